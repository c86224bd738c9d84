"""Batch statistics are global under sharding: 8 fake CPU devices equal one device."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxrl_llm as jrl
from jaxrl_llm import algorithms as alg
from jaxrl_llm import chain as ch
from jaxrl_llm.core import aggregation as agg
from tests.test_algorithms import random_rollout

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")


def mesh8():
    return Mesh(np.array(jax.devices()[:8]), ("data",))


def shard_rollout(rollout, mesh):
    """Prompts (axis 0) split over the 8 devices."""
    sharding = lambda x: NamedSharding(mesh, P("data", *([None] * (x.ndim - 1))))
    return jax.tree.map(lambda x: jax.device_put(x, sharding(x)), rollout)


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline", "ppo", "grpo"])
def test_advantages_sharded_equal_single_device(name):
    recipe = alg.get(name)
    rollout = random_rollout(11, 16, 4, 9)
    single = jrl.compute_advantages(recipe, rollout)
    sharded_rollout = shard_rollout(rollout, mesh8())
    sharded = jrl.compute_advantages(recipe, sharded_rollout)
    assert len(sharded_rollout.reward_bg.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(single), rtol=1e-5, atol=1e-5)


def test_batch_whitening_under_shard_map_is_global():
    """Inside shard_map each device sees 2 prompts; `axis_name` makes the whitening global."""
    mesh = mesh8()
    rollout = random_rollout(12, 16, 3, 5, ragged_groups=False)
    recipe_global = alg.reinforce_pp(beta=0.0, axis_name="data")
    recipe_local = alg.reinforce_pp(beta=0.0)
    single = jrl.compute_advantages(recipe_local, rollout)

    def per_shard(recipe, rollout):
        return ch.apply(recipe.advantage, rollout)[0]

    spec = jax.tree.map(lambda x: P("data", *([None] * (x.ndim - 1))), rollout)
    run = lambda recipe: jax.jit(
        jax.shard_map(
            functools.partial(per_shard, recipe),
            mesh=mesh,
            in_specs=(spec,),
            out_specs=P("data", None, None),
        )
    )(shard_rollout(rollout, mesh))
    np.testing.assert_allclose(run(recipe_global), single, rtol=1e-5, atol=1e-5)
    # without the axis name, every shard whitens on its own: a different (wrong) answer
    assert not np.allclose(run(recipe_local), single, atol=1e-3)


def test_token_mean_loss_sharded_equals_single_device():
    mesh = mesh8()
    recipe = alg.grpo(loss_agg_mode="token-mean", beta=0.0)
    rollout = random_rollout(13, 16, 4, 7)
    adv = jrl.compute_advantages(recipe, rollout)
    mask = ch.token_mask(rollout)
    logp = rollout.logp_old_bgt + 0.05

    @jax.jit
    def loss(logp, adv, mask, logp_old):
        terms = jrl.policy_objective(recipe, logp, adv, mask, logp_old_bgt=logp_old)
        return agg.finalize(*terms.total)

    single_value, single_grad = jax.value_and_grad(loss)(logp, adv, mask, rollout.logp_old_bgt)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
    args = [put(x) for x in (logp, adv, mask, rollout.logp_old_bgt)]
    value, grad = jax.value_and_grad(loss)(*args)
    # float32 sums over 8 shards in another order: a few ulps (1.6e-6 seen at XLA opt level 0)
    np.testing.assert_allclose(value, single_value, rtol=5e-6)
    np.testing.assert_allclose(grad, single_grad, rtol=1e-5, atol=1e-9)
    assert jnp.asarray(grad).sharding.spec == P("data", None, None) or len(grad.devices()) == 8
