"""Model-level log-probs: equal to core.token_logprobs on full logits, with far less memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import models
from jaxrl_llm.core import logprobs as core_logprobs
from jaxrl_llm.models.logprobs import completion_logprobs, hidden_logprobs

CONFIG = models.ModelConfig(
    vocab_size=512,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def lm():
    return models.CausalLM(CONFIG, rngs=nnx.Rngs(0))


def _reference(lm, tokens, mask, start, temperature):
    logits = lm(tokens, mask)
    return core_logprobs.token_logprobs(
        logits[:, start - 1 : -1], tokens[:, start:], temperature=temperature
    )


def test_matches_core_on_full_logits_with_uneven_chunks(lm):
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, 512, (3, 23)), jnp.int32)
    mask = jnp.asarray(np.arange(23)[None, :] >= np.array([[0], [5], [9]]))
    start = 6
    graphdef, params = nnx.split(lm)

    def ours(p):
        return completion_logprobs(
            nnx.merge(graphdef, p), tokens, mask, start=start, temperature=0.7, chunk_size=5
        )

    def ref(p):
        return _reference(nnx.merge(graphdef, p), tokens, mask, start, 0.7)

    out, expected = jax.jit(ours)(params), jax.jit(ref)(params)
    assert out.shape == (3, 17) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=0)
    g_ours = jax.jit(jax.grad(lambda p: jnp.sum(ours(p) * mask[:, start:])))(params)
    g_ref = jax.jit(jax.grad(lambda p: jnp.sum(ref(p) * mask[:, start:])))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=0), g_ours, g_ref)
    logp, entropy = jax.jit(
        lambda p: completion_logprobs(
            nnx.merge(graphdef, p), tokens, mask, start=start, chunk_size=4, with_entropy=True
        )
    )(params)
    ref_entropy = jax.jit(
        lambda p: core_logprobs.token_entropy(
            nnx.merge(graphdef, p)(tokens, mask)[:, start - 1 : -1]
        )
    )(params)
    np.testing.assert_allclose(entropy, ref_entropy, atol=1e-5)
    assert logp.shape == entropy.shape


def test_chunked_backward_never_holds_full_logits(lm):
    b, n, v = 4, 512, CONFIG.vocab_size
    h = jnp.zeros((b, n, CONFIG.hidden_size))
    y = jnp.zeros((b, n), jnp.int32)
    full_logits_bytes = b * n * v * 4

    def temp_bytes(chunk_size):
        loss = lambda h: jnp.sum(hidden_logprobs(lm, h, y, chunk_size=chunk_size))
        compiled = jax.jit(jax.grad(loss)).lower(h).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp_bytes(None) >= full_logits_bytes
    assert temp_bytes(32) < full_logits_bytes / 4


def test_chunks_shrink_with_the_batch_to_bound_the_logit_rows(lm, monkeypatch):
    """``B * chunk <= MAX_CHUNK_ROWS``: a wide batch gets shorter chunks, same numbers."""
    from jaxrl_llm.models import logprobs as lp

    b, n = 8, 12
    rng = np.random.RandomState(3)
    h = jnp.asarray(rng.standard_normal((b, n, CONFIG.hidden_size)), jnp.float32)
    y = jnp.asarray(rng.randint(0, CONFIG.vocab_size, (b, n)), jnp.int32)
    whole = hidden_logprobs(lm, h, y, chunk_size=None)
    real_scan, chunk_shapes = jax.lax.scan, []

    def recording_scan(f, init, xs):
        chunk_shapes.append(xs[1].shape)  # targets: [chunks, B, chunk]
        return real_scan(f, init, xs)

    monkeypatch.setattr(lp, "MAX_CHUNK_ROWS", 2 * b)  # two steps per chunk, not 12
    monkeypatch.setattr(lp.jax.lax, "scan", recording_scan)
    chunked = hidden_logprobs(lm, h, y, chunk_size=256)
    assert chunk_shapes == [(n // 2, b, 2)]
    np.testing.assert_allclose(chunked, whole, atol=1e-5)
