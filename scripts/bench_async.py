"""Async RL (issue 16): sync time and the per-step timeline, synchronous vs async, one run.

Each configuration trains ``--steps`` steps of ``--config`` (default the tiny random model) in
its own child process on ``--devices`` fake CPU devices (``XLA_FLAGS``), one after the other:

* ``colocated s=0``: today's synchronous loop;
* ``split s=0``: the rollout on each process's first ``--rollout-fraction`` of the devices
  (default half: 4 + 4 of 8, so that the colocated run's train mesh, ``data=4``, is the same),
  synchronous (the weight sync after every update, verified);
* ``split s=1``: the rollout of step t + 1 runs while update t runs (verl's one-step off-policy);
* ``split s=2 partial``: staleness 2 with partial rollouts (``--partial`` tokens per window).

Reported per configuration, over the steps after ``--warmup``: median step, update and rollout
seconds, the sync's seconds and bytes, and from ``RUN_DIR/timeline.jsonl`` the *overlap*: the
fraction of rollout seconds that lie inside an update's window (from the return of its
asynchronous dispatch to its metrics). On a CPU the
overlap does not make a step faster (the fake devices share the same cores: the rollout and the
update compete for them); on an accelerator with a split placement it is the point.

    JAX_PLATFORMS=cpu python scripts/bench_async.py --steps 6 --warmup 2
    JAX_PLATFORMS=cpu python scripts/bench_async.py --config quickstart --steps 4 --warmup 1 \\
        --set rollout.prompts_per_step=12

Writes ``bench_results/async.json`` (with the machine's ``lscpu`` model and flags and the load
average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import machine_info

REPO = Path(__file__).resolve().parents[1]

CONFIGS = {
    "colocated s=0": [],
    "split s=0": ["placement.mode=split"],
    "split s=1": ["placement.mode=split", "train.max_staleness=1"],
    "split s=2 partial": ["placement.mode=split", "train.max_staleness=2"],
}

CHILD = """
import json, sys, time
from jaxrl_llm.config import load_config
from jaxrl_llm.train import loop
config = load_config(sys.argv[1], json.loads(sys.argv[3]))
t0 = time.perf_counter()
loop.train(config, run_dir=sys.argv[2], progress=False, log=lambda *_: None)
print(json.dumps({"wall_s": time.perf_counter() - t0}))
"""


def _overlap(timeline: list[dict]) -> tuple[float, float]:
    """(rollout seconds inside update windows, all rollout seconds) over the steps given; an
    update's window runs from the return of its dispatch to its metrics."""
    inside = total = 0.0
    for step in timeline:
        updates = [
            (p.get("dispatched", p["start"]), p["end"])
            for p in step["phases"]
            if p["phase"] == "update"
        ]
        for p in step["phases"]:
            if p["phase"] != "rollout":
                continue
            total += p["end"] - p["start"]
            for a, b in updates:
                inside += max(0.0, min(b, p["end"]) - max(a, p["start"]))
    return inside, total


def run(name: str, overrides: list[str], args: argparse.Namespace, root: Path) -> dict:
    run_dir = root / name.replace(" ", "_").replace("=", "")
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    env.setdefault("JAX_PLATFORMS", "cpu")
    extra = [
        f"train.max_steps={args.steps}",
        "train.save_every=0",
        "train.eval_every=0",
        "data.eval_size=0",
        f"placement.rollout_fraction={args.rollout_fraction}",
        *args.set,
        *overrides,
    ]
    if "partial" in name:
        extra.append(f"train.partial_rollout_tokens={args.partial}")
    config = (
        args.config
        if args.config.endswith(".yaml")
        else str(REPO / "configs" / f"{args.config}.yaml")
    )
    cmd = [sys.executable, "-c", CHILD, config, str(run_dir), json.dumps(extra)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    if out.returncode:
        raise SystemExit(f"{name} failed:\n{out.stderr[-4000:]}")
    wall = json.loads(out.stdout.strip().splitlines()[-1])["wall_s"]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if "time/step" in r][args.warmup :]

    def median(key: str) -> float | None:
        values = [r[key] for r in steady if key in r]
        return statistics.median(values) if values else None

    result = {
        "overrides": extra,
        "wall_s": wall,
        "step_s": median("time/step"),
        "update_s": median("time/update"),
        "rollout_s": median("time/rollout"),
        "sync_s": median("sync/seconds"),
        "sync_bytes": median("sync/bytes"),
        "staleness_mean": median("async/staleness_mean"),
        "ratio_mean": median("rollout_corr/ratio_mean"),
    }
    timeline_file = run_dir / "timeline.jsonl"
    if timeline_file.exists():
        timeline = [json.loads(x) for x in timeline_file.read_text().splitlines()]
        inside, total = _overlap(timeline[args.warmup :])
        result["overlap_fraction"] = inside / total if total else 0.0
        result["timeline"] = timeline
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rollout-fraction", type=float, default=0.5)
    parser.add_argument("--partial", type=int, default=4)
    # the same train mesh (data=4) colocated on 8 devices and split 4 + 4
    parser.add_argument("--set", nargs="*", default=["mesh.data=4", "rollout.prompts_per_step=4"])
    parser.add_argument("--only", nargs="*", default=None, help="configuration names to run")
    parser.add_argument("--out", default=str(REPO / "bench_results" / "async.json"))
    args = parser.parse_args()
    result = {"machine": machine_info(), "args": vars(args), "runs": {}}
    result["machine"]["load_avg_before"] = os.getloadavg()
    with tempfile.TemporaryDirectory() as root:
        for name, overrides in CONFIGS.items():
            if args.only and name not in args.only:
                continue
            result["runs"][name] = run(name, overrides, args, Path(root))
            r = result["runs"][name]
            print(
                f"{name:18s} step {r['step_s']:.3f} s  update {r['update_s']:.3f}  rollout "
                f"{r['rollout_s']:.3f}  sync {r['sync_s'] or 0:.4f} s "
                f"({(r['sync_bytes'] or 0) / 2**20:.1f} MiB)  overlap "
                f"{r.get('overlap_fraction', 0):.2f}",
                flush=True,
            )
    result["machine"]["load_avg_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
