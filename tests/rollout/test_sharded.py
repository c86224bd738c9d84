"""The rollout on 8 fake CPU devices gives the same completions as on one device."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import rollout
from jaxrl_llm.models import sharding
from tests.models import hf_tiny

# B·G = 8 rows split over 8 devices; shapes as in test_generate (its programs are reused).
G, T = 2, 16


@pytest.fixture(scope="module")
def setup(tiny_pair):
    _, ours = tiny_pair("llama3")
    ids, mask = hf_tiny.left_padded_batch(np.random.RandomState(3), [11, 3, 1, 8], 11, 96)
    graphdef, state = nnx.split(ours)
    kw = dict(max_new_tokens=T, num_samples=G, stop_token_ids=())
    greedy = rollout.generate(ours, ids, mask, rng=jax.random.key(0), temperature=0.0, **kw)
    sampled = rollout.generate(ours, ids, mask, rng=jax.random.key(4), temperature=1.0, **kw)
    return graphdef, state, ids, mask, kw, greedy, sampled


@pytest.mark.parametrize("preset", ["dp", "fsdp_tp"])
def test_sharded_rollout_equals_single_device(setup, preset):
    graphdef, state, ids, mask, kw, greedy, sampled = setup
    assert len(jax.devices()) == 8
    mesh, rules = sharding.preset(preset)
    params = jax.device_put(nnx.to_pure_dict(state), sharding.param_shardings(state, mesh, rules))
    out = rollout.generate(
        (graphdef, params), ids, mask, rng=jax.random.key(0), temperature=0.0, **kw
    )
    assert len(out.tokens.sharding.device_set) == 8
    np.testing.assert_array_equal(out.tokens, greedy.tokens)
    np.testing.assert_allclose(out.logprobs, greedy.logprobs, atol=1e-5, rtol=0)
    # Same key, same samples: the random bits do not depend on the mesh.
    out = rollout.generate(
        (graphdef, params), ids, mask, rng=jax.random.key(4), temperature=1.0, **kw
    )
    np.testing.assert_array_equal(out.tokens, sampled.tokens)
    np.testing.assert_allclose(out.logprobs, sampled.logprobs, atol=1e-5, rtol=0)
