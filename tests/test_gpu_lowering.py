"""The GPU programs, lowered for CUDA on a machine without a GPU.

CI has no GPU, and a device session is rare and short, so a GPU program that does not even
lower (a Pallas kernel's Triton lowering rule refusing a block shape, a cuDNN attention call
refusing its arguments) would otherwise first fail on the device. JAX lowers for a platform
it has no device of (``jit(f).trace(...).lower(lowering_platforms=("cuda",))``): the Pallas
GPU kernel goes through its Triton lowering, and ``jax.nn.dot_product_attention(
implementation="cudnn")`` through its cuDNN checks and custom call. That needs nothing but
JAX. XLA:GPU's own compile without a GPU needs JAX's CUDA plugin (``jaxrl-llm plan
--topology h200-8``, tests/train/test_plan.py); the kernels' numbers and speed need the
device (``scripts/bench_accelerator.py``).

cuDNN attention asks the installed cuDNN for its version and the GPU for its compute
capability while tracing; :func:`hopper` answers for an H100/H200 (cuDNN 9.8, sm_90), patched
into ``jax._src.cudnn.fused_attention_stablehlo`` (a private module: the tests skip, saying
so, where it has moved).
"""

import collections
import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxrl_llm import models
from jaxrl_llm.config import build_recipe, load_config
from jaxrl_llm.models import sharding as shd
from jaxrl_llm.train import plan as P

TINY = "configs/tiny.yaml"
LLAMA_1B = "configs/models/llama-3.2-1b"
CUDNN_FWD, CUDNN_BWD = "__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"
TRITON = "__gpu$xla.gpu.triton"


@pytest.fixture
def hopper(monkeypatch):
    """cuDNN 9.8 on an sm_90 GPU, as jax's cuDNN attention asks while tracing."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError as e:
        pytest.skip(f"jax's cuDNN attention module moved ({e})")
    names = ("check_cudnn_version", "check_compute_capability", "is_cuda_compute_capability_equal")
    missing = [n for n in names if not hasattr(fa, n)]
    if missing:
        pytest.skip(f"jax's cuDNN attention module has no {missing}")

    def capability(c: str) -> tuple[int, ...]:
        return tuple(int(x) for x in c.split("."))

    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 90800)
    monkeypatch.setattr(fa, "check_compute_capability", lambda c: capability(c) <= (9, 0))
    monkeypatch.setattr(fa, "is_cuda_compute_capability_equal", lambda c: capability(c) == (9, 0))


def custom_calls(lowered: jax.stages.Lowered) -> collections.Counter:
    """The custom-call targets of a lowered program (StableHLO text), counted."""
    return collections.Counter(re.findall(r"custom_call @([^(\s]+)\(", lowered.as_text()))


def float32_dots(lowered: jax.stages.Lowered) -> list[str]:
    """The signatures of the dots that take a float32 operand (StableHLO text). In a bf16
    program these are TF32 GEMMs on a GPU, at half the bf16 rate: an H200 run found the
    backward pass's dots all float32 before ``transformer.low_precision_dot``."""
    sig = r"stablehlo\.dot_general [^\n]*: \((tensor<[^>]+>), (tensor<[^>]+>)\)"
    return [f"{a}, {b}" for a, b in re.findall(sig, lowered.as_text()) if "f32>" in a + b]


def lower_for_cuda(fn, *args, **kwargs) -> jax.stages.Lowered:
    """``fn.trace(*args, **kwargs)`` lowered for CUDA, for an H200: the Pallas Triton lowering
    reads the GPU's kind (its compute capability) from the abstract mesh's device when this
    machine has no GPU (jax >= 0.11; earlier releases lower without asking)."""
    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h200)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # a device assignment to lower for

    def placed(x):
        if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)
        return x

    args = jax.tree.map(placed, args)
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
        warnings.filterwarnings("error", "paged prefill: cuDNN attention refused")  # no fallback
        return fn.trace(*args, **kwargs).lower(lowering_platforms=("cuda",))


def gpu_config(*overrides: str):
    config = load_config(TINY, ["model.dtype=bfloat16", *overrides])
    return config, P.model_config(config.model, accelerator=True)


def lowered_update(config, cfg) -> jax.stages.Lowered:
    """The trainer's fused RL step of ``config`` (via the plan's abstract run, one device)
    lowered for CUDA, traced for a GPU."""
    recipe = build_recipe(config)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    run = P.abstract_run(config, recipe, mesh, cfg)
    return P.lower_step(run, config, recipe, platform="gpu", lowering_platforms=("cuda",))


def abstract_model(cfg):
    """``(graphdef, params)`` of a model of config ``cfg``: shapes only, nothing allocated."""
    return nnx.split(nnx.eval_shape(lambda: models.CausalLM(cfg, rngs=nnx.Rngs(0))))


# ---------------------------------------------------------------------------------------------
# The trainer's update step.


@pytest.mark.parametrize(
    "overrides",
    [
        (),  # packed rows (the default): segments in the attention mask
        ("train.packing=false",),  # left-padded [N, P + T] rows
        ("model.remat=full", "optim.micro_batch_tokens=256"),  # the fused-accumulation scan
        (f"model.path={LLAMA_1B}", "model.remat=full"),  # 1B-class shapes, GQA 32:8, Dh 64
        ("model.attention=auto",),  # traced for the GPU (attention.for_platform): cuDNN
    ],
    ids=["packed", "unpacked", "remat-micro", "llama-1b", "auto"],
)
def test_update_step_lowers_for_cuda_with_cudnn_attention(hopper, overrides):
    """The fused RL step (the trainer's own, via the plan's abstract run) with
    ``model.attention=cudnn`` in bfloat16: cuDNN's forward and backward attention calls in the
    program, no fallback to the reference; every dot, forward and backward, on bf16 operands."""
    lowered = lowered_update(*gpu_config("model.attention=cudnn", *overrides))
    calls = custom_calls(lowered)
    assert calls[CUDNN_FWD] >= 1 and calls[CUDNN_BWD] >= 1, calls
    assert not float32_dots(lowered)


@pytest.mark.parametrize(
    "overrides",
    [(), (f"model.path={LLAMA_1B}", "model.remat=full")],
    ids=["packed", "llama-1b-remat"],
)
def test_update_step_lowers_for_cuda_with_pallas_gpu_attention(overrides):
    """``model.attention=pallas_gpu``: the update's attention is Triton kernels (forward, and the
    backward's dq and dk/dv), with no cuDNN call and no fallback to the reference attention
    (whose scores would be float32 dots); packed rows are a multiple of its 16-token block.
    The non-finite skip is selects, not a conditional (XLA:GPU copies the parameters and the
    optimizer state into a conditional's result: ``accumulate._apply``)."""
    lowered = lowered_update(*gpu_config("model.attention=pallas_gpu", *overrides))
    calls = custom_calls(lowered)
    assert calls[TRITON] >= 3 and not calls[CUDNN_FWD] and not calls[CUDNN_BWD], calls
    assert not float32_dots(lowered)
    text = lowered.as_text()
    assert "stablehlo.case" not in text and "stablehlo.if" not in text
    names = set(re.findall(r'name = "(mha_[a-z_]+)"', text))
    assert {"mha_forward", "mha_backward"} <= names, names
    # the mask is one int32 id per token: no [B, 1, T, S] operand, as cuDNN's
    forward = [
        ln for ln in text.splitlines() if f"custom_call @{TRITON}(" in ln and "mha_forward" in ln
    ]
    operands = re.findall(r"tensor<([0-9x]+)x(\w+)>", forward[0].split(" : (")[-1])
    assert operands[3][1] == "i32" and operands[3][0].count("x") == 1, operands


def test_the_1b_update_forms_accelerator_sized_logits_blocks():
    """scripts/bench_accelerator.py's plan-part step (1B, 8 × 8 × (128 + 256) tokens, packed,
    8-sequence micro-batches) planned for an accelerator: the log-prob pass forms logits in
    blocks of 1,024 × 128,256 (``ModelConfig.logits_block_rows``), not the CPU's 256 rows (an
    H200 profile found 72 small blocks, ~7% of the step; a packed micro-batch's few wide rows
    kept 256-row blocks until the time chunk grew with the block)."""
    overrides = [
        f"model.path={LLAMA_1B}",
        "model.dtype=bfloat16",
        "model.remat=full",
        "rollout.prompts_per_step=8",
        "rollout.num_samples=8",
        "rollout.max_new_tokens=256",
        "data.max_prompt_length=128",
        "optim.micro_batch_size=8",
    ]
    config, cfg = gpu_config(*overrides)
    recipe = build_recipe(config)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    text = P.lower_step(P.abstract_run(config, recipe, mesh, cfg), config, recipe).as_text()
    blocks = set(re.findall(rf"tensor<(\d+)x{cfg.vocab_size}xf32>", text))
    assert blocks == {"1024"}, blocks


# ---------------------------------------------------------------------------------------------
# The rollout engines.


def _paged_worst_case(cfg, params, *, prompts, prompt_len, new_tokens, num_samples=1, tuning=()):
    from jaxrl_llm.rollout import paged

    options = paged.resolve_options(
        paged.PagedOptions(num_slots=prompts * num_samples, kernel_tuning=tuning),
        num_seqs=prompts * num_samples,
        num_samples=num_samples,
        longest_prompt=prompt_len,
        max_new_tokens=new_tokens,
    )
    kernel = paged.attention_kernel(cfg, options, jnp.bfloat16, platform="gpu")
    assert kernel is not None and kernel.name == "pallas_gpu" and not kernel.interpret
    assert kernel.prefill_impl == "cudnn"
    return paged.worst_case_programs(
        cfg,
        params,
        options,
        kernel,
        num_prompts=prompts,
        num_samples=num_samples,
        longest_prompt=prompt_len,
        max_new_tokens=new_tokens,
        greedy=False,
        top_k=0,
        top_p=1.0,
        pad_token_id=0,
        cache_dtype=jnp.bfloat16,
        num_stop_ids=8,
    )


@pytest.mark.parametrize(
    "model, shape",
    [
        ("tiny-random", dict(prompts=3, prompt_len=40, new_tokens=24, num_samples=2)),
        # SmolLM2-135M: 3 query heads per KV head (not a power of two), Dh 64
        ("smollm2", dict(prompts=8, prompt_len=64, new_tokens=64, num_samples=4)),
        # scripts/bench_accelerator.py's decode part: 256 rows, 128-token prompts, 256 new
        (LLAMA_1B, dict(prompts=256, prompt_len=128, new_tokens=256)),
    ],
    ids=["tiny", "smollm2", "llama-1b-bench"],
)
def test_paged_engine_programs_lower_for_cuda_with_the_gpu_kernels(hopper, request, model, shape):
    """The paged engine's largest ``_decode`` and ``_prefill`` calls (the shapes ``run``
    makes, :func:`~jaxrl_llm.rollout.paged.worst_case_programs`) with ``attention="auto"`` on a
    GPU: decode through the Pallas ``paged_attention`` kernel's Triton lowering, prefill
    through cuDNN, one call per layer: the layers run unrolled on per-layer weights (in a
    ``scan`` XLA:GPU copied every layer's kernels out of the stack at each decode step)."""
    if model == "smollm2":
        model = request.getfixturevalue("smollm2_path")
    _, cfg = gpu_config(f"model.path={model}")
    graphdef, params = abstract_model(cfg)
    worst = _paged_worst_case(cfg, params, **shape)
    decode_text = lower_for_cuda(
        worst.decode.fn, graphdef, *worst.decode.args, static=worst.decode.static
    ).as_text()
    prefill = custom_calls(
        lower_for_cuda(worst.prefill.fn, graphdef, *worst.prefill.args, static=worst.prefill.static)
    )
    assert re.findall(r"custom_call @([^(\s]+)\(", decode_text) == [TRITON]  # the kernel
    kernel_calls = re.findall(r"call @paged_attention\b", decode_text)
    assert len(kernel_calls) == cfg.num_layers  # unrolled: one call per layer
    assert "dynamic_slice" not in decode_text  # nothing sliced out of the stacked weights
    assert prefill[CUDNN_FWD] >= 1 and CUDNN_BWD not in prefill, prefill


def test_tuned_gpu_decode_kernel_lowers_for_cuda(hopper):
    """The decode part's 1B shapes at batch 256 with launch parameters other than the
    defaults (``PagedOptions.kernel_tuning``: what the ``decode_tuning`` part of
    scripts/bench_accelerator.py sweeps) still go through the Triton lowering, and the kernel
    is launched with them (its grid: KV heads × the context split in two)."""
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged

    _, cfg = gpu_config(f"model.path={LLAMA_1B}")
    graphdef, params = abstract_model(cfg)
    tuning = {"pages_per_compute_block": 4, "k_splits": 2, "num_warps": 4, "num_stages": 3}
    worst = _paged_worst_case(
        cfg, params, prompts=256, prompt_len=128, new_tokens=256, tuning=tuning
    )
    launches, kernel = [], gpu_paged.paged_attention

    def recording(*args, **kwargs):
        launches.append(kwargs)
        return kernel(*args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(gpu_paged, "paged_attention", recording)
        jax.clear_caches()
        text = lower_for_cuda(
            worst.decode.fn, graphdef, *worst.decode.args, static=worst.decode.static
        ).as_text()
    assert re.findall(r"custom_call @([^(\s]+)\(", text) == [TRITON]
    assert len(launches) == cfg.num_layers
    assert {(k, launches[0][k]) for k in tuning} == set(tuning.items())


def test_bench_accelerator_mfu_program_lowers_for_cuda(hopper):
    """scripts/bench_accelerator.py's MFU part (1B-class, bf16, 8 × 2048 tokens, forward and
    backward of the log-prob pass) with the attention ``auto`` resolves to on a GPU."""
    from jaxrl_llm.train import forward

    _, cfg = gpu_config(f"model.path={LLAMA_1B}", "model.attention=cudnn")
    graphdef, params = abstract_model(cfg)
    b, t = 8, 2048
    tokens, mask = jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b, t), bool)

    def loss(p, tokens, mask):
        logp = forward.completion_logprobs_nt(graphdef, p, tokens, mask, completion_len=t // 2)
        return jnp.mean(logp)

    lowered = lower_for_cuda(jax.jit(jax.value_and_grad(loss)), params, tokens, mask)
    calls = custom_calls(lowered)
    assert calls[CUDNN_FWD] >= 1 and calls[CUDNN_BWD] >= 1, calls
    assert not float32_dots(lowered)  # the LM head's backward dots included


def test_tensor_parallel_engine_programs_lower_for_cuda_per_device(hopper):
    """A two-GPU paged engine (``tensor_parallel=2``, regrouped from an FSDP mesh; CPU devices
    stand in for the GPUs): its decode and prefill lower for CUDA with the kernels inside the
    per-device ``shard_map`` (decode: the Pallas kernel's Triton lowering once per layer;
    prefill: cuDNN), each device on its own heads."""
    from jaxrl_llm.rollout import paged, paged_dp

    _, cfg = gpu_config()
    graphdef, params = abstract_model(cfg)
    rmesh = paged_dp.regroup_mesh(shd.make_mesh(fsdp=4, devices=jax.devices()[:4]), 2)
    engine = paged_dp.data_shard_meshes(rmesh)[0]
    args = paged_dp.abstract_regroup(
        graphdef, paged.abstract_engine_params(params, jnp.bfloat16), rmesh
    )
    args = paged_dp.abstract_shard_params(args, rmesh, engine)
    options = paged.resolve_options(
        paged.PagedOptions(num_slots=6), num_seqs=6, num_samples=2, longest_prompt=40,
        max_new_tokens=24,
    )  # fmt: skip
    kernel = paged.attention_kernel(cfg, options, jnp.bfloat16, mesh=engine, platform="gpu")
    assert kernel is not None and kernel.name == "pallas_gpu" and kernel.prefill_impl == "cudnn"
    worst = paged.worst_case_programs(
        cfg, args, options, kernel, num_prompts=3, num_samples=2, longest_prompt=40,
        max_new_tokens=24, greedy=False, top_k=0, top_p=1.0, pad_token_id=0,
        cache_dtype=jnp.bfloat16, num_stop_ids=8,
        sharding=jax.sharding.NamedSharding(engine, jax.P()),
    )  # fmt: skip
    texts = {}
    for which in ("decode", "prefill"):
        call = getattr(worst, which)
        with jax.set_mesh(engine), warnings.catch_warnings():
            traced = call.fn.trace(graphdef, *call.args, static=call.static)
            texts[which] = traced.lower(lowering_platforms=("cuda",)).as_text()
    calls = {w: set(re.findall(r"custom_call @([^(\s]+)\(", t)) for w, t in texts.items()}
    assert calls == {"decode": {TRITON}, "prefill": {CUDNN_FWD}}, calls
    assert len(re.findall(r"call @paged_attention\b", texts["decode"])) == cfg.num_layers
    assert all("sdy.manual_computation" in t or "shard_map" in t for t in texts.values())
