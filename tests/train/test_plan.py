"""``jaxrl-llm plan``: targets, abstract state bytes against real arrays, XLA's figures, errors.

The issue's "within 10% of the measured peak" needs a device that reports its memory
(``device.memory_stats()``); CPU devices report none, so on CPU the plan is checked against
what can be counted exactly: the real state's arrays (parameters, optimizer, reference) and
XLA's argument bytes (the state, reference and batch the step takes); and the tiny update's
planned peak against the bytes the process allocates while the trainer's step runs (glibc
``mallinfo2``, :func:`jaxrl_llm.train.hostmem.peak_heap_growth`), which on XLA:CPU exceeds the
plan by more than 10% (run-time scratch of XLA:CPU's YNNPACK dots; see that test).
"""

import dataclasses
import importlib.util
import json
import math
import re

import jax
import numpy as np
import pytest

from jaxrl_llm import cli
from jaxrl_llm.config import build_recipe, load_config
from jaxrl_llm.models import sharding as shd
from jaxrl_llm.train import hostmem
from jaxrl_llm.train import plan as P
from jaxrl_llm.train import setup as su
from jaxrl_llm.train.step import Groups, make_rl_step

TINY = "configs/tiny.yaml"
GiB = 2**30


def _nbytes(tree):
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def _device0_bytes(tree):
    """Bytes of device 0's shards of real (sharded) arrays."""
    total = 0
    for x in jax.tree.leaves(tree):
        (shard,) = [s for s in x.addressable_shards if s.device == jax.devices()[0]]
        total += shard.data.nbytes
    return total


# ---------------------------------------------------------------------------------------------
# Targets.


@pytest.mark.parametrize(
    "name, topology, devices, hbm",
    [
        ("v5e-16", "v5e:4x4", 16, 16 * GiB),
        ("v5e-64", "v5e:8x8", 64, 16 * GiB),
        ("v5p-128", "v5p:4x4x4", 64, 95 * GiB),  # v5p names count TensorCores, 2 per chip
        ("v5p-32", "v5p:2x2x4", 16, 95 * GiB),
        ("v6e-32", "v6e:4x8", 32, 32 * GiB),
        ("v5e:2x2", "v5e:2x2", 4, 16 * GiB),
        ("v6e:2x2", "v6e:2x2", 4, 32 * GiB),
    ],
)
def test_tpu_targets(name, topology, devices, hbm):
    t = P.parse_target(name)
    assert (t.topology, t.num_devices, t.hbm_bytes, t.platform) == (topology, devices, hbm, "tpu")
    assert not t.estimate and "cloud.google.com" in t.hbm_source


def test_gpu_target_and_sizes():
    t = P.parse_target(devices=8, device_memory="141GiB")
    assert (t.platform, t.num_devices, t.hbm_bytes, t.estimate) == ("cpu", 8, 141 * GiB, True)
    assert P.parse_bytes("80GB") == 80 * 10**9
    assert P.parse_bytes("16 gib") == 16 * GiB
    assert P.parse_bytes("1e9") == 10**9
    assert P.parse_target(devices=2).hbm_bytes is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(topology="v5e-12"), "valid: v5e-1, v5e-4, v5e-8, v5e-16"),
        (dict(topology="v7x-8"), "unknown TPU slice; valid: v5e-1"),
        (dict(topology="tpu"), "unknown TPU slice"),
        (dict(topology="v9:2x2"), "FAMILY one of v5e, v5p, v6e"),
        (dict(topology="v5p-3"), "no such v5p slice"),
        (dict(), "give either --topology"),
        (dict(topology="v5e-16", devices=8), "give either --topology"),
        (dict(topology="v5e-16", device_memory="1GiB"), "goes with --devices"),
        (dict(devices=0), "expected at least 1"),
        (dict(devices=8, device_memory="lots"), "--device-memory = 'lots'"),
        (dict(devices=8, device_memory="-3GB"), "positive size"),
    ],
)
def test_bad_targets(kwargs, message):
    topology = kwargs.pop("topology", None)
    with pytest.raises(P.PlanError) as e:
        P.parse_target(topology, **kwargs)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "name, topology, devices, memory",
    [
        ("h200-1", "1x1x1", 1, 143771 * 2**20),
        ("h200-8", "1x1x8", 8, 143771 * 2**20),
        ("H100-16", "1x2x8", 16, 80995 * 2**20),  # whole hosts of 8
        ("h100-4", "1x1x4", 4, 80995 * 2**20),
    ],
)
def test_gpu_targets_are_named_by_model_and_count(name, topology, devices, memory, monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    t = P.parse_target(name)
    assert (t.platform, t.topology, t.num_devices) == ("gpu", topology, devices)
    assert not t.estimate and t.accelerator and t.device_kind.startswith("NVIDIA H")
    # what JAX's allocator may take: 0.75 of the memory by default, or as the run sets it
    assert t.hbm_bytes == int(0.75 * memory) and "XLA_PYTHON_CLIENT_MEM_FRACTION" in t.hbm_source
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert P.parse_target(name).hbm_bytes == int(0.9 * memory)
    gpu = P.GPUS[name.lower().partition("-")[0]]
    text = gpu.target_config(cuda=(13, 0), cudnn=(9, 10))
    assert f"device_memory_size: {memory}" in text and f'"{t.device_kind}"' in text
    assert "cuda_compute_capability { major: 9 minor: 0 }" in text
    assert "runtime_version { major: 13 minor: 0 }" in text


@pytest.mark.parametrize(
    "name, fraction, message",
    [
        ("h200-12", None, "neither 1, 2, 4 or 8 (one host) nor a multiple of 8"),
        ("h200-0", None, "unknown TPU slice"),
        ("a100-8", None, "GPUs as MODEL-COUNT with MODEL one of h100, h200"),
        ("h200-8", "all", "XLA_PYTHON_CLIENT_MEM_FRACTION = 'all': expected a number in (0, 1]"),
        ("h200-8", "1.5", "expected a number in (0, 1]"),
    ],
)
def test_bad_gpu_targets(name, fraction, message, monkeypatch):
    if fraction is not None:
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", fraction)
    with pytest.raises(P.PlanError) as e:
        P.parse_target(name)
    assert message in str(e.value)


def test_a_gpu_target_without_the_cuda_plugin_says_what_to_install(monkeypatch):
    monkeypatch.setattr(P, "_cuda_plugin", lambda: None)
    with pytest.raises(P.PlanError, match=r'pip install -e "\.\[gpu-plan\]"'):
        P.target_devices(P.parse_target("h200-8"))


# XLA:GPU's own compile without a GPU needs JAX's CUDA plugin, which CI does not install (on a
# machine without a GPU it logs a failed start in every JAX process that does not set
# JAX_PLATFORMS); these run where it is installed (BENCHMARKS.md, "Deviceless XLA:GPU
# compiles").
needs_cuda_plugin = pytest.mark.skipif(
    P._cuda_plugin() is None,
    reason="JAX's CUDA plugin is not installed (pip install -e '.[gpu-plan]')",
)


def test_a_gpu_plan_notes_an_attention_that_fell_back_to_the_reference(monkeypatch):
    """Where cuDNN cannot be loaded, ``auto`` traced for a GPU falls back to the reference
    attention and logs why; the plan's update lowering collects that for its note."""
    import jax.numpy as jnp

    from jaxrl_llm.models import attention

    def no_cudnn(*args, **kwargs):
        raise RuntimeError("cuDNN not found.")

    monkeypatch.setattr(attention, "cudnn_attention", no_cudnn)
    q = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
    with P._attention_fallbacks() as fell_back, attention.for_platform("gpu"):
        jax.eval_shape(lambda q: attention.attention(q, q, q, implementation="auto"), q)
    assert fell_back == ["cudnn attention is not available (cuDNN not found.); using the reference"]
    with P._attention_fallbacks() as fell_back, attention.for_platform("gpu"):
        jax.eval_shape(lambda q: attention.attention(q, q, q, implementation="reference"), q)
    assert fell_back == []


@needs_cuda_plugin
def test_tiny_plan_on_gpus_is_xla_gpus_own_compile():
    config = load_config(TINY, ["mesh.preset=fsdp", "mesh.data=1", "mesh.fsdp=4"])
    plan = P.plan_run(config, P.parse_target("h200-4"))
    assert plan.target.platform == "gpu" and not plan.target.estimate
    assert plan.mesh == {"data": 1, "fsdp": 4, "tensor": 1}
    p = plan.parameters
    assert p.per_device == (p.total - p.replicated) // 4 + p.replicated
    assert plan.update.arguments >= plan.state
    assert plan.fits is True and plan.update.flops is None  # XLA:GPU reports no cost analysis
    # the paged engine's Pallas GPU kernel, compiled by Triton (a CPU estimate would compile
    # the reference attention); no estimate's notes
    assert plan.paged.attention == "pallas_gpu" and plan.paged.decode.temporaries > 0
    assert not any("estimate" in n or "CPU" in n for n in plan.notes), plan.notes
    text = P.format_plan(plan)
    assert "NVIDIA H200, 1x1x4" in text and "not reported" in text and "estimate" not in text


@needs_cuda_plugin
def test_on_xla_gpu_the_nonfinite_skip_keeps_no_copy_of_the_state(monkeypatch):
    """The update traced for a GPU skips a non-finite update with selects; XLA:GPU compiles the
    lax.cond form (XLA:CPU's) with the parameters and both Adam moments copied into the
    cond's result (accumulate._apply). The 1B update of scripts/bench_accelerator.py's plan
    part, where the state outweighs the step's other temporaries."""
    from jaxrl_llm.train import accumulate
    from tests.scripts import load_script

    part = load_script("bench_accelerator").SHAPES["device"]["plan"]
    config = load_config(part["config"], part["overrides"])
    recipe = build_recipe(config)
    devices = P.target_devices(P.parse_target("h200-1"))
    mesh = shd.make_mesh(1, 1, 1, devices=devices)
    run = P.abstract_run(config, recipe, mesh, P.model_config(config.model, accelerator=True))

    def temporaries() -> int:
        compiled = P.lower_step(run, config, recipe, platform="gpu").compile()
        return compiled.memory_analysis().temp_size_in_bytes

    select = temporaries()
    monkeypatch.setattr(accumulate, "skip_by_select", lambda: False)
    cond = temporaries()
    state = P.tree_bytes((run.state.params, run.state.opt_state)).per_device
    print(f"temporaries: select {select}, cond {cond}; params + optimizer state {state}")
    assert cond - select >= 0.75 * state  # 1B: 13.0 of the state's 14.8 GB


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None, reason="libtpu installed")
def test_tpu_target_without_libtpu_says_what_to_install():
    with pytest.raises(P.PlanError, match=r'pip install -e "\.\[tpu-plan\]"'):
        P.target_devices(P.parse_target("v5e-16"))


# ---------------------------------------------------------------------------------------------
# Abstract state: the same bytes as the trainer's real arrays.


def test_abstract_state_equals_real_state_on_one_device():
    config = load_config(TINY)
    recipe = build_recipe(config)
    models, state = su.build_models(config, recipe)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    run = P.abstract_run(config, recipe, mesh, P.model_config(config.model, accelerator=False))
    assert P.tree_bytes(run.state.params).per_device == _nbytes(state.params)
    assert P.tree_bytes(run.state.opt_state).per_device == _nbytes(state.opt_state)
    assert P.tree_bytes(run.models.ref_params).per_device == _nbytes(models.ref_params)
    assert P.tree_bytes(run.state).total == _nbytes(state)
    real = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), run.state) == real


def test_fsdp8_divides_parameters_and_optimizer_by_8():
    overrides = ["mesh.preset=fsdp", "mesh.data=1", "mesh.fsdp=8", "rollout.prompts_per_step=8"]
    # Unpacked: packed runs keep the masks on the host for the packing plan (not split).
    config = load_config(TINY, [*overrides, "train.packing=false"])
    recipe = build_recipe(config)
    mesh = shd.make_mesh(1, 8, 1, devices=jax.devices()[:8])
    run = P.abstract_run(config, recipe, mesh, P.model_config(config.model, accelerator=False))
    models, state = su.build_models(config, recipe, mesh=mesh)
    for abstract, real in [
        (run.state.params, state.params),
        (run.state.opt_state, state.opt_state),
        (run.models.ref_params, models.ref_params),
    ]:
        b = P.tree_bytes(abstract)
        assert b.total == _nbytes(real)
        assert b.per_device == (b.total - b.replicated) // 8 + b.replicated
        assert b.per_device == _device0_bytes(real)  # what device 0 really holds
        assert 0 < b.replicated < b.total / 1000  # only the norms' scales... and counters
    # The batch splits over the 8 data-parallel devices.
    assert P.tree_bytes(run.groups).per_device * 8 == P.tree_bytes(run.groups).total


def test_the_planned_update_has_the_trainers_shape_on_8_devices(monkeypatch):
    """The step the plan compiles packs as the trainer's does: a per-device token budget of
    ``⌈micro_batch_size / data-parallel devices⌉`` rows and the model's attention weight in the
    packing plan. (The plan used to take one device's budget: 8x the trainer's tokens per
    micro-batch on 8 devices, which put a 1.5B GRPO update on v5e-16 at 9.19 GiB of
    temporaries per chip where the trainer's program needs 3.65.)"""
    from jaxrl_llm.train import step as rl_step

    sizes = ["mesh.preset=fsdp", "mesh.data=1", "mesh.fsdp=8", "rollout.prompts_per_step=8"]
    config = load_config(TINY, [*sizes, "optim.micro_batch_size=8"])
    recipe = build_recipe(config)
    mesh = shd.make_mesh(1, 8, 1, devices=jax.devices()[:8])
    trainer = su.resolve(config, mesh=mesh).update
    assert trainer.packing and trainer.micro_batch_tokens == config.data.max_prompt_length + (
        config.rollout.max_new_tokens
    )  # one row's tokens per device
    seen = []
    real = rl_step.make_rl_step

    def spy(recipe, models, update, **kw):
        seen.append(update)
        return real(recipe, models, update, **kw)

    monkeypatch.setattr(rl_step, "make_rl_step", spy)
    run = P.abstract_run(config, recipe, mesh, P.model_config(config.model, accelerator=False))
    P.lower_step(run, config, recipe)
    assert seen == [trainer]


@pytest.mark.parametrize("quantize", ["none", "nf4"])
def test_abstract_lora_state_equals_the_trainers(quantize):
    """LoRA: the TrainState's parameters are the adapters, the optimizer holds theirs, the
    frozen base is Models.frozen (QLoRA: codes + scales, quant.quantized_nbytes) and is the
    reference: no copy."""
    from flax import nnx

    from jaxrl_llm import models as M
    from jaxrl_llm.models import quant

    rank = 4
    config = load_config(TINY, [f"model.lora.rank={rank}", f"model.lora.quantize={quantize}"])
    recipe = build_recipe(config)
    models, state = su.build_models(config, recipe)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    model_cfg = P.model_config(config.model, accelerator=False)
    run = P.abstract_run(config, recipe, mesh, model_cfg)
    shapes = lambda tree: jax.tree.map(lambda x: (tuple(x.shape), np.dtype(x.dtype)), tree)
    assert shapes(run.state) == shapes(state) and shapes(run.models.frozen) == shapes(models.frozen)
    assert P.tree_bytes(run.models.frozen).total == _nbytes(models.frozen)
    assert P.tree_bytes(run.state.opt_state).total == _nbytes(state.opt_state)
    assert run.models.ref_params is run.models.frozen  # the reference is the base itself
    base = nnx.state(M.CausalLM(model_cfg, rngs=nnx.Rngs(0)), nnx.Param)
    assert run.num_parameters == sum(x.size for x in jax.tree.leaves(base))
    # The seven projections as [L, K, N] (q/k/v [L, D, H, Dh]: K = D; o_proj [L, H, Dh, D]).
    layers = nnx.to_pure_dict(base)["model"]["layers"]
    kernels = {
        name: p["kernel"]
        for part in (layers["self_attn"], layers["mlp"])
        for name, p in part.items()
        if isinstance(p, dict) and "kernel" in p
    }
    assert sorted(kernels) == sorted(quant.PROJECTIONS)
    flat = {
        name: (k.shape[0], k.shape[1], math.prod(k.shape[2:]))
        if name in ("q_proj", "k_proj", "v_proj")
        else (k.shape[0], math.prod(k.shape[1:-1]), k.shape[-1])
        for name, k in kernels.items()
    }
    # Adapters: A [L, K, r] and B [L, r, N] in float32 for each projection.
    adapters = sum(4 * L * rank * (K + N) for L, K, N in flat.values())
    assert P.tree_bytes(run.state.params).total == _nbytes(state.params) == adapters
    floats = sum(x.nbytes for x in jax.tree.leaves(base))
    if quantize == "nf4":  # the projections' stacks are quantised, the rest stays float32
        floats -= sum(k.nbytes for k in kernels.values())
        floats += sum(quant.quantized_nbytes(f, "nf4") for f in flat.values())
    assert P.tree_bytes(run.models.frozen).total == floats


def test_abstract_ppo_lora_critic_equals_the_trainers():
    """PPO under LoRA: the critic's trunk frozen too (its adapters and value head trained)."""
    overrides = ["algorithm.name=ppo", "model.lora.rank=4", "critic.lora.rank=4"]
    config = load_config(TINY, overrides)
    recipe = build_recipe(config)
    models, state = su.build_models(config, recipe)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    run = P.abstract_run(config, recipe, mesh, P.model_config(config.model, accelerator=False))
    shapes = lambda tree: jax.tree.map(lambda x: (tuple(x.shape), np.dtype(x.dtype)), tree)
    assert shapes(run.state) == shapes(state)
    assert shapes(run.models.critic_frozen) == shapes(models.critic_frozen)
    assert P.tree_bytes(run.models.critic_frozen).total == _nbytes(models.critic_frozen)


def test_lora_sampler_arguments_unmerged_and_merged():
    """The rollout runs the base joined with the adapters (both resident), or with
    ``merge_for_sampling`` the base's graph on a merged copy shaped like the frozen base."""
    from jaxrl_llm.models import lora

    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    runs = {}
    for merge in (False, True):
        config = load_config(TINY, ["model.lora.rank=4", f"model.lora.merge_for_sampling={merge}"])
        recipe = build_recipe(config)
        cfg = P.model_config(config.model, accelerator=False)
        runs[merge] = P.abstract_run(config, recipe, mesh, cfg)
    unmerged, merged = runs[False], runs[True]
    graphdef, params = unmerged.sampler
    assert graphdef is unmerged.models.graphdef
    assert P.tree_bytes(params).total == (
        P.tree_bytes(unmerged.models.frozen).total + P.tree_bytes(unmerged.state.params).total
    )
    assert params == lora.combine(unmerged.models.frozen, unmerged.state.params)
    graphdef, params = merged.sampler
    assert graphdef is merged.models.ref_graphdef
    shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
    assert shapes(params) == shapes(merged.models.frozen)


def test_model_config_takes_the_targets_dtype_and_logits_blocks():
    """The plan compiles the target's programs: bf16 and accelerator-sized log-prob blocks for
    an accelerator (Llama-3.2-1B's 128,256-token vocabulary: 1,024 rows), float32 and the CPU's
    256 rows otherwise, as the trainer resolves them on each."""
    overrides = ["model.path=configs/models/llama-3.2-1b", "model.dtype=auto"]
    model = load_config(TINY, overrides).model
    gpu, cpu = (P.model_config(model, accelerator=a) for a in (True, False))
    assert (gpu.dtype, gpu.logits_block_rows) == ("bfloat16", 1024)
    assert (cpu.dtype, cpu.logits_block_rows) == ("float32", 256)


def test_kv_cache_bytes():
    cfg = P.model_config(load_config(TINY).model, accelerator=True)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    kv = P.kv_cache_bytes(cfg, rows=8, slots=100, dtype="bfloat16", mesh=mesh)
    assert kv.total == 2 * cfg.num_layers * 8 * cfg.num_kv_heads * cfg.head_dim * 100 * 2
    mesh4 = shd.make_mesh(4, 1, 1, devices=jax.devices()[:4])
    assert P.kv_cache_bytes(cfg, 8, 100, "bfloat16", mesh4).per_device == kv.total // 4
    uneven = P.kv_cache_bytes(cfg, 6, 100, "bfloat16", mesh4)  # 6 rows do not split 4 ways
    assert uneven.per_device == uneven.replicated == kv.total * 6 // 8


# ---------------------------------------------------------------------------------------------
# Compiled plans.


@pytest.mark.slow
def test_tiny_plan_on_one_cpu_device_agrees_with_xla_and_the_state():
    # The unpacked step's arguments (a packed step also takes the packing plan's int32[N]s).
    config = load_config(TINY, ["train.packing=false"])
    recipe = build_recipe(config)
    models, state = su.build_models(config, recipe)
    plan = P.plan_run(config, P.parse_target(devices=1, device_memory="1GiB"))
    assert plan.parameters.per_device == _nbytes(state.params)
    assert plan.optimizer.per_device == _nbytes(state.opt_state)
    assert plan.reference.per_device == _nbytes(models.ref_params)
    # XLA's arguments are the state, the reference and the groups, less what the program does
    # not read (jit drops unused arguments: the sampler's log-probs, with recompute π_old).
    b, g, t = 2, 2, 8
    unused = b * g * t * 4
    assert plan.update.arguments == _nbytes(state) + _nbytes(models.ref_params) + (
        plan.batch.per_device - unused
    )
    assert plan.update.aliased > _nbytes(state.params) + _nbytes(state.opt_state)  # donated
    assert plan.rollout.arguments >= _nbytes(state.params)
    assert plan.update.temporaries > 0 and plan.update.flops > 0
    # FLOPs, Kaplan's 2N per token forward (the reference) + 6N training, over B·G·(P + T).
    n = plan.model["parameters"]
    assert n == sum(x.size for x in jax.tree.leaves(state.params))
    assert plan.update_flops_analytic == (2 + 6) * n * b * g * (128 + t)
    assert plan.rollout_flops_analytic == 2 * n * b * (128 + g * t)
    assert plan.peak == max(plan.update_peak, plan.rollout_peak)
    assert plan.update_peak == (
        plan.update.arguments + plan.update.outputs - plan.update.aliased + plan.update.temporaries
    )
    assert plan.fits is True and plan.margin == GiB - plan.peak
    text = P.format_plan(plan)
    assert "FITS" in text and "estimate" in text
    # traced as on a GPU, where "auto" is the reference attention too for this float32 model
    assert "the update's attention is" not in text
    d = plan.to_dict()
    assert d["fits"] is True and d["per_device_bytes"]["peak"] == plan.peak
    # The same run against too little memory does not fit, and gets suggestions.
    small = P.Plan(**{**plan.__dict__, "target": P.parse_target(devices=1, device_memory="1MB")})
    assert small.fits is False and "DOES NOT FIT" in P.format_plan(small)
    assert [o for _, o in P.candidates(config, small)] == [
        ["model.remat=full"],
        ["kl.reference_param_dtype=bfloat16"],
        ["optim.micro_batch_size=2"],
        ["model.remat=full", "kl.reference_param_dtype=bfloat16", "optim.micro_batch_size=2"],
        ["model.lora.rank=16", "model.lora.quantize=none"],
        ["model.lora.rank=16", "model.lora.quantize=nf4"],
    ]


@pytest.mark.slow
@pytest.mark.skipif(
    hostmem.heap_bytes_in_use() is None,
    reason="counting allocated bytes needs glibc >= 2.33 (mallinfo2); CPU devices report none",
)
def test_tiny_update_peak_against_the_bytes_the_trainers_step_allocates():
    """The plan's update peak of the tiny config on one CPU device against the trainer's step
    (the same program: XLA's memory figures are the plan's) run on the plan's worst-case
    batch, measured as

        measured = bytes of its argument arrays + peak growth of the C heap's bytes in use
                   (glibc mallinfo2 uordblks + hblkhd, sampled while the step runs)

    The issue's 10% does not hold on XLA:CPU, and this test does not claim it. XLA's own
    buffers are all there: the step allocates ``outputs − aliased + temporaries`` (63.9 MiB
    under the suite's flags) as one block for the whole run. On top of it XLA:CPU's YNNPACK
    dot fusions allocate their own scratch at run time (``slinky::raw_buffer::allocate``
    under ``ynn_invoke_runtime``: 6 and 12 MiB blocks, the tied 49152 × 64 embedding's size
    and half of it), which no buffer assignment counts: 24-33 MiB at once on 2 cores, so
    measured / planned = 1.21-1.29 (plan 113.0 MiB; 2 cores, jax 0.10.2). Turning YNNPACK off
    (``--xla_cpu_experimental_ynn_fusion_type=``) leaves 15-21 MiB of other dot scratch, at
    1.13-1.17. What is checked: the plan is not above the measured peak by more than 10%, and
    not below it by more than 40% (the scratch; it may grow with the number of threads), and a
    plan that left out the temporaries would be far outside that band.
    """
    config = load_config(TINY)
    recipe = build_recipe(config)
    plan = P.plan_run(config, P.local_target(1))  # this CPU device, as the step runs here
    models, state = su.build_models(config, recipe)
    r = config.rollout
    b, g, t, p = r.prompts_per_step, r.num_samples, r.max_new_tokens, 128  # the plan's worst case
    vocab = P.model_config(config.model, accelerator=False).vocab_size
    rng = np.random.default_rng(0)
    host = Groups(
        prompt_ids_bp=rng.integers(3, vocab, (b, p), dtype=np.int32),
        prompt_mask_bp=np.ones((b, p), bool),
        tokens_bgt=rng.integers(3, vocab, (b, g, t), dtype=np.int32),
        mask_bgt=np.ones((b, g, t), bool),
        logp_sampler_bgt=-rng.random((b, g, t), dtype=np.float32),
        reward_bg=rng.standard_normal((b, g)).astype(np.float32),
        member_bg=np.ones((b, g), bool),
    )
    # On the step's own shardings, so that its device_put is a no-op inside the measurement.
    groups = jax.tree.map(lambda x: jax.device_put(x, models.batch_sharding(x.ndim)), host)
    step = make_rl_step(
        recipe,
        models,
        su.update_shape(config),
        temperature=r.temperature or 1.0,
        old_logprobs=su.OldLogprobs(config.old_logprobs.source, config.old_logprobs.tis_cap),
    )
    state, _ = step(state, groups)  # compiles
    mem = step.lower(state, groups).compile().memory_analysis()
    u = plan.update
    assert (mem.argument_size_in_bytes, mem.output_size_in_bytes) == (u.arguments, u.outputs)
    assert (mem.alias_size_in_bytes, mem.temp_size_in_bytes) == (u.aliased, u.temporaries)

    def run_step():
        nonlocal state
        state, metrics = step(state, groups)
        jax.block_until_ready(state)
        return metrics

    growths = []
    for _ in range(3):
        metrics, growth = hostmem.peak_heap_growth(run_step)
        assert np.isfinite(metrics["actor/loss"])
        growths.append(growth)
    arguments = _nbytes(state) + _nbytes(models.ref_params) + _nbytes(groups)
    # XLA drops the arguments the program does not read (the sampler's log-probs).
    assert 0 <= arguments - u.arguments <= plan.batch.per_device
    measured = arguments + max(growths)
    ratio = measured / plan.update_peak
    numbers = f"measured {measured / 2**20:.1f} MiB / planned {plan.update_peak / 2**20:.1f} MiB"
    assert 0.9 <= ratio <= 1.4, f"{numbers} = {ratio:.3f} (growths {growths})"
    # The band is narrow enough to catch a plan without the temporaries (about 2.3x here).
    assert measured > 1.4 * (plan.update_peak - u.temporaries), numbers


@pytest.mark.slow
def test_tiny_lora_plan_compiles_the_lora_step_with_the_frozen_base():
    """LoRA: the update takes the adapters' state, the frozen base (a non-donated argument,
    also the reference: counted once) and the groups; the base is not in the state."""
    config = load_config(TINY, ["model.lora.rank=4", "train.packing=false"])  # as above
    recipe = build_recipe(config)
    models, state = su.build_models(config, recipe)
    plan = P.plan_run(config, P.parse_target(devices=1, device_memory="1GiB"))
    assert plan.reference.total == 0 and plan.frozen.per_device == _nbytes(models.frozen)
    assert plan.parameters.per_device == _nbytes(state.params)
    assert plan.state == _nbytes(state.params) + _nbytes(state.opt_state) + _nbytes(models.frozen)
    unused = 2 * 2 * 8 * 4  # the sampler's log-probs (π_old is recomputed)
    # The base is passed twice (as the reference and as the frozen base; one buffer at run
    # time): XLA counts it twice, the plan once.
    assert plan.update.arguments == (
        _nbytes(state) + 2 * _nbytes(models.frozen) + plan.batch.per_device - unused
    )
    assert plan.update.shared == _nbytes(models.frozen)
    assert plan.update_peak == (
        plan.update.arguments
        - plan.update.shared
        + plan.update.outputs
        - plan.update.aliased
        + plan.update.temporaries
    )
    assert plan.update.aliased >= _nbytes(state.params) + _nbytes(state.opt_state)
    # The sampler (the paged engine: rollout.engine auto, an EOS) runs the base joined with
    # the adapters: both resident, not counted twice; its page pool is donated.
    assert plan.rollout_engine == "paged"
    # The paged programs take per-layer copies of the layer weights (paged.engine_params),
    # not the stacked ones: of their parameters only the non-layer leaves are resident.
    copies = _nbytes(models.frozen["model"]["layers"]) + _nbytes(state.params["model"]["layers"])
    assert plan.rollout.resident == _nbytes(models.frozen) + _nbytes(state.params) - copies
    assert plan.rollout.arguments >= plan.rollout.resident + plan.kv_cache.per_device
    assert (
        plan.rollout_peak
        == plan.state
        + (plan.rollout.arguments - _nbytes(models.frozen) - _nbytes(state.params) + copies)
        + plan.rollout.outputs
        - plan.rollout.aliased
        + plan.rollout.temporaries
    )
    n = plan.model["parameters"]
    assert plan.update_flops_analytic == (2 + 4) * n * 2 * 2 * (128 + 8)  # no weight gradients
    assert "frozen base = reference" in P.format_plan(plan)
    assert plan.model["lora"] == {"rank": 4, "quantize": "none", "reference_is_base": True}
    # The evaluation sampler (8 held-out prompts, greedy) is planned as a third program.
    (ev,) = plan.programs
    assert ev.name == "eval rollout" and plan.peaks["eval rollout"] == plan.program_peak(ev)


@pytest.mark.slow
def test_dpo_plan_has_the_reference_pass_and_the_update():
    overrides = [
        "model.path=tiny-random",
        "model.dtype=float32",
        "model.remat=none",
        "data.eval_size=0",
    ]
    config = load_config("configs/algorithms/dpo.yaml", overrides)
    recipe = build_recipe(config)
    models, state = su.build_models(config, recipe)
    plan = P.plan_run(config, P.parse_target(devices=1, device_memory="1GiB"))
    (ref_pass,) = plan.programs
    n, width = config.preference.pairs_per_step, 128 + 32  # prompts 128, answers 32
    assert ref_pass.name == "reference pass"
    assert ref_pass.arguments == _nbytes(models.ref_params) + n * width * (4 + 1)
    assert ref_pass.resident == _nbytes(models.ref_params)
    assert plan.reference.per_device == _nbytes(models.ref_params)
    assert plan.batch.total == 2 * n * (width * 5 + 32) + 2 * n * 4  # + the ref log-probs
    assert plan.update.aliased >= _nbytes(state.params) + _nbytes(state.opt_state)
    assert set(plan.peaks) == {"update", "reference pass"} and plan.fits
    assert plan.update_flops_analytic == 2 * n * width * plan.model["parameters"] * (2 + 6)
    assert "KV cache" not in P.format_plan(plan)


def _fake_plan(reference=1, critic=0):
    """A Plan that does not fit 1 MB, with no compile (for candidates)."""
    prog = P.Program("x", 0, 0, 0, 0, 0, 0.0, 0.0)
    return P.Plan(
        target=P.parse_target(devices=1, device_memory="1MB"),
        mesh={"data": 1, "fsdp": 1, "tensor": 1},
        preset="dp",
        model={
            "path": "tiny-random",
            "parameters": 1,
            "trainable_parameters": 1,
            "layers": 2,
            "kv_heads": 2,
            "dtype": "float32",
            "param_dtype": "float32",
            "remat": "none",
            "lora": None,
        },
        parameters=P.Bytes(),
        optimizer=P.Bytes(),
        reference=P.Bytes(reference, reference, 0),
        critic=P.Bytes(critic, critic, 0),
        batch=P.Bytes(),
        kv_cache=P.Bytes(),
        rollout=prog,
        update=prog,
        rollout_flops_analytic=0.0,
        update_flops_analytic=0.0,
        seconds=0.0,
    )


def test_the_rollout_engine_planned_is_the_trainers():
    assert P.rollout_engine(load_config(TINY, ["rollout.engine=static"])) == "static"
    assert P.rollout_engine(load_config(TINY, ["rollout.stop_token_ids=[]"])) == "static"  # auto
    assert P.rollout_engine(load_config(TINY)) == "paged"  # auto, the EOS stops
    assert P.rollout_engine(load_config(TINY, ["rollout.stop_token_ids=[7]"])) == "paged"
    assert P.rollout_engine(load_config(TINY, ["rollout.engine=paged"])) == "paged"
    dpo = load_config("configs/algorithms/dpo.yaml", ["model.path=tiny-random"])
    assert P.rollout_engine(dpo) == "static"  # setup._eval_plan: the static sampler
    text = P.format_plan(dataclasses.replace(_fake_plan(), notes=("a note",)))
    assert text.endswith("note: a note")


def _paged_rollout(overrides=(), **shape):
    """The tiny run's paged rollout planned alone (no update compiled), on one device."""
    config = load_config(TINY, list(overrides))
    recipe = build_recipe(config)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    cfg = P.model_config(config.model, accelerator=False)
    run = P.abstract_run(config, recipe, mesh, cfg)
    target = P.parse_target(devices=1)
    paged, _ = P.plan_paged_rollout(run, config, target, **shape)
    return config, cfg, paged


def _shapes(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), tree)


@pytest.mark.parametrize("sharing", [False, True])
def test_paged_worst_case_shapes_are_what_run_passes(monkeypatch, sharing):
    """A real paged run of the tiny model with the worst case (every prompt as long as
    data.max_prompt_length, every completion T tokens): the largest _prefill and _decode calls
    it makes have the shapes the plan lowers, and its pool the planned one's. With prefix
    sharing, a prompt that begins with another's first page is prefilled from token 16: its
    chunk is as wide and its table a page wider, the largest the plan lowers (its rows apart:
    a prompt deferred for a prefix is prefilled with fewer)."""
    from flax import nnx

    from jaxrl_llm import models
    from jaxrl_llm.rollout import engine
    from jaxrl_llm.rollout import paged as paged_lib

    config, cfg, planned = _paged_rollout([f"rollout.prefix_sharing={str(sharing).lower()}"])
    assert planned.options.prefix_sharing == sharing
    b, g, t, p = 2, 2, 8, config.data.max_prompt_length
    seen = {"_prefill": [], "_decode": []}
    for name in seen:
        fn = getattr(paged_lib, name)

        def record(graphdef, *args, fn=fn, name=name, **kw):
            seen[name].append(_shapes(args[1:]))  # past the parameters
            return fn(graphdef, *args, **kw)

        monkeypatch.setattr(paged_lib, name, record)
    graphdef, params = nnx.split(models.CausalLM(cfg, rngs=nnx.Rngs(0)))
    first = np.arange(3, 3 + p, dtype=np.int32) % cfg.vocab_size
    # the second shares the first's first page (16 tokens) when sharing, else nothing
    prompts = [first, np.r_[first[:16], (first[16:] + 1) % cfg.vocab_size].astype(np.int32)]
    _, stats = paged_lib.run(
        graphdef,
        None,
        nnx.to_pure_dict(params),
        prompts,
        np.full((b, g), t, np.int32),
        rng=jax.random.key(0),
        temperature=1.0,
        top_p=1.0,
        greedy=False,
        top_k=0,
        stop_ids=engine._stop_ids((), cfg),  # no stop: every completion T tokens
        pad_token_id=0,
        cache_dtype=np.dtype("float32"),
        max_new_tokens=t,
        options=planned.options,
    )
    assert stats.shared_prompt_tokens == (16 if sharing else 0)
    worst = paged_lib.worst_case_programs(
        cfg,
        nnx.to_pure_dict(params),
        planned.options,
        None,
        num_prompts=b,
        num_samples=g,
        longest_prompt=p,
        max_new_tokens=t,
        greedy=False,
        top_k=0,
        top_p=1.0,
        pad_token_id=0,
        cache_dtype=np.dtype("float32"),
        num_stop_ids=8,
    )

    def cells(a):  # a prefill's (rows, tokens x table pages): its attention scores' size
        (rows, width), _ = a[2]
        (_, pages), _ = a[5]
        return rows, width * pages

    lowered = _shapes(worst.prefill.args[1:])
    if sharing:
        assert all(cells(a)[0] <= cells(lowered)[0] for a in seen["_prefill"])
        assert max(cells(a)[1] for a in seen["_prefill"]) == cells(lowered)[1]
    else:
        assert max(seen["_prefill"], key=lambda a: a[2][0][0] * a[2][0][1]) == lowered
    assert seen["_decode"][0] == _shapes(worst.decode.args[1:])  # every slot live
    # the 128-token chunk past the shared page covers 144 tokens: 9 pages, in 8-page steps
    assert (planned.prefill_rows, planned.prefill_tokens, planned.prefill_table_pages) == (
        2,
        128,
        16 if sharing else 8,
    )
    assert (planned.decode_rows, planned.decode_table_pages) == (4, 16)  # 4 slots, 256 tokens
    assert stats.page_bytes * planned.options.num_pages == planned.pool.per_device


@pytest.mark.slow
def test_paged_plan_kv_is_the_pools_bytes_and_grows_with_its_pages():
    """The plan's paged KV figure is the real pool's bytes (pages.init_pool with the options
    the engine resolves), the pool is donated, and the figure grows with the pages the
    completions need: ⌈(P + T) / page_size⌉ per slot."""
    from jaxrl_llm.rollout import paged as paged_lib
    from jaxrl_llm.rollout import pages

    config = load_config(TINY)
    recipe = build_recipe(config)
    _models, state = su.build_models(config, recipe)
    plan = P.plan_run(config, P.parse_target(devices=1, device_memory="1GiB"))
    cfg = P.model_config(config.model, accelerator=False)
    options = paged_lib.resolve_options(
        paged_lib.PagedOptions(
            attention=config.rollout.paged_attention,
            max_prompt_length=config.data.max_prompt_length,  # the trainer's, as planned
        ),
        num_seqs=2 * 2,
        num_samples=2,
        longest_prompt=config.data.max_prompt_length,
        max_new_tokens=8,
    )
    pool = pages.init_pool(
        None, cfg.num_layers, options.num_pages, 16, cfg.num_kv_heads, cfg.head_dim, "float32"
    )
    assert plan.rollout_engine == "paged" and plan.paged.options == options
    assert (options.num_slots, options.num_pages) == (4, 1 + 4 * 9)  # ⌈(128 + 8) / 16⌉ = 9
    assert plan.kv_cache == P.Bytes(_nbytes(pool), _nbytes(pool), 0)
    layers = _nbytes(state.params["model"]["layers"])  # taken as per-layer copies instead
    for prog in (plan.paged.prefill, plan.paged.decode):
        assert prog.aliased == _nbytes(pool)  # donated: the pool is updated in place
        assert prog.resident == _nbytes(state.params) - layers  # f32 weights: not cast
        assert prog.arguments >= _nbytes(state.params) + _nbytes(pool)  # the copies, not stacked
    assert plan.rollout is plan.paged.program
    assert plan.rollout_peak == plan.state + plan.rollout.bytes - plan.rollout.resident
    (ev,) = plan.programs  # the evaluation samples with the paged engine too (greedy, G = 1)
    assert ev is plan.eval_paged.program and plan.eval_paged.options.num_slots == 8
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["rollout_engine"] == "paged" and d["per_device_bytes"]["kv_cache"]["total"] == (
        _nbytes(pool)
    )
    assert d["paged"]["options"]["num_pages"] == 37 and d["paged"]["planned"] in (
        "prefill",
        "decode",
    )
    text = P.format_plan(plan)
    assert "rollout: paged engine (decode 4 slots over 16-page tables" in text
    assert "a pool of 37 pages of 16 tokens" in text and "KV cache (paged pool)" in text
    # More new tokens: more pages per slot, the pool (and only the pool) grows linearly.
    page = _nbytes(pool) // options.num_pages
    for t in (24, 40):  # ⌈(128 + T) / 16⌉ = 10, 11 pages per slot
        _, _, longer = _paged_rollout(max_new_tokens=t)
        assert longer.options.num_pages == 1 + 4 * (-(-(128 + t) // 16))
        assert longer.pool.per_device == longer.options.num_pages * page
        assert longer.decode.aliased == longer.pool.per_device
    # More prompts: more slots (next_pow2(B·G), at most 64), each with its pages.
    _, _, big = _paged_rollout(["rollout.prompts_per_step=4"])
    assert big.options.num_slots == 8 and big.pool.per_device == (1 + 8 * 9) * page


def test_a_gpu_estimate_counts_no_cpu_float_conversions_of_a_bf16_pool():
    """XLA:CPU runs a scatter into a bf16 buffer in f32, 2x the pool in temporaries that a GPU
    does not hold: a GPU estimate of a bf16 cache compiles it as its bits (uint16, the same
    bytes), so the paged programs' temporaries do not grow with the pool; the pool's bytes
    are bf16's. A CPU target keeps the real dtype (the conversions are the CPU's own)."""
    bf16 = ["model.dtype=bfloat16", "rollout.engine=paged", "data.eval_size=0"]
    plans = {
        n: P.plan_run(
            load_config(TINY, [*bf16, f"rollout.max_total_tokens={n}"]),
            P.parse_target(devices=1, device_memory="80GB"),
        ).paged
        for n in (4096, 65536)
    }
    small, large = plans[4096], plans[65536]
    cfg = P.model_config(load_config(TINY, bf16).model, accelerator=True)
    page = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, bf16
    assert large.options.num_pages == 1 + 65536 // 16 and large.pool.per_device == (
        large.options.num_pages * page
    )
    for which in ("prefill", "decode"):
        s, g = getattr(small, which), getattr(large, which)
        assert g.temporaries == s.temporaries, which  # not 2x the pool more
        assert g.aliased == large.pool.per_device  # the pool donated, in place
    # A CPU target (no accelerator's memory): the conversions are real and counted.
    cpu = {
        n: P.plan_run(
            load_config(
                TINY, [*bf16, "rollout.cache_dtype=bfloat16", f"rollout.max_total_tokens={n}"]
            ),
            P.parse_target(devices=1),
        ).paged.decode.temporaries
        for n in (4096, 65536)
    }
    assert cpu[65536] - cpu[4096] >= (65536 - 4096) // 16 * page


@pytest.mark.slow
def test_the_paged_pool_is_planned_as_memory_utilization_sizes_it():
    """With a known HBM per device, the plan sizes the paged pool as the engine does on the
    devices (``rollout.memory_utilization`` of the memory, less the state and the engine's
    program): ample memory gives every slot's worst case; a tighter HBM fewer pages, planned
    with the program of a pool that may preempt (its recompute prefill) and filling u · HBM
    to within a page at the rollout's peak; too little plans the minimum with a note;
    ``max_total_tokens`` or no HBM keeps the CPU rule."""
    # 32 slots, prefilled 4 prompts at a time: a pool large beside the programs
    more = ["rollout.prompts_per_step=8", "rollout.num_samples=8", "rollout.max_num_seqs=32"]
    config = load_config(TINY, more)
    plan = P.plan_run(config, P.parse_target(devices=1, device_memory="1GiB"))
    o = plan.paged.options
    per_seq = -(-(config.data.max_prompt_length + config.rollout.max_new_tokens) // o.page_size)
    assert o.num_pages == 1 + o.num_slots * per_seq  # every slot's worst case
    page = plan.paged.pool.per_device // o.num_pages

    def other(p):  # the rollout's peak less its pool
        prog = p.paged.program
        return p.state + prog.bytes - prog.resident - p.paged.pool.per_device

    # A pool of one sequence's worst case (it may preempt): the programs a tight pool plans.
    minimum = load_config(TINY, [*more, f"rollout.max_total_tokens={per_seq * o.page_size}"])
    small = P.plan_run(minimum, P.parse_target(devices=1, device_memory="1GiB"))
    assert small.paged.options.num_pages == 1 + per_seq and other(small) >= other(plan)
    want = 1 + per_seq + 20
    hbm = int((other(small) + want * page + page // 2) / 0.9)
    tight = P.plan_run(config, P.parse_target(devices=1, device_memory=str(hbm)))
    assert tight.paged.options.num_pages == want < o.num_pages
    assert tight.paged.pool.per_device == want * page
    assert tight.rollout_peak <= 0.9 * hbm < tight.rollout_peak + page  # filled to a page
    assert not any("memory_utilization" in n for n in plan.notes)
    assert any(f"a paged pool of {want} pages per engine: 3 of its 32" in n for n in tight.notes)
    short = P.plan_run(config, P.parse_target(devices=1, device_memory=str(other(small))))
    assert short.paged.options.num_pages == 1 + per_seq
    assert any("less than one sequence's worst case" in n for n in short.notes), short.notes
    # the pool asked for, or no HBM known: as before
    fixed = P.plan_run(minimum, P.parse_target(devices=1, device_memory=str(hbm)))
    assert fixed.paged.options.num_pages == 1 + per_seq
    assert P.plan_run(config, P.parse_target(devices=1)).paged.options.num_pages == (
        1 + min(o.num_slots, 64) * per_seq
    )


def test_the_plan_sizes_a_pool_whose_reserve_grows_with_it_as_the_engine_does():
    """``fit_paged`` runs the engine's own search (``paged.largest_pool``) on reserves it
    plans: a reserve that grows 1.7 bytes per pool byte (XLA:CPU's f32 scatter into a bf16
    pool) gives the largest pool that fits u · HBM with its own reserve, in a few plans, the
    pages the engine's search gives on the same reserves. (The plan's own fixed point before,
    pages from the last plan's reserve, swung between the extremes here: 1000 pages, 10, 37,
    10, then planned 10 with a false "less than one sequence's worst case" note.)"""
    from jaxrl_llm.rollout import paged as pg

    config = load_config(TINY, ["rollout.memory_utilization=0.9"])
    page, base, fixed = 4096, 10_000_000, 3_000_000
    options = pg.PagedOptions(num_pages=1000, num_slots=64, page_size=16)

    def reserve(num_pages):  # the program less its resident arguments and the pool
        return fixed + int(1.7 * page * num_pages) + 256 * (num_pages % 7)  # laid out in steps

    calls = []

    def replan(num_pages):
        calls.append(num_pages)
        prog = P.Program("decode", 0, 0, 0, reserve(num_pages) + num_pages * page, 0, 0.0, 0.0)
        rollout = P.PagedRollout(
            engines=1,
            prompts=config.rollout.prompts_per_step,
            options=dataclasses.replace(options, num_pages=num_pages),
            attention="reference",
            pool=P.Bytes(num_pages * page, num_pages * page, 0),
            prefill=prog,
            decode=prog,
            prefill_rows=1,
            prefill_tokens=16,
            prefill_table_pages=1,
            decode_rows=1,
            decode_table_pages=1,
        )
        return rollout, ()

    hbm = 14_700_000  # ~20 pages of the 37 that hold every sequence's worst case
    target = P.Target("1x GPU (CPU estimate)", "cpu", 1, hbm, "test")
    fitted, notes = P.fit_paged(replan(1000), replan, base=base, config=config, target=target)
    n = fitted.options.num_pages
    budget = int(0.9 * hbm) - base
    assert n * page + reserve(n) <= budget < (n + 1) * page + reserve(n + 1)  # the largest
    assert len(calls) <= 1 + 6  # the default pool's plan, then a few
    t = config.rollout.max_new_tokens
    minimum = pg.pool_pages(1, config.data.max_prompt_length, t, options)
    live = min(options.num_slots, config.rollout.prompts_per_step * config.rollout.num_samples)
    cap = pg.pool_pages(live, config.data.max_prompt_length, t, options)
    assert n < cap and (n, reserve(n)) == pg.largest_pool(reserve, budget, page, minimum, cap)
    assert any(f"a paged pool of {n} pages per engine" in note for note in notes)
    assert not any("less than one sequence" in note for note in notes)


@pytest.mark.slow
def test_static_engine_is_planned_as_before():
    """rollout.engine=static: the static sampler's one program over a KV cache of P + T
    slots for B·G rows, nothing donated, no paged figures. It runs on per-layer copies of the
    layers (paged.engine_params, as the paged engine), which count beside the state; its other
    weights are the state's own buffers (float32 on CPU: not cast)."""
    config = load_config(TINY, ["rollout.engine=static", "data.eval_size=0"])
    recipe = build_recipe(config)
    _models, state = su.build_models(config, recipe)
    plan = P.plan_run(config, P.parse_target(devices=1, device_memory="1GiB"))
    cfg = P.model_config(config.model, accelerator=False)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    assert plan.paged is None and plan.rollout_engine == "static"
    assert plan.kv_cache == P.kv_cache_bytes(cfg, 2 * 2, 128 + 8, "float32", mesh)
    r = plan.rollout
    layers = _nbytes(state.params["model"]["layers"])
    assert r.aliased == 0 and r.resident == _nbytes(state.params) - layers
    assert plan.rollout_peak == plan.state + r.arguments - r.resident + r.outputs + r.temporaries
    assert r.arguments - r.resident > layers  # the copies, and the prompts
    d = plan.to_dict()
    assert d["rollout_engine"] == "static" and d["paged"] is None
    assert "rollout: static engine" in P.format_plan(plan) and not plan.notes


def test_candidates_packing_lora_and_offline():
    packed = load_config(TINY, ["train.packing=true", "optim.micro_batch_tokens=600"])
    found = dict((w.split(" (")[0], o) for w, o in P.candidates(packed, _fake_plan()))
    # half the tokens per device, still above the longest sequence (128 + 8)
    assert found["packed micro-batches of 300 tokens per device"] == [
        "optim.micro_batch_tokens=300"
    ]
    short = load_config(TINY, ["train.packing=true", "optim.micro_batch_tokens=200"])
    assert not any("packed" in w for w, _ in P.candidates(short, _fake_plan()))
    # LoRA is offered for full fine-tuning (a critic gets one too), not for a LoRA run
    ppo = load_config(TINY, ["algorithm.name=ppo"])
    lora = [o for w, o in P.candidates(ppo, _fake_plan(critic=1)) if "LoRA" in w]
    assert lora[1] == [
        "model.lora.rank=16",
        "model.lora.quantize=nf4",
        "critic.lora.rank=16",
        "critic.lora.quantize=nf4",
    ]
    adapted = load_config(TINY, ["model.lora.rank=4"])
    assert not any("LoRA" in w for w, _ in P.candidates(adapted, _fake_plan(reference=0)))
    dpo = load_config("configs/algorithms/dpo.yaml", ["model.path=tiny-random"])
    assert [o for _, o in P.candidates(dpo, _fake_plan())][-1] == [
        "model.lora.rank=16",
        "model.lora.quantize=nf4",
    ]


@pytest.mark.slow
def test_a_paged_rollout_that_sets_the_peak_suggests_the_static_engine():
    """Under FSDP each of the paged engine's per-shard engines holds a gathered copy of the
    weights (Llama-3.1-70B on v5p-128: the compiler refused the rollout, 135.6 GiB of
    temporaries per chip); the static engine samples on the sharded weights. Suggested when
    the rollout is the peak program, and the override re-plans with the static engine."""
    from jaxrl_llm.config import apply_overrides

    sizes = ["mesh.preset=fsdp", "mesh.data=1", "mesh.fsdp=4", "data.eval_size=0"]
    config = load_config(TINY, sizes)
    plan = P.plan_run(config, P.local_target(4))
    assert plan.rollout_engine == "paged"

    class Peak:  # the plan, with the peak program said to be `program`
        def __init__(self, program, **model):
            self.peak_program = program
            self.model = {**plan.model, **model}

        def __getattr__(self, name):
            return getattr(plan, name)

    static = ["rollout.engine=static"]
    assert static in [o for _, o in P.candidates(config, Peak("rollout"))]
    assert static in [o for _, o in P.candidates(config, Peak("eval rollout"))]
    assert static not in [o for _, o in P.candidates(config, Peak("update"))]
    assert P.plan_run(apply_overrides(config, static), plan.target).rollout_engine == "static"
    # Engines of 2 devices (4 devices, 4 query / 2 KV heads): each holds half the weights and
    # half its pool, so its programs' arguments shrink.
    tp = ["rollout.tensor_parallel=2"]
    assert tp in [o for _, o in P.candidates(config, Peak("rollout"))]
    assert tp not in [o for _, o in P.candidates(config, Peak("update"))]
    split = P.plan_run(apply_overrides(config, tp), plan.target)
    assert split.paged.engines == min(2, config.rollout.prompts_per_step)
    assert split.paged.pool.per_device == plan.paged.pool.per_device // 2
    assert split.paged.decode.arguments < plan.paged.decode.arguments
    assert tp not in [o for _, o in P.candidates(apply_overrides(config, tp), Peak("rollout"))]
    # Heads no engine size divides (SmolLM2's 9 / 3): no tensor-parallel suggestion at all.
    odd = [o for _, o in P.candidates(config, Peak("rollout", heads=9, kv_heads=3))]
    assert not any(x.startswith("rollout.tensor_parallel") for o in odd for x in o)
    # "All of the above" keeps the paged engine with its tensor parallelism (the two rollout
    # changes are alternatives: tensor_parallel with the static engine is a config error).
    (together,) = [o for w, o in P.candidates(config, Peak("rollout")) if w == "all of the above"]
    assert "rollout.tensor_parallel=2" in together and "rollout.engine=static" not in together
    apply_overrides(config, together)  # a valid config


def test_suggestions_are_replanned(monkeypatch, capsys):
    """A run that does not fit: exit 1, and each suggestion carries its re-planned peak."""
    bf16 = ("bfloat16 reference model", ["kl.reference_param_dtype=bfloat16"])
    monkeypatch.setattr(P, "candidates", lambda config, plan: [bf16])
    argv = ["plan", "--config", TINY, "--devices", "1", "--device-memory", "40MiB", "--json"]
    code = cli.main(argv)
    d = json.loads(capsys.readouterr().out)
    assert code == 1 and d["fits"] is False
    (s,) = d["suggestions"]
    assert "bfloat16 reference model: peak" in P.format_suggestions(d["suggestions"])
    assert s["overrides"] == bf16[1] and s["fits"] is False
    assert s["peak"] < d["per_device_bytes"]["peak"]  # the reference's bytes halve


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed")
def test_tiny_plan_on_a_tpu_topology():
    config = load_config(TINY, ["mesh.preset=fsdp", "mesh.data=1", "mesh.fsdp=4"])
    plan = P.plan_run(config, P.parse_target("v5e:2x2"))
    assert not plan.target.estimate and plan.mesh == {"data": 1, "fsdp": 4, "tensor": 1}
    p = plan.parameters
    assert p.per_device == (p.total - p.replicated) // 4 + p.replicated
    # TPU layouts pad to tiles, so XLA's arguments are at least the unpadded shards.
    assert plan.update.arguments >= plan.state + plan.batch.per_device - 2 * 2 * 8 * 4
    assert plan.update.flops > 0 and plan.fits is True
    # The rollout is the paged engine's (auto, an EOS): one engine per data shard (2 of the 4
    # have a prompt), each on one chip with the TPU kernel, its pool in the kernel's layout.
    from jaxrl_llm.rollout import pages

    pg = plan.paged
    assert plan.rollout_engine == "paged" and pg.attention == "ragged_tpu"
    assert (pg.engines, pg.prompts, pg.options.num_slots) == (2, 1, 2)
    c = P.model_config(config.model, accelerator=True)
    spec = pages.kernel_spec(
        "ragged_tpu",
        num_pages=pg.options.num_pages,
        page_size=16,
        head_dim=c.head_dim,
        window=None,
        platform="tpu",
    )
    pool = jax.eval_shape(
        lambda: pages.init_pool(
            spec, c.num_layers, pg.options.num_pages, 16, c.num_kv_heads, c.head_dim, "float32"
        )
    )
    assert plan.kv_cache.per_device == P.tree_bytes(pool).per_device
    assert pg.decode.flops > 0 and pg.prefill.flops > 0 and pg.decode.aliased > 0
    # FSDP: each engine runs on a gathered copy of the weights (not the resident shards).
    assert pg.decode.resident < plan.parameters.per_device
    assert pg.decode.arguments >= plan.parameters.total
    # Engines of 2 chips (rollout.tensor_parallel): the TPU kernel compiled per chip under
    # shard_map (4 query / 2 KV heads: one KV head per chip), half the pool and of the
    # weights' split leaves on each chip (the code must be Mosaic's kernel, not a fallback).
    from jaxrl_llm.config import apply_overrides

    tp = P.plan_run(apply_overrides(config, ["rollout.tensor_parallel=2"]), plan.target)
    tg = tp.paged
    assert tg.attention == "ragged_tpu" and (tg.engines, tg.prompts) == (2, 1)
    assert tg.pool.per_device == pg.pool.per_device // 2 and tg.pool.replicated == 0
    assert tg.decode.arguments < pg.decode.arguments
    assert "per engine, 2 engines of 2 devices; ragged_tpu attention" in tg.describe()


@pytest.mark.parametrize("attention, kernels", [("auto", True), ("reference", False)])
def test_a_tpu_plan_compiles_the_update_with_the_tpus_attention(attention, kernels):
    """A TPU plan's update is the program the trainer runs on the TPU: ``model.attention:
    auto`` is splash there, compiled by Mosaic (a ``tpu_custom_call``), not this CPU's
    reference attention nor splash's interpret mode. (Before, it was the reference, whose
    ``[T, S]`` scores made a 1B run's planned update peak 15.45 GiB per v5e chip against
    7.94 with splash, at 4,096-token completions.)"""
    config = load_config(
        TINY, ["mesh.preset=fsdp", "mesh.data=1", "mesh.fsdp=4", f"model.attention={attention}"]
    )
    target = P.parse_target("v5e:2x2")
    devices = P.target_devices(target)
    recipe = build_recipe(config)
    mesh = shd.make_mesh(1, 4, 1, devices=devices[:4])
    run = P.abstract_run(config, recipe, mesh, P.model_config(config.model, accelerator=True))
    text = P.lower_step(run, config, recipe, platform="tpu").as_text()
    assert ("tpu_custom_call" in text) is kernels  # splash's forward and backward kernels


@pytest.mark.parametrize("attention", ["cudnn", "pallas_gpu", "auto"])
def test_a_gpu_estimate_traces_the_update_as_on_a_gpu_with_cpu_stand_ins(attention):
    """A GPU plan is an XLA:CPU compile standing in for the GPUs: its update is traced as on a
    GPU (``auto`` is cuDNN there, so prompts are not shared), with the kernel in a CPU
    stand-in: the Pallas kernel interpreted, cuDNN's flash attention by the reference
    attention (not its call's XLA form, whose [B, H, T, S] scores flash never holds). Before,
    an explicit ``cudnn`` crashed the plan ("cuDNN is not detected")."""
    overrides = [
        "model.dtype=bfloat16",
        f"model.attention={attention}",
        "rollout.max_new_tokens=200",
    ]
    config = load_config(TINY, overrides)
    recipe = build_recipe(config)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    run = P.abstract_run(config, recipe, mesh, P.model_config(config.model, accelerator=True))
    lowered = P.lower_step(run, config, recipe, platform="gpu", emulated=True)
    text = lowered.as_text()
    assert "custom_call" not in text  # neither cuDNN's nor Triton's
    # a packed row: no whole [.., W, .., W] float32 scores (query blocks)
    w = run.prompt_width + 200
    assert not re.search(rf"x{w}x(\d+x)?{w}xf32>", text)
    if attention == "pallas_gpu":  # interpreted: the kernel's grid as loops over its blocks
        assert text.count("stablehlo.while") > 8
    lowered.compile()  # and XLA:CPU compiles it


@pytest.mark.slow
def test_a_gpu_plan_with_cudnn_attention_says_what_it_estimates(capsys):
    """``model.attention: cudnn`` on a GPU estimate plans (it crashed) and says how."""
    code, out, err = _cli(
        capsys,
        "--config",
        TINY,
        "--devices",
        "1",
        "--device-memory",
        "1GiB",
        "--no-suggest",
        "model.dtype=bfloat16",
        "model.attention=cudnn",
    )
    assert code == 0, err
    assert "the update's attention is cuDNN on the GPUs, estimated with the reference" in out


def test_a_program_the_tpu_compiler_refuses_for_memory_is_a_does_not_fit(monkeypatch, capsys):
    """A TPU's compiler refuses a program whose buffers exceed the chip's HBM (Llama-3.1-8B's
    paged rollout on v5e-16: "the total memory required for HLO temporaries (16.60G) exceeds
    available HBM (15.75G)"). The plan used to crash with that error; it is now the verdict it
    is: DOES NOT FIT, the program's figures the bytes the compiler said it needs (a lower
    bound), and the reason printed. Other compile errors still raise."""
    import jax.stages

    real = jax.stages.Lowered.compile
    message = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (20.50G) exceeds available HBM (15.75G)."
    )

    def refuse_the_update(self, *args, **kwargs):
        if "module @jit_step" in self.as_text()[:200]:
            raise jax.errors.JaxRuntimeError(message)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", refuse_the_update)
    config = load_config(TINY, ["mesh.preset=fsdp", "mesh.data=1", "mesh.fsdp=4"])
    plan = P.plan_run(config, P.parse_target("v5e:2x2"))
    need = int(20.50 * GiB)
    assert plan.update.refused == message and plan.update.temporaries == need
    assert plan.rollout.refused is None and plan.rollout.temporaries < need
    assert plan.update_peak >= need and plan.peak_program == "update" and plan.fits is False
    assert json.loads(json.dumps(plan.to_dict()))["programs"]["update"]["refused"] == message
    text = P.format_plan(plan)
    assert "DOES NOT FIT" in text
    assert "the target's compiler refused the update program for lack of memory" in text
    assert P._refused_bytes(
        "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used "
        "20.44G of 15.75G hbm. Exceeded hbm capacity by 4.69G."
    ) == int(20.44 * GiB)

    def broken(self, *args, **kwargs):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    monkeypatch.setattr(jax.stages.Lowered, "compile", broken)
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        P.plan_run(config, P.parse_target("v5e:2x2"))


# ---------------------------------------------------------------------------------------------
# The command line.


def _cli(capsys, *argv):
    code = cli.main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--topology", "v5e-17"], "no such v5e slice; valid: v5e-1"),
        (["--topology", "h100"], "unknown TPU slice; valid:"),
        (["--devices", "8", "mesh.data=3"], "mesh"),
        (["--devices", "1", "model.path=/no/such/model"], "model.path = '/no/such/model'"),
        (["--devices", "1", "--device-memory", "big"], "--device-memory = 'big'"),
    ],
)
def test_cli_bad_input_exits_2(capsys, argv, message):
    code, out, err = _cli(capsys, "--config", TINY, *argv)
    assert code == 2 and out == ""
    assert err.startswith("jaxrl-llm plan: ") and message in err


@pytest.mark.parametrize(
    "config_json, message",
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "is not supported"),
        ({"model_type": "llama", "vocab_size": 8}, "lacks or mistypes a field"),
    ],
)
def test_cli_bad_model_config_exits_2(capsys, tmp_path, config_json, message):
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    code, _, err = _cli(capsys, "--config", TINY, "--devices", "1", f"model.path={tmp_path}")
    assert code == 2 and message in err


def test_cli_mesh_that_does_not_divide_names_the_sizes(capsys):
    code, _, err = _cli(capsys, "--config", TINY, "--devices", "8", "mesh.data=3")
    assert code == 2 and "8" in err and "data" in err


def test_cli_is_registered_without_abbreviations(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "--config", TINY, "--topo", "v5e-16"])
    assert "unrecognized arguments: --topo" in capsys.readouterr().err


def test_quiet_cpu_platform(monkeypatch):
    calls = []
    monkeypatch.setattr(jax.config, "update", lambda *a: calls.append(a))
    monkeypatch.setattr(P, "_tpu_device_files", lambda: False)
    found = {"libtpu"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: object() if name in found else None
    )
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert P.quiet_cpu_platform() is False and calls == []  # the user's choice stands
    monkeypatch.delenv("JAX_PLATFORMS")
    assert P.quiet_cpu_platform() is True and calls == [("jax_platforms", "cpu")]
    monkeypatch.delenv("JAX_PLATFORMS")
    found.add("jax_cuda12_plugin")  # a GPU machine: leave it alone
    assert P.quiet_cpu_platform() is False
    found.discard("jax_cuda12_plugin")
    monkeypatch.setattr(P, "_tpu_device_files", lambda: True)  # a TPU VM
    assert P.quiet_cpu_platform() is False
    found.clear()  # no libtpu: nothing to quieten
    monkeypatch.setattr(P, "_tpu_device_files", lambda: False)
    assert P.quiet_cpu_platform() is False and len(calls) == 1


def test_bytes_of_split_and_replicated_shardings():
    mesh = shd.make_mesh(4, 1, 1, devices=jax.devices()[:4])
    spec = jax.sharding.PartitionSpec(("data", "fsdp"))
    split = jax.ShapeDtypeStruct((8, 3), np.float32, sharding=jax.NamedSharding(mesh, spec))
    whole = jax.NamedSharding(mesh, jax.sharding.PartitionSpec())
    rep = jax.ShapeDtypeStruct((5,), np.int32, sharding=whole)
    b = P.tree_bytes({"a": split, "b": rep, "c": None})
    assert b == P.Bytes(total=8 * 3 * 4 + 20, per_device=2 * 3 * 4 + 20, replicated=20)


def test_cli_subprocess_reports_the_subprocess_error(capsys):
    """More devices than this process has: the plan runs in a subprocess; its refusal is ours."""
    code, out, err = _cli(capsys, "--config", TINY, "--devices", "16", "model.path=/no/such")
    assert code == 2 and out == "" and "model.path = '/no/such'" in err


@pytest.mark.slow
def test_cli_plans_more_devices_than_this_process_in_a_subprocess(capsys):
    argv = ["--config", TINY, "--devices", "16", "--device-memory", "1GiB", "mesh.data=4"]
    code, out, _ = _cli(capsys, *argv, "--json")
    d = json.loads(out)
    assert code == 0 and d["fits"] is True and d["target"]["num_devices"] == 16
    assert d["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1} and d["target"]["estimate"]
    assert d["target"]["name"] == "16x GPU (CPU estimate)"


# ---------------------------------------------------------------------------------------------
# train.preflight.


def _small_memory(monkeypatch, hbm):
    """The local devices as if they had ``hbm`` bytes (CPU devices report no memory)."""
    real = P.local_target
    monkeypatch.setattr(
        P,
        "local_target",
        lambda n=None: dataclasses.replace(real(n), hbm_bytes=hbm, hbm_source="test limit"),
    )


def test_preflight_refuses_a_run_that_does_not_fit_before_writing(tmp_path, capsys, monkeypatch):
    _small_memory(monkeypatch, 2**20)
    run = tmp_path / "run"
    argv = ["train", "--config", TINY, "--run-dir", str(run), "--no-progress"]
    code = cli.main([*argv, "data.eval_size=0", "train.preflight=true"])
    out = capsys.readouterr()
    assert code == 2 and "Traceback" not in out.err
    assert out.err.startswith("jaxrl-llm train: train.preflight: the run does not fit")
    assert "of 1.0 MiB (test limit)" in out.err and "nothing was loaded" in out.err
    assert "rollout.tensor_parallel" not in out.err  # named only where the rollout is the peak
    assert "DOES NOT FIT" in out.out and "update peak" in out.out  # the table was printed
    assert not run.exists()  # as a refused config: nothing written, not even the folder


@pytest.mark.slow
def test_preflight_that_fits_trains(tmp_path, capsys, monkeypatch):
    _small_memory(monkeypatch, 4 * GiB)
    run = tmp_path / "run"
    argv = ["train", "--config", TINY, "--run-dir", str(run), "--no-progress", "--max-steps", "1"]
    code = cli.main([*argv, "data.eval_size=0", "train.preflight=true"])
    out = capsys.readouterr().out
    assert code == 0 and "FITS: peak" in out and "of 4.00 GiB HBM (test limit)" in out
    assert (run / "metrics.jsonl").exists()


@pytest.mark.slow
def test_preflight_without_device_memory_gives_no_verdict():
    lines = []
    plan = P.preflight(load_config(TINY, ["data.eval_size=0"]), log=lines.append)
    assert plan.fits is None and plan.target.platform == "local"
    assert "no device memory given" in lines[0]


# ---------------------------------------------------------------------------------------------
# Split placement: the rollout devices and the train devices planned apart.

SPLIT = [  # 8 devices: 2 rollout (dp over 2) + 6 train (data 3 x fsdp 2)
    "placement.mode=split",
    "placement.rollout_fraction=0.25",
    "mesh.preset=fsdp",
    "mesh.data=3",
    "mesh.fsdp=2",
    "rollout.prompts_per_step=6",
    "data.eval_size=0",
    "rollout.engine=static",  # the static sampler's figures (a paged split: its own test)
]


@pytest.fixture(scope="module")
def split_plan():
    config = load_config(TINY, SPLIT)
    return config, P.plan_run(config, P.parse_target(devices=8, device_memory="1GiB"))


@pytest.mark.slow
def test_split_plan_rollout_side_holds_the_rollout_copy_only(split_plan):
    """The rollout devices hold the sampler's copy (what RolloutWeights really syncs there),
    the prompts and the rollout's temporaries: no optimizer state, no reference."""
    from jaxrl_llm.train import placement as pl

    config, plan = split_plan
    sp = plan.split
    assert (sp.devices, sp.train_devices, sp.hosts) == (2, 6, 1)
    assert sp.mesh == {"data": 2, "fsdp": 1, "tensor": 1} and sp.preset == "dp"
    assert plan.mesh == {"data": 3, "fsdp": 2, "tensor": 1}
    # The real copy: the run's own meshes, models and RolloutWeights, synced once.
    recipe = build_recipe(config)
    mesh, _ = su.make_mesh(config)
    models, state = su.build_models(config, recipe, mesh=mesh)
    placement = su.make_placement(config, mesh, models.rules)
    weights = pl.RolloutWeights.build(models, placement, state.params)
    weights.sync(state.params, 0)
    device = placement.rollout_devices[0]
    copy = [s.data.nbytes for x in jax.tree.leaves(weights.params) for s in x.addressable_shards]
    on_device = [
        s.data.nbytes
        for x in jax.tree.leaves(weights.params)
        for s in x.addressable_shards
        if s.device == device
    ]
    assert sp.parameters.total == _nbytes(weights.params) == sum(copy) // 2
    assert sp.parameters.per_device == sum(on_device) == sp.copy  # dp: the whole copy each
    assert sp.frozen.total == sp.merged_copy.total == 0
    # XLA's arguments of the rollout program: the copy (its layers as per-layer copies,
    # paged.engine_params) and the prompts (B/2 rows of P ids and mask bits per device), a key
    # and the sampler's scalars; nothing of the optimizer's 12 MiB or the reference's.
    prompts = 6 // 2 * 128 * (4 + 1)
    extra = plan.rollout.arguments - sp.copy
    assert prompts <= extra <= prompts + 64
    # The per-layer copies are held beside the copy; its other weights are the copy's own.
    layers = _nbytes(weights.params["model"]["layers"])
    assert plan.rollout.resident == sp.copy - layers
    assert plan.rollout_peak == (
        sp.copy + layers + extra + plan.rollout.outputs + plan.rollout.temporaries
    )
    assert plan.peaks["weight sync"] == 2 * sp.copy  # the previous version while the next lands
    assert plan.kv_cache == P.kv_cache_bytes(
        P.model_config(config.model, accelerator=False),
        12,
        128 + 8,
        "float32",
        placement.rollout_mesh,
    )
    assert plan.kv_cache.per_device * 2 == plan.kv_cache.total  # 12 rows over the 2 rollout devices


@pytest.mark.slow
def test_split_plan_train_side_equals_the_colocated_plan_on_the_train_mesh(split_plan):
    _, plan = split_plan
    colocated = load_config(TINY, [*SPLIT, "placement.mode=colocated"])
    alone = P.plan_run(colocated, P.parse_target(devices=6, device_memory="1GiB"))
    assert alone.split is None and alone.mesh == plan.mesh
    for what in ("parameters", "optimizer", "reference", "critic", "batch", "frozen"):
        assert getattr(plan, what) == getattr(alone, what), what
    assert plan.state == alone.state
    u, v = plan.update, alone.update  # the same program on the same mesh shape
    assert (u.arguments, u.outputs, u.aliased) == (v.arguments, v.outputs, v.aliased)
    assert plan.update_flops_analytic == alone.update_flops_analytic
    # Colocated, the rollout runs next to the train state; split, next to its copy only.
    assert alone.rollout_peak > alone.state > plan.rollout_peak - plan.rollout.temporaries


@pytest.mark.slow
def test_split_plan_reports_both_sides_in_the_table_and_the_json(split_plan):
    _, plan = split_plan
    sides = plan.side_peaks
    assert sides == {
        "rollout": max(plan.peaks["rollout"], plan.peaks["weight sync"]),
        "train": plan.peaks["update"],
    }
    assert plan.peak == max(sides.values()) and plan.peak_side == "train"  # the update here
    assert plan.fits is True and plan.margin == GiB - plan.peak
    d = json.loads(json.dumps(plan.to_dict()))
    pd = d["placement"]
    assert pd["mode"] == "split" and pd["peak_side"] == "train"
    assert pd["rollout"]["devices"] == 2 and pd["train"]["devices"] == 6
    assert pd["rollout"]["per_device_bytes"]["peak"] == sides["rollout"]
    assert pd["train"]["per_device_bytes"]["peak"] == sides["train"]
    assert set(pd["rollout"]["per_device_bytes"]["peaks"]) == {"rollout", "weight sync"}
    assert "optimizer" not in pd["rollout"]["per_device_bytes"]
    assert pd["train"]["per_device_bytes"]["optimizer"]["per_device"] == plan.optimizer.per_device
    assert d["fits"] is True and d["margin_bytes"] == plan.margin
    text = P.format_plan(plan)
    train_block, rollout_block = text.split("rollout devices, per device")
    assert "train devices, per device" in train_block and "optimizer state" in train_block
    assert "optimizer" not in rollout_block and "reference" not in rollout_block
    assert "parameters (rollout copy)" in rollout_block and "KV cache" in rollout_block
    assert "placement split: 2 rollout + 6 train devices" in text
    assert "FITS (both sides; the train devices are the tighter)" in text


@pytest.mark.slow
def test_split_plan_of_the_paged_engine_runs_one_engine_per_rollout_data_shard():
    """Split placement, rollout.engine auto (paged): the rollout mesh (data 2) runs two paged
    engines of 3 prompts each, each pool whole on its device, next to the rollout copy."""
    config = load_config(TINY, [*SPLIT, "rollout.engine=auto"])
    plan = P.plan_run(config, P.parse_target(devices=8, device_memory="1GiB"))
    sp, pg = plan.split, plan.paged
    assert plan.rollout_engine == "paged" and (pg.engines, pg.prompts) == (2, 3)
    # 3·2 sequences in 8 slots; 1 GiB known: the pool holds every sequence's worst case
    assert (pg.options.num_slots, pg.options.num_pages) == (8, 1 + 6 * 9)
    assert plan.kv_cache.per_device == pg.pool.per_device and plan.kv_cache.total == (
        2 * pg.pool.per_device
    )
    _models, state = su.build_models(config, build_recipe(config))
    layers = _nbytes(state.params["model"]["layers"])
    # dp: the rollout copy, not copied again, less the per-layer copies of its layer weights
    assert plan.rollout.resident == sp.parameters.per_device - layers
    assert plan.rollout_peak == sp.copy + plan.rollout.bytes - plan.rollout.resident
    text = P.format_plan(plan)
    _, rollout_block = text.split("rollout devices, per device")
    assert "KV cache (paged pool)" in rollout_block
    assert "per engine, 2 engines (one per data shard)" in text


def test_split_plan_fits_only_if_both_sides_fit():
    """No compile: a rollout side over the memory fails the plan even when the update fits."""
    side = P.RolloutSide(2, 6, 1, {"data": 2, "fsdp": 1, "tensor": 1}, "dp", P.Bytes(3, 3, 3))
    base = dataclasses.replace(_fake_plan(), kv_cache=P.Bytes(1, 1, 0), split=side)
    big = P.Bytes(2 * 10**6, 2 * 10**6, 2 * 10**6)  # over the fake target's 1 MB
    over = dataclasses.replace(base, split=dataclasses.replace(side, parameters=big))
    assert base.fits is True and base.peak_side == "rollout"  # 6 bytes of sync vs 0
    assert over.fits is False and over.peak_side == "rollout" and over.peak == 2 * big.per_device
    assert over.side_peaks["train"] == 0 and over.margin == 10**6 - over.peak
    update = P.Program("update", 0, 0, 0, 2 * 10**6, 0, 0.0, 0.0)
    train_over = dataclasses.replace(base, update=update)
    assert train_over.fits is False and train_over.peak_side == "train"
    assert _fake_plan().peak_side is None and _fake_plan().side_peaks == {}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["mesh.data=4"], "does not divide the 6 train devices (of 8; 2 go to the rollout)"),
        (["placement.rollout_mesh.data=3"], "placement.rollout_mesh"),
        (["placement.rollout_fraction=0.3"], "placement.rollout_fraction = 0.3"),
    ],
)
def test_split_plan_bad_meshes_are_the_runs_errors(overrides, message):
    config = load_config(TINY, [*SPLIT, "mesh.fsdp=1", *overrides])
    with pytest.raises(P.PlanError) as e:
        P.plan_run(config, P.parse_target(devices=8))
    assert message in str(e.value) and "(target 8x GPU" in str(e.value)


def test_split_cli_bad_train_mesh_exits_2(capsys):
    argv = ["--config", TINY, "--devices", "8", *SPLIT, "mesh.fsdp=1", "mesh.data=4"]
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and out == "" and "6 train devices" in err


def test_rollout_copy_under_lora_is_what_rolloutweights_holds():
    """No compile: the plan's rollout copy under LoRA with ``merge_for_sampling`` (adapters,
    the frozen base's copy, the merged copy) has the shapes, shardings and bytes of the real
    RolloutWeights' arrays on the rollout mesh."""
    from jaxrl_llm.train import placement as pl

    config = load_config(TINY, [*SPLIT, "model.lora.rank=4", "model.lora.merge_for_sampling=true"])
    recipe = build_recipe(config)
    mesh, rules = su.make_mesh(config)
    placement = su.make_placement(config, mesh, rules)
    run = P.abstract_run(config, recipe, mesh, P.model_config(config.model, accelerator=False))
    params, frozen, merged, (graphdef, sampled) = P.rollout_copy(run, placement)
    assert graphdef is run.models.ref_graphdef and sampled is merged
    models, state = su.build_models(config, recipe, mesh=mesh)
    weights = pl.RolloutWeights.build(models, placement, state.params)
    weights.sync(state.params, 0)
    _, real_merged = weights.sampling_policy()
    device = placement.rollout_devices[0]

    def on_device(tree):
        return sum(
            s.data.nbytes
            for x in jax.tree.leaves(tree)
            for s in x.addressable_shards
            if s.device == device
        )

    def same(a, x):  # shape, dtype and an equivalent sharding (P(None,) is P())
        return (a.shape, a.dtype) == (x.shape, x.dtype) and a.sharding.is_equivalent_to(
            x.sharding, len(x.shape)
        )

    for abstract, real in [
        (params, weights.params),
        (frozen, weights.frozen),
        (merged, real_merged),
    ]:
        assert all(jax.tree.leaves(jax.tree.map(same, abstract, real)))
        assert P.tree_bytes(abstract).per_device == on_device(real) > 0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed")
def test_split_plan_on_a_multi_host_tpu_topology():
    """v5e:4x4 is 4 hosts of 4 chips: 0.25 carves one rollout chip per host (4 + 12), as the
    run does; both sides compile (on devices libtpu's deviceless compiler accepts, noted)."""
    split = ["placement.mode=split", "placement.rollout_fraction=0.25", "mesh.data=-1"]
    config = load_config(TINY, [*split, "rollout.prompts_per_step=12", "data.eval_size=0"])
    plan = P.plan_run(config, P.parse_target("v5e:4x4"))
    sp = plan.split
    assert (sp.hosts, sp.devices, sp.train_devices) == (4, 4, 12)
    assert plan.mesh == {"data": 12, "fsdp": 1, "tensor": 1} and sp.mesh["data"] == 4
    assert sp.parameters.per_device == plan.parameters.per_device == plan.parameters.total  # dp
    assert plan.rollout.arguments >= sp.copy and plan.fits is True
    (note,) = plan.notes  # the split's (the paged rollout is planned, not noted)
    assert plan.rollout_engine == "paged" and plan.paged.engines == 4
    assert "v5e:2x6 slice of its own" in note and "devices 0..3" in note


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed")
def test_a_colocated_multi_host_target_is_checked_per_host():
    """v5e:4x4 (4 hosts of 4 chips), colocated: an engine of 8 chips would span two hosts, and
    partial rollouts over the hosts refuse the static engine; both before any compile."""
    with pytest.raises(P.PlanError, match="of each process's 4"):
        P.plan_run(
            load_config(TINY, ["rollout.tensor_parallel=8", "rollout.engine=paged"]),
            P.parse_target("v5e:4x4"),
        )
    partial = ["train.max_staleness=2", "train.partial_rollout_tokens=3", "rollout.engine=static"]
    with pytest.raises(P.PlanError, match=r"rollout\.engine = static in a run of 4 processes"):
        P.plan_run(load_config(TINY, partial), P.parse_target("v5e:4x4"))


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed")
def test_split_tpu_plan_that_libtpu_cannot_compile_is_a_clear_error():
    """v5e:2x2 (one host) at 0.25: 1 rollout + 3 train chips; 3 neither divides 4 nor is a
    slice: refused before any compile (libtpu would abort the process)."""
    split = ["placement.mode=split", "placement.rollout_fraction=0.25", "mesh.data=-1"]
    config = load_config(TINY, [*split, "rollout.prompts_per_step=3", "data.eval_size=0"])
    with pytest.raises(P.PlanError) as e:
        P.plan_run(config, P.parse_target("v5e:2x2"))
    assert "placement.rollout_fraction = 0.25: the train side's 3 chips of v5e:2x2" in str(e.value)
