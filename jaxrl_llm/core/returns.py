"""Credit assignment over tokens: discounted returns and generalised advantage estimation.

Each estimator is written for ONE sequence (rank-1 ``[T]`` arrays) as a backward
``jax.lax.scan`` with a small local ``_body``, in the style of rlax's
``truncated_generalized_advantage_estimation``; the ``*_t`` function is the documented
primitive. The batched function lifts it with ``jax.vmap`` over every leading axis, which XLA
runs as one scan over T whose body is vectorised over the batch (no Python loop over time).

Masked tokens (right padding, or observation/tool spans inside a multi-turn completion) are
skipped by the recursion: the running accumulators are carried through them unchanged, and
their outputs are exactly 0. Rewards and values under the mask are never read, so they may be
anything, NaN included. This is verl's semantics (``compute_gae_advantage_return`` and, since
verl #7278/#7300, ``reinforce_plus_plus``).

``skip_masked=False`` is OpenRLHF's instead (``RemoteExperienceMaker.get_advantages_and_returns``
and ``get_cumulative_returns`` in ``openrlhf/trainer/ppo_utils/experience_maker.py``, 0.11.2):
rewards and values are multiplied by the mask (a hole token has r = V = 0) and the textbook
recursion runs over every position, so a hole is a zero-reward step that is discounted (γ, and
γλ in GAE) and whose zero value enters its neighbour's TD error. For right padding only (no
interior holes) both semantics give the same numbers on the valid tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.core import _contracts


def _check_unit_interval(fn: str, name: str, value: float) -> None:
    if isinstance(value, int | float) and not 0.0 <= value <= 1.0:
        raise ValueError(f"{fn}: argument `{name}` must be in [0, 1], got {value!r}")


def _check_sequence(fn: str, arrays: dict[str, chex.Array], mask_name: str) -> None:
    """Rank 1 float data and a bool mask, all of the same shape ``[T]``."""
    for name, x in arrays.items():
        _contracts.check_rank(fn, name, x, 1, "[T]")
        if name == mask_name:
            _contracts.check_bool(fn, name, x)
        else:
            _contracts.check_float(fn, name, x)
    _contracts.check_same_shape(fn, arrays)


def _check_batch(fn: str, arrays: dict[str, chex.Array], mask_name: str) -> None:
    """Rank ≥ 1 float data and a bool mask, all of the same shape ``[..., T]``."""
    for name, x in arrays.items():
        if getattr(x, "ndim", 0) < 1:
            raise ValueError(f"{fn}: argument `{name}` must have rank >= 1 [..., T]")
        if name == mask_name:
            _contracts.check_bool(fn, name, x)
        else:
            _contracts.check_float(fn, name, x)
    _contracts.check_same_shape(fn, arrays)


def _vmap_leading(fn: Callable, ndim: int) -> Callable:
    """Lifts a function of ``[T]`` arrays to ``[..., T]`` arrays (``ndim − 1`` leading axes)."""
    for _ in range(ndim - 1):
        fn = jax.vmap(fn)
    return fn


def discounted_returns_t(
    reward_t: chex.Array, mask_t: chex.Array, *, gamma: float, skip_masked: bool = True
) -> chex.Array:
    """Discounted reward-to-go of one sequence, skipping masked tokens.

        G_t = r_t + γ·G_{t'}   if m_t,   with t' the next valid token (G = 0 past the end)
        G_t := G_{t+1}         if not m_t (carried through unchanged, no discount; output 0)

    With ``skip_masked=False`` (OpenRLHF's ``get_cumulative_returns``) every position is a step:
    ``G_t = m_t·r_t + γ·G_{t+1}``, so each hole token discounts the return once more.

    This is the return of REINFORCE (Williams 1992, "Simple statistical gradient-following
    algorithms for connectionist reinforcement learning") and REINFORCE++ (Hu et al. 2025,
    arXiv:2501.03262), with verl's multi-turn rule (#7278/#7300): an observation span between
    two assistant turns neither resets nor discounts the return.

    Args:
      reward_t: float ``[T]`` token rewards (upcast to f32); entries under the mask are ignored.
      mask_t: ``bool[T]``, True on the tokens the policy generated.
      gamma: discount γ ∈ [0, 1].
      skip_masked: carry the return through masked tokens (verl) or discount at them as
        zero-reward steps (OpenRLHF).

    Returns:
      f32 ``[T]`` returns, 0 where ``mask_t`` is False.
    """
    fn = "discounted_returns_t"
    _check_sequence(fn, {"reward_t": reward_t, "mask_t": mask_t}, "mask_t")
    _check_unit_interval(fn, "gamma", gamma)

    def _body(acc: chex.Array, xs: tuple[chex.Array, chex.Array]) -> tuple[chex.Array, chex.Array]:
        r, m = xs
        if skip_masked:
            acc = jnp.where(m, r + gamma * acc, acc)
        else:
            acc = jnp.where(m, r, 0.0) + gamma * acc
        return acc, acc

    reward_t = _contracts.f32(reward_t)
    # The initial carry is derived from the input so that, inside shard_map, it has the same
    # (varying) manual-axis type as the carry the body returns.
    zero = jnp.zeros_like(reward_t[0])
    _, return_t = jax.lax.scan(_body, zero, (reward_t, mask_t), reverse=True)
    return jnp.where(mask_t, return_t, 0.0)


def discounted_returns(
    reward_bgt: chex.Array, mask_bgt: chex.Array, *, gamma: float, skip_masked: bool = True
) -> chex.Array:
    """``discounted_returns_t`` over every sequence of a batch (any leading shape).

    Args:
      reward_bgt: float ``[..., T]`` (e.g. ``[B, G, T]``), upcast to f32.
      mask_bgt: ``bool``, same shape as ``reward_bgt``.
      gamma: discount γ ∈ [0, 1].
      skip_masked: see :func:`discounted_returns_t` (the two agree when ``gamma == 1``).

    Returns:
      f32 ``[..., T]`` returns, 0 under the mask.

    With ``gamma == 1`` (a Python number) the recursion is a plain reverse cumulative sum of the
    masked rewards, ``G_t = Σ_{t' ≥ t} m_t' r_t'``, computed as such: the same numbers as the
    scan (masked spans add nothing and pass the sum through) at about half the cost on CPU.
    """
    fn = "discounted_returns"
    _check_batch(fn, {"reward_bgt": reward_bgt, "mask_bgt": mask_bgt}, "mask_bgt")
    _check_unit_interval(fn, "gamma", gamma)
    if isinstance(gamma, int | float) and gamma == 1:
        reward_bgt = jnp.where(mask_bgt, _contracts.f32(reward_bgt), 0.0)
        return_bgt = jax.lax.cumsum(reward_bgt, axis=reward_bgt.ndim - 1, reverse=True)
        return jnp.where(mask_bgt, return_bgt, 0.0)
    one = lambda r, m: discounted_returns_t(r, m, gamma=gamma, skip_masked=skip_masked)
    return _vmap_leading(one, reward_bgt.ndim)(reward_bgt, mask_bgt)


def gae_t(
    reward_t: chex.Array,
    value_t: chex.Array,
    mask_t: chex.Array,
    *,
    gamma: float,
    lam: float,
    skip_masked: bool = True,
) -> tuple[chex.Array, chex.Array]:
    """Generalised advantage estimation for one sequence, skipping masked tokens.

    Schulman, Moritz, Levine, Jordan, Abbeel 2016, "High-Dimensional Continuous Control Using
    Generalized Advantage Estimation", arXiv:1506.02438. With verl's masking semantics,
    for t = T−1 … 0, starting from V_next = 0 and A_next = 0 (no bootstrap after the last token):

        δ_t = r_t + γ·V_next − V_t
        A_t = δ_t + γλ·A_next
        if m_t:  V_next ← V_t,  A_next ← A_t      (else both are carried through unchanged)
        R_t = A_t + V_t                              (the value target)

    So V_next is the value of the next *valid* token and masked spans are invisible to the
    recursion. λ = 1, V = 0 gives the discounted return; λ = 0 gives the one-step TD error.

    With ``skip_masked=False`` (OpenRLHF's ``get_advantages_and_returns``) the recursion is the
    textbook one over every position on ``r·m`` and ``V·m``: ``δ_t = m_t r_t + γ m_{t+1}
    V_{t+1} − m_t V_t``, ``A_t = δ_t + γλ A_{t+1}``, so a hole token is a step with r = V = 0.

    Args:
      reward_t: float ``[T]`` token rewards (upcast to f32); ignored under the mask.
      value_t: float ``[T]`` critic values V(s_t); ignored under the mask.
      mask_t: ``bool[T]``, True on the tokens the policy generated.
      gamma: discount γ ∈ [0, 1].
      lam: GAE λ ∈ [0, 1].
      skip_masked: carry V and A through masked tokens (verl) or treat them as steps with
        r = V = 0 (OpenRLHF).

    Returns:
      ``(adv_t, return_t)``, both f32 ``[T]`` and 0 where ``mask_t`` is False.
    """
    fn = "gae_t"
    _check_sequence(fn, {"reward_t": reward_t, "value_t": value_t, "mask_t": mask_t}, "mask_t")
    _check_unit_interval(fn, "gamma", gamma)
    _check_unit_interval(fn, "lam", lam)

    def _body(
        carry: tuple[chex.Array, chex.Array], xs: tuple[chex.Array, chex.Array, chex.Array]
    ) -> tuple[tuple[chex.Array, chex.Array], chex.Array]:
        next_value, next_adv = carry
        r, v, m = xs
        if not skip_masked:
            r, v = jnp.where(m, r, 0.0), jnp.where(m, v, 0.0)
            adv = r + gamma * next_value - v + gamma * lam * next_adv
            return (v, adv), adv
        adv = r + gamma * next_value - v + gamma * lam * next_adv
        next_value = jnp.where(m, v, next_value)
        next_adv = jnp.where(m, adv, next_adv)
        return (next_value, next_adv), next_adv

    reward_t, value_t = _contracts.f32(reward_t), _contracts.f32(value_t)
    zero = jnp.zeros_like(reward_t[0])  # inherits shard_map's varying axes, see above
    _, adv_t = jax.lax.scan(_body, (zero, zero), (reward_t, value_t, mask_t), reverse=True)
    adv_t = jnp.where(mask_t, adv_t, 0.0)
    return adv_t, jnp.where(mask_t, adv_t + value_t, 0.0)


def gae(
    reward_bgt: chex.Array,
    value_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    gamma: float,
    lam: float,
    skip_masked: bool = True,
) -> tuple[chex.Array, chex.Array]:
    """``gae_t`` over every sequence of a batch (any leading shape).

    Advantages are returned raw; whitening (verl, OpenRLHF) is a separate stage
    (``masked.masked_whiten``).

    Args:
      reward_bgt: float ``[..., T]`` (e.g. ``[B, G, T]``), upcast to f32.
      value_bgt: float ``[..., T]`` critic values, same shape.
      mask_bgt: ``bool``, same shape.
      gamma: discount γ ∈ [0, 1].
      lam: GAE λ ∈ [0, 1].
      skip_masked: see :func:`gae_t`.

    Returns:
      ``(adv_bgt, return_bgt)``, f32 ``[..., T]``, 0 under the mask.
    """
    fn = "gae"
    _check_batch(
        fn, {"reward_bgt": reward_bgt, "value_bgt": value_bgt, "mask_bgt": mask_bgt}, "mask_bgt"
    )
    _check_unit_interval(fn, "gamma", gamma)
    _check_unit_interval(fn, "lam", lam)
    one = lambda r, v, m: gae_t(r, v, m, gamma=gamma, lam=lam, skip_masked=skip_masked)
    return _vmap_leading(one, reward_bgt.ndim)(reward_bgt, value_bgt, mask_bgt)
