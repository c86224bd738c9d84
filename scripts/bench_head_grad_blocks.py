"""XLA:CPU update temporaries with the LM head's fused gradient in one block and in blocks.

For each model (a folder name of ``jaxrl_llm/configs/models`` such as ``llama-3.2-1b``,
``default`` for SmolLM2, or an HF folder; only its config is read, the weights are abstract),
compiles, without running it, a
micro-batched Adam update of ``−Σ log π(y_t)`` through the chunked log-probs
(``models.logprobs.completion_logprobs``), fp32, ``remat="full"``, the state donated as the
trainer's is: once with the head's gradient formed in one block per chunk, once in blocks of
``models.logprobs.HEAD_GRAD_BLOCK_BYTES`` (what the trainer does on CPU). Reports XLA's
temporaries of each (``memory_analysis().temp_size_in_bytes``) and writes JSON.

With ``--micro`` equal to ``--rows`` (one micro-batch) there is no running sum: the head's
gradient goes into an accumulator of its own (``grad_accumulation.own_accumulators``), one
block against blocks as well.

``--topologies``: also ``jaxrl-llm plan``'s update program of ``bench_accelerator.py``'s 1B GRPO
plan run (FSDP over the target's devices; ``--plan-overrides`` on top, e.g.
``optim.micro_batch_size=64`` for one micro-batch) for each target, one block against blocks: a TPU
slice (libtpu compiles it without a TPU) or GPUs (JAX's CUDA plugin without a GPU, the
``gpu-plan`` extra and ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``; docs/plan.md).

    python scripts/bench_head_grad_blocks.py --models default qwen2.5-1.5b llama-3.2-1b \\
        --topologies v5p-8 h200-8 h200-1 --out bench_results/head_grad_blocks.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ONE_BLOCK = 2**62  # block bytes above any head's: one block


@contextlib.contextmanager
def head_blocks(block_bytes: int):
    """Traces within the block form the head's gradient in blocks of ``block_bytes``."""
    from jaxrl_llm.models import logprobs

    saved = logprobs.HEAD_GRAD_BLOCK_BYTES
    logprobs.HEAD_GRAD_BLOCK_BYTES = block_bytes
    try:
        yield
    finally:
        logprobs.HEAD_GRAD_BLOCK_BYTES = saved


def one_and_blocks(measure):
    """``measure(block_bytes)`` in one block and in the trainer's blocks."""
    from jaxrl_llm.models import logprobs

    return measure(ONE_BLOCK), measure(logprobs.HEAD_GRAD_BLOCK_BYTES)


def _model_config(model_name: str, layers: int | None = None):
    """The fp32, ``remat="full"`` config of ``model_name`` (optionally with ``layers`` layers)."""
    from jaxrl_llm.config.schema import ModelLoadConfig
    from jaxrl_llm.train.plan import model_config

    shipped = ROOT / "jaxrl_llm/configs/models" / model_name
    path = str(shipped) if shipped.is_dir() else model_name
    settings = ModelLoadConfig(path=path, dtype="float32", remat="full")
    config = model_config(settings, accelerator=False)
    return config if layers is None else config.replace(num_layers=layers)


def _compiled_update(model, rows: int, seq: int, micro: int, block_bytes: int):
    """The micro-batched Adam update of ``model`` (abstract or not) on ``rows x seq`` tokens,
    compiled with the head's gradient in blocks of ``block_bytes``; with its initial state."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxrl_llm.models import logprobs
    from jaxrl_llm.train import accumulate

    graphdef, params = nnx.split(model, nnx.Param)

    def sums(params, micro_batch):
        tokens, mask = micro_batch
        lm = nnx.merge(graphdef, params)
        logp = logprobs.completion_logprobs(lm, tokens, mask)
        total = -jnp.sum(logp * mask[:, 1:])
        return total, {"nll": (total, jnp.sum(mask[:, 1:]).astype(jnp.float32))}

    trainee = accumulate.Trainee("policy", optax.adam(1e-6), sums, lambda mb: jnp.float32(1.0))
    batch = (jax.ShapeDtypeStruct((rows, seq), jnp.int32), jax.ShapeDtypeStruct((rows, seq), bool))
    update = jax.jit(
        lambda p, o, b: accumulate.optimize((trainee,), (p,), (o,), b, micro_batch_size=micro)[:2],
        donate_argnums=(0, 1),
    )
    opt = jax.eval_shape(trainee.tx.init, params)
    with head_blocks(block_bytes):
        compiled = update.lower(params, opt, batch).compile()
    return compiled, (params, trainee.tx.init)


def update_temp_bytes(model_name: str, rows: int, seq: int, micro: int, block_bytes: int) -> dict:
    """The compiled update's temporaries for the model at ``model_name`` (abstract weights),
    its head's gradient in blocks of ``block_bytes`` (one block when that is above the head's
    size)."""
    from flax import nnx

    from jaxrl_llm.models.transformer import CausalLM

    config = _model_config(model_name)
    model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))
    t0 = time.perf_counter()
    compiled, _ = _compiled_update(model, rows, seq, micro, block_bytes)
    seconds = time.perf_counter() - t0
    head = config.vocab_size * config.hidden_size * 4
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_layers,
        "head_mib": round(head / 2**20, 1),
        "blocks": -(-head // block_bytes),
        "temp_mib": round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 1),
        "compile_s": round(seconds, 1),
    }


def time_update(model_name: str, layers: int, rows: int, seq: int, micro: int, rounds: int):
    """Seconds of the update (random weights, ``layers`` layers of ``model_name``'s shape), one
    block and blocks alternating in each of ``rounds`` rounds after a first call each."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxrl_llm.models.transformer import CausalLM

    config = _model_config(model_name, layers)
    rng = np.random.default_rng(0)
    batch = (
        rng.integers(0, config.vocab_size, (rows, seq)).astype(np.int32),
        np.ones((rows, seq), bool),
    )

    def build(block_bytes: int) -> list:
        model = CausalLM(config, rngs=nnx.Rngs(0))
        compiled, (params, init) = _compiled_update(model, rows, seq, micro, block_bytes)
        return [compiled, (params, init(params))]

    runs = dict(zip(("one_block", "blocks"), one_and_blocks(build), strict=True))
    seconds = {name: [] for name in runs}
    for r in range(rounds + 1):
        for name, run in runs.items():
            t0 = time.perf_counter()
            (params,), (opt,) = jax.block_until_ready(run[0](*run[1], batch))
            run[1] = (params, opt)  # the state was donated
            if r:  # the first call of each is left out
                seconds[name].append(round(time.perf_counter() - t0, 2))
    return {"model": model_name, "layers": layers, "rows": rows, "seq": seq, "seconds": seconds}


def plan_update_temps(topology: str, block_bytes: int, overrides: list[str] = ()) -> dict:
    """The update program's temporaries per device in ``jaxrl-llm plan`` of the 1B GRPO plan
    run of ``bench_accelerator.py`` on ``topology`` (with ``overrides`` on top), the head's
    gradient in blocks of ``block_bytes``."""
    import bench_accelerator

    from jaxrl_llm.config.validation import load_config
    from jaxrl_llm.train import plan as P

    spec = bench_accelerator.SHAPES["device"]["plan"]
    config = load_config(spec["config"], [*spec["overrides"], *overrides])
    with head_blocks(block_bytes):
        update = P.plan_run(config, P.parse_target(topology)).update
    return {
        "temp_gib": round(update.temporaries / 2**30, 3),
        "compile_s": round(update.compile_s, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["default", "qwen2.5-1.5b", "llama-3.2-1b"])
    ap.add_argument("--rows", type=int, default=8, help="sequences in the update's batch")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--topologies", nargs="*", default=[], help="plan targets, e.g. v5p-8 h200-8")
    ap.add_argument(
        "--plan-overrides",
        nargs="*",
        default=[],
        help="config overrides of the plan run, e.g. optim.micro_batch_size=64 (one micro-batch)",
    )
    ap.add_argument("--time", nargs="*", default=[], help="models to time (random weights)")
    ap.add_argument("--time-layers", type=int, default=2, help="their layers when timed")
    ap.add_argument("--time-rounds", type=int, default=3)
    ap.add_argument("--out", default="bench_results/head_grad_blocks.json")
    args = ap.parse_args(argv)
    if args.rows % args.micro:
        raise SystemExit(f"--micro {args.micro} must divide --rows {args.rows}")

    sys.path.insert(0, str(Path(__file__).parent))
    from _bench_common import machine_info  # importing it pins JAX to the CPU, as the CLI does

    machine = machine_info()
    results = []
    for name in args.models:
        one, blocked = one_and_blocks(
            lambda b, name=name: update_temp_bytes(name, args.rows, args.seq, args.micro, b)
        )
        row = {"model": name, "one_block": one, "blocks": blocked}
        row["saved_mib"] = round(one["temp_mib"] - blocked["temp_mib"], 1)
        results.append(row)
        print(json.dumps(row), flush=True)
    plans = []
    for topology in args.topologies:
        one, blocked = one_and_blocks(
            lambda b, t=topology: plan_update_temps(t, b, args.plan_overrides)
        )
        plan = {"topology": topology, "overrides": args.plan_overrides}
        plans.append(plan | {"one_block": one, "blocks": blocked})
        print(json.dumps(plans[-1]), flush=True)
    timed = []
    for name in args.time:
        timed.append(
            time_update(name, args.time_layers, args.rows, args.seq, args.micro, args.time_rounds)
        )
        print(json.dumps(timed[-1]), flush=True)
    machine["load_avg_after"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine, "command": " ".join(sys.argv)}
    result |= {"results": results, "plans": plans, "timed": timed}
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
