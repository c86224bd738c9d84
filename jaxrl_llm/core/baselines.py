"""Baselines b subtracted from a sequence score s to form the advantage A = s − b.

Group-level baselines take the sequence scores ``score_bg: f32[B, G]`` of the G completions of
each of B prompts and ``mask_bg: bool[B, G]``, which says which slots are real members of the
prompt's group (groups may have any size 0…G after filtering; shapes stay static under ``jit``).
They return ``f32[B, G]`` baselines that are exactly 0 at non-members; scores of non-members are
never read (they may be NaN/inf).

Singleton rule (one rule for every group baseline here). A group with exactly one member has no
other sample to compare against; the keyword ``singleton_baseline`` decides its baseline:

* ``None`` (default): the member's own score, so its advantage is 0 (the sample teaches nothing;
  TRL and verl's ``rloo_vectorized`` behave this way);
* a float c: the constant c. ``singleton_baseline=0.0`` reproduces verl's ``grpo``, ``rloo`` and
  ``opo`` (advantage = the raw score).

Groups with no member produce only zeros.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp

from jaxrl_llm.core import _contracts


def _check_group(fn: str, name: str, x_bg: chex.Array, mask_bg: chex.Array) -> None:
    """Contract for a float ``[B, G]`` group array and its membership mask."""
    _contracts.check_rank(fn, name, x_bg, 2, "[B, G]")
    _contracts.check_float(fn, name, x_bg)
    _contracts.check_rank(fn, "mask_bg", mask_bg, 2, "[B, G]")
    _contracts.check_bool(fn, "mask_bg", mask_bg)
    _contracts.check_same_shape(fn, {name: x_bg, "mask_bg": mask_bg})


def _check_singleton_baseline(fn: str, singleton_baseline: float | None) -> None:
    if singleton_baseline is not None and not isinstance(singleton_baseline, int | float):
        raise TypeError(
            f"{fn}: argument `singleton_baseline` must be None or a Python float, "
            f"got {type(singleton_baseline).__name__}"
        )


def _finish(
    baseline_bg: chex.Array,
    score_bg: chex.Array,
    count_b: chex.Array,
    mask_bg: chex.Array,
    singleton_baseline: float | None,
) -> chex.Array:
    """Applies the singleton rule, then zeroes non-members."""
    if singleton_baseline is None:
        singleton_bg = score_bg
    else:
        singleton_bg = jnp.full_like(baseline_bg, singleton_baseline)
    baseline_bg = jnp.where((count_b == 1.0)[:, None], singleton_bg, baseline_bg)
    return jnp.where(mask_bg, baseline_bg, 0.0)


def group_count(mask_bg: chex.Array) -> chex.Array:
    """Number of members of each group, n_b = Σ_g m_bg.

    Args:
      mask_bg: ``bool[B, G]`` group membership.

    Returns:
      ``f32[B]`` (f32 so it can be used as a denominator directly).
    """
    fn = "group_count"
    _contracts.check_rank(fn, "mask_bg", mask_bg, 2, "[B, G]")
    _contracts.check_bool(fn, "mask_bg", mask_bg)
    return jnp.sum(mask_bg, axis=-1, dtype=jnp.float32)


def group_mean_baseline(
    score_bg: chex.Array, mask_bg: chex.Array, *, singleton_baseline: float | None = None
) -> chex.Array:
    """Group-mean baseline of GRPO: each member's baseline is the mean score of its group.

        b_i = (1/n) Σ_{j ∈ group} s_j        (n ≥ 2; n = 1: singleton rule)

    Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
    Language Models", arXiv:2402.03300. s − b is Dr. GRPO's advantage; divided by the group std
    (``normalization.scale_by_group_std``) it is GRPO's.

    Args:
      score_bg: float ``[B, G]`` sequence scores (upcast to f32); non-members are never read.
      mask_bg: ``bool[B, G]``, True for real members of prompt b's group.
      singleton_baseline: baseline of a one-member group: ``None`` → its own score (advantage
        0); a float → that constant (verl: 0.0).

    Returns:
      ``f32[B, G]`` baselines, 0 at non-members.
    """
    fn = "group_mean_baseline"
    _check_group(fn, "score_bg", score_bg, mask_bg)
    _check_singleton_baseline(fn, singleton_baseline)
    score_bg = jnp.where(mask_bg, _contracts.f32(score_bg), 0.0)
    count_b = group_count(mask_bg)
    mean_b = jnp.sum(score_bg, axis=-1) / jnp.maximum(count_b, 1.0)
    baseline_bg = jnp.broadcast_to(mean_b[:, None], score_bg.shape)
    return _finish(baseline_bg, score_bg, count_b, mask_bg, singleton_baseline)


def leave_one_out_baseline(
    score_bg: chex.Array, mask_bg: chex.Array, *, singleton_baseline: float | None = None
) -> chex.Array:
    """Leave-one-out (RLOO) baseline: the mean score of the OTHER members of the group.

        b_i = (Σ_{j ∈ group} s_j − s_i) / (n − 1)        (n ≥ 2; n = 1: singleton rule)

    so A_i = s_i − b_i = n/(n − 1)·(s_i − mean), an unbiased baseline since b_i does not depend
    on sample i. Kool, van Hoof and Welling 2019, "Buy 4 REINFORCE Samples, Get a Baseline for
    Free!" (ICLR 2019 workshop); Ahmadian et al. 2024, "Back to Basics: Revisiting
    REINFORCE-Style Optimization for Learning from Human Feedback in LLMs", arXiv:2402.14740.
    verl's two RLOO implementations disagree on singletons: ``rloo`` gives A = s
    (``singleton_baseline=0.0``), ``rloo_vectorized`` gives A = 0 (``None``, our default).

    Args:
      score_bg: float ``[B, G]`` sequence scores (upcast to f32); non-members are never read.
      mask_bg: ``bool[B, G]``, True for real members of prompt b's group.
      singleton_baseline: baseline of a one-member group: ``None`` → its own score (advantage
        0); a float → that constant.

    Returns:
      ``f32[B, G]`` baselines, 0 at non-members.
    """
    fn = "leave_one_out_baseline"
    _check_group(fn, "score_bg", score_bg, mask_bg)
    _check_singleton_baseline(fn, singleton_baseline)
    score_bg = jnp.where(mask_bg, _contracts.f32(score_bg), 0.0)
    count_b = group_count(mask_bg)
    total_b = jnp.sum(score_bg, axis=-1)
    baseline_bg = (total_b[:, None] - score_bg) / jnp.maximum(count_b - 1.0, 1.0)[:, None]
    return _finish(baseline_bg, score_bg, count_b, mask_bg, singleton_baseline)


def length_weighted_baseline(
    score_bg: chex.Array,
    length_bg: chex.Array,
    mask_bg: chex.Array,
    *,
    singleton_baseline: float | None = None,
) -> chex.Array:
    """OPO's optimal baseline: the length-weighted mean score of the group.

        b = Σ_j |y_j|·s_j / Σ_j |y_j|        over the members j of the group

    (the variance-minimising baseline when the gradient norm grows with the length |y|).
    Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv:2505.23585 (verl
    ``opo``, which uses ``singleton_baseline=0.0``). A group whose members all have length 0
    falls back to the plain mean of its scores.

    Args:
      score_bg: float ``[B, G]`` sequence scores (upcast to f32); non-members are never read.
      length_bg: ``[B, G]`` completion lengths |y| ≥ 0 (int or float; upcast to f32).
      mask_bg: ``bool[B, G]``, True for real members of prompt b's group.
      singleton_baseline: baseline of a one-member group: ``None`` → its own score (advantage
        0); a float → that constant.

    Returns:
      ``f32[B, G]`` baselines (the same value for every member of a group), 0 at non-members.
    """
    fn = "length_weighted_baseline"
    _check_group(fn, "score_bg", score_bg, mask_bg)
    _contracts.check_rank(fn, "length_bg", length_bg, 2, "[B, G]")
    if not (
        jnp.issubdtype(length_bg.dtype, jnp.integer)
        or jnp.issubdtype(length_bg.dtype, jnp.floating)
    ):
        raise TypeError(
            f"{fn}: argument `length_bg` must be an int or float array, got dtype {length_bg.dtype}"
        )
    _contracts.check_same_shape(fn, {"score_bg": score_bg, "length_bg": length_bg})
    _check_singleton_baseline(fn, singleton_baseline)
    score_bg = jnp.where(mask_bg, _contracts.f32(score_bg), 0.0)
    weight_bg = jnp.where(mask_bg, _contracts.f32(length_bg), 0.0)
    count_b = group_count(mask_bg)
    weight_b = jnp.sum(weight_bg, axis=-1)
    weighted_b = jnp.sum(weight_bg * score_bg, axis=-1) / jnp.where(weight_b > 0, weight_b, 1.0)
    mean_b = jnp.sum(score_bg, axis=-1) / jnp.maximum(count_b, 1.0)
    baseline_b = jnp.where(weight_b > 0, weighted_b, mean_b)
    baseline_bg = jnp.broadcast_to(baseline_b[:, None], score_bg.shape)
    return _finish(baseline_bg, score_bg, count_b, mask_bg, singleton_baseline)


def given_baseline(score_bg: chex.Array, baseline_b: chex.Array, mask_bg: chex.Array) -> chex.Array:
    """A per-prompt baseline computed elsewhere, broadcast over the prompt's group.

        b_i = baseline_b[prompt(i)]

    ReMax uses the reward of the greedy (argmax-decoded) completion of the same prompt. Li et al.
    2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning
    Large Language Models", arXiv:2310.10505.

    Args:
      score_bg: float ``[B, G]`` sequence scores; only their shape is used (it fixes G).
      baseline_b: float ``[B]`` one baseline per prompt (upcast to f32).
      mask_bg: ``bool[B, G]``, True for real members of prompt b's group.

    Returns:
      ``f32[B, G]`` baselines, 0 at non-members.
    """
    fn = "given_baseline"
    _check_group(fn, "score_bg", score_bg, mask_bg)
    _contracts.check_rank(fn, "baseline_b", baseline_b, 1, "[B]")
    _contracts.check_float(fn, "baseline_b", baseline_b)
    _contracts.check_leading_shape(
        fn, "baseline_b", baseline_b, score_bg.shape[:1], "score_bg[:, 0]"
    )
    return jnp.where(mask_bg, _contracts.f32(baseline_b)[:, None], 0.0)


def critic_baseline(value_bgt: chex.Array, mask_bgt: chex.Array) -> chex.Array:
    """Token-level baseline from a learned critic: b_t = V(s_t) (the baseline inside GAE/PPO).

    Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
    Estimation", arXiv:1506.02438. This only validates, upcasts and masks the critic values;
    values under the mask are never read.

    Args:
      value_bgt: float ``[B, G, T]`` critic values (any shape works; the token axis is last).
      mask_bgt: ``bool``, same shape as ``value_bgt``; True at valid completion tokens.

    Returns:
      f32 array of ``value_bgt``'s shape, 0 under the mask.
    """
    fn = "critic_baseline"
    _contracts.check_float(fn, "value_bgt", value_bgt)
    _contracts.check_bool(fn, "mask_bgt", mask_bgt)
    _contracts.check_same_shape(fn, {"value_bgt": value_bgt, "mask_bgt": mask_bgt})
    return jnp.where(mask_bgt, _contracts.f32(value_bgt), 0.0)


def passk_advantage(
    score_bg: chex.Array,
    mask_bg: chex.Array,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> chex.Array:
    """Pass@k advantage: only the best answer of each group is credited, with its margin.

        i* = argmax_{j ∈ group} s_j  (the first one on ties),   s⁽²⁾ the second-largest score
        A_{i*} = (s_{i*} − s⁽²⁾) / (σ_b + eps)   (÷ only with ``scale_by_std``; σ_b the unbiased
        group std, ``torch.std``),   A_j = 0 for every other member

    Optimising the best of k samples (pass@k) rewards the answer that beats the rest of its
    group, not the mean; groups need at least two members (a one-member group gets 0).

    Reference: arXiv:2503.19595 (the paper verl cites for its pass@k estimator), as implemented
    in verl ``compute_grpo_passk_outcome_advantage``.

    Args:
      score_bg: float ``[B, G]`` sequence scores; non-members are never read.
      mask_bg: ``bool[B, G]`` group membership.
      scale_by_std: divide by the group std plus ``eps``.
      eps: ≥ 0.

    Returns:
      ``f32[B, G]`` advantages (one nonzero entry per group at most), 0 at non-members.
    """
    fn = "passk_advantage"
    _check_group(fn, "score_bg", score_bg, mask_bg)
    _contracts.check_positive(fn, "eps", eps, allow_zero=True)
    score = jnp.where(mask_bg, _contracts.f32(score_bg), -jnp.inf)
    best_b = jnp.argmax(score, axis=-1)
    is_best = jnp.arange(score.shape[-1])[None, :] == best_b[:, None]
    top_b = jnp.max(score, axis=-1)
    second_b = jnp.max(jnp.where(is_best, -jnp.inf, score), axis=-1)
    count_b = group_count(mask_bg)
    margin_b = jnp.where(count_b >= 2, top_b - second_b, 0.0)
    if scale_by_std:
        s = jnp.where(mask_bg, _contracts.f32(score_bg), 0.0)
        mean_b = jnp.sum(s, -1) / jnp.maximum(count_b, 1.0)
        sq_b = jnp.sum(jnp.where(mask_bg, jnp.square(s - mean_b[:, None]), 0.0), -1)
        std_b = jnp.sqrt(jnp.maximum(sq_b / jnp.maximum(count_b - 1.0, 1.0), 0.0))
        margin_b = margin_b / (std_b + eps)
    margin_b = jnp.where(count_b >= 2, margin_b, 0.0)
    return jnp.where(is_best & mask_bg, margin_b[:, None], 0.0)


def gpg_scale(reward_bg: chex.Array, mask_bg: chex.Array, *, f_norm: float = 1.0) -> chex.Array:
    """GPG's batch factor α/F: α = N / #{members with a nonzero reward}, F = ``f_norm``.

        A_i = α·(r_i − mean_group r) / F

    α undoes the dilution of the batch mean by groups that carry no signal (GPG's "gradient
    correction": with binary rewards, all-zero groups give zero advantage but still count in
    the mean). The count is over raw rewards, as in verl.

    Reference: X. Chu et al., "GPG: A Simple and Strong Reinforcement Learning Baseline for
    Model Reasoning", arXiv:2504.02546 (2025); verl ``compute_gpg_outcome_advantage``.

    Args:
      reward_bg: float ``[B, G]`` raw sequence rewards.
      mask_bg: ``bool[B, G]`` membership.
      f_norm: F > 0.

    Returns:
      ``f32[]`` the factor α/F (the nonzero count is floored at 1).
    """
    fn = "gpg_scale"
    _check_group(fn, "reward_bg", reward_bg, mask_bg)
    _contracts.check_positive(fn, "f_norm", f_norm)
    n = jnp.sum(mask_bg, dtype=jnp.float32)
    nonzero = jnp.sum(mask_bg & (_contracts.f32(reward_bg) != 0.0), dtype=jnp.float32)
    return n / jnp.maximum(nonzero, 1.0) / f_norm
