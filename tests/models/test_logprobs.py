"""Model-level log-probs: equal to core.token_logprobs on full logits, with far less memory."""

import jax
import jax.extend
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


def test_larger_blocks_lengthen_the_chunks_of_few_rows(monkeypatch):
    """Blocks of 4x the CPU's rows: one wide row (packed) gets 4x longer chunks, two rows
    share a block (the time chunk halves); the numbers are the unchunked pass's. (The H200's
    packed 1B update had run 256-row blocks: one row times the 256-step chunk.)"""
    from jaxrl_llm.models import logprobs as lp

    monkeypatch.setattr(lp, "MAX_CHUNK_ROWS", 4)  # the CPU's block, scaled down
    model = models.CausalLM(CONFIG.replace(logits_block_rows=16), rngs=nnx.Rngs(0))
    real_scan, chunk_shapes = jax.lax.scan, []

    def recording_scan(f, init, xs):
        chunk_shapes.append(xs[1].shape)  # targets: [chunks, B, chunk]
        return real_scan(f, init, xs)

    monkeypatch.setattr(lp.jax.lax, "scan", recording_scan)
    rng = np.random.RandomState(5)
    for b, expected in ((1, (3, 1, 16)), (2, (5, 2, 8))):  # 40 steps: 16 x 3, 8 x 5
        h = jnp.asarray(rng.standard_normal((b, 40, CONFIG.hidden_size)), jnp.float32)
        y = jnp.asarray(rng.randint(0, CONFIG.vocab_size, (b, 40)), jnp.int32)
        chunked = hidden_logprobs(model, h, y, chunk_size=4)
        assert chunk_shapes.pop() == expected
        whole = hidden_logprobs(model, h, y, chunk_size=None)
        np.testing.assert_allclose(chunked, whole, atol=1e-5)


def test_block_rows_default_by_platform_and_the_config_overrides_it(lm, monkeypatch):
    """256 rows on CPU; on an accelerator the multiples of 256 rows within 512 MiB of float32
    logits (Llama-3's 128,256 tokens: 1,024 rows; SmolLM2's 49,152: 2,560); never fewer than
    256. ``ModelConfig.logits_block_rows`` overrides the platform's default."""
    from jaxrl_llm.models import logprobs as lp

    assert lp.block_rows(128_256, accelerator=False) == 256
    assert lp.block_rows(128_256, accelerator=True) == 1024
    assert lp.block_rows(49_152, accelerator=True) == 2560
    assert lp.block_rows(4_000_000, accelerator=True) == 256
    assert lp.model_block_rows(lm) == 256  # this suite runs on CPU
    monkeypatch.setattr(lp.jax, "default_backend", lambda: "gpu")
    assert lp.model_block_rows(lm) == 262_144  # 512 MiB of float32 rows of V = 512 logits
    pinned = models.CausalLM(CONFIG.replace(logits_block_rows=16), rngs=nnx.Rngs(0))
    assert lp.model_block_rows(pinned) == 16
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="logits_block_rows must be a positive int or None"):
            CONFIG.replace(logits_block_rows=bad)


def _converts_in_loops(jaxpr, shape, in_loop=False):
    """``(in a loop, not in one)`` counts of float32 -> bf16 casts of an array of ``shape``."""
    inside = outside = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type":
            x, to = eqn.invars[0].aval, eqn.params["new_dtype"]
            cast = (x.shape, x.dtype, to) == (shape, jnp.float32, jnp.bfloat16)
            inside, outside = inside + (cast and in_loop), outside + (cast and not in_loop)
        loop = in_loop or eqn.primitive.name in ("scan", "while")
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            i, o = _converts_in_loops(sub, shape, loop)
            inside, outside = inside + i, outside + o
    return inside, outside


@pytest.mark.parametrize("tied", [True, False])
def test_a_bf16_head_is_cast_once_before_the_chunk_loop(tied):
    """bf16 states: the float32 head is cast to bf16 once, outside the chunks' scan, forward and
    backward (an H200 profile found it cast in every chunk and every rematerialised backward
    chunk); the numbers and the float32 gradient are the unchunked pass's."""
    cfg = CONFIG.replace(dtype="bfloat16", tie_word_embeddings=tied, logits_block_rows=8)
    graphdef, params = nnx.split(models.CausalLM(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.RandomState(4)
    h = jnp.asarray(rng.standard_normal((4, 10, cfg.hidden_size)), jnp.bfloat16)
    y = jnp.asarray(rng.randint(0, cfg.vocab_size, (4, 10)), jnp.int32)
    weights = jnp.arange(10.0)[None, :]

    def loss(p, chunk_size):
        out = hidden_logprobs(nnx.merge(graphdef, p), h, y, chunk_size=chunk_size)
        return jnp.sum(out * weights)

    grad = jax.grad(loss)
    jaxpr = jax.make_jaxpr(grad, static_argnums=1)(params, 256).jaxpr
    head = (cfg.vocab_size, cfg.hidden_size)
    assert _converts_in_loops(jaxpr, head) == (0, 1)  # 5 chunks of 2 steps, one cast
    chunked, whole = jax.jit(grad, static_argnums=1)(params, 256), grad(params, None)
    for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(whole), strict=True):
        assert a.dtype == jnp.float32  # the master's gradient, unrounded
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(b))))
