"""Running a recipe: advantages, sample selection and the policy objective.

``compute_advantages`` runs a recipe's chain on a :class:`~jaxrl_llm.chain.Rollout` under one
``jit`` per recipe object and shape; ``select`` applies PODS / DAPO selection to the group
membership; ``policy_objective`` is the per-token loss of the recipe aggregated as
``(sum, denominator)`` pairs; ``preference_loss`` is the DPO family's per-pair loss.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm import chain as ch
from jaxrl_llm.core import policy_losses as pl
from jaxrl_llm.core import preference as pref
from jaxrl_llm.core import selection as sel

if TYPE_CHECKING:
    from jaxrl_llm.algorithms import Recipe


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
    "LossTerms",
    "PreferenceBatch",
    "compute_advantages",
    "policy_objective",
    "preference_loss",
    "select",
]
