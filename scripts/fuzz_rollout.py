"""Randomised differential checks of the rollout engines (a soak test, not a benchmark).

Each seed draws one case: a tiny random model of one family (Llama with GQA; Mistral-style
sliding windows; Qwen2-style q/k/v biases with a window on one layer; Qwen3-style q/k norm
with a head dim of 24), ragged left-padded prompts of which some begin with a common prefix or
repeat exactly, G samples, a length T, per-sample budgets or none, stop ids (none, the model's
EOS, or a random set), a temperature with top-k / top-p, and random ``PagedOptions`` (page
size, slots, steps per dispatch, prefill chunk, prefix sharing, and a pool from roomy down to
one sample group's worst case, which forces preemption). Then it checks what must hold:

- ``engines``: greedy, the paged engine's tokens, masks and truncation equal the static
  engine's and its log-probs agree; sampled, they equal a roomy paged run's (every sequence
  seated at once, a pool that never preempts, no prefix sharing): a sequence's tokens do not
  depend on its slot, its neighbours, its admission time or a recompute. Every run returns all
  its pages, and no sample passes its budget.
- ``partial``: a partial rollout (``partial.generate_partial``, random segment length, paged or
  static engine) samples the one-shot paged run's tokens.
- ``dp``: data-parallel engines on a random mesh of 2 or 4 devices (``data`` 2 or 4, or
  ``data`` 2 with ``tensor`` or ``fsdp`` 2) give the one-device tokens, in one call and in a
  partial rollout of random segments. Needs 4 devices: on CPU run with
  ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (or more).
- ``kernel``: the paged engine with ``attention="pallas_gpu"`` (the Pallas GPU kernel; interpret
  mode off a GPU, slow) gives the reference attention's greedy tokens, log-probs within 1e-4.
  Families the kernel cannot serve (sliding windows, head dim 24) are drawn again as Llama.
- ``mp``: on **two processes** (``jax.distributed`` on CPU with gloo; this script launches
  them, two devices each, on a free local port) over a random layout of their 4 devices
  (``data`` 4; ``data`` 2 × ``tensor`` 2; ``fsdp`` 4, also regrouped into
  ``tensor_parallel=2`` engines; ``data`` 2 × ``fsdp`` 2): a partial rollout of random
  segments, where every process passes the whole batch and returns the one-device one-shot
  paged run; and (with 2 prompts or more) one paged ``generate`` call, each process passing
  its contiguous rows (uneven when B is odd), whose rows together are that run (with
  ``work_stealing`` drawn on, prompts that wait for room move across the processes: the
  facts' ``prompts_stolen`` per process). The two
  processes run all the seeds in one launch each and stop at the first error (the other would
  wait in a collective), which is then reported for that seed, the rest of the seeds not run.

A failing case prints its seed and its drawn configuration; ``--seeds S`` reruns it alone.
``--pressure`` keeps each seed's case but draws its pool near the smallest the engine accepts,
more slots and prefix sharing on, so that sequences are preempted and recomputed far more often;
in the ``mp`` check also prompts wait for room, so that more of them move across the processes
and their outputs come back through the store.
Output: one line per case, and with ``--out`` a JSON summary (cases, failures with seed, check,
case and error, the machine). Exit status 1 when any check failed.

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
        python scripts/fuzz_rollout.py --seeds 0:300 --checks engines,partial,dp \\
        --out fuzz_rollout.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
import traceback
import zlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import numpy as np
from _bench_common import free_port, machine_info
from flax import nnx

from jaxrl_llm import rollout
from jaxrl_llm.models import sharding
from jaxrl_llm.models.tiny import tiny_random_config
from jaxrl_llm.models.transformer import CausalLM
from jaxrl_llm.rollout import paged, paged_dp, partial

CHECKS = ("engines", "partial", "dp", "kernel", "mp")
MP_LAYOUTS = (  # (mesh sizes over the two processes' 4 devices, tensor_parallel)
    (dict(data=4), 0),
    (dict(data=2, tensor=2), 0),
    (dict(fsdp=4), 0),
    (dict(fsdp=4), 2),
    (dict(data=2, fsdp=2), 0),
)
MP_TIMEOUT_S = 1800  # the two processes' whole campaign
VOCAB = 96
LOGP_ATOL = 5e-5  # the same float32 model through other programs (chunked, batched differently)
FAMILIES = {
    "llama": dict(num_heads=4, num_kv_heads=2),
    "mistral": dict(model_type="mistral", sliding_windows=(5, 5)),
    "qwen2": dict(model_type="qwen2", qkv_bias=True, sliding_windows=(None, 4)),
    "qwen3": dict(model_type="qwen3", qk_norm=True, head_dim=24),
}
KERNEL_FAMILIES = ("llama",)  # what pallas_gpu serves: no sliding window, head dim % 16 == 0


@functools.cache
def tiny_model(family: str) -> CausalLM:
    """A tiny random model of ``family`` (built once per process); norm scales and biases moved
    off 1 and 0, so that they matter."""
    config = tiny_random_config(
        vocab_size=VOCAB, intermediate_size=80, max_position_embeddings=512, **FAMILIES[family]
    )
    model = CausalLM(config, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    key = jax.random.key(1)

    def perturb(path: tuple, x: jax.Array) -> jax.Array:
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        if "norm" in name or "bias" in name:
            leaf_key = jax.random.fold_in(key, zlib.crc32(name.encode()))  # the same every run
            return x + 0.1 * jax.random.normal(leaf_key, x.shape)
        return x

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(perturb, state))


class Case(NamedTuple):
    """One drawn case: the inputs, ``generate``'s keywords and the paged engine's options."""

    seed: int
    family: str
    ids: np.ndarray
    mask: np.ndarray
    options: paged.PagedOptions
    kwargs: dict[str, Any]
    draws: dict[str, Any]  # what was drawn, for the report

    def describe(self) -> dict[str, Any]:
        return dict(seed=self.seed, family=self.family, **self.draws)


def least_pages(lengths: list[int], g: int, t: int, budgets: np.ndarray | None, page: int) -> int:
    """The smallest pool (trash page included) the paged engine accepts for these prompts: each
    prompt's G samples admitted with their first tokens, and each sample alone to its budget."""
    per_bg = np.full((len(lengths), g), t) if budgets is None else budgets
    return 1 + max(paged.least_prompt_pages(p, per_bg[b], page) for b, p in enumerate(lengths))


def draw(seed: int, check: str, pressure: bool = False) -> Case:
    """The case of ``seed`` (the same for every check, but for the kernel check's family).
    ``pressure``: then a pool near the smallest the engine accepts, 4 to 16 slots (at least G)
    and prefix sharing on (drawn from another stream, so the rest of the case is the same):
    sequences are preempted and recomputed in about half the cases, prefilled again after the
    prompt pages their siblings still hold."""
    r = np.random.RandomState(seed)
    family = str(r.choice(sorted(FAMILIES)))
    if check == "kernel" and family not in KERNEL_FAMILIES:
        family = KERNEL_FAMILIES[0]
    b, g, t = r.randint(1, 7), r.randint(1, 4), r.randint(1, 21)
    prefix = r.randint(3, VOCAB, size=r.randint(0, 33))
    rows = []
    for _ in range(b):
        body = r.randint(3, VOCAB, size=r.randint(1, 41))
        if len(prefix) and r.rand() < 0.5:  # begins with the common prefix
            body = np.concatenate([prefix, body])[: max(len(body), len(prefix) + r.randint(0, 8))]
        rows.append(body)
    if b > 1 and r.rand() < 0.25:  # some prompts repeat the first exactly
        rows = [rows[0] if i and r.rand() < 0.5 else x for i, x in enumerate(rows)]
    width = max(len(x) for x in rows) + r.randint(0, 5)
    ids = np.zeros((b, width), np.int32)
    mask = np.zeros((b, width), bool)
    for i, x in enumerate(rows):
        ids[i, width - len(x) :], mask[i, width - len(x) :] = x, True
    budgets = r.randint(1, t + 1, size=(b, g)).astype(np.int32) if r.rand() < 0.7 else None
    stop_kind = str(r.choice(["none", "eos", "random"]))
    stop = {"none": (), "eos": None}.get(
        stop_kind, tuple(int(v) for v in r.randint(3, VOCAB, size=r.randint(1, 20)))
    )
    page = int(r.choice([2, 4, 8, 16]))
    group_worst = g * -(-(width + t) // page)  # one prompt's G samples, no page shared
    pool = str(r.choice(["default", "tight", "roomy"], p=[0.3, 0.4, 0.3]))
    num_pages = {
        "default": None,
        "tight": group_worst + 1 + r.randint(0, max(1, group_worst // 2)),
        "roomy": group_worst + 1 + r.randint(0, 3 * group_worst),
    }[pool]
    options = paged.PagedOptions(
        page_size=page,
        num_slots=int(max(g, r.randint(1, 9))),
        num_pages=num_pages,
        steps_per_dispatch=int(r.choice([1, 2, 3, 4, 8, 64])),
        prefill_chunk=int(r.choice([4, 8, 16, 32, 256])),
        prefix_sharing=bool(r.rand() < 0.6),
        attention="pallas_gpu" if check == "kernel" else "reference",
    )
    temperature = 0.0 if check == "kernel" else float(r.choice([0.0, 1.0, 0.7]))
    full = bool(r.rand() < 0.3)
    kwargs = dict(
        rng=jax.random.key(seed),
        max_new_tokens=int(t),
        num_samples=int(g),
        temperature=temperature,
        top_k=int(r.choice([0, 5])),
        top_p=float(r.choice([1.0, 0.9])),
        stop_token_ids=stop,
        max_new_tokens_bg=budgets,
        return_full_logprobs=full,
    )
    # Drawn last, so the earlier campaigns' seeds draw the same cases but for it.
    options = dataclasses.replace(options, work_stealing=bool(r.rand() < 0.7))
    if pressure:
        q = np.random.RandomState(seed + 7_919_000)
        least = least_pages([len(x) for x in rows], g, t, budgets, page)
        options = dataclasses.replace(
            options,
            num_pages=least + q.randint(0, max(2, least // 3)),
            num_slots=int(q.randint(max(g, 4), 17)),
            prefix_sharing=True,
        )
        pool = "pressure"
    draws = dict(
        prompt_lengths=[len(x) for x in rows],
        num_samples=int(g),
        max_new_tokens=int(t),
        budgets=None if budgets is None else budgets.tolist(),
        stop=stop_kind if stop_kind != "random" else list(stop),
        temperature=temperature,
        top_k=kwargs["top_k"],
        top_p=kwargs["top_p"],
        full_logprobs=full,
        pool=pool,
        options=dataclasses.asdict(options),
    )
    return Case(seed, family, ids, mask, options, kwargs, draws)


def assert_same(out: Any, ref: Any, what: str, atol: float = LOGP_ATOL) -> None:
    """Equal tokens, masks and truncation; log-probs (and full ones) within ``atol`` on real
    tokens."""
    for field in ("mask", "tokens", "truncated"):
        a, b = np.asarray(getattr(out, field)), np.asarray(getattr(ref, field))
        if not np.array_equal(a, b):
            at = np.argwhere(a != b)[:4].tolist()
            raise AssertionError(f"{field} differ from {what} at {at}")
    real = np.asarray(ref.mask)
    fields = ["logprobs"]
    if getattr(ref, "full_logprobs", None) is not None:
        fields.append("full_logprobs")
    for field in fields:
        a, b = np.asarray(getattr(out, field)), np.asarray(getattr(ref, field))
        real_ = real if a.ndim == real.ndim else real[..., None]
        gap = float(np.max(np.abs(np.where(real_, a - b, 0.0)), initial=0.0))
        if gap > atol:
            raise AssertionError(f"{field} differ from {what} by {gap:.2e} > {atol:g}")


def paged_run(model: Any, case: Case, options: paged.PagedOptions) -> tuple[Any, Any]:
    out, stats = rollout.generate(
        model, case.ids, case.mask, engine="paged", paged_options=options, return_stats=True,
        **case.kwargs,
    )  # fmt: skip
    if stats.pages_in_use_at_end:
        raise AssertionError(f"{stats.pages_in_use_at_end} pages not returned to the pool")
    budgets = case.kwargs["max_new_tokens_bg"]
    if budgets is not None and (np.asarray(out.mask).sum(-1) > budgets).any():
        raise AssertionError("a sample passed its budget")
    return out, stats


def roomy(case: Case) -> paged.PagedOptions:
    """Every sequence seated at once in a pool that never preempts, nothing shared across
    prompts."""
    b, width = case.ids.shape
    g, t = case.kwargs["num_samples"], case.kwargs["max_new_tokens"]
    return paged.PagedOptions(
        page_size=16,
        num_slots=max(16, b * g),
        num_pages=b * g * -(-(width + t) // 16) + 2,
        prefix_sharing=False,
        attention="reference",
    )


def on_mesh(model: Any, sizes: dict[str, int], devices: list) -> tuple[Any, Any]:
    """``(graphdef, params)`` of ``model`` laid out on a mesh of ``sizes`` over ``devices`` (its
    host values: the same on every process of a multi-process mesh)."""
    graphdef, state = nnx.split(model)
    mesh = sharding.make_mesh(**sizes, devices=devices)
    pure = jax.tree.map(np.asarray, nnx.to_pure_dict(state))
    return graphdef, jax.device_put(pure, sharding.param_shardings(state, mesh))


def partial_run(model: Any, case: Case, segment: int, engine: str = "paged") -> Any:
    """``partial.generate_partial`` of ``case`` in segments of ``segment`` tokens (the paged
    engine with the case's options)."""
    options = case.options if engine == "paged" else None
    return partial.generate_partial(
        [model], case.ids, case.mask, segment_tokens=segment, engine=engine,
        paged_options=options, **case.kwargs,
    )  # fmt: skip


def check_case(check: str, case: Case, model: Any) -> dict[str, Any]:
    """Runs ``check`` on ``case``; raises AssertionError on a mismatch. Returns facts for the
    line printed (preemptions, prefill calls)."""
    out, stats = paged_run(model, case, case.options)
    facts = dict(
        preemptions=int(stats.preemptions),
        prefills=int(stats.prefill_calls),
        shared_prompt_tokens=int(stats.shared_prompt_tokens),
    )
    if check == "engines":
        if case.kwargs["temperature"] == 0.0:
            assert_same(out, rollout.generate(model, case.ids, case.mask, **case.kwargs), "static")
        else:
            assert_same(out, paged_run(model, case, roomy(case))[0], "a roomy paged run")
    elif check == "partial":
        r = np.random.RandomState(case.seed + 1)
        segment = int(r.randint(1, case.kwargs["max_new_tokens"] + 3))
        engine = str(r.choice(["paged", "static"]))
        facts.update(segment=segment, engine=engine)
        got = partial_run(model, case, segment, engine)
        assert_same(got, out, f"the one-shot paged run ({engine}, segments of {segment})")
    elif check == "dp":
        r = np.random.RandomState(case.seed + 2)
        sizes = [dict(data=2), dict(data=4), dict(data=2, tensor=2), dict(data=2, fsdp=2)]
        mesh_sizes = sizes[r.randint(len(sizes))]
        facts.update(mesh=mesh_sizes)
        devices = jax.devices()[: int(np.prod(list(mesh_sizes.values())))]
        sharded = on_mesh(model, mesh_sizes, devices)
        got, dp_stats = paged_run(sharded, case, case.options)
        facts.update(prompts_stolen=int(dp_stats.prompts_stolen))
        assert_same(got, out, f"one device (mesh {mesh_sizes})")
        segment = int(r.randint(1, case.kwargs["max_new_tokens"] + 3))
        facts.update(segment=segment)
        got = partial_run(sharded, case, segment)
        assert_same(got, out, f"one device (partial, segments of {segment}, mesh {mesh_sizes})")
    elif check == "kernel":
        reference = dataclasses.replace(case.options, attention="reference")
        assert_same(out, paged_run(model, case, reference)[0], "the reference attention", 1e-4)
    else:
        raise ValueError(f"unknown check {check!r}; known: {', '.join(CHECKS)}")
    return facts


def mp_draws(case: Case) -> tuple[dict[str, int], int, int]:
    """The ``mp`` check's layout and segment length for ``case``."""
    r = np.random.RandomState(case.seed + 3)
    sizes, tp = MP_LAYOUTS[r.randint(len(MP_LAYOUTS))]
    return sizes, tp, int(r.randint(1, case.kwargs["max_new_tokens"] + 3))


def mp_child(port: int, pid: int, seeds: list[int], out_dir: str, pressure: bool = False) -> None:
    """One of the ``mp`` check's two processes: each seed's partial rollout on the drawn layout
    of both processes' devices, its outputs saved as ``{out_dir}/{seed}.{pid}.npz``."""
    from pathlib import Path

    from jaxrl_llm import distributed as dist

    dist.initialize(f"127.0.0.1:{port}", 2, pid)
    for seed in seeds:
        case = draw(seed, "mp", pressure)
        sizes, tp, segment = mp_draws(case)
        sharded = on_mesh(tiny_model(case.family), sizes, jax.devices())
        options = dataclasses.replace(case.options, tensor_parallel=tp)
        got = partial.generate_partial(
            [sharded], case.ids, case.mask, segment_tokens=segment,
            paged_options=options, **case.kwargs,
        )  # fmt: skip
        arrays = {f: np.asarray(x) for f, x in got._asdict().items() if x is not None}
        if len(case.ids) >= 2:  # generate: each process its own rows of the batch
            rows = paged_dp.split_rows(len(case.ids), 2)[pid]
            budgets = case.kwargs["max_new_tokens_bg"]
            kwargs = dict(case.kwargs, max_new_tokens_bg=None if budgets is None else budgets[rows])
            mine, stats = rollout.generate(
                sharded, case.ids[rows], case.mask[rows], engine="paged",
                paged_options=options, return_stats=True, **kwargs,
            )  # fmt: skip
            arrays.update(
                {f"gen_{f}": np.asarray(x) for f, x in mine._asdict().items() if x is not None}
            )
            arrays["stolen"] = np.int64(stats.prompts_stolen)  # across processes too
        path = Path(out_dir) / f"{seed}.{pid}.npz"
        np.savez(path.with_suffix(".tmp.npz"), **arrays)
        path.with_suffix(".tmp.npz").replace(path)  # whole, or not there
        print(f"done {seed}", flush=True)


def mp_campaign(
    seeds: list[int], pressure: bool = False
) -> Iterator[tuple[int, dict[str, Any], str | None]]:
    """Runs the ``mp`` check of ``seeds``: two processes sample, this one computes each seed's
    one-device reference meanwhile and compares. Yields ``(seed, facts, error or None)`` as
    each seed is compared."""
    import os
    import tempfile
    from pathlib import Path

    port = free_port()
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "force_host_platform" not in f]
    env = {
        **os.environ,
        "XLA_FLAGS": " ".join([*flags, "--xla_force_host_platform_device_count=2"]),
        "JAX_PLATFORMS": "cpu",
    }
    with tempfile.TemporaryDirectory(prefix="fuzz_mp_") as tmp:
        yield from _mp_compare(seeds, port, env, Path(tmp), pressure)


def _mp_compare(
    seeds: list[int], port: int, env: dict[str, str], out_dir: Any, pressure: bool = False
) -> Iterator[tuple[int, dict[str, Any], str | None]]:
    import subprocess

    seed_list = ",".join(map(str, seeds))
    children, logs = [], [out_dir / f"process{i}.log" for i in range(2)]
    for pid, log in enumerate(logs):
        cmd = [sys.executable, __file__, "--mp-child", str(port), str(pid), seed_list, str(out_dir)]
        cmd += ["--pressure"] if pressure else []
        with log.open("w") as f:
            children.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT))
    start, finished = time.perf_counter(), False
    try:
        for seed in seeds:
            case = draw(seed, "mp", pressure)
            ref, _ = paged_run(tiny_model(case.family), case, case.options)
            sizes, tp, segment = mp_draws(case)
            facts = dict(mesh=sizes, tensor_parallel=tp, segment=segment)
            if len(case.ids) >= 2:  # the generate call's rows per process
                facts["generate_rows"] = [
                    r.stop - r.start for r in paged_dp.split_rows(len(case.ids), 2)
                ]
            paths = [out_dir / f"{seed}.{pid}.npz" for pid in range(2)]
            while not all(p.exists() for p in paths) and all(c.poll() is None for c in children):
                if time.perf_counter() - start > MP_TIMEOUT_S:
                    break
                time.sleep(0.2)
            if not all(p.exists() for p in paths):  # a process failed (or hangs): stop here
                tails = [log.read_text()[-3000:] for log in logs]
                codes = [c.poll() for c in children]
                yield seed, facts, f"processes ended {codes}:\n" + "\n---\n".join(tails)
                return
            try:
                loaded = []
                for path in paths:
                    with np.load(path) as z:
                        loaded.append({k: z[k] for k in z.files})
                if "stolen" in loaded[0]:  # generate's prompts taken from another engine
                    facts["prompts_stolen"] = [int(a.pop("stolen")) for a in loaded]
                for pid, arrays in enumerate(loaded):
                    got = {k: v for k, v in arrays.items() if not k.startswith("gen_")}
                    got = partial.PartialGeneration(**got)
                    assert_same(got, ref, f"one device (partial, process {pid} of 2, {facts})")
                if len(case.ids) >= 2:
                    fields = [k for k in loaded[0] if k.startswith("gen_")]
                    rows = {k[4:]: np.concatenate([a[k] for a in loaded]) for k in fields}
                    got = rollout.Generation(**rows)
                    assert_same(got, ref, f"one device (generate, each process its rows, {facts})")
            except AssertionError as e:
                yield seed, facts, f"AssertionError: {e}"
                continue
            yield seed, facts, None
        finished = True
    finally:
        for child in children:
            try:
                child.wait(timeout=60 if finished else 5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(timeout=30)


def parse_seeds(text: str) -> list[int]:
    """``"S"`` (one seed), ``"A:B"`` (A to B-1) or a comma list of either."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.partition(":")
        try:
            seeds += list(range(int(lo), int(hi))) if sep else [int(lo)]
        except ValueError:
            raise SystemExit(f"--seeds: {part!r} is not a seed or A:B range of seeds") from None
    return seeds


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0:100", help="S, A:B (A..B-1) or a comma list")
    ap.add_argument("--checks", default="engines,partial", help=f"comma list of {CHECKS}")
    ap.add_argument("--out", default=None, help="JSON summary path")
    ap.add_argument(
        "--pressure",
        action="store_true",
        help="pools near the smallest the engine accepts (preemption in about half the cases; in "
        "mp, prompts that wait for room, so more of them move across the processes)",
    )
    ap.add_argument("--mp-child", nargs=4, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mp_child:  # one of the mp check's processes (launched by mp_campaign)
        port, pid, seeds, out_dir = args.mp_child
        mp_child(int(port), int(pid), parse_seeds(seeds), out_dir, args.pressure)
        return {"failures": []}
    checks = [c for c in args.checks.split(",") if c]
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        raise SystemExit(f"--checks: unknown {unknown}; known: {', '.join(CHECKS)}")
    if "dp" in checks and len(jax.devices()) < 4:
        raise SystemExit(
            f"--checks dp needs 4 devices, this process has {len(jax.devices())}; on CPU set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=4 before starting"
        )
    failures, cases, start = [], 0, time.perf_counter()
    seeds = parse_seeds(args.seeds)
    if "mp" in checks:
        for seed, facts, error in mp_campaign(seeds, args.pressure):
            cases += 1
            if error is None:
                print(f"ok seed {seed} mp {draw(seed, 'mp').family} {facts}", flush=True)
                continue
            case = draw(seed, "mp", args.pressure)
            failures.append(dict(seed=seed, check="mp", case=case.describe(), error=error))
            print(f"FAIL seed {seed} mp {facts}: {error}", flush=True)
            print(json.dumps(case.describe()), flush=True)
        checks = [c for c in checks if c != "mp"]
    for seed in seeds:
        for check in checks:
            case = draw(seed, check, args.pressure)
            model = tiny_model(case.family)
            t0 = time.perf_counter()
            cases += 1
            try:
                facts = check_case(check, case, model)
            except Exception as e:  # a mismatch, or an engine error on a valid case
                error = f"{type(e).__name__}: {e}"
                failures.append(dict(seed=seed, check=check, case=case.describe(), error=error))
                print(f"FAIL seed {seed} {check}: {error}", flush=True)
                print(json.dumps(case.describe()), flush=True)
                traceback.print_exc()
                continue
            took = time.perf_counter() - t0
            print(f"ok seed {seed} {check} {case.family} {took:.1f}s {facts}", flush=True)
    summary = dict(
        cases=cases,
        failures=failures,
        checks=checks,
        seeds=args.seeds,
        seconds=round(time.perf_counter() - start, 1),
        machine=machine_info(),
        devices=len(jax.devices()),
    )
    print(f"{cases} cases, {len(failures)} failed, {summary['seconds']} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return summary


if __name__ == "__main__":
    sys.exit(1 if main()["failures"] else 0)
