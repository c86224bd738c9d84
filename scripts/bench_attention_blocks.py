"""The reference attention's causal query blocks (``models.attention.QUERY_BLOCK``): memory and
time of a model's forward+backward on long packed rows, with and without them.

A 2-layer model with SmolLM2-135M's layer shapes (D=576, 9 query / 3 kv heads of 64, MLP
1536; a 1,024-token vocabulary so the attention, not the LM head, dominates), float32, no
remat, rows of two packed sequences each, ``value_and_grad`` of a mean log-prob. Reported:
XLA's compiled temporaries (``memory_analysis().temp_size_in_bytes``) and the best of three
timed calls (after one warm-up), for each row width, unblocked (one ``[T, S]`` softmax) and in
blocks of ``--block`` queries (each rematerialised, reading only the keys up to its end).

    python scripts/bench_attention_blocks.py --out bench_results/attention_blocks.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def measure(width: int, block: int | None, rows: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl_llm import models
    from jaxrl_llm.models import attention as attn

    attn.QUERY_BLOCK = block if block is not None else 2**31  # None: never blocked
    config = models.tiny_random_config(
        vocab_size=1024,
        hidden_size=576,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        num_layers=2,
    )
    graphdef, params = nnx.split(models.CausalLM(config, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(0), (rows, width), 3, config.vocab_size)
    half = width // 2
    segments = jnp.concatenate(
        [jnp.ones((rows, half), jnp.int32), jnp.full((rows, width - half), 2, jnp.int32)], 1
    )

    def loss(params):
        logits = nnx.merge(graphdef, params)(tokens, segment_ids_bt=segments)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 5])

    step = jax.jit(jax.value_and_grad(loss))
    temp = step.lower(params).compile().memory_analysis().temp_size_in_bytes
    jax.block_until_ready(step(params))
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(params))
        seconds.append(time.perf_counter() - t0)
    return {"temp_mib": temp / 2**20, "best_s": min(seconds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench_results/attention_blocks.json")
    args = ap.parse_args()

    from _bench_common import machine_info

    result = {"machine": machine_info(), "command": " ".join(sys.argv), "runs": []}
    for width in args.widths:
        whole = measure(width, None, args.rows, args.repeats)
        blocked = measure(width, args.block, args.rows, args.repeats)
        run = {
            "width": width,
            "rows": args.rows,
            "block": args.block,
            "whole": whole,
            "blocked": blocked,
            "temp_ratio": blocked["temp_mib"] / whole["temp_mib"],
            "speedup": whole["best_s"] / blocked["best_s"],
        }
        result["runs"].append(run)
        print(
            f"width {width}: temporaries {whole['temp_mib']:.0f} -> {blocked['temp_mib']:.0f} MiB,"
            f" {whole['best_s']:.3f} -> {blocked['best_s']:.3f} s ({run['speedup']:.2f}x)",
            flush=True,
        )
    result["machine"]["load_avg_after"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
