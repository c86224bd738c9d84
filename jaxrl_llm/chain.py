"""The reward → advantage chain as composable, optax-shaped transformations.

The seed documents describe every policy-gradient algorithm for LLMs as one chain::

    raw reward -> +KL -> return -> -baseline -> advantage -> normalize -> x grad log pi -> update

This module makes each arrow a value. An :class:`AdvantageTransform` is a pair of pure functions
``(init, update)`` exactly like ``optax.GradientTransformation``: ``init(rollout)`` builds the
stage's state, ``update(signal_bgt, state, rollout)`` maps one token-level signal to the next and
returns the new state. The signal starts as token rewards (the sequence reward sits on the last
valid token) and leaves the chain as advantages. :func:`chain` composes stages left to right,
:func:`stateless` lifts a pure function. The rollout is a read-only context (rewards, masks,
log-probs, values) that every stage may consult but none may change.

Stages in chain order:

* reward shaping: :func:`clip_reward`, :func:`overlong_penalty`, :func:`kl_penalty`
  (``r_t − β·KL_t``, with a fixed or adaptive β controller as the stage's state);
* return (credit assignment): :func:`outcome_return` (the sequence's total reward on every token),
  :func:`discounted_return` (reward-to-go with γ), :func:`gae` (γ, λ, critic values);
* baseline: :func:`group_mean_baseline`, :func:`leave_one_out_baseline`,
  :func:`length_weighted_baseline`, :func:`given_baseline`, :func:`critic_baseline`;
* normalisation: :func:`group_std_scale`, :func:`batch_std_scale`, :func:`batch_whiten`.

Baselines subtract a per-sequence constant from every token of the return. Group baselines need
one number per sequence: the return at the sequence's first valid token (its whole return). For
an outcome return every token carries that number, so this is the familiar
``A_i = r_i − b_i`` broadcast over tokens.

Every stage carries a :class:`StageInfo` (which arrow of the chain it is, and a sentence) from
which :func:`jaxrl_llm.explain` answers the seed's five questions for any composition.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import chex
import jax.numpy as jnp

from jaxrl_llm.core import _contracts as C
from jaxrl_llm.core import baselines as _baselines
from jaxrl_llm.core import kl as _kl
from jaxrl_llm.core import masked as _masked
from jaxrl_llm.core import normalization as _norm
from jaxrl_llm.core import returns as _returns
from jaxrl_llm.core import selection as _selection

State = Any


class Rollout(NamedTuple):
    """What the sampler and the scorers produced for ``B`` prompts × ``G`` completions.

    Attributes:
      reward_bg: ``f32[B, G]`` sequence-level rewards (any float dtype; math is f32).
      mask_bgt: ``bool[B, G, T]`` completion tokens that count (False on padding and on
        observation/tool tokens of multi-turn rollouts).
      mask_bg: ``bool[B, G]`` group membership: False for slots that are not real rollouts of the
        prompt (variable group sizes with static shapes, or dropped by selection). ``None`` means
        every slot is a member.
      logp_old_bgt: ``f32[B, G, T]`` log-probs of the rollout (behaviour) policy; needed for
        KL-in-reward and ratio-based losses.
      logp_ref_bgt: ``f32[B, G, T]`` log-probs of the frozen reference policy.
      value_bgt: ``f32[B, G, T]`` critic values (PPO/GAE).
      baseline_b: ``f32[B]`` a given per-prompt baseline reward (ReMax: the greedy rollout's
        reward).
      reward_bgk: ``f32[B, G, K]`` the K separate rewards of each completion, for multi-reward
        aggregation (GDPO's :func:`normalize_then_sum`); ``reward_bg`` stays their plain sum.
    """

    reward_bg: chex.Array
    mask_bgt: chex.Array
    mask_bg: chex.Array | None = None
    logp_old_bgt: chex.Array | None = None
    logp_ref_bgt: chex.Array | None = None
    value_bgt: chex.Array | None = None
    baseline_b: chex.Array | None = None
    reward_bgk: chex.Array | None = None


def member_mask(rollout: Rollout) -> chex.Array:
    """``bool[B, G]`` group membership (all True when the rollout gives none)."""
    if rollout.mask_bg is None:
        return jnp.ones(rollout.reward_bg.shape, jnp.bool_)
    return rollout.mask_bg


def token_mask(rollout: Rollout) -> chex.Array:
    """``bool[B, G, T]`` tokens that count: completion tokens of group members."""
    return rollout.mask_bgt & member_mask(rollout)[..., None]


def check_rollout(rollout: Rollout, *, fn: str = "Rollout") -> None:
    """Trace-time contract for a rollout: ranks, dtypes and shapes, naming the bad field."""
    C.check_rank(fn, "reward_bg", rollout.reward_bg, 2, "[B, G]")
    C.check_float(fn, "reward_bg", rollout.reward_bg)
    C.check_rank(fn, "mask_bgt", rollout.mask_bgt, 3, "[B, G, T]")
    C.check_bool(fn, "mask_bgt", rollout.mask_bgt)
    C.check_leading_shape(
        fn, "mask_bgt", rollout.mask_bgt, tuple(rollout.reward_bg.shape), of="reward_bg"
    )
    if rollout.mask_bg is not None:
        C.check_bool(fn, "mask_bg", rollout.mask_bg)
        C.check_same_shape(fn, {"reward_bg": rollout.reward_bg, "mask_bg": rollout.mask_bg})
    for name in ("logp_old_bgt", "logp_ref_bgt", "value_bgt"):
        x = getattr(rollout, name)
        if x is not None:
            C.check_float(fn, name, x)
            C.check_same_shape(fn, {"mask_bgt": rollout.mask_bgt, name: x})
    if rollout.baseline_b is not None:
        C.check_float(fn, "baseline_b", rollout.baseline_b)
        C.check_rank(fn, "baseline_b", rollout.baseline_b, 1, "[B]")
        C.check_leading_shape(
            fn, "baseline_b", rollout.reward_bg[:, 0], tuple(rollout.baseline_b.shape), of="B"
        )
    if rollout.reward_bgk is not None:
        C.check_float(fn, "reward_bgk", rollout.reward_bgk)
        C.check_rank(fn, "reward_bgk", rollout.reward_bgk, 3, "[B, G, K]")
        C.check_leading_shape(
            fn, "reward_bgk", rollout.reward_bgk, tuple(rollout.reward_bg.shape), of="reward_bg"
        )


def require(rollout: Rollout, field: str, stage: str) -> chex.Array:
    x = getattr(rollout, field)
    if x is None:
        raise ValueError(
            f"{stage}: this stage needs `Rollout.{field}`, which is None; pass it when building "
            f"the Rollout"
        )
    return x


# --------------------------------------------------------------------------------------------
# The transformation type and its combinators (optax's shape).


# What a stage may need from the trainer beyond rewards and masks (see ``StageInfo.requires``).
BEHAVIOUR_LOGPROBS = "behaviour_logprobs"  # Rollout.logp_old_bgt: the rollout policy's log-probs
REFERENCE_LOGPROBS = "reference_logprobs"  # Rollout.logp_ref_bgt: the frozen reference's
VALUES = "values"  # Rollout.value_bgt: a critic
GROUPS = "groups"  # G ≥ 2 completions per prompt, compared with each other
GIVEN_BASELINE = "given_baseline"  # Rollout.baseline_b (ReMax's greedy reward)
REWARD_COMPONENTS = "reward_components"  # Rollout.reward_bgk: K separate rewards (GDPO)


class StageInfo(NamedTuple):
    """Which arrow of the chain a stage is, and what it does, for :func:`jaxrl_llm.explain`.

    Attributes:
      kind: ``"reward"``, ``"kl"``, ``"return"``, ``"baseline"`` or ``"normalize"``.
      text: one sentence on what the stage does, with its hyperparameters.
      label: the same in a few words, for tables (``"group mean"``, ``"batch whitening"``).
      requires: what the stage reads beyond rewards and masks (the constants above), so that a
        recipe knows what the trainer must compute for it without being inspected.
    """

    kind: str
    text: str
    label: str = ""
    requires: frozenset[str] = frozenset()


class AdvantageTransform(NamedTuple):
    """A stage of the chain: ``init(rollout) -> state``, ``update(signal_bgt, state, rollout) ->
    (signal_bgt, state)``. Both pure; all state lives in the returned pytree."""

    init: Callable[[Rollout], State]
    update: Callable[[chex.Array, State, Rollout], tuple[chex.Array, State]]
    info: tuple[StageInfo, ...] = ()


class EmptyState(NamedTuple):
    """The state of a stateless stage."""


def stateless(
    fn: Callable[[chex.Array, Rollout], chex.Array], info: StageInfo | None = None
) -> AdvantageTransform:
    """Lifts ``fn(signal_bgt, rollout) -> signal_bgt`` to a stage with empty state."""

    def init(rollout: Rollout) -> EmptyState:
        del rollout
        return EmptyState()

    def update(
        signal_bgt: chex.Array, state: EmptyState, rollout: Rollout
    ) -> tuple[chex.Array, EmptyState]:
        return fn(signal_bgt, rollout), state

    return AdvantageTransform(init, update, (info,) if info is not None else ())


def chain(*stages: AdvantageTransform) -> AdvantageTransform:
    """Composes stages left to right; the state is the tuple of the stages' states."""

    def init(rollout: Rollout) -> tuple[State, ...]:
        return tuple(stage.init(rollout) for stage in stages)

    def update(
        signal_bgt: chex.Array, state: tuple[State, ...], rollout: Rollout
    ) -> tuple[chex.Array, tuple[State, ...]]:
        if len(state) != len(stages):
            raise ValueError(
                f"chain: state has {len(state)} entries for {len(stages)} stages; build it with "
                "the same chain's init"
            )
        new_state = []
        for stage, stage_state in zip(stages, state, strict=True):
            signal_bgt, stage_state = stage.update(signal_bgt, stage_state, rollout)
            new_state.append(stage_state)
        return signal_bgt, tuple(new_state)

    info = tuple(i for stage in stages for i in stage.info)
    kinds = [i.kind for i in info]
    if "baseline" in kinds and "return" in kinds[kinds.index("baseline") :]:
        raise ValueError(
            "chain: a baseline stage comes before a return stage; baselines subtract a "
            "per-sequence value from the return (the seed's order: reward -> +KL -> return -> "
            "-baseline -> normalize), e.g. chain(outcome_return(), group_mean_baseline())"
        )
    return AdvantageTransform(init, update, info)


def requirements(transform: AdvantageTransform) -> frozenset[str]:
    """Everything the stages of ``transform`` read beyond rewards and masks."""
    return frozenset().union(*(info.requires for info in transform.info))


def token_rewards(rollout: Rollout) -> chex.Array:
    """The chain's input: ``f32[B, G, T]`` with each sequence reward on its last valid token.

    A member whose completion is empty has no token to carry its reward: it gets no advantage
    and takes no part in group statistics (:func:`scoring_members`).
    """
    check_rollout(rollout, fn="token_rewards")
    return _masked.place_on_last_token(C.f32(rollout.reward_bg), token_mask(rollout))


def _sequence_score(signal_bgt: chex.Array, rollout: Rollout) -> chex.Array:
    """One number per sequence: the signal at its first valid token (0 for empty ones)."""
    return _masked.value_at_first_token(signal_bgt, token_mask(rollout))


def scoring_members(rollout: Rollout) -> chex.Array:
    """``bool[B, G]`` members that enter group statistics: members with at least one valid
    completion token. An empty completion has no token to carry a return or an advantage, so
    it takes no part in its group's baseline or std."""
    return token_mask(rollout).any(-1)


def _subtract_per_sequence(
    signal_bgt: chex.Array, baseline_bg: chex.Array, rollout: Rollout
) -> chex.Array:
    return jnp.where(token_mask(rollout), signal_bgt - baseline_bg[..., None], 0.0)


# --------------------------------------------------------------------------------------------
# Names of the KL estimators (resolved when a stage or a recipe is built, never in traced math).

KL_ESTIMATORS: dict[str, Callable[..., chex.Array]] = {
    "k1": _kl.kl_k1,
    "abs": _kl.kl_abs,
    "k2": _kl.kl_k2,
    "k3": _kl.kl_k3,
    "k1+": _kl.kl_k1_st,
    "k3+": _kl.kl_k3_st,
    # verl's names
    "kl": _kl.kl_k1,
    "mse": _kl.kl_k2,
    "low_var_kl": _kl.kl_k3,
    "low_var_kl+": _kl.kl_k3_st,
}


def kl_estimator(name: str) -> Callable[..., chex.Array]:
    """The per-token KL estimator called ``name`` (see :mod:`jaxrl_llm.core.kl`).

    Raises:
      ValueError: listing the valid names if ``name`` is unknown.
    """
    try:
        return KL_ESTIMATORS[name]
    except KeyError:
        valid = ", ".join(repr(k) for k in KL_ESTIMATORS)
        raise ValueError(f"unknown KL estimator {name!r}; valid names: {valid}") from None


# --------------------------------------------------------------------------------------------
# Reward shaping.


def clip_reward(low: float, high: float) -> AdvantageTransform:
    """Clips token rewards to ``[low, high]`` (OpenRLHF clips scores to (−10, 10))."""

    def fn(signal_bgt: chex.Array, rollout: Rollout) -> chex.Array:
        return jnp.where(token_mask(rollout), jnp.clip(signal_bgt, low, high), 0.0)

    return stateless(
        fn, StageInfo("reward", f"score clipped to [{low:g}, {high:g}]", "clipped score")
    )


def clip_advantage(low: float, high: float) -> AdvantageTransform:
    """Clips the signal to ``[low, high]`` after the baseline: OpenRLHF's reward clip, which
    ``compute_reward`` applies to the baselined (and group-normalised) score ``A_i = s_i − b_i``
    of its outcome estimators, not to the raw score (so it rarely fires)."""

    def fn(signal_bgt: chex.Array, rollout: Rollout) -> chex.Array:
        return jnp.where(token_mask(rollout), jnp.clip(signal_bgt, low, high), 0.0)

    text = f"the baselined score clipped to [{low:g}, {high:g}] (OpenRLHF's reward clip)"
    return stateless(fn, StageInfo("normalize", text, "clipped advantage"))


def overlong_penalty(
    *, max_length: int, buffer_length: int, penalty_factor: float = 1.0, cap: bool = True
) -> AdvantageTransform:
    """DAPO's soft overlong punishment added to the last token's reward (Yu et al. 2025,
    arXiv:2503.14476); the length is the number of valid completion tokens."""

    def fn(signal_bgt: chex.Array, rollout: Rollout) -> chex.Array:
        mask_bgt = token_mask(rollout)
        length_bg = mask_bgt.sum(-1)
        penalty_bg = _selection.overlong_reward_penalty(
            length_bg,
            max_length=max_length,
            buffer_length=buffer_length,
            penalty_factor=penalty_factor,
            cap=cap,
        )
        return signal_bgt + _masked.place_on_last_token(penalty_bg, mask_bgt)

    text = (
        f"overlong penalty: completions longer than {max_length - buffer_length} tokens lose up "
        f"to {penalty_factor:g} (linear over the last {buffer_length})"
    )
    return stateless(fn, StageInfo("reward", text, "overlong shaping"))


def _kl_stage(
    beta: float | _kl.KLController,
    estimator: str | Callable,
    estimator_kwargs: dict,
    *,
    to_go: bool,
) -> AdvantageTransform:
    controller = (
        beta if isinstance(beta, _kl.KLController) else _kl.fixed_kl_controller(float(beta))
    )
    kl_fn = kl_estimator(estimator) if isinstance(estimator, str) else estimator
    name = estimator if isinstance(estimator, str) else getattr(estimator, "__name__", "custom")
    stage = "kl_reward_to_go" if to_go else "kl_penalty"

    def init(rollout: Rollout) -> _kl.KLControllerState:
        del rollout
        return controller.init()

    def update(
        signal_bgt: chex.Array, state: _kl.KLControllerState, rollout: Rollout
    ) -> tuple[chex.Array, _kl.KLControllerState]:
        logp_old = require(rollout, "logp_old_bgt", stage)
        logp_ref = require(rollout, "logp_ref_bgt", stage)
        mask_bgt = token_mask(rollout)
        kl_bgt = jnp.where(mask_bgt, kl_fn(logp_old, logp_ref, **estimator_kwargs), 0.0)
        if to_go:
            to_go_bgt = _returns.discounted_returns(kl_bgt, mask_bgt, gamma=1.0)
            shaped = jnp.where(mask_bgt, signal_bgt - state.beta * to_go_bgt, 0.0)
        else:
            shaped = _kl.kl_in_reward(signal_bgt, kl_bgt, mask_bgt, beta=state.beta)
        observed = _kl.mean_sequence_kl(kl_bgt, mask_bgt)
        n_steps = jnp.asarray(mask_bgt.shape[0] * mask_bgt.shape[1], jnp.float32)
        return shaped, controller.update(state, observed, n_steps)

    kind = "fixed" if not isinstance(beta, _kl.KLController) else "controller-driven"
    if to_go:
        text = (
            f"in the reward, after the baseline: A_t − β·Σ_(t'≥t) {name}_t'(π_old ‖ π_ref), the "
            f"KL's reward-to-go added to the baselined score (OpenRLHF's order; {kind} β)"
        )
    else:
        text = f"in the reward: r_t − β·{name}(π_old ‖ π_ref) per token ({kind} β)"
    if not isinstance(beta, _kl.KLController):
        text += f", β = {float(beta):g}"
    needs = frozenset({BEHAVIOUR_LOGPROBS, REFERENCE_LOGPROBS})
    label = "in reward, after baseline" if to_go else "in reward"
    return AdvantageTransform(init, update, (StageInfo("kl", text, label, needs),))


def kl_penalty(
    beta: float | _kl.KLController, *, estimator: str | Callable = "k1", **estimator_kwargs
) -> AdvantageTransform:
    """KL folded into the token rewards: ``r_t ← r_t − β·KL_t(π_old ‖ π_ref)``.

    ``KL_t`` is the chosen estimator of the per-token log-ratio ``logp_old − logp_ref`` between
    the rollout policy and the reference (Ziegler et al. 2019, arXiv:1909.08593; Ouyang et al.
    2022, arXiv:2203.02155). ``beta`` is a number (fixed controller) or a
    :class:`~jaxrl_llm.core.kl.KLController` (e.g. the adaptive one); the stage's state is the
    controller's, and after shaping the controller is updated with this batch's observed KL
    (mean over sequences of the per-sequence mean KL) and ``n_steps = B·G``, as verl does.
    """
    return _kl_stage(beta, estimator, estimator_kwargs, to_go=False)


def kl_reward_to_go(
    beta: float | _kl.KLController, *, estimator: str | Callable = "k1", **estimator_kwargs
) -> AdvantageTransform:
    """The KL in the reward added *after* the baseline: ``A_t ← A_t − β·Σ_{t'≥t} KL_t'``.

    OpenRLHF's order for its outcome estimators (``rloo``, ``group_norm``, ``dr_grpo``,
    ``reinforce_baseline``; ``RemoteExperienceMaker.compute_advantages_and_returns`` then
    ``compute_reward`` and ``get_cumulative_returns`` with γ = 1, openrlhf 0.11.2): the group
    baseline (and std) is taken on the raw scores, then ``−β·KL_t`` is added per token and the
    return summed from the end. The per-sequence advantage from the stages before is one
    number on every token, so this equals ``A_i − β·Σ_{t'≥t} KL_t'`` on each valid token.
    :func:`kl_penalty` before the return (the seeds' order, verl's) instead folds the summed KL
    into the score that the baseline compares. Same estimators, controller and state as
    :func:`kl_penalty`.
    """
    return _kl_stage(beta, estimator, estimator_kwargs, to_go=True)


# --------------------------------------------------------------------------------------------
# Returns (credit assignment).


def outcome_return() -> AdvantageTransform:
    """Every valid token gets the sequence's total reward ``Σ_t r_t`` (verl's outcome estimators:
    GRPO, RLOO, REINFORCE++-baseline sum token rewards, KL included, before grouping)."""

    def fn(signal_bgt: chex.Array, rollout: Rollout) -> chex.Array:
        mask_bgt = token_mask(rollout)
        total_bg = _masked.masked_sum(signal_bgt, mask_bgt, axis=-1)
        return jnp.where(mask_bgt, total_bg[..., None], 0.0)

    text = "outcome: the sequence's total reward on every token"
    return stateless(fn, StageInfo("return", text, "outcome"))


_HOLES = {
    True: "masked tokens carry it through",
    False: "masked tokens are zero-reward, zero-value steps",
}


def discounted_return(gamma: float = 1.0, *, skip_masked: bool = True) -> AdvantageTransform:
    """Reward-to-go ``G_t = r_t + γ·G_{t+1}``; masked (observation) tokens carry ``G`` through,
    or, with ``skip_masked=False`` (OpenRLHF), are discounted as zero-reward steps
    (:func:`jaxrl_llm.core.returns.discounted_returns`)."""

    def fn(signal_bgt: chex.Array, rollout: Rollout) -> chex.Array:
        return _returns.discounted_returns(
            signal_bgt, token_mask(rollout), gamma=gamma, skip_masked=skip_masked
        )

    text = f"reward-to-go G_t = r_t + γ·G_(t+1), γ = {gamma:g}"
    if gamma != 1:
        text += f"; {_HOLES[skip_masked]}"
    return stateless(fn, StageInfo("return", text, f"reward-to-go (γ = {gamma:g})"))


def gae(gamma: float = 1.0, lam: float = 0.95, *, skip_masked: bool = True) -> AdvantageTransform:
    """Generalised advantage estimation with the rollout's critic values (Schulman et al. 2016,
    arXiv:1506.02438). The critic is the baseline, inside the TD errors
    ``δ_t = r_t + γV_(t+1) − V_t``; ``skip_masked`` as in :func:`jaxrl_llm.core.returns.gae`
    (False: OpenRLHF's zero-r, zero-V hole tokens)."""

    def fn(signal_bgt: chex.Array, rollout: Rollout) -> chex.Array:
        value_bgt = require(rollout, "value_bgt", "gae")
        adv_bgt, _ = _returns.gae(
            signal_bgt,
            C.f32(value_bgt),
            token_mask(rollout),
            gamma=gamma,
            lam=lam,
            skip_masked=skip_masked,
        )
        return adv_bgt

    return AdvantageTransform(
        *stateless(fn)[:2],
        (
            StageInfo(
                "return",
                f"GAE over TD errors, γ = {gamma:g}, λ = {lam:g}; {_HOLES[skip_masked]}",
                "GAE",
                frozenset(),
            ),
            StageInfo(
                "baseline",
                "a learned critic V(s_t), inside GAE's TD errors",
                "critic V(s)",
                frozenset({VALUES}),
            ),
        ),
    )


# --------------------------------------------------------------------------------------------
# Baselines.


def group_mean_baseline(*, singleton_baseline: float | None = None) -> AdvantageTransform:
    """``A_i = R_i − mean_{j∈group} R_j`` (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300)."""

    def fn(signal_bgt: chex.Array, rollout: Rollout) -> chex.Array:
        score_bg = _sequence_score(signal_bgt, rollout)
        b_bg = _baselines.group_mean_baseline(
            score_bg, scoring_members(rollout), singleton_baseline=singleton_baseline
        )
        return _subtract_per_sequence(signal_bgt, b_bg, rollout)

    text = "the group mean of the G answers' returns"
    return stateless(fn, StageInfo("baseline", text, "group mean", frozenset({GROUPS})))


def leave_one_out_baseline(*, singleton_baseline: float | None = None) -> AdvantageTransform:
    """``A_i = R_i − mean_{j≠i} R_j`` (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740)."""

    def fn(signal_bgt: chex.Array, rollout: Rollout) -> chex.Array:
        score_bg = _sequence_score(signal_bgt, rollout)
        b_bg = _baselines.leave_one_out_baseline(
            score_bg, scoring_members(rollout), singleton_baseline=singleton_baseline
        )
        return _subtract_per_sequence(signal_bgt, b_bg, rollout)

    text = "the mean of the other G−1 answers (leave-one-out)"
    return stateless(fn, StageInfo("baseline", text, "leave-one-out", frozenset({GROUPS})))


def length_weighted_baseline(*, singleton_baseline: float | None = None) -> AdvantageTransform:
    """OPO's length-weighted group mean ``b = Σ|y_j|R_j / Σ|y_j|`` (arXiv:2505.23585)."""

    def fn(signal_bgt: chex.Array, rollout: Rollout) -> chex.Array:
        score_bg = _sequence_score(signal_bgt, rollout)
        length_bg = token_mask(rollout).sum(-1).astype(jnp.float32)
        b_bg = _baselines.length_weighted_baseline(
            score_bg, length_bg, scoring_members(rollout), singleton_baseline=singleton_baseline
        )
        return _subtract_per_sequence(signal_bgt, b_bg, rollout)

    text = "the length-weighted group mean (OPO)"
    return stateless(fn, StageInfo("baseline", text, "length-weighted mean", frozenset({GROUPS})))


def given_baseline() -> AdvantageTransform:
    """A per-prompt baseline supplied in ``Rollout.baseline_b``, e.g. ReMax's greedy rollout reward
    (Li et al. 2023, arXiv:2310.10505)."""

    def fn(signal_bgt: chex.Array, rollout: Rollout) -> chex.Array:
        baseline_b = require(rollout, "baseline_b", "given_baseline")
        score_bg = _sequence_score(signal_bgt, rollout)
        b_bg = _baselines.given_baseline(score_bg, C.f32(baseline_b), scoring_members(rollout))
        return _subtract_per_sequence(signal_bgt, b_bg, rollout)

    text = "a given per-prompt reward (ReMax: greedy rollout)"
    return stateless(fn, StageInfo("baseline", text, "given (greedy)", frozenset({GIVEN_BASELINE})))


def passk_advantage(*, scale_by_std: bool = True, eps: float = 1e-6) -> AdvantageTransform:
    """GRPO pass@k: only each group's best answer gets an advantage, its margin over the
    runner-up (÷ the unbiased group std + ``eps`` with ``scale_by_std``); see
    :func:`jaxrl_llm.core.baselines.passk_advantage` (verl ``grpo_passk``)."""

    def fn(signal_bgt: chex.Array, rollout: Rollout) -> chex.Array:
        score_bg = _sequence_score(signal_bgt, rollout)
        adv_bg = _baselines.passk_advantage(
            score_bg, scoring_members(rollout), scale_by_std=scale_by_std, eps=eps
        )
        return jnp.where(token_mask(rollout), adv_bg[..., None], 0.0)

    infos = [
        StageInfo(
            "baseline",
            "pass@k: the runner-up of the group (only the best answer gets A = best − second)",
            "pass@k runner-up",
            frozenset({GROUPS}),
        )
    ]
    if scale_by_std:
        text = f"the best answer's margin ÷ (unbiased group std + {eps:g})"
        infos.append(StageInfo("normalize", text, "group std", frozenset({GROUPS})))
    return AdvantageTransform(*stateless(fn)[:2], tuple(infos))


def gpg_scale(*, f_norm: float = 1.0) -> AdvantageTransform:
    """GPG's correction: × α/F with α = N / #{members with a nonzero raw reward}
    (:func:`jaxrl_llm.core.baselines.gpg_scale`, verl ``gpg``)."""

    def fn(signal_bgt: chex.Array, rollout: Rollout) -> chex.Array:
        factor = _baselines.gpg_scale(C.f32(rollout.reward_bg), member_mask(rollout), f_norm=f_norm)
        return jnp.where(token_mask(rollout), signal_bgt * factor, 0.0)

    text = f"batch: × α/F, α = N / #(nonzero rewards), F = {f_norm:g} (GPG)"
    return stateless(fn, StageInfo("normalize", text, "GPG α/F"))


def normalize_then_sum(
    *, weights: tuple[float, ...] | None = None, eps: float = 1e-4
) -> AdvantageTransform:
    """GDPO: each of the K rewards in ``Rollout.reward_bgk`` normalised in its group, the
    weighted sum whitened over the batch (:func:`jaxrl_llm.core.normalization.
    normalize_then_sum`, TRL ``multi_objective_aggregation="normalize_then_sum"``). It replaces
    the signal by that advantage, so it comes after the return and takes the baseline's place
    (``reward_bg`` and any reward shaping before it are not read)."""

    def fn(signal_bgt: chex.Array, rollout: Rollout) -> chex.Array:
        del signal_bgt
        reward_bgk = require(rollout, "reward_bgk", "normalize_then_sum")
        adv_bg = _norm.normalize_then_sum(
            reward_bgk, scoring_members(rollout), weights=weights, eps=eps
        )
        return jnp.where(token_mask(rollout), adv_bg[..., None], 0.0)

    w = "equal weights" if weights is None else "weights " + ", ".join(f"{x:g}" for x in weights)
    needs = frozenset({GROUPS, REWARD_COMPONENTS})
    return AdvantageTransform(
        *stateless(fn)[:2],
        (
            StageInfo(
                "baseline",
                "per reward: the group mean of that reward (GDPO, rewards decoupled)",
                "group mean per reward",
                needs,
            ),
            StageInfo(
                "normalize",
                f"per reward: ÷ (unbiased group std + {eps:g}); the {w} sum, then batch "
                f"whitening (R − mean)/(unbiased std + {eps:g})",
                "per-reward group std + batch whitening",
            ),
        ),
    )


def critic_baseline() -> AdvantageTransform:
    """``A_t = G_t − V(s_t)`` with the rollout's critic values (REINFORCE with a learned
    baseline; GAE with λ = 1)."""

    def fn(signal_bgt: chex.Array, rollout: Rollout) -> chex.Array:
        value_bgt = require(rollout, "value_bgt", "critic_baseline")
        mask_bgt = token_mask(rollout)
        return jnp.where(
            mask_bgt, signal_bgt - _baselines.critic_baseline(value_bgt, mask_bgt), 0.0
        )

    text = "a learned critic V(s_t) per token"
    return stateless(fn, StageInfo("baseline", text, "critic V(s)", frozenset({VALUES})))


# --------------------------------------------------------------------------------------------
# Normalisation.


def group_std_scale(
    *, ddof: int = 0, eps: float = 1e-6, singleton_std: float = 1.0
) -> AdvantageTransform:
    """Divides each sequence's signal by its group's std of returns plus ``eps`` (GRPO)."""

    def fn(signal_bgt: chex.Array, rollout: Rollout) -> chex.Array:
        score_bg = _sequence_score(signal_bgt, rollout)
        return _norm.scale_by_group_std(
            signal_bgt,
            score_bg,
            scoring_members(rollout),
            ddof=ddof,
            eps=eps,
            singleton_std=singleton_std,
        )

    text = f"per group: ÷ (std of the group's returns + {eps:g}), ddof = {ddof}"
    return stateless(fn, StageInfo("normalize", text, "group std", frozenset({GROUPS})))


def batch_std_scale(
    *, ddof: int = 0, eps: float = 1e-6, source: str = "return"
) -> AdvantageTransform:
    """Divides by one std over the batch: of all member returns (``source="return"``, the
    signal's per-sequence value when the stage runs) or of the raw rewards ``Rollout.reward_bg``
    (``source="reward"``: TRL GRPO's ``scale_rewards="batch"``, which divides the group-centred
    advantage by ``nanstd(rewards)`` of the uncentred rewards, ``grpo_trainer.py``
    ``_generate_and_score_completions``). After a group baseline the two differ: the std of
    the centred signal lacks the spread of the group means."""
    if source not in ("return", "reward"):
        raise ValueError(f"batch_std_scale: source={source!r}; expected 'return' or 'reward'")

    def fn(signal_bgt: chex.Array, rollout: Rollout) -> chex.Array:
        if source == "reward":
            score_bg = C.f32(rollout.reward_bg)
        else:
            score_bg = _sequence_score(signal_bgt, rollout)
        return _norm.scale_by_batch_std(
            signal_bgt, score_bg, scoring_members(rollout), ddof=ddof, eps=eps
        )

    what = "all raw rewards" if source == "reward" else "all returns"
    text = f"batch: ÷ (std of {what} in the batch + {eps:g}), ddof = {ddof}"
    return stateless(fn, StageInfo("normalize", text, "batch std"))


def sequence_whiten(*, ddof: int = 1, eps: float = 1e-4) -> AdvantageTransform:
    """Whitens the per-sequence advantages over the batch's members (one value per sequence,
    not per token): ``A ← (A − mean_batch A)/(std_batch A + eps)``. TRL RLOO's
    ``normalize_advantages=True`` (``rloo_trainer.py``: ``(A − nanmean(A))/(nanstd(A) +
    1e-4)``, ddof 1)."""

    def fn(signal_bgt: chex.Array, rollout: Rollout) -> chex.Array:
        score_bg = _sequence_score(signal_bgt, rollout)
        members_bg = scoring_members(rollout)
        mean = _masked.masked_mean(score_bg, members_bg)
        centred_bg = jnp.where(members_bg, score_bg - mean, 0.0)
        centred_bgt = _subtract_per_sequence(
            signal_bgt, jnp.broadcast_to(mean, score_bg.shape), rollout
        )
        return _norm.scale_by_batch_std(centred_bgt, centred_bg, members_bg, ddof=ddof, eps=eps)

    text = f"batch: per-sequence whitening (A − mean)/(std + {eps:g}), ddof = {ddof}"
    return stateless(fn, StageInfo("normalize", text, "sequence whitening"))


def batch_whiten(
    *,
    ddof: int = 0,
    eps: float = 1e-8,
    eps_as_floor: bool = False,
    shift_mean: bool = True,
    axis_name: str | None = None,
) -> AdvantageTransform:
    """Whitens over every valid token of the (global) batch (REINFORCE++, Hu et al. 2025,
    arXiv:2501.03262). Under ``jit`` on sharded inputs the statistics are global; inside
    ``shard_map`` pass ``axis_name`` to ``psum`` them."""

    def fn(signal_bgt: chex.Array, rollout: Rollout) -> chex.Array:
        return _norm.batch_whiten(
            signal_bgt,
            token_mask(rollout),
            ddof=ddof,
            eps=eps,
            eps_as_floor=eps_as_floor,
            shift_mean=shift_mean,
            axis_name=axis_name,
        )

    where = "max(var, eps)" if eps_as_floor else "var + eps"
    text = f"global batch whitening over all valid tokens: (A − μ)/√({where}), ddof = {ddof}"
    if not shift_mean:
        text += ", mean kept"
    return stateless(fn, StageInfo("normalize", text, "batch whitening"))


def apply(
    transform: AdvantageTransform, rollout: Rollout, state: State | None = None
) -> tuple[chex.Array, State]:
    """Runs a chain on a rollout: token rewards in, ``(advantages_bgt, new_state)`` out.

    Advantages are exactly 0 on padding and on non-members.
    """
    check_rollout(rollout, fn="apply")
    if state is None:
        state = transform.init(rollout)
    signal_bgt = token_rewards(rollout)
    adv_bgt, state = transform.update(signal_bgt, state, rollout)
    return jnp.where(token_mask(rollout), adv_bgt, 0.0), state


__all__ = [
    "BEHAVIOUR_LOGPROBS",
    "GIVEN_BASELINE",
    "GROUPS",
    "KL_ESTIMATORS",
    "REFERENCE_LOGPROBS",
    "REWARD_COMPONENTS",
    "VALUES",
    "AdvantageTransform",
    "EmptyState",
    "Rollout",
    "StageInfo",
    "apply",
    "batch_std_scale",
    "batch_whiten",
    "chain",
    "check_rollout",
    "clip_advantage",
    "clip_reward",
    "critic_baseline",
    "discounted_return",
    "gae",
    "given_baseline",
    "gpg_scale",
    "group_mean_baseline",
    "group_std_scale",
    "kl_estimator",
    "kl_penalty",
    "kl_reward_to_go",
    "leave_one_out_baseline",
    "length_weighted_baseline",
    "member_mask",
    "normalize_then_sum",
    "outcome_return",
    "overlong_penalty",
    "passk_advantage",
    "requirements",
    "scoring_members",
    "sequence_whiten",
    "stateless",
    "token_mask",
    "token_rewards",
]
