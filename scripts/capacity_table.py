"""The capacity table of docs/plan.md: `jaxrl-llm plan` for five models on TPU slices and GPUs.

GRPO, 8 prompts x 8 samples x 1,024 new tokens (prompts up to 512), the experiment config
``configs/experiments/qwen2.5-1.5b-gsm8k-8gpu.yaml`` with each model's shape-only config
(``configs/models/``), ``remat: full``, one minibatch, micro-batches of one sequence per device;
full fine-tuning, LoRA rank 16 or QLoRA nf4 rank 16 (those two without held-out evaluation, so
that each row compiles the same two programs). Each row is one ``jaxrl-llm plan ... --json
--no-suggest`` in a child process, timed; the JSON of every row goes to ``--out`` and the
markdown rows to stdout. TPU rows are compiled for the topology through libtpu (no TPU needed);
GPU rows are XLA:CPU estimates on as many CPU devices.

    python scripts/capacity_table.py --method full --out bench_results/capacity_full.json
    python scripts/capacity_table.py --method lora --rows llama-3.1-8b:v5e-16
    python scripts/capacity_table.py --rows llama-3.1-70b:v5p-128 --set rollout.tensor_parallel=4

``--set KEY=VALUE`` (repeatable) adds a config override to every row's plan.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "experiments" / "qwen2.5-1.5b-gsm8k-8gpu.yaml"

#: (model, target, devices): the target as `plan` takes it, and its devices (chips; a v5p
#: slice's name counts TensorCores, two per chip).
ROWS = [
    ("qwen2.5-1.5b", "v5e-16", 16),
    ("qwen2.5-1.5b", "8xH100", 8),
    ("qwen2.5-7b", "v5p-32", 16),
    ("qwen2.5-7b", "8xH100", 8),
    ("llama-3.1-8b", "v5e-16", 16),
    ("llama-3.1-8b", "v6e-32", 32),
    ("llama-3.1-8b", "8xH200", 8),
    ("qwen2.5-32b", "8xH200", 8),
    ("llama-3.1-70b", "v5p-128", 64),
]
NAMES = {
    "qwen2.5-1.5b": "Qwen2.5-1.5B",
    "qwen2.5-7b": "Qwen2.5-7B",
    "qwen2.5-32b": "Qwen2.5-32B",
    "llama-3.1-8b": "Llama-3.1-8B",
    "llama-3.1-70b": "Llama-3.1-70B",
}
GPUS = {"8xH100": ("8", "80GB", "8×H100 80 GB"), "8xH200": ("8", "141GB", "8×H200 141 GB")}
METHODS = {
    "full": [],
    "lora": ["model.lora.rank=16", "data.eval_path=null", "data.eval_size=0"],
    "qlora": [
        "model.lora.rank=16",
        "model.lora.quantize=nf4",
        "data.eval_path=null",
        "data.eval_size=0",
    ],
}
GiB = 2**30


def command(
    model: str, target: str, devices: int, method: str, extra: tuple[str, ...] = ()
) -> list[str]:
    """The row's `jaxrl-llm plan` command line (``extra``: more config overrides)."""
    cmd = [sys.executable, "-m", "jaxrl_llm.cli", "plan", "--config", str(CONFIG)]
    if target in GPUS:
        n, memory, _ = GPUS[target]
        cmd += ["--devices", n, "--device-memory", memory]
    else:
        cmd += ["--topology", target]
    return [
        *cmd,
        "--json",
        "--no-suggest",
        "--",
        f"model.path={ROOT / 'configs' / 'models' / model}",
        "rollout.prompts_per_step=8",
        "rollout.num_samples=8",
        "rollout.max_new_tokens=1024",
        "optim.num_minibatches=1",
        f"optim.micro_batch_size={devices}",
        "model.remat=full",
        *METHODS[method],
        *extra,
    ]


def markdown(model: str, target: str, plan: dict, seconds: float, method: str) -> str:
    """One row of the docs' table (full fine-tuning's columns, or LoRA's)."""
    b = plan["per_device_bytes"]
    programs = plan["programs"]

    def gib(x: float) -> str:
        return f"{x / GiB:.2f} GiB"

    name = GPUS[target][2] + " (estimate)" if target in GPUS else target
    model = NAMES.get(model, model)
    margin = plan["margin_bytes"]
    verdict = "FITS" if plan["fits"] else "**DOES NOT FIT**"
    under = plan["fits"] and margin < 0.02 * plan["hbm_bytes"]
    verdict = f"{verdict}{', under 2%' if under else ''} ({'+' if margin >= 0 else '-'}"
    verdict += f"{abs(margin) / GiB:.1f} GiB)"
    mesh = ", ".join(f"{k}={v}" for k, v in plan["mesh"].items() if v > 1) or "1 device"
    common = [
        gib(b["kv_cache"]["per_device"]),
        gib(programs["rollout"]["temporaries"]),
        gib(programs["update"]["temporaries"]),
        gib(b["peaks"]["rollout"]),
        gib(b["peaks"]["update"]),
        f"{plan['hbm_bytes'] / GiB:.1f} GiB",
        verdict,
    ]
    if method == "full":
        state = sum(b[k]["per_device"] for k in ("parameters", "optimizer", "reference"))
        cells = [model, name, mesh, gib(state), *common]
        cells.append(f"{plan['flops_per_step']['total']:.2e}")  # per device, analytic
    else:
        label = "LoRA r16" if method == "lora" else "QLoRA nf4 r16"
        state = b["parameters"]["per_device"] + b["optimizer"]["per_device"]
        cells = [model, name, label, gib(state), gib(b["frozen"]["per_device"]), *common]
    cells.append(f"{seconds:.0f} s")
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--method", choices=sorted(METHODS), default="full")
    parser.add_argument("--rows", default="", help="model:target,... (default: every row)")
    parser.add_argument("--out", type=Path, default=None, help="the rows' plans as JSON")
    parser.add_argument("--render", type=Path, default=None, help="print --out's rows again")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override"
    )
    args = parser.parse_args(argv)
    if args.render is not None:
        saved = json.loads(args.render.read_text())
        for r in saved["rows"]:
            if "error" not in r:
                print(markdown(r["model"], r["target"], r["plan"], r["seconds"], saved["method"]))
        return 0
    wanted = {tuple(r.split(":")) for r in args.rows.split(",") if r}
    results = []
    for model, target, devices in ROWS:
        if wanted and (model, target) not in wanted:
            continue
        t0 = time.perf_counter()
        done = subprocess.run(
            command(model, target, devices, args.method, tuple(args.set)),
            capture_output=True,
            text=True,
        )
        seconds = time.perf_counter() - t0
        if done.returncode not in (0, 1):  # 1: planned, does not fit; 2: an error
            print(f"{model} on {target}: plan failed:\n{done.stderr[-3000:]}", file=sys.stderr)
            results.append({"model": model, "target": target, "error": done.stderr[-3000:]})
            continue
        plan = json.loads(done.stdout)
        results.append({"model": model, "target": target, "seconds": seconds, "plan": plan})
        print(markdown(model, target, plan, seconds, args.method), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        saved = {"method": args.method, "overrides": args.set, "rows": results}
        args.out.write_text(json.dumps(saved, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
