"""The decode step (own cache layout) equals the model's cached forward, for every family.

``decode.decode_step`` re-uses the model's submodules around its own attention; this pins it
to ``CausalLM.__call__(..., cache=...)`` so a change to the model that the step does not follow
fails here first.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.models.transformer import KVCache
from jaxrl_llm.rollout import decode
from tests.models import hf_tiny

STEPS = 3


@nnx.jit
def both(model, prompt, mask, tokens, alive):
    b, p = prompt.shape
    ref_cache = KVCache.init(model.config, b, p + STEPS)
    _, ref_cache = model(prompt, mask, cache=ref_cache)
    cache = KVCache.init(model.config, b, p)
    _, cache = model.model(prompt, mask, cache=cache)
    cache = decode.from_prefill(cache, p + STEPS)
    ref, ours = [], []
    for i in range(STEPS):
        logits, ref_cache = model(tokens[:, i : i + 1], alive[:, i : i + 1], cache=ref_cache)
        ref.append(logits[:, 0])
        logits, cache = decode.decode_step(model, tokens[:, i], alive[:, i], cache)
        ours.append(logits)
    return jnp.stack(ref, 1), jnp.stack(ours, 1)


@pytest.mark.parametrize("family", sorted(hf_tiny.FAMILIES))
def test_decode_step_equals_model_cached_forward(tiny_pair, family):
    _, model = tiny_pair(family)
    rng = np.random.RandomState(0)
    prompt, mask = hf_tiny.left_padded_batch(rng, [7, 2, 5], 7, 96)
    tokens = rng.randint(3, 96, (3, STEPS)).astype(np.int32)
    alive = np.ones((3, STEPS), bool)
    alive[1, 1:] = False  # a row that stops: its later logits are not compared
    ref, ours = jax.device_get(both(model, prompt, mask, tokens, alive))
    valid = np.broadcast_to(alive[:, :, None], ref.shape)
    np.testing.assert_allclose(ours[valid], ref[valid], atol=2e-5, rtol=0)
