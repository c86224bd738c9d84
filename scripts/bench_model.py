"""Forward and forward+backward throughput of SmolLM2-135M: our JAX model vs transformers (torch).

Same checkpoint (the default model), batch, sequence length and dtype (float32) for both, in one
run. forward+backward is the mean next-token cross-entropy and its gradient for every
parameter. The fp32 matmul peak of both libraries is measured too, and model FLOP/s reported as
a fraction of it (or of ``--peak-tflops`` on an accelerator: MFU).

Timings alternate between the two libraries round by round and report the best round (and the
median), so load from other processes on a shared machine disturbs both sides alike.

    OMP_WAIT_POLICY=PASSIVE python scripts/bench_model.py --batch 8 --seq 128 \
        --out bench_results/bench_model.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from _bench_common import machine_info

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def model_flops_per_token(config, seq: int) -> tuple[float, float]:
    """(forward, forward+backward) FLOPs per token: 2·matmul params + attention, ×3 for bwd."""
    d, f, layers = config.hidden_size, config.intermediate_size, config.num_layers
    h, k, hd, v = config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size
    per_layer = d * (h + 2 * k) * hd + h * hd * d + 3 * d * f
    matmul = layers * per_layer + v * d  # + LM head; the embedding lookup is free
    attention = layers * 2 * seq * h * hd  # QK^T and PV over the full (unmasked) square
    forward = 2 * matmul + 2 * attention
    return float(forward), float(3 * forward)


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def jax_cases(path, batch: int, seq: int, remat: str, dtype: str) -> tuple[dict, object]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxrl_llm import models

    model = models.from_pretrained(path, dtype=jnp.dtype(dtype), remat=remat)
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    tokens = jnp.asarray(
        np.random.RandomState(0).randint(0, model.config.vocab_size, (batch, seq)), jnp.int32
    )

    def loss_fn(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)
        return -jnp.mean(picked)

    fwd = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
    grad = jax.jit(jax.value_and_grad(loss_fn))
    cases = {
        "forward": lambda: jax.block_until_ready(fwd(params, tokens)),
        "forward_backward": lambda: jax.block_until_ready(grad(params, tokens)),
    }
    first = {f"first_call_{k}_s": _seconds(fn) for k, fn in cases.items()}  # compile + run
    return {"cases": cases, "first": first}, model.config


def torch_cases(path, batch: int, seq: int, threads: int) -> dict:
    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()  # no dropout in this model anyway; both sides compute the same thing
    tokens = torch.tensor(
        np.random.RandomState(0).randint(0, model.config.vocab_size, (batch, seq))
    )

    def forward():
        with torch.no_grad():
            model(tokens)

    def forward_backward():
        model.zero_grad(set_to_none=True)
        model(tokens, labels=tokens).loss.backward()

    cases = {"forward": forward, "forward_backward": forward_backward}
    for fn in cases.values():
        fn()
    return {"cases": cases, "first": {}}


def matmul_cases(n: int = 2048) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    a = np.random.RandomState(0).standard_normal((n, n)).astype(np.float32)
    ja, ta = jnp.asarray(a), torch.from_numpy(a)
    mm = jax.jit(lambda x: x @ x)
    mm(ja).block_until_ready()
    return {
        "jax": lambda: mm(ja).block_until_ready(),
        "torch": lambda: ta @ ta,
        "flops": 2 * n**3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--remat", default="none")
    ap.add_argument("--torch-threads", type=int, default=os.cpu_count())
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument(
        "--also-bf16", action="store_true", help="add a JAX row with bf16 compute (f32 params)"
    )
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="accelerator peak for MFU (default on CPU: the measured fp32 matmul peak)",
    )
    ap.add_argument("--model", default=None, help="HF folder (default: the default model)")
    ap.add_argument("--out", default="bench_results/bench_model.json")
    args = ap.parse_args()

    import jax

    from jaxrl_llm import models

    path = args.model or str(models.default_model_path())
    tokens = args.batch * args.seq
    result: dict = {
        "model": os.path.basename(path.rstrip("/")),
        "batch": args.batch,
        "seq": args.seq,
        "dtype": "float32",
        **machine_info(),
        "rounds": args.rounds,
    }
    libs: dict[str, dict] = {}
    libs["jax"], config = jax_cases(path, args.batch, args.seq, args.remat, "float32")
    if args.also_bf16:
        libs["jax_bf16_compute"], _ = jax_cases(path, args.batch, args.seq, args.remat, "bfloat16")
    if not args.skip_torch:
        import torch

        result["torch"] = torch.__version__
        libs["torch"] = torch_cases(path, args.batch, args.seq, args.torch_threads)
    on_cpu = jax.default_backend() == "cpu"
    mm = matmul_cases() if on_cpu and not args.skip_torch else None

    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):  # interleaved: each round times every case once
        for lib, entry in libs.items():
            for case, fn in entry["cases"].items():
                times.setdefault((lib, case), []).append(_seconds(fn))
        if mm:
            for lib in ("jax", "torch"):
                times.setdefault(("matmul", lib), []).append(_seconds(mm[lib]))

    peak_gflops = None
    if mm:
        result["matmul_peak_gflops"] = {
            lib: round(mm["flops"] / min(times[("matmul", lib)]) / 1e9, 1)
            for lib in ("jax", "torch")
        }
        peak_gflops = max(result["matmul_peak_gflops"].values())
    if args.peak_tflops:
        peak_gflops = args.peak_tflops * 1e3
    fwd_flops, fb_flops = model_flops_per_token(config, args.seq)
    result["model_gflop_per_token"] = {
        "forward": round(fwd_flops / 1e9, 4),
        "forward_backward": round(fb_flops / 1e9, 4),
    }
    for lib, entry in libs.items():
        row = dict(entry["first"])
        for case, flops in (("forward", fwd_flops), ("forward_backward", fb_flops)):
            best = min(times[(lib, case)])
            row[f"{case}_s_best"] = best
            row[f"{case}_s_median"] = statistics.median(times[(lib, case)])
            row[f"{case}_tok_s"] = tokens / best
            row[f"{case}_gflops"] = flops * tokens / best / 1e9
            if peak_gflops:
                row[f"{case}_frac_of_peak"] = row[f"{case}_gflops"] / peak_gflops
        result[f"{lib}_results"] = {k: round(v, 4) for k, v in row.items()}
    if "torch" in libs:
        result["jax_over_torch"] = {
            case: round(
                result["jax_results"][f"{case}_tok_s"] / result["torch_results"][f"{case}_tok_s"], 3
            )
            for case in ("forward", "forward_backward")
        }
    result["load_avg_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
