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


@pytest.mark.parametrize("causal", [True, False])
def test_query_blocks_equal_the_whole_softmax_values_and_gradients(causal):
    """Blocks of 4 queries over a row of 14 (three packed sequences, a window of 5 in one
    case), each rematerialised and, causal, reading only the keys up to its end: the same
    outputs and q/k/v gradients as the unblocked reference."""
    q, k, v = _qkv(jax.random.key(3), 2, WIDTH, 4, 2, 8)
    seg = jnp.asarray(np.concatenate([_segment_ids(), _segment_ids((14,))]))
    window = 5 if causal else None
    allowed = attn.attention_mask(WIDTH, WIDTH, window=window, segment_ids_bt=seg)
    if not causal:  # a mask that reads later keys too: segments only
        allowed = attn.segment_mask(seg)
    cotangent = jax.random.normal(jax.random.key(4), q.shape)

    def loss(q, k, v, block):
        out = attn.reference_attention(q, k, v, allowed, causal=causal, query_block=block)
        return jnp.sum(out * cotangent), out

    (_, whole), g_whole = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v, None)
    blocked_fn = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True), static_argnums=3)
    (_, blocked), g_blocked = blocked_fn(q, k, v, 4)
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(whole), rtol=1e-5, atol=1e-6)
    for a, b in zip(g_blocked, g_whole, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    # Four blocks: 4 + 4 + 4 + 2 queries; causal blocks read 4, 8, 12 and 14 keys.
    hlo = blocked_fn.lower(q, k, v, 4).as_text()
    widths = (4, 8, 12, 14) if causal else (14,)
    for s in widths:
        assert f"tensor<2x2x4x2x{s}xf32>" in hlo or f"tensor<2x2x2x2x{s}xf32>" in hlo, s
    assert "tensor<2x2x14x2x14xf32>" not in hlo  # no whole [T, S] score block


def test_query_blocks_only_from_twice_the_block_and_causal_needs_self_attention():
    q, k, v = _qkv(jax.random.key(5), 1, 7, 2, 2, 4)
    allowed = attn.attention_mask(7, 7)
    whole = attn.reference_attention(q, k, v, allowed)
    same = attn.reference_attention(q, k, v, allowed, causal=True, query_block=4)  # 7 < 2 * 4
    np.testing.assert_array_equal(np.asarray(same), np.asarray(whole))
    with pytest.raises(ValueError, match="causal query blocks need as many keys as queries"):
        attn.reference_attention(
            q, k[:, :6], v[:, :6], allowed[:, :, :6], causal=True, query_block=2
        )


def test_segment_positions_restart_per_segment():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [0, 0, 1, 1, 1, 1, 1, 1]], jnp.int32)
    want = [[0, 1, 2, 0, 1, 0, 0, 0], [0, 0, 0, 1, 2, 3, 4, 5]]
    np.testing.assert_array_equal(np.asarray(segment_positions(seg)), want)


def _tiny(**overrides) -> models.CausalLM:
    config = models.tiny_random_config(vocab_size=97, **overrides)
    return models.CausalLM(config, rngs=nnx.Rngs(0))


TINY_CONFIGS = {
    "llama_gqa": dict(),
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


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_causal_lm_query_blocks_equal_whole_rows(name, monkeypatch):
    """The model's cache-free forward passes run the reference attention in query blocks
    (``attention.QUERY_BLOCK``): blocks of 4 over a packed row of 14 give the logits and
    parameter gradients of the whole-row softmax (windows and remat included)."""
    seg_bt = jnp.asarray(_segment_ids())
    tokens = jnp.where(seg_bt > 0, jax.random.randint(jax.random.key(2), (1, WIDTH), 3, 97), 0)

    def run(block: int):
        monkeypatch.setattr(attn, "QUERY_BLOCK", block)
        model = _tiny(**TINY_CONFIGS[name], remat="full")
        graphdef, params = nnx.split(model)

        def loss(params):
            logits = nnx.merge(graphdef, params)(tokens, segment_ids_bt=seg_bt)
            return jnp.sum(jax.nn.log_softmax(logits)[..., 5] * (seg_bt > 0)), logits

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (_, whole), g_whole = run(10**6)
    (_, blocked), g_blocked = run(4)
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(whole), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g_blocked), jax.tree.leaves(g_whole), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


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


def _packed_segments(t: int = 256) -> jnp.ndarray:
    """Two rows of width ``t``: three segments plus tail padding, and one full-width segment."""
    seg = np.zeros((2, t), np.int32)
    seg[0, :100], seg[0, 100:180], seg[0, 180 : t - 6] = 1, 2, 3
    seg[1] = 1
    return jnp.asarray(seg)


KERNEL_CASES = [
    dict(window=None, heads=(4, 2), segments=True),
    dict(window=17, heads=(4, 1), segments=True),
    dict(window=None, heads=(2, 2), segments=False),  # key-validity mask only
]


def _kernel_inputs(case: dict, t: int = 256) -> tuple[tuple[jax.Array, ...], dict, np.ndarray]:
    h, k = case["heads"]
    q, kk, v = _qkv(jax.random.key(2), 2, t, h, k, 32)
    seg = _packed_segments(t)
    if case["segments"]:
        masks = dict(segment_ids_bt=seg, window=case["window"])
    else:
        masks = dict(kv_mask_bs=seg != 0, window=case["window"])
    return (q, kk, v), masks, np.asarray(seg != 0)


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: str(tuple(c.values())))
def test_splash_interpret_equals_reference(case):
    qkv, masks, real = _kernel_inputs(case)
    ref = attn.attention(*qkv, implementation="reference", **masks)
    out = attn.splash_attention(*qkv, interpret=True, **masks)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=2e-6, rtol=1e-5)


def test_splash_interpret_gradients_equal_reference():
    qkv, masks, real = _kernel_inputs(KERNEL_CASES[1])
    weight = jnp.asarray(real, jnp.float32)[:, :, None, None]

    def loss(impl):
        return lambda *qkv: jnp.sum(weight * attn.attention(*qkv, implementation=impl, **masks))

    grads = jax.grad(loss("splash"), argnums=(0, 1, 2))(*qkv)
    want = jax.grad(loss("reference"), argnums=(0, 1, 2))(*qkv)
    for g, w in zip(grads, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: str(tuple(c.values())))
def test_cudnn_call_in_xla_form_equals_reference(case):
    """The exact jax.nn.dot_product_attention call of the cudnn path, run by XLA on CPU."""
    qkv, masks, real = _kernel_inputs(case, t=32)
    ref = attn.attention(*qkv, implementation="reference", **masks)
    out = attn.cudnn_attention(*qkv, implementation="xla", **masks)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=2e-6, rtol=1e-5)


PALLAS_GPU_CASES = [
    dict(heads=(4, 2), mask="segments"),  # packed rows, GQA
    dict(heads=(2, 2), mask="tail"),  # key validity only: tail padding
    dict(heads=(4, 1), mask="left"),  # key validity only: left-padded rows, as unpacked rows
]


def _short_segments() -> jnp.ndarray:
    """Two rows of 64: three segments and 6 tail pads; 10 left pads and one segment."""
    seg = np.zeros((2, 64), np.int32)
    seg[0, :20], seg[0, 20:40], seg[0, 40:58] = 1, 2, 3
    seg[1, 10:] = 1
    return jnp.asarray(seg)


def _pallas_gpu_inputs(case: dict) -> tuple[tuple[jax.Array, ...], dict, np.ndarray]:
    h, k = case["heads"]
    qkv = _qkv(jax.random.key(5), 2, 64, h, k, 16)
    seg = _short_segments()
    if case["mask"] == "segments":
        return qkv, dict(segment_ids_bt=seg), np.asarray(seg != 0)
    valid = np.asarray(seg != 0)
    if case["mask"] == "left":
        valid = valid[:, ::-1].copy()
    return qkv, dict(kv_mask_bs=jnp.asarray(valid)), valid


@pytest.mark.parametrize("case", PALLAS_GPU_CASES, ids=lambda c: f"{c['heads']}-{c['mask']}")
def test_pallas_gpu_interpret_equals_reference_values_and_gradients(case):
    """jax's Pallas/Triton flash attention (interpret mode) with our O(T) id mask: the
    reference's outputs on real tokens, and its q/k/v gradients (GQA's repeated heads summed)."""
    qkv, masks, real = _pallas_gpu_inputs(case)
    weight = jnp.asarray(real, jnp.float32)[:, :, None, None]

    def loss(impl):
        return lambda *qkv: jnp.sum(weight * attn.attention(*qkv, implementation=impl, **masks))

    out = attn.attention(*qkv, implementation="pallas_gpu", **masks)
    ref = attn.attention(*qkv, implementation="reference", **masks)
    assert bool(jnp.all(jnp.isfinite(out)))  # padding queries too: they read padding keys
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=2e-6, rtol=1e-5)
    grads = jax.grad(loss("pallas_gpu"), argnums=(0, 1, 2))(*qkv)
    want = jax.grad(loss("reference"), argnums=(0, 1, 2))(*qkv)
    for g, w in zip(grads, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-4)


def test_pallas_gpu_requirements_are_clear_errors():
    q = jnp.zeros((1, 24, 2, 16), jnp.float32)
    assert "multiple of 16" in attn.kernel_problem("pallas_gpu", q, q)
    q32 = jnp.zeros((1, 32, 2, 8), jnp.float32)
    assert "head_dim >= 16" in attn.kernel_problem("pallas_gpu", q32, q32)
    q32 = jnp.zeros((1, 32, 2, 16), jnp.float32)
    assert "sliding window" in attn.kernel_problem("pallas_gpu", q32, q32, window=4)
    assert attn.kernel_problem("pallas_gpu", q32, q32) is None
    with pytest.raises(ValueError, match=r"multiple of 16.*model.attention: reference"):
        attn.attention(q, q, q, implementation="pallas_gpu")
    seg = jnp.ones((1, 32), jnp.int32)
    with pytest.raises(ValueError, match="one segment id per token"):
        attn.attention(
            q32,
            q32,
            q32,
            implementation="pallas_gpu",
            segment_ids_bt=seg,
            kv_segment_ids_bs=seg + 0,
        )
    # "auto" falls back to the reference where the kernel cannot run; pallas_gpu is never auto
    assert attn.resolve_implementation("auto", backend="gpu") == "cudnn"


@pytest.mark.parametrize("rows", ["packed", "left-padded"])
def test_causal_lm_pallas_gpu_equals_reference(rows):
    """The whole tiny model (GQA 4:2) with the Pallas GPU kernel in interpret mode: packed rows
    (segment ids) and left-padded rows (the unpacked trainer's mask)."""
    model = _tiny()
    seg = _short_segments()
    tokens = jax.random.randint(jax.random.key(3), seg.shape, 3, 97)
    if rows == "packed":
        kw = dict(segment_ids_bt=seg)
        real = np.asarray(seg != 0)
    else:
        real = np.asarray(seg != 0)[:, ::-1].copy()
        kw = dict(mask_bt=jnp.asarray(real))
    ref = model(tokens, attention_impl="reference", **kw)
    out = model(tokens, attention_impl="pallas_gpu", **kw)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=1e-5, rtol=1e-5)


def test_causal_lm_splash_equals_reference():
    """The whole tiny model (GQA, a window on one layer) with splash in interpret mode."""
    model = _tiny(model_type="qwen2", qkv_bias=True, sliding_windows=(None, 5))
    seg = _packed_segments(128)
    seg = seg.at[0, 100:].set(jnp.where(seg[0, 100:] != 0, 2, 0))
    tokens = jax.random.randint(jax.random.key(3), seg.shape, 3, 97)
    ref = model(tokens, segment_ids_bt=seg, attention_impl="reference")
    out = model(tokens, segment_ids_bt=seg, attention_impl="splash")
    real = np.asarray(seg != 0)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=1e-5, rtol=1e-5)


def test_auto_picks_by_backend_and_falls_back():
    assert attn.resolve_implementation("auto") == "reference"  # CPU
    assert attn.resolve_implementation("auto", backend="tpu") == "splash"
    assert attn.resolve_implementation("auto", backend="gpu") == "cudnn"
    assert attn.resolve_implementation("splash", backend="cpu") == "splash"
    q = jnp.zeros((1, 8, 2, 8), jnp.float32)
    # float32 / T=8 suit neither kernel: "auto" would fall back; the problems are named.
    assert "float16/bfloat16" in attn.kernel_problem("cudnn", q, q)
    assert "multiple of 128" in attn.kernel_problem("splash", q, q)
    assert attn.kernel_problem("reference", q, q) is None


def test_for_platform_resolves_auto_for_the_platform_traced_for():
    """``for_platform`` (what ``jaxrl-llm plan`` lowers a TPU step under): ``auto`` is that
    platform's kernel and splash is not interpreted inside the block; this machine's outside,
    nested blocks restore the outer one, and a ``backend=`` argument still wins."""
    from jaxrl_llm.models import logprobs

    lm = models.CausalLM(models.tiny_random_config(), rngs=nnx.Rngs(0))
    assert attn.trace_platform() == "cpu" and attn.resolve_implementation("auto") == "reference"
    with attn.for_platform("tpu"):
        assert attn.trace_platform() == "tpu"
        assert attn.resolve_implementation("auto") == "splash"
        assert attn.resolve_implementation("auto", backend="gpu") == "cudnn"
        assert logprobs.model_block_rows(lm) > logprobs.MAX_CHUNK_ROWS  # an accelerator's
        with attn.for_platform("gpu"):
            assert attn.resolve_implementation("auto") == "cudnn"
        with attn.for_platform(None):  # no change
            assert attn.resolve_implementation("auto") == "splash"
        assert attn.trace_platform() == "tpu"
    assert attn.resolve_implementation("auto") == "reference"
    assert logprobs.model_block_rows(lm) == logprobs.MAX_CHUNK_ROWS
    with (
        pytest.raises(ValueError, match="platform must be cpu, gpu or tpu, got 'cuda'"),
        attn.for_platform("cuda"),
    ):
        pass
    assert attn.trace_platform() == "cpu"


def test_bad_arguments_are_clear_errors():
    q = jnp.zeros((1, 8, 4, 8))
    kv = jnp.zeros((1, 8, 2, 8))
    with pytest.raises(ValueError, match="must be one of"):
        attn.attention(q, kv, kv, implementation="flash")
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attn.attention(q, jnp.zeros((1, 8, 3, 8)), jnp.zeros((1, 8, 3, 8)))
    with pytest.raises(ValueError, match="segment_ids_bt has shape"):
        attn.attention(q, kv, kv, segment_ids_bt=jnp.ones((1, 7), jnp.int32))
    with pytest.raises(TypeError, match="kv_mask_bs must be boolean"):
        attn.attention(q, kv, kv, kv_mask_bs=jnp.ones((1, 8), jnp.int32))
    with pytest.raises(ValueError, match=r"multiple of 128.*reference"):
        attn.attention(q, kv, kv, implementation="splash")
    with pytest.raises(ValueError, match=r"float16/bfloat16.*reference"):
        attn.attention(q, kv, kv, implementation="cudnn")
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        models.tiny_random_config(vocab_size=97, attention_impl="flash")
    with pytest.raises(ValueError, match=r"multiple of 128.*attention_impl='reference'"):
        _tiny()(jnp.ones((1, 8), jnp.int32), attention_impl="splash")


def test_config_knob_reaches_the_model():
    from jaxrl_llm.config import TrainConfig
    from jaxrl_llm.train import models as train_models

    assert TrainConfig().model.attention == "auto"
    lm = train_models.load_policy("tiny-random", attention="reference")
    assert lm.config.attention_impl == lm.model.config.attention_impl == "reference"


@pytest.mark.parametrize("impl", ["splash", "pallas_gpu"])
def test_pallas_kernel_under_a_mesh_runs_per_shard_and_equals_reference(impl):
    """On a (data 2, fsdp 2, tensor 2) mesh of fake CPU devices the kernel runs in shard_map
    (batch over data x fsdp, whole GQA groups over tensor): same logits as one device."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxrl_llm.models import sharding

    model = _tiny()  # 4 query heads, 2 kv heads
    seg = jnp.concatenate([_packed_segments(128)] * 2)  # [4, 128]
    tokens = jax.random.randint(jax.random.key(4), seg.shape, 3, 97)
    ref = model(tokens, segment_ids_bt=seg, attention_impl="reference")
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    p_sh = sharding.param_shardings(nnx.state(model, nnx.Param), mesh, sharding.DEFAULT_RULES)
    x_sh = sharding.batch_sharding(mesh, 2, sharding.DEFAULT_RULES)
    with jax.set_mesh(mesh):
        out = jax.jit(
            lambda p, x, s: nnx.merge(graphdef, p)(x, segment_ids_bt=s, attention_impl=impl),
            in_shardings=(p_sh, x_sh, x_sh),
            out_shardings=NamedSharding(mesh, PartitionSpec(("data", "fsdp"))),
        )(jax.device_put(params, p_sh), tokens, seg)
    real = np.asarray(seg != 0)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=1e-5, rtol=1e-5)


def test_auto_on_a_gpu_without_cudnn_falls_back_to_reference(monkeypatch):
    """ "auto" on a GPU backend picks cudnn; where cuDNN cannot build (here: none installed)
    it uses the reference, while an explicit "cudnn" is a clear error."""
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(jax.random.key(5), 1, 8, 2, 1, 16))
    want = attn.attention(q, k, v, implementation="reference")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert attn.resolve_implementation("auto") == "cudnn"
    if attn.kernel_problem("cudnn", q, k) is None:
        try:
            attn.attention(q, k, v, implementation="cudnn")
        except ValueError as e:
            assert "reference" in str(e)
        else:
            pytest.skip("cuDNN is usable here")
    got = attn.attention(q, k, v, implementation="auto")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
