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


def _margin(
    logp_chosen_p: chex.Array,
    logp_rejected_p: chex.Array,
    ref_chosen_p: chex.Array,
    ref_rejected_p: chex.Array,
) -> chex.Array:
    """Δ = ρ_w − ρ_l."""
    rho_w, rho_l = _log_ratios(logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p)
    return rho_w - rho_l


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


def exo_pair_loss(
    logp_chosen_p: chex.Array,
    logp_rejected_p: chex.Array,
    ref_chosen_p: chex.Array,
    ref_rejected_p: chex.Array,
    *,
    beta: float = 0.1,
    label_smoothing: float = 1e-3,
) -> chex.Array:
    """EXO (pairwise): the reverse KL from the label distribution to the policy's pair softmax.

        q = σ(βΔ),   ℓ = q·(log q − log(1 − ε)) + (1 − q)·(log(1 − q) − log ε)
          = KL( [q, 1 − q] ‖ [1 − ε, ε] )

    DPO minimises the *forward* KL between the same two distributions over {y_w, y_l}; EXO's
    reverse KL is mode-seeking. ε > 0 is required (ε = 0 makes log ε infinite; the paper and TRL
    use 1e-3). ℓ ≥ 0, with its minimum at σ(βΔ) = 1 − ε.

    Reference: H. Ji, C. Lu, Y. Niu, P. Ke, H. Wang, J. Zhu, J. Tang, M. Huang, "Towards
    Efficient Exact Optimization of Language Model Alignment", arXiv:2402.00856 (2024), Eq. 16.
    TRL: ``loss_type="exo_pair"``.

    Args:
      logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p: as in
        :func:`dpo_sigmoid_loss`.
      beta: β > 0.
      label_smoothing: ε ∈ (0, 1), the label distribution's mass on the rejected answer.

    Returns:
      f32 ``[P]`` per-pair losses.
    """
    fn = "exo_pair_loss"
    _dpo_args(fn, logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p, beta)
    if not 0.0 < label_smoothing < 1.0:
        raise ValueError(
            f"{fn}: argument `label_smoothing` must be in (0, 1) (EXO needs log ε; the paper "
            f"uses 1e-3), got {label_smoothing!r}"
        )
    z = beta * _margin(logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p)
    log_q_w, log_q_l = jax.nn.log_sigmoid(z), jax.nn.log_sigmoid(-z)
    eps = label_smoothing
    return jnp.exp(log_q_w) * (log_q_w - jnp.log1p(-eps)) + jnp.exp(log_q_l) * (
        log_q_l - jnp.log(eps)
    )


def nca_pair_loss(
    logp_chosen_p: chex.Array,
    logp_rejected_p: chex.Array,
    ref_chosen_p: chex.Array,
    ref_rejected_p: chex.Array,
    *,
    beta: float = 0.1,
) -> chex.Array:
    """NCA (pairwise): noise-contrastive alignment on the absolute implicit rewards.

        r_w = βρ_w,  r_l = βρ_l,   ℓ = −log σ(r_w) − ½·log σ(−r_w) − ½·log σ(−r_l)

    Unlike DPO (which only sees the margin r_w − r_l) NCA also raises the chosen answer's
    likelihood in absolute terms, so it does not let both log-probs fall together.

    Reference: H. Chen, G. He, L. Yuan, G. Cui, H. Su, J. Zhu, "Noise Contrastive Alignment of
    Language Models with Explicit Rewards", arXiv:2402.05369 (2024). TRL: ``"nca_pair"``.

    Args:
      logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p: as in
        :func:`dpo_sigmoid_loss`.
      beta: β > 0.

    Returns:
      f32 ``[P]`` per-pair losses.
    """
    _dpo_args("nca_pair_loss", logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p, beta)
    rho_w, rho_l = _log_ratios(logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p)
    r_w, r_l = beta * rho_w, beta * rho_l
    return (
        -jax.nn.log_sigmoid(r_w) - 0.5 * jax.nn.log_sigmoid(-r_w) - 0.5 * jax.nn.log_sigmoid(-r_l)
    )


def bco_pair_loss(
    logp_chosen_p: chex.Array,
    logp_rejected_p: chex.Array,
    ref_chosen_p: chex.Array,
    ref_rejected_p: chex.Array,
    *,
    beta: float = 0.1,
) -> chex.Array:
    """BCO (pairwise): a binary classifier of chosen vs rejected on the implicit reward.

        ℓ = −log σ(βρ_w) − log σ(−βρ_l)

    The BCO paper's classifier also subtracts a running mean δ of the rewards (its "reward
    shift"); TRL's paired ``"bco_pair"`` — reproduced here — uses none (δ = 0).

    Reference: S. Jung, G. Han, D. W. Nam, K.-W. On, "Binary Classifier Optimization for Large
    Language Model Alignment", arXiv:2404.04656 (2024).

    Args:
      logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p: as in
        :func:`dpo_sigmoid_loss`.
      beta: β > 0.

    Returns:
      f32 ``[P]`` per-pair losses.
    """
    _dpo_args("bco_pair_loss", logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p, beta)
    rho_w, rho_l = _log_ratios(logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p)
    return -jax.nn.log_sigmoid(beta * rho_w) - jax.nn.log_sigmoid(-beta * rho_l)


def sppo_hard_loss(
    logp_chosen_p: chex.Array,
    logp_rejected_p: chex.Array,
    ref_chosen_p: chex.Array,
    ref_rejected_p: chex.Array,
    *,
    beta: float = 0.1,
) -> chex.Array:
    """SPPO with hard win probabilities: each log-ratio regressed to ±1/(2β) on its own.

        ℓ = (ρ_w − 1/(2β))² + (ρ_l + 1/(2β))²

    SPPO's target is ``η·(P(y ≻ π) − ½)`` with P estimated by a preference model; the "hard"
    form sets P = 1 for the chosen and 0 for the rejected answer (η = 1/β), as TRL's
    ``"sppo_hard"`` does.

    Reference: Y. Wu, Z. Sun, H. Yuan, K. Ji, Y. Yang, Q. Gu, "Self-Play Preference Optimization
    for Language Model Alignment", arXiv:2405.00675 (2024), Eq. 4.7.

    Args:
      logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p: as in
        :func:`dpo_sigmoid_loss`.
      beta: β > 0.

    Returns:
      f32 ``[P]`` per-pair losses.
    """
    _dpo_args("sppo_hard_loss", logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p, beta)
    rho_w, rho_l = _log_ratios(logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p)
    target = 0.5 / beta
    return jnp.square(rho_w - target) + jnp.square(rho_l + target)


def aot_loss(
    logp_chosen_p: chex.Array,
    logp_rejected_p: chex.Array,
    ref_chosen_p: chex.Array,
    ref_rejected_p: chex.Array,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    paired: bool = True,
) -> chex.Array:
    """AOT: distributional alignment by optimal transport — DPO's loss on *sorted* quantities.

    paired (``"aot"``): the policy's margins m = log π(y_w) − log π(y_l) and the reference's
    m_ref, each sorted over the batch, δ_i = m_(i) − m_ref(i);
    unpaired (``"aot_unpaired"``, TRL's former ``"aot_pair"``): δ_i = ρ_w(i) − ρ_l(i), the
    chosen and the rejected log-ratios each sorted over the batch. Then

        ℓ_i = −(1 − ε)·log σ(βδ_i) − ε·log σ(−βδ_i)

    Sorting makes the loss a first-order stochastic-dominance condition between the two
    distributions (chosen rewards dominate rejected ones quantile by quantile), so ``ℓ_i``
    belongs to the i-th quantile, not to pair i: the loss depends on the whole batch it is
    given. Like TRL (which sorts per device micro-batch) this sorts within the call, so split
    a batch into micro-batches only when that is what you want.

    Reference: I. Melnyk, Y. Mroueh, B. Belgodere, M. Rigotti, A. Nitsure, M. Yurochkin, K.
    Greenewald, J. Navratil, J. Ross, "Distributional Preference Alignment of LLMs via Optimal
    Transport", arXiv:2406.05882 (2024).

    Args:
      logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p: as in
        :func:`dpo_sigmoid_loss`.
      beta: β > 0.
      label_smoothing: ε ∈ [0, 0.5].
      paired: sort the margins (True) or the chosen and rejected log-ratios separately.

    Returns:
      f32 ``[P]`` losses, one per quantile (their mean is the batch loss).
    """
    fn = "aot_loss"
    _dpo_args(fn, logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p, beta)
    _check_smoothing(fn, label_smoothing, upper=0.5, inclusive=True)
    if paired:
        margin = f32(logp_chosen_p) - f32(logp_rejected_p)
        ref_margin = _sg(f32(ref_chosen_p) - f32(ref_rejected_p))
        delta = jnp.sort(margin) - jnp.sort(ref_margin)
    else:
        rho_w, rho_l = _log_ratios(logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p)
        delta = jnp.sort(rho_w) - jnp.sort(rho_l)
    z = beta * delta
    eps = label_smoothing
    return -(1.0 - eps) * jax.nn.log_sigmoid(z) - eps * jax.nn.log_sigmoid(-z)


def apo_loss(
    logp_chosen_p: chex.Array,
    logp_rejected_p: chex.Array,
    ref_chosen_p: chex.Array,
    ref_rejected_p: chex.Array,
    *,
    beta: float = 0.1,
    anchor: str = "zero",
) -> chex.Array:
    """APO: anchored preference optimisation — which way each likelihood must move is explicit.

        zero: ℓ = (1 − σ(βρ_w)) + σ(βρ_l)        (chosen answers better than the model's own:
                                                  raise chosen, lower rejected)
        down: ℓ = σ(βρ_w) + (1 − σ(β(ρ_w − ρ_l))) (chosen answers worse than the model's own:
                                                  lower both, rejected more)

    Reference: K. D'Oosterlinck, W. Xu, C. Develder, T. Demeester, A. Singh, C. Potts, D. Kiela,
    S. Mehri, "Anchored Preference Optimization and Contrastive Revisions: Addressing
    Underspecification in Alignment", arXiv:2408.06266 (2024), Eqs. 7 and 8. TRL:
    ``"apo_zero"`` / ``"apo_down"``.

    Args:
      logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p: as in
        :func:`dpo_sigmoid_loss`.
      beta: β > 0.
      anchor: ``"zero"`` or ``"down"``.

    Returns:
      f32 ``[P]`` per-pair losses.
    """
    fn = "apo_loss"
    _dpo_args(fn, logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p, beta)
    if anchor not in ("zero", "down"):
        raise ValueError(f"{fn}: argument `anchor` must be 'zero' or 'down', got {anchor!r}")
    rho_w, rho_l = _log_ratios(logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p)
    if anchor == "zero":
        return (1.0 - jax.nn.sigmoid(beta * rho_w)) + jax.nn.sigmoid(beta * rho_l)
    return jax.nn.sigmoid(beta * rho_w) + (1.0 - jax.nn.sigmoid(beta * (rho_w - rho_l)))


def discopop_loss(
    logp_chosen_p: chex.Array,
    logp_rejected_p: chex.Array,
    ref_chosen_p: chex.Array,
    ref_rejected_p: chex.Array,
    *,
    beta: float = 0.1,
    tau: float = 0.05,
) -> chex.Array:
    """DiscoPOP (log-ratio modulated loss): a sigmoid-gated blend of the logistic and the
    exponential loss, discovered by an LLM-driven objective search.

        z = βΔ,   m = σ(z/τ),   ℓ = (1 − m)·(−log σ(z)) + m·exp(−z)

    The gradient flows through the gate m too (as in TRL).

    Reference: C. Lu, S. Holt, C. Fanconi, A. J. Chan, J. Foerster, M. van der Schaar, R. T.
    Lange, "Discovering Preference Optimization Algorithms with and for Large Language Models",
    arXiv:2406.08414 (2024), Eq. 5. TRL: ``"discopop"`` with ``discopop_tau`` (default 0.05).

    Args:
      logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p: as in
        :func:`dpo_sigmoid_loss`.
      beta: β > 0.
      tau: τ > 0, the gate's temperature.

    Returns:
      f32 ``[P]`` per-pair losses.
    """
    fn = "discopop_loss"
    _dpo_args(fn, logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p, beta)
    check_positive(fn, "tau", tau)
    z = beta * _margin(logp_chosen_p, logp_rejected_p, ref_chosen_p, ref_rejected_p)
    gate = jax.nn.sigmoid(z / tau)
    return (1.0 - gate) * -jax.nn.log_sigmoid(z) + gate * jnp.exp(-z)


def wpo_weights(
    logp_bt: chex.Array, log_sum_sq_probs_bt: chex.Array, mask_bt: chex.Array
) -> chex.Array:
    """WPO's per-sequence weight: how likely the policy is to produce the (off-policy) answer.

        w(y) = exp( (1/|y|)·Σ_t [log π(y_t | y_<t) − log Σ_v π(v | y_<t)²] )

    The "aligned" log-prob subtracts ``log Σ_v π(v)²`` — the log-prob a token would have on
    average under the policy itself — so a confident but typical answer is not down-weighted.
    A pair's loss is multiplied by ``w(y_w)·w(y_l)`` (:func:`wpo_pair_weights`); the weights are
    constants (``stop_gradient``). |y| = 0 is read as 1.

    Reference: W. Zhou, R. Agrawal, S. Zhang, S. R. Indurthi, S. Zhao, K. Song, S. Xu, C. Zhu,
    "WPO: Enhancing RLHF with Weighted Preference Optimization", arXiv:2406.11827 (2024), Eq. 2.
    TRL: ``use_weighting=True``.

    Args:
      logp_bt: per-token log-probs of the answer's tokens, float ``[B, T]``.
      log_sum_sq_probs_bt: ``log Σ_v π(v)²`` at each position, float ``[B, T]``.
      mask_bt: completion-token mask, bool ``[B, T]``.

    Returns:
      f32 ``[B]`` weights in (0, ∞).
    """
    fn = "wpo_weights"
    for name, x in (("logp_bt", logp_bt), ("log_sum_sq_probs_bt", log_sum_sq_probs_bt)):
        check_rank(fn, name, x, 2, "[B, T]")
        check_float(fn, name, x)
    check_rank(fn, "mask_bt", mask_bt, 2, "[B, T]")
    check_bool(fn, "mask_bt", mask_bt)
    check_same_shape(fn, {"logp_bt": logp_bt, "log_sum_sq": log_sum_sq_probs_bt, "mask": mask_bt})
    aligned_bt = jnp.where(mask_bt, f32(logp_bt) - f32(log_sum_sq_probs_bt), 0.0)
    mean_b = aligned_bt.sum(-1) / jnp.maximum(mask_bt.sum(-1), 1).astype(jnp.float32)
    return _sg(jnp.exp(mean_b))


def wpo_pair_weights(weight_chosen_p: chex.Array, weight_rejected_p: chex.Array) -> chex.Array:
    """WPO's pair weight ``w(y_w)·w(y_l)`` (:func:`wpo_weights`), a constant, ``f32[P]``."""
    _check_pairs(
        "wpo_pair_weights",
        {"weight_chosen_p": weight_chosen_p, "weight_rejected_p": weight_rejected_p},
        {},
    )
    return _sg(f32(weight_chosen_p) * f32(weight_rejected_p))


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
