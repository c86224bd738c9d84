"""One GRPO step of two checkouts of jaxrl_llm side by side: before and after a change.

For a change to the trainer's shape the numbers that must not get worse are the step time of
``scripts/bench_train_step.py``'s workload (SmolLM2-135M fp32, 8 prompts x 4 samples x 64
tokens, beta = 0.04), the host<->device transfers per step (``scripts/count_transfers.py``) and
the size of the files the change was about. This script runs each checkout's own
``bench_train_step.py --child ours`` alternately (before, after, before, after, ...: the machine's
noise hits both alike), each child importing its own checkout's ``jaxrl_llm`` through
``PYTHONPATH``, then the transfer count of each, and counts lines per file.

    git worktree add /tmp/before <commit>
    python scripts/bench_before_after.py --before /tmp/before --rounds 2 --steps 3 \\
        --json bench_results/before_after.json

Run it alone on the machine (XLA:CPU suffers from a busy core far more than torch does) and
record ``lscpu``'s model and flags and the load average with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = (
    "jaxrl_llm/recipe.py",
    "jaxrl_llm/algorithms.py",
    "jaxrl_llm/objective.py",
    "jaxrl_llm/explain.py",
    "jaxrl_llm/config.py",
    "jaxrl_llm/config/engine.py",
    "jaxrl_llm/config/schema.py",
    "jaxrl_llm/config/validation.py",
    "jaxrl_llm/train/update.py",
    "jaxrl_llm/train/accumulate.py",
    "jaxrl_llm/train/checkpoint.py",
    "jaxrl_llm/train/checksums.py",
    "jaxrl_llm/train/batches.py",
    "jaxrl_llm/train/collect.py",
    "jaxrl_llm/train/run.py",
    "jaxrl_llm/train/setup.py",
    "jaxrl_llm/train/step.py",
    "jaxrl_llm/train/loop.py",
    "jaxrl_llm/train/state.py",
)


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _step_child(tree: Path, steps: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        script = tree / "scripts/bench_train_step.py"
        cmd = [sys.executable, str(script), "--child", "ours", "--steps", str(steps)]
        subprocess.run([*cmd, "--json", f.name], check=True, cwd=tree, env=_env(tree))
        return json.loads(Path(f.name).read_text())


def _transfers(tree: Path) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, str(ROOT / "scripts/count_transfers.py"), "--json", f.name]
        subprocess.run(cmd, check=True, cwd=tree, env=_env(tree), stdout=subprocess.DEVNULL)
        return json.loads(Path(f.name).read_text())["per_step"]


def _lines(tree: Path) -> dict[str, int | None]:
    out = {}
    for name in FILES:
        path = tree / name
        out[name] = len(path.read_text().splitlines()) if path.exists() else None
    return out


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="a checkout of the old commit")
    ap.add_argument("--after", default=str(ROOT), help="a checkout of the new commit")
    ap.add_argument("--rounds", type=int, default=2, help="alternating runs of each checkout")
    ap.add_argument("--steps", type=int, default=3, help="steps per run (the first is warm-up)")
    ap.add_argument("--json", default=str(ROOT / "bench_results/before_after.json"))
    args = ap.parse_args()
    trees = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    load = {"start": _loadavg()}
    runs: dict[str, list] = {k: [] for k in trees}
    for _ in range(args.rounds):
        for side, tree in trees.items():
            runs[side].append(_step_child(tree, args.steps))
    load["after_steps"] = _loadavg()
    summary = {}
    for side, results in runs.items():
        measured = [s for r in results for s in r["steps"][1:]]
        summary[side] = {
            "step_s_median": statistics.median(s["step"] for s in measured),
            "update_s_median": statistics.median(s["update"] for s in measured),
            "generation_s_median": statistics.median(s["generation"] for s in measured),
            "step_s_all": [round(s["step"], 3) for s in measured],
            "peak_rss_gib_steps": max(s["peak_rss_gib"] for r in results for s in r["steps"]),
            "transfers_per_step": _transfers(trees[side]),
            "lines": _lines(trees[side]),
        }
    load["end"] = _loadavg()
    b, a = summary["before"]["step_s_median"], summary["after"]["step_s_median"]
    out = {
        "machine": {"cpu": platform.processor() or platform.machine(), "nproc": os.cpu_count()},
        "loadavg": load,
        "trees": {k: str(v) for k, v in trees.items()},
        "rounds": args.rounds,
        "steps_per_run": args.steps,
        "summary": summary,
        "step_time_after_over_before": a / b,
    }
    print(json.dumps(out, indent=1))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
