"""Where one engine's time goes on the fixed rollout workload (a diagnostic, not a benchmark).

The fixed workload of ``bench_rollout.py --paged`` (SmolLM2-135M-Instruct fp32, ``--prompts``
chat prompts, temperature 1, no early stop), one engine per process (``--engine``): the wall
time of calls with 1, 16 and 64 new tokens (best of ``--rounds``; the 1-token call is the
prefill and the first sample, ``(t64 - t16) / 48`` the marginal decode step), and with
``--trace`` one profiled 64-token call (``jax.profiler``), its XLA:CPU thunk time summed per
compiled program and per op kind (the fusion name without its number). Run each engine in
its own process, alone on the machine, and compare:

    OMP_WAIT_POLICY=PASSIVE python scripts/profile_rollout.py --engine static --trace
    OMP_WAIT_POLICY=PASSIVE python scripts/profile_rollout.py --engine paged --trace

Profiling slows the run (~1.5x here); compare traced numbers only with traced numbers.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile

from bench_rollout import _time, make_prompts

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def op_times(trace_dir: str) -> dict[str, collections.Counter]:
    """Thunk microseconds per compiled program and, within each, per op kind."""
    (path,) = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)
    with gzip.open(path) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    per_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in events:
        module = e.get("args", {}).get("hlo_module")
        if e.get("ph") == "X" and module:
            per_kind[module][re.sub(r"\.\d+$", "", e["name"])] += e["dur"]
    return per_kind


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=("static", "paged"), required=True)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trace", action="store_true", help="also profile one 64-token call")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from jaxrl_llm import models, rollout

    path = str(models.default_model_path())
    tokenizer = models.load_tokenizer(path)
    model = models.from_pretrained(path, dtype=jnp.float32)
    ids, mask = rollout.encode_prompts(tokenizer, make_prompts(args.prompts))

    def run(new_tokens: int, seed: int) -> None:
        out = rollout.generate(
            model,
            ids,
            mask,
            rng=jax.random.key(seed),
            max_new_tokens=new_tokens,
            temperature=1.0,
            stop_token_ids=(),
            engine=args.engine,
        )
        jax.block_until_ready(out)

    for t in (1, 16, 64):  # compile every program first
        run(t, 0)
    best = {}
    for r in range(args.rounds):
        for t in (1, 16, 64):
            best[t] = min(best.get(t, float("inf")), _time(lambda t=t, r=r: run(t, 10 + r)))
    step_ms = (best[64] - best[16]) / 48 * 1e3
    print(
        f"{args.engine}: prompts {ids.shape}; 1 token {best[1]:.3f} s, 16 {best[16]:.3f} s, "
        f"64 {best[64]:.3f} s ({args.prompts * 64 / best[64]:.1f} tok/s); marginal decode "
        f"step {step_ms:.1f} ms; 16-token call minus 15 marginal steps "
        f"{best[16] - 15 * step_ms / 1e3:.3f} s"
    )
    if not args.trace:
        return
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            run(64, 99)
        per_kind = op_times(trace_dir)
    for module, kinds in sorted(per_kind.items(), key=lambda mk: -mk[1].total())[:4]:
        top = ", ".join(f"{k} {v / 1e6:.3f}" for k, v in kinds.most_common(8))
        print(f"  {module}: {kinds.total() / 1e6:.3f} s of thunks ({top})")


if __name__ == "__main__":
    main()
