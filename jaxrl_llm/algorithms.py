"""Named algorithms as recipes: compositions of the chain, a policy loss and an aggregation.

A :class:`~jaxrl_llm.recipe.Recipe` is a value made of functions, not a class to subclass: the
advantage chain, the objective (per-token loss, aggregation, KL and entropy terms), the critic,
the selection, and what it requires of the trainer (see :mod:`jaxrl_llm.recipe`). Each function
below is a docstring, like the paper it comes from, and one composition; variants are keyword
arguments (or ``functools.partial``), never subclasses. Hyperparameters are named as in the
literature: ``beta`` (KL coefficient), ``gamma``, ``lam``, ``clip_eps`` or
``clip_low``/``clip_high``, ``kl_estimator``; ``numerics`` picks this project's conventions or a
peer's preset (``"verl"``, ``"trl"``, ``"openrlhf"``; see :mod:`jaxrl_llm.numerics`).

Where the KL goes follows the seed documents: ``ppo``, ``reinforce``, ``rloo`` and
``reinforce_pp`` shape the token rewards with the KL between the rollout policy and the
reference (k1 by default), so it flows into returns and advantages; ``grpo``, ``dr_grpo``,
``reinforce_pp_baseline``, ``dapo`` and ``gspo`` add it as a separate per-token loss term on the
current policy (k3 by default).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping

import jax.numpy as jnp

from jaxrl_llm import chain as ch
from jaxrl_llm import numerics as nm
from jaxrl_llm import recipe as rc
from jaxrl_llm.core import kl as _kl
from jaxrl_llm.core import policy_losses as pl
from jaxrl_llm.core import preference as pref
from jaxrl_llm.recipe import PreferenceRecipe, Recipe, Selection

# --------------------------------------------------------------------------------------------
# The recipes.


def reinforce(
    *,
    beta: float = 0.01,
    gamma: float = 1.0,
    kl_estimator: str = "k1",
    kl_controller: _kl.KLController | None = None,
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    rollout_correction: rc.RolloutCorrection | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """REINFORCE (Williams 1992, "Simple statistical gradient-following algorithms"):
    ``∇J = E[Σ_t G_t ∇log π(y_t | ·)]`` with ``G_t = Σ_{k≥t} γ^{k−t}(r_k − β·KL_k)``.

    Chain: KL in reward → reward-to-go. No baseline, no normalisation; loss ``−G_t·log π``
    summed over tokens and averaged over sequences (``seq-mean-token-sum``).

    ``rollout_correction`` (:class:`~jaxrl_llm.recipe.RolloutCorrection`): no ratio and no
    π_old pass, so verl's bypass ``reinforce`` loss ``−w·A·log π``, ``w = f(sg(π_θ)/μ)``
    (``compute_policy_loss_reinforce``; ``A ← w·A``).
    """
    n = nm.resolve(numerics)
    correction = rc.rollout_correction("reinforce", rollout_correction)
    return rc.make_recipe(
        "reinforce",
        numerics=n,
        advantage=ch.chain(
            *rc.reward_stages(n),
            *rc.kl_reward_stages(beta, kl_estimator, n, kl_controller),
            ch.discounted_return(gamma, skip_masked=n.skip_masked_tokens),
        ),
        objective=rc.reinforce_objective(
            agg=rc.agg_mode("seq-mean-token-sum", loss_agg_mode, n),
            entropy_coef=entropy_coef,
            text="−A·log π (vanilla policy gradient, no ratio, no clip)",
            rollout_correction=correction,
        ),
        hparams=dict(
            beta=beta,
            gamma=gamma,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
            rollout_correction=correction,
        ),
    )


def ppo(
    *,
    beta: float = 0.05,
    gamma: float = 1.0,
    lam: float = 0.95,
    clip_eps: float = 0.2,
    clip_low: float | None = None,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    value_clip: float | None = None,
    kl_estimator: str = "k1",
    kl_controller: _kl.KLController | None = None,
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    rollout_correction: rc.RolloutCorrection | None = None,
    axis_name: str | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """PPO for RLHF (Schulman et al. 2017, arXiv:1707.06347; Ouyang et al. 2022,
    arXiv:2203.02155): per-token rewards ``r_t − β·KL_t`` with the score on the last token, GAE
    with a learned critic (arXiv:1506.02438), batch-whitened advantages, clipped surrogate
    ``max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high))`` (dual clip ``c`` optional, arXiv:1912.09729),
    clipped value loss regressed on the unwhitened GAE returns ``A_t + V_t``.

    ``value_clip``: the value loss's clip ε_v; ``None`` takes the preset's (0.2 by default, 0.5
    under ``verl`` and ``openrlhf``), 0 turns the clip off.

    ``rollout_correction``: the sampler correction (:class:`~jaxrl_llm.recipe.RolloutCorrection`:
    TIS / MIS / icepop / rejection, token or sequence level, bypass or decoupled), or None.
    """
    n = nm.resolve(numerics)
    correction = rc.rollout_correction("ppo", rollout_correction)
    low, high = rc.clip_range(clip_eps, clip_low, clip_high)
    if value_clip is None:
        value_clip = 0.2 if n.value_clip is None else n.value_clip
    if value_clip < 0:
        raise ValueError(f"ppo: `value_clip` must be >= 0 (0: no clip), got {value_clip!r}")
    value_clip = float(value_clip) or None
    agg = rc.agg_mode("token-mean", loss_agg_mode, n)
    returns = ch.chain(
        *rc.reward_stages(n),
        *rc.kl_reward_stages(beta, kl_estimator, n, kl_controller),
        ch.gae(gamma, lam, skip_masked=n.skip_masked_tokens),
    )
    return rc.make_recipe(
        "ppo",
        numerics=n,
        advantage=ch.chain(returns, rc.whiten_stage(n, axis_name)),
        objective=rc.ppo_objective(
            clip_low=low,
            clip_high=high,
            dual_clip=dual_clip,
            numerics=n,
            agg=agg,
            entropy_coef=entropy_coef,
            label="PPO clip + value loss",
            rollout_correction=correction,
            text=(
                f"clipped surrogate −min(ρA, clip(ρ, 1−{low:g}, 1+{high:g})A) + "
                + (f"a value loss clipped at ±{value_clip:g}" if value_clip else "a value loss")
            ),
        ),
        critic=rc.gae_critic(
            returns,
            value_clip=value_clip,
            agg=agg if n.critic_follows_actor_agg else "token-mean",
        ),
        hparams=dict(
            beta=beta,
            gamma=gamma,
            lam=lam,
            clip_low=low,
            clip_high=high,
            value_clip=value_clip,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
            rollout_correction=correction,
        ),
    )


def grpo(
    *,
    beta: float = 0.04,
    clip_eps: float = 0.2,
    clip_low: float | None = None,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    delta: float | None = None,
    scale_by_std: bool = True,
    scale_rewards: str | None = None,
    passk: bool = False,
    reward_aggregation: str = "sum_then_normalize",
    reward_weights: tuple[float, ...] | None = None,
    kl_estimator: str | None = None,
    kl_in_reward: bool | None = None,
    use_bias_correction_kl: bool = False,
    off_policy_mask_threshold: float | None = None,
    rollout_correction: rc.RolloutCorrection | None = None,
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    top_entropy_quantile: float = 1.0,
    pods_num_keep: int | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300): ``A_i = (r_i − mean(r))/(std(r) +
    ε)`` over the G answers of a prompt, the same for every token; PPO's clipped surrogate;
    ``β·k3(π_θ ‖ π_ref)`` as a loss term; per-sequence token mean (``seq-mean-token-mean``).

    ``pods_num_keep`` enables PODS down-sampling (arXiv:2504.13818) before the advantages.
    ``passk=True`` is verl's GRPO pass@k estimator: only each group's best answer gets an
    advantage, ``(r_max − r_second)/(std + ε)`` (``ch.passk_advantage``).
    ``reward_aggregation="normalize_then_sum"`` is GDPO (arXiv:2601.05242, TRL's
    ``multi_objective_aggregation``): each of the K rewards in ``Rollout.reward_bgk`` is
    normalised in its group, their ``reward_weights``-weighted sum whitened over the batch
    (``ch.normalize_then_sum``); it needs the separate rewards (``REWARD_COMPONENTS``).

    ``kl_in_reward=True`` moves the KL from the loss into the reward (``−β·KL_t`` per token,
    k1 unless ``kl_estimator`` says otherwise); ``None`` takes the preset's
    (``group_kl_in_reward``: OpenRLHF's ``group_norm`` puts it in the reward). ``kl_estimator``
    defaults to k3 in the loss, k1 in the reward.

    ``scale_rewards`` (TRL's names): ``"group"`` (÷ the group std, the default),
    ``"batch"`` (÷ the std of the raw rewards over the whole batch, centring still per group:
    TRL's ``scale_rewards="batch"``) or ``"none"`` (no std: ``scale_by_std=False``); ``None``
    follows ``scale_by_std``.

    TRL GRPO's options: ``delta`` (two-sided clipping, ``min(ρ, δ)`` in the unclipped term,
    δ > 1 + ε_high) is the dual clip with ``c = δ``: for A ≥ 0 the cap never binds and for
    A < 0 both cap the loss at ``δ·|A|``, the same piecewise function (so ``dual_clip`` and
    ``delta`` exclude each other); ``use_bias_correction_kl`` multiplies the KL term by
    ``π_θ/π_old`` (``KLTerm.importance_weighted``); ``off_policy_mask_threshold`` drops
    negative-advantage sequences that drifted from π_old (:func:`rc.off_policy_sequence_mask`);
    ``top_entropy_quantile`` ρ < 1 keeps the policy loss on the tokens whose entropy is in the
    top ρ of the micro-batch's (Wang et al. 2025, "Beyond the 80/20 Rule", arXiv:2506.01939;
    TRL's option; :func:`rc.high_entropy_mask`).

    ``rollout_correction``: the sampler correction (:class:`~jaxrl_llm.recipe.RolloutCorrection`:
    TIS / MIS / icepop / rejection, token or sequence level, bypass or decoupled), or None.
    """
    n = nm.resolve(numerics)
    correction = rc.rollout_correction("grpo", rollout_correction)
    low, high = rc.clip_range(clip_eps, clip_low, clip_high)
    in_reward, kl_estimator = rc.kl_placement("grpo", kl_in_reward, kl_estimator, n)
    if delta is not None:
        if dual_clip is not None:
            raise ValueError("grpo: give `delta` (TRL's name) or `dual_clip`, not both")
        if not delta > 1.0 + high:
            raise ValueError(
                f"grpo: `delta` must be > 1 + clip_high = {1.0 + high:g} (TRL: δ > 1 + ε), got "
                f"{delta!r}"
            )
        dual_clip = float(delta)
    if use_bias_correction_kl and in_reward:
        raise ValueError("grpo: `use_bias_correction_kl` applies to a KL in the loss only")
    if scale_rewards is None:
        scale_rewards = "group" if scale_by_std else "none"
    elif scale_rewards not in ("group", "batch", "none"):
        raise ValueError(
            f"grpo: scale_rewards={scale_rewards!r}; expected 'group', 'batch' or 'none'"
        )
    elif not scale_by_std and scale_rewards != "none":
        raise ValueError(
            f"grpo: scale_by_std=False contradicts scale_rewards={scale_rewards!r}; give one"
        )
    if scale_rewards == "batch" and (passk or reward_aggregation != "sum_then_normalize"):
        raise ValueError("grpo: scale_rewards='batch' applies to the group-mean estimator only")
    scale_by_std = scale_rewards == "group"
    if reward_aggregation not in ("sum_then_normalize", "normalize_then_sum"):
        raise ValueError(
            f"grpo: reward_aggregation={reward_aggregation!r}; expected 'sum_then_normalize' or "
            "'normalize_then_sum'"
        )
    if passk and reward_aggregation == "normalize_then_sum":
        raise ValueError(
            "grpo: `passk` and reward_aggregation='normalize_then_sum' exclude each other"
        )
    if reward_weights is not None and reward_aggregation != "normalize_then_sum":
        raise ValueError(
            "grpo: `reward_weights` only applies to reward_aggregation='normalize_then_sum'"
        )
    if passk:
        estimator = (ch.passk_advantage(scale_by_std=scale_by_std),)
    elif reward_aggregation == "normalize_then_sum":
        weights = None if reward_weights is None else tuple(float(w) for w in reward_weights)
        estimator = (ch.normalize_then_sum(weights=weights),)
    else:
        estimator = rc.group_norm_stages(n, scale_by_std)
        if scale_rewards == "batch":
            estimator += (
                ch.batch_std_scale(ddof=n.group_std_ddof, eps=n.group_std_eps, source="reward"),
            )
    return rc.make_recipe(
        "grpo",
        numerics=n,
        advantage=rc.outcome_advantage(
            n, estimator, beta=beta if in_reward else 0.0, kl_estimator=kl_estimator
        ),
        objective=rc.ppo_objective(
            clip_low=low,
            clip_high=high,
            dual_clip=dual_clip,
            numerics=n,
            agg=rc.agg_mode("seq-mean-token-mean", loss_agg_mode, n),
            kl=None
            if in_reward
            else rc.kl_term(
                beta, kl_estimator, n, importance_weighted=bool(use_bias_correction_kl)
            ),
            entropy_coef=entropy_coef,
            off_policy_mask_threshold=off_policy_mask_threshold,
            rollout_correction=correction,
        )._replace(top_entropy_quantile=rc.check_entropy_quantile("grpo", top_entropy_quantile)),
        selection=Selection(pods_num_keep=pods_num_keep),
        hparams=dict(
            beta=beta,
            kl_in_reward=in_reward,
            use_bias_correction_kl=use_bias_correction_kl,
            off_policy_mask_threshold=off_policy_mask_threshold,
            rollout_correction=correction,
            delta=delta,
            clip_low=low,
            clip_high=high,
            scale_by_std=scale_by_std,
            scale_rewards=scale_rewards,
            passk=passk,
            reward_aggregation=reward_aggregation,
            reward_weights=reward_weights,
            pods_num_keep=pods_num_keep,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
            top_entropy_quantile=top_entropy_quantile,
        ),
    )


def dr_grpo(
    *,
    beta: float = 0.0,
    clip_eps: float = 0.2,
    clip_low: float | None = None,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    max_completion_length: int | None = None,
    kl_estimator: str | None = None,
    kl_in_reward: bool | None = None,
    entropy_coef: float = 0.0,
    pods_num_keep: int | None = None,
    rollout_correction: rc.RolloutCorrection | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783):
    GRPO without the std division (``A_i = r_i − mean(r)``) and without the per-sequence length
    normaliser: token losses are summed and divided by a constant (``max_completion_length``,
    default the padded T) times the number of sequences (``seq-mean-token-sum-norm``); no KL.
    ``kl_in_reward`` / ``kl_estimator`` as in :func:`grpo` (for ``beta > 0``). Under
    ``numerics="openrlhf"`` the loss is a token mean: OpenRLHF's ``dr_grpo`` changes the
    advantage only, its ``--actor.loss_agg_mode`` stays token-mean.

    ``rollout_correction``: the sampler correction (:class:`~jaxrl_llm.recipe.RolloutCorrection`:
    TIS / MIS / icepop / rejection, token or sequence level, bypass or decoupled), or None.
    """
    n = nm.resolve(numerics)
    correction = rc.rollout_correction("dr_grpo", rollout_correction)
    low, high = rc.clip_range(clip_eps, clip_low, clip_high)
    in_reward, kl_estimator = rc.kl_placement("dr_grpo", kl_in_reward, kl_estimator, n)
    # OpenRLHF's `dr_grpo` is an advantage estimator only: its loss keeps the actor's token-mean
    agg = rc.agg_mode("seq-mean-token-sum-norm", None, n, "dr_grpo", fixed=True)
    return rc.make_recipe(
        "dr_grpo",
        numerics=n,
        advantage=rc.outcome_advantage(
            n,
            rc.group_norm_stages(n, False),
            beta=beta if in_reward else 0.0,
            kl_estimator=kl_estimator,
        ),
        objective=rc.ppo_objective(
            clip_low=low,
            clip_high=high,
            dual_clip=dual_clip,
            numerics=n,
            agg=agg,
            agg_norm=max_completion_length if agg == "seq-mean-token-sum-norm" else None,
            kl=None if in_reward else rc.kl_term(beta, kl_estimator, n),
            entropy_coef=entropy_coef,
            rollout_correction=correction,
            text=(
                f"clipped surrogate −min(ρA, clip(ρ, 1−{low:g}, 1+{high:g})A), token sums ÷ a "
                "constant length"
            ),
        ),
        selection=Selection(pods_num_keep=pods_num_keep),
        hparams=dict(
            beta=beta,
            kl_in_reward=in_reward,
            clip_low=low,
            clip_high=high,
            max_completion_length=max_completion_length,
            pods_num_keep=pods_num_keep,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
            rollout_correction=correction,
        ),
    )


def rloo(
    *,
    beta: float = 0.05,
    kl_estimator: str = "k1",
    kl_controller: _kl.KLController | None = None,
    normalize_advantages: bool = False,
    reward_clip_range: tuple[float, float] | None = None,
    clip_eps: float | None = None,
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    pods_num_keep: int | None = None,
    rollout_correction: rc.RolloutCorrection | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740):
    ``A_i = R_i − 1/(G−1)·Σ_{j≠i} R_j`` with ``R_i = r_i − β·Σ_t KL_t`` (KL folded into the
    sequence reward), no std, no clipping: REINFORCE on whole sequences. Under
    ``numerics="openrlhf"`` the baseline is taken on the raw scores and the KL enters after it,
    ``A_t = (s_i − mean_{j≠i} s_j) − β·Σ_{t'≥t} KL_t'`` (OpenRLHF's ``rloo``).

    TRL RLOO's options: ``reward_clip_range=(lo, hi)`` clips the raw score before the KL;
    ``normalize_advantages`` whitens the per-sequence advantages over the batch,
    ``(A − mean)/(std₁ + 1e-4)``. Under ``numerics="trl"`` the loss is a mean over sequences
    of the sequence loss (``seq-mean-token-sum``), as TRL's ``per_sequence_loss.mean()``.
    ``clip_eps=ε`` is TRL's off-policy RLOO: the sequence ratio ``ρ = exp(Σ_t log π −
    Σ_t log π_old)`` clipped, ``−min(ρA, clip(ρ, 1−ε, 1+ε)A)`` per sequence
    (``rc.sequence_level`` of PPO's loss), so several updates per batch are allowed; ``None``
    (the default) is on-policy REINFORCE, one update per batch.

    ``rollout_correction`` (:class:`~jaxrl_llm.recipe.RolloutCorrection`): on-policy, verl's
    bypass ``reinforce`` loss ``−w·A·log π``, ``w = f(sg(π_θ)/μ)`` (``A ← w·A``); with
    ``clip_eps`` the weight multiplies the spread sequence loss, ``ℓ_t ← w_t·L_i/|y_i|``
    (:func:`~jaxrl_llm.recipe.weights_times_loss`: the sequence's weight is the mean of its
    token weights, the sequence ratio with ``level: sequence``; TRL's RLOO has no correction,
    so this is our choice).
    """
    n = nm.resolve(numerics)
    correction = rc.rollout_correction("rloo", rollout_correction)
    shaping = ()
    if reward_clip_range is not None:
        low, high = (float(x) for x in reward_clip_range)
        if not low < high:
            raise ValueError(
                f"rloo: `reward_clip_range` must be (low, high) with low < high, got "
                f"{reward_clip_range!r}"
            )
        shaping = (ch.clip_reward(low, high),)
    whiten = (ch.sequence_whiten(ddof=1, eps=1e-4),) if normalize_advantages else ()
    agg = rc.agg_mode("seq-mean-token-sum", loss_agg_mode, n, "rloo")
    if clip_eps is None:
        objective = rc.reinforce_objective(
            agg=agg,
            entropy_coef=entropy_coef,
            text="−A·log π summed over each sequence (REINFORCE, no ratio, no clip)",
            rollout_correction=correction,
        )
    else:
        if not clip_eps > 0:
            raise ValueError(f"rloo: `clip_eps` must be > 0 (or None), got {clip_eps!r}")
        kw = dict(
            clip_low=float(clip_eps),
            clip_high=float(clip_eps),
            dual_clip=None,
            log_ratio_clamp=n.log_ratio_clamp,
        )
        loss = rc.sequence_level(functools.partial(pl.ppo_clip_loss, **kw))
        objective = rc.objective(
            loss,
            agg=agg,
            ratio_metrics=rc.sequence_level(functools.partial(pl.ratio_metrics, **kw)),
            entropy_coef=entropy_coef,
            label="RLOO sequence-ratio clip",
            text=(
                f"−min(ρA, clip(ρ, 1−{clip_eps:g}, 1+{clip_eps:g})A) per sequence, "
                "ρ = exp(Σ_t log π − Σ_t log π_old) (TRL's off-policy RLOO)"
            ),
            rollout_correction=correction,
            weighted_loss=rc.weights_times_loss(loss),
        )
    return rc.make_recipe(
        "rloo",
        numerics=n,
        advantage=rc.outcome_advantage(
            n,
            (ch.leave_one_out_baseline(singleton_baseline=n.loo_singleton_baseline), *whiten),
            beta=beta,
            kl_estimator=kl_estimator,
            kl_controller=kl_controller,
            shaping=shaping,
        ),
        objective=objective,
        selection=Selection(pods_num_keep=pods_num_keep),
        hparams=dict(
            beta=beta,
            kl_estimator=kl_estimator,
            normalize_advantages=normalize_advantages,
            reward_clip_range=reward_clip_range,
            clip_eps=clip_eps,
            pods_num_keep=pods_num_keep,
            entropy_coef=entropy_coef,
            rollout_correction=correction,
        ),
    )


def reinforce_pp(
    *,
    beta: float = 0.01,
    gamma: float = 1.0,
    clip_eps: float = 0.2,
    clip_low: float | None = None,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    kl_estimator: str = "k1",
    kl_controller: _kl.KLController | None = None,
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    axis_name: str | None = None,
    rollout_correction: rc.RolloutCorrection | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """REINFORCE++ (Hu et al. 2025, arXiv:2501.03262): token rewards ``r_t − β·KL_t``,
    reward-to-go, then whitening over every valid token of the global batch (not per prompt);
    PPO's clipped surrogate with a token mean.

    ``rollout_correction``: the sampler correction (:class:`~jaxrl_llm.recipe.RolloutCorrection`:
    TIS / MIS / icepop / rejection, token or sequence level, bypass or decoupled), or None.
    """
    n = nm.resolve(numerics)
    correction = rc.rollout_correction("reinforce_pp", rollout_correction)
    low, high = rc.clip_range(clip_eps, clip_low, clip_high)
    return rc.make_recipe(
        "reinforce_pp",
        numerics=n,
        advantage=ch.chain(
            *rc.reward_stages(n),
            *rc.kl_reward_stages(beta, kl_estimator, n, kl_controller),
            ch.discounted_return(gamma, skip_masked=n.skip_masked_tokens),
            rc.whiten_stage(n, axis_name),
        ),
        objective=rc.ppo_objective(
            clip_low=low,
            clip_high=high,
            dual_clip=dual_clip,
            numerics=n,
            agg=rc.agg_mode("token-mean", loss_agg_mode, n),
            entropy_coef=entropy_coef,
            rollout_correction=correction,
        ),
        hparams=dict(
            beta=beta,
            gamma=gamma,
            clip_low=low,
            clip_high=high,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
            rollout_correction=correction,
        ),
    )


def reinforce_pp_baseline(
    *,
    beta: float = 0.01,
    clip_eps: float = 0.2,
    clip_low: float | None = None,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    kl_estimator: str | None = None,
    kl_in_reward: bool | None = None,
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    axis_name: str | None = None,
    pods_num_keep: int | None = None,
    rollout_correction: rc.RolloutCorrection | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """REINFORCE++-baseline (Hu et al. 2025, arXiv:2501.03262): ``r_i − mean(group)`` (no
    per-group std), then global batch whitening; ``β·k3`` as a loss term; clipped surrogate.
    ``kl_in_reward`` / ``kl_estimator`` as in :func:`grpo` (OpenRLHF's ``reinforce_baseline``
    puts a k1 KL in the reward, after the baseline, before the whitening).

    ``rollout_correction``: the sampler correction (:class:`~jaxrl_llm.recipe.RolloutCorrection`:
    TIS / MIS / icepop / rejection, token or sequence level, bypass or decoupled), or None.
    """
    n = nm.resolve(numerics)
    correction = rc.rollout_correction("reinforce_pp_baseline", rollout_correction)
    low, high = rc.clip_range(clip_eps, clip_low, clip_high)
    name = "reinforce_pp_baseline"
    in_reward, kl_estimator = rc.kl_placement(name, kl_in_reward, kl_estimator, n)
    return rc.make_recipe(
        name,
        numerics=n,
        advantage=ch.chain(
            rc.outcome_advantage(
                n,
                rc.group_norm_stages(n, False),
                beta=beta if in_reward else 0.0,
                kl_estimator=kl_estimator,
            ),
            rc.whiten_stage(n, axis_name),
        ),
        objective=rc.ppo_objective(
            clip_low=low,
            clip_high=high,
            dual_clip=dual_clip,
            numerics=n,
            agg=rc.agg_mode("token-mean", loss_agg_mode, n),
            kl=None if in_reward else rc.kl_term(beta, kl_estimator, n),
            entropy_coef=entropy_coef,
            rollout_correction=correction,
        ),
        selection=Selection(pods_num_keep=pods_num_keep),
        hparams=dict(
            beta=beta,
            kl_in_reward=in_reward,
            clip_low=low,
            clip_high=high,
            pods_num_keep=pods_num_keep,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
            rollout_correction=correction,
        ),
    )


def dapo(
    *,
    beta: float = 0.0,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    max_length: int | None = None,
    overlong_buffer: int | None = None,
    overlong_penalty: float = 1.0,
    dynamic_sampling: bool = True,
    kl_estimator: str = "k3",
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    pods_num_keep: int | None = None,
    rollout_correction: rc.RolloutCorrection | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """DAPO (Yu et al. 2025, arXiv:2503.14476): GRPO's group-normalised advantage with
    clip-higher (``ε_low = 0.2``, ``ε_high = 0.28``), a token mean over the whole batch,
    dynamic sampling (prompts whose answers all score the same are dropped and refilled), soft
    overlong punishment (when ``max_length`` and ``overlong_buffer`` are given) and no KL.

    ``rollout_correction``: the sampler correction (:class:`~jaxrl_llm.recipe.RolloutCorrection`:
    TIS / MIS / icepop / rejection, token or sequence level, bypass or decoupled), or None.
    """
    n = nm.resolve(numerics)
    correction = rc.rollout_correction("dapo", rollout_correction)
    if (max_length is None) != (overlong_buffer is None):
        raise ValueError(
            "dapo: give both `max_length` and `overlong_buffer` for overlong shaping, or neither"
        )
    shaping = (
        ()
        if max_length is None
        else (
            ch.overlong_penalty(
                max_length=max_length,
                buffer_length=overlong_buffer,
                penalty_factor=overlong_penalty,
            ),
        )
    )
    return rc.make_recipe(
        "dapo",
        numerics=n,
        advantage=rc.outcome_advantage(n, rc.group_norm_stages(n, True), shaping=shaping),
        objective=rc.ppo_objective(
            clip_low=float(clip_low),
            clip_high=float(clip_high),
            dual_clip=dual_clip,
            numerics=n,
            agg=loss_agg_mode or "token-mean",
            kl=rc.kl_term(beta, kl_estimator, n),
            entropy_coef=entropy_coef,
            label="PPO clip-higher",
            text=(
                f"clip-higher surrogate −min(ρA, clip(ρ, 1−{clip_low:g}, 1+{clip_high:g})A), "
                "token mean over the batch"
            ),
            rollout_correction=correction,
        ),
        selection=Selection(pods_num_keep=pods_num_keep, dynamic_sampling=dynamic_sampling),
        hparams=dict(
            beta=beta,
            clip_low=clip_low,
            clip_high=clip_high,
            max_length=max_length,
            overlong_buffer=overlong_buffer,
            dynamic_sampling=dynamic_sampling,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
            pods_num_keep=pods_num_keep,
            rollout_correction=correction,
        ),
    )


def gspo(
    *,
    beta: float = 0.0,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    kl_estimator: str = "k3",
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    pods_num_keep: int | None = None,
    rollout_correction: rc.RolloutCorrection | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071): GRPO's
    advantage with a sequence-level importance ratio ``s_i = exp(mean_t(log π − log π_old))``
    clipped to ``[1−ε_low, 1+ε_high]`` (paper: 3e-4, 4e-4); ``seq-mean-token-mean`` (the
    paper's), token-mean under ``numerics="verl"`` and ``"trl"`` (their defaults).

    ``rollout_correction`` (:class:`~jaxrl_llm.recipe.RolloutCorrection`): ``A_t ← w_t·A_t``
    on the GSPO-token loss, i.e. ``w_t·max(−A·r_t, −A·clip(r_t))`` per token with ``r_t``
    carrying the sequence ratio s_i (against π_prox when π_old is recomputed; 1 in value in
    bypass) — exactly verl's ``compute_policy_loss_gspo`` (``pg_losses * rollout_is_weights``
    before ``seq-mean-token-mean``). Token-level weights thus correct each token's gradient
    inside the sequence ratio; ``level: sequence`` gives one weight per sequence.
    """
    n = nm.resolve(numerics)
    correction = rc.rollout_correction("gspo", rollout_correction)
    clip = dict(
        clip_low=float(clip_low), clip_high=float(clip_high), log_ratio_clamp=n.gspo_log_ratio_clamp
    )
    return rc.make_recipe(
        "gspo",
        numerics=n,
        advantage=rc.outcome_advantage(n, rc.group_norm_stages(n, True)),
        objective=rc.objective(
            functools.partial(pl.gspo_loss, **clip),
            agg=rc.agg_mode("seq-mean-token-mean", loss_agg_mode, n, "gspo", fixed=True),
            ratio_metrics=functools.partial(pl.ratio_metrics, **clip),
            kl=rc.kl_term(beta, kl_estimator, n),
            entropy_coef=entropy_coef,
            label="GSPO sequence ratio",
            text=(
                f"sequence-ratio surrogate −min(sA, clip(s, 1−{clip_low:g}, 1+{clip_high:g})A), "
                "s = exp(mean_t log ρ_t)"
            ),
            rollout_correction=correction,
        ),
        selection=Selection(pods_num_keep=pods_num_keep),
        hparams=dict(
            beta=beta,
            clip_low=clip_low,
            clip_high=clip_high,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
            pods_num_keep=pods_num_keep,
            rollout_correction=correction,
        ),
    )


# --------------------------------------------------------------------------------------------
# The 2025–26 loss family (issue 17): GRPO's group-normalised advantage (unless said otherwise)
# with a different per-token loss. Formulas and papers in jaxrl_llm.core.policy_losses.


def _grpo_advantage(n: nm.Numerics, scale_by_std: bool = True) -> ch.AdvantageTransform:
    return rc.outcome_advantage(n, rc.group_norm_stages(n, scale_by_std))


def _loss_recipe(
    name: str,
    n: nm.Numerics,
    loss: rc.PolicyLoss,
    *,
    agg: str,
    ratio_kwargs: dict,
    beta: float,
    kl_estimator: str,
    entropy_coef: float,
    label: str,
    text: str,
    hparams: dict,
    advantage: ch.AdvantageTransform | None = None,
    on_policy: bool = False,
    pods_num_keep: int | None = None,
    rollout_correction: rc.RolloutCorrection | Mapping | None = None,
    weighted_loss: Callable[[rc.PolicyLoss], rc.WeightedLoss] | None = None,
) -> Recipe:
    """A recipe of the loss family; ``rollout_correction`` checked and put on the objective,
    applied through ``weighted_loss(loss)`` when given, else on the advantage."""
    correction = rc.rollout_correction(name, rollout_correction)
    return rc.make_recipe(
        name,
        numerics=n,
        advantage=advantage if advantage is not None else _grpo_advantage(n),
        objective=rc.objective(
            loss,
            agg=agg,
            ratio_metrics=functools.partial(pl.ratio_metrics, **ratio_kwargs),
            kl=rc.kl_term(beta, kl_estimator, n),
            entropy_coef=entropy_coef,
            on_policy=on_policy,
            label=label,
            text=text,
            rollout_correction=correction,
            weighted_loss=weighted_loss(loss) if weighted_loss is not None else None,
        ),
        selection=Selection(pods_num_keep=pods_num_keep),
        hparams=dict(
            beta=beta,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
            **hparams,
            rollout_correction=correction,
        ),
    )


def cispo(
    *,
    beta: float = 0.0,
    clip_low: float = 10.0,
    clip_high: float = 0.2,
    kl_estimator: str = "k3",
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    pods_num_keep: int | None = None,
    rollout_correction: rc.RolloutCorrection | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """CISPO (MiniMax-M1, arXiv:2506.13585): GRPO's advantage; REINFORCE weighted by the
    clipped, stop-gradient ratio ``−sg(clip(ρ, 1−ε_low, 1+ε_high))·A·log π`` (no token loses
    its gradient); token mean over the batch. Defaults are verl's example (``ε_low = 10``, i.e.
    no lower bound, ``ε_high = 0.2``) with verl's log-ratio clamp κ = 20.

    ``rollout_correction`` (:class:`~jaxrl_llm.recipe.RolloutCorrection`): ``A_t ← w_t·A_t``,
    i.e. ``−w·sg(clip(ρ))·A·log π`` — the decoupled form when π_old is recomputed (the ratio
    against π_prox, w = f(π_prox/μ)), the bypass one otherwise (ratio 1, w = f(sg(π_θ)/μ));
    verl's ``compute_policy_loss_cispo`` (``pg_losses * rollout_is_weights``).
    """
    n = nm.resolve(numerics)
    kw = dict(clip_low=float(clip_low), clip_high=float(clip_high), log_ratio_clamp=20.0)
    return _loss_recipe(
        "cispo",
        n,
        functools.partial(pl.cispo_loss, **kw),
        agg=rc.agg_mode("token-mean", loss_agg_mode, n),
        ratio_kwargs=kw,
        beta=beta,
        kl_estimator=kl_estimator,
        entropy_coef=entropy_coef,
        label="CISPO clipped IS weight",
        text=(
            f"−sg(clip(ρ, 1−{clip_low:g}, 1+{clip_high:g}))·A·log π (REINFORCE with a clipped, "
            "stop-gradient importance weight)"
        ),
        hparams=dict(clip_low=clip_low, clip_high=clip_high, pods_num_keep=pods_num_keep),
        pods_num_keep=pods_num_keep,
        rollout_correction=rollout_correction,
    )


def gpg(
    *,
    f_norm: float = 1.0,
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    rollout_correction: rc.RolloutCorrection | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline",
    arXiv:2504.02546): ``A_i = α·(r_i − mean_group r)/F`` with ``α = N / #(nonzero rewards)``;
    the plain policy gradient ``−A·log π`` (no ratio, no clip, no KL, no reference), token
    mean; one update per batch. verl ``adv_estimator=gpg`` + ``loss_mode=gpg``.

    ``rollout_correction`` (:class:`~jaxrl_llm.recipe.RolloutCorrection`): no ratio and no π_old
    pass, so verl's bypass ``reinforce`` loss ``−w·A·log π``, ``w = f(sg(π_θ)/μ)``
    (``compute_policy_loss_reinforce``; ``A ← w·A``).
    """
    n = nm.resolve(numerics)
    correction = rc.rollout_correction("gpg", rollout_correction)
    return rc.make_recipe(
        "gpg",
        numerics=n,
        advantage=rc.outcome_advantage(
            n, (ch.group_mean_baseline(singleton_baseline=0.0), ch.gpg_scale(f_norm=f_norm))
        ),
        objective=rc.reinforce_objective(
            agg=rc.agg_mode("token-mean", loss_agg_mode, n),
            entropy_coef=entropy_coef,
            text="−A·log π (GPG: vanilla policy gradient, no ratio, no clip)",
            rollout_correction=correction,
        ),
        hparams=dict(f_norm=f_norm, entropy_coef=entropy_coef, rollout_correction=correction),
    )


def sapo(
    *,
    beta: float = 0.0,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    pods_num_keep: int | None = None,
    rollout_correction: rc.RolloutCorrection | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """SAPO ("Soft Adaptive Policy Optimization", 2025, arXiv:2511.20347): GRPO's
    advantage; the soft gate ``−σ(τ(ρ−1))·4/τ·A`` instead of the hard clip (τ_pos for A > 0,
    τ_neg otherwise); ``seq-mean-token-mean`` (forced, as in verl).

    ``rollout_correction`` (:class:`~jaxrl_llm.recipe.RolloutCorrection`): ``A_t ← w_t·A_t`` (τ
    follows sign(A), unchanged for w > 0, so it is ``w·ℓ_t``) — the decoupled form when π_old is
    recomputed (the ratio against π_prox, w = f(π_prox/μ)), the bypass one otherwise (ratio 1, w
    = f(sg(π_θ)/μ)); verl's ``compute_policy_loss_sapo``, TRL's ``per_token_loss *
    importance_sampling_ratio``.
    """
    n = nm.resolve(numerics)
    kw = dict(tau_pos=float(tau_pos), tau_neg=float(tau_neg), log_ratio_clamp=20.0)
    return _loss_recipe(
        "sapo",
        n,
        functools.partial(pl.sapo_loss, **kw),
        agg="seq-mean-token-mean",
        ratio_kwargs={},
        beta=beta,
        kl_estimator=kl_estimator,
        entropy_coef=entropy_coef,
        label="SAPO soft gate",
        text=(
            f"soft-gated surrogate −σ(τ(ρ−1))·(4/τ)·A, τ = {tau_pos:g} for A > 0 and "
            f"{tau_neg:g} otherwise"
        ),
        hparams=dict(tau_pos=tau_pos, tau_neg=tau_neg, pods_num_keep=pods_num_keep),
        pods_num_keep=pods_num_keep,
        rollout_correction=rollout_correction,
    )


def gmpo(
    *,
    beta: float = 0.0,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    pods_num_keep: int | None = None,
    rollout_correction: rc.RolloutCorrection | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673; verl
    ``loss_mode=geo_mean``): GRPO's advantage; one surrogate per sequence ``−Ā_i·ρ_i`` with
    ``ρ_i`` the geometric mean of the token ratios clipped in log space to ``[−ε_low, ε_high]``
    (paper: 0.4); mean over sequences (``seq-mean-token-mean``, forced).

    ``rollout_correction`` (:class:`~jaxrl_llm.recipe.RolloutCorrection`): the sequence loss
    times the geometric mean of the sequence's token weights, ``W_i·L_i`` (verl's
    ``compute_policy_loss_geo_mean``; a zero weight drops the sequence:
    :func:`~jaxrl_llm.recipe.geometric_weight_times_loss`); the sign and mean of A are those of
    the uncorrected advantage.
    """
    n = nm.resolve(numerics)
    kw = dict(clip_low=float(clip_low), clip_high=float(clip_high))
    return _loss_recipe(
        "gmpo",
        n,
        functools.partial(pl.gmpo_loss, **kw),
        agg="seq-mean-token-mean",
        ratio_kwargs={},
        beta=beta,
        kl_estimator=kl_estimator,
        entropy_coef=entropy_coef,
        label="GMPO geometric mean",
        text=(
            f"−Ā·exp(mean_t clip(log ρ_t, −{clip_low:g}, {clip_high:g})) per sequence "
            "(geometric mean of the token ratios, clipped in log space)"
        ),
        hparams=dict(clip_low=clip_low, clip_high=clip_high, pods_num_keep=pods_num_keep),
        pods_num_keep=pods_num_keep,
        rollout_correction=rollout_correction,
        weighted_loss=rc.geometric_weight_times_loss,
    )


_COV_NOTE = (
    "; the chosen tokens depend on the micro-batch's statistics (not micro-batch- or "
    "packing-invariant)"
)


def clip_cov(
    *,
    beta: float = 0.0,
    clip_eps: float = 0.2,
    clip_low: float | None = None,
    clip_high: float | None = None,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    kl_estimator: str = "k3",
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    rollout_correction: rc.RolloutCorrection | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
    Reasoning Language Models", arXiv:2505.22617; verl ``loss_mode=clip_cov``): GRPO's
    advantage; PPO clip, plus the gradient of ``max(⌊ratio·N⌋, 1)`` tokens whose centred
    covariance ``(A − Ā)(log π − mean log π)`` lies in ``(lb, ub)`` set to zero (entropy-collapse
    control); token mean. The tokens are the highest-covariance candidates (deterministic; verl
    draws them at random). Batch statistics are per micro-batch: the loss is not micro-batch-
    or packing-invariant.

    ``rollout_correction`` (:class:`~jaxrl_llm.recipe.RolloutCorrection`): ``ℓ_t ← w_t·ℓ_t``
    with the tokens chosen from the uncorrected A (verl's ``compute_policy_loss_clip_cov``:
    ``pg_losses * rollout_is_weights``).
    """
    n = nm.resolve(numerics)
    low, high = rc.clip_range(clip_eps, clip_low, clip_high)
    kw = dict(
        clip_low=low,
        clip_high=high,
        clip_cov_ratio=float(clip_cov_ratio),
        clip_cov_lb=float(clip_cov_lb),
        clip_cov_ub=float(clip_cov_ub),
    )
    return _loss_recipe(
        "clip_cov",
        n,
        functools.partial(pl.clip_cov_loss, **kw),
        agg=rc.agg_mode("token-mean", loss_agg_mode, n),
        ratio_kwargs=dict(clip_low=low, clip_high=high),
        beta=beta,
        kl_estimator=kl_estimator,
        entropy_coef=entropy_coef,
        label="Clip-Cov",
        text=(
            f"clipped surrogate −min(ρA, clip(ρ, 1−{low:g}, 1+{high:g})A) with the gradient of "
            f"the top {clip_cov_ratio:g} of tokens by covariance (in ({clip_cov_lb:g}, "
            f"{clip_cov_ub:g})) removed" + _COV_NOTE
        ),
        hparams=dict(
            clip_low=low,
            clip_high=high,
            clip_cov_ratio=clip_cov_ratio,
            clip_cov_lb=clip_cov_lb,
            clip_cov_ub=clip_cov_ub,
        ),
        rollout_correction=rollout_correction,
        weighted_loss=rc.weights_times_loss,
    )


def kl_cov(
    *,
    beta: float = 0.0,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 1.0,
    kl_estimator: str = "k3",
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    rollout_correction: rc.RolloutCorrection | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617; verl ``loss_mode=kl_cov``): GRPO's advantage;
    the unclipped surrogate ``−A·ρ`` plus ``k·|log ρ|`` on the ``max(⌊ratio·N⌋, 1)`` tokens of
    largest covariance ``(A − Ā)(log π − mean log π)``; token mean. Batch statistics are per
    micro-batch: the loss is not micro-batch- or packing-invariant.

    ``rollout_correction`` (:class:`~jaxrl_llm.recipe.RolloutCorrection`): ``ℓ_t ← w_t·ℓ_t``,
    the |log ρ| penalty included, the tokens chosen from the uncorrected A (verl's
    ``compute_policy_loss_kl_cov``: ``pg_losses * rollout_is_weights``).
    """
    n = nm.resolve(numerics)
    kw = dict(kl_cov_ratio=float(kl_cov_ratio), ppo_kl_coef=float(ppo_kl_coef))
    return _loss_recipe(
        "kl_cov",
        n,
        functools.partial(pl.kl_cov_loss, **kw),
        agg=rc.agg_mode("token-mean", loss_agg_mode, n),
        ratio_kwargs={},
        beta=beta,
        kl_estimator=kl_estimator,
        entropy_coef=entropy_coef,
        label="KL-Cov",
        text=(
            f"unclipped surrogate −ρA plus {ppo_kl_coef:g}·|log ρ| on the top {kl_cov_ratio:g} "
            "of tokens by covariance" + _COV_NOTE
        ),
        hparams=dict(kl_cov_ratio=kl_cov_ratio, ppo_kl_coef=ppo_kl_coef),
        rollout_correction=rollout_correction,
        weighted_loss=rc.weights_times_loss,
    )


_DPPO_DEFAULT_DELTA = {"tv": 0.15, "kl": 0.05}


def dppo(
    *,
    divergence: str = "tv",
    clip_low: float | None = None,
    clip_high: float | None = None,
    ratio_cap: float = 10.0,
    scale_by_std: bool = True,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    pods_num_keep: int | None = None,
    rollout_correction: rc.RolloutCorrection | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """DPPO (Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning",
    arXiv:2602.04879): GRPO's advantage; ``−A·sg(min(ρ, c))·M·log π`` where the mask M drops a
    token whose sampled-token divergence left the trust region in the direction its advantage
    pushes: ``divergence="tv"`` (``p − q`` beyond ``δ_high`` / ``−δ_low``, DPPO-Binary-TV) or
    ``"kl"`` (the binary KL of the token beyond ``δ``, DPPO-Binary-KL); token mean. Default δ:
    0.15 (TV), 0.05 (KL) on both sides, as in verl's ``examples/dppo_trainer/run_qwen30b_dppo.sh``
    (which also runs Dr. GRPO's advantage and aggregation: ``scale_by_std=False``,
    ``loss_agg_mode="seq-mean-token-sum-norm"``, and disables the cap with c = 10000).

    ``rollout_correction`` (:class:`~jaxrl_llm.recipe.RolloutCorrection`): ``A_t ← w_t·A_t``,
    i.e. ``−w·A·sg(min(ρ, c))·M·log π`` — the decoupled form when π_old is recomputed (the ratio
    against π_prox, w = f(π_prox/μ)), the bypass one otherwise (ratio 1, w = f(sg(π_θ)/μ));
    Stable-RL's own DPPO puts μ in one capped ratio π_θ/μ instead; here the weight is split as
    f(π_prox/μ)·min(π_θ/π_prox, c), our choice.
    """
    n = nm.resolve(numerics)
    if divergence not in _DPPO_DEFAULT_DELTA:
        raise ValueError(f"dppo: divergence={divergence!r}; expected 'tv' or 'kl'")
    low = _DPPO_DEFAULT_DELTA[divergence] if clip_low is None else float(clip_low)
    high = _DPPO_DEFAULT_DELTA[divergence] if clip_high is None else float(clip_high)
    kw = dict(divergence=divergence, clip_low=low, clip_high=high, ratio_cap=float(ratio_cap))
    d = "p − q" if divergence == "tv" else "binary KL(q ‖ p)"
    return _loss_recipe(
        "dppo",
        n,
        functools.partial(pl.dppo_loss, **kw),
        agg=rc.agg_mode("token-mean", loss_agg_mode, n),
        ratio_kwargs={},
        beta=beta,
        kl_estimator=kl_estimator,
        entropy_coef=entropy_coef,
        label=f"DPPO-Binary-{divergence.upper()}",
        text=(
            f"−A·sg(min(ρ, {ratio_cap:g}))·log π, tokens masked when {d} of the sampled token "
            f"leaves [−{low:g}, {high:g}] in the advantage's direction"
        ),
        hparams=dict(
            divergence=divergence,
            clip_low=low,
            clip_high=high,
            ratio_cap=ratio_cap,
            scale_by_std=scale_by_std,
            pods_num_keep=pods_num_keep,
        ),
        advantage=_grpo_advantage(n, scale_by_std),
        pods_num_keep=pods_num_keep,
        rollout_correction=rollout_correction,
    )


def dro(
    *,
    dro_beta: float = 0.05,
    scale_by_std: bool = False,
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    pods_num_keep: int | None = None,
    rollout_correction: rc.RolloutCorrection | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """DRO, Direct Reward Optimisation (Richemond et al. 2024, arXiv:2405.19107; per token as in
    Kimi k1.5, arXiv:2501.12599, and Tinker's ``loss_fn="dro"``): the group-mean advantage
    (÷ std with ``scale_by_std``); ``−A·log π + ½β(log π − log π_old)²`` per token — no ratio,
    no clip; the squared log-ratio keeps the policy near the sampler; token mean. ``dro_beta``
    is that β (``beta`` is the KL-to-reference coefficient elsewhere, not used here).

    ``rollout_correction`` (:class:`~jaxrl_llm.recipe.RolloutCorrection`): ``ℓ_t ← w_t·ℓ_t``,
    the squared log-ratio included (the whole per-token loss importance-weighted from μ; in
    bypass the penalty is 0 with its gradient). No peer has DRO with a rollout correction: our
    choice.
    """
    n = nm.resolve(numerics)
    return _loss_recipe(
        "dro",
        n,
        functools.partial(pl.dro_loss, beta=float(dro_beta)),
        agg=rc.agg_mode("token-mean", loss_agg_mode, n),
        ratio_kwargs={},
        beta=0.0,
        kl_estimator="k3",
        entropy_coef=entropy_coef,
        label="DRO squared log-ratio",
        text=f"−A·log π + ½·{dro_beta:g}·(log π − log π_old)² (policy gradient, quadratic "
        "penalty to the sampler)",
        hparams=dict(dro_beta=dro_beta, scale_by_std=scale_by_std, pods_num_keep=pods_num_keep),
        advantage=_grpo_advantage(n, scale_by_std),
        pods_num_keep=pods_num_keep,
        rollout_correction=rollout_correction,
        weighted_loss=rc.weights_times_loss,
    )


def luspo(
    *,
    beta: float = 0.0,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    pods_num_keep: int | None = None,
    rollout_correction: rc.RolloutCorrection | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """LUSPO ("Length-Unbiased Sequence Policy Optimization", arXiv:2602.05261; TRL
    ``loss_type="luspo"``): GSPO's clipped sequence ratio, each sequence's loss scaled by its
    length — token sums averaged over sequences (``seq-mean-token-sum``) instead of GSPO's
    per-sequence mean; no log-ratio clamp (TRL's).

    ``rollout_correction`` (:class:`~jaxrl_llm.recipe.RolloutCorrection`): ``A_t ← w_t·A_t`` on
    the GSPO-token loss (as :func:`gspo`) — the decoupled form when π_old is recomputed (the
    ratio against π_prox, w = f(π_prox/μ)), the bypass one otherwise (ratio 1, w =
    f(sg(π_θ)/μ)); TRL's ``per_token_loss * importance_sampling_ratio`` for
    ``loss_type='luspo'``.
    """
    n = nm.resolve(numerics)
    kw = dict(clip_low=float(clip_low), clip_high=float(clip_high), log_ratio_clamp=None)
    return _loss_recipe(
        "luspo",
        n,
        functools.partial(pl.gspo_loss, **kw),
        agg="seq-mean-token-sum",
        ratio_kwargs=dict(clip_low=kw["clip_low"], clip_high=kw["clip_high"]),
        beta=beta,
        kl_estimator=kl_estimator,
        entropy_coef=entropy_coef,
        label="LUSPO length-scaled sequence ratio",
        text=(
            f"|y|·(−min(sA, clip(s, 1−{clip_low:g}, 1+{clip_high:g})A)) per sequence, "
            "s = exp(mean_t log ρ_t)"
        ),
        hparams=dict(clip_low=clip_low, clip_high=clip_high, pods_num_keep=pods_num_keep),
        pods_num_keep=pods_num_keep,
        rollout_correction=rollout_correction,
    )


def _vespo_weighted(loss: rc.PolicyLoss) -> rc.WeightedLoss:
    """VESPO's loss with the correction's token weights inside φ (``is_weight_bgt``)."""

    def weighted(
        logp_bgt: jnp.ndarray,
        logp_old_bgt: jnp.ndarray,
        adv_bgt: jnp.ndarray,
        mask_bgt: jnp.ndarray,
        w_bgt: jnp.ndarray,
    ) -> jnp.ndarray:
        return loss(logp_bgt, logp_old_bgt, adv_bgt, mask_bgt, is_weight_bgt=w_bgt)

    return weighted


def vespo(
    *,
    beta: float = 0.0,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    pods_num_keep: int | None = None,
    rollout_correction: rc.RolloutCorrection | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """VESPO ("Variational Sequence-Level Soft Policy Optimization", arXiv:2602.10693; TRL
    ``loss_type="vespo"``): GRPO's advantage; ``−sg(φ(w))·A·log π`` with the Gamma weight
    ``φ(w) = e^λ·w^k·e^(−λw)`` of the sequence ratio ``w = exp(Σ_t log ρ_t)`` ((k, λ) by the
    advantage's sign); token mean over the batch (TRL's normaliser).

    ``rollout_correction`` (:class:`~jaxrl_llm.recipe.RolloutCorrection`, ``level: token``
    only): the token weights enter φ's ratio, ``log w_i += Σ_t clamp(log v_t, log 1e-8, 20)``,
    instead of multiplying the loss (TRL ``get_gamma_weights`` with
    ``importance_sampling_ratio``; TRL likewise refuses sequence-level modes for VESPO).
    """
    n = nm.resolve(numerics)
    correction = rc.rollout_correction("vespo", rollout_correction)
    if correction is not None and correction.level != "token":
        raise ValueError(
            f"vespo: rollout_correction.level must be 'token', got {correction.level!r}: VESPO "
            "folds the token weights into the sequence ratio w of its weight φ(w) (log w += "
            "Σ_t log v_t), so a sequence-level weight would count |y| times; TRL refuses it too"
        )
    kw = dict(
        k_pos=float(k_pos),
        lambda_pos=float(lambda_pos),
        k_neg=float(k_neg),
        lambda_neg=float(lambda_neg),
    )
    return _loss_recipe(
        "vespo",
        n,
        functools.partial(pl.vespo_loss, **kw),
        agg="token-mean",
        ratio_kwargs={},
        beta=beta,
        kl_estimator=kl_estimator,
        entropy_coef=entropy_coef,
        label="VESPO Gamma weight",
        text=(
            "−sg(φ(w))·A·log π, φ(w) = e^λ·w^k·e^(−λw) of the sequence ratio w "
            f"(k, λ = {k_pos:g}, {lambda_pos:g} for A ≥ 0; {k_neg:g}, {lambda_neg:g} otherwise)"
        ),
        hparams=dict(**kw, pods_num_keep=pods_num_keep),
        pods_num_keep=pods_num_keep,
        rollout_correction=rollout_correction,
        weighted_loss=_vespo_weighted,
    )


def opo(
    *,
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    rollout_correction: rc.RolloutCorrection | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """OPO (Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv:2505.23585;
    verl ``adv_estimator=opo``): exactly on-policy REINFORCE with the length-weighted group
    baseline ``b = Σ_j |y_j|·r_j / Σ_j |y_j|`` (0 for a group of one), no std, no KL; token
    mean; one update per batch.

    ``rollout_correction`` (:class:`~jaxrl_llm.recipe.RolloutCorrection`): no ratio and no π_old
    pass, so verl's bypass ``reinforce`` loss ``−w·A·log π``, ``w = f(sg(π_θ)/μ)``
    (``compute_policy_loss_reinforce``; ``A ← w·A``).
    """
    n = nm.resolve(numerics)
    correction = rc.rollout_correction("opo", rollout_correction)
    return rc.make_recipe(
        "opo",
        numerics=n,
        advantage=rc.outcome_advantage(n, (ch.length_weighted_baseline(singleton_baseline=0.0),)),
        objective=rc.reinforce_objective(
            agg=rc.agg_mode("token-mean", loss_agg_mode, n),
            entropy_coef=entropy_coef,
            text="−A·log π, exactly on-policy (no ratio, no clip)",
            rollout_correction=correction,
        ),
        hparams=dict(entropy_coef=entropy_coef, rollout_correction=correction),
    )


def remax(
    *,
    beta: float = 0.0,
    kl_estimator: str = "k1",
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    rollout_correction: rc.RolloutCorrection | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """ReMax (Li et al. 2023, arXiv:2310.10505; verl ``adv_estimator=remax``): REINFORCE with
    the reward of the prompt's *greedy* completion as baseline, ``A_t = G_t − r(x, ŷ_greedy)``
    (G_t the reward-to-go; KL in the reward with ``beta > 0``); token mean; one update per batch.
    Needs ``Rollout.baseline_b`` (``GIVEN_BASELINE``): one greedy rollout per prompt, scored
    with the same reward — the trainer does not generate it yet (see ``train.collect``).

    ``rollout_correction`` (:class:`~jaxrl_llm.recipe.RolloutCorrection`): no ratio and no π_old
    pass, so verl's bypass ``reinforce`` loss ``−w·A·log π``, ``w = f(sg(π_θ)/μ)``
    (``compute_policy_loss_reinforce``; ``A ← w·A``).
    """
    n = nm.resolve(numerics)
    correction = rc.rollout_correction("remax", rollout_correction)
    return rc.make_recipe(
        "remax",
        numerics=n,
        advantage=ch.chain(
            *rc.reward_stages(n),
            *rc.kl_reward_stages(beta, kl_estimator, n, None),
            ch.discounted_return(1.0),
            ch.given_baseline(),
        ),
        objective=rc.reinforce_objective(
            agg=rc.agg_mode("token-mean", loss_agg_mode, n),
            entropy_coef=entropy_coef,
            text="−A·log π with the greedy completion's reward as baseline (no ratio, no clip)",
            rollout_correction=correction,
        ),
        hparams=dict(
            beta=beta,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
            rollout_correction=correction,
        ),
    )


def _reference_losses(
    beta: float,
    label_smoothing: float,
    discopop_tau: float,
    ipo_length_normalize: bool = True,
    sigmoid_label_smoothing: bool = True,
) -> dict[str, Callable]:
    """``loss_type -> PairLogprobs -> f32[P]`` for the losses against a reference.

    ``ipo_length_normalize=False`` gives IPO lengths of 1: OpenRLHF's raw token-summed margin
    (``DPOLoss(ipo=True)``, ``openrlhf/models/loss.py``) instead of TRL's length average.
    ``sigmoid_label_smoothing=False`` is TRL 1.16's sigmoid, which ignores ``label_smoothing``
    (``DPOTrainer._compute_loss``: ``-logsigmoid(β·Δ)``)."""

    def with_ref(fn: Callable, *, lengths: bool = False, **kw) -> Callable:
        def loss(pairs: rc.PairLogprobs):
            if pairs.ref_chosen_p is None or pairs.ref_rejected_p is None:
                raise ValueError("dpo: reference log-probs are required (ref_chosen_p)")
            args = (pairs.logp_chosen_p, pairs.logp_rejected_p, pairs.ref_chosen_p)
            args += (pairs.ref_rejected_p,)
            if lengths == "raw":
                one_p = jnp.ones_like(pairs.logp_chosen_p)
                args += (one_p, one_p)
            elif lengths:
                args += (pairs.len_chosen_p, pairs.len_rejected_p)
            return fn(*args, beta=beta, **kw)

        return loss

    smoothed = dict(label_smoothing=label_smoothing)
    sigmoid_smoothing = dict(label_smoothing=label_smoothing if sigmoid_label_smoothing else 0.0)
    return {
        "sigmoid": with_ref(pref.dpo_sigmoid_loss, **sigmoid_smoothing),
        "ipo": with_ref(pref.ipo_loss, lengths=True if ipo_length_normalize else "raw"),
        "hinge": with_ref(pref.hinge_loss),
        "robust": with_ref(pref.robust_dpo_loss, **smoothed),
        "exo_pair": with_ref(pref.exo_pair_loss, label_smoothing=label_smoothing or 1e-3),
        "nca_pair": with_ref(pref.nca_pair_loss),
        "bco_pair": with_ref(pref.bco_pair_loss),
        "sppo_hard": with_ref(pref.sppo_hard_loss),
        "aot": with_ref(pref.aot_loss, paired=True, **smoothed),
        "aot_unpaired": with_ref(pref.aot_loss, paired=False, **smoothed),
        "apo_zero": with_ref(pref.apo_loss, anchor="zero"),
        "apo_down": with_ref(pref.apo_loss, anchor="down"),
        "discopop": with_ref(pref.discopop_loss, tau=discopop_tau),
    }


_PREFERENCE_TEXT = {
    "sigmoid": "−log σ(βΔ) on the policy-vs-reference log-ratio margin Δ",
    "ipo": "(Δ̄ − 1/(2β))², Δ̄ the length-averaged margin",
    "hinge": "max(0, 1 − βΔ)",
    "robust": "noise-robust −[(1−ε)log σ(βΔ) − ε log σ(−βΔ)]/(1−2ε)",
    "simpo": "−log σ(β(logπ(y_w)/|y_w| − logπ(y_l)/|y_l|) − γ), reference-free",
    "exo_pair": "KL(σ(βΔ) ‖ 1−ε), the reverse KL to the labels (EXO)",
    "nca_pair": "−log σ(βρ_w) − ½log σ(−βρ_w) − ½log σ(−βρ_l) (NCA)",
    "bco_pair": "−log σ(βρ_w) − log σ(−βρ_l), a chosen-vs-rejected classifier (BCO)",
    "sppo_hard": "(ρ_w − 1/(2β))² + (ρ_l + 1/(2β))² (SPPO, hard probabilities)",
    "aot": "−log σ(β(sort(m) − sort(m_ref))) over the batch's sorted margins (AOT)",
    "aot_unpaired": "−log σ(β(sort(ρ_w) − sort(ρ_l))) over the batch (AOT, unpaired)",
    "apo_zero": "(1 − σ(βρ_w)) + σ(βρ_l): raise chosen, lower rejected (APO-zero)",
    "apo_down": "σ(βρ_w) + 1 − σ(βΔ): lower both, rejected more (APO-down)",
    "discopop": "(1−σ(βΔ/τ))·(−log σ(βΔ)) + σ(βΔ/τ)·exp(−βΔ) (DiscoPOP)",
}
# Former names of a loss type (TRL renamed "aot_pair" to "aot_unpaired").
_PREFERENCE_ALIASES = {"aot_pair": "aot_unpaired"}


def _wpo_weighted(loss: Callable) -> Callable:
    """``loss`` with each pair's value times WPO's ``w(y_w)·w(y_l)`` (a constant)."""

    def weighted(pairs: rc.PairLogprobs):
        if pairs.weight_chosen_p is None or pairs.weight_rejected_p is None:
            raise ValueError("dpo: use_weighting needs weight_chosen_p and weight_rejected_p")
        return loss(pairs) * pref.wpo_pair_weights(pairs.weight_chosen_p, pairs.weight_rejected_p)

    return weighted


def dpo(
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    discopop_tau: float = 0.05,
    use_weighting: bool = False,
    numerics: nm.Numerics | str | None = None,
) -> PreferenceRecipe:
    """DPO (Rafailov et al. 2023, arXiv:2305.18290) and its family, offline on preference pairs:
    ``−log σ(β[(log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l))])``.

    ``loss_type`` (TRL's names; formulas and papers in :mod:`jaxrl_llm.core.preference`):
    ``"sigmoid"`` (DPO; cDPO with ``label_smoothing``), ``"ipo"`` (Azar et al.,
    length-averaged as TRL; the raw summed margin under ``numerics="openrlhf"``), ``"hinge"``
    (SLiC), ``"robust"`` (rDPO), ``"simpo"`` (reference-free,
    length-normalised, margin ``simpo_gamma``), ``"exo_pair"`` (EXO; ``label_smoothing`` is its
    ε, 1e-3 when 0), ``"nca_pair"``, ``"bco_pair"``, ``"sppo_hard"``, ``"aot"`` /
    ``"aot_unpaired"`` (formerly ``"aot_pair"``; batch-sorted, so the loss depends on the
    micro-batch), ``"apo_zero"`` / ``"apo_down"``, ``"discopop"`` (gate temperature
    ``discopop_tau``). ``use_weighting`` multiplies each pair's loss by WPO's weights (Zhou et
    al. 2024), which the trainer computes from the policy's logits. DPO is the seeds' side
    branch: no reward model, no rollouts, no advantage; :func:`jaxrl_llm.compute_advantages`
    does not apply to it.
    """
    # the preset changes IPO's margin (ipo_length_normalize) and whether the sigmoid applies
    # label_smoothing (dpo_sigmoid_label_smoothing: not in TRL 1.16)
    n = nm.resolve(numerics)
    loss_type = _PREFERENCE_ALIASES.get(loss_type, loss_type)
    if loss_type not in _PREFERENCE_TEXT:
        raise ValueError(f"dpo: loss_type={loss_type!r}; expected one of {tuple(_PREFERENCE_TEXT)}")
    if beta <= 0:
        raise ValueError(f"dpo: `beta` must be > 0, got {beta!r}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo: `label_smoothing` must be in [0, 0.5), got {label_smoothing!r}")
    if not discopop_tau > 0:
        raise ValueError(f"dpo: `discopop_tau` must be > 0, got {discopop_tau!r}")
    if loss_type == "simpo":

        def loss(pairs: rc.PairLogprobs):
            return pref.simpo_loss(
                pairs.logp_chosen_p,
                pairs.logp_rejected_p,
                pairs.len_chosen_p,
                pairs.len_rejected_p,
                beta=beta,
                gamma=simpo_gamma,
            )

        requires = {rc.PREFERENCE_PAIRS}
    else:
        losses = _reference_losses(
            beta,
            label_smoothing,
            discopop_tau,
            n.ipo_length_normalize,
            n.dpo_sigmoid_label_smoothing,
        )
        loss = losses[loss_type]
        requires = {rc.PREFERENCE_PAIRS, rc.REFERENCE_LOGPROBS}
    label, text = f"DPO {loss_type}", _PREFERENCE_TEXT[loss_type]
    if loss_type == "ipo" and not n.ipo_length_normalize:
        text = "(Δ − 1/(2β))² on the raw token-summed margin Δ (OpenRLHF)"
    if use_weighting:
        loss = _wpo_weighted(loss)
        requires.add(rc.SEQUENCE_WEIGHTS)
        label, text = label + " + WPO", text + ", weighted by WPO's w(y_w)·w(y_l)"
    return PreferenceRecipe(
        name="dpo",
        loss=loss,
        beta=float(beta),
        requires=frozenset(requires),
        label=label,
        text=text,
        hparams=types.MappingProxyType(
            dict(
                beta=beta,
                loss_type=loss_type,
                label_smoothing=label_smoothing,
                discopop_tau=discopop_tau,
                use_weighting=use_weighting,
            )
        ),
    )


RECIPES: dict[str, Callable[..., rc.AnyRecipe]] = {
    "reinforce": reinforce,
    "ppo": ppo,
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "dapo": dapo,
    "gspo": gspo,
    "cispo": cispo,
    "gpg": gpg,
    "sapo": sapo,
    "gmpo": gmpo,
    "clip_cov": clip_cov,
    "kl_cov": kl_cov,
    "dppo": dppo,
    "dro": dro,
    "luspo": luspo,
    "vespo": vespo,
    "opo": opo,
    "remax": remax,
    "dpo": dpo,
}

ONLINE_RECIPES = tuple(name for name, fn in RECIPES.items() if isinstance(fn(), Recipe))


def get(name: str, **hparams) -> rc.AnyRecipe:
    """Builds the recipe called ``name`` (the CLI and config layer's lookup)."""
    if name not in RECIPES:
        raise ValueError(f"unknown algorithm {name!r}; available: {', '.join(RECIPES)}")
    return RECIPES[name](**hparams)


__all__ = [
    "ONLINE_RECIPES",
    "RECIPES",
    "PreferenceRecipe",
    "Recipe",
    "Selection",
    "cispo",
    "clip_cov",
    "dapo",
    "dpo",
    "dppo",
    "dr_grpo",
    "dro",
    "get",
    "gmpo",
    "gpg",
    "grpo",
    "gspo",
    "kl_cov",
    "luspo",
    "opo",
    "ppo",
    "reinforce",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "rloo",
    "sapo",
    "vespo",
]
