"""What a recipe is, and the building blocks the named algorithms are assembled from.

A :class:`Recipe` is data, not a class to subclass: the advantage chain (an
:class:`~jaxrl_llm.chain.AdvantageTransform`), a per-token policy loss, a loss aggregation that
returns ``(sum, denominator)``, where the KL goes, and which samples are selected. The named
algorithms in :mod:`jaxrl_llm.algorithms` are built from the helpers below, which resolve names
and :class:`~jaxrl_llm.numerics.Numerics` into plain keyword arguments at build time, so nothing
string-typed or config-like ever reaches traced math.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import chex

from jaxrl_llm import chain as ch
from jaxrl_llm import numerics as nm
from jaxrl_llm.core import aggregation as agg
from jaxrl_llm.core import kl as _kl
from jaxrl_llm.core import policy_losses as pl

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


def aggregation_by_name(mode: str, *, norm: int | None = None) -> Aggregation:
    """The aggregation named ``mode``; ``seq-mean-token-sum-norm`` divides by ``norm`` (default:
    the padded completion length T of the batch)."""
    if mode == "seq-mean-token-sum-norm":

        def seq_sum_norm(loss_bgt, mask_bgt):
            scale = norm if norm is not None else mask_bgt.shape[-1]
            return agg.seq_mean_token_sum_norm(loss_bgt, mask_bgt, norm=scale)

        return seq_sum_norm
    return agg.get_aggregation(mode)


def resolve_agg_mode(recipe_default: str, loss_agg_mode: str | None, numerics: nm.Numerics) -> str:
    return loss_agg_mode or numerics.loss_agg_mode or recipe_default


def clip_range(clip_eps, clip_low, clip_high) -> tuple[float, float]:
    low = clip_eps if clip_low is None else clip_low
    high = clip_eps if clip_high is None else clip_high
    return float(low), float(high)


def ppo_loss(clip_low, clip_high, numerics: nm.Numerics, dual_clip) -> PolicyLoss:
    c = numerics.dual_clip if dual_clip is None else (dual_clip or None)
    return functools.partial(
        _ppo_loss_call,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=c,
        log_ratio_clamp=numerics.log_ratio_clamp,
    )


def _ppo_loss_call(logp_bgt, logp_old_bgt, adv_bgt, mask_bgt, **kw):
    return pl.ppo_clip_loss(logp_bgt, logp_old_bgt, adv_bgt, mask_bgt, **kw)


def reinforce_policy_loss(logp_bgt, logp_old_bgt, adv_bgt, mask_bgt):
    del logp_old_bgt
    return pl.reinforce_loss(logp_bgt, adv_bgt, mask_bgt)


def kl_loss_fn(beta: float, estimator: str, numerics: nm.Numerics):
    if beta <= 0:
        return None
    fn = _kl.get_kl_estimator(estimator)
    return functools.partial(fn, **numerics.kl_kwargs(estimator))


def reward_stages(numerics: nm.Numerics) -> tuple[ch.AdvantageTransform, ...]:
    if numerics.reward_clip is None:
        return ()
    return (ch.clip_reward(*numerics.reward_clip),)


def kl_reward_stages(beta, estimator, numerics, kl_controller) -> tuple[ch.AdvantageTransform, ...]:
    if kl_controller is not None:
        return (ch.kl_penalty(kl_controller, estimator=estimator, **numerics.kl_kwargs(estimator)),)
    if beta <= 0:
        return ()
    return (ch.kl_penalty(beta, estimator=estimator, **numerics.kl_kwargs(estimator)),)


def whiten_stage(numerics: nm.Numerics, axis_name: str | None) -> ch.AdvantageTransform:
    return ch.batch_whiten(
        ddof=numerics.whiten_ddof,
        eps=numerics.whiten_eps,
        eps_as_floor=numerics.whiten_eps_as_floor,
        axis_name=axis_name,
    )


def group_norm_stages(
    numerics: nm.Numerics, scale_by_std: bool
) -> tuple[ch.AdvantageTransform, ...]:
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


def check_hparams(name: str, **values) -> None:
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


def make_recipe(
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
    check_hparams(
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
        aggregation=aggregation_by_name(agg_mode, norm=agg_norm),
        aggregation_name=agg_mode,
        beta=float(beta),
        kl_estimator=kl_estimator,
        kl_in_reward=kl_in_reward,
        kl_loss=None if kl_in_reward else kl_loss_fn(beta, kl_estimator, numerics),
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
