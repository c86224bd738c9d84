"""Offline preference losses (the DPO family) and the sequence log-probs they are built from.

A batch holds P preference pairs (x, y_w, y_l): a prompt, a chosen and a rejected completion.
Each loss takes per-pair *sequence* log-probs, ``f32[P]``, and returns a per-pair loss
``f32[P]`` (the trainer averages over pairs). With the policy π_θ and a frozen reference π_ref:

    ρ_w = log π_θ(y_w|x) − log π_ref(y_w|x),   ρ_l = log π_θ(y_l|x) − log π_ref(y_l|x),
    Δ = ρ_w − ρ_l                               (the implicit reward margin, over β)

Sequence log-probs are sums over completion tokens (:func:`sequence_logprob`); prompt tokens are
masked out. Reference log-probs are constants (``stop_gradient``). ``jax.nn.log_sigmoid`` keeps
−log σ(z) finite and smooth for any |z|. Lengths |y| are token counts (int or float); a length
of 0 is read as 1 so that nothing divides by zero.

Conventions follow TRL's ``DPOTrainer`` (huggingface/trl@f2cd577; see "DPO family" in
``docs/numerics.md``), except that label smoothing here is an explicit keyword of the losses that
use it.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.core._contracts import (
    check_bool,
    check_float,
    check_positive,
    check_rank,
    check_same_shape,
    f32,
)

_sg = jax.lax.stop_gradient


def _check_pairs(fn: str, floats: dict[str, chex.Array], lengths: dict[str, chex.Array]) -> None:
    for name, x in floats.items():
        check_rank(fn, name, x, 1, "[P]")
        check_float(fn, name, x)
    for name, x in lengths.items():
        check_rank(fn, name, x, 1, "[P]")
        if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
            raise TypeError(f"{fn}: argument `{name}` must be an int or float array, got {x.dtype}")
    check_same_shape(fn, {**floats, **lengths})


def _check_smoothing(fn: str, value: float, *, upper: float, inclusive: bool) -> None:
    ok = 0.0 <= value <= upper if inclusive else 0.0 <= value < upper
    if not ok:
        interval = f"[0, {upper}]" if inclusive else f"[0, {upper})"
        raise ValueError(f"{fn}: argument `label_smoothing` must be in {interval}, got {value!r}")


def _log_ratios(
    logp_chosen_p: chex.Array,
    logp_rejected_p: chex.Array,
    ref_chosen_p: chex.Array,
    ref_rejected_p: chex.Array,
) -> tuple[chex.Array, chex.Array]:
    rho_chosen = f32(logp_chosen_p) - _sg(f32(ref_chosen_p))
    rho_rejected = f32(logp_rejected_p) - _sg(f32(ref_rejected_p))
    return rho_chosen, rho_rejected


def _dpo_args(
    fn: str,
    logp_chosen_p: chex.Array,
    logp_rejected_p: chex.Array,
    ref_chosen_p: chex.Array,
    ref_rejected_p: chex.Array,
    beta: float,
) -> None:
    _check_pairs(
        fn,
        {
            "logp_chosen_p": logp_chosen_p,
            "logp_rejected_p": logp_rejected_p,
            "ref_chosen_p": ref_chosen_p,
            "ref_rejected_p": ref_rejected_p,
        },
        {},
    )
    check_positive(fn, "beta", beta)


def _length(length_p: chex.Array) -> chex.Array:
    return jnp.maximum(f32(length_p), 1.0)


def sequence_logprob(logp_bt: chex.Array, mask_bt: chex.Array) -> chex.Array:
    """Log-probability of each completion: log π(y|x) = Σ_t m_t · log π(y_t | x, y_<t).

    Padded and prompt positions are excluded with ``where`` (they may hold −inf) and get zero
    gradient.

    Args:
      logp_bt: per-token log-probs, float ``[..., T]`` (usually ``[B, T]``).
      mask_bt: bool, same shape; True on completion tokens.

    Returns:
      f32 ``[...]`` (``[B]``); 0 for a sequence with no valid token.
    """
    fn = "sequence_logprob"
    check_float(fn, "logp_bt", logp_bt)
    check_bool(fn, "mask_bt", mask_bt)
    if logp_bt.ndim < 1:
        raise ValueError(f"{fn}: argument `logp_bt` must have rank >= 1 [..., T], got a scalar")
    check_same_shape(fn, {"logp_bt": logp_bt, "mask_bt": mask_bt})
    return jnp.sum(jnp.where(mask_bt, f32(logp_bt), 0.0), axis=-1)


def sequence_length(mask_bt: chex.Array) -> chex.Array:
    """Number of completion tokens of each sequence, |y| = Σ_t m_t, as f32 ``[...]`` (``[B]``).

    Args:
      mask_bt: bool ``[..., T]``; True on completion tokens.
    """
    fn = "sequence_length"
    check_bool(fn, "mask_bt", mask_bt)
    if mask_bt.ndim < 1:
        raise ValueError(f"{fn}: argument `mask_bt` must have rank >= 1 [..., T], got a scalar")
    return jnp.sum(mask_bt, axis=-1, dtype=jnp.int32).astype(jnp.float32)


def dpo_sigmoid_loss(
    logp_chosen_p: chex.Array,
    logp_rejected_p: chex.Array,
    ref_chosen_p: chex.Array,
    ref_rejected_p: chex.Array,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> chex.Array:
    """DPO's sigmoid loss, with conservative label smoothing (cDPO).

        ℓ = −(1 − ε)·log σ(βΔ) − ε·log σ(−βΔ)          (ε = 0: plain DPO, −log σ(βΔ))

    cDPO assumes each preference label is flipped with probability ε, so its optimum keeps the
    implicit reward margin finite. ∂ℓ/∂Δ = −β·(σ(−βΔ) − ε).

    References: R. Rafailov, A. Sharma, E. Mitchell, S. Ermon, C. D. Manning, C. Finn, "Direct
    Preference Optimization: Your Language Model is Secretly a Reward Model", arXiv:2305.18290
    (2023). E. Mitchell, "A note on DPO with noisy preferences & relationship to IPO" (2023).

    Args:
      logp_chosen_p, logp_rejected_p: policy sequence log-probs of y_w and y_l, float ``[P]``.
      ref_chosen_p, ref_rejected_p: reference sequence log-probs, float ``[P]`` (constants).
      beta: β > 0, the KL-regularisation strength (TRL default 0.1).
      label_smoothing: ε ∈ [0, 0.5], the assumed label-noise rate.

    Returns:
      f32 ``[P]`` per-pair losses.
    """
    fn = "dpo_sigmoid_loss"
    _dpo_args(fn, logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p, beta)
    _check_smoothing(fn, label_smoothing, upper=0.5, inclusive=True)
    rho_w, rho_l = _log_ratios(logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p)
    z = beta * (rho_w - rho_l)
    eps = label_smoothing
    return -(1.0 - eps) * jax.nn.log_sigmoid(z) - eps * jax.nn.log_sigmoid(-z)


def robust_dpo_loss(
    logp_chosen_p: chex.Array,
    logp_rejected_p: chex.Array,
    ref_chosen_p: chex.Array,
    ref_rejected_p: chex.Array,
    *,
    beta: float,
    label_smoothing: float,
) -> chex.Array:
    """Robust DPO (rDPO): an unbiased DPO loss under labels flipped with probability ε.

        ℓ = [−(1 − ε)·log σ(βΔ) + ε·log σ(−βΔ)] / (1 − 2ε),   ε ∈ [0, 0.5)

    In expectation over the label noise it equals the clean DPO loss (ε = 0 is plain DPO).

    Reference: S. R. Chowdhury, A. Kini, N. Natarajan, "Provably Robust DPO: Aligning Language
    Models with Noisy Feedback", arXiv:2403.00409 (2024).

    Args:
      logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p: as in
        :func:`dpo_sigmoid_loss`.
      beta: β > 0.
      label_smoothing: ε ∈ [0, 0.5), the label-flip rate.

    Returns:
      f32 ``[P]`` per-pair losses.
    """
    fn = "robust_dpo_loss"
    _dpo_args(fn, logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p, beta)
    _check_smoothing(fn, label_smoothing, upper=0.5, inclusive=False)
    rho_w, rho_l = _log_ratios(logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p)
    z = beta * (rho_w - rho_l)
    eps = label_smoothing
    return (-(1.0 - eps) * jax.nn.log_sigmoid(z) + eps * jax.nn.log_sigmoid(-z)) / (1.0 - 2 * eps)


def ipo_loss(
    logp_chosen_p: chex.Array,
    logp_rejected_p: chex.Array,
    ref_chosen_p: chex.Array,
    ref_rejected_p: chex.Array,
    len_chosen_p: chex.Array,
    len_rejected_p: chex.Array,
    *,
    beta: float,
) -> chex.Array:
    """IPO's squared loss on the length-averaged margin (TRL's form).

        Δ̄ = ρ_w / |y_w| − ρ_l / |y_l|,    ℓ = (Δ̄ − 1/(2β))²

    IPO regresses the margin to the finite target 1/(2β) instead of pushing it to infinity, so
    it does not overfit deterministic preferences. TRL divides the log-ratios by the completion
    lengths (per-token average log-probs); OpenRLHF uses the raw Δ (pass lengths of 1 for that).

    Reference: M. G. Azar, M. Rowland, B. Piot, D. Guo, D. Calandriello, M. Valko, R. Munos, "A
    General Theoretical Paradigm to Understand Learning from Human Preferences",
    arXiv:2310.12036 (2023).

    Args:
      logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p: as in
        :func:`dpo_sigmoid_loss`.
      len_chosen_p, len_rejected_p: completion lengths |y_w|, |y_l|, int or float ``[P]``
        (0 is read as 1).
      beta: β > 0 (the target margin is 1/(2β)).

    Returns:
      f32 ``[P]`` per-pair losses.
    """
    fn = "ipo_loss"
    _check_pairs(
        fn,
        {
            "logp_chosen_p": logp_chosen_p,
            "logp_rejected_p": logp_rejected_p,
            "ref_chosen_p": ref_chosen_p,
            "ref_rejected_p": ref_rejected_p,
        },
        {"len_chosen_p": len_chosen_p, "len_rejected_p": len_rejected_p},
    )
    check_positive(fn, "beta", beta)
    rho_w, rho_l = _log_ratios(logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p)
    margin = rho_w / _length(len_chosen_p) - rho_l / _length(len_rejected_p)
    return jnp.square(margin - 1.0 / (2.0 * beta))


def hinge_loss(
    logp_chosen_p: chex.Array,
    logp_rejected_p: chex.Array,
    ref_chosen_p: chex.Array,
    ref_rejected_p: chex.Array,
    *,
    beta: float,
) -> chex.Array:
    """Hinge loss on the implicit reward margin (SLiC-HF with a reference model).

        ℓ = max(0, 1 − βΔ)

    Reference: Y. Zhao, R. Joshi, T. Liu, M. Khalman, M. Saleh, P. J. Liu, "SLiC-HF: Sequence
    Likelihood Calibration with Human Feedback", arXiv:2305.10425 (2023).

    Args:
      logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p: as in
        :func:`dpo_sigmoid_loss`.
      beta: β > 0 (1/β is the margin in log-ratio units).

    Returns:
      f32 ``[P]`` per-pair losses.
    """
    fn = "hinge_loss"
    _dpo_args(fn, logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p, beta)
    rho_w, rho_l = _log_ratios(logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p)
    return jax.nn.relu(1.0 - beta * (rho_w - rho_l))


def simpo_loss(
    logp_chosen_p: chex.Array,
    logp_rejected_p: chex.Array,
    len_chosen_p: chex.Array,
    len_rejected_p: chex.Array,
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
) -> chex.Array:
    """SimPO: reference-free, length-normalised sigmoid loss with a target margin.

        ℓ = −log σ( β·log π_θ(y_w)/|y_w| − β·log π_θ(y_l)/|y_l| − γ )

    The implicit reward is the average per-token log-prob, scaled by β; γ is the target reward
    margin. The SimPO repository sets γ through ``gamma_beta_ratio`` = γ/β (TRL's CPO trainer
    likewise): β = 2, ratio 0.25 is γ = 0.5, the defaults here.

    Reference: Y. Meng, M. Xia, D. Chen, "SimPO: Simple Preference Optimization with a
    Reference-Free Reward", arXiv:2405.14734 (2024).

    Args:
      logp_chosen_p, logp_rejected_p: policy sequence log-probs of y_w and y_l, float ``[P]``.
      len_chosen_p, len_rejected_p: completion lengths, int or float ``[P]`` (0 is read as 1).
      beta: β > 0.
      gamma: γ ≥ 0, the target margin.

    Returns:
      f32 ``[P]`` per-pair losses.
    """
    fn = "simpo_loss"
    _check_pairs(
        fn,
        {"logp_chosen_p": logp_chosen_p, "logp_rejected_p": logp_rejected_p},
        {"len_chosen_p": len_chosen_p, "len_rejected_p": len_rejected_p},
    )
    check_positive(fn, "beta", beta)
    check_positive(fn, "gamma", gamma, allow_zero=True)
    reward_w = beta * f32(logp_chosen_p) / _length(len_chosen_p)
    reward_l = beta * f32(logp_rejected_p) / _length(len_rejected_p)
    return -jax.nn.log_sigmoid(reward_w - reward_l - gamma)


def preference_rewards(
    logp_chosen_p: chex.Array,
    logp_rejected_p: chex.Array,
    ref_chosen_p: chex.Array,
    ref_rejected_p: chex.Array,
    *,
    beta: float,
) -> tuple[chex.Array, chex.Array]:
    """DPO's implicit rewards, for metrics: (β·ρ_w, β·ρ_l), detached.

    r(x, y) = β·log(π_θ(y|x)/π_ref(y|x)) is the reward under which π_θ is optimal (Rafailov et
    al., arXiv:2305.18290). Their difference is the reward margin, and the fraction of pairs with
    a positive margin is the usual "reward accuracy". ``beta`` has no default on purpose: pass
    the β of the loss.

    Args:
      logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p: as in
        :func:`dpo_sigmoid_loss`.
      beta: β > 0.

    Returns:
      ``(reward_chosen_p, reward_rejected_p)``, f32 ``[P]`` each, under ``stop_gradient``.
    """
    fn = "preference_rewards"
    _dpo_args(fn, logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p, beta)
    rho_w, rho_l = _log_ratios(logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p)
    return _sg(beta * rho_w), _sg(beta * rho_l)
