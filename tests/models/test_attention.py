"""attention.py: segment masks, kernels against the reference, packed rows == separate rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import models
from jaxrl_llm.models import attention as attn
from jaxrl_llm.models.transformer import segment_positions

# Three sequences of lengths 5, 3 and 4 packed into a row of 14 (two padding slots at the end).
LENGTHS = (5, 3, 4)
WIDTH = 14


def _segment_ids(lengths: tuple[int, ...] = LENGTHS, width: int = WIDTH) -> np.ndarray:
    ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])
    return np.pad(ids, (0, width - len(ids))).astype(np.int32)[None]


def _qkv(key: jax.Array, b: int, t: int, h: int, k: int, d: int) -> tuple[jax.Array, ...]:
    kq, kk, kv = jax.random.split(key, 3)
    return (
        jax.random.normal(kq, (b, t, h, d)),
        jax.random.normal(kk, (b, t, k, d)),
        jax.random.normal(kv, (b, t, k, d)),
    )


def _naive_attention(q_thd, k_skd, v_skd, window):
    """One sequence, loops over heads: softmax(q k^T / sqrt(d)) v, causal (and windowed)."""
    t, h, d = q_thd.shape
    g = h // k_skd.shape[1]
    out = np.zeros((t, h, d))
    for head in range(h):
        scores = q_thd[:, head] @ k_skd[:, head // g].T / np.sqrt(d)
        i, j = np.meshgrid(np.arange(t), np.arange(t), indexing="ij")
        allowed = (j <= i) & ((i - j) < (window or 10**9))
        scores = np.where(allowed, scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[:, head] = (p / p.sum(-1, keepdims=True)) @ v_skd[:, head // g]
    return out


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_reference_segments_equal_separate_sequences(window, heads):
    h, k = heads
    seg_bt = _segment_ids()
    q, kk, v = _qkv(jax.random.key(0), 1, WIDTH, h, k, 8)
    out = attn.attention(
        q, kk, v, segment_ids_bt=jnp.asarray(seg_bt), window=window, implementation="reference"
    )
    start = 0
    for n in LENGTHS:
        sl = slice(start, start + n)
        want = _naive_attention(
            np.asarray(q[0, sl]), np.asarray(kk[0, sl]), np.asarray(v[0, sl]), window
        )
        np.testing.assert_allclose(np.asarray(out[0, sl]), want, rtol=1e-5, atol=1e-5)
        start += n


def test_segment_positions_restart_per_segment():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1]], jnp.int32)
    want = [[0, 1, 2, 0, 1, 0, 0, 0], [0, 0, 0, 1, 2, 3, 4, 5]]
    np.testing.assert_array_equal(np.asarray(segment_positions(seg)), want)


def _tiny(**overrides) -> models.CausalLM:
    config = models.tiny_random_config(vocab_size=97, **overrides)
    return models.CausalLM(config, rngs=nnx.Rngs(0))


TINY_CONFIGS = {
    "llama_gqa": dict(),
    "llama_mha": dict(num_kv_heads=4),
    "mistral_window": dict(model_type="mistral", sliding_windows=(3, 3)),
    "qwen2_mixed_window": dict(
        model_type="qwen2", qkv_bias=True, sliding_windows=(None, 2), tie_word_embeddings=False
    ),
}


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_causal_lm_packed_row_equals_separate_rows(name):
    model = _tiny(**TINY_CONFIGS[name])
    seg_bt = _segment_ids()
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (1, WIDTH), 3, 97), np.int32)
    tokens = np.where(seg_bt > 0, tokens, 0)
    packed = model(
        jnp.asarray(tokens),
        jnp.asarray(seg_bt > 0),
        positions_bt=segment_positions(jnp.asarray(seg_bt)),
        segment_ids_bt=jnp.asarray(seg_bt),
    )
    # The default positions (restarting per segment) give the same logits.
    packed_default = model(jnp.asarray(tokens), segment_ids_bt=jnp.asarray(seg_bt))
    np.testing.assert_array_equal(np.asarray(packed), np.asarray(packed_default))
    start = 0
    for n in LENGTHS:
        alone = model(jnp.asarray(tokens[:, start : start + n]))
        got = packed[:, start : start + n]
        np.testing.assert_allclose(np.asarray(got), np.asarray(alone), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            np.asarray(jax.nn.log_softmax(got)),
            np.asarray(jax.nn.log_softmax(alone)),
            rtol=1e-5,
            atol=1e-5,
        )
        start += n


def test_unpacked_call_is_unchanged_by_all_ones_segments():
    """One segment per row (with left padding as segment 0) is the plain masked call, bitwise."""
    model = _tiny()
    mask = jnp.asarray([[False, False, True, True, True, True], [True] * 6])
    tokens = jnp.where(mask, jnp.arange(6)[None] + 5, 0).astype(jnp.int32)
    plain = model(tokens, mask)
    seg = model(tokens, mask, segment_ids_bt=mask.astype(jnp.int32))
    np.testing.assert_array_equal(np.asarray(plain)[mask], np.asarray(seg)[mask])


def test_segment_ids_with_cache_is_an_error():
    model = _tiny()
    tokens = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="KV cache"):
        model(tokens, segment_ids_bt=jnp.ones((1, 4), jnp.int32), cache=model.init_cache(1, 8))
    with pytest.raises(ValueError, match="segment_ids_bt has shape"):
        model(tokens, segment_ids_bt=jnp.ones((1, 3), jnp.int32))
    with pytest.raises(TypeError, match="int32"):
        model(tokens, segment_ids_bt=jnp.ones((1, 4), jnp.float32))
