"""Benchmark: ``jaxrl_llm.compute_advantages`` for every online recipe vs a loop reference.

For each recipe (default hyperparameters, default numerics) on ``B`` prompts × ``G`` answers ×
``T`` tokens with ragged completion lengths:

* compile: the first call (trace + compile + run), and XLA's backend compile time;
* warm: the median, p10 and p90 of ``--repeats`` calls, each ``.block_until_ready()``, taken
  round-robin over the recipes so that bursts of load on a shared machine hit all of them alike;
* no recompilation: compilations are counted (``jax.monitoring``) over the timed calls and one
  call on a fresh rollout of the same shape, and the jit cache size must not grow;
* correctness: the result is checked once against the loop reference (``tests/reference.py``,
  plain numpy looping over groups, or over time steps for reward-to-go and GAE), which is timed
  the same way; the ratio is loop / jitted.

Writes JSON (default ``bench_results/advantages.json``) and, with ``--markdown``, a section for
BENCHMARKS.md. Exits 1 if a result differs from its reference or a call recompiled.

    python scripts/bench_advantages.py                       # B=512, G=8, T=512
    python scripts/bench_advantages.py --batch 4 --group 2 --tokens 8 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shlex
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.monitoring
import jaxlib
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jaxrl_llm as jrl  # noqa: E402
from jaxrl_llm import algorithms  # noqa: E402
from tests import reference as ref  # noqa: E402

# verl's own functions on the 2-core CPU, B·G = 4096 responses × 512 tokens (ms), and
# this benchmark's target per estimator: as fast as the fastest verl figure (its vectorised
# variant where there is one); for the two time loops, 10x faster than verl's loop.
VERL_MS = {
    "GRPO": "50–90 (vectorised 3–14)",
    "Dr. GRPO": "50–90 (vectorised 3–14)",
    "RLOO": "117–142 (vectorised 5–15)",
    "REINFORCE++-baseline": "— (held to GRPO's)",
    "reward-to-go": "~155 (REINFORCE++ loop)",
    "REINFORCE++": "~155",
    "GAE": "~190",
}
TARGET_MS = {
    "GRPO": 3.0,
    "Dr. GRPO": 3.0,
    "RLOO": 5.0,
    "REINFORCE++-baseline": 3.0,
    "reward-to-go": 15.5,
    "REINFORCE++": 15.5,
    "GAE": 19.0,
}
TARGET_RULE = {
    "GRPO": "≤ verl vectorised best",
    "Dr. GRPO": "≤ verl vectorised best",
    "RLOO": "≤ verl vectorised best",
    "REINFORCE++-baseline": "≤ GRPO vectorised best",
    "reward-to-go": "≥ 10x verl loop",
    "REINFORCE++": "≥ 10x verl loop",
    "GAE": "≥ 10x verl loop",
}
DEFAULT_OUT = "bench_results/advantages.json"
TARGET_SHAPE = (512, 8, 512)  # the targets are for the shape only


class CompileCounter:
    """Counts XLA backend compilations (and their seconds) through ``jax.monitoring``."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        del kwargs
        if event == self.EVENT:
            self.count += 1
            self.seconds += duration


def _jit_cache_size() -> int | None:
    """Entries in the jit cache behind ``compute_advantages`` (None if it cannot be found)."""
    module = sys.modules.get(jrl.compute_advantages.__module__)
    fn = getattr(module, "_compute_advantages_jit", None)
    size = getattr(fn, "_cache_size", None)
    return size() if callable(size) else None


def make_data(batch: int, group: int, tokens: int, seed: int) -> dict[str, np.ndarray]:
    """A rollout as numpy float32: ragged lengths in [1, T], right padding."""
    rng = np.random.default_rng(seed)
    shape = (batch, group, tokens)
    length_bg = rng.integers(1, tokens + 1, size=(batch, group))
    mask_bgt = np.arange(tokens) < length_bg[..., None]
    logp_old = -rng.exponential(1.0, size=shape).astype(np.float32)
    return {
        "reward_bg": rng.normal(0.5, 1.0, size=(batch, group)).astype(np.float32),
        "mask_bgt": mask_bgt,
        "logp_old_bgt": logp_old,
        "logp_ref_bgt": (logp_old + rng.normal(0.0, 0.1, size=shape)).astype(np.float32),
        "value_bgt": rng.normal(0.0, 1.0, size=shape).astype(np.float32),
    }


def fields_for(recipe: jrl.Recipe) -> tuple[str, ...]:
    """The Rollout fields a recipe's advantage chain reads."""
    names = ["reward_bg", "mask_bgt"]
    if jrl.recipe.BEHAVIOUR_LOGPROBS in recipe.requires:
        names += ["logp_old_bgt", "logp_ref_bgt"]
    if recipe.critic is not None:
        names.append("value_bgt")
    return tuple(names)


def to_rollout(data: dict[str, np.ndarray], names: tuple[str, ...]) -> jrl.Rollout:
    return jrl.Rollout(**{k: jax.device_put(data[k]) for k in names})


def _percentiles_ms(seconds: list[float]) -> dict[str, float]:
    p10, p50, p90 = np.percentile(np.asarray(seconds) * 1e3, [10, 50, 90])
    return {"median": float(p50), "p10": float(p10), "p90": float(p90)}


def _time_once(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall-clock and process CPU seconds of one call (CPU time is less sensitive to other
    processes on a shared machine; it sums XLA's threads)."""
    cpu_start, start = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu_start


class Case(NamedTuple):
    """One recipe under test: its jitted call and its loop reference, ready to time."""

    name: str
    recipe: jrl.Recipe
    fast: Callable[[], object]
    loop: Callable[[], object]
    again: Callable[[], object]  # the jitted call on another rollout of the same shape


def prepare(
    name: str, data: dict, other: dict, counter: CompileCounter, rtol: float, atol: float
) -> tuple[Case, dict[str, object]]:
    """Builds a recipe's case, compiles it (timed) and checks it against its loop reference."""
    recipe = algorithms.get(name)
    names = fields_for(recipe)
    rollout, rollout2 = to_rollout(data, names), to_rollout(other, names)
    jax.block_until_ready((rollout, rollout2))
    numpy_data = {k: data[k] for k in names}

    compiles_before, compile_s_before = counter.count, counter.seconds
    start = time.perf_counter()
    adv = jrl.compute_advantages(recipe, rollout).block_until_ready()
    first_call_s = time.perf_counter() - start

    expected = ref.recipe_advantages(name, numpy_data, beta=recipe.hparams["beta"])
    got = np.asarray(adv)
    scale = max(1.0, float(np.max(np.abs(expected))))
    case = Case(
        name,
        recipe,
        fast=lambda: jrl.compute_advantages(recipe, rollout).block_until_ready(),
        loop=lambda: ref.recipe_advantages(name, numpy_data, beta=recipe.hparams["beta"]),
        again=lambda: jrl.compute_advantages(recipe, rollout2).block_until_ready(),
    )
    estimator = ref.ESTIMATOR[name]
    info = {
        "estimator": estimator,
        "fields": list(names),
        "beta": recipe.hparams["beta"],
        "compile_s": first_call_s,
        "backend_compile_s": counter.seconds - compile_s_before,
        "compilations_first_call": counter.count - compiles_before,
        "allclose": bool(np.allclose(got, expected, rtol=rtol, atol=atol * scale)),
        "max_abs_err": float(np.max(np.abs(got - expected))),
        "verl_ms": VERL_MS[estimator],
        "target_ms": TARGET_MS[estimator],
        "target_rule": TARGET_RULE[estimator],
    }
    return case, info


def run_timed(cases: list[Case], repeats: int, counter: CompileCounter) -> dict[str, dict]:
    """Times every case ``repeats`` times, round-robin (so a burst of load on a shared machine
    hits every recipe alike), counting compilations around each jitted call."""
    wall = {c.name: [] for c in cases}
    cpu = {c.name: [] for c in cases}
    loop_wall = {c.name: [] for c in cases}
    loop_cpu = {c.name: [] for c in cases}
    recompiles = dict.fromkeys(wall, 0)
    cache_before = _jit_cache_size()
    for _ in range(repeats):
        for c in cases:
            before = counter.count
            w, u = _time_once(c.fast)
            recompiles[c.name] += counter.count - before
            wall[c.name].append(w)
            cpu[c.name].append(u)
    for c in cases:  # same shape, new values: must not compile either
        before = counter.count
        c.again()
        recompiles[c.name] += counter.count - before
    cache_after = _jit_cache_size()
    for _ in range(repeats):
        for c in cases:
            w, u = _time_once(c.loop)
            loop_wall[c.name].append(w)
            loop_cpu[c.name].append(u)
    cache_growth = None if cache_before is None else cache_after - cache_before
    out = {}
    for c in cases:
        ms, loop_ms = _percentiles_ms(wall[c.name]), _percentiles_ms(loop_wall[c.name])
        out[c.name] = {
            "ms": ms,
            "cpu_ms": _percentiles_ms(cpu[c.name])["median"],
            "loop_ms": loop_ms,
            "loop_cpu_ms": _percentiles_ms(loop_cpu[c.name])["median"],
            "ratio": loop_ms["median"] / ms["median"],
            "recompilations_warm": recompiles[c.name],
            "jit_cache_growth_warm": cache_growth,
        }
    return out


def machine_info() -> dict:
    cpu = "unknown"
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "cores_usable": affinity,
        "load_avg": list(os.getloadavg()),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _met(flag: bool | None) -> str:
    return "n/a (other shape)" if flag is None else ("yes" if flag else "**no**")


def markdown(result: dict) -> str:
    """A BENCHMARKS.md section: machine, command, table, targets."""
    m, s, recipes = result["machine"], result["shape"], result["recipes"]
    wrong = [n for n, r in recipes.items() if not r["allclose"]]
    recompiled = [n for n, r in recipes.items() if r["recompilations_warm"]]
    checks = (
        "Every result equals its loop reference (allclose) and no warm call recompiled."
        if not wrong and not recompiled
        else f"DIFFERS from its loop reference: {wrong}; recompiled: {recompiled}."
    )
    lines = [
        "## Advantage estimation (`scripts/bench_advantages.py`)",
        "",
        f"Machine: {m['cpu_model']}, {m['cores']} cores ({m['cores_usable']} usable), "
        f"{m['backend']} backend, jax {m['jax']}, numpy {m['numpy']}, Python {m['python']}. "
        f"Load average (1 min) at start {m['load_avg'][0]:.2f}, at end "
        f"{result['load_avg_end'][0]:.2f}.",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Shape: B={s['batch']} prompts × G={s['group']} answers = {s['responses']} "
        f"responses × T={s['tokens']} tokens, ragged lengths uniform in [1, T] (seed {s['seed']}, "
        f"{s['valid_tokens']} valid tokens). Each recipe with its default hyperparameters; "
        "KL-in-reward recipes get `logp_old/ref` (k1, their default β), PPO gets `value_bgt`. "
        f"Jitted: median (p10–p90) of {s['repeats']} warm calls of "
        "`jrl.compute_advantages(recipe, rollout).block_until_ready()`, round-robin over the "
        "recipes; compile s is the first call (trace + compile + run). Loop: "
        "`tests/reference.py` (numpy float32; one Python iteration per group, or per time "
        "step vectorised over the batch for reward-to-go and GAE), timed the same way; "
        "ratio = loop / jitted (medians). CPU ms: median process CPU time per jitted call (all "
        "threads; less sensitive to other load on a shared machine). "
        f"{checks}",
        "",
        "| recipe | estimator | jitted ms, median (p10–p90) | CPU ms | loop ms | ratio "
        "| compile s | verl ms (issue) | target | met |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in recipes.items():
        ms, loop = r["ms"], r["loop_ms"]
        lines.append(
            f"| `{name}` | {r['estimator']} | {ms['median']:.2f} ({ms['p10']:.2f}–"
            f"{ms['p90']:.2f}) | {r['cpu_ms']:.2f} | {loop['median']:.1f} | {r['ratio']:.1f}x | "
            f"{r['compile_s']:.2f} | {r['verl_ms']} | ≤ {r['target_ms']:g} ms "
            f"({r['target_rule']}) | {_met(r['target_met'])} |"
        )
    missed = [n for n, r in recipes.items() if r["target_met"] is False]
    lines.append("")
    if all(r["target_met"] is None for r in recipes.values()):
        lines.append("Targets: not evaluated (they are for B=512, G=8, T=512).")
    elif missed:
        lines.append(f"Targets missed: {', '.join(f'`{n}`' for n in missed)}.")
    else:
        lines.append("Targets: all met.")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=512, help="prompts B")
    p.add_argument("--group", type=int, default=8, help="answers per prompt G")
    p.add_argument("--tokens", type=int, default=512, help="completion tokens T")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per recipe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recipes", nargs="*", default=None, help="default: every online recipe")
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--atol", type=float, default=1e-4)
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON path (default {DEFAULT_OUT})")
    p.add_argument("--markdown", default=None, help="also write a markdown section here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # default: every online recipe with a loop reference (GPG, OPO and ReMax have none here)
    names = (
        tuple(args.recipes)
        if args.recipes
        else tuple(n for n in algorithms.ONLINE_RECIPES if n in ref.ESTIMATOR)
    )
    unknown = [n for n in names if n not in ref.ESTIMATOR]
    if unknown:
        raise SystemExit(f"bench_advantages: no loop reference for {unknown}")
    command = "python scripts/bench_advantages.py " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    machine = machine_info()
    counter = CompileCounter()
    data = make_data(args.batch, args.group, args.tokens, args.seed)
    other = make_data(args.batch, args.group, args.tokens, args.seed + 1)
    cases, results = [], {}
    for name in names:
        case, results[name] = prepare(name, data, other, counter, args.rtol, args.atol)
        cases.append(case)
        print(
            f"{name:22s} compiled in {results[name]['compile_s']:.2f} s, "
            f"allclose {results[name]['allclose']}",
            flush=True,
        )
    timed = run_timed(cases, args.repeats, counter)
    full_shape = data["mask_bgt"].shape == TARGET_SHAPE
    for name, r in results.items():
        r.update(timed[name])
        r["target_met"] = r["ms"]["median"] <= r["target_ms"] if full_shape else None
        print(
            f"{name:22s} {r['ms']['median']:8.2f} ms (p10 {r['ms']['p10']:.2f}, "
            f"p90 {r['ms']['p90']:.2f}, CPU {r['cpu_ms']:.2f})  "
            f"loop {r['loop_ms']['median']:8.1f} ms  x{r['ratio']:6.1f}  "
            f"recompiles {r['recompilations_warm']}",
            flush=True,
        )
    result = {
        "benchmark": "advantages",
        "command": command.strip(),
        "machine": machine,
        "load_avg_end": list(os.getloadavg()),
        "shape": {
            "batch": args.batch,
            "group": args.group,
            "tokens": args.tokens,
            "responses": args.batch * args.group,
            "valid_tokens": int(data["mask_bgt"].sum()),
            "seed": args.seed,
            "repeats": args.repeats,
        },
        "recipes": results,
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {out}")
    if args.markdown:
        pathlib.Path(args.markdown).write_text(markdown(result))
        print(f"wrote {args.markdown}")
    wrong = [n for n, r in results.items() if not r["allclose"]]
    recompiled = [
        n
        for n, r in results.items()
        if r["recompilations_warm"] or (r["jit_cache_growth_warm"] or 0) > 0
    ]
    if wrong or recompiled:
        print(f"FAILED: differs from loop reference: {wrong}; recompiled: {recompiled}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
