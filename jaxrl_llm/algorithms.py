"""Named algorithms as recipes: compositions of the chain, a policy loss and an aggregation.

A :class:`Recipe` is data, not a class to subclass: the advantage chain (an
:class:`~jaxrl_llm.chain.AdvantageTransform`), a per-token policy loss, a loss aggregation that
returns ``(sum, denominator)``, where the KL goes, and which samples are selected. Each function
below builds one, documented like the paper it comes from; variants are keyword arguments (or
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

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm import chain as ch
from jaxrl_llm import numerics as nm
from jaxrl_llm.core import aggregation as agg
from jaxrl_llm.core import kl as _kl
from jaxrl_llm.core import policy_losses as pl
from jaxrl_llm.core import preference as pref
from jaxrl_llm.core import selection as sel

PolicyLoss = Callable[[chex.Array, chex.Array, chex.Array, chex.Array], chex.Array]
Aggregation = Callable[[chex.Array, chex.Array], tuple[chex.Array, chex.Array]]


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
    """One algorithm: the chain, the loss, the aggregation, the KL placement, the selection.

    Hashed by identity, so a recipe can be a static argument of ``jax.jit`` and each recipe
    object compiles once per shape.

    Attributes:
      name: the algorithm's name.
      advantage: the reward → advantage chain; ``None`` for offline preference recipes (DPO).
      policy_loss: ``(logp_bgt, logp_old_bgt, adv_bgt, mask_bgt) -> loss_bgt`` per token.
      aggregation: ``(loss_bgt, mask_bgt) -> (sum, denominator)``.
      aggregation_name: its name (for ``explain`` and logs).
      beta: KL coefficient.
      kl_estimator: the KL estimator's name.
      kl_in_reward: True if the KL shapes the rewards (inside ``advantage``), False if it is a
        loss term.
      kl_loss: ``(logp_bgt, logp_ref_bgt) -> kl_bgt`` per token when ``beta > 0`` and the KL is a
        loss term, else ``None``.
      entropy_coef: coefficient of the entropy bonus (``− c·H`` per token).
      needs_critic: whether the recipe trains a value function (PPO).
      value_clip: clip range of the value loss (PPO).
      selection: PODS / DAPO dynamic sampling.
      preference_loss: the per-pair loss of an offline preference recipe (DPO family).
      numerics: the conventions the recipe was built with.
      hparams: the keyword arguments it was built with (read-only), for logs and ``explain``.
      objective: one sentence on what is finally optimised, for ``explain``.
      loss_name: the policy loss in a few words (for tables).
    """

    name: str
    advantage: ch.AdvantageTransform | None
    policy_loss: PolicyLoss | None
    aggregation: Aggregation
    aggregation_name: str
    beta: float
    kl_estimator: str
    kl_in_reward: bool
    kl_loss: Callable[[chex.Array, chex.Array], chex.Array] | None
    entropy_coef: float
    needs_critic: bool
    value_clip: float | None
    selection: Selection
    preference_loss: Callable[..., chex.Array] | None
    numerics: nm.Numerics
    hparams: Mapping[str, Any]
    objective: str
    loss_name: str = ""

    @property
    def needs_reference(self) -> bool:
        """Whether reference log-probs are needed at all (False when β = 0 and DPO is
        reference-free): the trainer then skips the reference model entirely."""
        if self.preference_loss is not None:
            return self.hparams.get("loss_type") != "simpo"
        return self.beta > 0


# --------------------------------------------------------------------------------------------
# Building blocks shared by the recipes (resolved at build time, never inside traced math).


def _aggregation(mode: str, *, norm: int | None = None) -> Aggregation:
    """The aggregation named ``mode``; ``seq-mean-token-sum-norm`` divides by ``norm`` (default:
    the padded completion length T of the batch)."""
    if mode == "seq-mean-token-sum-norm":

        def seq_sum_norm(loss_bgt, mask_bgt):
            scale = norm if norm is not None else mask_bgt.shape[-1]
            return agg.seq_mean_token_sum_norm(loss_bgt, mask_bgt, norm=scale)

        return seq_sum_norm
    return agg.get_aggregation(mode)


def _agg_mode(recipe_default: str, loss_agg_mode: str | None, numerics: nm.Numerics) -> str:
    return loss_agg_mode or numerics.loss_agg_mode or recipe_default


def _clip_range(clip_eps, clip_low, clip_high) -> tuple[float, float]:
    low = clip_eps if clip_low is None else clip_low
    high = clip_eps if clip_high is None else clip_high
    return float(low), float(high)


def _ppo_loss(clip_low, clip_high, numerics: nm.Numerics, dual_clip) -> PolicyLoss:
    c = numerics.dual_clip if dual_clip is None else (dual_clip or None)
    return functools.partial(
        _ppo_loss_impl,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=c,
        log_ratio_clamp=numerics.log_ratio_clamp,
    )


def _ppo_loss_impl(logp_bgt, logp_old_bgt, adv_bgt, mask_bgt, **kw):
    return pl.ppo_clip_loss(logp_bgt, logp_old_bgt, adv_bgt, mask_bgt, **kw)


def _reinforce_loss_impl(logp_bgt, logp_old_bgt, adv_bgt, mask_bgt):
    del logp_old_bgt
    return pl.reinforce_loss(logp_bgt, adv_bgt, mask_bgt)


def _kl_loss(beta: float, estimator: str, numerics: nm.Numerics):
    if beta <= 0:
        return None
    fn = _kl.get_kl_estimator(estimator)
    return functools.partial(fn, **numerics.kl_kwargs(estimator))


def _reward_stages(numerics: nm.Numerics) -> tuple[ch.AdvantageTransform, ...]:
    if numerics.reward_clip is None:
        return ()
    return (ch.clip_reward(*numerics.reward_clip),)


def _kl_reward_stage(beta, estimator, numerics, kl_controller) -> tuple[ch.AdvantageTransform, ...]:
    if kl_controller is not None:
        return (ch.kl_penalty(kl_controller, estimator=estimator, **numerics.kl_kwargs(estimator)),)
    if beta <= 0:
        return ()
    return (ch.kl_penalty(beta, estimator=estimator, **numerics.kl_kwargs(estimator)),)


def _whiten(numerics: nm.Numerics, axis_name: str | None) -> ch.AdvantageTransform:
    return ch.batch_whiten(
        ddof=numerics.whiten_ddof,
        eps=numerics.whiten_eps,
        eps_as_floor=numerics.whiten_eps_as_floor,
        axis_name=axis_name,
    )


def _group_norm(numerics: nm.Numerics, scale_by_std: bool) -> tuple[ch.AdvantageTransform, ...]:
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


def _check_hparams(name: str, **values) -> None:
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


def _make(
    name: str,
    *,
    advantage: ch.AdvantageTransform,
    policy_loss: PolicyLoss,
    agg_mode: str,
    agg_norm: int | None = None,
    beta: float,
    kl_estimator: str,
    kl_in_reward: bool,
    numerics: nm.Numerics,
    entropy_coef: float = 0.0,
    needs_critic: bool = False,
    value_clip: float | None = None,
    selection: Selection | None = None,
    hparams: dict,
    objective: str,
    loss_name: str,
) -> Recipe:
    _check_hparams(
        name,
        beta=beta,
        entropy_coef=entropy_coef,
        gamma=hparams.get("gamma"),
        lam=hparams.get("lam"),
        clip_low=hparams.get("clip_low"),
        clip_high=hparams.get("clip_high"),
        pods_num_keep=selection.pods_num_keep if selection else None,
    )
    return Recipe(
        name=name,
        advantage=advantage,
        policy_loss=policy_loss,
        aggregation=_aggregation(agg_mode, norm=agg_norm),
        aggregation_name=agg_mode,
        beta=float(beta),
        kl_estimator=kl_estimator,
        kl_in_reward=kl_in_reward,
        kl_loss=None if kl_in_reward else _kl_loss(beta, kl_estimator, numerics),
        entropy_coef=float(entropy_coef),
        needs_critic=needs_critic,
        value_clip=value_clip,
        selection=selection or Selection(),
        preference_loss=None,
        numerics=numerics,
        hparams=types.MappingProxyType(dict(hparams)),
        objective=objective,
        loss_name=loss_name,
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
        *_reward_stages(n),
        *_kl_reward_stage(beta, kl_estimator, n, kl_controller),
        ch.discounted_return(gamma),
    )
    return _make(
        "reinforce",
        advantage=advantage,
        policy_loss=_reinforce_loss_impl,
        agg_mode=_agg_mode("seq-mean-token-sum", loss_agg_mode, n),
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
    low, high = _clip_range(clip_eps, clip_low, clip_high)
    advantage = ch.chain(
        *_reward_stages(n),
        *_kl_reward_stage(beta, kl_estimator, n, kl_controller),
        ch.gae(gamma, lam),
        _whiten(n, axis_name),
    )
    return _make(
        "ppo",
        advantage=advantage,
        policy_loss=_ppo_loss(low, high, n, dual_clip),
        agg_mode=_agg_mode("token-mean", loss_agg_mode, n),
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
    low, high = _clip_range(clip_eps, clip_low, clip_high)
    advantage = ch.chain(*_reward_stages(n), ch.outcome_return(), *_group_norm(n, scale_by_std))
    return _make(
        "grpo",
        advantage=advantage,
        policy_loss=_ppo_loss(low, high, n, dual_clip),
        agg_mode=_agg_mode("seq-mean-token-mean", loss_agg_mode, n),
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
    low, high = _clip_range(clip_eps, clip_low, clip_high)
    advantage = ch.chain(*_reward_stages(n), ch.outcome_return(), *_group_norm(n, False))
    return _make(
        "dr_grpo",
        advantage=advantage,
        policy_loss=_ppo_loss(low, high, n, dual_clip),
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
        *_reward_stages(n),
        *_kl_reward_stage(beta, kl_estimator, n, kl_controller),
        ch.outcome_return(),
        ch.leave_one_out_baseline(singleton_baseline=n.loo_singleton_baseline),
    )
    return _make(
        "rloo",
        advantage=advantage,
        policy_loss=_reinforce_loss_impl,
        agg_mode=_agg_mode("seq-mean-token-sum", loss_agg_mode, n),
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
    low, high = _clip_range(clip_eps, clip_low, clip_high)
    advantage = ch.chain(
        *_reward_stages(n),
        *_kl_reward_stage(beta, kl_estimator, n, kl_controller),
        ch.discounted_return(gamma),
        _whiten(n, axis_name),
    )
    return _make(
        "reinforce_pp",
        advantage=advantage,
        policy_loss=_ppo_loss(low, high, n, dual_clip),
        agg_mode=_agg_mode("token-mean", loss_agg_mode, n),
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
    low, high = _clip_range(clip_eps, clip_low, clip_high)
    advantage = ch.chain(
        *_reward_stages(n), ch.outcome_return(), *_group_norm(n, False), _whiten(n, axis_name)
    )
    return _make(
        "reinforce_pp_baseline",
        advantage=advantage,
        policy_loss=_ppo_loss(low, high, n, dual_clip),
        agg_mode=_agg_mode("token-mean", loss_agg_mode, n),
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
    advantage = ch.chain(*_reward_stages(n), *shaping, ch.outcome_return(), *_group_norm(n, True))
    return _make(
        "dapo",
        advantage=advantage,
        policy_loss=_ppo_loss(float(clip_low), float(clip_high), n, dual_clip),
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
    advantage = ch.chain(*_reward_stages(n), ch.outcome_return(), *_group_norm(n, True))
    loss = functools.partial(
        pl.gspo_loss,
        clip_low=float(clip_low),
        clip_high=float(clip_high),
        log_ratio_clamp=n.gspo_log_ratio_clamp,
    )
    return _make(
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


class PreferenceBatch(NamedTuple):
    """Sequence log-probs and lengths of ``P`` preference pairs (``f32[P]`` each).

    ``ref_chosen_p`` / ``ref_rejected_p`` may be ``None`` for reference-free losses (SimPO).
    """

    logp_chosen_p: chex.Array
    logp_rejected_p: chex.Array
    len_chosen_p: chex.Array
    len_rejected_p: chex.Array
    ref_chosen_p: chex.Array | None = None
    ref_rejected_p: chex.Array | None = None


def preference_loss(
    batch: PreferenceBatch,
    *,
    loss_type: str,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> chex.Array:
    """Per-pair loss ``f32[P]`` of the DPO family (see :func:`dpo`)."""
    if loss_type == "simpo":
        return pref.simpo_loss(
            batch.logp_chosen_p,
            batch.logp_rejected_p,
            batch.len_chosen_p,
            batch.len_rejected_p,
            beta=beta,
            gamma=simpo_gamma,
        )
    if batch.ref_chosen_p is None or batch.ref_rejected_p is None:
        raise ValueError(f"dpo ({loss_type}): reference log-probs are required (ref_chosen_p)")
    args = (batch.logp_chosen_p, batch.logp_rejected_p, batch.ref_chosen_p, batch.ref_rejected_p)
    if loss_type == "sigmoid":
        return pref.dpo_sigmoid_loss(*args, beta=beta, label_smoothing=label_smoothing)
    if loss_type == "ipo":
        return pref.ipo_loss(*args, batch.len_chosen_p, batch.len_rejected_p, beta=beta)
    if loss_type == "hinge":
        return pref.hinge_loss(*args, beta=beta)
    if loss_type == "robust":
        return pref.robust_dpo_loss(*args, beta=beta, label_smoothing=label_smoothing)
    raise ValueError(f"unknown preference loss_type {loss_type!r}")


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


# --------------------------------------------------------------------------------------------
# Running a recipe.


@functools.partial(jax.jit, static_argnums=0)
def _compute_advantages_jit(recipe: Recipe, rollout: ch.Rollout) -> chex.Array:
    adv_bgt, _ = ch.apply(recipe.advantage, rollout)
    return adv_bgt


def compute_advantages(recipe: Recipe, rollout: ch.Rollout) -> chex.Array:
    """``f32[B, G, T]`` advantages of ``recipe`` on ``rollout`` (jit-compiled once per recipe
    object and shape; 0 on padding and non-members).

    Stateful stages (an adaptive KL controller) start from their initial state here; to carry
    the state across steps use ``recipe.advantage.init`` / ``chain.apply`` directly.
    """
    if recipe.advantage is None:
        raise ValueError(
            f"compute_advantages: recipe {recipe.name!r} is an offline preference recipe with no "
            "advantage; use jaxrl_llm.algorithms.preference_loss on a PreferenceBatch"
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

    total: tuple[chex.Array, chex.Array]
    policy: tuple[chex.Array, chex.Array]
    kl: tuple[chex.Array, chex.Array]
    entropy: tuple[chex.Array, chex.Array]


def policy_objective(
    recipe: Recipe,
    logp_bgt: chex.Array,
    adv_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    logp_old_bgt: chex.Array | None = None,
    logp_ref_bgt: chex.Array | None = None,
    entropy_bgt: chex.Array | None = None,
) -> LossTerms:
    """The recipe's policy loss as ``(sum, denominator)`` pairs, differentiable in ``logp_bgt``.

    Per token: ``ℓ_t = policy_loss + β·KL_t(π_θ ‖ π_ref) − c_H·H_t`` (the KL term only when the
    recipe puts KL in the loss), aggregated with the recipe's mode. Because sums and
    denominators add, micro-batches and shards combine to exactly the whole-batch loss. Without
    ``logp_old_bgt`` the rollout is taken as on-policy: ``logp_old = stop_gradient(logp)``.
    """
    if recipe.policy_loss is None:
        raise ValueError(f"policy_objective: recipe {recipe.name!r} has no policy loss")
    if logp_old_bgt is None:
        logp_old_bgt = jax.lax.stop_gradient(logp_bgt)
    zero = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    policy_bgt = recipe.policy_loss(logp_bgt, logp_old_bgt, adv_bgt, mask_bgt)
    total_bgt = policy_bgt
    kl_terms = entropy_terms = zero
    if recipe.kl_loss is not None:
        if logp_ref_bgt is None:
            raise ValueError(
                f"policy_objective({recipe.name}): beta={recipe.beta} puts a KL term in the loss, "
                "so `logp_ref_bgt` is required"
            )
        kl_bgt = jnp.where(mask_bgt, recipe.kl_loss(logp_bgt, logp_ref_bgt), 0.0)
        total_bgt = total_bgt + recipe.beta * kl_bgt
        kl_terms = recipe.aggregation(kl_bgt, mask_bgt)
    if recipe.entropy_coef > 0:
        if entropy_bgt is None:
            raise ValueError(
                f"policy_objective({recipe.name}): entropy_coef={recipe.entropy_coef} needs "
                "`entropy_bgt`"
            )
        bonus_bgt = pl.entropy_bonus(entropy_bgt, mask_bgt, coef=recipe.entropy_coef)
        total_bgt = total_bgt + bonus_bgt
        entropy_terms = recipe.aggregation(jnp.where(mask_bgt, entropy_bgt, 0.0), mask_bgt)
    return LossTerms(
        total=recipe.aggregation(total_bgt, mask_bgt),
        policy=recipe.aggregation(policy_bgt, mask_bgt),
        kl=kl_terms,
        entropy=entropy_terms,
    )


__all__ = [
    "ONLINE_RECIPES",
    "RECIPES",
    "LossTerms",
    "PreferenceBatch",
    "Recipe",
    "Selection",
    "compute_advantages",
    "dapo",
    "dpo",
    "dr_grpo",
    "get",
    "grpo",
    "gspo",
    "policy_objective",
    "ppo",
    "preference_loss",
    "reinforce",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "rloo",
    "select",
]
