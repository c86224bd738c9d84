"""The trainer's RL step under several config variants, timed side by side in one process.

Each variant (``NAME=key=value,key=value``, overrides on ``--config``) gets its own setup and
RL step (``loop._rl_step``, the training loop's); every variant then runs the same synthetic
batches of ``scripts/probe_update_shapes.py`` (``--shapes``, ``completion:prompt`` tokens),
once to compile and then ``--rounds`` times, the variants alternating within each round, so
that the machine's drift falls on all of them alike. A variant named with the suffix
``+plain`` traces its step with the fused gradient accumulation turned off
(``models/grad_accumulation``: the plain accumulate-then-add, for the layers and the LM head),
``+plainhead`` with only the LM head's turned off (``grad_accumulation.map_chunks``), for the
A/B of those changes.
Peak memory is per process: measure it with ``probe_update_shapes.py``, one variant per run.

    python scripts/bench_update_variants.py --out bench_results/update_variants.json \
        --variants none-256=model.remat=none,optim.micro_batch_tokens=256 \
        full-512=model.remat=full,optim.micro_batch_tokens=512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
PLAIN = {"+plain": ("scan", "map_chunks"), "+plainhead": ("map_chunks",)}
"""Name suffix -> the fused paths of ``models/grad_accumulation`` that the variant turns off."""


def _plain(name: str) -> tuple[str, ...]:
    return next((off for suffix, off in PLAIN.items() if name.endswith(suffix)), ())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--variants", nargs="+", required=True, help="NAME=key=value,key=value")
    ap.add_argument("--shapes", nargs="+", default=["24:64", "11:40"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench_results/update_variants.json")
    args = ap.parse_args()

    sys.path.insert(0, str(Path(__file__).parent))
    import numpy as np
    from _bench_common import machine_info  # importing it pins JAX to the CPU, as the CLI does
    from probe_update_shapes import synthetic_groups

    from jaxrl_llm.config.validation import load_config
    from jaxrl_llm.models import grad_accumulation
    from jaxrl_llm.train import hostmem, loop
    from jaxrl_llm.train import setup as su

    machine = machine_info()
    hostmem.release_after_compiles()
    runs: dict[str, list] = {}
    for spec in args.variants:
        name, _, overrides = spec.partition("=")
        if not overrides and not _plain(name):
            raise SystemExit(f"--variants {spec}: expected NAME=key=value[,key=value...]")
        config = load_config(args.config, ["data.eval_size=0", *filter(None, overrides.split(","))])
        setup = su.resolve(config, run_dir=tempfile.mkdtemp(prefix="variants_"))
        runs[name] = [loop._rl_step(setup), setup.state, setup]
    first = next(iter(runs.values()))[2]
    rng = np.random.default_rng(0)
    batches = {s: synthetic_groups(first, *map(int, s.split(":")), rng) for s in args.shapes}
    fused = {f: getattr(grad_accumulation, f) for f in PLAIN["+plain"]}

    def run(name: str, groups) -> float:
        step, state, _ = runs[name]
        for f in _plain(name):  # only the first call traces; the later ones reuse it
            setattr(grad_accumulation, f, lambda *a, **k: None)
        try:
            hostmem.release_free_heap()
            t0 = time.perf_counter()
            runs[name][1], _ = step(state, groups)
            return time.perf_counter() - t0
        finally:
            for f, fn in fused.items():
                setattr(grad_accumulation, f, fn)

    for groups in batches.values():  # compile every program first
        for name in runs:
            run(name, groups)
    seconds: dict[str, dict[str, list[float]]] = {n: {s: [] for s in batches} for n in runs}
    for r in range(args.rounds):
        for shape, groups in batches.items():
            for name in runs:
                seconds[name][shape].append(round(run(name, groups), 2))
            print(r, shape, {n: seconds[n][shape][-1] for n in runs}, flush=True)
    base = next(iter(runs))
    median = {n: {s: statistics.median(v) for s, v in by.items()} for n, by in seconds.items()}
    summary = {  # vs_first > 1: faster than the first variant
        n: {s: {"median_s": m, "vs_first": round(median[base][s] / m, 3)} for s, m in by.items()}
        for n, by in median.items()
    }
    machine["load_avg_after"] = os.getloadavg()
    result = {"machine": machine, "command": " ".join(sys.argv), "seconds": seconds}
    result["summary"] = summary
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
