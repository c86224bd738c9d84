"""Properties that must hold for every recipe (hypothesis over shapes, masks and rewards).

Shapes come from a small fixed set so that each recipe compiles a handful of times and
hypothesis spends its examples on masks, rewards and padding rather than on compilation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import jaxrl_llm as jrl
from jaxrl_llm import algorithms as alg
from jaxrl_llm import chain as ch
from jaxrl_llm.core import aggregation as agg
from tests.test_algorithms import KL_IN_REWARD, get, random_rollout

RECIPES = {
    name: get(name, **({"beta": 0.1} if name in KL_IN_REWARD else {"beta": 0.05}))
    for name in alg.ONLINE_RECIPES
}
GROUP_NORMALISED = ("grpo", "dapo", "gspo")

shapes = st.tuples(
    st.sampled_from([(1, 1, 3), (2, 3, 4), (3, 5, 6)]), st.integers(0, 2**31 - 1)
).map(lambda t: (*t[0], t[1]))


def advantages(recipe, rollout):
    return jrl.compute_advantages(recipe, rollout)


@functools.cache
def jitted_objective(recipe):
    return jax.jit(functools.partial(jrl.policy_objective, recipe))


def with_garbage_under_masks(rollout, value=np.nan):
    """Replaces everything the masks hide with ``value``."""
    token = ch.token_mask(rollout)
    member = ch.member_mask(rollout)

    def spoil(x):
        return None if x is None else jnp.where(token, x, value)

    return rollout._replace(
        reward_bg=jnp.where(member, rollout.reward_bg, value),
        logp_old_bgt=spoil(rollout.logp_old_bgt),
        logp_ref_bgt=spoil(rollout.logp_ref_bgt),
        value_bgt=spoil(rollout.value_bgt),
    )


@pytest.mark.parametrize("name", alg.ONLINE_RECIPES)
@given(shape=shapes)
def test_values_under_padding_change_nothing(name, shape):
    recipe = RECIPES[name]
    rollout = random_rollout(shape[3], *shape[:3])
    clean = advantages(recipe, rollout)
    for garbage in (np.nan, 1e30, -np.inf):
        np.testing.assert_array_equal(
            advantages(recipe, with_garbage_under_masks(rollout, garbage)), clean
        )


@pytest.mark.parametrize("name", alg.ONLINE_RECIPES)
@given(shape=shapes, extra_t=st.sampled_from([1, 3]), extra_g=st.sampled_from([0, 2]))
def test_extra_padding_changes_nothing(name, shape, extra_t, extra_g):
    recipe = RECIPES[name]
    rollout = random_rollout(shape[3], *shape[:3])
    clean = advantages(recipe, rollout)

    def pad(x, fill):
        if x is None:
            return None
        widths = [(0, 0), (0, extra_g)] + [(0, extra_t)] * (x.ndim - 2)
        return jnp.pad(x, widths, constant_values=fill)

    padded = jrl.Rollout(
        reward_bg=pad(rollout.reward_bg, 7.0),
        mask_bgt=pad(rollout.mask_bgt, False),
        mask_bg=pad(rollout.mask_bg, False),
        logp_old_bgt=pad(rollout.logp_old_bgt, -3.0),
        logp_ref_bgt=pad(rollout.logp_ref_bgt, -1.0),
        value_bgt=pad(rollout.value_bgt, 5.0),
        baseline_b=rollout.baseline_b,  # per prompt: B is not padded
    )
    got = advantages(recipe, padded)
    _b, g, t = clean.shape
    np.testing.assert_allclose(got[:, :g, :t], clean, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[:, g:], 0.0)
    np.testing.assert_array_equal(got[:, :, t:], 0.0)


# Clip-Cov and KL-Cov pick tokens by each micro-batch's covariance statistics (as verl does):
# by construction their loss is not additive over micro-batches (core.policy_losses).
MICRO_BATCH_DEPENDENT = ("clip_cov", "kl_cov")


@pytest.mark.parametrize("name", [n for n in alg.ONLINE_RECIPES if n not in MICRO_BATCH_DEPENDENT])
@given(shape=shapes, split=st.integers(1, 2))
def test_micro_batches_combine_to_the_whole_batch(name, shape, split):
    """Gradient accumulation: advantages are computed on the whole batch (they are batch
    statistics), then the loss over micro-batches of prompts adds up to the one-batch loss."""
    recipe = RECIPES[name]
    rollout = random_rollout(shape[3], *shape[:3])
    adv = advantages(recipe, rollout)
    mask = ch.token_mask(rollout)
    logp = rollout.logp_old_bgt + 0.1

    def terms(sl):
        return jitted_objective(recipe)(
            logp[sl],
            adv[sl],
            mask[sl],
            logp_old_bgt=rollout.logp_old_bgt[sl],
            logp_ref_bgt=rollout.logp_ref_bgt[sl],
        ).total

    whole = terms(slice(None))
    cut = min(split, rollout.reward_bg.shape[0])
    parts = agg.combine([terms(slice(0, cut)), terms(slice(cut, None))])
    np.testing.assert_allclose(parts[0], whole[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(parts[1], whole[1], rtol=1e-6)
    np.testing.assert_allclose(agg.finalize(*parts), agg.finalize(*whole), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", alg.ONLINE_RECIPES)
@given(shape=shapes)
def test_bf16_inputs_give_finite_float32(name, shape):
    recipe = RECIPES[name]
    rollout = random_rollout(shape[3], *shape[:3])
    to_bf16 = lambda x: None if x is None else x.astype(jnp.bfloat16)
    low = rollout._replace(
        reward_bg=to_bf16(rollout.reward_bg),
        logp_old_bgt=to_bf16(rollout.logp_old_bgt),
        logp_ref_bgt=to_bf16(rollout.logp_ref_bgt),
        value_bgt=to_bf16(rollout.value_bgt),
    )
    adv = advantages(recipe, low)
    assert adv.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(adv)))


@pytest.mark.parametrize("name", GROUP_NORMALISED)
@given(shape=shapes, shift=st.floats(-50, 50), scale=st.floats(0.1, 20))
def test_group_normalised_advantages_ignore_shift_and_scale(name, shape, shift, scale):
    recipe = RECIPES[name]
    rollout = random_rollout(shape[3], *shape[:3])
    # a wide, untied spread so that eps (1e-6 on the std) is negligible
    rng = np.random.default_rng(shape[3])
    b, g = rollout.reward_bg.shape
    rollout = rollout._replace(reward_bg=jnp.asarray(rng.permutation(b * g).reshape(b, g), float))
    clean = advantages(recipe, rollout)
    moved = rollout._replace(
        reward_bg=rollout.reward_bg.at[0].set(rollout.reward_bg[0] * scale + shift)
    )
    np.testing.assert_allclose(advantages(recipe, moved), clean, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", ("dr_grpo", "rloo", "reinforce_pp_baseline"))
@given(shape=shapes, shift=st.floats(-50, 50))
def test_group_centred_advantages_ignore_shift(name, shape, shift):
    recipe = RECIPES[name]
    rollout = random_rollout(shape[3], *shape[:3])
    clean = advantages(recipe, rollout)
    moved = rollout._replace(reward_bg=rollout.reward_bg.at[0].add(shift))
    np.testing.assert_allclose(advantages(recipe, moved), clean, rtol=1e-3, atol=2e-3)
