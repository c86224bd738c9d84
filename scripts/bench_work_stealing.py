"""Work stealing between data-parallel paged engines (``PagedOptions.work_stealing``).

The same call twice on a ``data=D`` mesh (one paged engine per device), once with each engine
running its contiguous share of the prompts and once with work stealing, on the rollout
issue's long-tail workload (per-sample budgets drawn from a heavy tail: 80% of the samples
16-48 tokens, 20% 256-512; no early stop) with few decode slots per engine, so that prompts
queue. Reported per mode: wall seconds and useful tokens/s, and per engine its decode steps
(``PagedStats.decode_steps``), dispatches and the prompts it took from others. The call's
**critical path** is its busiest engine's decode steps: on an accelerator, where each engine
has its own chips and a decode step's time barely depends on its rows, the call's time follows
it. On this CPU the D "devices" share the same cores (``--xla_force_host_platform_device_count``),
so an idle engine's cores go to the others and the wall time moves far less than the critical
path. The two modes' tokens are compared (``agreement``).

With ``--processes N`` the script runs N processes of a ``jax.distributed`` job on this host
(``--engines`` devices and engines each, a mesh over all of them): each process passes its
contiguous share of the prompts, as the trainer does, and prompts then move across processes
too (``stealing.Lending``). The critical path is then the busiest engine of any process, the
wall time the slowest process's.

    python scripts/bench_work_stealing.py                    # SmolLM2-135M, 4 engines
    python scripts/bench_work_stealing.py --processes 2 --engines 1
    python scripts/bench_work_stealing.py --model tiny-random --prompts 8 --samples 2
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time


def _force_devices(argv: list[str]) -> None:
    """``--engines`` fake CPU devices, set before JAX is imported (no effect once it is)."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--engines", type=int, default=4)
    n = ap.parse_known_args(argv)[0].engines
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


if __name__ == "__main__":
    _force_devices(sys.argv[1:])

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _bench_common import free_port, machine_info  # noqa: E402
from bench_rollout import long_tail_budgets  # noqa: E402


def agreement(a, b) -> dict:
    """How two runs' samples agree: the samples whose tokens differ, the token where each
    first differs, and the largest log-prob gap over the tokens before it (float rounding:
    an engine's matmuls run at the row width of what it is decoding, so a near-tie can
    sample another token; a wrong key would differ from the first token on)."""
    import numpy as np

    tok_a, tok_b = np.asarray(a.tokens), np.asarray(b.tokens)
    mask = np.asarray(a.mask) & np.asarray(b.mask)
    differ = (tok_a != tok_b) & mask
    first = np.where(differ.any(-1), differ.argmax(-1), tok_a.shape[-1])  # [B, G]
    before = np.arange(tok_a.shape[-1]) < first[..., None]
    gap = np.abs(np.asarray(a.logprobs) - np.asarray(b.logprobs))
    return {
        "samples": int(first.size),
        "samples_differing": int(differ.any(-1).sum()),
        "first_difference_at": sorted(int(x) for x in first[differ.any(-1)]),
        "max_logprob_gap_before": float(np.max(np.where(before & mask, gap, 0.0))),
    }


def _processes(args: argparse.Namespace, argv: list[str]) -> dict:
    """Runs the script as ``args.processes`` processes (``--child``) on this host and merges
    what each wrote: per mode, the engines' figures in process order, the slowest process's
    seconds, and the agreement of the whole batch's outputs."""
    import subprocess
    import tempfile

    import numpy as np

    from jaxrl_llm import rollout

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COORDINATOR")}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={args.engines}"])
    env["JAX_PLATFORMS"] = "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        outs = [pathlib.Path(tmp) / f"process{i}" for i in range(args.processes)]
        children = [
            subprocess.Popen(
                [sys.executable, __file__, *argv, "--child", f"{port}:{i}", "--out", str(out)],
                env=env,
            )
            for i, out in enumerate(outs)
        ]
        codes = [c.wait() for c in children]
        if any(codes):
            raise SystemExit(f"--processes {args.processes}: the processes exited with {codes}")
        parts = [json.loads(out.with_suffix(".json").read_text()) for out in outs]
        arrays = [dict(np.load(out.with_suffix(".npz"))) for out in outs]
    result = {k: v for k, v in parts[0].items() if k not in ("modes", "load_avg_after")}
    result["modes"] = {}
    result["command"] = "python scripts/bench_work_stealing.py " + " ".join(argv)
    outputs = {}
    for mode in parts[0]["modes"]:
        ours = [q["modes"][mode] for q in parts]
        steps = [x for q in ours for x in q["decode_steps"]]
        seconds = max(q["seconds"] for q in ours)
        result["modes"][mode] = {
            "seconds": seconds,
            "useful_tokens_per_s": round(result["budgets"]["useful"] / seconds, 1),
            "decode_steps": steps,
            "critical_path_steps": max(steps),
            "decode_dispatches": [x for q in ours for x in q["decode_dispatches"]],
            "prompts_stolen": [x for q in ours for x in q["prompts_stolen"]],
            "preemptions": sum(q["preemptions"] for q in ours),
        }
        fields = ("tokens", "mask", "logprobs", "truncated")
        outputs[mode] = rollout.Generation(
            **{f: np.concatenate([a[f"{mode}/{f}"] for a in arrays]) for f in fields}
        )
    return result, outputs


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=4, help="data-parallel engines (devices)")
    ap.add_argument("--processes", type=int, default=1, help="processes of a jax.distributed job")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # PORT:ID, set by --processes
    ap.add_argument("--model", default="default", help="default, tiny-random or an HF folder")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--short", type=int, nargs=2, default=[16, 48], help="short budgets' range")
    ap.add_argument("--long", type=int, nargs=2, default=[256, 512], help="long budgets' range")
    ap.add_argument("--slots", type=int, default=8, help="decode slots per engine")
    ap.add_argument("--steps-per-dispatch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_results/bench_work_stealing.json")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.processes > 1 and args.child is None:
        result, outputs = _processes(args, [a for a in argv if a not in ("--out", args.out)])
        return _report(args, result, outputs)
    if args.child is not None:
        from jaxrl_llm import distributed as dist

        port, pid = args.child.split(":")
        dist.initialize(f"127.0.0.1:{port}", args.processes, int(pid))

    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxrl_llm import models, rollout
    from jaxrl_llm.models import sharding
    from jaxrl_llm.rollout import paged

    engines = args.engines * args.processes
    if len(jax.devices()) < engines:
        raise SystemExit(f"--engines {args.engines}: only {len(jax.devices())} devices")
    if args.model == "tiny-random":
        model = models.CausalLM(models.tiny_random_config(), rngs=nnx.Rngs(0))
        name = "tiny-random"
    else:
        path = str(models.default_model_path() if args.model == "default" else args.model)
        model = models.from_pretrained(path, dtype=jnp.float32)
        name = os.path.basename(path.rstrip("/"))
    graphdef, state = nnx.split(model)
    devices = jax.devices()[:engines]  # in process order
    mesh = sharding.make_mesh(data=engines, devices=devices)

    def on_mesh(x, s):  # every process holds the whole weights: each puts its devices' part
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda i: host[i])

    params = jax.tree.map(on_mesh, nnx.to_pure_dict(state), sharding.param_shardings(state, mesh))

    rng = np.random.RandomState(args.seed)
    vocab = model.config.vocab_size
    lengths = rng.randint(16, 65, args.prompts)
    width = int(lengths.max())
    ids = np.zeros((args.prompts, width), np.int32)
    mask = np.zeros((args.prompts, width), bool)
    for b, n in enumerate(lengths):
        ids[b, width - n :] = rng.randint(3, vocab, n)
        mask[b, width - n :] = True
    budgets = long_tail_budgets(args.prompts, args.samples, args.seed, args.short, args.long)
    t = int(budgets.max())
    useful_all = int(budgets.sum())
    if args.child is not None:  # this process's contiguous share, as the trainer passes it
        from jaxrl_llm.rollout import paged_dp

        rows = paged_dp.split_rows(args.prompts, args.processes)[jax.process_index()]
        ids, mask, budgets = ids[rows], mask[rows], budgets[rows]
    base = paged.PagedOptions(num_slots=args.slots, steps_per_dispatch=args.steps_per_dispatch)
    kw = dict(
        rng=jax.random.key(args.seed), temperature=1.0, max_new_tokens=t,
        num_samples=args.samples, max_new_tokens_bg=budgets, stop_token_ids=(),
        engine="paged", return_stats=True,
    )  # fmt: skip

    result: dict = {
        "model": name,
        "processes": args.processes,
        "engines": args.engines,
        "prompts": args.prompts,
        "samples": args.samples,
        "budgets": {"short": args.short, "long": args.long, "useful": useful_all},
        "slots_per_engine": args.slots,
        "steps_per_dispatch": args.steps_per_dispatch,
        **machine_info(),
        "command": "python scripts/bench_work_stealing.py " + " ".join(argv),
        "modes": {},
    }
    outputs = {}
    for mode, stealing in (("split", False), ("stealing", True)):
        options = dataclasses.replace(base, work_stealing=stealing)
        policy = (graphdef, params)
        warm = rollout.generate(policy, ids, mask, paged_options=options, **kw)
        jax.block_until_ready(warm[0])  # compiles every engine's programs
        start = time.perf_counter()
        out, stats = rollout.generate(policy, ids, mask, paged_options=options, **kw)
        jax.block_until_ready(out)
        seconds = time.perf_counter() - start
        useful = int(np.asarray(out.mask).sum())
        assert useful == int(budgets.sum()), (useful, int(budgets.sum()))
        shards = [s for s in stats.shards if s is not None]  # this process's engines
        steps = [s.decode_steps for s in shards]
        result["modes"][mode] = {
            "seconds": round(seconds, 3),
            "useful_tokens_per_s": round(useful / seconds, 1),
            "decode_steps": steps,
            "critical_path_steps": max(steps),
            "decode_dispatches": [s.decode_dispatches for s in shards],
            "prompts_stolen": [s.prompts_stolen for s in shards],
            "preemptions": stats.preemptions,
        }
        outputs[mode] = out
        print(mode, json.dumps(result["modes"][mode]), flush=True)
    if args.child is not None:  # the parent merges the processes' figures and outputs
        out_path = pathlib.Path(args.out)
        out_path.with_suffix(".json").write_text(json.dumps(result))
        fields = ("tokens", "mask", "logprobs", "truncated")
        np.savez(
            out_path.with_suffix(".npz"),
            **{f"{m}/{f}": np.asarray(getattr(o, f)) for m, o in outputs.items() for f in fields},
        )
        return result
    return _report(args, result, outputs)


def _report(args: argparse.Namespace, result: dict, outputs: dict) -> dict:
    """Adds the two modes' agreement and ratios, prints and writes ``args.out``."""
    result["agreement"] = agreement(outputs["split"], outputs["stealing"])
    print("agreement", json.dumps(result["agreement"]), flush=True)
    split, steal = result["modes"]["split"], result["modes"]["stealing"]
    result["critical_path_ratio"] = round(
        split["critical_path_steps"] / steal["critical_path_steps"], 3
    )
    result["wall_ratio"] = round(split["seconds"] / steal["seconds"], 3)
    result["load_avg_after"] = os.getloadavg()
    print(json.dumps({k: result[k] for k in ("critical_path_ratio", "wall_ratio")}))
    out_path = pathlib.Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
