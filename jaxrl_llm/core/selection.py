"""Sample selection and reward shaping: PODS down-sampling, DAPO group filter, overlong penalty.

Group-level inputs follow ``baselines``: ``reward_bg: f32[B, G]`` and ``mask_bg: bool[B, G]``
(which slots are real members of each prompt's group). Rewards of non-members are never read.
Selections are returned as masks (static shapes under ``jit``); the caller gathers or re-masks.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.core import _contracts
from jaxrl_llm.core.baselines import _check_group


def pods_max_variance(reward_bg: chex.Array, mask_bg: chex.Array, *, num_keep: int) -> chex.Array:
    """PODS max-variance down-sampling: keep the m rollouts of each group with the largest variance.

    For each prompt with n members keep m = min(num_keep, n) of them maximising the (population)
    variance of the kept rewards. Xu, Savani, Fang and Kolter 2025, "Not All Rollouts are
    Useful: Down-Sampling Rollouts in LLM Reasoning", arXiv:2504.13818. An optimal subset is
    always the k highest plus the m − k lowest rewards for some k ∈ {0, …, m}, so with the
    members sorted ascending (r₍₁₎ ≤ … ≤ r₍ₙ₎) and prefix sums of r and r²:

        S_k  = Σ_{p ≤ m−k} r₍ₚ₎ + Σ_{p > n−k} r₍ₚ₎,   S2_k likewise with r²,
        m²·Var_k = m·S2_k − S_k²,      k* = the smallest k ∈ {0..m} maximising Var_k.

    O(G log G) per prompt, fully vectorised (one sort, prefix sums). For binary rewards this is
    the most balanced split available (⌊m/2⌋ correct when both ⌊m/2⌋ and ⌈m/2⌉ are possible, by
    the smallest-k rule). m = n keeps every member; a group with no member keeps nothing.

    Deterministic tie rules (the paper leaves ties open):

    1. Between values of k with equal variance, the smallest k wins (fewest from the top).
    2. Among members with equal rewards, the lowest slot indices are kept: if the chosen split
       takes c of the members whose reward equals v, they are the c of them with the smallest
       slot index g, whether v sits at the low end, the high end, or both.

    Variances are compared after subtracting a member's reward (the median member), so integer
    and dyadic rewards (0/1, 0.5) give exactly equal values for equal-variance splits and rule 1
    applies exactly; for other floats, splits whose variances agree to f32 rounding may be
    ordered by the rounding (still deterministic for a given input).

    Args:
      reward_bg: float ``[B, G]`` rewards (upcast to f32); non-members are never read, member
        rewards must be finite.
      mask_bg: ``bool[B, G]`` group membership.
      num_keep: m, the number of rollouts to keep per prompt, a Python int ≥ 1.

    Returns:
      ``bool[B, G]`` keep mask in the original slot order (False at non-members); row b has
      exactly min(num_keep, n_b) True entries.
    """
    fn = "pods_max_variance"
    _check_group(fn, "reward_bg", reward_bg, mask_bg)
    if not isinstance(num_keep, int) or isinstance(num_keep, bool):
        raise TypeError(f"{fn}: argument `num_keep` must be a Python int, got {num_keep!r}")
    _contracts.check_positive(fn, "num_keep", num_keep)
    num_prompts, group_size = reward_bg.shape
    reward_bg = jnp.where(mask_bg, _contracts.f32(reward_bg), 0.0)
    slot_bg = jax.lax.broadcasted_iota(jnp.int32, (num_prompts, group_size), 1)

    # Members first, ascending reward, then slot: a total order, so the sort is deterministic.
    _, sorted_bp, perm_bp = jax.lax.sort(
        (jnp.where(mask_bg, 0, 1), reward_bg, slot_bg), dimension=1, num_keys=3
    )
    pos_bp = slot_bg  # sorted positions p = 0..G-1
    n_b1 = jnp.sum(mask_bg, axis=-1, keepdims=True, dtype=jnp.int32)
    m_b1 = jnp.minimum(num_keep, n_b1)
    member_bp = pos_bp < n_b1

    # Prefix sums of r and r² after subtracting the median member's reward (variance is
    # shift-invariant; this avoids cancellation and keeps integer rewards exact).
    median_b1 = jnp.take_along_axis(sorted_bp, jnp.maximum(n_b1 - 1, 0) // 2, axis=1)
    centred_bp = jnp.where(member_bp, sorted_bp - median_b1, 0.0)
    zeros_b1 = jnp.zeros((num_prompts, 1), jnp.float32)
    sum_bq = jnp.concatenate([zeros_b1, jnp.cumsum(centred_bp, axis=1)], axis=1)
    sum_sq_bq = jnp.concatenate([zeros_b1, jnp.cumsum(jnp.square(centred_bp), axis=1)], axis=1)

    # Candidate splits k = 0..G (k > m invalid): positions [0, m−k) and [n−k, n) are kept.
    k_bk = jax.lax.broadcasted_iota(jnp.int32, (num_prompts, group_size + 1), 1)
    low_end_bk = jnp.clip(m_b1 - k_bk, 0, group_size)
    high_start_bk = jnp.clip(n_b1 - k_bk, 0, group_size)
    at = functools.partial(jnp.take_along_axis, axis=1)
    split_sum = lambda prefix_bq: (
        at(prefix_bq, low_end_bk) + at(prefix_bq, n_b1) - at(prefix_bq, high_start_bk)
    )
    s_bk, s2_bk = split_sum(sum_bq), split_sum(sum_sq_bq)
    objective_bk = m_b1.astype(jnp.float32) * s2_bk - jnp.square(s_bk)
    objective_bk = jnp.where(k_bk <= m_b1, objective_bk, -jnp.inf)
    k_b1 = jnp.argmax(objective_bk, axis=1, keepdims=True).astype(jnp.int32)  # first = smallest k
    chosen_bp = (pos_bp < m_b1 - k_b1) | ((pos_bp >= n_b1 - k_b1) & member_bp)

    # Tie rule 2: inside each run of equal member rewards, move the chosen count to the run's
    # start (lowest slots, since the sort breaks ties by slot). Non-members are runs of one.
    prev_bp = jnp.concatenate([sorted_bp[:, :1], sorted_bp[:, :-1]], axis=1)
    starts_bp = (pos_bp == 0) | (sorted_bp != prev_bp) | ~member_bp
    ends_bp = jnp.concatenate([starts_bp[:, 1:], jnp.ones((num_prompts, 1), bool)], axis=1)
    run_start_bp = jax.lax.cummax(jnp.where(starts_bp, pos_bp, 0), axis=1)
    run_end_bp = jax.lax.cummin(jnp.where(ends_bp, pos_bp + 1, group_size), axis=1, reverse=True)
    zeros_i1 = jnp.zeros((num_prompts, 1), jnp.int32)
    chosen_before_bq = jnp.concatenate(
        [zeros_i1, jnp.cumsum(chosen_bp, axis=1, dtype=jnp.int32)], axis=1
    )
    run_chosen_bp = at(chosen_before_bq, run_end_bp) - at(chosen_before_bq, run_start_bp)
    keep_sorted_bp = member_bp & (pos_bp - run_start_bp < run_chosen_bp)

    rows_b1 = jnp.arange(num_prompts)[:, None]
    return jnp.zeros((num_prompts, group_size), bool).at[rows_b1, perm_bp].set(keep_sorted_bp)


def dapo_group_filter(reward_bg: chex.Array, mask_bg: chex.Array) -> chex.Array:
    """DAPO dynamic sampling: drop prompts whose rollouts all got the same reward.

        keep_b = (n_b = 1) ∨ (n_b ≥ 2 ∧ max_j r_bj ≠ min_j r_bj)      (j over members)

    i.e. keep a prompt iff the population std of its members' rewards is positive, or it has one
    member (verl's recipe keeps singletons); prompts with no member are dropped. An all-equal
    group has zero GRPO advantage and only dilutes the batch. Yu et al. 2025, "DAPO: An
    Open-Source LLM Reinforcement Learning System at Scale", arXiv:2503.14476. "std > 0" is
    evaluated exactly as max ≠ min (verl's ``np.std(...) > 0`` can be fooled by rounding in the
    mean, e.g. three equal rewards of 0.1).

    Args:
      reward_bg: float ``[B, G]`` rewards (upcast to f32); non-members are never read.
      mask_bg: ``bool[B, G]`` group membership.

    Returns:
      ``bool[B]``, True for prompts to keep.
    """
    fn = "dapo_group_filter"
    _check_group(fn, "reward_bg", reward_bg, mask_bg)
    reward_bg = _contracts.f32(reward_bg)
    count_b = jnp.sum(mask_bg, axis=-1, dtype=jnp.int32)
    high_b = jnp.max(jnp.where(mask_bg, reward_bg, -jnp.inf), axis=-1)
    low_b = jnp.min(jnp.where(mask_bg, reward_bg, jnp.inf), axis=-1)
    return (count_b == 1) | ((count_b >= 2) & (high_b != low_b))


def overlong_reward_penalty(
    length_bg: chex.Array,
    *,
    max_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
    cap: bool = True,
) -> chex.Array:
    """DAPO's soft overlong punishment, added to the reward of long completions.

    With L_exp = max_length − buffer_length and φ = penalty_factor:

        penalty = clip(−(|y| − L_exp)/buffer_length · φ, −φ, 0)     (cap=True)
        penalty = min(−(|y| − L_exp)/buffer_length · φ, 0)         (cap=False, verl)

    0 for |y| ≤ L_exp, linear in the buffer, −φ at |y| = max_length. Yu et al. 2025, "DAPO",
    arXiv:2503.14476 (paper: L_max = 20480, buffer 4096, φ = 1). verl's DAPO reward manager does
    not cap, so lengths beyond max_length get less than −φ; OpenRLHF caps the excess at the
    buffer (our default). Elementwise, no mask: add it to the member scores.

    Args:
      length_bg: completion lengths |y| (int or float, any shape, usually ``[B, G]``).
      max_length: L_max, a Python int > 0.
      buffer_length: the buffer, a Python int with 0 < buffer_length ≤ max_length.
      penalty_factor: φ ≥ 0, the penalty at the end of the buffer.
      cap: clip the penalty at −φ (OpenRLHF) instead of letting it grow past max_length (verl).

    Returns:
      f32 penalties ≤ 0, ``length_bg``'s shape.
    """
    fn = "overlong_reward_penalty"
    dtype = getattr(length_bg, "dtype", None)
    if dtype is None or not (
        jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
    ):
        raise TypeError(f"{fn}: argument `length_bg` must be an int or float array, got {dtype}")
    _contracts.check_positive(fn, "max_length", max_length)
    _contracts.check_positive(fn, "buffer_length", buffer_length)
    _contracts.check_positive(fn, "penalty_factor", penalty_factor, allow_zero=True)
    if buffer_length > max_length:
        raise ValueError(
            f"{fn}: argument `buffer_length` ({buffer_length}) must be <= max_length ({max_length})"
        )
    expected_length = max_length - buffer_length
    exceed = _contracts.f32(length_bg) - expected_length
    penalty = jnp.where(exceed > 0.0, -exceed / buffer_length * penalty_factor, 0.0)
    if cap:
        penalty = jnp.maximum(penalty, -float(penalty_factor))
    return penalty
