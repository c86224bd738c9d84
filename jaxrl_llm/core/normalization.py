"""Advantage normalisation: per-group std scaling, batch std scaling, batch whitening.

Centering (subtracting a baseline) lives in ``baselines``; the functions here only rescale, so
GRPO's advantage is two explicit steps:

    adv_bg = score_bg − group_mean_baseline(score_bg, mask_bg)
    adv_bg = scale_by_group_std(adv_bg, score_bg, mask_bg, ddof=1, eps=1e-6)   # verl preset

The std always comes from the scores, whatever is being scaled (a ``[B, G]`` advantage or its
``[B, G, T]`` token broadcast). Division is never by zero: a zero denominator is replaced by 1
(the numerator is then a centred constant, i.e. 0). Peer presets (``docs/numerics.md``):

    verl GRPO      ddof=1, eps=1e-6, singleton_std=1.0
    TRL GRPO       ddof=1, eps=1e-4 (``scale_rewards="batch"``: ``scale_by_batch_std``)
    OpenRLHF       ddof=1, eps=1e-9
"""

from __future__ import annotations

import chex
import jax.numpy as jnp

from jaxrl_llm.core import _contracts, masked
from jaxrl_llm.core.baselines import _check_group, group_count


def _safe_sqrt(var: chex.Array) -> chex.Array:
    """√var with a finite gradient at var = 0 (the gradient there is defined as 0)."""
    positive = var > 0.0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, var, 1.0)), 0.0)


def _safe_denominator(denom: chex.Array) -> chex.Array:
    return jnp.where(denom > 0.0, denom, 1.0)


def _check_hparams(fn: str, ddof: int, eps: float) -> None:
    if not isinstance(ddof, int) or isinstance(ddof, bool):
        raise TypeError(f"{fn}: argument `ddof` must be a Python int, got {ddof!r}")
    _contracts.check_positive(fn, "ddof", ddof, allow_zero=True)
    _contracts.check_positive(fn, "eps", eps, allow_zero=True)


def _check_scaled(fn: str, x: chex.Array, score_bg: chex.Array, mask_bg: chex.Array) -> None:
    """``x`` is ``[B, G]`` or ``[B, G, T]`` with the leading shape of ``score_bg``."""
    _check_group(fn, "score_bg", score_bg, mask_bg)
    _contracts.check_float(fn, "x", x)
    if x.ndim not in (2, 3):
        raise ValueError(
            f"{fn}: argument `x` must have rank 2 [B, G] or 3 [B, G, T], got {x.shape}"
        )
    _contracts.check_leading_shape(fn, "x", x, score_bg.shape, "score_bg")


def _divide(x: chex.Array, denom_b: chex.Array, mask_bg: chex.Array) -> chex.Array:
    """where(member, x / denom_b, 0), broadcasting per-prompt values over G (and T)."""
    x = _contracts.f32(x)
    extra = (None,) * (x.ndim - 1)
    mask = mask_bg if x.ndim == 2 else mask_bg[:, :, None]
    return jnp.where(mask, x / denom_b[(slice(None), *extra)], 0.0)


def group_std(score_bg: chex.Array, mask_bg: chex.Array, *, ddof: int = 0) -> chex.Array:
    """Standard deviation of the member scores of each group.

        σ_b = √( Σ_{j ∈ group} (s_j − μ_b)² / (n_b − ddof) ),   σ_b = 0 when n_b ≤ ddof

    ``ddof=0`` is the population std (``jnp.std``, ``np.std``: DAPO's filter); ``ddof=1`` is
    ``torch.std`` (verl, TRL and OpenRLHF group normalisation). Two-pass (the mean is
    subtracted before squaring), so an all-equal group gives exactly 0.

    Args:
      score_bg: float ``[B, G]`` sequence scores (upcast to f32); non-members are never read.
      mask_bg: ``bool[B, G]`` group membership.
      ddof: delta degrees of freedom, a Python int ≥ 0.

    Returns:
      ``f32[B]``; 0 for groups with n ≤ ddof (empty groups included), never NaN.
    """
    fn = "group_std"
    _check_group(fn, "score_bg", score_bg, mask_bg)
    _check_hparams(fn, ddof, 0.0)
    score_bg = jnp.where(mask_bg, _contracts.f32(score_bg), 0.0)
    count_b = group_count(mask_bg)
    mean_b = jnp.sum(score_bg, axis=-1) / jnp.maximum(count_b, 1.0)
    centred_bg = jnp.where(mask_bg, score_bg - mean_b[:, None], 0.0)
    sum_sq_b = jnp.sum(jnp.square(centred_bg), axis=-1)
    var_b = jnp.where(count_b > ddof, sum_sq_b / jnp.maximum(count_b - ddof, 1.0), 0.0)
    return _safe_sqrt(var_b)


def scale_by_group_std(
    x: chex.Array,
    score_bg: chex.Array,
    mask_bg: chex.Array,
    *,
    ddof: int = 0,
    eps: float = 1e-6,
    singleton_std: float = 1.0,
) -> chex.Array:
    """Divides by the std of each group's scores: GRPO's normalisation.

        x̂ = x / (σ_b + eps),   σ_b = group_std(score, ddof)   (σ_b := singleton_std if n_b = 1)

    Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300. Leaving this step out is Dr. GRPO (Liu
    et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective",
    arXiv:2503.20783). A one-member group uses σ = ``singleton_std`` (1.0, verl's rule). If
    σ_b + eps = 0 (an all-equal group with ``eps=0``) the group is divided by 1 instead, so
    centred advantages stay exactly 0, never NaN. The result is invariant to a shift of a
    group's scores and, for centred x, to a positive rescaling of them (up to eps).

    Args:
      x: float ``[B, G]`` or ``[B, G, T]`` values to scale (e.g. centred advantages), upcast to
        f32. Only group membership is masked: with ``[B, G, T]`` the token padding of x is
        divided like any value, so pass x already 0 there (as every ``core`` output is).
      score_bg: float ``[B, G]`` sequence scores the std is computed from.
      mask_bg: ``bool[B, G]`` group membership.
      ddof: delta degrees of freedom of σ (0: population, 1: ``torch.std``).
      eps: ≥ 0, added to σ (verl 1e-6, TRL 1e-4, OpenRLHF 1e-9).
      singleton_std: σ used for one-member groups, > 0.

    Returns:
      f32 array of ``x``'s shape, 0 at non-members.
    """
    fn = "scale_by_group_std"
    _check_scaled(fn, x, score_bg, mask_bg)
    _check_hparams(fn, ddof, eps)
    _contracts.check_positive(fn, "singleton_std", singleton_std)
    std_b = group_std(score_bg, mask_bg, ddof=ddof)
    std_b = jnp.where(group_count(mask_bg) == 1.0, jnp.float32(singleton_std), std_b)
    return _divide(x, _safe_denominator(std_b + eps), mask_bg)


def scale_by_batch_std(
    x: chex.Array,
    score_bg: chex.Array,
    mask_bg: chex.Array,
    *,
    ddof: int = 0,
    eps: float = 1e-6,
    axis_name: str | None = None,
) -> chex.Array:
    """Divides by one std taken over every member score of the batch.

        x̂ = x / (σ + eps),   σ = std of {s_bg : m_bg} over all prompts (0 when N ≤ ddof)

    TRL GRPO's ``scale_rewards="batch"`` (with ``ddof=1, eps=1e-4``; centring stays per group),
    after Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783, and Hu et al.
    2025, "REINFORCE++", arXiv:2501.03262 (batch-level rather than group-level scale). If
    σ + eps = 0 the values are divided by 1 (never NaN).

    Args:
      x: float ``[B, G]`` or ``[B, G, T]`` values to scale, upcast to f32 (token padding of a
        ``[B, G, T]`` x is divided like any value: pass x already 0 there).
      score_bg: float ``[B, G]`` sequence scores the std is computed from.
      mask_bg: ``bool[B, G]`` group membership.
      ddof: delta degrees of freedom of σ.
      eps: ≥ 0, added to σ.
      axis_name: if given (inside ``jax.shard_map``), σ is computed over the global batch by
        ``psum`` over this axis.

    Returns:
      f32 array of ``x``'s shape, 0 at non-members.
    """
    fn = "scale_by_batch_std"
    _check_scaled(fn, x, score_bg, mask_bg)
    _check_hparams(fn, ddof, eps)
    var = masked.masked_var(score_bg, mask_bg, ddof=ddof, axis_name=axis_name)
    denom = _safe_denominator(_safe_sqrt(var) + eps)
    return _divide(x, jnp.broadcast_to(denom, score_bg.shape[:1]), mask_bg)


def batch_whiten(
    adv_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    ddof: int = 0,
    eps: float = 1e-8,
    eps_as_floor: bool = False,
    shift_mean: bool = True,
    axis_name: str | None = None,
) -> chex.Array:
    """Whitens advantages over every valid token of the batch (batch-global, not per group).

        Â = (A − μ)·rsqrt(σ² + eps)          (verl; ``eps_as_floor=True``: rsqrt(max(σ², eps)))

    with μ, σ² (``ddof``) over all tokens under the mask. REINFORCE++ (Hu et al. 2025,
    "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
    arXiv:2501.03262) and PPO's advantage whitening. A thin wrapper over
    ``masked.masked_whiten``. Presets: verl ``ddof=1, eps=1e-8``; OpenRLHF ``ddof=0, eps=1e-8,
    eps_as_floor=True``. ``shift_mean=False`` adds μ back (rescale only).

    Args:
      adv_bgt: float advantages ``[B, G, T]`` (any shape works), upcast to f32.
      mask_bgt: ``bool``, same shape; True at valid tokens. Values under the mask are ignored.
      ddof: delta degrees of freedom of σ² (σ² = 0 when N ≤ ddof).
      eps: > 0 (see the formula).
      eps_as_floor: floor the variance at eps instead of adding eps.
      shift_mean: if False, μ is added back after scaling.
      axis_name: if given (inside ``jax.shard_map``), μ and σ² are ``psum``-ed over this axis.

    Returns:
      f32 array of ``adv_bgt``'s shape, 0 under the mask; all zeros for an empty mask.
    """
    fn = "batch_whiten"
    _contracts.check_float(fn, "adv_bgt", adv_bgt)
    _contracts.check_bool(fn, "mask_bgt", mask_bgt)
    _contracts.check_same_shape(fn, {"adv_bgt": adv_bgt, "mask_bgt": mask_bgt})
    _check_hparams(fn, ddof, eps)
    _contracts.check_positive(fn, "eps", eps)
    return masked.masked_whiten(
        adv_bgt,
        mask_bgt,
        shift_mean=shift_mean,
        ddof=ddof,
        eps=eps,
        eps_as_floor=eps_as_floor,
        axis_name=axis_name,
    )


def normalize_then_sum(
    reward_bgk: chex.Array,
    mask_bg: chex.Array,
    *,
    weights: tuple[float, ...] | None = None,
    eps: float = 1e-4,
) -> chex.Array:
    """GDPO's multi-reward aggregation: normalise each reward in its group, then sum.

        ẑ_bgk = (r_bgk − mean_g r_bgk) / (σ_bk + eps)     (σ: unbiased std over the group)
        R_bg = Σ_k w_k ẑ_bgk
        A_bg = (R_bg − mean R) / (σ(R) + eps)              (mean, unbiased σ over the batch)

    Summing raw rewards first lets one reward with a wide range drown the others and collapses
    distinct reward combinations onto the same advantage; normalising each one first keeps
    their resolution. Groups of one get ẑ = 0 (TRL: std 0 when G = 1 → 0/eps·0).

    Reference: "GDPO: Group reward-Decoupled Normalization Policy Optimization for
    Multi-reward RL Optimization", arXiv:2601.05242 (2026); TRL 1.16 GRPOTrainer
    ``multi_objective_aggregation="normalize_then_sum"``.

    Args:
      reward_bgk: float ``[B, G, K]``, K rewards per completion.
      mask_bg: ``bool[B, G]`` membership.
      weights: K weights (default all 1).
      eps: > 0, added to both stds.

    Returns:
      ``f32[B, G]`` advantages, 0 at non-members.
    """
    fn = "normalize_then_sum"
    _contracts.check_rank(fn, "reward_bgk", reward_bgk, 3, "[B, G, K]")
    _contracts.check_float(fn, "reward_bgk", reward_bgk)
    _contracts.check_leading_shape(fn, "reward_bgk", reward_bgk, tuple(mask_bg.shape), "mask_bg")
    _contracts.check_bool(fn, "mask_bg", mask_bg)
    _contracts.check_positive(fn, "eps", eps)
    k = reward_bgk.shape[-1]
    if weights is None:
        weights = (1.0,) * k
    if len(weights) != k:
        raise ValueError(f"{fn}: argument `weights` has {len(weights)} entries for K = {k} rewards")
    m = mask_bg[..., None]
    r = jnp.where(m, _contracts.f32(reward_bgk), 0.0)
    count_b1 = jnp.sum(m, axis=1, keepdims=True, dtype=jnp.float32)
    mean = jnp.sum(r, axis=1, keepdims=True) / jnp.maximum(count_b1, 1.0)
    sq = jnp.sum(jnp.where(m, jnp.square(r - mean), 0.0), axis=1, keepdims=True)
    std = jnp.where(count_b1 > 1, _safe_sqrt(sq / jnp.maximum(count_b1 - 1.0, 1.0)), 0.0)
    z = jnp.where(m, (r - mean) / (std + eps), 0.0)
    total_bg = jnp.sum(z * jnp.asarray(weights, jnp.float32)[None, None, :], axis=-1)
    n = jnp.sum(mask_bg, dtype=jnp.float32)
    mu = jnp.sum(jnp.where(mask_bg, total_bg, 0.0)) / jnp.maximum(n, 1.0)
    var = jnp.sum(jnp.where(mask_bg, jnp.square(total_bg - mu), 0.0)) / jnp.maximum(n - 1.0, 1.0)
    sigma = jnp.where(n > 1, _safe_sqrt(var), 0.0)
    return jnp.where(mask_bg, (total_bg - mu) / (sigma + eps), 0.0)
