"""Everything that needs a lent GPU/TPU, as one prepared script writing one JSON (issue 15).

    python scripts/bench_accelerator.py --out /tmp/bench.json            # the device run
    python scripts/bench_accelerator.py --tiny --out /tmp/bench.json     # CPU, tiny shapes

Ten parts, each in a fresh Python (so that ``device.memory_stats()["peak_bytes_in_use"]``,
which cannot be reset, is that part's own peak), run in the order of :data:`PARTS`; all shapes
are random weights from a ``config.json`` (``configs/models/llama-3.2-1b``: Llama-3.2-1B's
published shapes, 1.236 B parameters), so nothing is downloaded:

``check``    the accelerator paths' numbers, before any speed is measured: bf16 inputs through
             the platform's kernel (``attention="auto"``: cuDNN on a GPU, splash on a TPU;
             on CPU, the cuDNN call's own XLA form) and through the reference attention,
             both against the reference in float32, on left-padded rows and on packed rows
             (segments): outputs and the q/k/v gradients; then the trainer's log-prob pass
             (forward and parameter gradient) with the model's attention against the same
             weights with the reference; then the paged engine with the platform's kernel
             (greedy): its log-probs of its own tokens against the trainer's float32 pass over
             them. A kernel passes where its relative L2 error is at most 4x the bf16
             reference path's own (the rounding of bf16 inputs), or 1% (``ok``). On the
             device, the 1B model's first 4 layers (its shapes, a quarter of the compiles).
``plan``     :func:`jaxrl_llm.train.plan.plan_run` of a GRPO run (``--config``, default the
             1B model, 8 prompts x 8 samples x 256 tokens, FSDP over ``--devices``) for this
             process's devices, then the same run's state built for real (random weights, the
             trainer's optimizer, shardings and reference), one rollout and one fused GRPO step
             (:func:`jaxrl_llm.train.step.make_rl_step`), timed; the measured peak against the
             planned one (the issue's check: within 10%), and that step's update MFU (issue
             13's figure, from the trainer's own fused step: :func:`update_model_flops` over
             the steady step time, per device, over the chip's bf16 peak). Memory measured:
             ``memory_stats()`` on a GPU/TPU; on CPU, which reports none, the process's
             resident memory (``VmHWM`` of /proc, reset before the step with
             ``/proc/self/clear_refs``, large allocations forced to mmap so freed memory leaves
             the count) during the update program, plus the bytes of the arrays it takes.
``mfu``      bf16 forward + backward of the trainer's log-prob pass (``completion_logprobs_nt``,
             mean over the tokens) on ``[B, S]`` tokens; model FLOPs per token (PaLM,
             Chowdhery et al. 2022, app. B): ``6·N + 12·L·H·Dh·S`` with ``N`` the parameters in
             matmuls; MFU = FLOP/s over the chip's dense bf16 peak (:data:`CHIPS`).
``update``   the same run's fused GRPO update step alone (a synthetic rollout, no sampling)
             under a few settings of remat and micro-batch size (:func:`part_update`): the
             update MFU of each, since remat's recomputation is hardware FLOPs that MFU does not
             count, and issue 13's 45% may need a setting other than the plan part's.
``decode``   the paged engine (:func:`jaxrl_llm.rollout.generate`, ``engine="paged"``, the
             trainer's default; bf16 weights and KV cache; every row in a slot; the platform's
             attention kernel, named in the result) at batch 256: decode tokens/s from
             ``t(T new tokens) − t(1 new token)`` (prefill taken out), and the HBM roofline
             ``B / (bytes per decode step / HBM bandwidth)``, a step reading the bf16 weights
             (``2·N``) and the KV cache (``2·L·B·K·Dh·(P + T/2)`` bf16 elements on average).
``decode_dense``   the paged engine with ``attention="reference"``: each dispatch gathers its
             rows' pages into a dense context and XLA attends over it, as on CPU (on the H200
             the static engine, whose attention is XLA's too, decoded 1.63x faster than the
             paged one with the Pallas kernel).
``decode_static``  the same with the static (dense-cache) engine.
``update_attention``  the ``plan`` part's fused GRPO update (remat full, 8-sequence
             micro-batches) with ``model.attention=cudnn`` and with ``pallas_gpu`` (the Pallas
             Triton flash attention with O(T) segment ids instead of cuDNN's dense
             ``[B, 1, T, S]`` mask), side by side; the ``check`` part checks the numbers of both.
``pool_fit``  the paged pool sized from the device's memory (``rollout.memory_utilization``,
             the trainer's default) on the real allocator (:func:`part_pool_fit`): a u that
             leaves half of every sequence's worst case, then whether the engine got that
             pool, preempted, kept the peak under ``u · bytes_limit`` and sampled a large
             pool's tokens.
``decode_tuning``  the ``decode`` part, then the decode again with a few other launch
             parameters of the Pallas kernel (``PagedOptions.kernel_tuning``: pages per
             compute block, warps, pipeline stages; the defaults ran at ~35% of HBM bandwidth
             on the H200); each compiles its programs anew (~13 s there).

The parts' results are merged into one JSON (``parts``: name → result, or its error),
rewritten after each part. ``--profile DIR`` adds, after each part's timings, one more call of
its program under ``jax.profiler`` and the ops that took the device's time
(:func:`summarize_trace`: busy vs span, the top ops, the programs, the kernel kinds), under
the part's ``profile`` key; the traces stay in ``DIR``. Budget: each part's subprocess
timeout (:data:`BUDGETS`; ``--budget-s`` sets all), and the whole run stops starting parts at
``--total-budget-s`` (:data:`TOTAL_BUDGET_S`, inside one device command's 10 minutes). On the
lent H200 (Python 3.12 with jax 0.11 and CUDA 13 in its image; no install needed: the parts
import the working tree), from the repository root::

    PYTHONPATH=$PWD python3 scripts/bench_accelerator.py --parts check,mfu,update \
        --profile /tmp/prof --out $OUT/bench_a.json
    PYTHONPATH=$PWD python3 scripts/bench_accelerator.py \
        --parts decode,decode_dense,decode_static,plan --profile /tmp/prof --out $OUT/bench_b.json
    PYTHONPATH=$PWD python3 scripts/bench_accelerator.py \
        --parts pool_fit,decode_tuning,update_attention --out $OUT/bench_c.json

(several device commands: the parts need ~600 s there, more than one command's limit; the
third, ~90 + ~40 s and the pool fit's (not yet run on a device), only if device time is
left).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
MODEL_1B = str(ROOT / "configs" / "models" / "llama-3.2-1b")
TINY_CONFIG = str(ROOT / "configs" / "tiny.yaml")

#: Dense bf16 FLOP/s and HBM bytes/s per chip (one JAX device), from the vendors' data sheets:
#: NVIDIA H100/H200 SXM (989.4 TFLOP/s dense bf16; 3.35 / 4.8 TB/s), A100 SXM 80 GB (312;
#: 2.039 TB/s), Google Cloud TPU v5e (197; 819 GB/s), v5p (459; 2765 GB/s), v6e (918; 1640 GB/s).
CHIPS = {
    "H200": (989.4e12, 4.8e12),
    "H100": (989.4e12, 3.35e12),
    "A100": (312e12, 2.039e12),
    "TPU v5 lite": (197e12, 819e9),
    "TPU v5e": (197e12, 819e9),
    "TPU v5p": (459e12, 2765e9),
    "TPU v5": (459e12, 2765e9),
    "TPU v6 lite": (918e12, 1640e9),
    "TPU v6e": (918e12, 1640e9),
}

#: The 1B GRPO run of the ``plan`` and ``update`` parts: 8 prompts x 8 samples x (128 + 256)
#: tokens, bf16 compute, FSDP over the devices; the plan part adds remat full and 8-sequence
#: micro-batches, the update part varies those two.
RUN_1B = [
    f"model.path={MODEL_1B}",
    "model.dtype=auto",
    "rollout.prompts_per_step=8",
    "rollout.num_samples=8",
    "rollout.max_new_tokens=256",
    "data.max_prompt_length=128",
    "data.eval_size=0",
    "kl.reference_param_dtype=bfloat16",
    "mesh.preset=fsdp",
    "mesh.data=1",
    "mesh.fsdp=-1",
]

#: The shapes of each part: the device run, and the CPU test's (``--tiny``).
SHAPES = {
    "device": {
        "plan": {
            "config": TINY_CONFIG,
            "overrides": [*RUN_1B, "model.remat=full", "optim.micro_batch_size=8"],
        },
        "update": {
            "config": TINY_CONFIG,
            "overrides": RUN_1B,
            "variants": {  # one factor at a time: micro-batch size, then remat on the whole
                "remat_full_mb8": ["model.remat=full", "optim.micro_batch_size=8"],  # plan's
                "remat_full_mb64": ["model.remat=full", "optim.micro_batch_size=64"],
                "remat_dots_mb64": ["model.remat=dots", "optim.micro_batch_size=64"],
                # no remat on 32 sequences fits an H100 (53.7 GiB of its 59.3 at JAX's 0.75);
                # on 64, an H200 only (77.7 GiB): deviceless XLA:GPU plans, BENCHMARKS.md
                "no_remat_mb32": ["model.remat=none", "optim.micro_batch_size=32"],
                "no_remat_mb64": ["model.remat=none", "optim.micro_batch_size=64"],
            },
            "steps": 3,
        },
        "update_attention": {  # cuDNN's dense mask against Pallas's O(T) segment ids
            "config": TINY_CONFIG,
            "overrides": [*RUN_1B, "model.remat=full", "optim.micro_batch_size=8"],
            "variants": {
                "cudnn": ["model.attention=cudnn"],
                "pallas_gpu": ["model.attention=pallas_gpu"],
            },
            "steps": 3,
        },
        "check": {"model": MODEL_1B, "layers": 4, "batch": 4, "prompt": 128, "new": 32},
        "mfu": {"model": MODEL_1B, "batch": 8, "seq": 2048, "steps": 5},
        "decode": {"model": MODEL_1B, "batch": 256, "prompt": 128, "new": 256},
        "decode_dense": {
            "model": MODEL_1B,
            "batch": 256,
            "prompt": 128,
            "new": 256,
            "attention": "reference",
        },
        "decode_tuning": {
            "model": MODEL_1B,
            "batch": 256,
            "prompt": 128,
            "new": 256,
            "tunings": {  # the defaults: 8 pages per block, 1 split, 8 warps, 2 stages
                "pages16": {"pages_per_compute_block": 16},
                "pages4_warps4": {"pages_per_compute_block": 4, "num_warps": 4},
                "stages3": {"num_stages": 3},
            },
        },
        "decode_static": {
            "model": MODEL_1B,
            "batch": 256,
            "prompt": 128,
            "new": 256,
            "engine": "static",
        },
        "pool_fit": {"model": MODEL_1B, "batch": 256, "prompt": 128, "new": 256},
    },
    "tiny": {
        "plan": {"config": TINY_CONFIG, "overrides": ["data.eval_size=0"]},
        "update": {
            "config": TINY_CONFIG,
            "overrides": ["data.eval_size=0"],
            "variants": {"remat_full": ["model.remat=full"], "no_remat": ["model.remat=none"]},
            "steps": 1,
        },
        "update_attention": {
            "config": TINY_CONFIG,
            "overrides": ["data.eval_size=0"],
            "variants": {
                "reference": ["model.attention=reference"],
                "pallas_gpu": ["model.attention=pallas_gpu"],
            },
            "steps": 1,
        },
        "check": {"model": "tiny-random", "batch": 2, "prompt": 16, "new": 4},
        "mfu": {"model": "tiny-random", "batch": 2, "seq": 32, "steps": 1},
        "decode": {"model": "tiny-random", "batch": 4, "prompt": 16, "new": 4},
        "decode_dense": {
            "model": "tiny-random",
            "batch": 4,
            "prompt": 16,
            "new": 4,
            "attention": "reference",
        },
        "decode_tuning": {
            "model": "tiny-random",
            "batch": 4,
            "prompt": 16,
            "new": 4,
            "tunings": {"pages1": {"pages_per_compute_block": 1}},
        },
        "decode_static": {
            "model": "tiny-random",
            "batch": 4,
            "prompt": 16,
            "new": 4,
            "engine": "static",
        },
        "pool_fit": {"model": "tiny-random", "batch": 4, "prompt": 16, "new": 8},
    },
}


def chip_peaks(device_kind: str) -> tuple[float | None, float | None]:
    """``(bf16 FLOP/s, HBM bytes/s)`` of a ``device.device_kind`` (None, None: unknown, CPU)."""
    for name, peaks in CHIPS.items():
        if name.lower() in device_kind.lower():
            return peaks
    return None, None


def _model_config(path: str, *, dtype: str = "bfloat16", remat: str = "none"):
    from jaxrl_llm.config import load_config
    from jaxrl_llm.train import plan as P

    overrides = [f"model.path={path}", f"model.dtype={dtype}", f"model.remat={remat}"]
    return P.model_config(load_config(TINY_CONFIG, overrides).model, accelerator=True)


def _random_model(cfg, seed: int = 0):
    from flax import nnx

    from jaxrl_llm import models

    return models.CausalLM(cfg, rngs=nnx.Rngs(seed))


def matmul_parameters(cfg, num_parameters: int) -> int:
    """Parameters that take part in a matmul per token: all but an untied input embedding."""
    tied = getattr(cfg, "tie_word_embeddings", False)
    return num_parameters - (0 if tied else cfg.vocab_size * cfg.hidden_size)


def update_model_flops(
    cfg,
    num_parameters: int,
    *,
    sequences: int,
    prompt_len: int,
    completion_len: int,
    forward_passes: int,
) -> float:
    """Model FLOPs of one fused RL update step over ``sequences`` rows of ``prompt_len +
    completion_len`` real tokens (PaLM, Chowdhery et al. 2022, app. B, as :func:`part_mfu`):
    the policy's forward and backward, ``6·N'`` per token with ``N'`` the matmul parameters
    outside the LM head, plus the head's ``6·V·D`` on completion tokens only (the step computes
    log-probs there only; packed updates run the head on those columns), plus attention's
    ``12·L·H·Dh·S`` per token (``S = P + T``, causality not discounted, as :func:`part_mfu`);
    and each of ``forward_passes`` extra forward passes (π_ref, a recomputed π_old) a third of
    that. Activation recomputation (remat) is not counted: model FLOPs, not hardware FLOPs."""
    s = prompt_len + completion_len
    head = cfg.vocab_size * cfg.hidden_size
    body = matmul_parameters(cfg, num_parameters) - head  # tied or not, the head is in there
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * s
    per_sequence = 6 * body * s + 6 * head * completion_len + attention * s
    return float(sequences * per_sequence * (1 + forward_passes / 3))


# ---------------------------------------------------------------------------------------------
# Profiles (``--profile``): one more call of a part's timed program under ``jax.profiler``,
# after its timings (so that tracing costs them nothing), summarised to the ops that took the
# device's time.

#: Set by ``--profile DIR`` for the parts' subprocesses.
PROFILE_ENV = "JAXRL_BENCH_PROFILE_DIR"


@contextlib.contextmanager
def profiled(name: str, out: dict):
    """Trace the block into ``$JAXRL_BENCH_PROFILE_DIR/name`` and put its summary
    (:func:`summarize_trace`) in ``out["profile"][name]``; nothing when the variable is unset."""
    root = os.environ.get(PROFILE_ENV)
    if not root:
        yield
        return
    import jax

    where = Path(root) / name
    with jax.profiler.trace(str(where), create_perfetto_trace=True):
        yield
    out.setdefault("profile", {})[name] = summarize_trace(where)


#: Kernel kinds by name, the first match wins (cuBLAS/cuDNN/XLA/Pallas names as seen on the
#: H200; BENCHMARKS.md "Accelerator runs"): float32/TF32 GEMMs apart, since in a bf16 program
#: they are a defect (``transformer.low_precision_dot``).
KERNEL_KINDS = (
    ("gemm_f32", r"f32f32_tf32|f32f32_f32|sgemm"),
    ("attention", r"cudnn|sdpa|fmha|flash|paged_attention|ragged"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|matmul|\bdot"),
    ("copy", r"memcpy|memset|copy"),
    ("convert", r"convert"),
)


def kernel_kind(name: str) -> str:
    """The :data:`KERNEL_KINDS` entry a kernel's name matches, else ``"other"``."""
    return next((kind for kind, pattern in KERNEL_KINDS if re.search(pattern, name)), "other")


def summarize_trace(where: Path, top: int = 25) -> dict:
    """The device time of a ``jax.profiler`` trace (its ``perfetto_trace.json.gz``), by op.

    Events are the XLA ops' executions (trace events with an ``hlo_op``): on a GPU the kernels
    on the device's streams (``/device:GPU:N``, threads named ``Stream ...``: the derived "XLA
    Ops" and "XLA Modules" lines would count the same time twice), on a CPU the host threads
    that run them. ``busy_ms`` is the union of their intervals, ``span_ms`` first start to last
    end: the difference is time the device waited (for the host, dispatch, transfers).
    ``ops`` are the ``top`` ops by total time, with their program (``hlo_module``) and kernel
    (the event's name); ``modules`` the programs' totals; ``kinds`` the time by
    :func:`kernel_kind`."""
    import gzip

    files = sorted(where.glob("**/perfetto_trace.json.gz"))
    if not files:
        return {"error": f"no perfetto_trace.json.gz under {where}"}
    with gzip.open(files[-1], "rt") as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e["args"]["name"]
    ops = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
    device_pids = {p for p, n in processes.items() if re.match(r"/device:(GPU|TPU):\d+$", n)}
    if device_pids:
        ops = [e for e in ops if e["pid"] in device_pids]
        streams = [e for e in ops if threads.get((e["pid"], e.get("tid")), "").startswith("Stream")]
        ops = streams or ops
    if not ops:
        return {"error": "no XLA op events in the trace", "processes": sorted(processes.values())}
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in ops)
    busy, end = 0.0, spans[0][0]
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    by_op, by_module, by_kind = {}, {}, {}
    for e in ops:
        a = e["args"]
        key = (a.get("hlo_module", "?"), a["hlo_op"], e["name"])
        n, t = by_op.get(key, (0, 0.0))
        by_op[key] = (n + 1, t + e["dur"])
        by_module[key[0]] = by_module.get(key[0], 0.0) + e["dur"]
        kind = kernel_kind(e["name"])
        by_kind[kind] = by_kind.get(kind, 0.0) + e["dur"]
    total = sum(t for _, t in by_op.values())
    ranked = sorted(by_op.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "threads": sorted({threads.get((e["pid"], e.get("tid")), "?") for e in ops}),
        "events": len(ops),
        "span_ms": (end - spans[0][0]) / 1e3,
        "busy_ms": busy / 1e3,
        "op_time_ms": total / 1e3,
        "ops": [
            {"module": m, "op": o, "kernel": k[:120], "count": n, "ms": t / 1e3, "share": t / total}
            for (m, o, k), (n, t) in ranked
        ],
        "modules": {m: t / 1e3 for m, t in sorted(by_module.items(), key=lambda kv: -kv[1])},
        "kinds": {k: t / 1e3 for k, t in sorted(by_kind.items(), key=lambda kv: -kv[1])},
    }


# ---------------------------------------------------------------------------------------------
# Parts.


def part_mfu(model: str, batch: int, seq: int, steps: int) -> dict:
    """bf16 forward + backward of the log-prob pass; see the module docstring."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_llm.train import forward
    from jaxrl_llm.train import state as st

    cfg = _model_config(model)
    graphdef, params = st.split_params(_random_model(cfg))
    n = sum(x.size for x in jax.tree.leaves(params))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (batch, seq)), jnp.int32)
    mask = jnp.ones((batch, seq), bool)
    completion = seq // 2

    def loss(p):
        logp = forward.completion_logprobs_nt(graphdef, p, tokens, mask, completion_len=completion)
        return jnp.mean(logp)

    grad = jax.jit(jax.value_and_grad(loss))
    t0 = time.perf_counter()
    jax.block_until_ready(grad(params))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        out = grad(params)
    jax.block_until_ready(out)
    step_s = (time.perf_counter() - t0) / steps
    per_token = 6 * matmul_parameters(cfg, n) + 12 * cfg.num_layers * cfg.num_heads * (
        cfg.head_dim * seq
    )
    flops = per_token * batch * seq
    peak, _ = chip_peaks(jax.devices()[0].device_kind)
    prof = {}
    with profiled("mfu", prof):
        jax.block_until_ready(grad(params))
    return {
        **prof,
        "model": model,
        "parameters": int(n),
        "batch": batch,
        "seq": seq,
        "compile_s": compile_s,
        "step_s": step_s,
        "model_flops_per_step": float(flops),
        "flops_per_s": flops / step_s,
        "peak_bf16_flops_per_s": peak,
        "mfu": None if peak is None else flops / step_s / peak,
        "loss_finite": bool(np.isfinite(float(out[0]))),
    }


def part_decode(
    model: str,
    batch: int,
    prompt: int,
    new: int,
    engine: str = "paged",
    attention: str = "auto",
    tunings: dict | None = None,
) -> dict:
    """Decode tokens/s at ``batch`` rows against the HBM roofline; see the module docstring.

    ``engine="paged"`` (the trainer's default) runs every row at once (``num_slots = batch``)
    with the platform's attention kernel (``attention="auto"``: Pallas ``paged_attention`` on a
    GPU, ``ragged_paged_attention`` on a TPU, the reference path where neither serves the
    model; the result names the one that ran), or with ``attention="reference"``: each
    dispatch gathers its rows' pages into a dense context and attends with XLA, as on CPU
    (the ``decode_dense`` part: whether that beats the kernel on this chip); ``"static"`` is
    the dense-cache engine. ``tunings`` (name → ``PagedOptions.kernel_tuning``; the
    ``decode_tuning`` part): after the default launch parameters' timings, the decode again
    with each of these (each compiles its programs; the prefill time is the default's)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_llm import rollout
    from jaxrl_llm.rollout import paged
    from jaxrl_llm.train import state as st

    cfg = _model_config(model)
    graphdef, params = st.split_params(_random_model(cfg))
    n = sum(x.size for x in jax.tree.leaves(params))
    rng = np.random.default_rng(0)
    ids = rng.integers(3, cfg.vocab_size, (batch, prompt), dtype=np.int32)
    mask = np.ones((batch, prompt), bool)

    if engine == "paged":
        # All rows at once, and a pool that holds them all (no preemption).
        pool = paged.pool_pages(batch, prompt, new)
        paged_options = paged.PagedOptions(num_slots=batch, num_pages=pool, attention=attention)
        options = {"paged_options": paged_options, "return_stats": True}
        kernel = paged.attention_kernel(cfg, paged_options, jnp.bfloat16, params=params)
        attention = "reference" if kernel is None else kernel.name
    elif engine == "static":
        options, attention = {}, None
    else:
        raise ValueError(f"engine must be 'paged' or 'static', got {engine!r}")
    stats = {}

    def sample(t: int, options: dict = options) -> float:
        t0 = time.perf_counter()
        out = rollout.generate(
            (graphdef, params),
            ids,
            mask,
            rng=jax.random.key(0),
            max_new_tokens=t,
            temperature=1.0,
            stop_token_ids=(),  # no stop: every row decodes all t tokens
            cache_dtype="bfloat16",
            engine=engine,
            **options,
        )
        if engine == "paged":
            out, run_stats = out
            stats[t] = run_stats._asdict()
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    first = {t: sample(t) for t in (1, new)}  # compiles
    prefill_s = min(sample(1) for _ in range(2))
    full_s = min(sample(new) for _ in range(2))
    decode_s = max(full_s - prefill_s, 1e-9)
    tokens_per_s = batch * (new - 1) / decode_s
    kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * cfg.head_dim * (prompt + new / 2) * 2
    step_bytes = 2 * matmul_parameters(cfg, n) + kv
    _, bandwidth = chip_peaks(jax.devices()[0].device_kind)
    roofline = None if bandwidth is None else batch / (step_bytes / bandwidth)
    prof = {}
    with profiled(f"decode_{engine}_{attention}", prof):
        sample(new)
    tuned = {}
    for name, tuning in (tunings or {}).items():
        if engine != "paged":
            raise ValueError("part_decode: tunings are the paged engine's kernel's")
        opts = {
            **options,
            "paged_options": dataclasses.replace(paged_options, kernel_tuning=tuning),
        }
        try:
            first_s = sample(new, opts)
            t_s = min(sample(new, opts) for _ in range(2))
        except Exception as e:  # a launch the kernel refuses on this GPU is a result too
            tuned[name] = {"tuning": tuning, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        tps = batch * (new - 1) / max(t_s - prefill_s, 1e-9)
        tuned[name] = {
            "tuning": tuning,
            "compile_s": first_s,
            "generate_s": t_s,
            "decode_tokens_per_s": tps,
            "percent_of_roofline": None if roofline is None else 100 * tps / roofline,
        }
    return {
        **prof,
        "tunings": tuned or None,
        "model": model,
        "engine": engine,
        "attention": attention,
        "paged_stats": {str(k): v for k, v in stats.items()} or None,
        "batch": batch,
        "prompt": prompt,
        "new_tokens": new,
        "compile_s": {str(k): v for k, v in first.items()},
        "prefill_s": prefill_s,
        "generate_s": full_s,
        "decode_tokens_per_s": tokens_per_s,
        "bytes_per_decode_step": float(step_bytes),
        "hbm_bytes_per_s": bandwidth,
        "roofline_tokens_per_s": roofline,
        "percent_of_roofline": None if roofline is None else 100 * tokens_per_s / roofline,
    }


def paged_greedy(model, ids, mask, new: int, options, **kw):
    """``rollout.generate`` on the paged engine with ``options``: greedy, ``new`` tokens for
    every row (no stop id), a bf16 KV cache (the ``check`` and ``pool_fit`` parts)."""
    import jax

    from jaxrl_llm import rollout

    return rollout.generate(
        model,
        ids,
        mask,
        rng=jax.random.key(0),
        max_new_tokens=new,
        temperature=0.0,
        stop_token_ids=(),
        cache_dtype="bfloat16",
        engine="paged",
        paged_options=options,
        **kw,
    )


def part_pool_fit(model: str, batch: int, prompt: int, new: int, fraction: float = 0.5) -> dict:
    """The paged pool sized from the device's memory (``PagedOptions.memory_utilization``, the
    trainer's default) on a real allocator: ``bytes_in_use`` as the allocator reports it with
    the weights resident, XLA's memory analysis for the programs' reserve, and whether the
    process's peak stays under ``u · bytes_limit``.

    First the fit at the default u = 0.9 (no sampling): its reserve, page bytes and the cap
    (every sequence's worst case). Then u is set so that the pool holds ``fraction`` of the
    cap, ``u = (bytes_in_use + reserve + pages · page_bytes) / bytes_limit``, and the engine
    samples ``batch`` greedy rows of ``new`` tokens (no stop) in it: it should get about those
    pages (fewer where the programs' temporaries grow with the pool), preempt, and keep the
    peak (``peak_bytes_in_use``, this fresh process's) under ``u · bytes_limit``; then once
    more with a pool for every sequence, whose tokens the tight pool's should equal (in bf16 a
    recomputed context's logits may round otherwise than the decode's, so a near-tie can flip
    a row: the fraction of equal rows is reported). On a CPU (no ``memory_stats``) the
    devices' memory is faked, 1 GiB with nothing in use, so that the path runs; its peak is
    not measured (``memory: "faked"``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_llm.rollout import engine, paged
    from jaxrl_llm.train import state as st

    cfg = _model_config(model)
    graphdef, params = st.split_params(_random_model(cfg))
    real = paged._memory_stats(jax.devices()[0])
    faked = real is None or "bytes_limit" not in real
    if faked:
        paged._memory_stats = lambda d: {"bytes_limit": 1 << 30, "bytes_in_use": 0}
    rng = np.random.default_rng(0)
    ids = rng.integers(3, cfg.vocab_size, (batch, prompt), dtype=np.int32)
    mask = np.ones((batch, prompt), bool)
    options = paged.PagedOptions(num_slots=batch)  # memory_utilization=0.9, no num_pages

    def sample(opts: paged.PagedOptions):
        out, stats = paged_greedy((graphdef, params), ids, mask, new, opts, return_stats=True)
        return jax.tree.map(np.asarray, jax.block_until_ready(out)), stats

    # The fit at u = 0.9, without sampling: what generate's first call computes.
    engine_params = paged.engine_params(params, cfg.jnp_dtype)
    resolved = paged.resolve_options(
        options, num_seqs=batch, num_samples=1, longest_prompt=prompt, max_new_tokens=new
    )
    kernel = paged.attention_kernel(cfg, resolved, jnp.bfloat16, params=engine_params[0])
    fit_kw = dict(
        num_prompts=batch,
        num_samples=1,
        longest_prompt=prompt,
        max_new_tokens=new,
        cache_dtype=jnp.dtype(jnp.bfloat16),
        greedy=True,
        top_k=0,
        top_p=1.0,
        pad_token_id=engine._pad_id(cfg),
        num_stop_ids=8,
        full_logprobs=False,
    )
    t0 = time.perf_counter()
    wide = paged.fit_pool_to_memory(graphdef, cfg, None, engine_params, resolved, kernel, **fit_kw)
    fit_s = time.perf_counter() - t0
    (fit,) = paged._FITTED.values()
    cap = paged.pool_pages(batch, prompt, new, resolved)
    stats0 = paged._memory_stats(jax.devices()[0])
    pages = max(paged.pool_pages(1, prompt, new, resolved), int(fraction * cap))
    u = (stats0["bytes_in_use"] + fit.reserve + pages * fit.page_bytes) / stats0["bytes_limit"]
    u = min(u + 1e-6, 1.0)  # rounding: floor((u·limit − in_use − reserve) / page) = pages
    paged._FITTED.clear()
    t0 = time.perf_counter()
    tight_out, tight = sample(dataclasses.replace(options, memory_utilization=u))
    tight_s = time.perf_counter() - t0
    after = paged._memory_stats(jax.devices()[0])
    peak = None if faked else int(after.get("peak_bytes_in_use", 0))
    budget = int(u * stats0["bytes_limit"])
    full_out, full = sample(dataclasses.replace(options, num_pages=cap))
    rows_same = (tight_out.tokens == full_out.tokens).all(axis=(1, 2))
    return {
        "model": model,
        "memory": "faked" if faked else "device",
        "batch": batch,
        "prompt": prompt,
        "new_tokens": new,
        "bytes_limit": int(stats0["bytes_limit"]),
        "bytes_in_use_before": int(stats0["bytes_in_use"]),
        "fit_at_0.9": {
            "pool_pages": int(wide.num_pages),
            "cap_pages": int(cap),
            "reserve_bytes": int(fit.reserve),
            "page_bytes": int(fit.page_bytes),
            "fit_s": fit_s,
        },
        "memory_utilization": u,
        "planned_pool_pages": int(pages),
        "pool_pages": int(tight.pool_pages),
        "preemptions": int(tight.preemptions),
        "peak_pages": int(tight.peak_pages),
        "generate_s": tight_s,
        "peak_bytes_in_use": peak,
        "budget_bytes": budget,
        "peak_within_budget": None if peak is None else peak <= budget,
        "headroom_bytes": None if peak is None else budget - peak,
        "full_pool_preemptions": int(full.preemptions),
        "tokens_equal_full_pool": bool(rows_same.all()),
        "rows_equal_full_pool_fraction": float(rows_same.mean()),
    }


def _errors(got, truth, valid) -> dict:
    """``got`` against ``truth`` where ``valid`` (broadcast from the leading axes): the largest
    absolute difference and the relative L2 error ``‖got − truth‖ / ‖truth‖``."""
    import numpy as np

    got, truth = (np.asarray(x, np.float64) for x in (got, truth))
    valid = np.asarray(valid, bool)
    valid = np.broadcast_to(
        valid.reshape(valid.shape + (1,) * (truth.ndim - valid.ndim)), truth.shape
    )
    diff = np.where(valid, got - truth, 0.0)
    norm = float(np.sqrt(np.sum(np.where(valid, truth, 0.0) ** 2)))
    return {
        "max_abs": float(np.max(np.abs(diff))),
        "rel_l2": float(np.sqrt(np.sum(diff**2)) / max(norm, 1e-30)),
    }


def _verdict(kernel: dict, floor: dict) -> dict:
    """The kernel path's and the bf16 reference path's errors (:func:`_errors`) against the
    float32 reference; ``ok``: the kernel's relative error is at most 4x the bf16 reference's
    own (the rounding of bf16 inputs), or 1%."""
    ok = kernel["rel_l2"] <= max(4 * floor["rel_l2"], 1e-2)
    return {"kernel": kernel, "bf16_reference": floor, "ok": ok}


def _compare(kernel, floor, truth, valid) -> dict:
    """:func:`_verdict` of two arrays against ``truth`` where ``valid``."""
    return _verdict(_errors(kernel, truth, valid), _errors(floor, truth, valid))


def _all_ok(tree) -> bool:
    """Every ``ok`` in a nested result."""
    if isinstance(tree, dict):
        return all(_all_ok(v) if k != "ok" else bool(v) for k, v in tree.items())
    return True


def _left_padded_mask(rng, rows: int, width: int, shortest: int):
    """bool ``[rows, width]``, each row's last ``shortest..width`` columns True."""
    import numpy as np

    lengths = rng.integers(shortest, width + 1, rows)
    return np.arange(width)[None] >= (width - lengths)[:, None]


def check_attention(cfg, batch: int, width: int, rng, kernel=None) -> dict:
    """The platform's attention kernel alone (``attention="auto"``; on CPU, which has none,
    the cuDNN call's own XLA form: its argument wiring), forward and the q/k/v gradients of
    ``<out, ct>``, on the two masks the trainer makes: left-padded rows (unpacked updates) and
    packed rows (consecutive segments, a padding tail). ``kernel(q, k, v, **masks)``: another
    implementation to check (tests)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_llm.models import attention as attn

    b, t, dh = batch, width, cfg.head_dim
    q, k, v, ct = (
        jnp.asarray(rng.standard_normal((b, t, n, dh)), jnp.float32)
        for n in (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads, cfg.num_heads)
    )
    kv_mask = _left_padded_mask(rng, b, t, t // 4)
    seg = np.zeros((b, t), np.int32)
    for row in range(b):  # segments of 1..t/2 tokens, then padding (segment 0)
        pos, sid = 0, 1
        while pos < t - t // 8:
            n = int(rng.integers(1, t // 2 + 1))
            seg[row, pos : pos + n], pos, sid = sid, pos + n, sid + 1
    cases = {  # masks, and the queries whose outputs are defined
        "left_padded": ({"kv_mask_bs": jnp.asarray(kv_mask)}, kv_mask),
        "packed": ({"segment_ids_bt": jnp.asarray(seg)}, seg != 0),
    }
    impl = attn.resolve_implementation("auto")
    name = impl
    if kernel is not None:
        name = getattr(kernel, "__name__", "given")
    elif impl == "reference":
        name = "cudnn (implementation='xla', CPU)"

        def kernel(q, k, v, **m):
            return attn.cudnn_attention(q, k, v, causal=True, implementation="xla", **m)
    else:

        def kernel(q, k, v, **m):
            return attn.attention(q, k, v, causal=True, implementation=impl, **m)

    def reference(q, k, v, **m):
        return attn.attention(q, k, v, causal=True, implementation="reference", **m)

    def forward_backward(fn, dtype, masks, valid_bt):
        def out_of(q, k, v):
            return fn(q.astype(dtype), k.astype(dtype), v.astype(dtype), **masks)

        def loss(q, k, v):
            out = out_of(q, k, v).astype(jnp.float32)
            return jnp.sum(jnp.where(valid_bt[..., None, None], out * ct, 0.0))

        run = jax.jit(lambda q, k, v: (out_of(q, k, v), *jax.grad(loss, (0, 1, 2))(q, k, v)))
        return run(q, k, v)

    result: dict = {"implementation": name}
    for case, (masks, valid_bt) in cases.items():
        truth, floor, got = (
            forward_backward(fn, dtype, masks, jnp.asarray(valid_bt))
            for fn, dtype in (
                (reference, jnp.float32),
                (reference, jnp.bfloat16),
                (kernel, jnp.bfloat16),
            )
        )
        # padding queries' outputs (and so their q gradients) are undefined; keys all count
        valids = (valid_bt, valid_bt, True, True)
        names = ("out", "grad_q", "grad_k", "grad_v")
        result[case] = {
            n: _compare(g, f, r, m)
            for n, g, f, r, m in zip(names, got, floor, truth, valids, strict=True)
        }
    return result


def _pallas_gpu_attention(q, k, v, **masks):
    """``model.attention: pallas_gpu`` (Triton on a GPU, interpret mode elsewhere)."""
    from jaxrl_llm.models import attention as attn

    return attn.attention(q, k, v, causal=True, implementation="pallas_gpu", **masks)


def _graphdef(cfg, **change):
    """The graphdef of a model of ``cfg`` with ``change``d fields (same parameter tree)."""
    import dataclasses

    from flax import nnx

    from jaxrl_llm import models

    c = dataclasses.replace(cfg, **change)
    return nnx.graphdef(nnx.eval_shape(lambda: models.CausalLM(c, rngs=nnx.Rngs(0))))


def check_logprob_pass(cfg, graphdef, truth_gd, params, batch: int, width: int, rng) -> dict:
    """The trainer's log-prob pass (``completion_logprobs_nt``, forward and the parameters'
    gradient of the summed log-probs) with the model's configured attention, against the
    same weights with the reference attention, on left-padded rows."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_llm.models import attention as attn
    from jaxrl_llm.train import forward

    mask = _left_padded_mask(rng, batch, width, width // 2)
    ids = np.where(mask, rng.integers(3, cfg.vocab_size, (batch, width)), 0).astype(np.int32)
    completion = width // 2

    def run(gd):
        def loss(p):
            logp = forward.completion_logprobs_nt(gd, p, ids, mask, completion_len=completion)
            return jnp.sum(logp), logp

        (_, logp), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        return logp, np.concatenate(
            [np.ravel(np.asarray(x, np.float32)) for x in jax.tree.leaves(grad)]
        )

    truth = run(truth_gd)
    floor = run(_graphdef(cfg, attention_impl="reference"))
    got = run(graphdef)
    return {
        "attention": attn.resolve_implementation(cfg.attention_impl),
        "logprobs": _compare(got[0], floor[0], truth[0], mask[:, -completion:]),
        "grad": _compare(got[1], floor[1], truth[1], True),
    }


def check_paged_sampler(
    cfg,
    graphdef,
    truth_gd,
    params,
    batch: int,
    prompt: int,
    new: int,
    rng,
    attention: str = "auto",
) -> dict:
    """The paged engine (greedy, bf16 KV cache) with ``attention`` (``auto``: the platform's
    kernel) and with the reference attention: each one's log-probs of its own tokens against
    the trainer's float32 reference pass over those tokens."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_llm.rollout import paged
    from jaxrl_llm.train import forward

    p_mask = _left_padded_mask(rng, batch, prompt, prompt // 4)
    p_ids = np.where(p_mask, rng.integers(3, cfg.vocab_size, (batch, prompt)), 0).astype(np.int32)
    truth_pass = jax.jit(
        lambda p, x, m: forward.completion_logprobs_nt(truth_gd, p, x, m, completion_len=new)
    )
    runs = {}
    for which in dict.fromkeys((attention, "reference")):
        pool = paged.pool_pages(batch, prompt, new)
        options = paged.PagedOptions(num_slots=batch, num_pages=pool, attention=which)
        spec = paged.attention_kernel(cfg, options, jnp.bfloat16, params=params)
        gen = paged_greedy((graphdef, params), p_ids, p_mask, new, options)
        tokens, mask = np.asarray(gen.tokens)[:, 0], np.asarray(gen.mask)[:, 0]
        truth = truth_pass(
            params, np.concatenate([p_ids, tokens], 1), np.concatenate([p_mask, mask], 1)
        )
        runs[which] = ("reference" if spec is None else spec.name, tokens, mask, gen, truth)
    name, tokens, mask, gen, truth = runs[attention]
    _, ref_tokens, ref_mask, ref_gen, ref_truth = runs["reference"]
    kern = _errors(np.asarray(gen.logprobs)[:, 0], truth, mask)
    floor = _errors(np.asarray(ref_gen.logprobs)[:, 0], ref_truth, ref_mask)
    return {
        "attention": name,
        "logprobs_vs_float32_trainer": _verdict(kern, floor),
        "greedy_tokens_equal_fraction": float(np.mean(tokens == ref_tokens)),
    }


def part_check(
    model: str,
    batch: int,
    prompt: int,
    new: int,
    engine_attention: str = "auto",
    layers: int | None = None,
) -> dict:
    """The accelerator paths' numbers against the reference path; see the module docstring.
    ``layers``: keep only the model's first ``layers`` layers (the kernels, their shapes and
    the pool's layer folding are the same per layer; the part's compiles, the paged engine's
    unrolled layers above all, scale with them: the whole 1B model's took 176 s on the H200)."""
    import jax
    import numpy as np

    from jaxrl_llm.train import state as st

    cfg = _model_config(model)  # bfloat16 compute; "auto" attention, resolved where it runs
    if layers is not None:
        cfg = cfg.replace(num_layers=layers)
    graphdef, params = st.split_params(_random_model(cfg))
    truth_gd = _graphdef(cfg, attention_impl="reference", dtype="float32")  # the float32 truth
    rng = np.random.default_rng(0)
    result = {
        "model": model,
        "layers": cfg.num_layers,
        "backend": jax.default_backend(),
        "attention": check_attention(cfg, batch, 2 * prompt, rng),
        "attention_pallas_gpu": check_attention(
            cfg, batch, 2 * prompt, rng, kernel=_pallas_gpu_attention
        ),
        "logprob_pass": check_logprob_pass(cfg, graphdef, truth_gd, params, batch, 2 * prompt, rng),
        "paged_sampler": check_paged_sampler(
            cfg, graphdef, truth_gd, params, batch, prompt, new, rng, attention=engine_attention
        ),
    }
    result["ok"] = _all_ok(result)
    return result


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak_rss() -> bool:
    """Linux: ``VmHWM`` restarts from the current RSS (``echo 5 > /proc/PID/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def random_run(config, abstract, recipe):
    """The planned run's real state: the same Models (mesh, shardings, optimizer, graphdef)
    as the abstract run, with random weights of the model's config in place of a checkpoint
    (full fine-tuning; the reference a copy in ``kl.reference_param_dtype``)."""
    import dataclasses

    import jax

    from jaxrl_llm.models import sharding as shd
    from jaxrl_llm.train import models as train_models
    from jaxrl_llm.train import state as st

    if config.model.lora is not None:
        raise ValueError("bench_accelerator: the measured run is full fine-tuning (no model.lora)")
    models = abstract.models
    with jax.set_mesh(models.mesh):
        lm = shd.shard_model(
            _random_model(abstract.model_config, config.train.seed), models.mesh, models.rules
        )
        _, params = st.split_params(lm)
        del lm
        ref = None
        if models.ref_params is not None:
            ref = train_models.reference_params(params, config.kl.reference_param_dtype)
        state = st.init_train_state(
            params,
            models.tx,
            recipe=recipe,
            seed=config.train.seed,
            opt_sharding=models.state_sharding.opt_state,
        )
        state = jax.device_put(state, models.state_sharding)
    return dataclasses.replace(models, ref_params=ref), state


def _rl_step(config, recipe, models, abstract):
    """The trainer's fused RL step of ``config`` over ``models``, how many forward passes it
    adds to the policy's (π_ref, a recomputed π_old), and its model FLOPs on a rollout of the
    config's shape, every completion ``max_new_tokens`` long (:func:`update_model_flops`)."""
    from jaxrl_llm.models import sharding as shd
    from jaxrl_llm.train import setup as su
    from jaxrl_llm.train.step import make_rl_step, needs_old_logprob_pass

    # the trainer's (setup.resolve): the packed budget per data-parallel device
    dp = shd.data_parallel_size(models.mesh)
    update = su.update_shape(config, dp, abstract.model_config)
    old = su.OldLogprobs(config.old_logprobs.source, config.old_logprobs.tis_cap)
    r = config.rollout
    step = make_rl_step(recipe, models, update, temperature=r.temperature or 1.0, old_logprobs=old)
    passes = int(models.ref_params is not None) + int(needs_old_logprob_pass(recipe, update, old))
    flops = update_model_flops(
        abstract.model_config,
        abstract.num_parameters,
        sequences=r.prompts_per_step * r.num_samples,
        prompt_len=abstract.prompt_width,
        completion_len=r.max_new_tokens,
        forward_passes=passes,
    )
    return step, passes, flops


def part_update(config_path: str, overrides: list[str], variants: dict, steps: int) -> dict:
    """The fused GRPO update step's MFU under each of ``variants`` (name → overrides on top of
    ``overrides``: remat policy, micro-batch size), on a synthetic rollout of the config's
    shape (random tokens, every completion ``max_new_tokens`` long; no sampling, so that each
    variant costs one compile and ``steps`` timed steps). Issue 13's 45% is a model-FLOP
    figure (:func:`update_model_flops`), so remat's recomputation costs MFU: the sweep says
    which setting reaches it on this chip. Each variant's timed step is profiled under
    ``--profile``; a variant that fails (out of memory) is recorded and the next one runs."""
    import jax
    import numpy as np

    from jaxrl_llm.config import build_recipe, load_config, mesh_axis_sizes
    from jaxrl_llm.train import models as train_models
    from jaxrl_llm.train import plan as P
    from jaxrl_llm.train.step import Groups

    peak_flops, _ = chip_peaks(jax.devices()[0].device_kind)
    out: dict = {"config": config_path, "overrides": overrides, "variants": {}}
    for name, extra in variants.items():
        result: dict = {"overrides": extra}
        try:
            config = load_config(config_path, [*overrides, *extra])
            recipe = build_recipe(config)
            sizes = mesh_axis_sizes(config.mesh, jax.device_count())
            mesh, _ = train_models.make_mesh(sizes, config.mesh.preset)
            model_cfg = P.model_config(config.model, accelerator=jax.default_backend() != "cpu")
            abstract = P.abstract_run(config, recipe, mesh, model_cfg)
            r = config.rollout
            b, g, t = r.prompts_per_step, r.num_samples, r.max_new_tokens
            p, v = abstract.prompt_width, model_cfg.vocab_size
            rng = np.random.default_rng(0)
            groups = Groups(
                prompt_ids_bp=rng.integers(3, v, (b, p), dtype=np.int32),
                prompt_mask_bp=np.ones((b, p), bool),
                tokens_bgt=rng.integers(3, v, (b, g, t), dtype=np.int32),
                mask_bgt=np.ones((b, g, t), bool),
                logp_sampler_bgt=-rng.uniform(0.0, 8.0, (b, g, t)).astype(np.float32),
                reward_bg=rng.standard_normal((b, g)).astype(np.float32),
                member_bg=np.ones((b, g), bool),
            )
            models, state = random_run(config, abstract, recipe)
            step, _, flops = _rl_step(config, recipe, models, abstract)
            t0 = time.perf_counter()
            state, metrics = jax.block_until_ready(step(state, groups))  # compiles
            result["first_s"] = time.perf_counter() - t0
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                state, metrics = jax.block_until_ready(step(state, groups))
                times.append(time.perf_counter() - t0)
            step_s = float(np.median(times))
            per_device = flops / step_s / math.prod(sizes.values())
            result |= {
                "step_s": times,
                "update_model_flops": flops,
                "update_flops_per_s_per_device": per_device,
                "update_mfu": None if peak_flops is None else per_device / peak_flops,
                "step_finite": bool(np.isfinite(metrics["actor/loss"])),
                # the process's peak so far (it cannot be reset): this variant's own where the
                # variants grow, as they are listed (None on CPU)
                "peak_bytes_in_use_so_far": (jax.devices()[0].memory_stats() or {}).get(
                    "peak_bytes_in_use"
                ),
            }
            with profiled(f"update_{name}", result):
                jax.block_until_ready(step(state, groups))
        except Exception as e:  # an OOM in one setting is a result; the next one runs
            result["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        out["variants"][name] = result
        models = state = step = groups = metrics = None  # this variant's arrays go first
        jax.clear_caches()
    return out


def part_plan(config_path: str, overrides: list[str], num_devices: int | None) -> dict:
    """The planned peak of a GRPO run against the measured one; see the module docstring."""
    import jax
    import numpy as np

    from jaxrl_llm import rollout
    from jaxrl_llm.config import build_recipe, load_config
    from jaxrl_llm.train import plan as P
    from jaxrl_llm.train.step import Groups

    config = load_config(config_path, overrides)
    n_devices = num_devices or jax.device_count()
    target = P.local_target(n_devices)
    t0 = time.perf_counter()
    plan = P.plan_run(config, target)
    plan_s = time.perf_counter() - t0
    recipe = build_recipe(config)
    sizes = dict(plan.mesh)
    from jaxrl_llm.models import sharding as shd

    mesh = shd.make_mesh(**sizes, devices=jax.devices()[: math.prod(sizes.values())])
    model_cfg = P.model_config(config.model, accelerator=target.accelerator)
    abstract = P.abstract_run(config, recipe, mesh, model_cfg)
    models, state = random_run(config, abstract, recipe)

    r = config.rollout
    b, g, t = r.prompts_per_step, r.num_samples, r.max_new_tokens
    p = abstract.prompt_width
    rng = np.random.default_rng(0)
    ids = rng.integers(3, model_cfg.vocab_size, (b, p), dtype=np.int32)
    mask = np.ones((b, p), bool)

    def sample():
        out = rollout.generate(
            models.sampling_policy(state.params),
            ids,
            mask,
            rng=jax.random.key(0),
            max_new_tokens=t,
            num_samples=g,
            temperature=r.temperature,
            top_k=r.top_k,
            top_p=r.top_p,
            stop_token_ids=(),  # the plan's worst case: every completion T tokens
            cache_dtype=None if r.cache_dtype == "auto" else r.cache_dtype,
        )
        return jax.block_until_ready(out)

    t0 = time.perf_counter()
    gen = sample()
    rollout_first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    gen = sample()
    rollout_s = time.perf_counter() - t0
    groups = Groups(
        prompt_ids_bp=ids,
        prompt_mask_bp=mask,
        tokens_bgt=np.asarray(gen.tokens),
        mask_bgt=np.asarray(gen.mask),
        logp_sampler_bgt=np.asarray(gen.logprobs),
        reward_bg=rng.standard_normal((b, g)).astype(np.float32),
        member_bg=np.ones((b, g), bool),
    )
    step, passes, flops = _rl_step(config, recipe, models, abstract)
    t0 = time.perf_counter()
    state, _ = step(state, groups)  # compiles
    step_first_s = time.perf_counter() - t0
    stats = jax.devices()[0].memory_stats()
    device0 = jax.devices()[0]

    def device0_bytes(tree) -> int:  # the real arguments' bytes on device 0
        total = 0
        for x in jax.tree.leaves(tree):
            if isinstance(x, jax.Array):
                total += sum(s.data.nbytes for s in x.addressable_shards if s.device == device0)
            elif hasattr(x, "nbytes"):
                total += x.nbytes
        return total

    live = device0_bytes((state, models.ref_params, groups))
    rss_before = _proc_status("VmRSS")
    reset = stats is None and _reset_peak_rss()
    t0 = time.perf_counter()
    state, metrics = step(state, groups)
    step_s = time.perf_counter() - t0
    peak_flops, _ = chip_peaks(jax.devices()[0].device_kind)
    u = plan.update
    if stats is not None:  # GPU / TPU: the allocator's peak over the whole part
        stats = jax.devices()[0].memory_stats()
        measured = int(stats.get("peak_bytes_in_use", 0)) or None
        method = "device.memory_stats()['peak_bytes_in_use'] (whole process: state, rollout, step)"
        predicted = plan.peak
    elif reset:  # CPU: the update program's arguments, plus what the process grew by
        measured = live + _proc_status("VmHWM") - rss_before
        method = (
            "CPU: the step's argument arrays + growth of the process's peak RSS (VmHWM) "
            "during one update step"
        )
        predicted = plan.update_peak
    else:
        measured, method, predicted = None, "not measurable here", plan.peak
    ratio = None if measured is None else measured / predicted
    prof = {}
    with profiled("plan_rollout", prof):
        sample()
    with profiled("plan_step", prof):
        jax.block_until_ready(step(state, groups))
    return {
        **prof,
        "config": config_path,
        "overrides": overrides,
        "plan": plan.to_dict(),
        "plan_s": plan_s,
        "predicted_bytes": predicted,
        "measured_bytes": measured,
        "measured_method": method,
        "measured_over_predicted": ratio,
        "within_10_percent": None if ratio is None else abs(ratio - 1) <= 0.1,
        "update_predicted_dynamic_bytes": u.outputs - u.aliased + u.temporaries,
        "update_measured_dynamic_bytes": None if measured is None or stats else measured - live,
        "argument_bytes": live,
        "rollout_s": {"first (compile)": rollout_first_s, "steady": rollout_s},
        "rollout_tokens_per_s": b * g * t / rollout_s,
        "step_s": {"first (compile)": step_first_s, "steady": step_s},
        "update_forward_passes": passes,
        "update_model_flops": flops,
        "update_flops_per_s_per_device": flops / step_s / n_devices,
        "update_mfu": None if peak_flops is None else flops / step_s / n_devices / peak_flops,
        "step_finite": bool(np.isfinite(metrics["actor/loss"]))
        if "actor/loss" in metrics
        else None,
    }


#: In the order they run: the kernels' numbers first (a speed of wrong numbers is worth
#: nothing), then the open issues' (13: update MFU; 12: the paged engine's decode against the
#: roofline, then the static engine's, the comparison that says where the static engine is
#: still the faster one), the plan check last.
PARTS = (
    "check",
    "mfu",
    "update",
    "decode",
    "decode_dense",
    "decode_static",
    "plan",
    "decode_tuning",
    "update_attention",
    "pool_fit",
)
#: Each part's subprocess timeout, seconds (the plan part compiles its two programs twice,
#: planned and real; the check part took 176 s on the H200 with all 16 layers of the 1B model,
#: it now checks 4). A run stops starting parts at
#: ``--total-budget-s``.
BUDGETS = {
    "check": 240.0,
    "mfu": 150.0,
    "update": 150.0,
    "decode": 150.0,
    "decode_dense": 120.0,
    "decode_static": 120.0,
    "plan": 300.0,
    "decode_tuning": 150.0,
    "update_attention": 120.0,
    "pool_fit": 150.0,
}
#: The whole run's default limit: a device command may run 600 s, and the machine's start and
#: the transfers come on top, so 540 s leaves room to see the output.
TOTAL_BUDGET_S = 540.0


def run_part(name: str, shapes: dict, num_devices: int | None) -> dict:
    """One part in this process."""
    s = shapes[name]
    if name == "plan":
        return part_plan(s["config"], list(s["overrides"]), num_devices)
    if name == "mfu":
        return part_mfu(**s)
    if name in ("update", "update_attention"):
        return part_update(s["config"], list(s["overrides"]), dict(s["variants"]), s["steps"])
    if name == "check":
        return part_check(**s)
    if name == "pool_fit":
        return part_pool_fit(**s)
    return part_decode(**s)  # decode, decode_dense, decode_static, decode_tuning


def run_in_subprocess(name: str, tiny: bool, num_devices: int | None, timeout: float) -> dict:
    """One part in a fresh Python (its own peak), large allocations forced to mmap (so the CPU
    RSS measurement sees freed memory leave)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    args = [sys.executable, str(Path(__file__).resolve()), "--part", name]
    args += ["--tiny"] if tiny else []
    args += [] if num_devices is None else ["--devices", str(num_devices)]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-5:], "returncode": out.returncode}
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["part_wall_s"] = time.perf_counter() - t0
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU test)")
    parser.add_argument("--devices", type=int, default=None, help="first N devices (plan part)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"some of {','.join(PARTS)}")
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # one, in this process
    parser.add_argument(
        "--budget-s", type=float, default=None, help=f"timeout of each part (default {BUDGETS})"
    )
    parser.add_argument(
        "--total-budget-s",
        type=float,
        default=TOTAL_BUDGET_S,
        help="stop here: a part gets at most the time left, and none starts under 30 s",
    )
    parser.add_argument("--out", default=None, help="write the JSON here (also printed)")
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="also trace one more call of each part's timed program into DIR/<name> "
        "(jax.profiler) and put the ops that took the device's time in the JSON",
    )
    args = parser.parse_args(argv)
    if args.profile:
        os.environ[PROFILE_ENV] = str(Path(args.profile).resolve())
    shapes = SHAPES["tiny" if args.tiny else "device"]
    if args.part is not None:  # the subprocess: one line of JSON on stdout
        print(json.dumps(run_part(args.part, shapes, args.devices), default=str))
        return 0
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {unknown}; expected some of {list(PARTS)}")
    sys.path.insert(0, str(SCRIPTS))
    from _bench_common import machine_info

    result = {"machine": machine_info(), "tiny": args.tiny, "parts": {}}
    deadline = time.monotonic() + args.total_budget_s
    for name in parts:
        left = deadline - time.monotonic()
        if left < 30:
            result["parts"][name] = {"error": f"not run: {left:.0f} s of --total-budget-s left"}
        else:
            budget = min(args.budget_s or BUDGETS[name], left)
            result["parts"][name] = run_in_subprocess(name, args.tiny, args.devices, budget)
        text = json.dumps(result, indent=2, default=str)
        if args.out:  # after every part: a later part's timeout loses nothing already measured
            Path(args.out).write_text(text + "\n")
    print(text)
    return 0 if all("error" not in r for r in result["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
