"""The paged engine's attention backends (rollout/pages.py, PagedOptions.attention).

The Pallas GPU kernel runs on CPU in interpret mode, so its wiring (pool layout with the layers
folded into the pages, page tables with shared pages, lengths, GQA, the write-first layer step)
is checked against the reference attention's numbers, and the whole engine on it against the
reference engine. The TPU kernel has no working interpret mode in jax 0.10.2 (the interpreter
fails on its reshaped-ref loads), so its wrapper's layout is checked with the kernel module's own
``ref_ragged_paged_attention`` (same arguments) and the engine's programs with the kernel are
compiled for a TPU topology through libtpu (no TPU attached).
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import rollout
from jaxrl_llm.models.transformer import NO_WINDOW
from jaxrl_llm.rollout import paged, pages
from tests.rollout.test_generate import prompts
from tests.rollout.test_paged import shared_prefix_prompts

L, P, PS, K, H, D = 2, 9, 4, 2, 4, 16  # layers, pages, page size, kv heads, heads (GQA), dim
# Rows 0 and 2 share their first two pages (the G samples of one prompt); row 1 is empty.
TABLE = np.array([[3, 1, 5, 0], [2, 0, 0, 0], [3, 1, 8, 6]], np.int32)
CTX = np.array([9, 0, 8], np.int32)  # ragged context lengths (tokens already pooled)


def _reference_pool(rng):
    return pages.PagePool(*(rng.randn(L, P, PS, K, D).astype(np.float32) for _ in range(2)))


def _kernel_pool(name, ref_pool):
    """The reference pool's contents in kernel ``name``'s layout (module docstring of pages)."""
    k, v = ref_pool
    if name == "pallas_gpu":
        k, v = (jnp.asarray(x.transpose(3, 0, 1, 2, 4).reshape(K, L * P, PS, D)) for x in (k, v))
        return pages.PagePool(k, v)
    kv = np.stack([k, v], axis=-2).reshape(L * P, PS, 2 * K, D)
    return pages.PagePool(jnp.asarray(np.pad(kv, [(0, 0)] * 3 + [(0, 128 - D)])), None)


def _expected(ref_pool, layer, q, k_new, v_new, window):
    ctx_k = pages.gather_pages(jnp.asarray(ref_pool.k), layer, TABLE)
    ctx_v = pages.gather_pages(jnp.asarray(ref_pool.v), layer, TABLE)
    valid = np.ones(q.shape[:2], bool)
    return pages.paged_attention_reference(q, k_new, v_new, ctx_k, ctx_v, CTX, valid, window)


def _write_at(t):
    """Pages and offsets of each row's next ``t`` tokens (positions CTX + j) by TABLE."""
    pos = CTX[:, None] + np.arange(t)[None]
    return TABLE[np.arange(3)[:, None], pos // PS], pos % PS


@pytest.mark.parametrize("t", [1, 3], ids=["decode", "prefill"])
def test_pallas_gpu_backend_equals_reference_attention(t):
    """Write the new tokens into the GPU layout (layer 1: the folded page offset), then the
    Pallas decode kernel (interpret mode) or the dense prefill attention; = the reference."""
    rng = np.random.RandomState(0)
    ref_pool = _reference_pool(rng)
    q = rng.randn(3, t, H, D).astype(np.float32)
    k_new, v_new = (rng.randn(3, t, K, D).astype(np.float32) for _ in range(2))
    spec = pages.KernelSpec("pallas_gpu", num_pages=P, page_size=PS, head_dim=D, interpret=True)
    page, off = _write_at(t)
    pool = pages.write_layer(spec, _kernel_pool("pallas_gpu", ref_pool), 1, page, off, k_new, v_new)
    got = pages.kernel_attention(spec, pool, 1, q, TABLE, CTX, NO_WINDOW)
    want = _expected(ref_pool, 1, q, k_new, v_new, NO_WINDOW)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    # Layer 0 of the pool was not touched by layer 1's write.
    np.testing.assert_array_equal(
        np.asarray(pool.k[:, :P]), np.asarray(_kernel_pool("pallas_gpu", ref_pool).k[:, :P])
    )


@pytest.mark.parametrize("window", [None, 3])
def test_ragged_tpu_wrapper_layout_equals_reference_attention(window):
    """The TPU wrapper (interleaved K/V pages, padded head dim, folded layers, cu_q_lens) run
    with the kernel module's own reference implementation: = the reference attention."""
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

    rng = np.random.RandomState(1)
    ref_pool = _reference_pool(rng)
    t = 3
    q = rng.randn(3, t, H, D).astype(np.float32)
    k_new, v_new = (rng.randn(3, t, K, D).astype(np.float32) for _ in range(2))
    spec = pages.KernelSpec("ragged_tpu", num_pages=P, page_size=PS, head_dim=D, window=window)
    page, off = _write_at(t)
    pool = pages.write_layer(spec, _kernel_pool("ragged_tpu", ref_pool), 1, page, off, k_new, v_new)
    got = pages.ragged_tpu_attention(
        q, pool.k, P + TABLE, CTX, window=window, kernel=rpa.ref_ragged_paged_attention
    )
    want = _expected(ref_pool, 1, q, k_new, v_new, NO_WINDOW if window is None else window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def greedy_paged(model, ids, mask, options, max_new_tokens, **kw):
    """``(Generation, PagedStats)`` of a greedy paged run, G = 2, with every page returned."""
    out, stats = rollout.generate(
        model,
        ids,
        mask,
        rng=jax.random.key(0),
        max_new_tokens=max_new_tokens,
        num_samples=2,
        temperature=0.0,
        engine="paged",
        paged_options=options,
        return_stats=True,
        **kw,
    )
    assert stats.pages_in_use_at_end == 0
    return out, stats


def assert_same_greedy(ref, got):
    """The same masks and tokens, log-probs within 1e-5."""
    np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(ref.mask))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(ref.logprobs), atol=1e-5)


@pytest.mark.parametrize(
    "tuning",
    [
        {},
        # one page per block and the context split in two (the kernel's split-K combine)
        {"pages_per_compute_block": 1, "k_splits": 2, "num_warps": 4, "num_stages": 3},
    ],
    ids=["default", "tuned"],
)
def test_engine_on_the_gpu_kernels_gives_the_reference_engines_tokens(
    tiny_pair, tuning, monkeypatch
):
    """The whole paged engine with attention='pallas_gpu' (interpret mode on CPU): ragged
    prompts (one chunked), G = 2 sharing prompt pages, per-sample budgets, GQA; greedy
    tokens equal the reference engine's, log-probs within 1e-5, with the kernel's default
    launch parameters and with others (``PagedOptions.kernel_tuning``, which the reference
    path ignores; the kernel is called with them)."""
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged

    launches, kernel = [], gpu_paged.paged_attention

    def recording(*args, **kwargs):
        launches.append({k: v for k, v in kwargs.items() if k in pages.GPU_DECODE_TUNING})
        return kernel(*args, **kwargs)

    monkeypatch.setattr(gpu_paged, "paged_attention", recording)
    jax.clear_caches()  # the kernel is called while tracing: no program of another test reused
    _, model = tiny_pair("llama3")
    ids, mask = prompts(seed=1, lengths=(9, 4, 1, 6, 23))  # 23 > prefill_chunk: two chunks
    budgets = np.array([[8, 3], [1, 8], [5, 6], [8, 2], [2, 7]], np.int32)
    outs = {}
    for name in ("reference", "pallas_gpu"):
        options = paged.PagedOptions(
            page_size=4,
            num_slots=4,
            steps_per_dispatch=4,
            prefill_chunk=16,
            attention=name,
            kernel_tuning=tuning,
        )
        outs[name], _ = greedy_paged(model, ids, mask, options, 8, max_new_tokens_bg=budgets)
    assert launches and all(
        launch[k] == v
        for launch in launches
        for k, v in (pages.GPU_DECODE_TUNING | tuning).items()
        if k not in ("k_splits", "pages_per_compute_block")  # caps: checked below
    )
    splits = {launch["k_splits"] for launch in launches}
    assert splits == ({2} if tuning else {1})  # the page tables here have even widths
    assert_same_greedy(outs["reference"], outs["pallas_gpu"])


def test_gpu_kernels_read_prefixes_other_prompts_wrote(tiny_pair):
    """Prefix sharing on the GPU kernels (interpret mode): prefill rows that begin past a
    shared prefix (per-row offsets, offsets that are not multiples of the chunk, a second
    chunk after one) read the pages other prompts wrote; greedy tokens equal the reference
    engine's without sharing, log-probs within 1e-5."""
    _, model = tiny_pair("llama3")
    ids, mask = shared_prefix_prompts()
    outs = {}
    for name, sharing in (("reference", False), ("pallas_gpu", True)):
        options = paged.PagedOptions(
            page_size=4,
            num_slots=16,
            steps_per_dispatch=4,
            prefill_chunk=16,
            attention=name,
            prefix_sharing=sharing,
        )
        outs[name], stats = greedy_paged(model, ids, mask, options, 6, stop_token_ids=())
        assert (stats.shared_prompt_tokens > 0) == sharing
    assert_same_greedy(outs["reference"], outs["pallas_gpu"])


@pytest.mark.slow  # interpret mode, 2 two-device engines: ~15 s
def test_tensor_parallel_engines_run_the_gpu_kernel_on_each_devices_heads(tiny_pair, monkeypatch):
    """``tensor_parallel=2`` on an FSDP mesh of 4 with attention='pallas_gpu' (interpret
    mode): each engine's kernel runs per device on its half of the query heads and of the pool
    (``jax.shard_map``), and the tokens are the one-device reference engine's, the log-probs
    within 1e-5."""
    from flax import nnx
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged

    from jaxrl_llm.models import sharding

    heads, kernel = [], gpu_paged.paged_attention

    def recording(q, k_pages, *args, **kwargs):
        heads.append((q.shape[1], k_pages.shape[0]))  # [B, H, Dh], [K, pages, ps, Dh]
        return kernel(q, k_pages, *args, **kwargs)

    monkeypatch.setattr(gpu_paged, "paged_attention", recording)
    jax.clear_caches()  # the kernel is called while tracing
    _, model = tiny_pair("llama3")
    cfg = model.config
    ids, mask = prompts(seed=1, lengths=(9, 4, 6, 23))  # 23 > prefill_chunk: two chunks
    budgets = np.array([[8, 3], [1, 8], [8, 2], [2, 7]], np.int32)
    small = dict(page_size=4, num_slots=4, steps_per_dispatch=4, prefill_chunk=16)
    kw = dict(
        rng=jax.random.key(0), max_new_tokens=8, num_samples=2, temperature=0.0,
        max_new_tokens_bg=budgets, engine="paged",
    )  # fmt: skip
    ref = rollout.generate(
        model, ids, mask, paged_options=paged.PagedOptions(**small, attention="reference"), **kw
    )
    graphdef, state = nnx.split(model)
    mesh = sharding.make_mesh(fsdp=4, devices=jax.devices()[:4])
    params = jax.device_put(nnx.to_pure_dict(state), sharding.param_shardings(state, mesh))
    options = paged.PagedOptions(**small, attention="pallas_gpu", tensor_parallel=2)
    got, stats = rollout.generate(
        (graphdef, params), ids, mask, paged_options=options, return_stats=True, **kw
    )
    assert heads and set(heads) == {(cfg.num_heads // 2, cfg.num_kv_heads // 2)}
    assert stats.pages_in_use_at_end == 0
    np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(ref.mask))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(ref.logprobs), atol=1e-5)
    # A kernel cannot be split over a batch axis, nor over heads the axis does not divide.
    with pytest.raises(ValueError, match="tensor-parallel engine's devices"):
        paged.attention_kernel(cfg, options, jnp.float32, mesh=mesh, platform="gpu")
    with pytest.raises(ValueError, match="does not divide the model's"):
        on8 = sharding.make_mesh(tensor=8)
        paged.attention_kernel(cfg, options, jnp.float32, mesh=on8, platform="gpu")
    assert (
        paged.attention_kernel(cfg, paged.PagedOptions(), jnp.float32, mesh=on8, platform="gpu")
        is None
    )  # auto: the reference


def test_engine_programs_with_the_tpu_kernel_compile_for_a_tpu(tiny_pair):
    """_decode and _prefill with attention='ragged_tpu' lower and compile for one chip of a
    v5e:2x2 topology through libtpu (no TPU attached), the kernel in the compiled program."""
    pytest.importorskip("libtpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from flax import nnx
    from jax.experimental import topologies

    _, model = tiny_pair("llama3")
    graphdef, params = nnx.split(model)
    desc = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
    mesh = jax.sharding.Mesh(np.array(desc.devices[:1]), ("x",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def sds(shape, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=rep)

    c, ps, num_pages, n, w, r, chunk, g = model.config, 16, 33, 8, 8, 2, 16, 2
    options = paged.PagedOptions(page_size=ps, num_pages=num_pages, attention="ragged_tpu")
    spec = paged.attention_kernel(c, options, jnp.float32, platform="tpu")
    assert spec is not None and spec.name == "ragged_tpu"
    pool = jax.eval_shape(
        lambda: pages.init_pool(
            spec, c.num_layers, num_pages, ps, c.num_kv_heads, c.head_dim, jnp.float32
        )
    )
    static = paged._Static(True, 0, False, 0, ps, 4, kernel=spec)
    key = jax.eval_shape(lambda: jax.random.key(0))
    args = (
        graphdef,
        jax.tree.map(lambda x: sds(x.shape, x.dtype), params),
        None,  # layers_l: None, the programs slice the stacked layers themselves
        jax.tree.map(lambda x: sds(x.shape, x.dtype), pool),
    )
    key, f32 = sds(key.shape, key.dtype), sds((), jnp.float32)
    state = paged._SlotState(sds((n,)), sds((n,)), sds((n,), bool), sds((n,)), sds((n,)), sds((n,)))
    with jax.set_mesh(mesh):  # Mosaic reads the chip generation from the mesh's device
        decode = paged._decode.lower(
            *args, sds((n, w)), state, key, f32, f32, sds((2,)), *(sds(()),) * 3, static=static
        ).compile()
        prefill = paged._prefill.lower(
            *args,
            sds((r, chunk)),
            sds((r, chunk), bool),
            sds((r,)),
            sds((r, w)),
            sds((r, chunk, g)),
            sds((r, chunk)),
            sds((r,)),
            sds((r, g)),
            sds((r, g)),
            key,
            f32,
            f32,
            static=static,
        ).compile()
    for program in (decode, prefill):
        assert "ragged_paged_attention" in program.as_text()


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, page_size, dtype, rows, queries",
    [
        (32, 8, 64, 16, "bfloat16", 8, 1),  # a 1B Llama's decode
        (32, 8, 64, 16, "bfloat16", 2, 64),  # its chunked prefill
        (64, 8, 128, 16, "bfloat16", 2, 64),  # wider heads, GQA 8:1
        (32, 8, 128, 32, "bfloat16", 2, 64),  # larger pages
        (32, 8, 64, 16, "float32", 2, 64),  # a float32 cache
    ],
)
def test_tpu_kernel_blocks_fit_its_vmem_at_long_contexts(
    heads, kv_heads, head_dim, page_size, dtype, rows, queries
):
    """The TPU kernel compiles for a v5e chip (libtpu, no TPU) over 4,352-token page tables.
    Its own default blocks (128 pages) took 16 MiB of VMEM for a 1B Llama's keys and values
    alone, past the chip's 16 MiB scoped limit (``CompileTimeScopedVmemOom``), so every
    context of 2,048 tokens or more failed to compile; the blocks are now sized to
    ``pages.RAGGED_VMEM_BUDGET``."""
    pytest.importorskip("libtpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    desc = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
    mesh = jax.sharding.Mesh(np.array(desc.devices[:1]), ("x",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def sds(shape, dt=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dt, sharding=rep)

    width, dp, dt = 272, -(-head_dim // 128) * 128, jnp.dtype(dtype)
    pool = sds((width * rows + 1, page_size, 2 * kv_heads, dp), dt)
    q = sds((rows, queries, heads, head_dim), dt)
    fn = jax.jit(lambda q, kv, table, ctx: pages.ragged_tpu_attention(q, kv, table, ctx))
    with jax.set_mesh(mesh):
        compiled = fn.lower(q, pool, sds((rows, width)), sds((rows,))).compile()
    assert "ragged_paged_attention" in compiled.as_text()
    q_kernel = jax.ShapeDtypeStruct((rows * queries, heads, dp), dt)
    blocks, qblock = pages._ragged_block_sizes(q_kernel, pool, width)
    size = functools.partial(
        pages.ragged_vmem_bytes,
        page_size=page_size,
        num_q_heads=heads,
        num_combined_kv_heads=2 * kv_heads,
        head_dim=dp,
        q_dtype=dt,
        kv_dtype=dt,
    )
    assert size(blocks, qblock) <= pages.RAGGED_VMEM_BUDGET < size(128, qblock)


def test_bad_backends_and_unsupported_models_are_clear_errors(tiny_pair):
    sizes = dict(num_seqs=2, num_samples=1, longest_prompt=4, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"attention must be one of .* got 'flash'"):
        paged.resolve_options(paged.PagedOptions(attention="flash"), **sizes)
    llama, mistral = tiny_pair("llama3")[1].config, tiny_pair("mistral")[1].config
    f32 = jnp.float32
    options = paged.resolve_options(paged.PagedOptions(attention="auto"), **sizes)

    def pick(cfg, name, platform):
        o = paged.PagedOptions(**{**options.__dict__, "attention": name})
        return paged.attention_kernel(cfg, o, f32, platform=platform)

    # auto: the platform's kernel where it can serve the model, else the reference (None).
    assert pick(llama, "auto", "cpu") is None
    assert pick(llama, "auto", "gpu").name == "pallas_gpu"
    assert pick(llama, "auto", "tpu").name == "ragged_tpu"
    assert pick(mistral, "auto", "gpu") is None  # sliding window: no GPU decode kernel
    assert pick(mistral, "auto", "tpu").window == mistral.window(0)  # one window: the kernel's
    on_cpu = pick(llama, "pallas_gpu", "cpu")
    assert on_cpu.interpret and on_cpu.prefill_impl == "xla"
    assert pick(llama, "pallas_gpu", "gpu").prefill_impl == "cudnn"
    with pytest.raises(ValueError, match=r"'pallas_gpu' cannot serve this model: .*sliding-window"):
        pick(mistral, "pallas_gpu", "gpu")
    with pytest.raises(ValueError, match="'ragged_tpu' runs on TPU only"):
        pick(llama, "ragged_tpu", "cpu")
    shapes = dict(num_heads=6, num_kv_heads=3, windows=(None,), cache_dtype=f32)
    assert "multiple of 16" in pages.kernel_refusal("pallas_gpu", head_dim=24, **shapes)
    assert "6 interleaved kv heads" in pages.kernel_refusal("ragged_tpu", head_dim=128, **shapes)
    mixed = dict(num_heads=4, num_kv_heads=2, head_dim=128, windows=(4, None), cache_dtype=f32)
    assert "different windows" in pages.kernel_refusal("ragged_tpu", **mixed)
    # Through generate: the error comes before anything compiles.
    ids, mask = prompts(seed=0, lengths=(3, 2))
    with pytest.raises(ValueError, match="attention='pallas_gpu' cannot serve"):
        rollout.generate(
            tiny_pair("mistral")[1],
            ids,
            mask,
            rng=jax.random.key(0),
            max_new_tokens=2,
            engine="paged",
            paged_options=paged.PagedOptions(attention="pallas_gpu"),
        )


def test_rollout_paged_attention_config_reaches_the_sampler():
    from jaxrl_llm.config import ConfigError
    from jaxrl_llm.train import setup as S
    from tests.train import helpers as H

    small = ("rollout.prompts_per_step=2", "rollout.num_samples=2", "data.eval_size=4")
    assert S.resolve(H.config("tiny.yaml", *small)).sampler.paged_attention == "auto"
    setup = S.resolve(H.config("tiny.yaml", *small, "rollout.paged_attention=pallas_gpu"))
    assert setup.sampler.paged_attention == "pallas_gpu"
    assert setup.sampler.greedy().paged_attention == "pallas_gpu"  # evaluation too
    with pytest.raises(ConfigError, match="paged_attention"):
        H.config("tiny.yaml", "rollout.paged_attention=flash")


def test_cudnn_prefill_falls_back_to_xla_where_cudnn_refuses():
    """Off a GPU (or for shapes cuDNN refuses at trace time) the cuDNN prefill warns and
    gives the XLA implementation's numbers."""
    rng = np.random.RandomState(2)
    q = jnp.asarray(rng.randn(2, 3, H, D), jnp.bfloat16)
    k, v = (jnp.asarray(rng.randn(2, 8, K, D), jnp.bfloat16) for _ in range(2))
    ctx = jnp.asarray([5, 0], jnp.int32)
    want = pages.dense_prefill_attention(q, k, v, ctx, NO_WINDOW, implementation="xla")
    if jax.default_backend() == "gpu":
        pytest.skip("cuDNN is available here")
    with pytest.warns(UserWarning, match="cuDNN attention refused"):
        got = pages.dense_prefill_attention(q, k, v, ctx, NO_WINDOW, implementation="cudnn")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_kernel_tuning_is_checked_and_only_the_gpu_kernel_takes_it():
    """Unknown keys and values that are not ints >= 1 are clear errors (before anything runs);
    the pallas_gpu spec carries the pairs, sorted; ragged_tpu and the reference ignore them."""
    spec = functools.partial(pages.kernel_spec, num_pages=9, page_size=4, head_dim=16)
    tuning = {"num_warps": 4, "pages_per_compute_block": 2}
    gpu = spec("pallas_gpu", window=None, platform="gpu", tuning=tuning)
    assert gpu.tuning == (("num_warps", 4), ("pages_per_compute_block", 2))
    assert spec("ragged_tpu", window=None, platform="tpu", tuning=tuning).tuning == ()
    assert spec("reference", window=None, platform="cpu", tuning=tuning) is None
    resolve = functools.partial(
        paged.resolve_options, num_seqs=4, num_samples=1, longest_prompt=8, max_new_tokens=8
    )
    assert resolve(paged.PagedOptions(kernel_tuning=tuning)).kernel_tuning == gpu.tuning
    for bad, match in (
        ({"warps": 4}, "unknown key 'warps'; expected some of"),
        ({"num_warps": 0}, r"kernel_tuning\['num_warps'\] must be an int >= 1, got 0"),
        ({"k_splits": 2.0}, r"kernel_tuning\['k_splits'\] must be an int >= 1, got 2.0"),
        ({"block_h": 8}, r"kernel_tuning\['block_h'\] must be a multiple of 16, got 8"),
        (7, "kernel_tuning must map launch parameters to ints, got 7"),
    ):
        with pytest.raises(ValueError, match=match):
            resolve(paged.PagedOptions(kernel_tuning=bad))
