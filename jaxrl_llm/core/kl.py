"""Per-token KL estimators, KL-in-reward shaping and KL coefficient controllers.

With Δ = log π(y_t) − log π_ref(y_t) for tokens sampled from π, each estimator k(Δ) has
E_π[k] ≈ KL(π ‖ π_ref) (Schulman 2020, "Approximating KL Divergence",
http://joschu.net/blog/kl-approx.html):

    k1 = Δ                    unbiased, high variance, can be negative
    abs = |Δ|                 (verl "abs")
    k2 = ½Δ²                  biased, low variance, ≥ 0; ∂k2/∂log π = Δ
    k3 = e^{−Δ} − 1 + Δ       unbiased, low variance, ≥ 0 (verl "low_var_kl", TRL GRPO)

The straight-through "+" variants (verl ``k1+``, ``k3+``) have the value of k1/k3 and the
gradient of k2, ``k2 − sg(k2) + sg(k)``, so the gradient is ∂/∂log π = Δ (an unbiased estimate
of ∇KL when used as a loss), see verl #6058.

Estimators are elementwise and take no mask: mask their outputs (``kl_in_reward``, or an
aggregation). All math is f32; bf16 inputs are upcast first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.core import _contracts, masked

# ----------------------------------------------------------------------------------------------
# Estimators
# ----------------------------------------------------------------------------------------------


def _estimate(
    fn: str,
    of_log_ratio: Callable[[chex.Array], chex.Array],
    logp: chex.Array,
    logp_ref: chex.Array,
    log_ratio_clamp: float | None,
    value_clamp: float | None,
    straight_through: bool = False,
) -> chex.Array:
    """Checks, Δ in f32, the optional clamps, and the optional straight-through gradient."""
    _contracts.check_float(fn, "logp", logp)
    _contracts.check_float(fn, "logp_ref", logp_ref)
    _contracts.check_same_shape(fn, {"logp": logp, "logp_ref": logp_ref})
    delta = _contracts.f32(logp) - _contracts.f32(logp_ref)
    clamped = delta
    if log_ratio_clamp is not None:
        _contracts.check_positive(fn, "log_ratio_clamp", log_ratio_clamp)
        clamped = jnp.clip(delta, -log_ratio_clamp, log_ratio_clamp)
    value = of_log_ratio(clamped)
    if value_clamp is not None:
        _contracts.check_positive(fn, "value_clamp", value_clamp)
        value = jnp.clip(value, -value_clamp, value_clamp)
    if straight_through:
        # Value of the estimator, gradient of ½Δ² (unclamped, as in verl): k2 − sg(k2) + sg(k).
        k2 = _k2(delta)
        value = k2 - jax.lax.stop_gradient(k2) + jax.lax.stop_gradient(value)
    return value


def _k1(delta: chex.Array) -> chex.Array:
    return delta


def _k2(delta: chex.Array) -> chex.Array:
    return 0.5 * jnp.square(delta)


def _k3(delta: chex.Array) -> chex.Array:
    return jnp.expm1(-delta) + delta


def kl_k1(
    logp: chex.Array,
    logp_ref: chex.Array,
    *,
    log_ratio_clamp: float | None = None,
    value_clamp: float | None = None,
) -> chex.Array:
    """k1 = Δ = log π − log π_ref (Schulman 2020; verl/TRL "kl", OpenRLHF default).

    Args:
      logp: float log-probs of the sampled tokens under the policy, any shape.
      logp_ref: float log-probs under the reference policy, same shape.
      log_ratio_clamp: if set to c > 0, Δ is clipped to [−c, c] before the estimator.
      value_clamp: if set to v > 0, the estimate is clipped to [−v, v] (OpenRLHF: 10).

    Returns:
      f32 array of ``logp``'s shape.
    """
    return _estimate("kl_k1", _k1, logp, logp_ref, log_ratio_clamp, value_clamp)


def kl_abs(
    logp: chex.Array,
    logp_ref: chex.Array,
    *,
    log_ratio_clamp: float | None = None,
    value_clamp: float | None = None,
) -> chex.Array:
    """|Δ| = |log π − log π_ref| (verl "abs"). Arguments as in ``kl_k1``."""
    return _estimate("kl_abs", jnp.abs, logp, logp_ref, log_ratio_clamp, value_clamp)


def kl_k2(
    logp: chex.Array,
    logp_ref: chex.Array,
    *,
    log_ratio_clamp: float | None = None,
    value_clamp: float | None = None,
) -> chex.Array:
    """k2 = ½Δ² (Schulman 2020; verl "mse"); its gradient w.r.t. log π is Δ.

    Arguments as in ``kl_k1``.
    """
    return _estimate("kl_k2", _k2, logp, logp_ref, log_ratio_clamp, value_clamp)


def kl_k3(
    logp: chex.Array,
    logp_ref: chex.Array,
    *,
    log_ratio_clamp: float | None = None,
    value_clamp: float | None = None,
) -> chex.Array:
    """k3 = e^{−Δ} − 1 + Δ ≥ 0 (Schulman 2020; verl "low_var_kl", TRL GRPO's per-token KL).

    verl: ``log_ratio_clamp=20`` (Δ clipped to [−20, 20], in both the exp and the linear
    term) and ``value_clamp=10``; OpenRLHF: ``value_clamp=10``; TRL: no clamp.
    Golden (verl): log π = (−1, −2), log π_ref = (−1.5, −1) → (0.1065, 0.7183), gradient
    1 − e^{−Δ} = (0.3935, −1.7183).

    Arguments as in ``kl_k1``.
    """
    return _estimate("kl_k3", _k3, logp, logp_ref, log_ratio_clamp, value_clamp)


def kl_k1_st(
    logp: chex.Array,
    logp_ref: chex.Array,
    *,
    log_ratio_clamp: float | None = None,
    value_clamp: float | None = None,
) -> chex.Array:
    """Straight-through k1 (verl "k1+"): value of ``kl_k1``, gradient of ½Δ² (= Δ).

    The gradient uses the unclamped Δ (clamps act on the value only), as in verl.
    Arguments as in ``kl_k1``.
    """
    return _estimate("kl_k1_st", _k1, logp, logp_ref, log_ratio_clamp, value_clamp, True)


def kl_k3_st(
    logp: chex.Array,
    logp_ref: chex.Array,
    *,
    log_ratio_clamp: float | None = None,
    value_clamp: float | None = None,
) -> chex.Array:
    """Straight-through k3 (verl "k3+", "low_var_kl+"): value of ``kl_k3``, gradient Δ.

    Golden (verl): log π = (−1, −2), log π_ref = (−1.5, −1) → gradient (0.5, −1.0).
    The gradient uses the unclamped Δ. Arguments as in ``kl_k1``.
    """
    return _estimate("kl_k3_st", _k3, logp, logp_ref, log_ratio_clamp, value_clamp, True)


# ----------------------------------------------------------------------------------------------
# Placement
# ----------------------------------------------------------------------------------------------


def kl_in_reward(
    reward_bgt: chex.Array,
    kl_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    beta: float | chex.Array,
) -> chex.Array:
    """Folds a per-token KL penalty into the token rewards: r'_t = r_t − β·kl_t on valid tokens.

        out = where(m, r − β·kl, 0)

    The reward-side KL of Ziegler et al. 2019 (arXiv:1909.08593), verl
    ``use_kl_in_reward``, OpenRLHF's default and TRL PPO. KL values under the mask (possibly
    NaN from −inf padded log-probs) are never read.

    Args:
      reward_bgt: float ``[..., T]`` token rewards (e.g. the score on the last token).
      kl_bgt: float per-token KL estimate, same shape (β-free, e.g. ``kl_k1(logp_old, ref)``).
      mask_bgt: ``bool``, same shape.
      beta: KL coefficient β ≥ 0, a Python float or a traced f32 scalar (adaptive controller).

    Returns:
      f32 ``[..., T]``, 0 under the mask.
    """
    fn = "kl_in_reward"
    _contracts.check_float(fn, "reward_bgt", reward_bgt)
    _contracts.check_float(fn, "kl_bgt", kl_bgt)
    _contracts.check_bool(fn, "mask_bgt", mask_bgt)
    _contracts.check_same_shape(
        fn, {"reward_bgt": reward_bgt, "kl_bgt": kl_bgt, "mask_bgt": mask_bgt}
    )
    if isinstance(beta, int | float):
        _contracts.check_positive(fn, "beta", beta, allow_zero=True)
    else:
        _contracts.check_rank(fn, "beta", beta, 0, "(scalar)")
    shaped = _contracts.f32(reward_bgt) - _contracts.f32(beta) * _contracts.f32(kl_bgt)
    return jnp.where(mask_bgt, shaped, 0.0)


def mean_sequence_kl(
    kl_bgt: chex.Array, mask_bgt: chex.Array, *, axis_name: str | None = None
) -> chex.Array:
    """Observed KL for a controller: mean over sequences of each sequence's masked token mean.

        KL = (1/|S|) Σ_{i∈S} (Σ_t m_it·kl_it / |y_i|),   S = {i : |y_i| > 0}

    verl's ``current_kl``. Sequences with no valid token are left out of the mean (verl counts
    them as 0, which only matters when a batch contains empty rows); an all-empty batch gives 0.

    Args:
      kl_bgt: float ``[..., T]`` per-token KL (β-free).
      mask_bgt: ``bool``, same shape.
      axis_name: if given, the sums over sequences are ``psum``-ed over this ``shard_map`` axis.

    Returns:
      f32 scalar.
    """
    fn = "mean_sequence_kl"
    _contracts.check_float(fn, "kl_bgt", kl_bgt)
    _contracts.check_bool(fn, "mask_bgt", mask_bgt)
    _contracts.check_same_shape(fn, {"kl_bgt": kl_bgt, "mask_bgt": mask_bgt})
    if kl_bgt.ndim < 1:
        raise ValueError(f"{fn}: argument `kl_bgt` must have rank >= 1 [..., T], got a scalar")
    seq_kl = masked.masked_mean(kl_bgt, mask_bgt, axis=-1)
    nonempty = jnp.any(mask_bgt, axis=-1)
    return masked.masked_mean(seq_kl, nonempty, axis_name=axis_name)


# ----------------------------------------------------------------------------------------------
# Controllers (optax-shaped: a NamedTuple of pure functions, all state in the returned pytree)
# ----------------------------------------------------------------------------------------------


class KLControllerState(NamedTuple):
    """State of a KL controller: the current coefficient β (f32 scalar)."""

    beta: chex.Array


class KLController(NamedTuple):
    """``init() -> state`` and ``update(state, observed_kl, n_steps) -> state``."""

    init: Callable[[], KLControllerState]
    update: Callable[[KLControllerState, chex.Array, chex.Numeric], KLControllerState]


def fixed_kl_controller(beta: float) -> KLController:
    """A constant β (verl ``kl_ctrl.type="fixed"``, default 0.001; OpenRLHF 0.01).

    Args:
      beta: the coefficient, ≥ 0.
    """
    _contracts.check_positive("fixed_kl_controller", "beta", beta, allow_zero=True)

    def init() -> KLControllerState:
        return KLControllerState(beta=jnp.asarray(beta, jnp.float32))

    def update(
        state: KLControllerState, observed_kl: chex.Array, n_steps: chex.Numeric
    ) -> KLControllerState:
        del observed_kl, n_steps
        return state

    return KLController(init=init, update=update)


def adaptive_kl_controller(init_beta: float, *, target: float, horizon: float) -> KLController:
    """Proportional controller that steers the observed KL towards ``target``.

    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", arXiv:1909.08593:

        e = clip(KL / target − 1, −0.2, 0.2)
        β ← β · (1 + e · n_steps / horizon)

    ``n_steps`` is the number of sequences in the batch (verl) or rollout_batch_size ×
    n_samples (OpenRLHF); KL is e.g. ``mean_sequence_kl``. verl defaults: target 0.1, horizon
    10000. Golden: β = 0.001, KL = 0.3, n_steps = 256 → 0.00100512.

    Args:
      init_beta: initial β ≥ 0.
      target: target KL > 0.
      horizon: > 0, the number of steps over which a maximal error changes β by 20%.
    """
    fn = "adaptive_kl_controller"
    _contracts.check_positive(fn, "init_beta", init_beta, allow_zero=True)
    _contracts.check_positive(fn, "target", target)
    _contracts.check_positive(fn, "horizon", horizon)

    def init() -> KLControllerState:
        return KLControllerState(beta=jnp.asarray(init_beta, jnp.float32))

    def update(
        state: KLControllerState, observed_kl: chex.Array, n_steps: chex.Numeric
    ) -> KLControllerState:
        error = jnp.clip(_contracts.f32(observed_kl) / target - 1.0, -0.2, 0.2)
        factor = 1.0 + error * _contracts.f32(n_steps) / horizon
        return KLControllerState(beta=state.beta * factor)

    return KLController(init=init, update=update)
