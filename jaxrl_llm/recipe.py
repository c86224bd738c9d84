"""What a recipe is — a value made of functions — and how one runs.

A recipe is to an RL algorithm what ``optax.GradientTransformation`` is to an optimiser: a few
pure functions bundled as data, composed from smaller ones, never a class to subclass. An online
:class:`Recipe` holds

* ``advantage``: the reward → advantage chain (a :class:`~jaxrl_llm.chain.AdvantageTransform`,
  its state carried by the trainer, e.g. an adaptive KL coefficient);
* ``objective``: the per-token policy loss, its aggregation into a ``(sum, denominator)`` pair
  whose denominator depends on the mask alone, the optional KL and entropy terms, and its own
  diagnostics (:class:`Objective`);
* ``critic``: PPO's value targets and value-loss clip (:class:`Critic`), or ``None``;
* ``selection``: which rollouts reach the update (PODS, DAPO's dynamic sampling);
* ``requires``: what the trainer must compute for it (reference log-probs, critic values,
  groups of G ≥ 2, one update per batch ...), derived from its parts, so that nothing outside a
  recipe inspects its functions or tests its name.

The DPO family is a :class:`PreferenceRecipe`: a per-pair loss on sequence log-probs
(:class:`PairLogprobs`), no chain.

Running a recipe: :func:`compute_advantages` (the chain under one ``jit`` per recipe and shape),
:func:`select` (PODS / DAPO membership), :func:`policy_objective` (the loss as additive
``(sum, denominator)`` pairs) and :func:`value_targets` (the critic's regression targets).

Names are resolved here, when a recipe is built (:data:`AGGREGATIONS`,
:data:`~jaxrl_llm.chain.KL_ESTIMATORS`): no string ever reaches traced math, and ``core/`` holds
no lookup tables.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm import chain as ch
from jaxrl_llm import numerics as nm
from jaxrl_llm.core import aggregation as agg
from jaxrl_llm.core import masked as _masked
from jaxrl_llm.core import policy_losses as pl
from jaxrl_llm.core import rollout_correction as rcorr
from jaxrl_llm.core import selection as sel

Pair = tuple[chex.Array, chex.Array]
PolicyLoss = Callable[[chex.Array, chex.Array, chex.Array, chex.Array], chex.Array]
Aggregation = Callable[[chex.Array, chex.Array], Pair]
RatioMetrics = Callable[[chex.Array, chex.Array, chex.Array, chex.Array], dict[str, Pair]]
# (logp, logp_old, adv, mask, w) -> loss: a policy loss under rollout-correction weights w
WeightedLoss = Callable[[chex.Array, chex.Array, chex.Array, chex.Array, chex.Array], chex.Array]

# What a recipe may require of the trainer: the chain's own requirements
# (ch.BEHAVIOUR_LOGPROBS, ch.REFERENCE_LOGPROBS, ch.VALUES, ch.GROUPS, ch.GIVEN_BASELINE), and:
REFERENCE_LOGPROBS = ch.REFERENCE_LOGPROBS
BEHAVIOUR_LOGPROBS = ch.BEHAVIOUR_LOGPROBS
VALUES = ch.VALUES
GROUPS = ch.GROUPS
GIVEN_BASELINE = ch.GIVEN_BASELINE  # Rollout.baseline_b: ReMax's greedy-rollout reward
REWARD_COMPONENTS = ch.REWARD_COMPONENTS  # Rollout.reward_bgk: K separate rewards (GDPO)
ON_POLICY = "on_policy"  # the loss has no importance ratio: each batch feeds exactly one update
PREFERENCE_PAIRS = "preference_pairs"  # offline (prompt, chosen, rejected) pairs, no rollouts
# WPO: per-answer weights from the policy's own token distribution (log Σ_v π(v)², see
# core.preference.wpo_weights), in PairLogprobs.weight_chosen_p / weight_rejected_p
SEQUENCE_WEIGHTS = "sequence_weights"
# The objective corrects with the sampler's own log-probs (UpdateBatch.logp_sampler_nt): an
# objective with a RolloutCorrection
SAMPLER_LOGPROBS = "sampler_logprobs"


# --------------------------------------------------------------------------------------------
# Aggregation names (verl's), resolved at build time.

AGGREGATIONS: dict[str, Callable[..., Pair]] = {
    "token-mean": agg.token_mean,
    "token-sum": agg.token_sum,
    "seq-mean-token-mean": agg.seq_mean_token_mean,
    "seq-mean-token-sum": agg.seq_mean_token_sum,
    "seq-mean-token-sum-norm": agg.seq_mean_token_sum_norm,
}


def aggregation(name: str, *, norm: int | None = None) -> Aggregation:
    """The aggregation called ``name`` as ``(loss_bgt, mask_bgt) -> (sum, denominator)``.

    ``seq-mean-token-sum-norm`` divides each sequence's token sum by ``norm`` (default: the
    padded completion length T of the batch, Dr. GRPO's constant); no other mode takes ``norm``.

    Raises:
      ValueError: for an unknown name (listing the valid ones) or a ``norm`` the mode does not
        take or that is not ≥ 1.
    """
    if name not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {name!r}; valid names: {sorted(AGGREGATIONS)}")
    fn = AGGREGATIONS[name]
    if name != "seq-mean-token-sum-norm":
        if norm is not None:
            raise ValueError(f"aggregation {name!r} does not take `norm` (got {norm!r})")
        return fn
    if norm is not None and not norm >= 1:
        raise ValueError(f"aggregation {name!r}: argument `norm` must be ≥ 1, got {norm!r}")

    def seq_sum_norm(loss_bgt: chex.Array, mask_bgt: chex.Array) -> Pair:
        return fn(loss_bgt, mask_bgt, norm=norm if norm is not None else mask_bgt.shape[-1])

    return seq_sum_norm


# --------------------------------------------------------------------------------------------
# The parts of a recipe.


class KLTerm(NamedTuple):
    """A KL penalty in the loss: ``+ β·estimate(log π_θ, log π_ref)`` per token.

    Attributes:
      estimate: ``(logp_bgt, logp_ref_bgt) -> kl_bgt``, β-free.
      beta: the coefficient β > 0.
      label: the estimator's name (``"k3"``), for ``explain``.
      importance_weighted: multiply the estimate by the ratio ``π_θ/π_old`` (gradient through
        it), TRL GRPO's ``use_bias_correction_kl``: the sampled tokens come from π_old, so the
        weighted k3 estimates KL(π_θ ‖ π_ref) without bias off-policy. The log-ratio is
        clamped to ±20 before the exp.
    """

    estimate: Callable[[chex.Array, chex.Array], chex.Array]
    beta: float
    label: str
    importance_weighted: bool = False


@dataclasses.dataclass(frozen=True)
class RolloutCorrection:
    """Rollout correction: how the policy gradient is reweighted or masked when the sampler μ
    (the rollout engine's log-probs) differs from the policy the loss is written for
    (:mod:`jaxrl_llm.core.rollout_correction`; docs/numerics.md, "Rollout correction").

    The target π of the weights: with ``old_logprobs.source: sampler`` (no recompute) it is
    sg(π_θ) — verl's *bypass* mode; with a recomputed π_old it is π_old = π_prox — the
    *decoupled* three-policy objective (Hilton et al. 2021, AReaL): the recipe's clip relative
    to π_prox and the weight π_prox/μ. With ρ the token ratio π/μ (``level: token``) or the
    sequence ratio (``level: sequence``; ``reduction: mean`` = the geometric mean
    exp(mean_t log ρ_t), ``sum`` = the product Π_t ρ_t, verl's and TRL's):

      ``tis``     A_t ← clip(ρ, low, high)·A_t                    (truncated IS; high = the cap C)
      ``mis``     A_t ← ρ·A_t inside [low, high], 0 outside       (masked IS)
      ``icepop``  ``mis`` at the token level
      ``reject``  A_t ← A_t inside [low, high], 0 outside         (rejection sampling)
      ``none``    A_t unchanged (the ``rollout_corr/*`` metrics only)

    ``token_weights`` (``mis`` at the sequence level): gate on the sequence statistic, weight
    the survivors by their token ratios (OpenRLHF's ``is_correction_level: seq``).
    ``bypass``: ``reinforce`` (the recipe's ratio is 1 and the weights carry the correction:
    verl's bypass ``loss_type: reinforce``) or ``ppo_clip`` (π_old := μ in the recipe's own
    ratio, so its clip bounds π_θ/μ, and only the keep-mask is applied: verl's bypass
    ``ppo_clip``; modes ``reject`` / ``none`` only). A dropped token keeps its place in the
    aggregation's denominator and its KL / entropy terms (TRL's and OpenRLHF's convention;
    verl removes it from the response mask). Replaces ``old_logprobs.tis_cap``.

    Attributes: see :func:`jaxrl_llm.core.rollout_correction.correction_weights`.
    """

    mode: Literal["tis", "mis", "icepop", "reject", "none"] = "tis"
    level: Literal["token", "sequence"] = "token"
    reduction: Literal["mean", "sum"] = "mean"
    low: float | None = None
    high: float | None = 2.0
    token_weights: bool = False
    bypass: Literal["reinforce", "ppo_clip"] = "reinforce"

    def weights(
        self, logp_target_bgt: chex.Array, logp_behaviour_bgt: chex.Array, mask_bgt: chex.Array
    ) -> rcorr.Correction:
        """The weights, keep-mask and raw ratio of ``π_target / μ`` under this scheme."""
        return rcorr.correction_weights(
            logp_target_bgt,
            logp_behaviour_bgt,
            mask_bgt,
            mode=self.mode,
            level=self.level,
            reduction=self.reduction,
            low=None if self.mode == "none" else self.low,
            high=None if self.mode == "none" else self.high,
            token_weights=self.token_weights,
        )


def rollout_correction(
    name: str, value: RolloutCorrection | Mapping[str, Any] | None
) -> RolloutCorrection | None:
    """``value`` (a mapping is built into a :class:`RolloutCorrection`) checked at build time:
    the mode, level, reduction and bounds as the core function takes them, and ``bypass:
    ppo_clip`` only with a mode that applies no weight. Raises ``ValueError`` naming ``name``."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        fields = {f.name for f in dataclasses.fields(RolloutCorrection)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(
                f"{name}: rollout_correction has no key {unknown[0]!r}; keys: {sorted(fields)}"
            )
        value = RolloutCorrection(**value)
    if not isinstance(value, RolloutCorrection):
        raise ValueError(f"{name}: rollout_correction must be a mapping or None, got {value!r}")
    if value.bypass not in ("reinforce", "ppo_clip"):
        raise ValueError(
            f"{name}: rollout_correction.bypass must be 'reinforce' or 'ppo_clip', got "
            f"{value.bypass!r}"
        )
    if value.bypass == "ppo_clip" and value.mode not in ("reject", "none"):
        raise ValueError(
            f"{name}: rollout_correction.bypass='ppo_clip' puts μ in the recipe's own ratio, so an "
            f"importance weight (mode {value.mode!r}) would correct twice; use mode 'reject' or "
            "'none' (verl's bypass ppo_clip applies the rejection mask only)"
        )
    t = jnp.zeros((1, 2), jnp.float32)
    try:  # the core function's own checks (names, bounds), on a dummy token pair
        value.weights(t, t, jnp.ones((1, 2), bool))
    except ValueError as e:
        raise ValueError(f"{name}: rollout_correction: {e}") from None
    return value


class Objective(NamedTuple):
    """The per-token policy objective of an online recipe.

    Per token ``ℓ_t = loss_t + β·KL_t − c_H·H_t`` (the KL term when ``kl`` is given, the entropy
    bonus when ``entropy_coef > 0``), reduced by ``aggregate`` to a ``(sum, denominator)`` pair
    whose denominator depends only on the mask, so that micro-batches and shards add up to the
    whole-batch loss exactly (see :func:`policy_objective`).

    Attributes:
      loss: ``(logp_bgt, logp_old_bgt, adv_bgt, mask_bgt) -> loss_bgt``, 0 on padding.
      aggregate: ``(x_bgt, mask_bgt) -> (sum, denominator)``.
      ratio_metrics: ``(logp_bgt, logp_old_bgt, adv_bgt, mask_bgt) -> {name: (sum, den)}``, the
        loss's own diagnostics of its importance ratio (clip fractions at its clip range).
      kl: the KL loss term, or ``None``.
      entropy_coef: the entropy bonus coefficient ``c_H ≥ 0``.
      requires: what it needs from the trainer (``REFERENCE_LOGPROBS`` for a KL term,
        ``ON_POLICY`` for a loss without importance ratio).
      label: the loss in a few words (``"PPO clip"``).
      aggregation_label: the aggregation's name (``"seq-mean-token-mean"``).
      text: one sentence on what is optimised.
      rollout_correction: how the update corrects for the sampler (:class:`RolloutCorrection`),
        or ``None`` (the trainer's ``old_logprobs.tis_cap`` TIS with ``source: sampler``).
      weighted_loss: ``(logp, logp_old, adv, mask, w) -> loss_bgt``, the per-token policy loss
        under the correction's weights ``w`` when they do not simply multiply the advantage
        (a loss not positively homogeneous in A: :func:`weights_times_loss`,
        :func:`geometric_weight_times_loss`; or one that folds them into its own ratio, VESPO);
        ``None``: the update sets ``A_t ← w_t·A_t`` (= ``w_t·ℓ_t`` for such losses).
      top_entropy_quantile: ρ; below 1 the policy loss (not the KL or entropy terms) counts only
        on the tokens whose entropy is at least the micro-batch's (1 − ρ)-quantile
        (:func:`high_entropy_mask`; the denominator keeps every token, as TRL's).
      token_mean_kl, token_mean_entropy: the KL term / the entropy bonus is a token mean over
        the minibatch whatever ``aggregate`` is (OpenRLHF: both; TRL: the entropy), instead of
        following the loss's aggregation. See :func:`policy_objective` and
        :func:`term_scales`.
    """

    loss: PolicyLoss
    aggregate: Aggregation
    ratio_metrics: RatioMetrics
    kl: KLTerm | None = None
    entropy_coef: float = 0.0
    requires: frozenset[str] = frozenset()
    label: str = ""
    aggregation_label: str = ""
    text: str = ""
    rollout_correction: RolloutCorrection | None = None
    token_mean_kl: bool = False
    token_mean_entropy: bool = False
    top_entropy_quantile: float = 1.0
    weighted_loss: WeightedLoss | None = None

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss reads the per-token entropy (a bonus, or the entropy mask)."""
        return self.entropy_coef > 0 or self.top_entropy_quantile < 1.0

    @property
    def mixed_aggregation(self) -> bool:
        """Whether a term is a token mean while the loss is aggregated otherwise."""
        token_mean = self.aggregation_label == "token-mean"
        kl = self.token_mean_kl and self.kl is not None
        return not token_mean and (kl or (self.token_mean_entropy and self.entropy_coef > 0))


def check_entropy_quantile(name: str, rho: float) -> float:
    """``rho`` as a float in (0, 1], or a ValueError naming the recipe and the option."""
    if isinstance(rho, bool) or not isinstance(rho, int | float) or not 0.0 < rho <= 1.0:
        raise ValueError(f"{name}: `top_entropy_quantile` must be in (0, 1], got {rho!r}")
    return float(rho)


def high_entropy_mask(entropy_bgt: chex.Array, mask_bgt: chex.Array, quantile: float) -> chex.Array:
    """``bool[B, G, T]``: valid tokens whose entropy is ≥ the ``(1 − quantile)``-quantile of
    the valid tokens' entropies (linear interpolation, as ``torch.quantile``; TRL's
    ``GRPOTrainer.get_high_entropy_mask``), computed without gradient. Wang et al. 2025,
    "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective RL for LLM
    Reasoning", arXiv:2506.01939 (ρ = 0.2 there). Statistics of the tokens given, so under
    micro-batching (as in TRL, per micro-batch) the mask depends on the split."""
    h_bgt = jax.lax.stop_gradient(entropy_bgt.astype(jnp.float32))
    valid = jnp.where(mask_bgt, h_bgt, jnp.nan)
    threshold = jnp.nanquantile(valid.reshape(-1), 1.0 - quantile)
    return mask_bgt & (h_bgt >= threshold)


class TermScales(NamedTuple):
    """``D_loss / D_tokens`` of a minibatch, as f32 scalars: what turns a token-mean term's
    token sum into the loss's own units (``None``: the term follows the loss's aggregation)."""

    kl: chex.Array | None = None
    entropy: chex.Array | None = None


def term_scales(objective: Objective, mask_bgt: chex.Array) -> TermScales:
    """The :class:`TermScales` of the batch (or minibatch) ``mask_bgt`` (any leading axes:
    ``[K, m, T]`` stacked micro-batches too): ``D_loss / max(#tokens, 1)`` for each token-mean
    term, from the masks alone."""
    den_loss = objective.aggregate(jnp.zeros(mask_bgt.shape, jnp.float32), mask_bgt)[1]
    tokens = jnp.maximum(jnp.sum(mask_bgt, dtype=jnp.int32).astype(jnp.float32), 1.0)
    ratio = jnp.maximum(den_loss, 1.0) / tokens
    return TermScales(
        kl=ratio if objective.token_mean_kl and objective.kl is not None else None,
        entropy=ratio if objective.token_mean_entropy and objective.entropy_coef > 0 else None,
    )


class Critic(NamedTuple):
    """A learned value function trained next to the policy (PPO).

    Attributes:
      targets: ``(rollout, advantage_state) -> return_bgt``, the value loss's regression targets
        computed with the same chain state as the advantages (e.g. the same adaptive β).
      value_clip: clip range of the value loss around the rollout-time values, or ``None``.
      aggregate: how the per-token value loss becomes the critic's loss (a ``(sum,
        denominator)`` aggregation, as the policy's); token-mean by default, the actor's mode
        under verl (its critic's ``loss_agg_mode`` follows the actor's).
      agg: the aggregation's name, for ``explain``.
    """

    targets: Callable[[ch.Rollout, Any], chex.Array]
    value_clip: float | None
    aggregate: Aggregation = AGGREGATIONS["token-mean"]
    agg: str = "token-mean"


class Selection(NamedTuple):
    """Which rollouts reach the update.

    Attributes:
      pods_num_keep: keep this many rollouts per prompt by PODS max-variance down-sampling
        (``None``: keep all).
      dynamic_sampling: drop prompts whose group rewards are all equal (DAPO).
    """

    pods_num_keep: int | None = None
    dynamic_sampling: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class Recipe:
    """An online RL algorithm: the chain, the objective, the critic, the selection.

    Hashed by identity, so a recipe can be a static argument of ``jax.jit`` and each recipe
    object compiles once per shape. Build one with :func:`make_recipe` (which derives
    ``requires``) or take a named one from :mod:`jaxrl_llm.algorithms`.

    Attributes:
      name: the algorithm's name (for logs and ``explain``; nothing dispatches on it).
      advantage: the reward → advantage chain.
      objective: the policy objective.
      critic: the value function's targets and clip, or ``None``.
      selection: PODS / DAPO dynamic sampling.
      requires: what the trainer must provide (see the module's requirement constants).
      numerics: the conventions it was built with (this project's or a peer's preset).
      hparams: the keyword arguments it was built with (read-only), for logs.
    """

    name: str
    advantage: ch.AdvantageTransform
    objective: Objective
    critic: Critic | None = None
    selection: Selection = dataclasses.field(default_factory=Selection)
    requires: frozenset[str] = frozenset()
    numerics: nm.Numerics = nm.DEFAULT
    hparams: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({})
    )


class PairLogprobs(NamedTuple):
    """Sequence log-probs and lengths of ``P`` preference pairs (``f32[P]`` each).

    ``ref_chosen_p`` / ``ref_rejected_p`` may be ``None`` for reference-free losses (SimPO).
    ``weight_chosen_p`` / ``weight_rejected_p`` are WPO's answer weights
    (:func:`jaxrl_llm.core.preference.wpo_weights`), given when the recipe requires
    ``SEQUENCE_WEIGHTS``.
    """

    logp_chosen_p: chex.Array
    logp_rejected_p: chex.Array
    len_chosen_p: chex.Array
    len_rejected_p: chex.Array
    ref_chosen_p: chex.Array | None = None
    ref_rejected_p: chex.Array | None = None
    weight_chosen_p: chex.Array | None = None
    weight_rejected_p: chex.Array | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class PreferenceRecipe:
    """An offline preference-optimisation algorithm (the DPO family).

    Attributes:
      name: the algorithm's name.
      loss: ``PairLogprobs -> f32[P]`` per-pair loss (mean over pairs is optimised).
      beta: the coefficient of the implicit reward ``β·log(π/π_ref)`` (also for its metrics).
      requires: ``PREFERENCE_PAIRS`` and, unless reference-free, ``REFERENCE_LOGPROBS``.
      label: the loss in a few words (``"DPO sigmoid"``).
      text: one sentence on what is optimised.
      hparams: the keyword arguments it was built with (read-only), for logs.
    """

    name: str
    loss: Callable[[PairLogprobs], chex.Array]
    beta: float
    requires: frozenset[str]
    label: str
    text: str
    hparams: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({})
    )


AnyRecipe = Recipe | PreferenceRecipe


# --------------------------------------------------------------------------------------------
# Building blocks of the named recipes (names and numerics resolved here, at build time).


def make_recipe(
    name: str,
    *,
    advantage: ch.AdvantageTransform,
    objective: Objective,
    critic: Critic | None = None,
    selection: Selection | None = None,
    numerics: nm.Numerics = nm.DEFAULT,
    hparams: Mapping[str, Any] | None = None,
) -> Recipe:
    """A :class:`Recipe` whose ``requires`` is the union of its parts' requirements."""
    selection = selection or Selection()
    hparams = dict(hparams or {})
    check_hparams(
        name,
        **{k: hparams.get(k) for k in ("beta", "entropy_coef", "gamma", "lam")},
        **{k: hparams.get(k) for k in ("clip_low", "clip_high")},
        pods_num_keep=selection.pods_num_keep,
    )
    objective = objective._replace(
        token_mean_kl=numerics.token_mean_kl, token_mean_entropy=numerics.token_mean_entropy
    )
    requires = ch.requirements(advantage) | objective.requires
    if critic is not None:
        requires |= {VALUES}
    if selection.pods_num_keep is not None or selection.dynamic_sampling:
        requires |= {GROUPS}
    return Recipe(
        name=name,
        advantage=advantage,
        objective=objective,
        critic=critic,
        selection=selection,
        requires=frozenset(requires),
        numerics=numerics,
        hparams=types.MappingProxyType(hparams),
    )


def clip_range(
    clip_eps: float, clip_low: float | None, clip_high: float | None
) -> tuple[float, float]:
    """``(ε_low, ε_high)``: each side ``clip_eps`` unless given."""
    low = clip_eps if clip_low is None else clip_low
    high = clip_eps if clip_high is None else clip_high
    return float(low), float(high)


def agg_mode(
    recipe_default: str,
    loss_agg_mode: str | None,
    numerics: nm.Numerics,
    recipe: str | None = None,
    *,
    fixed: bool = False,
) -> str:
    """The aggregation: the call's ``loss_agg_mode``, else the preset's for ``recipe``
    (``Numerics.recipe_loss_agg_modes``), else the preset's ``loss_agg_mode`` (unless the
    recipe's aggregation is ``fixed``, its defining feature), else the recipe's."""
    if loss_agg_mode:
        return loss_agg_mode
    own = numerics.recipe_loss_agg_mode(recipe) if recipe else None
    if own:
        return own
    return recipe_default if fixed else (numerics.loss_agg_mode or recipe_default)


def kl_term(
    beta: float, estimator: str, numerics: nm.Numerics, *, importance_weighted: bool = False
) -> KLTerm | None:
    """``β·estimator(π_θ ‖ π_ref)`` as a loss term (times ``π_θ/π_old`` when
    ``importance_weighted``), or ``None`` when β = 0."""
    if beta <= 0:
        return None
    fn = functools.partial(ch.kl_estimator(estimator), **numerics.kl_kwargs(estimator))
    return KLTerm(
        estimate=fn, beta=float(beta), label=estimator, importance_weighted=importance_weighted
    )


def off_policy_sequence_mask(loss: PolicyLoss, threshold: float) -> PolicyLoss:
    """``loss`` with the sequences dropped that have a negative advantage and drifted from the
    sampler: DeepSeek-V3.2's off-policy sequence mask (DeepSeek-AI 2025, "DeepSeek-V3.2",
    Eq. 9; TRL GRPO ``off_policy_mask_threshold``, ``GRPOTrainer.get_off_policy_mask``)::

        keep_i = (A_i ≥ 0) or (Σ_t m_t (log π_old − sg(log π_θ)) / max(|y_i|, 1) ≤ δ)

    per token ``ℓ_t ← keep_i·ℓ_t``. π_old is the rollout's log-probs (with the trainer's
    ``old_logprobs.source: sampler`` they equal sg(π_θ), so nothing is dropped)."""
    if not threshold >= 0:
        raise ValueError(f"off_policy_mask_threshold must be >= 0, got {threshold!r}")

    def masked(
        logp_bgt: chex.Array, logp_old_bgt: chex.Array, adv_bgt: chex.Array, mask_bgt: chex.Array
    ) -> chex.Array:
        drift = jnp.where(mask_bgt, logp_old_bgt - jax.lax.stop_gradient(logp_bgt), 0.0)
        length = jnp.maximum(mask_bgt.sum(-1, keepdims=True), 1)
        low_kl = drift.sum(-1, keepdims=True) / length <= threshold
        keep = (adv_bgt >= 0) | low_kl
        return jnp.where(keep, loss(logp_bgt, logp_old_bgt, adv_bgt, mask_bgt), 0.0)

    return masked


def objective(
    loss: PolicyLoss,
    *,
    agg: str,
    agg_norm: int | None = None,
    ratio_metrics: RatioMetrics,
    kl: KLTerm | None = None,
    entropy_coef: float = 0.0,
    on_policy: bool = False,
    label: str,
    text: str,
    rollout_correction: RolloutCorrection | None = None,
    weighted_loss: WeightedLoss | None = None,
) -> Objective:
    """An :class:`Objective` with its requirements: reference log-probs for a KL term, one
    update per batch for a loss without importance ratio (``on_policy``), the sampler's
    log-probs for a ``rollout_correction`` (applied as ``weighted_loss`` when given, else on
    the advantage)."""
    requires = set()
    if kl is not None:
        requires.add(REFERENCE_LOGPROBS)
    if on_policy:
        requires.add(ON_POLICY)
    if rollout_correction is not None:
        requires.add(SAMPLER_LOGPROBS)
    return Objective(
        loss=loss,
        aggregate=aggregation(agg, norm=agg_norm),
        ratio_metrics=ratio_metrics,
        kl=kl,
        entropy_coef=float(entropy_coef),
        requires=frozenset(requires),
        label=label,
        aggregation_label=agg,
        text=text,
        rollout_correction=rollout_correction,
        weighted_loss=weighted_loss if rollout_correction is not None else None,
    )


def weights_times_loss(loss: PolicyLoss) -> WeightedLoss:
    """``ℓ_t ← w_t·loss_t``: the rollout-correction weight on the whole per-token loss, for a
    loss that is not positively homogeneous in the advantage (Clip-Cov and KL-Cov choose their
    tokens from the raw A, KL-Cov's and DRO's penalties carry no A, a sequence-lifted loss
    reads A at one token). verl's ``pg_losses = pg_losses * rollout_is_weights`` after every
    ``compute_policy_loss_*`` (b178a3c ``core_algos.py``), TRL's ``per_token_loss *
    importance_sampling_ratio``. On a loss spread evenly over a sequence (``ℓ_t = L_i/|y_i|``,
    :func:`sequence_level`) the token sum is ``L_i·mean_t w_t``: the sequence's weight is the
    arithmetic mean of its token weights (``level: sequence`` makes it the sequence ratio)."""

    def weighted(
        logp_bgt: chex.Array,
        logp_old_bgt: chex.Array,
        adv_bgt: chex.Array,
        mask_bgt: chex.Array,
        w_bgt: chex.Array,
    ) -> chex.Array:
        loss_bgt = loss(logp_bgt, logp_old_bgt, adv_bgt, mask_bgt)
        return jnp.where(mask_bgt, jax.lax.stop_gradient(w_bgt) * loss_bgt, 0.0)

    return weighted


def geometric_weight_times_loss(loss: PolicyLoss) -> WeightedLoss:
    """``ℓ_t ← W_i·loss_t`` with ``W_i = exp(Σ_t m_t log w_t / max(|y_i|, 1))`` the geometric
    mean of sequence i's token weights, and ``W_i = 0`` when one of its weights is 0 (a
    dropped token drops the sequence: the loss is one surrogate per sequence). verl's
    ``compute_policy_loss_geo_mean`` (GMPO, b178a3c): ``exp(Σ_t m_t log(w_t + 1e-10) /
    (|y_i| + 1e-8))`` times the sequence loss; verl's truncated weights are never 0, and for
    w > 0 the 1e-10 guard changes nothing at f32 precision."""

    def weighted(
        logp_bgt: chex.Array,
        logp_old_bgt: chex.Array,
        adv_bgt: chex.Array,
        mask_bgt: chex.Array,
        w_bgt: chex.Array,
    ) -> chex.Array:
        w_bgt = jax.lax.stop_gradient(w_bgt.astype(jnp.float32))
        zero = jnp.any(mask_bgt & (w_bgt <= 0.0), axis=-1, keepdims=True)
        log_w = jnp.where(
            mask_bgt & (w_bgt > 0.0), jnp.log(jnp.where(w_bgt > 0.0, w_bgt, 1.0)), 0.0
        )
        length = jnp.maximum(mask_bgt.sum(-1, keepdims=True), 1)
        w_seq = jnp.where(zero, 0.0, jnp.exp(log_w.sum(-1, keepdims=True) / length))
        loss_bgt = loss(logp_bgt, logp_old_bgt, adv_bgt, mask_bgt)
        return jnp.where(mask_bgt, w_seq * loss_bgt, 0.0)

    return weighted


def ppo_objective(
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    numerics: nm.Numerics,
    agg: str,
    agg_norm: int | None = None,
    kl: KLTerm | None = None,
    entropy_coef: float = 0.0,
    label: str = "PPO clip",
    text: str | None = None,
    off_policy_mask_threshold: float | None = None,
    rollout_correction: RolloutCorrection | None = None,
) -> Objective:
    """PPO's clipped surrogate (``pl.ppo_clip_loss``) at ``[1 − ε_low, 1 + ε_high]``; the dual
    clip ``c`` is the preset's unless given (0 turns it off); with
    ``off_policy_mask_threshold`` the loss goes through :func:`off_policy_sequence_mask`;
    ``rollout_correction``: see :class:`RolloutCorrection`."""
    kwargs = dict(
        clip_low=float(clip_low),
        clip_high=float(clip_high),
        dual_clip=numerics.dual_clip if dual_clip is None else (dual_clip or None),
        log_ratio_clamp=numerics.log_ratio_clamp,
    )
    default_text = f"clipped surrogate −min(ρA, clip(ρ, 1−{clip_low:g}, 1+{clip_high:g})A)"
    if kwargs["dual_clip"] is not None:
        default_text += f", dual clip c = {kwargs['dual_clip']:g} for A < 0"
    loss = functools.partial(pl.ppo_clip_loss, **kwargs)
    if off_policy_mask_threshold is not None:
        loss = off_policy_sequence_mask(loss, float(off_policy_mask_threshold))
        default_text += (
            f"; sequences with A < 0 and mean log(π_old/π) > {off_policy_mask_threshold:g} "
            "dropped (off-policy sequence mask)"
        )
    return objective(
        loss,
        agg=agg,
        agg_norm=agg_norm,
        ratio_metrics=functools.partial(pl.ratio_metrics, **kwargs),
        kl=kl,
        entropy_coef=entropy_coef,
        label=label,
        text=text or default_text,
        rollout_correction=rollout_correction,
    )


def sequence_level(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Lifts a per-token ratio loss (or its ``ratio_metrics``) to whole sequences: ``fn`` is
    applied to the sequence log-probs ``Σ_t m_t log π`` and ``Σ_t m_t log π_old`` with the
    sequence's advantage (read at its first valid token), so its ratio is the sequence ratio
    ``ρ_i = exp(Σ_t log π − Σ_t log π_old)``; a loss is then spread evenly over the sequence's
    tokens (``ℓ_t = L_i / |y_i|``), so its token sum is ``L_i`` and ``seq-mean-token-sum``
    averages ``L_i`` over sequences. With ``pl.ppo_clip_loss`` this is TRL RLOO's loss
    ``−min(ρA, clip(ρ)A)`` averaged over sequences (``RLOOTrainer._compute_loss``)."""

    def _sequence(
        logp_bgt: chex.Array, logp_old_bgt: chex.Array, adv_bgt: chex.Array, mask_bgt: chex.Array
    ):
        logp_seq = jnp.where(mask_bgt, logp_bgt, 0.0).sum(-1, keepdims=True)
        logp_old_seq = jnp.where(mask_bgt, logp_old_bgt, 0.0).sum(-1, keepdims=True)
        adv_seq = _masked.value_at_first_token(adv_bgt, mask_bgt)[..., None]
        return fn(logp_seq, logp_old_seq, adv_seq, mask_bgt.any(-1, keepdims=True))

    def lifted(
        logp_bgt: chex.Array, logp_old_bgt: chex.Array, adv_bgt: chex.Array, mask_bgt: chex.Array
    ) -> Any:
        out = _sequence(logp_bgt, logp_old_bgt, adv_bgt, mask_bgt)
        if isinstance(out, dict):  # ratio metrics: already (sum, den) pairs over sequences
            return out
        length = jnp.maximum(mask_bgt.sum(-1, keepdims=True), 1)
        return jnp.where(mask_bgt, out / length, 0.0)

    return lifted


def _reinforce_loss(
    logp_bgt: chex.Array, logp_old_bgt: chex.Array, adv_bgt: chex.Array, mask_bgt: chex.Array
) -> chex.Array:
    del logp_old_bgt  # no importance ratio
    return pl.reinforce_loss(logp_bgt, adv_bgt, mask_bgt)


def reinforce_objective(
    *,
    agg: str,
    kl: KLTerm | None = None,
    entropy_coef: float = 0.0,
    text: str,
    rollout_correction: RolloutCorrection | None = None,
) -> Objective:
    """The vanilla policy gradient ``−A·log π`` (no ratio, so one update per batch). With a
    ``rollout_correction`` the update has no π_old pass, so it is verl's bypass ``reinforce``
    loss ``−w·A·log π``, ``w = f(sg(π_θ)/μ)`` (``compute_policy_loss_reinforce``)."""
    return objective(
        _reinforce_loss,
        agg=agg,
        ratio_metrics=pl.ratio_metrics,
        kl=kl,
        entropy_coef=entropy_coef,
        on_policy=True,
        label="REINFORCE −A·log π",
        text=text,
        rollout_correction=rollout_correction,
    )


def reward_stages(numerics: nm.Numerics) -> tuple[ch.AdvantageTransform, ...]:
    """The preset's score clip (OpenRLHF ±10), if any."""
    if numerics.reward_clip is None:
        return ()
    return (ch.clip_reward(*numerics.reward_clip),)


def kl_reward_stages(
    beta: float, estimator: str, numerics: nm.Numerics, kl_controller: Any, *, to_go: bool = False
) -> tuple[ch.AdvantageTransform, ...]:
    """The KL folded into the rewards (a fixed β, or the given controller), if any; ``to_go``:
    after the baseline, as its reward-to-go (``ch.kl_reward_to_go``)."""
    kwargs = numerics.kl_kwargs(estimator)
    stage = ch.kl_reward_to_go if to_go else ch.kl_penalty
    if kl_controller is not None:
        return (stage(kl_controller, estimator=estimator, **kwargs),)
    if beta <= 0:
        return ()
    return (stage(beta, estimator=estimator, **kwargs),)


def outcome_advantage(
    numerics: nm.Numerics,
    estimator: tuple[ch.AdvantageTransform, ...],
    *,
    beta: float = 0.0,
    kl_estimator: str = "k1",
    kl_controller: Any = None,
    shaping: tuple[ch.AdvantageTransform, ...] = (),
) -> ch.AdvantageTransform:
    """An outcome estimator's chain in the preset's order.

    The seeds' order (default, verl, TRL): score clip → ``shaping`` → KL in the reward →
    outcome return → ``estimator`` (baseline, std), so a KL in the reward is summed into the
    score that the group compares. ``numerics.shaping_after_baseline`` (OpenRLHF's
    ``compute_advantages_and_returns``): ``shaping`` → outcome return → ``estimator`` on the
    raw score → score clip on the baselined score → the KL's per-token reward-to-go.
    """
    if numerics.shaping_after_baseline:
        clip = () if numerics.reward_clip is None else (ch.clip_advantage(*numerics.reward_clip),)
        kl = kl_reward_stages(beta, kl_estimator, numerics, kl_controller, to_go=True)
        return ch.chain(*shaping, ch.outcome_return(), *estimator, *clip, *kl)
    return ch.chain(
        *reward_stages(numerics),
        *shaping,
        *kl_reward_stages(beta, kl_estimator, numerics, kl_controller),
        ch.outcome_return(),
        *estimator,
    )


def kl_placement(
    name: str, kl_in_reward: bool | None, kl_estimator: str | None, numerics: nm.Numerics
) -> tuple[bool, str]:
    """``(in_reward, estimator)``: the call's ``kl_in_reward``, else the preset's
    ``group_kl_in_reward``; the estimator the call's, else k1 in the reward and k3 in the loss
    (OpenRLHF's and GRPO's defaults)."""
    if kl_in_reward is not None and not isinstance(kl_in_reward, bool):
        raise ValueError(
            f"{name}: `kl_in_reward` must be true, false or null, got {kl_in_reward!r}"
        )
    in_reward = numerics.group_kl_in_reward if kl_in_reward is None else kl_in_reward
    estimator = kl_estimator if kl_estimator is not None else ("k1" if in_reward else "k3")
    ch.kl_estimator(estimator)  # validates the name
    return in_reward, estimator


def whiten_stage(numerics: nm.Numerics, axis_name: str | None) -> ch.AdvantageTransform:
    """Global batch whitening with the preset's ddof and eps."""
    return ch.batch_whiten(
        ddof=numerics.whiten_ddof,
        eps=numerics.whiten_eps,
        eps_as_floor=numerics.whiten_eps_as_floor,
        axis_name=axis_name,
    )


def group_norm_stages(
    numerics: nm.Numerics, scale_by_std: bool
) -> tuple[ch.AdvantageTransform, ...]:
    """The group-mean baseline and, with ``scale_by_std``, the group std (GRPO)."""
    stages = [ch.group_mean_baseline(singleton_baseline=numerics.group_singleton_baseline)]
    if scale_by_std:
        stages.append(
            ch.group_std_scale(
                ddof=numerics.group_std_ddof,
                eps=numerics.group_std_eps,
                singleton_std=numerics.singleton_std,
            )
        )
    return tuple(stages)


def gae_critic(
    returns: ch.AdvantageTransform, *, value_clip: float | None, agg: str = "token-mean"
) -> Critic:
    """A critic regressed on ``R_t = A_t + V_t``, the unnormalised output of ``returns`` (the
    advantage chain up to and including GAE), run with the advantage chain's state for those
    stages: the recipe's advantage must be ``chain(returns, *normalisation)``; its value loss
    aggregated with ``agg``."""

    def targets(rollout: ch.Rollout, advantage_state: Any) -> chex.Array:
        adv_bgt, _ = ch.apply(returns, rollout, advantage_state[0])
        value_bgt = ch.require(rollout, "value_bgt", "value targets")
        return jnp.where(ch.token_mask(rollout), adv_bgt + value_bgt, 0.0)

    return Critic(targets=targets, value_clip=value_clip, aggregate=aggregation(agg), agg=agg)


def check_hparams(name: str, **values: float | None) -> None:
    """Range checks shared by the recipes, naming the recipe and the keyword."""
    for key, value in values.items():
        if value is None:
            continue
        if key in ("beta", "entropy_coef") and value < 0:
            raise ValueError(f"{name}: `{key}` must be >= 0, got {value!r}")
        if key in ("gamma", "lam") and not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}: `{key}` must be in [0, 1], got {value!r}")
        if key in ("clip_low", "clip_high") and value <= 0:
            raise ValueError(f"{name}: `{key}` must be > 0, got {value!r}")
        if key == "pods_num_keep" and value < 1:
            raise ValueError(f"{name}: `pods_num_keep` must be >= 1, got {value!r}")


def hparam_defaults(builder: Callable[..., AnyRecipe]) -> dict[str, Any]:
    """The keyword defaults of a recipe builder (what a config may set)."""
    return {
        n: p.default
        for n, p in inspect.signature(builder).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


# --------------------------------------------------------------------------------------------
# Running a recipe.


@functools.partial(jax.jit, static_argnums=0)
def _compute_advantages_jit(recipe: Recipe, rollout: ch.Rollout) -> chex.Array:
    adv_bgt, _ = ch.apply(recipe.advantage, rollout)
    return adv_bgt


def compute_advantages(recipe: AnyRecipe, rollout: ch.Rollout) -> chex.Array:
    """``f32[B, G, T]`` advantages of ``recipe`` on ``rollout`` (jit-compiled once per recipe
    object and shape; 0 on padding and non-members).

    Stateful stages (an adaptive KL controller) start from their initial state here; to carry
    the state across steps use ``recipe.advantage.init`` / ``chain.apply`` directly.
    """
    if isinstance(recipe, PreferenceRecipe):
        raise ValueError(
            f"compute_advantages: recipe {recipe.name!r} is an offline preference recipe with no "
            "advantage; call its `loss` on a jaxrl_llm.recipe.PairLogprobs"
        )
    ch.check_rollout(rollout, fn=f"compute_advantages({recipe.name})")
    return _compute_advantages_jit(recipe, rollout)


def select(recipe: Recipe, rollout: ch.Rollout) -> ch.Rollout:
    """Applies the recipe's sample selection to the group membership ``mask_bg``.

    PODS keeps ``pods_num_keep`` rollouts per prompt maximising reward variance; DAPO's dynamic
    sampling drops every member of prompts whose rewards are all equal. Shapes are unchanged;
    the trainer gathers the kept rows (and refills dropped prompts) before the update.
    """
    ch.check_rollout(rollout, fn=f"select({recipe.name})")
    mask_bg = ch.member_mask(rollout)
    reward_bg = jnp.asarray(rollout.reward_bg, jnp.float32)
    if recipe.selection.pods_num_keep is not None:
        mask_bg = sel.pods_max_variance(reward_bg, mask_bg, num_keep=recipe.selection.pods_num_keep)
    if recipe.selection.dynamic_sampling:
        keep_b = sel.dapo_group_filter(reward_bg, mask_bg)
        mask_bg = mask_bg & keep_b[:, None]
    return rollout._replace(mask_bg=mask_bg)


class LossTerms(NamedTuple):
    """``(sum, denominator)`` pairs of each loss term; the loss is ``finalize(*total)``."""

    total: Pair
    policy: Pair
    kl: Pair
    entropy: Pair


def policy_objective(
    recipe: Recipe | Objective,
    logp_bgt: chex.Array,
    adv_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    logp_old_bgt: chex.Array | None = None,
    logp_ref_bgt: chex.Array | None = None,
    entropy_bgt: chex.Array | None = None,
    scales: TermScales | None = None,
    correction_weight_bgt: chex.Array | None = None,
) -> LossTerms:
    """The policy objective as ``(sum, denominator)`` pairs, differentiable in ``logp_bgt``.

    ``correction_weight_bgt``: the rollout correction's weights w for an objective with a
    ``weighted_loss`` (its policy loss is then ``weighted_loss(..., w)``; the KL and entropy
    terms are not weighted); the other objectives take w in ``adv_bgt`` (``A·w``).

    Per token: ``ℓ_t = loss_t + β·KL_t(π_θ ‖ π_ref) − c_H·H_t`` (the KL term only when the
    objective has one), aggregated with the objective's mode. Because sums and denominators
    add, micro-batches and shards combine to exactly the whole-batch loss. Without
    ``logp_old_bgt`` the rollout is taken as on-policy: ``logp_old = stop_gradient(logp)``.

    With ``token_mean_kl`` / ``token_mean_entropy`` (OpenRLHF, TRL) a term is a token mean
    whatever the loss's mode: ``L = agg(loss) + β·Σ KL/N_tok − c_H·Σ H/N_tok``. Its token sum
    enters the loss's sum times ``scales`` (``D_loss / N_tok`` of the *minibatch*, which the
    update computes once per minibatch so that micro-batches still add up exactly); without
    ``scales`` they are this batch's own (:func:`term_scales`).
    """
    obj = recipe.objective if isinstance(recipe, Recipe) else recipe
    where = recipe.name if isinstance(recipe, Recipe) else obj.label
    if logp_old_bgt is None:
        logp_old_bgt = jax.lax.stop_gradient(logp_bgt)
    if scales is None:
        scales = term_scales(obj, mask_bgt) if obj.mixed_aggregation else TermScales()
    token_mean = AGGREGATIONS["token-mean"]
    extra_sum = jnp.zeros((), jnp.float32)  # token-mean terms, in the loss's units
    zero = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    if correction_weight_bgt is None:
        policy_bgt = obj.loss(logp_bgt, logp_old_bgt, adv_bgt, mask_bgt)
    elif obj.weighted_loss is not None:
        w_bgt = correction_weight_bgt
        policy_bgt = obj.weighted_loss(logp_bgt, logp_old_bgt, adv_bgt, mask_bgt, w_bgt)
    else:
        raise ValueError(
            f"policy_objective({where}): `correction_weight_bgt` given, but the objective has no "
            "`weighted_loss`; pass the weighted advantages A·w instead"
        )
    if obj.top_entropy_quantile < 1.0:
        if entropy_bgt is None:
            raise ValueError(
                f"policy_objective({where}): top_entropy_quantile={obj.top_entropy_quantile} "
                "needs `entropy_bgt`"
            )
        keep_bgt = high_entropy_mask(entropy_bgt, mask_bgt, obj.top_entropy_quantile)
        policy_bgt = jnp.where(keep_bgt, policy_bgt, 0.0)
    total_bgt = policy_bgt
    kl_terms = entropy_terms = zero
    if obj.kl is not None:
        if logp_ref_bgt is None:
            raise ValueError(
                f"policy_objective({where}): beta={obj.kl.beta} puts a KL term in the loss, "
                "so `logp_ref_bgt` is required"
            )
        kl_bgt = obj.kl.estimate(logp_bgt, logp_ref_bgt)
        if obj.kl.importance_weighted:
            kl_bgt = kl_bgt * jnp.exp(jnp.clip(logp_bgt - logp_old_bgt, -20.0, 20.0))
        kl_bgt = jnp.where(mask_bgt, kl_bgt, 0.0)
        if scales.kl is None:
            total_bgt = total_bgt + obj.kl.beta * kl_bgt
            kl_terms = obj.aggregate(kl_bgt, mask_bgt)
        else:
            kl_terms = token_mean(kl_bgt, mask_bgt)
            extra_sum = extra_sum + obj.kl.beta * scales.kl * kl_terms[0]
    if obj.entropy_coef > 0:
        if entropy_bgt is None:
            raise ValueError(
                f"policy_objective({where}): entropy_coef={obj.entropy_coef} needs `entropy_bgt`"
            )
        bonus_bgt = pl.entropy_bonus(entropy_bgt, mask_bgt, coef=obj.entropy_coef)
        entropy_masked = jnp.where(mask_bgt, entropy_bgt, 0.0)
        if scales.entropy is None:
            total_bgt = total_bgt + bonus_bgt
            entropy_terms = obj.aggregate(entropy_masked, mask_bgt)
        else:
            entropy_terms = token_mean(entropy_masked, mask_bgt)
            bonus_sum = jnp.sum(jnp.where(mask_bgt, bonus_bgt, 0.0))
            extra_sum = extra_sum + scales.entropy * bonus_sum
    total_sum, total_den = obj.aggregate(total_bgt, mask_bgt)
    return LossTerms(
        total=(total_sum + extra_sum, total_den),
        policy=obj.aggregate(policy_bgt, mask_bgt),
        kl=kl_terms,
        entropy=entropy_terms,
    )


def value_targets(recipe: Recipe, rollout: ch.Rollout, advantage_state: Any) -> chex.Array:
    """``f32[B, G, T]`` regression targets of the recipe's critic (0 on padding)."""
    if recipe.critic is None:
        raise ValueError(f"value_targets: recipe {recipe.name!r} has no critic")
    return recipe.critic.targets(rollout, advantage_state)


__all__ = [
    "AGGREGATIONS",
    "BEHAVIOUR_LOGPROBS",
    "GIVEN_BASELINE",
    "GROUPS",
    "ON_POLICY",
    "PREFERENCE_PAIRS",
    "REFERENCE_LOGPROBS",
    "REWARD_COMPONENTS",
    "SAMPLER_LOGPROBS",
    "SEQUENCE_WEIGHTS",
    "VALUES",
    "AnyRecipe",
    "Critic",
    "KLTerm",
    "LossTerms",
    "Objective",
    "PairLogprobs",
    "PreferenceRecipe",
    "Recipe",
    "RolloutCorrection",
    "Selection",
    "TermScales",
    "WeightedLoss",
    "aggregation",
    "check_entropy_quantile",
    "compute_advantages",
    "geometric_weight_times_loss",
    "high_entropy_mask",
    "make_recipe",
    "policy_objective",
    "rollout_correction",
    "select",
    "term_scales",
    "value_targets",
    "weights_times_loss",
]
