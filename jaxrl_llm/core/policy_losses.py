"""Per-token policy-gradient and value losses.

Every loss maps per-token inputs of one common shape (usually ``[B, G, T]``: B prompts, G
completions per prompt, T completion tokens; any shape works, and GSPO needs the token axis
last) to a per-token loss ``f32`` of that same shape. The per-token losses are then reduced by
:mod:`jaxrl_llm.core.aggregation`, which returns ``(sum, denominator)`` pairs so that
micro-batches and data-parallel shards add up to exactly the whole-batch loss.

Conventions shared by every function:

* r = exp(logπ_θ − logπ_old) is the per-token importance ratio of the current policy to the
  policy that sampled the tokens (GSPO replaces it by a per-sequence ratio).
* Inputs are upcast to float32; bf16 in gives f32 out.
* Padding never leaks. Every input is replaced by 0 under the mask *before* any arithmetic (the
  first ``where`` of the "double where"), and the loss is set to exactly 0 under the mask after
  (the second). Padded log-probs may therefore be −inf and padded advantages NaN without
  producing NaN in the loss or in its gradient; masked positions get exactly zero gradient.
* Advantages, old log-probs, old values and returns are constants of the loss: they are wrapped
  in ``jax.lax.stop_gradient`` (as in rlax), so only ``logp`` (or ``value``) is differentiated.
* Hyperparameters are keyword-only Python scalars, checked at trace time.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.core._contracts import (
    check_bool,
    check_float,
    check_positive,
    check_same_shape,
    f32,
)

_sg = jax.lax.stop_gradient


def _check_token_inputs(
    fn: str, floats: dict[str, chex.Array], mask_name: str, mask: chex.Array
) -> None:
    for name, x in floats.items():
        if not hasattr(x, "dtype"):
            raise TypeError(f"{fn}: argument `{name}` must be an array, got {type(x).__name__}")
        check_float(fn, name, x)
    check_bool(fn, mask_name, mask)
    check_same_shape(fn, {**floats, mask_name: mask})


def _check_token_axis(fn: str, name: str, x: chex.Array) -> None:
    if x.ndim < 1:
        raise ValueError(f"{fn}: argument `{name}` must have rank >= 1 [..., T], got a scalar")


def _check_greater(fn: str, name: str, value: float, bound: float) -> None:
    if not value > bound:
        raise ValueError(f"{fn}: argument `{name}` must be > {bound}, got {value!r}")


def _masked_f32(mask: chex.Array, *xs: chex.Array) -> tuple[chex.Array, ...]:
    """First half of the double where: f32 inputs with 0 (never −inf/NaN) under the mask."""
    return tuple(jnp.where(mask, f32(x), 0.0) for x in xs)


def _log_ratio(logp: chex.Array, logp_old: chex.Array, clamp: float | None) -> chex.Array:
    log_ratio = logp - _sg(logp_old)
    if clamp is not None:
        log_ratio = jnp.clip(log_ratio, -clamp, clamp)
    return log_ratio


def _clipped_surrogate(
    ratio: chex.Array, adv: chex.Array, clip_low: float, clip_high: float
) -> chex.Array:
    """max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)): PPO's pessimistic bound."""
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return jnp.maximum(unclipped, clipped)


def reinforce_loss(logp_bgt: chex.Array, adv_bgt: chex.Array, mask_bgt: chex.Array) -> chex.Array:
    """REINFORCE (score-function) surrogate loss per token.

        ℓ_t = −A_t · log π_θ(y_t),   so   ∂ℓ_t/∂logπ_θ(y_t) = −A_t.

    No ratio and no clipping: this is the on-policy policy gradient (verl's ``gpg`` loss).

    Reference: R. J. Williams, "Simple statistical gradient-following algorithms for
    connectionist reinforcement learning", Machine Learning 8, 1992.

    Args:
      logp_bgt: log π_θ of the sampled tokens, float, any shape (e.g. ``[B, G, T]``).
      adv_bgt: advantages A_t, float, same shape (treated as constants).
      mask_bgt: bool, same shape; True on completion tokens that carry loss.

    Returns:
      f32 per-token loss of the same shape, exactly 0 where ``mask_bgt`` is False.
    """
    fn = "reinforce_loss"
    _check_token_inputs(fn, {"logp_bgt": logp_bgt, "adv_bgt": adv_bgt}, "mask_bgt", mask_bgt)
    logp, adv = _masked_f32(mask_bgt, logp_bgt, adv_bgt)
    return jnp.where(mask_bgt, -_sg(adv) * logp, 0.0)


def ppo_clip_loss(
    logp_bgt: chex.Array,
    logp_old_bgt: chex.Array,
    adv_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    log_ratio_clamp: float | None = None,
) -> chex.Array:
    """PPO clipped surrogate loss per token, with clip-higher and optional dual clip.

        r_t = exp(clamp(logπ_θ − logπ_old, −κ, κ))            (clamp only if κ is given)
        ℓ_t = max(−A_t·r_t, −A_t·clip(r_t, 1 − ε_low, 1 + ε_high))
        dual clip, for A_t < 0 only:  ℓ_t ← min(ℓ_t, −c·A_t)   (c > 1)

    At r = 1 the gradient is ∂ℓ/∂logπ_θ = −A. Tokens whose ratio has left the trust region in
    the direction the advantage pushes (r > 1+ε_high with A > 0, r < 1−ε_low with A < 0) get zero
    gradient, and so do tokens capped by the dual clip (A < 0 and r > c): the dual clip bounds the
    loss of a negative-advantage token by c·|A| however large its ratio.

    References: J. Schulman, F. Wolski, P. Dhariwal, A. Radford, O. Klimov, "Proximal Policy
    Optimization Algorithms", arXiv:1707.06347 (2017). Dual clip: D. Ye et al., "Mastering
    Complex Control in MOBA Games with Deep Reinforcement Learning", arXiv:1912.09729 (2020).
    Decoupled ε_low/ε_high ("clip-higher"): Q. Yu et al., "DAPO: An Open-Source LLM
    Reinforcement Learning System at Scale", arXiv:2503.14476 (2025).

    Peer defaults: verl ε = 0.2/0.2, dual clip c = 3 always on, κ = 20; DAPO ε_high = 0.28;
    OpenRLHF dual clip off, κ = 20; TRL no dual clip, no clamp.

    Args:
      logp_bgt: log π_θ of the sampled tokens, float, any shape (e.g. ``[B, G, T]``).
      logp_old_bgt: log π_old of the same tokens (the sampling policy), same shape.
      adv_bgt: advantages A_t, same shape (treated as constants).
      mask_bgt: bool, same shape; True on completion tokens that carry loss.
      clip_low: ε_low ≥ 0, the lower clip is 1 − ε_low.
      clip_high: ε_high ≥ 0, the upper clip is 1 + ε_high.
      dual_clip: c > 1 to cap the loss of negative-advantage tokens, or None (off).
      log_ratio_clamp: κ > 0 to clamp the log-ratio to [−κ, κ] before the exp (keeps r finite
        when the two policies disagree wildly), or None (no clamp).

    Returns:
      f32 per-token loss of the same shape, exactly 0 where ``mask_bgt`` is False.
    """
    fn = "ppo_clip_loss"
    _check_token_inputs(
        fn,
        {"logp_bgt": logp_bgt, "logp_old_bgt": logp_old_bgt, "adv_bgt": adv_bgt},
        "mask_bgt",
        mask_bgt,
    )
    check_positive(fn, "clip_low", clip_low, allow_zero=True)
    check_positive(fn, "clip_high", clip_high, allow_zero=True)
    if dual_clip is not None:
        _check_greater(fn, "dual_clip", dual_clip, 1.0)
    if log_ratio_clamp is not None:
        check_positive(fn, "log_ratio_clamp", log_ratio_clamp)

    logp, logp_old, adv = _masked_f32(mask_bgt, logp_bgt, logp_old_bgt, adv_bgt)
    adv = _sg(adv)
    ratio = jnp.exp(_log_ratio(logp, logp_old, log_ratio_clamp))
    loss = _clipped_surrogate(ratio, adv, clip_low, clip_high)
    if dual_clip is not None:
        loss = jnp.where(adv < 0.0, jnp.minimum(loss, -dual_clip * adv), loss)
    return jnp.where(mask_bgt, loss, 0.0)


def ratio_metrics(
    logp_bgt: chex.Array,
    logp_old_bgt: chex.Array,
    adv_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    log_ratio_clamp: float | None = None,
) -> dict[str, tuple[chex.Array, chex.Array]]:
    """Token-mean diagnostics of the importance ratio, as additive ``(sum, denominator)`` pairs.

    With r_t as in :func:`ppo_clip_loss` and N = Σ mask, every entry is (Σ_t m_t·x_t, N) for:

      ``clip_fraction_low``   x = [A < 0 and r < 1 − ε_low]   (the lower clip is active)
      ``clip_fraction_high``  x = [A > 0 and r > 1 + ε_high]  (the upper clip is active)
      ``clip_fraction``       the sum of the two: tokens whose gradient the clip removed
                              (verl's ``pg_clipfrac``)
      ``dual_clip_fraction``  x = [A < 0 and r > c] (0 when ``dual_clip`` is None)
      ``ratio_mean``          x = r
      ``approx_kl``           x = (r − 1) − log r, Schulman's k3 estimate of KL(π_old ‖ π_θ)
                              from tokens sampled under π_old (≥ 0)

    The pairs add over micro-batches and shards; ``aggregation.finalize`` turns one into a
    number. Everything is computed under ``stop_gradient``. Arguments as in
    :func:`ppo_clip_loss`.

    Reference: J. Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html
    (2020).
    """
    fn = "ratio_metrics"
    _check_token_inputs(
        fn,
        {"logp_bgt": logp_bgt, "logp_old_bgt": logp_old_bgt, "adv_bgt": adv_bgt},
        "mask_bgt",
        mask_bgt,
    )
    check_positive(fn, "clip_low", clip_low, allow_zero=True)
    check_positive(fn, "clip_high", clip_high, allow_zero=True)
    if dual_clip is not None:
        _check_greater(fn, "dual_clip", dual_clip, 1.0)
    if log_ratio_clamp is not None:
        check_positive(fn, "log_ratio_clamp", log_ratio_clamp)

    logp, logp_old, adv = _sg(_masked_f32(mask_bgt, logp_bgt, logp_old_bgt, adv_bgt))
    log_ratio = _log_ratio(logp, logp_old, log_ratio_clamp)
    ratio = jnp.exp(log_ratio)
    low = (adv < 0.0) & (ratio < 1.0 - clip_low)
    high = (adv > 0.0) & (ratio > 1.0 + clip_high)
    dual = (adv < 0.0) & (ratio > dual_clip) if dual_clip is not None else jnp.zeros_like(low)
    count = jnp.sum(mask_bgt, dtype=jnp.int32).astype(jnp.float32)

    def pair(x: chex.Array) -> tuple[chex.Array, chex.Array]:
        return jnp.sum(jnp.where(mask_bgt, f32(x), 0.0)), count

    return {
        "clip_fraction_low": pair(low),
        "clip_fraction_high": pair(high),
        "clip_fraction": pair(low | high),
        "dual_clip_fraction": pair(dual),
        "ratio_mean": pair(ratio),
        "approx_kl": pair(jnp.expm1(log_ratio) - log_ratio),
    }


def gspo_loss(
    logp_bgt: chex.Array,
    logp_old_bgt: chex.Array,
    adv_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    clip_low: float,
    clip_high: float,
    log_ratio_clamp: float | None = 10.0,
) -> chex.Array:
    """GSPO: PPO clipping on the length-normalised sequence ratio ("GSPO-token" form).

        s_i = exp( Σ_t m_t (logπ_θ − logπ_old) / max(|y_i|, 1) )       (one ratio per sequence)
        log r_t = logπ_θ(y_t) − sg(logπ_θ(y_t)) + sg(log s_i),  then  min(log r_t, κ)
        ℓ_t = max(−A_t·r_t, −A_t·clip(r_t, 1 − ε_low, 1 + ε_high))

    r_t has the *value* of the sequence ratio s_i at every token and the *gradient*
    ∂r_t/∂logπ_θ(y_t) = s_i, so with one advantage per sequence and ``seq_mean_token_mean``
    aggregation the gradient is exactly the paper's sequence-level GSPO gradient
    s_i·A_i·(1/|y_i|)·Σ_t ∇logπ_θ(y_t). Use it with that aggregation (verl forces it). No dual
    clip. The paper's ε are tiny (3e-4 / 4e-4) because s_i is a geometric mean.

    Reference: C. Zheng et al., "Group Sequence Policy Optimization", arXiv:2507.18071 (2025).
    The κ = 10 upper clamp on the log-ratio is verl's.

    Args:
      logp_bgt: log π_θ of the sampled tokens, float ``[..., T]`` (token axis last).
      logp_old_bgt: log π_old of the same tokens, same shape.
      adv_bgt: per-token advantages (usually one value per sequence), same shape.
      mask_bgt: bool, same shape; True on completion tokens. Sequences with no valid token get
        s_i = 1 and zero loss.
      clip_low, clip_high: ε_low, ε_high ≥ 0.
      log_ratio_clamp: κ > 0, upper clamp on log r_t, or None.

    Returns:
      f32 per-token loss of the same shape, exactly 0 where ``mask_bgt`` is False.
    """
    fn = "gspo_loss"
    _check_token_inputs(
        fn,
        {"logp_bgt": logp_bgt, "logp_old_bgt": logp_old_bgt, "adv_bgt": adv_bgt},
        "mask_bgt",
        mask_bgt,
    )
    _check_token_axis(fn, "logp_bgt", logp_bgt)
    check_positive(fn, "clip_low", clip_low, allow_zero=True)
    check_positive(fn, "clip_high", clip_high, allow_zero=True)
    if log_ratio_clamp is not None:
        check_positive(fn, "log_ratio_clamp", log_ratio_clamp)

    logp, logp_old, adv = _masked_f32(mask_bgt, logp_bgt, logp_old_bgt, adv_bgt)
    length = jnp.sum(mask_bgt, axis=-1, keepdims=True, dtype=jnp.int32).astype(jnp.float32)
    seq_log_ratio = jnp.sum(logp - _sg(logp_old), axis=-1, keepdims=True) / jnp.maximum(length, 1)
    log_ratio = logp - _sg(logp) + _sg(seq_log_ratio)
    if log_ratio_clamp is not None:
        log_ratio = jnp.minimum(log_ratio, log_ratio_clamp)
    loss = _clipped_surrogate(jnp.exp(log_ratio), _sg(adv), clip_low, clip_high)
    return jnp.where(mask_bgt, loss, 0.0)


def cispo_loss(
    logp_bgt: chex.Array,
    logp_old_bgt: chex.Array,
    adv_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    clip_low: float,
    clip_high: float,
    log_ratio_clamp: float | None = None,
) -> chex.Array:
    """CISPO: REINFORCE weighted by a clipped, stop-gradient importance ratio.

        r_t = exp(logπ_θ − logπ_old),   w_t = sg(clip(r_t, 1 − ε_low, 1 + ε_high))
        ℓ_t = −w_t · A_t · logπ_θ(y_t),   so   ∂ℓ_t/∂logπ_θ(y_t) = −w_t·A_t.

    Unlike PPO, no token ever loses its gradient: the clip bounds the weight, not the update.
    The MiniMax-M1 setting has no lower bound in effect (verl's example: ε_low = 10, ε_high =
    0.2, i.e. w ≤ 1.2). TRL's ``cispo`` caps r at an *absolute* ε_high instead (w = min(r, 5)):
    that is ε_low ≥ 1 and ε_high = 4 here.

    Reference: MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention", arXiv:2506.13585 (2025).

    Args:
      logp_bgt: log π_θ of the sampled tokens, float, any shape (e.g. ``[B, G, T]``).
      logp_old_bgt: log π_old of the same tokens, same shape.
      adv_bgt: advantages A_t, same shape (treated as constants).
      mask_bgt: bool, same shape; True on completion tokens that carry loss.
      clip_low, clip_high: ε_low, ε_high ≥ 0.
      log_ratio_clamp: κ > 0 to clamp the log-ratio to [−κ, κ] before the exp (verl uses 20),
        or None.

    Returns:
      f32 per-token loss of the same shape, exactly 0 where ``mask_bgt`` is False.
    """
    fn = "cispo_loss"
    _check_token_inputs(
        fn,
        {"logp_bgt": logp_bgt, "logp_old_bgt": logp_old_bgt, "adv_bgt": adv_bgt},
        "mask_bgt",
        mask_bgt,
    )
    check_positive(fn, "clip_low", clip_low, allow_zero=True)
    check_positive(fn, "clip_high", clip_high, allow_zero=True)
    if log_ratio_clamp is not None:
        check_positive(fn, "log_ratio_clamp", log_ratio_clamp)

    logp, logp_old, adv = _masked_f32(mask_bgt, logp_bgt, logp_old_bgt, adv_bgt)
    ratio = jnp.exp(_log_ratio(_sg(logp), logp_old, log_ratio_clamp))
    weight = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return jnp.where(mask_bgt, -weight * _sg(adv) * logp, 0.0)


def value_loss(
    value_bgt: chex.Array,
    value_old_bgt: chex.Array,
    return_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    clip_eps: float | None = None,
) -> chex.Array:
    """Clipped squared-error value loss per token (PPO's critic loss).

        v̂_t = clip(v_t, v_old,t − ε, v_old,t + ε)
        ℓ_t = ½·max((v_t − R_t)², (v̂_t − R_t)²)          (ℓ_t = ½(v_t − R_t)² when ε is None)

    The max makes the clip pessimistic: a value that moved more than ε away from v_old only gets
    gradient when that move brings it closer to the return.

    Reference: J. Schulman et al., "Proximal Policy Optimization Algorithms", arXiv:1707.06347
    (2017), as implemented in OpenAI baselines' ``ppo2``. Peer defaults: verl and OpenRLHF
    ε = 0.5, TRL PPO ε = 0.2.

    Args:
      value_bgt: current critic values v_t, float, any shape (e.g. ``[B, G, T]``).
      value_old_bgt: critic values at rollout time, same shape (constants).
      return_bgt: return targets R_t, same shape (constants).
      mask_bgt: bool, same shape; True on tokens that carry loss.
      clip_eps: ε > 0, or None for the unclipped loss.

    Returns:
      f32 per-token loss of the same shape, exactly 0 where ``mask_bgt`` is False.
    """
    fn = "value_loss"
    _check_token_inputs(
        fn,
        {"value_bgt": value_bgt, "value_old_bgt": value_old_bgt, "return_bgt": return_bgt},
        "mask_bgt",
        mask_bgt,
    )
    if clip_eps is not None:
        check_positive(fn, "clip_eps", clip_eps)

    value, value_old, ret = _masked_f32(mask_bgt, value_bgt, value_old_bgt, return_bgt)
    value_old, ret = _sg(value_old), _sg(ret)
    loss = jnp.square(value - ret)
    if clip_eps is not None:
        value_clipped = value_old + jnp.clip(value - value_old, -clip_eps, clip_eps)
        loss = jnp.maximum(loss, jnp.square(value_clipped - ret))
    return jnp.where(mask_bgt, 0.5 * loss, 0.0)


def entropy_bonus(entropy_bgt: chex.Array, mask_bgt: chex.Array, *, coef: float) -> chex.Array:
    """Entropy regularisation as a per-token loss: ℓ_t = −coef·H_t.

    Adding it to the policy loss (before aggregation) maximises the policy's entropy
    H_t = −Σ_v π(v) log π(v) with weight ``coef``.

    Reference: R. J. Williams and J. Peng, "Function optimization using connectionist
    reinforcement learning algorithms", Connection Science 3, 1991; V. Mnih et al.,
    "Asynchronous Methods for Deep Reinforcement Learning", arXiv:1602.01783 (2016).

    Args:
      entropy_bgt: per-token entropies H_t, float, any shape (e.g. ``[B, G, T]``).
      mask_bgt: bool, same shape.
      coef: the weight; a Python float or a traced scalar (adaptive entropy control).

    Returns:
      f32 per-token loss of the same shape, exactly 0 where ``mask_bgt`` is False.
    """
    fn = "entropy_bonus"
    _check_token_inputs(fn, {"entropy_bgt": entropy_bgt}, "mask_bgt", mask_bgt)
    (entropy,) = _masked_f32(mask_bgt, entropy_bgt)
    return jnp.where(mask_bgt, -f32(coef) * entropy, 0.0)


def truncated_importance_weight(
    logp_bgt: chex.Array,
    logp_sampler_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    cap: float | None = None,
) -> chex.Array:
    """Truncated importance weights correcting a sampler/trainer mismatch, per token.

        w_t = min(exp(sg(log π_θ(y_t)) − log μ(y_t)), C)        (no min when C is None)

    with μ the distribution the rollout engine sampled from (its own numerics, kernels or
    stale weights) and π_θ the trainer's policy. Multiplying the advantages by w_t turns any
    policy gradient into E_μ[min(π_θ/μ, C)·A·∇log π_θ], the truncated-IS estimator of Yao et al.
    2025 ("Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", the TIS
    correction also used by verl and SkyRL); Ionides 2008 ("Truncated importance sampling")
    for the truncation's bias-variance trade-off. The weight is a constant of the loss (no
    gradient flows through it).

    Args:
      logp_bgt: float log π_θ of the sampled tokens, any shape (e.g. ``[B, G, T]``).
      logp_sampler_bgt: float log μ of the same tokens, same shape.
      mask_bgt: bool, same shape.
      cap: the truncation C > 0, or ``None`` for plain importance weights.

    Returns:
      f32 weights of the same shape, exactly 1 where ``mask_bgt`` is False (a neutral factor).
    """
    fn = "truncated_importance_weight"
    _check_token_inputs(
        fn, {"logp_bgt": logp_bgt, "logp_sampler_bgt": logp_sampler_bgt}, "mask_bgt", mask_bgt
    )
    if cap is not None:
        check_positive(fn, "cap", cap)
    logp, logp_sampler = _sg(_masked_f32(mask_bgt, logp_bgt, logp_sampler_bgt))
    w = jnp.exp(jnp.where(mask_bgt, logp - logp_sampler, 0.0))
    if cap is not None:
        w = jnp.where(mask_bgt, jnp.minimum(w, cap), 1.0)
    return w


# --------------------------------------------------------------------------------------------
# The 2025–26 loss family (issue 17). Same conventions as above: per-token loss of the input's
# shape, 0 under the mask, advantages and old log-probs constants, math in f32.


def _check_loss_inputs(
    fn: str,
    logp_bgt: chex.Array,
    logp_old_bgt: chex.Array,
    adv_bgt: chex.Array,
    mask_bgt: chex.Array,
) -> None:
    _check_token_inputs(
        fn,
        {"logp_bgt": logp_bgt, "logp_old_bgt": logp_old_bgt, "adv_bgt": adv_bgt},
        "mask_bgt",
        mask_bgt,
    )


def _sequence_mean(x_bgt: chex.Array, mask_bgt: chex.Array) -> chex.Array:
    """``Σ_t m_t x_t / max(|y|, 1)`` over the last axis, keepdims (0 for empty sequences)."""
    length = jnp.sum(mask_bgt, axis=-1, keepdims=True, dtype=jnp.int32).astype(jnp.float32)
    return jnp.sum(jnp.where(mask_bgt, x_bgt, 0.0), axis=-1, keepdims=True) / jnp.maximum(length, 1)


def sapo_loss(
    logp_bgt: chex.Array,
    logp_old_bgt: chex.Array,
    adv_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    log_ratio_clamp: float | None = 20.0,
) -> chex.Array:
    """SAPO: a smooth, temperature-controlled gate in place of PPO's hard clip.

        r_t = exp(clamp(logπ_θ − logπ_old, −κ, κ)),   τ_t = τ_pos if A_t > 0 else τ_neg
        f(r; τ) = σ(τ·(r − 1)) · 4/τ
        ℓ_t = −f(r_t; τ_t) · A_t,   so   ∂ℓ_t/∂logπ_θ = −A_t · 4σ(τ(r−1))(1−σ(τ(r−1))) · r

    At r = 1 the gradient is −A (exactly the policy gradient); it decays smoothly as r leaves 1
    instead of dropping to zero at a boundary, faster for negative advantages (τ_neg > τ_pos).
    SAPO aggregates per sequence (``seq-mean-token-mean``), as verl forces.

    Reference: "Soft Adaptive Policy Optimization", arXiv:2511.20347
    (2025). verl ``compute_policy_loss_sapo`` (κ = 20), TRL ``loss_type="sapo"`` (no clamp);
    defaults τ_pos = 1.0, τ_neg = 1.05 are TRL's.

    Args:
      logp_bgt, logp_old_bgt, adv_bgt, mask_bgt: as in :func:`ppo_clip_loss`.
      tau_pos: τ > 0 for tokens with A > 0.
      tau_neg: τ > 0 for tokens with A ≤ 0.
      log_ratio_clamp: κ > 0 to clamp the log-ratio before the exp, or None.

    Returns:
      f32 per-token loss of the same shape, exactly 0 where ``mask_bgt`` is False.
    """
    fn = "sapo_loss"
    _check_loss_inputs(fn, logp_bgt, logp_old_bgt, adv_bgt, mask_bgt)
    check_positive(fn, "tau_pos", tau_pos)
    check_positive(fn, "tau_neg", tau_neg)
    if log_ratio_clamp is not None:
        check_positive(fn, "log_ratio_clamp", log_ratio_clamp)
    logp, logp_old, adv = _masked_f32(mask_bgt, logp_bgt, logp_old_bgt, adv_bgt)
    adv = _sg(adv)
    ratio = jnp.exp(_log_ratio(logp, logp_old, log_ratio_clamp))
    tau = jnp.where(adv > 0, float(tau_pos), float(tau_neg))
    gate = jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return jnp.where(mask_bgt, -gate * adv, 0.0)


def gmpo_loss(
    logp_bgt: chex.Array,
    logp_old_bgt: chex.Array,
    adv_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
) -> chex.Array:
    """GMPO: the geometric mean of token-clipped ratios, one surrogate per sequence.

        d_t = logπ_θ − logπ_old,   d̂_t = sgn(A)·min(sgn(A)·d_t, sgn(A)·clip(d_t, −ε_low, ε_high))
        ρ_i = exp( Σ_t m_t d̂_t / |y_i| )           (geometric mean of the clipped token ratios)
        Ā_i = Σ_t m_t A_t / |y_i|,   L_i = −Ā_i · ρ_i

    The clip acts in log space at the token level (verl's ``geo_mean``: "clipping wider", the
    paper's ε = 0.4), pessimistically in the direction of the advantage. Per token this function
    returns L_i on every valid token of sequence i, so ``seq-mean-token-mean`` aggregation gives
    exactly mean_i L_i (verl takes a plain mean over sequences) in value and gradient.
    The token axis must be last; sequences with no valid token get zero loss.

    Reference: Y. Zhao et al., "Geometric-Mean Policy Optimization", arXiv:2507.20673 (2025);
    verl ``compute_policy_loss_geo_mean``.

    Args:
      logp_bgt, logp_old_bgt, adv_bgt, mask_bgt: as in :func:`ppo_clip_loss`, ``[..., T]``.
      clip_low, clip_high: ε_low, ε_high ≥ 0, the log-ratio clip range [−ε_low, ε_high].

    Returns:
      f32 per-token loss of the same shape, exactly 0 where ``mask_bgt`` is False.
    """
    fn = "gmpo_loss"
    _check_loss_inputs(fn, logp_bgt, logp_old_bgt, adv_bgt, mask_bgt)
    _check_token_axis(fn, "logp_bgt", logp_bgt)
    check_positive(fn, "clip_low", clip_low, allow_zero=True)
    check_positive(fn, "clip_high", clip_high, allow_zero=True)
    logp, logp_old, adv = _masked_f32(mask_bgt, logp_bgt, logp_old_bgt, adv_bgt)
    adv = _sg(adv)
    d = logp - _sg(logp_old)
    sgn = jnp.sign(adv)
    d_clip = sgn * jnp.minimum(sgn * d, sgn * jnp.clip(d, -clip_low, clip_high))
    ratio = jnp.exp(_sequence_mean(d_clip, mask_bgt))
    seq_adv = _sequence_mean(adv, mask_bgt)
    return jnp.where(mask_bgt, -seq_adv * ratio, 0.0)


def _cov_scores(adv: chex.Array, logp: chex.Array, mask: chex.Array) -> chex.Array:
    """Per-token centred product (A − mean A)(logπ − mean logπ) over the valid tokens."""
    count = jnp.maximum(jnp.sum(mask, dtype=jnp.int32), 1).astype(jnp.float32)
    mean_adv = jnp.sum(jnp.where(mask, adv, 0.0)) / count
    mean_logp = jnp.sum(jnp.where(mask, logp, 0.0)) / count
    return (adv - mean_adv) * (logp - mean_logp)


def _top_k_mask(score: chex.Array, eligible: chex.Array, k: chex.Array) -> chex.Array:
    """True on the ``k`` eligible entries of largest ``score`` (ties: the earlier flat index),
    ``k`` a traced integer; deterministic."""
    flat = jnp.where(eligible, score, -jnp.inf).reshape(-1)
    order = jnp.argsort(-flat, stable=True)
    rank = jnp.empty_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    return (rank < k).reshape(score.shape) & eligible


def _token_budget(ratio: float, mask: chex.Array) -> chex.Array:
    """``max(⌊ratio·N⌋, 1)`` with N the number of valid tokens (verl's count)."""
    n = jnp.sum(mask, dtype=jnp.int32).astype(jnp.float32)
    return jnp.maximum(jnp.floor(ratio * n), 1.0).astype(jnp.int32)


def clip_cov_loss(
    logp_bgt: chex.Array,
    logp_old_bgt: chex.Array,
    adv_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
) -> chex.Array:
    """Clip-Cov: PPO clip, and the gradient of a few high-covariance tokens removed.

        c_t = (A_t − Ā)·(logπ_θ(y_t) − mean logπ_θ)          (centred over the valid tokens)
        candidates: valid tokens with lb < c_t < ub that PPO's clip did not already cut
        K = max(⌊ratio·N⌋, 1);   chosen: the K candidates of largest c_t
        ℓ_t = 0 on chosen tokens, else PPO's max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high))

    Tokens whose log-prob co-varies most with the advantage drive entropy collapse; detaching
    them keeps entropy up. The paper and verl draw the K tokens *at random* among the
    candidates (``torch.randperm``); here the choice is **deterministic**: the K candidates of
    largest covariance (ties: the earlier token), so the loss is a pure function of its inputs
    and needs no PRNG key. When there are at most K candidates both rules pick all of them.

    Batch dependence: Ā, mean logπ, N and the ranking are statistics of the arrays passed in —
    under the trainer, one micro-batch. The loss therefore depends on how the batch is split
    into micro-batches (as in verl, where it is computed per micro-batch) and is **not packing-
    or micro-batch-invariant**: a packed update with token-budget micro-batches groups other
    sequences together and selects other tokens.

    Reference: G. Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models", arXiv:2505.22617 (2025); verl ``compute_policy_loss_clip_cov`` (defaults
    ratio = 2e-4, lb = 1, ub = 5).

    Args:
      logp_bgt, logp_old_bgt, adv_bgt, mask_bgt: as in :func:`ppo_clip_loss`.
      clip_low, clip_high: PPO's ε_low, ε_high ≥ 0.
      clip_cov_ratio: fraction in (0, 1] of the valid tokens to detach (at least one).
      clip_cov_lb, clip_cov_ub: the covariance band (lb < ub) of the candidates.

    Returns:
      f32 per-token loss of the same shape, exactly 0 where ``mask_bgt`` is False.
    """
    fn = "clip_cov_loss"
    _check_loss_inputs(fn, logp_bgt, logp_old_bgt, adv_bgt, mask_bgt)
    check_positive(fn, "clip_low", clip_low, allow_zero=True)
    check_positive(fn, "clip_high", clip_high, allow_zero=True)
    if not 0.0 < clip_cov_ratio <= 1.0:
        raise ValueError(
            f"{fn}: argument `clip_cov_ratio` must be in (0, 1], got {clip_cov_ratio!r}"
        )
    if not clip_cov_lb < clip_cov_ub:
        raise ValueError(
            f"{fn}: arguments `clip_cov_lb` < `clip_cov_ub` required, got {clip_cov_lb!r} and "
            f"{clip_cov_ub!r}"
        )
    logp, logp_old, adv = _masked_f32(mask_bgt, logp_bgt, logp_old_bgt, adv_bgt)
    adv = _sg(adv)
    ratio = jnp.exp(logp - _sg(logp_old))
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    cut_by_clip = (clipped > unclipped) & mask_bgt
    cov = _sg(_cov_scores(adv, logp, mask_bgt))
    eligible = mask_bgt & ~cut_by_clip & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    chosen = _top_k_mask(cov, eligible, _token_budget(clip_cov_ratio, mask_bgt))
    loss = jnp.maximum(unclipped, clipped)
    return jnp.where(mask_bgt & ~chosen, loss, 0.0)


def kl_cov_loss(
    logp_bgt: chex.Array,
    logp_old_bgt: chex.Array,
    adv_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 1.0,
) -> chex.Array:
    """KL-Cov: the unclipped surrogate, with a |log r| penalty on the top-covariance tokens.

        c_t = (A_t − Ā)·(logπ_θ(y_t) − mean logπ_θ)          (centred over the valid tokens)
        K = max(⌊ratio·N⌋, 1);   chosen: the K valid tokens of largest c_t
        ℓ_t = −A_t·r_t + [t chosen]·k·|logπ_θ − logπ_old|

    No ratio clip at all: the trust region is a KL-like penalty on the few tokens that drive
    entropy collapse. The choice is deterministic (top-K, ties: the earlier token), as in verl.
    Like :func:`clip_cov_loss` it depends on the micro-batch's statistics and is **not
    packing- or micro-batch-invariant**.

    Reference: G. Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models", arXiv:2505.22617 (2025); verl ``compute_policy_loss_kl_cov`` (defaults
    ratio = 2e-4, k = 1).

    Args:
      logp_bgt, logp_old_bgt, adv_bgt, mask_bgt: as in :func:`ppo_clip_loss`.
      kl_cov_ratio: fraction in (0, 1] of the valid tokens to penalise (at least one).
      ppo_kl_coef: the penalty weight k ≥ 0.

    Returns:
      f32 per-token loss of the same shape, exactly 0 where ``mask_bgt`` is False.
    """
    fn = "kl_cov_loss"
    _check_loss_inputs(fn, logp_bgt, logp_old_bgt, adv_bgt, mask_bgt)
    if not 0.0 < kl_cov_ratio <= 1.0:
        raise ValueError(f"{fn}: argument `kl_cov_ratio` must be in (0, 1], got {kl_cov_ratio!r}")
    check_positive(fn, "ppo_kl_coef", ppo_kl_coef, allow_zero=True)
    logp, logp_old, adv = _masked_f32(mask_bgt, logp_bgt, logp_old_bgt, adv_bgt)
    adv = _sg(adv)
    log_ratio = logp - _sg(logp_old)
    cov = _sg(_cov_scores(adv, logp, mask_bgt))
    chosen = _top_k_mask(cov, mask_bgt, _token_budget(kl_cov_ratio, mask_bgt))
    loss = -adv * jnp.exp(log_ratio) + jnp.where(chosen, ppo_kl_coef * jnp.abs(log_ratio), 0.0)
    return jnp.where(mask_bgt, loss, 0.0)


def dro_loss(
    logp_bgt: chex.Array,
    logp_old_bgt: chex.Array,
    adv_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    beta: float = 0.05,
) -> chex.Array:
    """DRO: the policy gradient with a quadratic penalty on the log-ratio to the sampler.

        ℓ_t = −A_t·logπ_θ(y_t) + ½β·(logπ_θ(y_t) − logπ_old(y_t))²
        ∂ℓ_t/∂logπ_θ = −A_t + β·(logπ_θ − logπ_old)

    An off-policy (even offline) regularised policy gradient: no ratio, no clip; the squared
    log-ratio keeps π_θ near the policy that sampled the data. "DRO" here is **Direct Reward
    Optimisation** (Richemond et al. 2024) in the per-token form of Kimi k1.5 and Thinking
    Machines' Tinker ``loss_fn="dro"`` (β = 0.05 in Tinker's example) — not "Direct Reasoning
    Optimization" (arXiv:2506.13351), which is a reward (R³), not a loss.

    References: P. H. Richemond et al., "Offline Regularised Reinforcement Learning for Large
    Language Models Alignment", arXiv:2405.19107 (2024); Kimi Team, "Kimi k1.5: Scaling
    Reinforcement Learning with LLMs", arXiv:2501.12599 (2025).

    Args:
      logp_bgt, logp_old_bgt, adv_bgt, mask_bgt: as in :func:`ppo_clip_loss` (``logp_old`` is
        the sampling policy q).
      beta: the penalty weight β ≥ 0.

    Returns:
      f32 per-token loss of the same shape, exactly 0 where ``mask_bgt`` is False.
    """
    fn = "dro_loss"
    _check_loss_inputs(fn, logp_bgt, logp_old_bgt, adv_bgt, mask_bgt)
    check_positive(fn, "beta", beta, allow_zero=True)
    logp, logp_old, adv = _masked_f32(mask_bgt, logp_bgt, logp_old_bgt, adv_bgt)
    loss = -_sg(adv) * logp + 0.5 * beta * jnp.square(logp - _sg(logp_old))
    return jnp.where(mask_bgt, loss, 0.0)


def dppo_loss(
    logp_bgt: chex.Array,
    logp_old_bgt: chex.Array,
    adv_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    divergence: str,
    clip_low: float,
    clip_high: float,
    ratio_cap: float = 10.0,
) -> chex.Array:
    """DPPO (Binary-TV / Binary-KL): a trust region on a divergence, not on the ratio.

        p = π_θ(y_t), q = π_old(y_t) (probabilities of the sampled token)
        TV:  D_t = p − q;   leaves the region if  D_t > δ_high (A > 0) or D_t < −δ_low (A ≤ 0)
        KL:  D_t = q·log(q/p) + (1−q)·log((1−q+1e-8)/(1−p+1e-8))   (binary KL of the token)
             leaves the region if D_t > δ_high with p > q (A > 0), or D_t > δ_low with p < q
             (A ≤ 0)
        w_t = sg(min(exp(min(logπ_θ − logπ_old, 20)), c)),   M_t = 0 outside the region else 1
        ℓ_t = −A_t · w_t · M_t · logπ_θ(y_t)

    A token loses its gradient only when the divergence moved in the direction its advantage
    pushes, as in PPO, but measured on probabilities: a rare token may grow its ratio a lot
    (tiny TV) while a likely one may not move much. The weight is CISPO-like (stop-gradient,
    capped at c = 10). The anchor is ``logp_old`` (the rollout policy of this framework's
    batch: verl's ``dppo_binary_*_recompute`` when π_old is recomputed, ``dppo_binary_*`` when
    the sampler's log-probs are used as π_old).

    Reference: P. Qi et al., "Rethinking the Trust Region in LLM Reinforcement Learning",
    arXiv:2602.04879 (2026); sail-sg/Stable-RL ``compute_policy_loss_with_mask`` and
    ``_compute_token_mask_for_policy_loss`` (merged in verl PR 5397).

    Args:
      logp_bgt, logp_old_bgt, adv_bgt, mask_bgt: as in :func:`ppo_clip_loss`.
      divergence: ``"tv"`` or ``"kl"``.
      clip_low, clip_high: δ_low, δ_high ≥ 0 (the region's bounds for A ≤ 0 and A > 0).
      ratio_cap: c > 0, cap on the stop-gradient weight.

    Returns:
      f32 per-token loss of the same shape, exactly 0 where ``mask_bgt`` is False.
    """
    fn = "dppo_loss"
    _check_loss_inputs(fn, logp_bgt, logp_old_bgt, adv_bgt, mask_bgt)
    if divergence not in ("tv", "kl"):
        raise ValueError(f"{fn}: argument `divergence` must be 'tv' or 'kl', got {divergence!r}")
    check_positive(fn, "clip_low", clip_low, allow_zero=True)
    check_positive(fn, "clip_high", clip_high, allow_zero=True)
    check_positive(fn, "ratio_cap", ratio_cap)
    logp, logp_old, adv = _masked_f32(mask_bgt, logp_bgt, logp_old_bgt, adv_bgt)
    adv, logp_old = _sg(adv), _sg(logp_old)
    p, q = jnp.exp(_sg(logp)), jnp.exp(logp_old)
    if divergence == "tv":
        out_pos = (p - q) > clip_high
        out_neg = (p - q) < -clip_low
    else:
        kl = q * (logp_old - _sg(logp)) + (1.0 - q) * jnp.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
        out_pos = (kl > clip_high) & (p > q)
        out_neg = (kl > clip_low) & (p < q)
    inside = ~jnp.where(adv > 0, out_pos, out_neg)
    weight = jnp.minimum(jnp.exp(jnp.minimum(_sg(logp) - logp_old, 20.0)), ratio_cap)
    return jnp.where(mask_bgt & inside, -adv * weight * logp, 0.0)


def vespo_loss(
    logp_bgt: chex.Array,
    logp_old_bgt: chex.Array,
    adv_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
    is_weight_bgt: chex.Array | None = None,
) -> chex.Array:
    """VESPO: a smooth Gamma-shaped weight on the sequence importance ratio.

        log w_i = clamp( Σ_t m_t clamp(logπ_θ − logπ_old, −20, 20), log 1e-8, 20 )
        (k, λ) = (k_pos, λ_pos) if A ≥ 0 else (k_neg, λ_neg)
        φ(w) = e^λ · w^k · e^(−λw)    (φ(1) = 1), in log space: λ + k·log w − λ·w
        ℓ_t = −sg(φ(w_i)) · A_t · logπ_θ(y_t)

    φ replaces a hard clip by a weight that vanishes smoothly as the *sequence* ratio w (a sum
    of token log-ratios, not a mean) leaves 1; it is a constant of the loss (REINFORCE
    weighted by φ). Token axis last. TRL aggregates VESPO as a token sum over the batch's
    valid tokens (``token-mean``).

    With ``is_weight_bgt`` (a rollout correction's token weights v_t ≈ π_old/μ, truncated or
    masked) the weights enter φ's argument instead of multiplying the loss, so w is the ratio
    against the sampler: ``log w_i = clamp(Σ_t m_t [clamp(log ρ_t, −20, 20) + clamp(log v_t,
    log 1e-8, 20)], log 1e-8, 20)`` (TRL ``get_gamma_weights(importance_sampling_ratio=...)``;
    a masked token, v = 0, adds log 1e-8).

    Reference: "VESPO: Variational Sequence-Level Soft Policy Optimization", arXiv:2602.10693
    (2026); TRL 1.16 ``GRPOTrainer.get_gamma_weights`` (its defaults: k = 2 / 3, λ = 3 / 2 for
    A ≥ 0 / A < 0; λ floored at 1e-4).

    Args:
      logp_bgt, logp_old_bgt, adv_bgt, mask_bgt: as in :func:`ppo_clip_loss`, ``[..., T]``.
      k_pos, lambda_pos: the Gamma shape k ≥ 0 and rate λ > 0 for A ≥ 0.
      k_neg, lambda_neg: the same for A < 0.
      is_weight_bgt: per-token importance weights ≥ 0 (no gradient), same shape, or None.

    Returns:
      f32 per-token loss of the same shape, exactly 0 where ``mask_bgt`` is False.
    """
    fn = "vespo_loss"
    _check_loss_inputs(fn, logp_bgt, logp_old_bgt, adv_bgt, mask_bgt)
    if is_weight_bgt is not None:
        _check_token_inputs(fn, {"is_weight_bgt": is_weight_bgt}, "mask_bgt", mask_bgt)
    _check_token_axis(fn, "logp_bgt", logp_bgt)
    for name, value in (("k_pos", k_pos), ("k_neg", k_neg)):
        check_positive(fn, name, value, allow_zero=True)
    for name, value in (("lambda_pos", lambda_pos), ("lambda_neg", lambda_neg)):
        check_positive(fn, name, value)
    logp, logp_old, adv = _masked_f32(mask_bgt, logp_bgt, logp_old_bgt, adv_bgt)
    adv = _sg(adv)
    token_lr = jnp.clip(_sg(logp) - _sg(logp_old), -20.0, 20.0)
    if is_weight_bgt is not None:
        v = _sg(jnp.asarray(is_weight_bgt, jnp.float32))
        log_v = jnp.log(jnp.where(v > 0.0, v, 1e-30))
        token_lr = token_lr + jnp.clip(log_v, math.log(1e-8), 20.0)
    seq_lr = jnp.sum(jnp.where(mask_bgt, token_lr, 0.0), axis=-1, keepdims=True)
    log_w = jnp.clip(seq_lr, math.log(1e-8), 20.0)
    nonneg = adv >= 0
    k = jnp.where(nonneg, float(k_pos), float(k_neg))
    lam = jnp.maximum(jnp.where(nonneg, float(lambda_pos), float(lambda_neg)), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    phi = jnp.where(jnp.isfinite(phi), phi, 0.0)
    return jnp.where(mask_bgt, -phi * adv * logp, 0.0)
