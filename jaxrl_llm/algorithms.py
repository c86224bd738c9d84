"""Named algorithms as recipes: compositions of the chain, a policy loss and an aggregation.

A :class:`~jaxrl_llm.recipe.Recipe` is data, not a class to subclass: the advantage chain, a
per-token policy loss, a loss aggregation that returns ``(sum, denominator)``, where the KL goes,
and which samples are selected (see :mod:`jaxrl_llm.recipe`). Each function below builds one,
documented like the paper it comes from; variants are keyword arguments (or
``functools.partial``), never subclasses. Hyperparameters are named as in the literature: ``beta``
(KL coefficient), ``gamma``, ``lam``, ``clip_eps`` or ``clip_low``/``clip_high``,
``kl_estimator``; ``numerics`` picks this project's conventions or a peer's preset
(``"verl"``, ``"trl"``, ``"openrlhf"``; see :mod:`jaxrl_llm.numerics`).

Where the KL goes follows the seed documents: ``ppo``, ``reinforce``, ``rloo`` and
``reinforce_pp`` shape the token rewards with the KL between the rollout policy and the
reference (k1 by default), so it flows into returns and advantages; ``grpo``, ``dr_grpo``,
``reinforce_pp_baseline``, ``dapo`` and ``gspo`` add it as a separate per-token loss term on the
current policy (k3 by default).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

from jaxrl_llm import chain as ch
from jaxrl_llm import numerics as nm
from jaxrl_llm.core import aggregation as agg
from jaxrl_llm.core import kl as _kl
from jaxrl_llm.core import policy_losses as pl
from jaxrl_llm.objective import preference_loss
from jaxrl_llm.recipe import (
    Recipe,
    Selection,
    clip_range,
    group_norm_stages,
    kl_reward_stages,
    make_recipe,
    ppo_loss,
    reinforce_policy_loss,
    resolve_agg_mode,
    reward_stages,
    whiten_stage,
)

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
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """REINFORCE (Williams 1992, "Simple statistical gradient-following algorithms"):
    ``∇J = E[Σ_t G_t ∇log π(y_t | ·)]`` with ``G_t = Σ_{k≥t} γ^{k−t}(r_k − β·KL_k)``.

    Chain: KL in reward → reward-to-go. No baseline, no normalisation; loss ``−G_t·log π``
    summed over tokens and averaged over sequences (``seq-mean-token-sum``).
    """
    n = nm.resolve(numerics)
    advantage = ch.chain(
        *reward_stages(n),
        *kl_reward_stages(beta, kl_estimator, n, kl_controller),
        ch.discounted_return(gamma),
    )
    return make_recipe(
        "reinforce",
        advantage=advantage,
        policy_loss=reinforce_policy_loss,
        agg_mode=resolve_agg_mode("seq-mean-token-sum", loss_agg_mode, n),
        beta=beta,
        kl_estimator=kl_estimator,
        kl_in_reward=True,
        numerics=n,
        entropy_coef=entropy_coef,
        hparams=dict(beta=beta, gamma=gamma, kl_estimator=kl_estimator),
        loss_name="REINFORCE −A·log π",
        objective="−A·log π (vanilla policy gradient, no ratio, no clip)",
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
    value_clip: float | None = 0.2,
    kl_estimator: str = "k1",
    kl_controller: _kl.KLController | None = None,
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    axis_name: str | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """PPO for RLHF (Schulman et al. 2017, arXiv:1707.06347; Ouyang et al. 2022,
    arXiv:2203.02155): per-token rewards ``r_t − β·KL_t`` with the score on the last token, GAE
    with a learned critic (arXiv:1506.02438), batch-whitened advantages, clipped surrogate
    ``max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high))`` (dual clip ``c`` optional, arXiv:1912.09729),
    clipped value loss.
    """
    n = nm.resolve(numerics)
    low, high = clip_range(clip_eps, clip_low, clip_high)
    advantage = ch.chain(
        *reward_stages(n),
        *kl_reward_stages(beta, kl_estimator, n, kl_controller),
        ch.gae(gamma, lam),
        whiten_stage(n, axis_name),
    )
    return make_recipe(
        "ppo",
        advantage=advantage,
        policy_loss=ppo_loss(low, high, n, dual_clip),
        agg_mode=resolve_agg_mode("token-mean", loss_agg_mode, n),
        beta=beta,
        kl_estimator=kl_estimator,
        kl_in_reward=True,
        numerics=n,
        entropy_coef=entropy_coef,
        needs_critic=True,
        value_clip=value_clip,
        hparams=dict(
            beta=beta, gamma=gamma, lam=lam, clip_low=low, clip_high=high, value_clip=value_clip
        ),
        loss_name="PPO clip + value loss",
        objective=(
            f"clipped surrogate −min(ρA, clip(ρ, 1−{low:g}, 1+{high:g})A) + a clipped value loss"
        ),
    )


def grpo(
    *,
    beta: float = 0.04,
    clip_eps: float = 0.2,
    clip_low: float | None = None,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    scale_by_std: bool = True,
    kl_estimator: str = "k3",
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    pods_num_keep: int | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300): ``A_i = (r_i − mean(r))/(std(r) +
    ε)`` over the G answers of a prompt, the same for every token; PPO's clipped surrogate;
    ``β·k3(π_θ ‖ π_ref)`` as a loss term; per-sequence token mean (``seq-mean-token-mean``).

    ``pods_num_keep`` enables PODS down-sampling (arXiv:2504.13818) before the advantages.
    """
    n = nm.resolve(numerics)
    low, high = clip_range(clip_eps, clip_low, clip_high)
    advantage = ch.chain(
        *reward_stages(n), ch.outcome_return(), *group_norm_stages(n, scale_by_std)
    )
    return make_recipe(
        "grpo",
        advantage=advantage,
        policy_loss=ppo_loss(low, high, n, dual_clip),
        agg_mode=resolve_agg_mode("seq-mean-token-mean", loss_agg_mode, n),
        beta=beta,
        kl_estimator=kl_estimator,
        kl_in_reward=False,
        numerics=n,
        entropy_coef=entropy_coef,
        selection=Selection(pods_num_keep=pods_num_keep),
        hparams=dict(
            beta=beta,
            clip_low=low,
            clip_high=high,
            scale_by_std=scale_by_std,
            pods_num_keep=pods_num_keep,
        ),
        loss_name="PPO clip",
        objective=f"clipped surrogate −min(ρA, clip(ρ, 1−{low:g}, 1+{high:g})A)",
    )


def dr_grpo(
    *,
    beta: float = 0.0,
    clip_eps: float = 0.2,
    clip_low: float | None = None,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    max_completion_length: int | None = None,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    pods_num_keep: int | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783):
    GRPO without the std division (``A_i = r_i − mean(r)``) and without the per-sequence length
    normaliser: token losses are summed and divided by a constant (``max_completion_length``,
    default the padded T) times the number of sequences (``seq-mean-token-sum-norm``); no KL.
    """
    n = nm.resolve(numerics)
    low, high = clip_range(clip_eps, clip_low, clip_high)
    advantage = ch.chain(*reward_stages(n), ch.outcome_return(), *group_norm_stages(n, False))
    return make_recipe(
        "dr_grpo",
        advantage=advantage,
        policy_loss=ppo_loss(low, high, n, dual_clip),
        agg_mode="seq-mean-token-sum-norm",
        agg_norm=max_completion_length,
        beta=beta,
        kl_estimator=kl_estimator,
        kl_in_reward=False,
        numerics=n,
        entropy_coef=entropy_coef,
        selection=Selection(pods_num_keep=pods_num_keep),
        hparams=dict(
            beta=beta,
            clip_low=low,
            clip_high=high,
            max_completion_length=max_completion_length,
            pods_num_keep=pods_num_keep,
        ),
        loss_name="PPO clip",
        objective=(
            f"clipped surrogate −min(ρA, clip(ρ, 1−{low:g}, 1+{high:g})A), token sums ÷ a "
            "constant length"
        ),
    )


def rloo(
    *,
    beta: float = 0.05,
    kl_estimator: str = "k1",
    kl_controller: _kl.KLController | None = None,
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    pods_num_keep: int | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740):
    ``A_i = R_i − 1/(G−1)·Σ_{j≠i} R_j`` with ``R_i = r_i − β·Σ_t KL_t`` (KL folded into the
    sequence reward), no std, no clipping: REINFORCE on whole sequences.
    """
    n = nm.resolve(numerics)
    advantage = ch.chain(
        *reward_stages(n),
        *kl_reward_stages(beta, kl_estimator, n, kl_controller),
        ch.outcome_return(),
        ch.leave_one_out_baseline(singleton_baseline=n.loo_singleton_baseline),
    )
    return make_recipe(
        "rloo",
        advantage=advantage,
        policy_loss=reinforce_policy_loss,
        agg_mode=resolve_agg_mode("seq-mean-token-sum", loss_agg_mode, n),
        beta=beta,
        kl_estimator=kl_estimator,
        kl_in_reward=True,
        numerics=n,
        entropy_coef=entropy_coef,
        selection=Selection(pods_num_keep=pods_num_keep),
        hparams=dict(beta=beta, kl_estimator=kl_estimator, pods_num_keep=pods_num_keep),
        loss_name="REINFORCE −A·log π",
        objective="−A·log π summed over each sequence (REINFORCE, no ratio, no clip)",
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
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """REINFORCE++ (Hu et al. 2025, arXiv:2501.03262): token rewards ``r_t − β·KL_t``,
    reward-to-go, then whitening over every valid token of the global batch (not per prompt);
    PPO's clipped surrogate with a token mean.
    """
    n = nm.resolve(numerics)
    low, high = clip_range(clip_eps, clip_low, clip_high)
    advantage = ch.chain(
        *reward_stages(n),
        *kl_reward_stages(beta, kl_estimator, n, kl_controller),
        ch.discounted_return(gamma),
        whiten_stage(n, axis_name),
    )
    return make_recipe(
        "reinforce_pp",
        advantage=advantage,
        policy_loss=ppo_loss(low, high, n, dual_clip),
        agg_mode=resolve_agg_mode("token-mean", loss_agg_mode, n),
        beta=beta,
        kl_estimator=kl_estimator,
        kl_in_reward=True,
        numerics=n,
        entropy_coef=entropy_coef,
        hparams=dict(beta=beta, gamma=gamma, clip_low=low, clip_high=high),
        loss_name="PPO clip",
        objective=f"clipped surrogate −min(ρA, clip(ρ, 1−{low:g}, 1+{high:g})A)",
    )


def reinforce_pp_baseline(
    *,
    beta: float = 0.01,
    clip_eps: float = 0.2,
    clip_low: float | None = None,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    kl_estimator: str = "k3",
    loss_agg_mode: str | None = None,
    entropy_coef: float = 0.0,
    axis_name: str | None = None,
    pods_num_keep: int | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """REINFORCE++-baseline (Hu et al. 2025, arXiv:2501.03262): ``r_i − mean(group)`` (no
    per-group std), then global batch whitening; ``β·k3`` as a loss term; clipped surrogate.
    """
    n = nm.resolve(numerics)
    low, high = clip_range(clip_eps, clip_low, clip_high)
    advantage = ch.chain(
        *reward_stages(n),
        ch.outcome_return(),
        *group_norm_stages(n, False),
        whiten_stage(n, axis_name),
    )
    return make_recipe(
        "reinforce_pp_baseline",
        advantage=advantage,
        policy_loss=ppo_loss(low, high, n, dual_clip),
        agg_mode=resolve_agg_mode("token-mean", loss_agg_mode, n),
        beta=beta,
        kl_estimator=kl_estimator,
        kl_in_reward=False,
        numerics=n,
        entropy_coef=entropy_coef,
        selection=Selection(pods_num_keep=pods_num_keep),
        hparams=dict(beta=beta, clip_low=low, clip_high=high, pods_num_keep=pods_num_keep),
        loss_name="PPO clip",
        objective=f"clipped surrogate −min(ρA, clip(ρ, 1−{low:g}, 1+{high:g})A)",
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
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """DAPO (Yu et al. 2025, arXiv:2503.14476): GRPO's group-normalised advantage with
    clip-higher (``ε_low = 0.2``, ``ε_high = 0.28``), a token mean over the whole batch,
    dynamic sampling (prompts whose answers all score the same are dropped and refilled), soft
    overlong punishment (when ``max_length`` and ``overlong_buffer`` are given) and no KL.
    """
    n = nm.resolve(numerics)
    shaping = ()
    if (max_length is None) != (overlong_buffer is None):
        raise ValueError(
            "dapo: give both `max_length` and `overlong_buffer` for overlong shaping, or neither"
        )
    if max_length is not None:
        shaping = (
            ch.overlong_penalty(
                max_length=max_length,
                buffer_length=overlong_buffer,
                penalty_factor=overlong_penalty,
            ),
        )
    advantage = ch.chain(
        *reward_stages(n), *shaping, ch.outcome_return(), *group_norm_stages(n, True)
    )
    return make_recipe(
        "dapo",
        advantage=advantage,
        policy_loss=ppo_loss(float(clip_low), float(clip_high), n, dual_clip),
        agg_mode=loss_agg_mode or "token-mean",
        beta=beta,
        kl_estimator=kl_estimator,
        kl_in_reward=False,
        numerics=n,
        entropy_coef=entropy_coef,
        selection=Selection(pods_num_keep=pods_num_keep, dynamic_sampling=dynamic_sampling),
        hparams=dict(
            beta=beta,
            clip_low=clip_low,
            clip_high=clip_high,
            max_length=max_length,
            overlong_buffer=overlong_buffer,
            dynamic_sampling=dynamic_sampling,
        ),
        loss_name="PPO clip-higher",
        objective=(
            f"clip-higher surrogate −min(ρA, clip(ρ, 1−{clip_low:g}, 1+{clip_high:g})A), "
            "token mean over the batch"
        ),
    )


def gspo(
    *,
    beta: float = 0.0,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    pods_num_keep: int | None = None,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071): GRPO's
    advantage with a sequence-level importance ratio ``s_i = exp(mean_t(log π − log π_old))``
    clipped to ``[1−ε_low, 1+ε_high]`` (paper: 3e-4, 4e-4); ``seq-mean-token-mean``.
    """
    n = nm.resolve(numerics)
    advantage = ch.chain(*reward_stages(n), ch.outcome_return(), *group_norm_stages(n, True))
    loss = functools.partial(
        pl.gspo_loss,
        clip_low=float(clip_low),
        clip_high=float(clip_high),
        log_ratio_clamp=n.gspo_log_ratio_clamp,
    )
    return make_recipe(
        "gspo",
        advantage=advantage,
        policy_loss=loss,
        agg_mode="seq-mean-token-mean",
        beta=beta,
        kl_estimator=kl_estimator,
        kl_in_reward=False,
        numerics=n,
        entropy_coef=entropy_coef,
        selection=Selection(pods_num_keep=pods_num_keep),
        hparams=dict(beta=beta, clip_low=clip_low, clip_high=clip_high),
        loss_name="GSPO sequence ratio",
        objective=(
            f"sequence-ratio surrogate −min(sA, clip(s, 1−{clip_low:g}, 1+{clip_high:g})A), "
            "s = exp(mean_t log ρ_t)"
        ),
    )


_PREFERENCE_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo")


def dpo(
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    numerics: nm.Numerics | str | None = None,
) -> Recipe:
    """DPO (Rafailov et al. 2023, arXiv:2305.18290) and its family, offline on preference pairs:
    ``−log σ(β[(log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l))])``.

    ``loss_type``: ``"sigmoid"`` (DPO; cDPO with ``label_smoothing``), ``"ipo"`` (Azar et al.,
    length-averaged), ``"hinge"`` (SLiC), ``"robust"`` (rDPO), ``"simpo"`` (reference-free,
    length-normalised, margin ``simpo_gamma``). DPO is the seeds' side branch: no reward model,
    no rollouts, no advantage; :func:`jaxrl_llm.compute_advantages` does not apply to it.
    """
    n = nm.resolve(numerics)
    if loss_type not in _PREFERENCE_TYPES:
        raise ValueError(f"dpo: loss_type={loss_type!r}; expected one of {_PREFERENCE_TYPES}")
    if beta <= 0:
        raise ValueError(f"dpo: `beta` must be > 0, got {beta!r}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo: `label_smoothing` must be in [0, 0.5), got {label_smoothing!r}")
    loss = functools.partial(
        preference_loss,
        loss_type=loss_type,
        beta=beta,
        label_smoothing=label_smoothing,
        simpo_gamma=simpo_gamma,
    )
    objective = {
        "sigmoid": "−log σ(βΔ) on the policy-vs-reference log-ratio margin Δ",
        "ipo": "(Δ̄ − 1/(2β))², Δ̄ the length-averaged margin",
        "hinge": "max(0, 1 − βΔ)",
        "robust": "noise-robust −[(1−ε)log σ(βΔ) − ε log σ(−βΔ)]/(1−2ε)",
        "simpo": "−log σ(β(logπ(y_w)/|y_w| − logπ(y_l)/|y_l|) − γ), reference-free",
    }[loss_type]
    return Recipe(
        name="dpo",
        advantage=None,
        policy_loss=None,
        aggregation=agg.get_aggregation("token-mean"),
        aggregation_name="mean over pairs",
        beta=float(beta),
        kl_estimator="implicit",
        kl_in_reward=False,
        kl_loss=None,
        entropy_coef=0.0,
        needs_critic=False,
        value_clip=None,
        selection=Selection(),
        preference_loss=loss,
        numerics=n,
        hparams=types.MappingProxyType(
            dict(beta=beta, loss_type=loss_type, label_smoothing=label_smoothing)
        ),
        objective=objective,
        loss_name=f"DPO {loss_type}",
    )


RECIPES: dict[str, Callable[..., Recipe]] = {
    "reinforce": reinforce,
    "ppo": ppo,
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "dapo": dapo,
    "gspo": gspo,
    "dpo": dpo,
}

ONLINE_RECIPES = tuple(name for name in RECIPES if name != "dpo")


def get(name: str, **hparams) -> Recipe:
    """Builds the recipe called ``name`` (the CLI and config layer's lookup)."""
    if name not in RECIPES:
        raise ValueError(f"unknown algorithm {name!r}; available: {', '.join(RECIPES)}")
    return RECIPES[name](**hparams)


__all__ = [
    "ONLINE_RECIPES",
    "RECIPES",
    "Recipe",
    "Selection",
    "dapo",
    "dpo",
    "dr_grpo",
    "get",
    "grpo",
    "gspo",
    "ppo",
    "reinforce",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "rloo",
]
