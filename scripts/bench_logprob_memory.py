"""Peak memory of per-token log-probs (forward, and forward+backward) for an RL-sized batch.

Compares three ways to get ``log π(y_t)`` for B=8, T=1024, V=49152 (SmolLM2's vocabulary,
D=576), all float32:

* ``full``: logits ``[B, T, V]`` formed at once, then ``core.token_logprobs`` unchunked;
* ``full+core_chunked``: logits formed at once, ``core.token_logprobs(chunk_size=C)``;
* ``fused_chunked``: ``models.logprobs.hidden_logprobs`` — logits formed chunk by chunk from
  the hidden states and dropped, never ``[B, T, V]``.

Each variant runs in its own process; reported are XLA's compiled temp buffer size and the
process's measured peak RSS above the inputs. JSON goes to ``--out``.

    python scripts/bench_logprob_memory.py --out bench_results/logprob_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

VARIANTS = ("full", "full+core_chunked", "fused_chunked")


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_one(variant: str, mode: str, b: int, t: int, v: int, d: int, chunk: int) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl_llm import models
    from jaxrl_llm.core import logprobs as core_logprobs
    from jaxrl_llm.models.logprobs import hidden_logprobs

    config = models.ModelConfig(
        vocab_size=v,
        hidden_size=d,
        intermediate_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
        tie_word_embeddings=True,
    )
    lm = models.CausalLM(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(lm)
    key = jax.random.key(1)
    h = jax.random.normal(key, (b, t, d), jnp.float32)
    y = jax.random.randint(key, (b, t), 0, v)

    def logp(params, h):
        m = nnx.merge(graphdef, params)
        if variant == "fused_chunked":
            return hidden_logprobs(m, h, y, chunk_size=chunk)
        logits = m.logits(h)
        size = chunk if variant == "full+core_chunked" else None
        return core_logprobs.token_logprobs(logits, y, chunk_size=size)

    if mode == "forward":
        fn = jax.jit(logp)
    else:
        fn = jax.jit(jax.grad(lambda p, h: jnp.sum(logp(p, h)), argnums=(0, 1)))
    compiled = fn.lower(params, h).compile()
    mem = compiled.memory_analysis()
    jax.block_until_ready((params, h, y))
    base = _rss_mb()
    start = time.perf_counter()
    jax.block_until_ready(compiled(params, h))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "variant": variant,
        "mode": mode,
        "chunk_size": None if variant == "full" else chunk,
        "xla_temp_mb": round(mem.temp_size_in_bytes / 2**20, 1),
        "xla_args_out_mb": round(
            (mem.argument_size_in_bytes + mem.output_size_in_bytes) / 2**20, 1
        ),
        "rss_peak_above_inputs_mb": round(peak - base, 1),
        "seconds": round(seconds, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--dim", type=int, default=576)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--out", default="bench_results/logprob_memory.json")
    ap.add_argument("--one", nargs=2, metavar=("VARIANT", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    dims = (args.batch, args.seq, args.vocab, args.dim, args.chunk)
    if args.one:
        print(json.dumps(run_one(args.one[0], args.one[1], *dims)))
        return
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    rows = []
    for mode in ("forward", "forward+backward"):
        for variant in VARIANTS:
            cmd = [sys.executable, __file__, "--one", variant, mode]
            cmd += [f"--batch={args.batch}", f"--seq={args.seq}", f"--vocab={args.vocab}"]
            cmd += [f"--dim={args.dim}", f"--chunk={args.chunk}"]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    logits_mb = args.batch * args.seq * args.vocab * 4 / 2**20
    result = {
        "batch": args.batch,
        "seq": args.seq,
        "vocab": args.vocab,
        "dim": args.dim,
        "f32_logits_mb": round(logits_mb, 1),
        "backend": "cpu",
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
