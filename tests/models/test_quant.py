"""QLoRA base quantisation (models/quant.py): error bounds, exact grids, packing, layer slices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import models
from jaxrl_llm.models import quant
from jaxrl_llm.models import sharding as shd

MODES = quant.QUANT_MODES

# bitsandbytes' NF4 table, copied from bitsandbytes/functional.py, get_4bit_type("nf4")
# (bitsandbytes-foundation/bitsandbytes @ 95f9af3, Aug 2026; the same values as csrc/kernels.cu's
# dDequantizeNF4 and the QLoRA paper's appendix, arXiv:2305.14314).
BITSANDBYTES_NF4 = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
]

# x @ dequantize(quantize(w)) vs x @ w, relative Frobenius error, w ~ 0.02 N(0, 1) [256, 96],
# default block 64. Measured over 5 seeds: int8 0.58-0.60%, nf4 9.09-9.24%, int4 10.67-11.02%.
MATMUL_REL_ERROR_BOUND = {"int8": 0.01, "nf4": 0.11, "int4": 0.13}


def _reference_quantize(w_kn, mode, block_size):
    """Slow, obvious numpy reference: per (block, column) absmax, nearest level by argmin."""
    k, n = w_kn.shape
    w = np.asarray(w_kn, np.float64)
    codes = np.zeros((k, n), np.int64)
    scales = np.zeros((k // block_size, n), np.float64)
    for b in range(k // block_size):
        for j in range(n):
            block = w[b * block_size : (b + 1) * block_size, j]
            absmax = np.max(np.abs(block))
            if mode == "nf4":
                scale, levels = absmax, np.asarray(BITSANDBYTES_NF4)
                offset = 0
            else:
                q_max = 127 if mode == "int8" else 7
                scale, levels = absmax / q_max, np.arange(-q_max, q_max + 1)
                offset = -q_max if mode == "int8" else 1  # int4 stores c + 8, c in [-7, 7]
            x = block / scale if scale > 0 else block
            idx = np.argmin(np.abs(x[:, None] - levels[None, :]), axis=1)
            codes[b * block_size : (b + 1) * block_size, j] = idx + offset
            scales[b, j] = scale
    return codes, scales


def _reference_pack(codes_kn):
    """Row 2i in the low nibble, row 2i + 1 in the high one, one element at a time."""
    k, n = codes_kn.shape
    out = np.zeros((k // 2, n), np.uint8)
    for i in range(k // 2):
        for j in range(n):
            out[i, j] = int(codes_kn[2 * i, j]) + 16 * int(codes_kn[2 * i + 1, j])
    return out


def _error_bound(w_kn, mode, block_size):
    """Per-element bound on |w - ŵ|: half a step of the block's grid."""
    k, n = w_kn.shape[-2:]
    w = np.asarray(w_kn, np.float32)
    blocks = w.reshape(*w.shape[:-2], k // block_size, block_size, n)
    absmax = np.max(np.abs(blocks), axis=-2, keepdims=True)
    half_step = {"int8": 0.5 / 127, "int4": 0.5 / 7, "nf4": quant.NF4_MAX_HALF_GAP}[mode]
    return np.broadcast_to(absmax * half_step, blocks.shape).reshape(w.shape)


def _weights(shape, seed=0, dtype=np.float32):
    return (0.02 * np.random.default_rng(seed).standard_normal(shape)).astype(dtype)


def test_nf4_levels_are_bitsandbytes():
    levels = quant.NF4_LEVELS
    assert levels.shape == (16,) and levels.dtype == np.float32
    np.testing.assert_array_equal(levels, np.asarray(BITSANDBYTES_NF4, np.float32))
    assert np.all(np.diff(levels) > 0)
    assert levels[0] == -1.0 and levels[-1] == 1.0 and 0.0 in levels
    assert pytest.approx((1.0 - 0.6961928009986877) / 2) == quant.NF4_MAX_HALF_GAP


@pytest.mark.parametrize("mode", MODES)
def test_matches_slow_reference(mode):
    w = _weights((128, 6), seed=1)
    q = quant.quantize_kernel(w, mode, block_size=32)
    codes, scales = _reference_quantize(w, mode, 32)
    np.testing.assert_allclose(np.asarray(q.scales), scales, rtol=1e-6)
    assert q.scales.dtype == jnp.float32 and q.scales.shape == (4, 6)
    if mode == "int8":
        assert q.values.dtype == jnp.int8 and q.values.shape == (128, 6)
        np.testing.assert_array_equal(np.asarray(q.values), codes)
    else:
        assert q.values.dtype == jnp.uint8 and q.values.shape == (64, 6)
        np.testing.assert_array_equal(np.asarray(q.values), _reference_pack(codes))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("in_dtype", [np.float32, jnp.bfloat16])
def test_round_trip_within_half_a_step(mode, in_dtype):
    w = _weights((2, 192, 40), seed=2).astype(in_dtype)
    w32 = np.asarray(w, np.float32)
    w_hat = np.asarray(quant.dequantize_kernel(quant.quantize_kernel(w, mode), mode))
    assert w_hat.shape == w.shape and w_hat.dtype == np.float32
    bound = _error_bound(w32, mode, quant.DEFAULT_BLOCK_SIZES[mode])
    err = np.abs(w_hat - w32)
    assert np.all(err <= bound * (1 + 1e-5) + 1e-12), float(np.max(err / bound))
    # The bound is tight-ish: the worst element uses a good part of it.
    assert np.max(err / bound) > 0.5


def _on_grid_kernel(mode, k=128, n=8, block_size=32, seed=3):
    """w = level(code) * s with power-of-2 scales and each block's extreme level present."""
    rng = np.random.default_rng(seed)
    n_blocks = k // block_size
    scale_bn = 2.0 ** rng.integers(-12, -4, (n_blocks, n))
    if mode == "nf4":
        levels = quant.NF4_LEVELS[rng.integers(0, 16, (k, n))].astype(np.float64)
        extreme = 1.0
    else:
        q_max = 127 if mode == "int8" else 7
        levels = rng.integers(-q_max, q_max + 1, (k, n)).astype(np.float64)
        extreme = float(q_max)
    levels[::block_size] = extreme * rng.choice([-1, 1], (n_blocks, n))
    scale_kn = np.repeat(scale_bn, block_size, axis=0)
    return (levels * scale_kn).astype(np.float32)


@pytest.mark.parametrize("mode", MODES)
def test_exact_on_the_grid(mode):
    w = _on_grid_kernel(mode)
    w_hat = quant.dequantize_kernel(quant.quantize_kernel(w, mode, block_size=32), mode)
    np.testing.assert_array_equal(np.asarray(w_hat), w)


@pytest.mark.parametrize("mode", MODES)
def test_zero_block_is_exact_zero(mode):
    w = _weights((128, 4), seed=4)
    w[64:, 1] = 0.0
    q = quant.quantize_kernel(w, mode)
    assert float(q.scales[1, 1]) == 0.0
    w_hat = np.asarray(quant.dequantize_kernel(q, mode))
    assert np.all(np.isfinite(w_hat))
    np.testing.assert_array_equal(w_hat[64:, 1], 0.0)


def test_packing_is_a_bijection():
    rng = np.random.default_rng(5)
    codes = jnp.asarray(rng.integers(0, 16, (3, 10, 7)), jnp.uint8)
    packed = quant.pack_nibbles(codes)
    assert packed.shape == (3, 5, 7) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(quant.unpack_nibbles(packed)), np.asarray(codes))
    np.testing.assert_array_equal(np.asarray(packed[1]), _reference_pack(np.asarray(codes[1])))
    every_byte = jnp.arange(256, dtype=jnp.uint8).reshape(128, 2)
    np.testing.assert_array_equal(
        np.asarray(quant.pack_nibbles(quant.unpack_nibbles(every_byte))), np.asarray(every_byte)
    )


@pytest.mark.parametrize("mode", MODES)
def test_layer_slice_is_the_layer_quantised_alone(mode):
    w_lkn = _weights((3, 128, 24), seed=6)
    q = quant.quantize_kernel(w_lkn, mode)
    stacked_hat = np.asarray(quant.dequantize_kernel(q, mode))
    for layer in range(3):
        q_l = jax.tree.map(lambda x, layer=layer: x[layer], q)
        assert isinstance(q_l, quant.QuantizedKernel)
        alone = quant.quantize_kernel(w_lkn[layer], mode)
        jax.tree.map(np.testing.assert_array_equal, q_l, alone)
        np.testing.assert_array_equal(
            np.asarray(quant.dequantize_kernel(q_l, mode)), stacked_hat[layer]
        )


@pytest.mark.parametrize("mode", MODES)
def test_matmul_error_below_bound(mode):
    w = _weights((256, 96), seed=0)
    x = np.random.default_rng(10).standard_normal((32, 256)).astype(np.float32)
    w_hat = np.asarray(quant.dequantize_kernel(quant.quantize_kernel(w, mode), mode))
    y, y_hat = x @ w, x @ w_hat
    rel = np.linalg.norm(y_hat - y) / np.linalg.norm(y)
    assert rel < MATMUL_REL_ERROR_BOUND[mode], rel
    assert rel > MATMUL_REL_ERROR_BOUND[mode] / 3  # it does quantise


def test_nf4_beats_int4_on_normal_weights():
    """QLoRA's point: for normally distributed weights NF4's levels lose less than int4's."""
    w = _weights((512, 64), seed=7)

    def error(mode):
        w_hat = quant.dequantize_kernel(quant.quantize_kernel(w, mode), mode)
        return float(np.linalg.norm(np.asarray(w_hat) - w))

    assert error("nf4") < 0.95 * error("int4")
    assert error("int8") < 0.1 * error("nf4")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_jit_and_vmap_match_eager(mode, out_dtype):
    w_lkn = _weights((2, 64, 16), seed=8)
    q = quant.quantize_kernel(w_lkn, mode)
    eager = quant.dequantize_kernel(q, mode, dtype=out_dtype)
    assert eager.dtype == out_dtype

    quantize = jax.jit(functools.partial(quant.quantize_kernel, mode=mode))
    dequantize = jax.jit(functools.partial(quant.dequantize_kernel, mode=mode, dtype=out_dtype))
    jax.tree.map(np.testing.assert_array_equal, quantize(w_lkn), q)
    np.testing.assert_array_equal(np.asarray(dequantize(q)), np.asarray(eager))

    vmapped_q = jax.vmap(functools.partial(quant.quantize_kernel, mode=mode))(w_lkn)
    jax.tree.map(np.testing.assert_array_equal, vmapped_q, q)
    vmapped = jax.vmap(functools.partial(quant.dequantize_kernel, mode=mode, dtype=out_dtype))
    np.testing.assert_array_equal(np.asarray(vmapped(q)), np.asarray(eager))
    if out_dtype == jnp.bfloat16:
        f32 = quant.dequantize_kernel(q, mode, dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(eager), np.asarray(f32.astype(jnp.bfloat16)))


@pytest.mark.parametrize("mode", MODES)
def test_quantized_nbytes_counts_the_arrays(mode):
    shape = (2, 128, 48)
    q = quant.quantize_kernel(_weights(shape), mode)
    assert quant.quantized_nbytes(shape, mode) == q.values.nbytes + q.scales.nbytes
    bits_per_weight = 8 * quant.quantized_nbytes(shape, mode) / np.prod(shape)
    assert bits_per_weight == {"int8": 8.5, "nf4": 4.5, "int4": 4.5}[mode]
    assert quant.quantized_nbytes((128, 48), mode, block_size=128) == (
        128 * 48 * (1 if mode == "int8" else 0.5) + 4 * 48
    )


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda w: quant.quantize_kernel(w, "fp8"), r"mode: expected one of"),
        (lambda w: quant.quantize_kernel(w, "nf4", block_size=48), r"block_size: K=128 .*48"),
        (lambda w: quant.quantize_kernel(w, "int8", block_size=0), r"block_size: expected a pos"),
        (lambda w: quant.quantize_kernel(w, "int4", block_size=-64), r"block_size: expected"),
        (lambda w: quant.quantize_kernel(w, "nf4", block_size=2.0), r"block_size: expected"),
        (lambda w: quant.quantize_kernel(w[:127], "nf4", block_size=127), r"K must be even"),
        (lambda w: quant.quantize_kernel(w.astype(np.int32), "int8"), r"w_kn: .*floating"),
        (lambda w: quant.quantize_kernel(w[:, 0], "int8"), r"w_kn: expected .*\[\.\.\., K, N\]"),
        (lambda w: quant.quantized_nbytes((127, 8), "int4", 127), r"shape: .*K must be even"),
        (lambda w: quant.quantized_nbytes((128, 8), "int4", 100), r"block_size: K=128"),
        (lambda w: quant.quantized_nbytes((128, 8), "q4"), r"mode: expected one of"),
    ],
)
def test_bad_inputs_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call(_weights((128, 8)))


def test_bad_quantized_kernel_raises():
    q = quant.quantize_kernel(_weights((128, 8)), "nf4")
    with pytest.raises(ValueError, match=r"q.values: int8 expects dtype int8, got uint8"):
        quant.dequantize_kernel(q, "int8")
    with pytest.raises(ValueError, match=r"block_size: got 32 but q's shapes imply 64"):
        quant.dequantize_kernel(q, "nf4", block_size=32)
    with pytest.raises(ValueError, match=r"q.scales: shape \(2, 7\) does not fit"):
        quant.dequantize_kernel(q._replace(scales=q.scales[:, :7]), "nf4")
    with pytest.raises(ValueError, match=r"mode: expected one of"):
        quant.dequantize_kernel(q, "NF4")


@pytest.mark.parametrize("mode", MODES)
def test_scan_over_stacked_layers_dequantises_each_slice(mode):
    """As in transformer.scan_layers: lax.scan slices the [L] axis of the QuantizedKernel."""
    w_lkk = _weights((3, 64, 64), seed=9)
    x_bk = jnp.asarray(np.random.default_rng(11).standard_normal((4, 64)), jnp.float32)
    q = quant.quantize_kernel(w_lkk, mode)

    def layer(h_bk, q_l):
        return jnp.tanh(h_bk @ quant.dequantize_kernel(q_l, mode)), None

    scanned, _ = jax.jit(lambda x, q: jax.lax.scan(layer, x, q))(x_bk, q)
    w_hat = np.asarray(quant.dequantize_kernel(q, mode))
    h = np.asarray(x_bk)
    for w_l in w_hat:
        h = np.tanh(h @ w_l)
    np.testing.assert_allclose(np.asarray(scanned), h, rtol=1e-5, atol=1e-6)

    # The input's gradient flows through the frozen, dequantised kernel (as LoRA's does).
    grad = jax.grad(lambda x: jnp.sum(jax.lax.scan(layer, x, q)[0]))(x_bk)
    assert grad.shape == x_bk.shape and bool(jnp.all(jnp.isfinite(grad)))


TINY = models.tiny_random_config(vocab_size=256)
# Logits of the 2-layer random tiny model, quantised vs float, relative Frobenius error; measured
# (seed 0): int8 0.64%, nf4 10.1%, int4 15.4%.
MODEL_LOGITS_REL_ERROR_BOUND = {"int8": 0.02, "nf4": 0.15, "int4": 0.22}


def _tokens():
    return jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 12)), jnp.int32)


def _projections(model):
    layers = model.model.layers
    for name in quant.PROJECTIONS:
        parent = (
            layers.self_attn if name in ("q_proj", "k_proj", "v_proj", "o_proj") else layers.mlp
        )
        yield name, getattr(parent, name)


@pytest.mark.parametrize("mode", MODES)
def test_quantize_model_replaces_every_projection(mode):
    model = models.CausalLM(TINY, rngs=nnx.Rngs(0))
    float_kernels = {name: np.asarray(p.kernel[...]) for name, p in _projections(model)}
    float_axes = {name: p.kernel.get_metadata()["logical_axes"] for name, p in _projections(model)}
    logits = model(_tokens())
    assert quant.quantize_model(model, mode) is model
    for name, proj in _projections(model):
        w = float_kernels[name]
        assert proj.quant == (mode, 64)
        assert proj.kernel[...].dtype == (jnp.int8 if mode == "int8" else jnp.uint8)
        assert proj.kernel[...].ndim == proj.kernel_scales[...].ndim == 3  # [L, K(/2), N]
        assert proj.kernel_shape == w.shape
        meta = proj.kernel.get_metadata()
        assert tuple(meta["float_logical_axes"]) == tuple(float_axes[name])
        assert len(meta["logical_axes"]) == 3
        assert len(proj.kernel_scales.get_metadata()["logical_axes"]) == 3
        w_hat = np.asarray(proj.dense_kernel(jnp.float32))
        assert w_hat.shape == w.shape
        k = int(np.prod(proj.unstacked_shape[: proj.n_in]))
        w_lkn, w_hat_lkn = w.reshape(w.shape[0], k, -1), w_hat.reshape(w.shape[0], k, -1)
        bound = _error_bound(w_lkn, mode, 64)
        assert np.all(np.abs(w_hat_lkn - w_lkn) <= bound * (1 + 1e-5) + 1e-12), name
    out = model(_tokens())
    rel = float(jnp.linalg.norm(out - logits) / jnp.linalg.norm(logits))
    assert rel < MODEL_LOGITS_REL_ERROR_BOUND[mode], rel
    graphdef, state = nnx.split(model)
    jitted = jax.jit(lambda state: nnx.merge(graphdef, state)(_tokens()))(state)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(out), rtol=1e-5, atol=1e-5)


def test_quantize_model_saves_memory_and_spares_the_value_head():
    critic = models.ValueModel(TINY, rngs=nnx.Rngs(0))
    score = np.asarray(critic.score.kernel[...])

    def layer_bytes():
        return sum(x.nbytes for x in jax.tree.leaves(nnx.state(critic.model.layers)))

    def flat_shape(p):  # [L, K, N]
        k = int(np.prod(p.unstacked_shape[: p.n_in]))
        return (p.kernel_shape[0], k, int(np.prod(p.unstacked_shape)) // k)

    proj_bytes = sum(p.kernel[...].nbytes for _, p in _projections(critic))
    before = layer_bytes()
    quant.quantize_model(critic, "nf4")
    expected = sum(quant.quantized_nbytes(flat_shape(p), "nf4") for _, p in _projections(critic))
    assert before - layer_bytes() == proj_bytes - expected
    assert 8 * expected / (proj_bytes / 4) == 4.5  # bits per weight, from float32
    np.testing.assert_array_equal(np.asarray(critic.score.kernel[...]), score)
    assert critic(_tokens()).shape == (2, 12)


def test_quantized_model_shards_over_eight_devices():
    model = quant.quantize_model(models.CausalLM(TINY, rngs=nnx.Rngs(0)), "nf4")
    expected = model(_tokens())
    mesh = shd.make_mesh(fsdp=4, tensor=2, devices=jax.devices()[:8])
    shd.shard_model(model, mesh)
    q_codes = model.model.layers.self_attn.q_proj.kernel[...]
    assert q_codes.sharding.spec == jax.P(None, "fsdp", "tensor")
    graphdef, state = nnx.split(model)
    with jax.set_mesh(mesh):
        out = jax.jit(lambda state: nnx.merge(graphdef, state)(_tokens()))(state)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_quantize_model_bad_inputs():
    model = models.CausalLM(TINY, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"mode: expected one of"):
        quant.quantize_model(model, "int2")
    with pytest.raises(ValueError, match=r"targets: 'lm_head' is not a projection"):
        quant.quantize_model(model, "int8", targets=("lm_head",))
    with pytest.raises(
        ValueError,
        match=r"model.layers.self_attn.q_proj \(kernel \(2, 64, 4, 16\), K=64\): "
        r"block_size: K=64 .* not divisible by block_size=48",
    ):
        quant.quantize_model(model, "nf4", block_size=48)
    quant.quantize_model(model, "int8", targets=("down_proj",))
    with pytest.raises(ValueError, match=r"model.layers.mlp.down_proj: already quantised \(int8\)"):
        quant.quantize_model(model, "nf4")
