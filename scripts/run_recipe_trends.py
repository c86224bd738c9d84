"""One short training run per recipe config (``configs/algorithms/*.yaml``) and its reward trend.

Each recipe trains SmolLM2-135M-Instruct (the default model) on the built-in arithmetic task
with its own config, shortened by :data:`OVERRIDES`, through the real CLI
(``jaxrl-llm train``) in its own process, one after the other. From each run's
``metrics.jsonl`` it reports the mean training reward over the first and the last
``--window`` steps and the held-out metric before and after (greedy accuracy on
``--eval-size`` problems; DPO: preference accuracy on held-out pairs).

    python scripts/run_recipe_trends.py --steps 12   # writes bench_results/recipe_trends.json

Runs are short, so a reward trend over a few steps of 32 samples is noisy; the held-out
numbers before and after are the better signal of learning.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def overrides(steps: int, eval_size: int) -> list[str]:
    return [
        f"train.max_steps={steps}",
        f"train.eval_every={steps}",
        f"data.eval_size={eval_size}",
        "train.save_every=1000",
        "train.log_every=1",
    ]


def summarize(run_dir: Path, window: int) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "time/update" in r]
    evals = [r for r in records if any(k.startswith("eval/") for k in r)]
    key = "reward/mean" if train and "reward/mean" in train[0] else "dpo/reward_accuracy"
    metric = next(
        (k for k in ("eval/accuracy", "eval/preference_accuracy") if evals and k in evals[0]), None
    )
    first = [r[key] for r in train[:window] if key in r]
    last = [r[key] for r in train[-window:] if key in r]
    return {
        "train_metric": key,
        "first": statistics.fmean(first) if first else None,
        "last": statistics.fmean(last) if last else None,
        "per_step": [r.get(key) for r in train],
        "eval_metric": metric,
        "eval_before": evals[0][metric] if metric else None,
        "eval_after": evals[-1][metric] if metric else None,
        "eval_prompts": evals[0].get("eval/num_prompts") if evals else None,
        "seconds_per_step": statistics.median(r["time/step"] for r in train) if train else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--window", type=int, default=3, help="steps averaged at each end")
    ap.add_argument("--eval-size", type=int, default=100)
    ap.add_argument("--recipes", nargs="*", help="config names (default: all)")
    ap.add_argument("--runs", default=str(ROOT / "runs/recipe_trends"))
    ap.add_argument("--out", default=str(ROOT / "bench_results/recipe_trends.json"))
    args = ap.parse_args()
    configs = sorted((ROOT / "configs/algorithms").glob("*.yaml"))
    if args.recipes:
        configs = [c for c in configs if c.stem in args.recipes]
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join(sys.argv), "recipes": {}}
    for config in configs:
        run_dir = Path(args.runs) / config.stem
        if run_dir.exists():
            raise SystemExit(f"{run_dir} exists; remove it or pass another --runs")
        cmd = [
            sys.executable, "-m", "jaxrl_llm.cli", "train", "--config", str(config),
            "--run-dir", str(run_dir), "--no-progress", *overrides(args.steps, args.eval_size),
        ]  # fmt: skip
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            result["recipes"][config.stem] = {"error": proc.stderr[-2000:], "wall_s": wall}
        else:
            result["recipes"][config.stem] = {**summarize(run_dir, args.window), "wall_s": wall}
        print(config.stem, json.dumps(result["recipes"][config.stem])[:400], flush=True)
        out_path.write_text(json.dumps(result, indent=2))
    print(markdown(result))


def markdown(result: dict) -> str:
    rows = [
        "| recipe | train metric | first steps | last steps | held-out metric | before | after "
        "| s/step | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda x: "—" if x is None else f"{x:.3f}"
    for name, r in result["recipes"].items():
        if "error" in r:
            rows.append(f"| {name} | error | | | | | | | {r['wall_s']:.0f} |")
            continue
        rows.append(
            f"| `{name}` | {r['train_metric']} | {fmt(r['first'])} | {fmt(r['last'])} | "
            f"{r['eval_metric']} | {fmt(r['eval_before'])} | {fmt(r['eval_after'])} | "
            f"{fmt(r['seconds_per_step'])} | {r['wall_s']:.0f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
