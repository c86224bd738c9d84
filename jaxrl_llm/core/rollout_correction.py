"""Rollout correction: importance weights and rejection masks between the policy that sampled
the tokens and the policy the loss is written for.

Three policies appear in an asynchronous or mismatched RL step (Hilton et al. 2021 name them):

* μ = π_behaviour: the policy that *sampled* the tokens. Its log-probs come from the rollout
  engine (its own kernels and numerics, possibly stale weights).
* π_prox = π_proximal (π_old): the anchor of the trust region, usually the trainer's own
  recomputed log-probs of the weights that generated (or the weights before this update).
* π_θ: the policy being optimised.

Everything here is a per-token array of the input's shape ``[..., T]`` (token axis last), f32,
computed under ``stop_gradient`` except where a loss says otherwise. With the target policy
π (π_prox, or sg(π_θ) when nothing is recomputed) the per-token log-ratio and weight are

    ℓ_t = log π(y_t) − log μ(y_t),        ρ_t = exp(clamp(ℓ_t, −20, 20))

and the sequence-level ones reduce ℓ over the valid tokens of each sequence y_i:

    geometric mean (reduction ``"mean"``):  ρ_i = exp( Σ_t m_t ℓ_t / max(|y_i|, 1) )
    product        (reduction ``"sum"``):   ρ_i = exp( Σ_t m_t ℓ_t )  = Π_t ρ_t

The reduction is the one detail where the peers differ (and where bugs hide: TRL #5814 summed
ratios where a mean was meant, giving a ratio mean of 0.57 at staleness 0). verl's
``rollout_is: sequence`` and TRL's ``sequence_*`` modes use the **product** (sum of
log-ratios); OpenRLHF's ``is_correction_level: seq`` gates on the **geometric mean**; GSPO and
AReaL's sequence-level PPO ratio are geometric means too. Padding never leaks: inputs are
zeroed under the mask before any arithmetic, every weight is exactly 0 on padding and every
keep-mask False there, so padded log-probs may be −inf or NaN.

Reference: F. Yao, L. Liu et al., "Your Efficient RL Framework Secretly Brings You Off-Policy
RL Training" (2025, https://fengyao.notion.site/off-policy-rl), TIS; J. Hilton, K. Cobbe,
J. Schulman, "Batch size-invariance for policy optimization", arXiv:2110.00641 (2021), the
decoupled objective; W. Fu et al., "AReaL: A Large-Scale Asynchronous Reinforcement Learning
System for Language Reasoning", arXiv:2505.24298 (2025); Ling Team, "Every Step Evolves:
Scaling Reinforcement Learning for Trillion-Scale Thinking Model" (Ring-1T, arXiv:2510.18855,
2025), IcePop; verl ``trainer/ppo/rollout_corr_helper.py`` (its ``SAFETY_BOUND = 20``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.core._contracts import check_bool, check_float, check_same_shape, f32
from jaxrl_llm.core.policy_losses import ppo_clip_loss

_sg = jax.lax.stop_gradient

LOG_RATIO_BOUND = 20.0  # verl's SAFETY_BOUND: exp(±20) keeps every weight finite

REDUCTIONS = ("mean", "sum")
LEVELS = ("token", "sequence")
MODES = ("tis", "mis", "icepop", "reject", "none")
ESTIMATORS = ("k1", "k2", "k3")
SEQUENCE_STATISTICS = ("sum", "mean", "max")


# --------------------------------------------------------------------------------------------
# Checks.


def _check_inputs(fn: str, floats: dict[str, chex.Array], mask_bgt: chex.Array) -> None:
    for name, x in floats.items():
        if not hasattr(x, "dtype"):
            raise TypeError(f"{fn}: argument `{name}` must be an array, got {type(x).__name__}")
        check_float(fn, name, x)
    check_bool(fn, "mask_bgt", mask_bgt)
    check_same_shape(fn, {**floats, "mask_bgt": mask_bgt})
    if mask_bgt.ndim < 1:
        raise ValueError(f"{fn}: argument `mask_bgt` must have rank >= 1 [..., T], got a scalar")


def _check_choice(fn: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(
            f"{fn}: argument `{name}` must be one of {', '.join(map(repr, choices))}, got {value!r}"
        )


def check_correction_bounds(
    fn: str, low: float | None, high: float | None, *, need_one: bool, ratio: bool = True
) -> None:
    """Bounds of a band ``[low, high]`` (None: open): finite, ``low < high`` when both are given,
    and for a band on ratios or weights (``ratio``) ``low ≥ 0`` and ``high > 0``;
    ``need_one``: at least one bound. Raises ``ValueError`` naming the function and the bound."""
    for name, value in (("low", low), ("high", high)):
        if value is not None and not (isinstance(value, int | float) and math.isfinite(value)):
            raise ValueError(
                f"{fn}: argument `{name}` must be a finite number or None, got {value!r}"
            )
    if ratio and low is not None and not low >= 0:
        raise ValueError(f"{fn}: argument `low` must be >= 0 (a ratio; None: open), got {low!r}")
    if ratio and high is not None and not high > 0:
        raise ValueError(f"{fn}: argument `high` must be > 0 (a ratio; None: open), got {high!r}")
    if low is not None and high is not None and not low < high:
        raise ValueError(
            f"{fn}: arguments `low` < `high` required, got low={low!r} and high={high!r}"
        )
    if need_one and low is None and high is None:
        raise ValueError(f"{fn}: give a bound, `low` or `high` (both are None)")


def _check_clamp(fn: str, log_clamp: float | None) -> None:
    if log_clamp is not None and not log_clamp > 0:
        raise ValueError(f"{fn}: argument `log_clamp` must be > 0 (or None), got {log_clamp!r}")


# --------------------------------------------------------------------------------------------
# Log-ratios, sequence reductions, weights.


def importance_log_ratio(
    logp_target_bgt: chex.Array, logp_behaviour_bgt: chex.Array, mask_bgt: chex.Array
) -> chex.Array:
    """Per-token ``ℓ_t = sg(log π(y_t) − log μ(y_t))``, exactly 0 on padding (f32).

    Args:
      logp_target_bgt: log π of the sampled tokens (π_prox, or π_θ: it is stop-gradiented).
      logp_behaviour_bgt: log μ of the same tokens (the sampler's), same shape ``[..., T]``.
      mask_bgt: bool, same shape; True on completion tokens.
    """
    _check_inputs(
        "importance_log_ratio",
        {"logp_target_bgt": logp_target_bgt, "logp_behaviour_bgt": logp_behaviour_bgt},
        mask_bgt,
    )
    target = jnp.where(mask_bgt, f32(logp_target_bgt), 0.0)
    behaviour = jnp.where(mask_bgt, f32(logp_behaviour_bgt), 0.0)
    return _sg(jnp.where(mask_bgt, target - behaviour, 0.0))


def sequence_statistic(x_bgt: chex.Array, mask_bgt: chex.Array, *, reduction: str) -> chex.Array:
    """A per-sequence reduction of ``x`` over the valid tokens, broadcast back to ``[..., T]``.

        ``"sum"``:  Σ_t m_t x_t          ``"mean"``:  Σ_t m_t x_t / max(|y|, 1)
        ``"max"``:  max_{t: m_t} x_t  (0 for a sequence without valid tokens, as verl)

    The value is the same at every token of a sequence; 0 on padding.
    """
    fn = "sequence_statistic"
    _check_inputs(fn, {"x_bgt": x_bgt}, mask_bgt)
    _check_choice(fn, "reduction", reduction, SEQUENCE_STATISTICS)
    x = jnp.where(mask_bgt, f32(x_bgt), 0.0)
    if reduction == "max":
        some = jnp.any(mask_bgt, axis=-1, keepdims=True)
        top = jnp.max(jnp.where(mask_bgt, x, -jnp.inf), axis=-1, keepdims=True)
        stat = jnp.where(some, top, 0.0)
    else:
        stat = jnp.sum(x, axis=-1, keepdims=True)
        if reduction == "mean":
            length = jnp.sum(mask_bgt, axis=-1, keepdims=True, dtype=jnp.int32)
            stat = stat / jnp.maximum(length, 1).astype(jnp.float32)
    return jnp.where(mask_bgt, stat, 0.0)


def _exp_clamped(log_w: chex.Array, log_clamp: float | None) -> chex.Array:
    if log_clamp is not None:
        log_w = jnp.clip(log_w, -log_clamp, log_clamp)
    return jnp.exp(log_w)


def token_importance_weights(
    logp_target_bgt: chex.Array,
    logp_behaviour_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    log_clamp: float | None = LOG_RATIO_BOUND,
) -> chex.Array:
    """Token-level importance weights ``ρ_t = exp(clamp(log π(y_t) − log μ(y_t), ±κ))``.

    No truncation (see :func:`truncate_weights`); a constant of any loss (stop-gradient). κ = 20 is
    verl's ``SAFETY_BOUND``; TRL and OpenRLHF do not clamp (identical below e^20).

    Args:
      logp_target_bgt, logp_behaviour_bgt, mask_bgt: as in :func:`importance_log_ratio`.
      log_clamp: κ > 0, or None for no clamp.

    Returns:
      f32 ``[..., T]``, exactly 0 on padding.
    """
    _check_clamp("token_importance_weights", log_clamp)
    lr = importance_log_ratio(logp_target_bgt, logp_behaviour_bgt, mask_bgt)
    return jnp.where(mask_bgt, _exp_clamped(lr, log_clamp), 0.0)


def sequence_importance_weights(
    logp_target_bgt: chex.Array,
    logp_behaviour_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    reduction: str = "mean",
    log_clamp: float | None = LOG_RATIO_BOUND,
) -> chex.Array:
    """Sequence-level importance weights, one value per sequence broadcast over its tokens.

        ``"mean"``:  ρ_i = exp(clamp(Σ_t m_t ℓ_t / max(|y_i|, 1), ±κ))   (geometric mean of ρ_t)
        ``"sum"``:   ρ_i = exp(clamp(Σ_t m_t ℓ_t, ±κ)) = Π_t ρ_t          (the product)

    The product is the unbiased sequence importance weight (verl ``rollout_is: sequence``,
    TRL ``vllm_importance_sampling_mode: sequence_*``); its variance grows exponentially with
    the length, so long completions are truncated or rejected almost surely. The geometric
    mean is length-normalised (biased, but of the scale of a token weight): OpenRLHF's
    ``is_correction_level: seq`` statistic, GSPO's ratio. A constant of any loss.

    Args:
      logp_target_bgt, logp_behaviour_bgt, mask_bgt: as in :func:`importance_log_ratio`.
      reduction: ``"mean"`` (geometric mean) or ``"sum"`` (product).
      log_clamp: κ > 0 on the *sequence* log-ratio (verl's), or None.

    Returns:
      f32 ``[..., T]``, the sequence's weight at each of its tokens, exactly 0 on padding.
    """
    fn = "sequence_importance_weights"
    _check_choice(fn, "reduction", reduction, REDUCTIONS)
    _check_clamp(fn, log_clamp)
    lr = importance_log_ratio(logp_target_bgt, logp_behaviour_bgt, mask_bgt)
    seq = sequence_statistic(lr, mask_bgt, reduction=reduction)
    return jnp.where(mask_bgt, _exp_clamped(seq, log_clamp), 0.0)


def truncate_weights(
    weight_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    low: float | None = None,
    high: float | None = None,
) -> chex.Array:
    """Truncated importance sampling (TIS): ``w̄ = clip(w, low, high)`` on valid tokens.

    ``high`` alone is the TIS of Yao et al. 2025 and verl (``min(ρ, C)``, C =
    ``rollout_is_threshold``); TRL's ``*_truncate`` modes clamp to ``[clip_min, clip_max]``;
    OpenRLHF's ``is_correction_mode: clip`` to ``[low, high]``. Truncation bounds the variance
    at the price of a bias (Ionides 2008, "Truncated importance sampling").

    Returns:
      f32, exactly 0 on padding.
    """
    fn = "truncate_weights"
    _check_inputs(fn, {"weight_bgt": weight_bgt}, mask_bgt)
    check_correction_bounds(fn, low, high, need_one=True)
    w = jnp.where(mask_bgt, f32(weight_bgt), 0.0)
    w = jnp.clip(w, low, high)
    return _sg(jnp.where(mask_bgt, w, 0.0))


def within_bounds(
    stat_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    low: float | None = None,
    high: float | None = None,
) -> chex.Array:
    """The keep-mask ``m_t ∧ (low ≤ s_t ≤ high)`` (both bounds inclusive; None is open; any
    finite bounds, so log-space or divergence statistics work too).

    Masked importance sampling (MIS, "icepop" at the token level) and rejection sampling drop
    the tokens (or, with a per-sequence statistic from :func:`sequence_statistic`, the whole
    sequences) whose statistic leaves the band. TRL, OpenRLHF and verl all keep the closed
    interval (TRL: ``ratio < min or ratio > max`` is dropped).

    Returns:
      bool of the input's shape, False on padding.
    """
    fn = "within_bounds"
    _check_inputs(fn, {"stat_bgt": stat_bgt}, mask_bgt)
    check_correction_bounds(fn, low, high, need_one=True, ratio=False)
    s = jnp.where(mask_bgt, f32(stat_bgt), 0.0)
    keep = mask_bgt
    if low is not None:
        keep = keep & (s >= low)
    if high is not None:
        keep = keep & (s <= high)
    return keep


def rejection_divergence(
    logp_target_bgt: chex.Array,
    logp_behaviour_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    estimator: str,
) -> chex.Array:
    """Per-token divergence estimates of the sampler from the target, verl's ``rollout_rs``
    statistics, with ``ℓ = clamp(log π − log μ, ±20)`` and ``ρ = e^ℓ``:

        k1 = −ℓ = log(μ/π)       k2 = ½ℓ²       k3 = ρ − 1 − ℓ

    (Schulman's estimators of KL(μ ‖ π) from tokens sampled under μ). verl rejects on
    ``token_k*`` per token and on ``seq_{sum,mean,max}_k*`` per sequence (compose with
    :func:`sequence_statistic` and :func:`within_bounds`). Note verl's k1 bounds: a
    ``rollout_rs_threshold`` of ``"lo_hi"`` keeps ``log lo ≤ k1 ≤ log hi``, i.e.
    ``μ/π ∈ [lo, hi]`` — the ratio of the *sampler* to the trainer, the inverse of the IS
    weight (the same band when lo = 1/hi, its default).

    Returns:
      f32, 0 on padding.
    """
    fn = "rejection_divergence"
    _check_choice(fn, "estimator", estimator, ESTIMATORS)
    lr = jnp.clip(importance_log_ratio(logp_target_bgt, logp_behaviour_bgt, mask_bgt), -20.0, 20.0)
    if estimator == "k1":
        d = -lr
    elif estimator == "k2":
        d = 0.5 * jnp.square(lr)
    else:
        d = jnp.expm1(lr) - lr
    return jnp.where(mask_bgt, d, 0.0)


class Correction(NamedTuple):
    """The outcome of :func:`correction_weights` (all ``[..., T]``, constants of the loss).

    Attributes:
      weight_bgt: f32 weights multiplying each token's policy-gradient term (0 on dropped
        tokens and on padding).
      keep_bgt: bool, the tokens that survive (False on dropped tokens and padding).
      ratio_bgt: f32 the raw token ratio ρ_t = π(y_t)/μ(y_t) (clamped at e^±20), 0 on padding:
        the diagnostic whose mean is 1 when π = μ.
    """

    weight_bgt: chex.Array
    keep_bgt: chex.Array
    ratio_bgt: chex.Array


def correction_weights(
    logp_target_bgt: chex.Array,
    logp_behaviour_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    mode: str,
    level: str = "token",
    reduction: str = "mean",
    low: float | None = None,
    high: float | None = None,
    token_weights: bool = False,
) -> Correction:
    """Importance weights and the keep-mask of one rollout-correction scheme.

    With ρ = the token ratio ρ_t (``level="token"``) or the sequence ratio ρ_i of
    :func:`sequence_importance_weights` (``level="sequence"``, ``reduction`` mean/sum):

      ``"tis"``     w = clip(ρ, low, high),  keep = m                 (truncated IS)
      ``"mis"``     keep = m ∧ low ≤ ρ ≤ high,  w = keep·ρ            (masked IS)
      ``"icepop"``  ``"mis"`` at the token level (IcePop, Ring-1T)
      ``"reject"``  keep = m ∧ low ≤ ρ ≤ high,  w = keep               (rejection, no weight)
      ``"none"``    w = m, keep = m                                    (diagnostics only)

    ``token_weights`` (``"mis"`` at the sequence level only): gate on the sequence statistic
    but weight the survivors by their own token ratios ρ_t — OpenRLHF's
    ``is_correction_level: seq`` with ``is_correction_mode: mask``.

    Which peer does which (fixtures in ``tests/fixtures/generate_rollout_corr.py``):
    verl ``rollout_is: token`` = tis/token (high only); ``rollout_is: sequence`` =
    tis/sequence/sum; TRL ``token_truncate`` / ``sequence_truncate`` = tis/token and
    tis/sequence/sum with [clip_min, clip_max], ``token_mask`` / ``sequence_mask`` = mis/token
    and mis/sequence/sum; OpenRLHF ``token``+``clip`` = tis/token [low, high], ``token``+
    ``mask`` = icepop, ``seq``+``mask`` = mis/sequence/mean with ``token_weights``.

    Args:
      logp_target_bgt: log π (π_prox, or π_θ under stop-gradient), ``[..., T]``.
      logp_behaviour_bgt: log μ (the sampler), same shape.
      mask_bgt: bool, same shape.
      mode, level, reduction: as above.
      low, high: the bounds (None: open); ``"tis"``, ``"mis"``, ``"icepop"`` and ``"reject"``
        need at least one, ``"none"`` takes none.
      token_weights: see above.

    Returns:
      A :class:`Correction`.
    """
    fn = "correction_weights"
    _check_choice(fn, "mode", mode, MODES)
    _check_choice(fn, "level", level, LEVELS)
    _check_choice(fn, "reduction", reduction, REDUCTIONS)
    if mode == "none":
        if low is not None or high is not None:
            raise ValueError(f"{fn}: mode 'none' takes no bounds, got low={low!r}, high={high!r}")
    else:
        check_correction_bounds(fn, low, high, need_one=True)
    if mode == "icepop" and level != "token":
        raise ValueError(f"{fn}: mode 'icepop' is token-level masking; got level={level!r}")
    if token_weights and not (mode == "mis" and level == "sequence"):
        raise ValueError(
            f"{fn}: `token_weights` applies to mode 'mis' at level 'sequence' only, got "
            f"mode={mode!r}, level={level!r}"
        )
    ratio = token_importance_weights(logp_target_bgt, logp_behaviour_bgt, mask_bgt)
    if level == "token":
        rho = ratio
    else:
        rho = sequence_importance_weights(
            logp_target_bgt, logp_behaviour_bgt, mask_bgt, reduction=reduction
        )
    if mode == "none":
        return Correction(mask_bgt.astype(jnp.float32), mask_bgt, ratio)
    if mode == "tis":
        return Correction(truncate_weights(rho, mask_bgt, low=low, high=high), mask_bgt, ratio)
    keep = within_bounds(rho, mask_bgt, low=low, high=high)
    if mode == "reject":
        return Correction(keep.astype(jnp.float32), keep, ratio)
    survivor = ratio if token_weights else rho
    return Correction(jnp.where(keep, survivor, 0.0), keep, ratio)


def correction_metrics(
    correction: Correction, mask_bgt: chex.Array
) -> dict[str, tuple[chex.Array, chex.Array]]:
    """Diagnostics of a correction as additive ``(sum, denominator)`` pairs over N = Σ m:

    ``is_weight_mean``   (Σ m·w, N)
    ``is_weight_max``    (max_{m} w, 1): with several micro-batches the trainer averages the
                         micro-batch maxima (exactly the max with one micro-batch)
    ``masked_fraction``  (Σ m·[¬keep], N): tokens the correction dropped
    ``ratio_mean``       (Σ m·ρ_t, N): the raw token ratio π/μ; 1 at staleness 0 when the
                         trainer and the sampler agree (TRL #5814 reported 0.57 there)
    """
    check_bool("correction_metrics", "mask_bgt", mask_bgt)
    n = jnp.sum(mask_bgt, dtype=jnp.int32).astype(jnp.float32)
    w = _sg(jnp.where(mask_bgt, correction.weight_bgt, 0.0))
    ratio = _sg(jnp.where(mask_bgt, correction.ratio_bgt, 0.0))
    dropped = (mask_bgt & ~correction.keep_bgt).astype(jnp.float32)
    w_max = jnp.max(jnp.where(mask_bgt, w, 0.0)) if w.size else jnp.zeros((), jnp.float32)
    return {
        "is_weight_mean": (jnp.sum(w), n),
        "is_weight_max": (w_max, jnp.ones((), jnp.float32)),
        "masked_fraction": (jnp.sum(dropped), n),
        "ratio_mean": (jnp.sum(ratio), n),
    }


# --------------------------------------------------------------------------------------------
# Losses with a behaviour policy.


def decoupled_ppo_loss(
    logp_bgt: chex.Array,
    logp_prox_bgt: chex.Array,
    logp_behaviour_bgt: chex.Array,
    adv_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    log_ratio_clamp: float | None = None,
    behaviour_weight_cap: float | None = None,
    cap_mode: str = "mask",
) -> chex.Array:
    """The decoupled three-policy PPO loss per token.

        r_t = exp(logπ_θ − sg(logπ_prox))                           (the trust region's ratio)
        w_t = sg(π_prox(y_t)/μ(y_t))                                (the behaviour correction)
        cap C:  ``"mask"``: w_t ← w_t·[w_t ≤ C]  (AReaL ``behav_imp_weight_cap``)
                ``"truncate"``: w_t ← min(w_t, C)  (verl/TRL TIS on π_prox/μ)
        ℓ_t = w_t · max(−A_t r_t, −A_t clip(r_t, 1 − ε_low, 1 + ε_high))
        dual clip (A < 0):  max(...) ← min(max(...), −c·A_t)  before the weight

    The clip is relative to π_prox, not to the behaviour policy: the trust region is about how
    far *this update* moves, which the staleness of the data does not change, and the
    off-policy shift μ → π_prox is corrected by the weight instead (Hilton et al. 2021, §3:
    "decoupling the proximal policy from the behavior policy"). With π_prox = μ it is PPO;
    ∂ℓ/∂logπ_θ = −w·A at r = 1. verl's decoupled mode (``bypass_mode: false``) multiplies its
    PPO loss by ``rollout_is_weights`` = trunc(π_old/μ) in the same way.

    References: J. Hilton, K. Cobbe, J. Schulman, "Batch size-invariance for policy
    optimization", arXiv:2110.00641 (2021); W. Fu et al., "AReaL", arXiv:2505.24298 (2025),
    ``ppo_actor_loss_fn``.

    Args:
      logp_bgt: log π_θ of the sampled tokens ``[..., T]`` (differentiated).
      logp_prox_bgt: log π_prox, the proximal (recomputed old) policy, same shape.
      logp_behaviour_bgt: log μ, the sampler's, same shape.
      adv_bgt: advantages, same shape (constants).
      mask_bgt: bool, same shape.
      clip_low, clip_high: ε_low, ε_high ≥ 0.
      dual_clip: c > 1, or None.
      log_ratio_clamp: κ > 0 on log r_t (verl 20), or None.
      behaviour_weight_cap: C > 0, or None (no cap).
      cap_mode: ``"mask"`` or ``"truncate"``.

    Returns:
      f32 per-token loss, exactly 0 where ``mask_bgt`` is False.
    """
    fn = "decoupled_ppo_loss"
    _check_inputs(
        fn,
        {
            "logp_bgt": logp_bgt,
            "logp_prox_bgt": logp_prox_bgt,
            "logp_behaviour_bgt": logp_behaviour_bgt,
            "adv_bgt": adv_bgt,
        },
        mask_bgt,
    )
    _check_choice(fn, "cap_mode", cap_mode, ("mask", "truncate"))
    if behaviour_weight_cap is not None and not behaviour_weight_cap > 0:
        raise ValueError(
            f"{fn}: argument `behaviour_weight_cap` must be > 0 (or None), got "
            f"{behaviour_weight_cap!r}"
        )
    w = token_importance_weights(logp_prox_bgt, logp_behaviour_bgt, mask_bgt)
    if behaviour_weight_cap is not None:
        if cap_mode == "mask":
            w = jnp.where(w <= behaviour_weight_cap, w, 0.0)
        else:
            w = jnp.minimum(w, behaviour_weight_cap)
    ppo = ppo_clip_loss(
        logp_bgt,
        logp_prox_bgt,
        adv_bgt,
        mask_bgt,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        log_ratio_clamp=log_ratio_clamp,
    )
    return jnp.where(mask_bgt, _sg(w) * ppo, 0.0)


def weighted_reinforce_loss(
    logp_bgt: chex.Array, weight_bgt: chex.Array, adv_bgt: chex.Array, mask_bgt: chex.Array
) -> chex.Array:
    """REINFORCE with importance weights: ``ℓ_t = −sg(w_t)·A_t·log π_θ(y_t)``.

    verl's bypass mode with ``loss_type: reinforce`` (``compute_policy_loss_reinforce``):
    π_old is the sampler μ (no recompute), w = trunc(sg(π_θ)/μ) (and the rejection mask in
    ``mask_bgt``), so ∇ = E_μ[w·A·∇log π_θ], the truncated-IS policy gradient. This trainer's
    ``old_logprobs.source: sampler`` path is the same estimator for every recipe: π_old :=
    sg(π_θ) (the ratio is 1) and A ← w·A. verl's bypass ``ppo_clip`` instead takes μ as π_old in
    PPO's ratio (the clip bounds π_θ/μ) and applies no weight — ``ppo_clip_loss(logp,
    logp_behaviour, ...)`` on the kept tokens.

    Returns:
      f32 per-token loss, exactly 0 where ``mask_bgt`` is False.
    """
    fn = "weighted_reinforce_loss"
    _check_inputs(
        fn, {"logp_bgt": logp_bgt, "weight_bgt": weight_bgt, "adv_bgt": adv_bgt}, mask_bgt
    )
    logp = jnp.where(mask_bgt, f32(logp_bgt), 0.0)
    w = _sg(jnp.where(mask_bgt, f32(weight_bgt), 0.0))
    adv = _sg(jnp.where(mask_bgt, f32(adv_bgt), 0.0))
    return jnp.where(mask_bgt, -w * adv * logp, 0.0)


__all__ = [
    "ESTIMATORS",
    "LEVELS",
    "LOG_RATIO_BOUND",
    "MODES",
    "REDUCTIONS",
    "SEQUENCE_STATISTICS",
    "Correction",
    "check_correction_bounds",
    "correction_metrics",
    "correction_weights",
    "decoupled_ppo_loss",
    "importance_log_ratio",
    "rejection_divergence",
    "sequence_importance_weights",
    "sequence_statistic",
    "token_importance_weights",
    "truncate_weights",
    "weighted_reinforce_loss",
    "within_bounds",
]
