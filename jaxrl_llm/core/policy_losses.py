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
