"""Rollout throughput: jaxrl_llm.rollout.generate vs transformers' generate, same prompts, same run.

SmolLM2-135M-Instruct (the default model), chat-templated prompts left-padded to one width (both
libraries get the same id and mask tensors), exactly ``--new-tokens`` new tokens per prompt
(no early stop: ``stop_token_ids=()`` here, ``min_new_tokens`` there), temperature 1.0, no
top-k/top-p. Reports new tokens/s for each batch size and library, the ratio, compilation time
separately (first call minus the best steady call), and the decode loop's achieved FLOP/s
against this machine's fp32 matmul peak measured in the same run.

Rounds alternate between the libraries (each round times every case once) and the best round is
reported with the median, so load from other processes disturbs both sides alike.

    OMP_WAIT_POLICY=PASSIVE python scripts/bench_rollout.py --batches 32 8 \
        --out bench_results/bench_rollout.json --markdown /tmp/bench_rollout.md

``--paged`` runs the engine comparison of issue 12 instead (:func:`paged_main`): the paged
engine (continuous batching, ``rollout/paged.py``) against the static engine on

1. **fixed**: ``--fixed-prompts`` chat prompts x ``--new-tokens`` tokens each;
2. **long-tail**: ``--lt-prompts`` prompts x G=``--lt-samples``, per-sample budgets drawn
   (seed 0) from a heavy tail: 80% of samples 16-48 tokens, 20% 256-512, no early stop, so
   every engine produces exactly the same useful tokens (those inside each budget; the static
   engine runs every row to the longest budget, the paged one stops each at its own).

Each engine is warmed up once on the same shapes (long-tail: all budgets 1, which compiles the
static engine's program and the paged prefills), then timed once; XLA compile time during the
timed call (the paged engine's decode programs of new page-table widths) is measured apart
(``jax.monitoring`` trace + lowering + backend-compile events) and subtracted.
Reports useful tokens/s, compile seconds and the peak KV-cache bytes (static: the dense
``[L, N, P + T, K, Dh]`` keys and values; paged: the peak pages held x page bytes). The paged
engine runs twice, with prefix sharing (its default) and without (``paged_unshared``), with
the prompt tokens it prefilled and those it found in another prompt's pages.
``--lt-torch`` adds transformers' ``generate`` on both workloads (static batch to the longest
budget) and, on the long tail, its continuous batching (``init_continuous_batching``,
``generate_batch``'s manager, per-request budgets).

    OMP_WAIT_POLICY=PASSIVE python scripts/bench_rollout.py --paged \
        --out bench_results/bench_rollout_paged.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

from _bench_common import machine_info

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

QUESTIONS = [
    "What is {a} + {b}? Answer with just the number.",
    "Write one sentence about the number {a}.",
    "What is {a} times {b}? Explain briefly.",
    "Name {b} animals that live in the sea.",
]


def make_prompts(n: int) -> list[str]:
    """``n`` varied chat prompts (different lengths, deterministic)."""
    return [QUESTIONS[i % len(QUESTIONS)].format(a=3 + 7 * i % 90, b=2 + i % 9) for i in range(n)]


def decode_flops(config, batch: int, prompt_lengths, new_tokens: int) -> tuple[float, float]:
    """(prefill, decode) model FLOPs: 2 per matmul weight per token plus attention.

    Prefill runs the padded width and forms logits only at the last position; decode counts
    the ``new_tokens - 1`` cached steps, attention over each sequence's real context.
    """
    d, f, layers = config.hidden_size, config.intermediate_size, config.num_layers
    h, k, hd, v = config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size
    per_layer = d * (h + 2 * k) * hd + h * hd * d + 3 * d * f
    body = 2 * layers * per_layer
    head = 2 * v * d
    width = max(prompt_lengths)
    prefill = batch * width * body + batch * head + batch * layers * 4 * h * hd * width * width / 2
    decode = 0.0
    for length in prompt_lengths:
        for step in range(1, new_tokens):
            context = length + step
            decode += body + head + layers * 4 * h * hd * context
    return float(prefill), float(decode)


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def jax_case(model, ids, mask, new_tokens: int, seed: list[int]):
    import jax

    from jaxrl_llm import rollout

    def run(max_new: int):
        seed[0] += 1
        out = rollout.generate(
            model,
            ids,
            mask,
            rng=jax.random.key(seed[0]),
            max_new_tokens=max_new,
            temperature=1.0,
            stop_token_ids=(),
        )
        jax.block_until_ready(out)
        return out

    return lambda: run(new_tokens), lambda: run(1)


def torch_case(model, ids, mask, new_tokens: int, pad_id: int):
    import torch

    ids_t = torch.tensor(ids, dtype=torch.long)
    mask_t = torch.tensor(mask, dtype=torch.long)

    def run():
        with torch.inference_mode():
            out = model.generate(
                ids_t,
                attention_mask=mask_t,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=pad_id,
            )
        assert out.shape[1] == ids.shape[1] + new_tokens
        return out

    return run


def matmul_peaks(n: int = 2048) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    a = np.random.RandomState(0).standard_normal((n, n)).astype(np.float32)
    ja, ta = jnp.asarray(a), torch.from_numpy(a)
    jb = ja.astype(jnp.bfloat16)
    mm = jax.jit(lambda x: x @ x)
    mm_bf16 = jax.jit(lambda x: jnp.dot(x, x, preferred_element_type=jnp.float32))
    mm(ja).block_until_ready()
    mm_bf16(jb).block_until_ready()
    return {
        "jax_fp32": lambda: mm(ja).block_until_ready(),
        "torch_fp32": lambda: ta @ ta,
        "jax_bf16_f32acc": lambda: mm_bf16(jb).block_until_ready(),
        "flops": 2 * n**3,
    }


def long_tail_budgets(
    num_prompts: int, num_samples: int, seed: int = 0, short=(16, 48), long=(256, 512)
):
    """int32[B, G]: 80% of samples uniform in ``short``, 20% uniform in ``long`` (inclusive,
    seeded; the rollout issue's long tail by default)."""
    import numpy as np

    rng = np.random.RandomState(seed)
    is_long = rng.rand(num_prompts, num_samples) < 0.2
    short_b = rng.randint(short[0], short[1] + 1, (num_prompts, num_samples))
    long_b = rng.randint(long[0], long[1] + 1, (num_prompts, num_samples))
    return np.where(is_long, long_b, short_b).astype(np.int32)


class _CompileSeconds:
    """Sums JAX's compile-path durations (trace, lowering, XLA compile) while active."""

    def __init__(self):
        self.seconds = 0.0

    def __call__(self, event: str, duration: float, **kwargs) -> None:
        if event.startswith("/jax/core/compile/"):
            self.seconds += duration

    def __enter__(self):
        import jax

        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        import jax

        jax.monitoring.unregister_event_duration_listener(self)


def paged_main(args) -> None:
    """The static vs paged engine comparison (issue 12): fixed and long-tail workloads."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_llm import models, rollout

    path = str(args.model or models.default_model_path())
    tokenizer = models.load_tokenizer(path)
    model = models.from_pretrained(path, dtype=jnp.float32)
    c = model.config
    result: dict = {
        "model": os.path.basename(path.rstrip("/")),
        "dtype": "float32",
        "sampling": "temperature 1.0, no top-k/top-p, no early stop",
        **machine_info(),
        "command": "OMP_WAIT_POLICY=PASSIVE python scripts/bench_rollout.py "
        + " ".join(sys.argv[1:]),
        "workloads": {},
    }
    kv_token_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4

    def run_engine(
        engine, ids, mask, g, t, budgets, seed, options=None, per_sample=True, label=None
    ):
        """Warm-up (per-sample budgets: all 1, the same programs; else the same call), then
        one timed call. Without ``per_sample`` no budgets are passed (today's call). ``label``
        names the row (default: the engine)."""
        kw = dict(
            max_new_tokens=t,
            num_samples=g,
            temperature=1.0,
            stop_token_ids=(),
            max_new_tokens_bg=budgets if per_sample else None,
            engine=engine,
            return_stats=True,
        )
        if engine == "paged":
            kw["paged_options"] = options
        warm_kw = {**kw, "max_new_tokens_bg": np.ones_like(budgets)} if per_sample else kw
        warm = rollout.generate(model, ids, mask, rng=jax.random.key(seed), **warm_kw)
        jax.block_until_ready(warm)
        with _CompileSeconds() as compiles:
            start = time.perf_counter()
            out, stats = rollout.generate(model, ids, mask, rng=jax.random.key(seed + 1), **kw)
            jax.block_until_ready(out)
            seconds = time.perf_counter() - start
        useful = int(np.asarray(out.mask).sum())
        assert useful == int(budgets.sum()), (useful, int(budgets.sum()))
        wall = seconds - compiles.seconds
        if stats is None:
            kv = kv_token_bytes * ids.shape[0] * g * (ids.shape[1] + t)
        else:
            kv = stats.peak_kv_bytes
        row = {
            "engine": label or engine,
            "seconds": round(seconds, 2),
            "compile_s_in_timed_call": round(compiles.seconds, 2),
            "useful_tokens": useful,
            "useful_tokens_per_s": round(useful / wall, 1),
            "peak_kv_mb": round(kv / 2**20, 1),
        }
        if stats is not None:
            row.update(
                decode_dispatches=stats.decode_dispatches,
                prefill_calls=stats.prefill_calls,
                prefill_tokens=stats.prefill_tokens,
                shared_prompt_tokens=stats.shared_prompt_tokens,
                preemptions=stats.preemptions,
                pool_pages=stats.pool_pages,
                num_slots=options.num_slots if options else None,
            )
        print(json.dumps(row), flush=True)
        return row

    def torch_row(ids, mask, g, t, budgets):
        import torch
        import transformers

        torch.set_num_threads(args.torch_threads)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids_t = torch.tensor(np.repeat(ids, g, axis=0), dtype=torch.long)
        mask_t = torch.tensor(np.repeat(mask, g, axis=0), dtype=torch.long)
        start = time.perf_counter()
        with torch.inference_mode():
            hf.generate(
                ids_t,
                attention_mask=mask_t,
                do_sample=True,
                top_k=0,
                max_new_tokens=t,
                min_new_tokens=t,
                pad_token_id=tokenizer.pad_token_id,
            )
        seconds = time.perf_counter() - start
        row = {
            "engine": "transformers_generate",
            "seconds": round(seconds, 2),
            "useful_tokens": int(budgets.sum()),
            "useful_tokens_per_s": round(int(budgets.sum()) / seconds, 1),
        }
        print(json.dumps(row), flush=True)
        return row

    def torch_batch_row(ids, mask, g, t, budgets):
        """transformers' continuous batching (``init_continuous_batching``, the manager behind
        ``generate_batch``, which takes per-request budgets): every sample a request with its
        own ``max_new_tokens`` and no stop id, all queued at once; the manager's start-up and
        warm-up are not timed."""
        import torch
        import transformers
        from transformers.generation.continuous_batching.utils import WorkloadHints

        torch.set_num_threads(args.torch_threads)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="paged|sdpa"
        ).eval()
        config = transformers.GenerationConfig(
            do_sample=True,
            top_k=0,
            temperature=1.0,
            max_new_tokens=t,
            eos_token_id=None,
            pad_token_id=tokenizer.pad_token_id,
        )
        prompts = [ids[b][mask[b]].tolist() for b in range(ids.shape[0])]
        hints = WorkloadHints(  # as generate_batch sizes its manager
            max_prompt_length=max(map(len, prompts)),
            max_generated_length=t,
            num_requests=len(prompts) * g,
        )
        manager = hf.init_continuous_batching(generation_config=config, workload_hints=hints)
        manager.start()
        try:
            start = time.perf_counter()
            requests = [
                manager.add_request(prompts[b], max_new_tokens=int(budgets[b, i]), eos_token_id=-1)
                for b in range(len(prompts))
                for i in range(g)
            ]
            done: dict[str, int] = {}
            while len(done) < len(requests):  # results arrive as requests finish
                result = manager.get_result(timeout=3600)
                if result is None:
                    raise RuntimeError(
                        f"transformers' continuous batching returned {len(done)} of "
                        f"{len(requests)} requests within the timeout"
                    )
                done[result.request_id] = len(result.generated_tokens)
            made = sum(done.values())
            seconds = time.perf_counter() - start
        finally:
            manager.stop(block=True)
        assert made == int(budgets.sum()), (made, int(budgets.sum()))
        row = {
            "engine": "transformers_continuous_batching",
            "seconds": round(seconds, 2),
            "useful_tokens": made,
            "useful_tokens_per_s": round(made / seconds, 1),
        }
        print(json.dumps(row), flush=True)
        return row

    workloads = []
    if args.fixed_prompts:
        ids, mask = rollout.encode_prompts(tokenizer, make_prompts(args.fixed_prompts))
        budgets = np.full((args.fixed_prompts, 1), args.new_tokens, np.int32)
        workloads.append(("fixed", ids, mask, 1, args.new_tokens, budgets))
    if args.lt_prompts:
        ids, mask = rollout.encode_prompts(tokenizer, make_prompts(args.lt_prompts))
        budgets = long_tail_budgets(args.lt_prompts, args.lt_samples)
        workloads.append(("long_tail", ids, mask, args.lt_samples, int(budgets.max()), budgets))
    for name, ids, mask, g, t, budgets in workloads:
        slots = args.lt_slots if name == "long_tail" else 0
        options = rollout.paged.PagedOptions(
            num_slots=slots or None,
            steps_per_dispatch=args.steps_per_dispatch
            or rollout.paged.PagedOptions().steps_per_dispatch,
            num_pages=(args.lt_pages if name == "long_tail" else 0) or None,
        )
        options = rollout.paged.resolve_options(
            options,
            num_seqs=ids.shape[0] * g,
            num_samples=g,
            longest_prompt=int(mask.sum(1).max()),
            max_new_tokens=t,
        )
        per_sample = name == "long_tail"
        unshared = dataclasses.replace(options, prefix_sharing=False)
        rows = [run_engine("paged", ids, mask, g, t, budgets, 10, options, per_sample)]
        if not args.skip_static:
            rows.append(run_engine("static", ids, mask, g, t, budgets, 20, None, per_sample))
        rows.append(
            run_engine(
                "paged", ids, mask, g, t, budgets, 10, unshared, per_sample, "paged_unshared"
            )
        )
        if args.lt_torch:
            rows.append(torch_row(ids, mask, g, t, budgets))
            if name == "long_tail":
                rows.append(torch_batch_row(ids, mask, g, t, budgets))
        by_engine = {row["engine"]: row["useful_tokens_per_s"] for row in rows}
        static = by_engine.get("static")
        generate = by_engine.get("transformers_generate")
        for row in rows:
            if static:
                row["vs_static"] = round(row["useful_tokens_per_s"] / static, 2)
            if generate:
                row["vs_transformers_generate"] = round(row["useful_tokens_per_s"] / generate, 2)
        result["workloads"][name] = {
            "prompts": int(ids.shape[0]),
            "samples": g,
            "max_new_tokens": t,
            "prompt_width": int(ids.shape[1]),
            "budget_histogram": {
                "16-48": int(((budgets >= 16) & (budgets <= 48)).sum()),
                "256-512": int((budgets >= 256).sum()),
            }
            if name == "long_tail"
            else None,
            "results": rows,
        }
    result["load_avg_after"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 8])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--torch-threads", type=int, default=os.cpu_count())
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--no-bf16", action="store_true", help="skip the JAX bf16-compute rows")
    ap.add_argument("--model", default=None, help="HF folder (default: the default model)")
    ap.add_argument("--out", default="bench_results/bench_rollout.json")
    ap.add_argument("--markdown", default=None, help="also write a markdown table here")
    ap.add_argument("--paged", action="store_true", help="static vs paged engine (issue 12)")
    ap.add_argument("--fixed-prompts", type=int, default=32, help="--paged: 0 skips")
    ap.add_argument("--lt-prompts", type=int, default=64, help="--paged long-tail; 0 skips")
    ap.add_argument("--lt-samples", type=int, default=4)
    ap.add_argument(
        "--lt-torch",
        action="store_true",
        help="--paged: add transformers (generate on both workloads; continuous batching on"
        " the long tail)",
    )
    ap.add_argument("--lt-slots", type=int, default=0, help="long-tail decode slots (0: default)")
    ap.add_argument("--steps-per-dispatch", type=int, default=0, help="0: PagedOptions' default")
    ap.add_argument("--skip-static", action="store_true", help="--paged: no static-engine rows")
    ap.add_argument(
        "--lt-pages",
        type=int,
        default=0,
        help="long-tail pool pages, trash page included (0: the default pool); a pool below the"
        " live tokens preempts and recomputes",
    )
    args = ap.parse_args()
    if args.paged:
        if args.out == "bench_results/bench_rollout.json":
            args.out = "bench_results/bench_rollout_paged.json"
        paged_main(args)
        return

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl_llm import models, rollout

    path = str(args.model or models.default_model_path())
    tokenizer = models.load_tokenizer(path)
    prompts = make_prompts(max(args.batches))
    result: dict = {
        "model": os.path.basename(path.rstrip("/")),
        "new_tokens": args.new_tokens,
        "sampling": "temperature 1.0, no top-k/top-p, no early stop",
        **machine_info(),
        "rounds": args.rounds,
        "command": "OMP_WAIT_POLICY=PASSIVE python scripts/bench_rollout.py "
        + " ".join(sys.argv[1:]),
    }
    jax_models = {"jax_fp32": models.from_pretrained(path, dtype=jnp.float32)}
    if not args.no_bf16:
        jax_models["jax_bf16"] = models.from_pretrained(path, dtype=jnp.bfloat16)
    config = jax_models["jax_fp32"].config
    param_count = sum(x.size for x in jax.tree.leaves(nnx.state(jax_models["jax_fp32"], nnx.Param)))
    result["parameters"] = int(param_count)
    torch_model = None
    if not args.skip_torch:
        import torch
        import transformers

        torch.set_num_threads(args.torch_threads)
        result["torch"] = torch.__version__
        result["transformers"] = transformers.__version__
        torch_model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32
        ).eval()
        result["torch_attn_implementation"] = torch_model.config._attn_implementation

    cases: dict[tuple[str, int], object] = {}
    prefill_cases: dict[tuple[str, int], object] = {}
    first: dict[str, float] = {}
    shapes: dict[int, dict] = {}
    seed = [0]
    for batch in args.batches:
        ids, mask = rollout.encode_prompts(tokenizer, prompts[:batch])
        lengths = mask.sum(1).tolist()
        shapes[batch] = {"width": int(ids.shape[1]), "prompt_lengths": lengths}
        for name, model in jax_models.items():
            full, prefill = jax_case(model, ids, mask, args.new_tokens, seed)
            first[f"{name}_b{batch}"] = _time(full)
            first[f"{name}_b{batch}_prefill_only"] = _time(prefill)
            cases[(name, batch)] = full
            prefill_cases[(name, batch)] = prefill
        if torch_model is not None:
            run = torch_case(torch_model, ids, mask, args.new_tokens, tokenizer.pad_token_id)
            first[f"torch_fp32_b{batch}"] = _time(run)
            cases[("torch_fp32", batch)] = run
    peaks = matmul_peaks() if jax.default_backend() == "cpu" and torch_model is not None else None

    times: dict = {}
    for _ in range(args.rounds):
        for key, fn in cases.items():
            times.setdefault(key, []).append(_time(fn))
        for key, fn in prefill_cases.items():
            times.setdefault(("prefill", *key), []).append(_time(fn))
        if peaks:
            for lib in ("jax_fp32", "torch_fp32", "jax_bf16_f32acc"):
                times.setdefault(("matmul", lib), []).append(_time(peaks[lib]))

    peak = None
    if peaks:
        result["matmul_peak_gflops"] = {
            lib: round(peaks["flops"] / min(times[("matmul", lib)]) / 1e9, 1)
            for lib in ("jax_fp32", "torch_fp32", "jax_bf16_f32acc")
        }
        peak = max(
            result["matmul_peak_gflops"]["jax_fp32"], result["matmul_peak_gflops"]["torch_fp32"]
        )
    rows = []
    for (name, batch), _ in cases.items():
        best = min(times[(name, batch)])
        new = batch * args.new_tokens
        row = {
            "library": name,
            "batch": batch,
            "width": shapes[batch]["width"],
            "seconds_best": round(best, 3),
            "seconds_median": round(statistics.median(times[(name, batch)]), 3),
            "new_tokens_per_s": round(new / best, 1),
            "first_call_s": round(first[f"{name}_b{batch}"], 2),
        }
        if name.startswith("jax"):
            prefill_best = min(times[("prefill", name, batch)])
            decode_s = best - prefill_best
            pf, df = decode_flops(config, batch, shapes[batch]["prompt_lengths"], args.new_tokens)
            row["compile_s"] = round(first[f"{name}_b{batch}"] - best, 2)
            row["compile_prefill_only_s"] = round(
                first[f"{name}_b{batch}_prefill_only"] - prefill_best, 2
            )
            row["prefill_s"] = round(prefill_best, 3)
            row["decode_s"] = round(decode_s, 3)
            row["decode_tokens_per_s"] = round(batch * (args.new_tokens - 1) / decode_s, 1)
            row["prefill_gflops"] = round(pf / prefill_best / 1e9, 1)
            row["decode_gflops"] = round(df / decode_s / 1e9, 1)
            # Every decode step reads every weight once (in the compute dtype).
            weight_bytes = param_count * jnp.dtype(jax_models[name].config.dtype).itemsize
            row["decode_weight_gb_per_s"] = round(
                weight_bytes * (args.new_tokens - 1) / decode_s / 1e9, 1
            )
            if peak:
                row["decode_fraction_of_fp32_peak"] = round(df / decode_s / 1e9 / peak, 3)
        rows.append(row)
    for row in rows:
        ref = next(
            (r for r in rows if r["library"] == "torch_fp32" and r["batch"] == row["batch"]),
            None,
        )
        if ref and row["library"] != "torch_fp32":
            row["speedup_vs_torch_fp32"] = round(
                row["new_tokens_per_s"] / ref["new_tokens_per_s"], 2
            )
    result["load_avg_after"] = os.getloadavg()
    result["shapes"] = shapes
    result["results"] = rows
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(result))


def markdown(result: dict) -> str:
    lines = [
        "| library | batch | new tok/s (best) | vs transformers | first call s | compile s | "
        "decode tok/s | decode GFLOP/s | of fp32 peak |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["results"]:
        lines.append(
            f"| {r['library']} | {r['batch']} | {r['new_tokens_per_s']} | "
            f"{r.get('speedup_vs_torch_fp32', '—')} | {r['first_call_s']} | "
            f"{r.get('compile_s', '—')} | {r.get('decode_tokens_per_s', '—')} | "
            f"{r.get('decode_gflops', '—')} | {r.get('decode_fraction_of_fp32_peak', '—')} |"
        )
    peaks = result.get("matmul_peak_gflops", {})
    lines.append("")
    lines.append(
        f"fp32 matmul peak (2048³, same run): {peaks} GFLOP/s; load average "
        f"before/after {result['load_avg_before']} / {result['load_avg_after']}."
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
