"""One GRPO training step, jaxrl_llm against TRL's GRPOTrainer, side by side in one run.

The workload (issue 5): SmolLM2-135M-Instruct in fp32, 8 arithmetic prompts x 4 samples x
exactly 64 new tokens, beta = 0.04 (so both sides run the reference model), one update per
batch, AdamW. Each library runs in its own child process, so the peak resident memory each
reports (``ru_maxrss`` of that process) is its own; the children run one after the other.

Per step, seconds split into:

* generation: sampling the 32 completions (ours: ``time/rollout``; TRL: its ``_generate``);
* log-probs: reference (and old, when needed) log-prob passes plus rewards and advantages
  (ours: ``time/reward``, plus ``time/forward`` in versions before the one-jit RL step; TRL: the
  rest of ``_generate_and_score_completions``);
* update: forward, backward and optimizer step on the 32 sequences (ours: ``time/update``,
  which since the one-jit RL step also holds the reference pass and the advantages; TRL: step
  time minus the two above).

Both sides are the libraries' own training loops: ours is ``jaxrl_llm.train.train`` on
``configs/quickstart.yaml`` with the overrides in :data:`OURS_OVERRIDES`, TRL is
``GRPOTrainer.train`` with the matching :func:`trl_child` arguments. Step times are medians over
the steps after ``--warmup`` (compile / first-call steps). The update's model FLOP/s
(``6 * params * tokens`` plus attention, as in ``bench_model.py``; no remat recompute counted) is
reported against this machine's fp32 matmul peak measured in the same run.

Peak memory is the child's peak resident set size (``ru_maxrss``) at two moments: at the end of
the last training step ("steps": model loading, compilation and every step; ours from the
loop's ``perf/peak_rss_gib``, TRL's from a step-end callback) and at the child's exit
("process"). They differ for ours only: the loop then writes its final orbax checkpoint and
exports the HF folder, which TRL, run with ``save_strategy="no"``, does not do. The target
(at most half of TRL's) is on the steps. Our children pick the JAX platform as the
``jaxrl-llm`` CLI does (``quiet_cpu_platform``): with ``libtpu`` installed (the test extra) on
a machine without a TPU, JAX is pinned to CPU before it starts; unpinned, libtpu's
initialisation adds about 0.09 GiB of RSS (measured: 3.84 against 3.76 GiB).

    python scripts/bench_train_step.py --steps 3 --warmup 1   # writes bench_results/train_step.json

``--plain``: ours once more, as a plain install runs it (``pip install jaxrl_llm``, whose
dependencies do not include torch): the child hides torch, gguf and accelerate
(``weights.GGUF_LOADER_PACKAGES``; ``sys.modules[name] = None``, as for packages that are not
installed), which this benchmark's environment has for TRL. transformers imports torch
whenever it is installed (``AutoConfig`` → ``modeling_rope_utils``), about 0.19 GiB of our
process that a user without torch does not have. The model is the converted default, read
from its cache (the conversion itself needs torch).

TRL is an optional benchmark extra: ``pip install -e ".[bench]"``.

Ragged workload (``--ragged``, issue 13): the same GRPO step (β = 0.04, so π_ref runs too)
on synthetic groups whose completion lengths are heavy-tailed (log-normal, median
:data:`RAGGED_MEDIAN` tokens, σ = :data:`RAGGED_SIGMA`, clipped to [4, :data:`RAGGED_MAX`];
prompts of 30–60 tokens left-padded to 64; ``--uniform``: every completion exactly
:data:`NEW_TOKENS` tokens, the issue-5 shape). Only the device step runs (``make_rl_step``:
π_ref plus the update), unpacked (``train.packing=false``), packed (``train.packing=true``)
and packed with shared prompts (``train.shared_prompts=true``), each in its own child process
(its own peak RSS), alternating ``--rounds`` times, on the same seeded batches. Reported:
update tokens/s (real prompt + completion tokens per second of the step, each prompt counted
G times), the padding fraction of the rows the model runs on (unpacked ``[N, P + T]``; packed
the used ``[rows, W]`` micro-batches), peak RSS, and model FLOP/s (on real tokens) against the
measured fp32 matmul peak.

    python scripts/bench_train_step.py --ragged --steps 3 --warmup 1 --rounds 1
    python scripts/bench_train_step.py --ragged --uniform ...   # every completion 64 tokens

LoRA (``--lora``, issue 14): the issue-5 workload above (β = 0.04) as full fine-tuning, LoRA
rank 16 (α = 32, every projection; rollouts with the adapters unmerged, and merged once per
step), and QLoRA (the same adapters on an nf4 base), each in its own child: seconds per step
(rollout / update) and peak RSS, with the ratios to full fine-tuning.

    python scripts/bench_train_step.py --lora --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, SAMPLES, NEW_TOKENS, BETA, LR = 8, 4, 64, 0.04, 1e-6

RAGGED_MEDIAN, RAGGED_SIGMA, RAGGED_MAX, RAGGED_PROMPT = 24, 1.0, 256, 64

OURS_OVERRIDES = [
    "algorithm.name=grpo",
    f"algorithm.hparams.beta={BETA}",
    f"rollout.prompts_per_step={PROMPTS}",
    f"rollout.num_samples={SAMPLES}",
    f"rollout.max_new_tokens={NEW_TOKENS}",
    "rollout.stop_token_ids=[]",  # no stop token: exactly 64 new tokens, like TRL's below
    f"optim.lr={LR}",
    "optim.warmup_steps=0",
    "optim.ppo_epochs=1",
    "optim.num_minibatches=1",
    "data.eval_size=0",  # no held-out evaluation: the run is the training steps
    "train.eval_every=0",
    "train.save_every=1000",
    "train.log_every=1",
    # Activation checkpointing, as TRL's GRPOConfig does by default (gradient_checkpointing).
    "model.remat=full",
]


def _prompt_rows(n: int) -> list[dict]:
    """The quickstart's arithmetic training prompts (same seed and knobs as the config)."""
    from jaxrl_llm.config import load_config
    from jaxrl_llm.data import arithmetic_task

    c = load_config(ROOT / "configs/quickstart.yaml", [])
    a = c.data.arithmetic
    rows, _ = arithmetic_task(
        num_train=n,
        num_eval=0,
        ops=tuple(a.operations),
        seed=c.data.seed,
        min_operand=a.min_operand,
        max_operand=a.max_operand,
    )
    return rows


# ---------------------------------------------------------------------------------------------
# Children.


def ours_child(steps: int, extra: list[str] | None = None) -> dict:
    from jaxrl_llm.config import load_config
    from jaxrl_llm.models import default_model_path
    from jaxrl_llm.train.hostmem import peak_rss_gib
    from jaxrl_llm.train.loop import train

    default_model_path()  # converted and cached outside the timed steps (as TRL's folder is)
    config = load_config(ROOT / "configs/quickstart.yaml", [*OURS_OVERRIDES, *(extra or [])])
    with tempfile.TemporaryDirectory() as run_dir:
        t0 = time.perf_counter()
        train(config, run_dir=run_dir, max_steps=steps, progress=False, log=lambda *a: None)
        wall = time.perf_counter() - t0
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    per_step = [r for r in records if "time/update" in r]
    return {
        "steps": [
            {
                "generation": r["time/rollout"],
                "logprobs": r.get("time/forward", 0.0) + r["time/reward"],
                "update": r["time/update"],
                "step": r["time/step"],
                "tokens": r["perf/tokens"],
                "generated_tokens": r.get("perf/generated_tokens"),
                "reward_mean": r.get("reward/mean"),
                "peak_rss_gib": r["perf/peak_rss_gib"],
            }
            for r in per_step
        ],
        "wall_s": wall,
        "peak_rss_gib": peak_rss_gib(),
    }


def ragged_groups(seed: int, vocab: int, uniform: bool = False):
    """B x G groups with heavy-tailed completion lengths (see the module docstring); with
    ``uniform`` the issue-5 shape instead: every completion exactly ``NEW_TOKENS`` long."""
    import numpy as np

    from jaxrl_llm.train.step import Groups

    rng = np.random.default_rng(seed)
    b, g, p = PROMPTS, SAMPLES, RAGGED_PROMPT
    t = NEW_TOKENS if uniform else RAGGED_MAX
    p_len = rng.integers(30, 61, b)
    c_len = np.clip(np.round(rng.lognormal(np.log(RAGGED_MEDIAN), RAGGED_SIGMA, (b, g))), 4, t)
    if uniform:
        c_len = np.full((b, g), t)
    prompt_mask = np.arange(p)[None] >= (p - p_len)[:, None]
    mask = np.arange(t) < c_len[..., None]
    return Groups(
        prompt_ids_bp=np.where(prompt_mask, rng.integers(3, vocab, (b, p)), 2).astype(np.int32),
        prompt_mask_bp=prompt_mask,
        tokens_bgt=np.where(mask, rng.integers(3, vocab, (b, g, t)), 2).astype(np.int32),
        mask_bgt=mask,
        logp_sampler_bgt=np.where(mask, -2.0, 0.0).astype(np.float32),
        reward_bg=rng.normal(size=(b, g)).astype(np.float32),
        member_bg=np.ones((b, g), bool),
    )


RAGGED_VARIANTS = {
    "unpacked": ["train.packing=false"],
    "packed": ["train.packing=true", "train.shared_prompts=false"],
    "shared": ["train.packing=true", "train.shared_prompts=true"],
}
"""The ``--ragged`` children: unpacked rows, packed rows, packed rows with shared prompts."""


def ragged_child(steps: int, variant: str, extra: list[str], uniform: bool = False) -> dict:
    """The device RL step on ragged (or ``uniform``) groups, as ``RAGGED_VARIANTS[variant]``."""
    from jaxrl_llm.config import load_config
    from jaxrl_llm.models import default_model_path
    from jaxrl_llm.train import setup as S
    from jaxrl_llm.train.hostmem import peak_rss_gib
    from jaxrl_llm.train.step import make_rl_step

    default_model_path()
    overrides = [
        *OURS_OVERRIDES,
        f"rollout.max_new_tokens={NEW_TOKENS if uniform else RAGGED_MAX}",
        # whole-batch updates (one micro-batch), as this workload has always been measured
        "optim.micro_batch_tokens=null",
        *RAGGED_VARIANTS[variant],
        *extra,
    ]
    if variant == "unpacked":  # token budgets are for packed rows only
        overrides.append("optim.micro_batch_tokens=null")
    config = load_config(ROOT / "configs/quickstart.yaml", overrides)
    with tempfile.TemporaryDirectory() as run_dir:
        setup = S.resolve(config, run_dir)
        step = make_rl_step(
            setup.recipe,
            setup.models,
            setup.update,
            temperature=setup.sampler.temperature,
            old_logprobs=setup.old_logprobs,
        )
        vocab = setup.policy().config.vocab_size
        state, out = setup.state, []
        for i in range(steps):
            groups = ragged_groups(i, vocab, uniform)
            t0 = time.perf_counter()
            state, metrics = step(state, groups)
            seconds = time.perf_counter() - t0
            real = float(metrics["perf/tokens"])
            n, length = PROMPTS * SAMPLES, RAGGED_PROMPT + groups.tokens_bgt.shape[-1]
            slots = metrics.get("perf/pack_rows_tokens", n * length)
            placed = metrics.get("perf/packed_tokens", real)
            out.append(
                {
                    "step": seconds,
                    "tokens": real,
                    "slots": slots,
                    "padding": 1.0 - placed / slots,
                    "placed_tokens": placed,
                    "peak_rss_gib": peak_rss_gib(),
                    "loss": metrics["actor/loss"],
                }
            )
    return {"steps": out, "peak_rss_gib": peak_rss_gib(), "overrides": overrides}


LORA_VARIANTS = {
    "full": [],
    "lora": ["model.lora={rank: 16, alpha: 32}"],
    "lora_merged": ["model.lora={rank: 16, alpha: 32, merge_for_sampling: true}"],
    "qlora_nf4": ["model.lora={rank: 16, alpha: 32, quantize: nf4}"],
}


def lora_main(args: argparse.Namespace) -> None:
    """Full fine-tuning vs LoRA rank 16 (adapters sampled unmerged, and merged once per step) vs
    QLoRA (nf4 base) on the issue-5 workload (β = 0.04): seconds per step and peak RSS, each
    variant in its own child process, one after the other."""
    from _bench_common import machine_info

    total = args.steps + args.warmup
    result = {"machine": machine_info(), "command": " ".join(sys.argv), "raw": {}}
    result["machine"]["load_avg_before"] = os.getloadavg()
    for name, extra in LORA_VARIANTS.items():
        result["raw"][name] = _run_child("ours", total, [*extra, *args.extra])
        result[name] = _summary(result["raw"][name], args.warmup)
    full = result["full"]
    for name in LORA_VARIANTS:
        r = result[name]
        r["step_ratio_vs_full"] = r["median_s"]["step"] / full["median_s"]["step"]
        r["rss_ratio_vs_full"] = r["peak_rss_gib_steps"] / full["peak_rss_gib_steps"]
    result["machine"]["load_avg_after"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    rows = [
        "| variant | step s | rollout s | update s | peak RSS GiB (steps) | step / full "
        "| RSS / full |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in LORA_VARIANTS:
        r = result[name]
        m = r["median_s"]
        rows.append(
            f"| {name} | {m['step']:.2f} | {m['generation']:.2f} | {m['update']:.2f} | "
            f"{r['peak_rss_gib_steps']:.2f} | {r['step_ratio_vs_full']:.2f} | "
            f"{r['rss_ratio_vs_full']:.2f} |"
        )
    print("\n".join(rows))
    print(f"wrote {out}")


def ragged_main(args: argparse.Namespace) -> None:
    from _bench_common import machine_info, matmul_peak_gflops

    total = args.steps + args.warmup
    result = {"machine": machine_info(), "command": " ".join(sys.argv), "raw": {}}
    result["machine"]["load_avg_before"] = os.getloadavg()
    runs: dict[str, list[dict]] = {name: [] for name in RAGGED_VARIANTS}
    result["workload"] = "uniform" if args.uniform else "ragged"
    for _ in range(args.rounds):
        for name in runs:
            flags = ["--uniform"] if args.uniform else []
            runs[name].append(_run_child(f"ragged-{name}", total, args.extra, flags))
    result["raw"] = runs
    peaks = matmul_peak_gflops()
    result["matmul_peak_gflops"] = peaks
    for name, rounds in runs.items():
        measured = [s for r in rounds for s in r["steps"][args.warmup :]]
        sec = statistics.median(s["step"] for s in measured)
        tokens = statistics.median(s["tokens"] for s in measured)
        flops = update_flops(tokens, PROMPTS * SAMPLES) * 4 / 3  # + the π_ref forward (1/3)
        result[name] = {
            "median_step_s": sec,
            "tokens_per_s": statistics.median(s["tokens"] / s["step"] for s in measured),
            "padding_fraction": statistics.median(s["padding"] for s in measured),
            "peak_rss_gib": max(r["peak_rss_gib"] for r in rounds),
            "gflops": flops / sec / 1e9,
            "frac_of_peak": flops / sec / 1e9 / max(peaks.values()),
            "measured_steps": len(measured),
        }
    result["speedup"] = {
        name: result["unpacked"]["median_step_s"] / result[name]["median_step_s"] for name in runs
    }
    result["machine"]["load_avg_after"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    rows = [
        "| | step s | real tokens/s | padding | peak RSS GiB | GFLOP/s (of peak) |",
        "|---|---|---|---|---|---|",
    ]
    for name in runs:
        r = result[name]
        rows.append(
            f"| {name} | {r['median_step_s']:.2f} | {r['tokens_per_s']:.0f} | "
            f"{r['padding_fraction']:.0%} | {r['peak_rss_gib']:.2f} | {r['gflops']:.0f} "
            f"({r['frac_of_peak']:.0%}) |"
        )
    print("\n".join(rows))
    speedups = ", ".join(f"{k} {v:.2f}x" for k, v in result["speedup"].items())
    print(f"vs unpacked: {speedups}; wrote {out}")


def trl_child(steps: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from jaxrl_llm.models import default_model_path
    from jaxrl_llm.rewards import IntegerAnswer
    from jaxrl_llm.train.hostmem import peak_rss_gib

    torch.manual_seed(0)
    path = str(default_model_path())
    rows = _prompt_rows(PROMPTS * steps)
    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
            for r in rows
        ]
    )
    reward = IntegerAnswer()

    def integer_answer(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return reward(prompts, texts, answer=answer)

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        bf16=False,
        fp16=False,
        per_device_train_batch_size=PROMPTS * SAMPLES,
        gradient_accumulation_steps=1,
        num_generations=SAMPLES,
        max_completion_length=NEW_TOKENS,
        generation_kwargs={"min_new_tokens": NEW_TOKENS},  # exactly 64 tokens, like ours
        temperature=1.0,
        beta=BETA,
        num_iterations=1,
        learning_rate=LR,
        warmup_steps=0,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=integer_answer,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    times: list[dict] = []
    current: dict = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                current[name] = current.get(name, 0.0) + time.perf_counter() - t

        return wrapper

    trainer._generate = timed("generation", trainer._generate)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._generate_and_score_completions = timed(
        "prepare", trainer._generate_and_score_completions
    )

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            current.clear()
            current["t0"] = time.perf_counter()

        def on_step_end(self, *_, **__):
            step = time.perf_counter() - current.pop("t0")
            times.append(
                {
                    "generation": current["generation"],
                    "logprobs": current["prepare"] - current["generation"],
                    "update": step - current["prepare"],
                    "step": step,
                    "peak_rss_gib": peak_rss_gib(),
                }
            )

    trainer.add_callback(StepTimer())
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    for record, r in zip(times, rewards, strict=False):
        record["reward_mean"] = r
    return {
        "steps": times,
        "wall_s": wall,
        "peak_rss_gib": peak_rss_gib(),
        "gradient_checkpointing": bool(args.gradient_checkpointing),
        "trl": __import__("trl").__version__,
        "torch_threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------------------------------
# Parent.


def _run_child(
    which: str, steps: int, extra: list[str] | None = None, flags: list[str] | None = None
) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--child", which, "--steps", str(steps), "--json", f.name]
        cmd += [f"--extra={e}" for e in extra or []] + list(flags or [])
        subprocess.run(cmd, check=True, cwd=ROOT)
        return json.loads(Path(f.name).read_text())


def _summary(result: dict, warmup: int) -> dict:
    measured = result["steps"][warmup:] or result["steps"][-1:]
    med = {
        k: statistics.median(s[k] for s in measured)
        for k in ("generation", "logprobs", "update", "step")
    }
    return {
        "median_s": med,
        "measured_steps": len(measured),
        "peak_rss_gib_steps": max(s["peak_rss_gib"] for s in result["steps"]),
        "peak_rss_gib": result["peak_rss_gib"],
    }


def update_flops(tokens: float, sequences: int) -> float:
    """Model FLOPs of one forward+backward over ``tokens`` valid tokens in ``sequences`` rows
    (attention counted at the mean valid length; padding is not counted as useful work)."""
    from bench_model import model_flops_per_token

    from jaxrl_llm.models import ModelConfig, default_model_path

    hf = json.loads((Path(default_model_path()) / "config.json").read_text())
    config = ModelConfig.from_hf(hf)
    return model_flops_per_token(config, round(tokens / sequences))[1] * tokens


def markdown(result: dict) -> str:
    o, t = result["ours"], result["trl"]
    rows = [
        "| | generation s | log-probs s | update s | step s | peak RSS GiB, steps | "
        "peak RSS GiB, process |",
        "|---|---|---|---|---|---|---|",
    ]
    named = [("jaxrl_llm", o)]
    if "ours_plain" in result:
        named.append(("jaxrl_llm, plain install (no torch)", result["ours_plain"]))
    for name, r in (*named, ("TRL GRPOTrainer", t)):
        m = r["median_s"]
        rows.append(
            f"| {name} | {m['generation']:.2f} | {m['logprobs']:.2f} | {m['update']:.2f} | "
            f"{m['step']:.2f} | {r['peak_rss_gib_steps']:.2f} | {r['peak_rss_gib']:.2f} |"
        )
    ratio = result["ratios"]
    rows.append(
        f"\nTRL / ours: step {ratio['step']:.2f}x, generation {ratio['generation']:.2f}x, "
        f"log-probs {ratio['logprobs']:.2f}x, update {ratio['update']:.2f}x; peak RSS ours / TRL "
        f"{ratio['rss']:.2f} over the steps, {ratio['rss_process']:.2f} over the process. "
        f"Update: {result['update_gflops']:.0f} GFLOP/s, "
        f"{result['update_frac_of_peak']:.0%} of the fp32 matmul peak "
        f"{result['matmul_peak_gflops']} GFLOP/s."
    )
    if "ratios_plain" in result:
        p = result["ratios_plain"]
        rows.append(
            f"Plain install (torch imported: {result['ours_plain']['torch_imported']}): TRL / "
            f"ours step {p['step']:.2f}x; peak RSS ours / TRL {p['rss']:.3f} over the steps, "
            f"{p['rss_process']:.3f} over the process."
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="measured steps per library")
    ap.add_argument("--warmup", type=int, default=1, help="steps run first and not measured")
    ap.add_argument("--out", default=str(ROOT / "bench_results/train_step.json"))
    ap.add_argument("--ragged", action="store_true", help="the ragged workload (issue 13)")
    ap.add_argument("--rounds", type=int, default=1, help="--ragged: alternating rounds")
    ap.add_argument(
        "--uniform",
        action="store_true",
        help="--ragged: the issue-5 shape instead (every completion 64 tokens)",
    )
    ap.add_argument(
        "--lora", action="store_true", help="full vs LoRA vs QLoRA on this workload (issue 14)"
    )
    ap.add_argument(
        "--extra",
        action="append",
        default=[],
        help="a config override for ours (--ragged/--lora: for every variant)",
    )
    ap.add_argument(
        "--child",
        choices=("ours", "ours-plain", "trl", *(f"ragged-{name}" for name in RAGGED_VARIANTS)),
        help=argparse.SUPPRESS,
    )
    ap.add_argument(
        "--plain",
        action="store_true",
        help="also ours without torch/gguf/accelerate importable, as a plain install runs",
    )
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        if args.child == "ours-plain":  # torch & co. as if not installed (see --plain)
            from jaxrl_llm.models.weights import GGUF_LOADER_PACKAGES

            for name in GGUF_LOADER_PACKAGES:
                sys.modules[name] = None
        if args.child != "trl":  # the JAX platform the `jaxrl-llm` CLI picks (no libtpu here)
            from jaxrl_llm.train.plan import quiet_cpu_platform

            quiet_cpu_platform()
        if args.child.startswith("ragged"):
            res = ragged_child(
                args.steps, args.child.removeprefix("ragged-"), args.extra, args.uniform
            )
        elif args.child in ("ours", "ours-plain"):
            res = ours_child(args.steps, args.extra)
            res["torch_imported"] = sys.modules.get("torch") is not None
        else:
            res = trl_child(args.steps)
        Path(args.json).write_text(json.dumps(res))
        return
    if args.lora:
        if args.out == str(ROOT / "bench_results/train_step.json"):
            args.out = str(ROOT / "bench_results/train_step_lora.json")
        lora_main(args)
        return
    if args.ragged:
        if args.out == str(ROOT / "bench_results/train_step.json"):
            args.out = str(ROOT / "bench_results/train_step_ragged.json")
        ragged_main(args)
        return

    from _bench_common import machine_info, matmul_peak_gflops

    total = args.steps + args.warmup
    result = {"machine": machine_info(), "command": " ".join(sys.argv)}
    result["ours_extra"] = args.extra
    raw = {"ours": _run_child("ours", total, args.extra)}
    if args.plain:
        raw["ours_plain"] = _run_child("ours-plain", total, args.extra)
    raw["trl"] = _run_child("trl", total)
    result["raw"] = raw
    for name in raw:
        result[name] = _summary(raw[name], args.warmup)
    o, t = result["ours"]["median_s"], result["trl"]["median_s"]
    result["ratios"] = {k: t[k] / o[k] for k in o}
    ours, trl = result["ours"], result["trl"]
    result["ratios"]["rss"] = ours["peak_rss_gib_steps"] / trl["peak_rss_gib_steps"]
    result["ratios"]["rss_process"] = ours["peak_rss_gib"] / trl["peak_rss_gib"]
    if args.plain:
        plain = result["ours_plain"]
        result["ours_plain"]["torch_imported"] = raw["ours_plain"]["torch_imported"]
        result["ratios_plain"] = {k: t[k] / plain["median_s"][k] for k in o}
        result["ratios_plain"]["rss"] = plain["peak_rss_gib_steps"] / trl["peak_rss_gib_steps"]
        result["ratios_plain"]["rss_process"] = plain["peak_rss_gib"] / trl["peak_rss_gib"]
    tokens = statistics.median(s["tokens"] for s in raw["ours"]["steps"])
    flops = update_flops(tokens, PROMPTS * SAMPLES)
    peaks = matmul_peak_gflops()
    result["matmul_peak_gflops"] = peaks
    result["update_gflops"] = flops / o["update"] / 1e9
    result["update_frac_of_peak"] = result["update_gflops"] / max(peaks.values())
    result["valid_tokens_per_step"] = tokens
    result["machine"]["load_avg_after"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(markdown(result))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
