"""Resident memory as a run's update meets new packed shapes (a diagnostic, not a benchmark).

The trainer's RL step (``make_rl_step`` of ``--config``, the quickstart's by default) on
synthetic batches of the config's ``B × G × T``, one step per entry of ``--shapes``
(``completion_tokens:prompt_tokens``, each batch's longest): a shape not seen before compiles one
more update program. After each step it prints the process's resident set, its peak
(``ru_maxrss``) and the C heap in use (glibc ``mallinfo2``), and writes them as JSON. The loop
hands freed heap back before each step (``hostmem.release_free_heap``), as the trainer does.

    python scripts/probe_update_shapes.py --out bench_results/update_shapes.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
DEFAULT_SHAPES = ["24:64", "24:64", "11:40", "11:40", "18:50", "24:32", "24:64", "11:40"]


def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def synthetic_groups(setup, completion: int, prompt: int, rng):
    """A batch of the setup's ``B × G × T`` groups whose longest completion has ``completion``
    tokens (the others 8 fewer at most) and whose prompts have ``prompt`` columns with 0-11
    tokens of left padding; random tokens, rewards and sampler log-probs."""
    import numpy as np

    from jaxrl_llm.train.step import Groups

    b, g, t = setup.loop.batch_size, setup.sampler.num_samples, setup.sampler.max_new_tokens
    vocab = setup.policy().config.vocab_size
    c_len = rng.integers(max(1, completion - 8), completion + 1, (b, g))
    c_len[0, 0] = completion
    mask = np.arange(t) < c_len[..., None]
    prompt_mask = np.ones((b, prompt), bool)
    for row in range(b):
        prompt_mask[row, : rng.integers(0, 12)] = False
    ids = np.where(prompt_mask, rng.integers(3, vocab, (b, prompt)), 0)
    return Groups(
        prompt_ids_bp=ids.astype(np.int32),
        prompt_mask_bp=prompt_mask,
        tokens_bgt=np.where(mask, rng.integers(3, vocab, (b, g, t)), 0).astype(np.int32),
        mask_bgt=mask,
        logp_sampler_bgt=-rng.uniform(0.5, 3.0, (b, g, t)).astype(np.float32),
        reward_bg=rng.integers(0, 2, (b, g)).astype(np.float32),
        member_bg=np.ones((b, g), bool),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES)
    ap.add_argument("--out", default="bench_results/update_shapes.json")
    ap.add_argument(
        "--plain-accumulation",
        action="store_true",
        help="trace the step without the fused gradient accumulation (models/grad_accumulation:"
        " the layers' and the LM head's)",
    )
    ap.add_argument("overrides", nargs="*", help="config key=value overrides")
    args = ap.parse_args()

    sys.path.insert(0, str(Path(__file__).parent))
    import numpy as np
    from _bench_common import machine_info  # importing it pins JAX to the CPU, as the CLI does

    from jaxrl_llm.config.validation import load_config
    from jaxrl_llm.models import grad_accumulation
    from jaxrl_llm.train import hostmem, loop
    from jaxrl_llm.train import setup as su

    machine = machine_info()  # the load average before the run
    if args.plain_accumulation:  # the A/B of the fused accumulation: every trace falls back
        grad_accumulation.scan = lambda *a, **k: None
        grad_accumulation.map_chunks = lambda *a, **k: None
    hostmem.release_after_compiles()
    config = load_config(args.config, ["data.eval_size=0", *args.overrides])
    setup = su.resolve(config, run_dir=tempfile.mkdtemp(prefix="probe_shapes_"))
    step = loop._rl_step(setup)  # the training loop's own RL step
    state = setup.state
    t = setup.sampler.max_new_tokens
    rng = np.random.default_rng(0)

    rows = []
    for spec in args.shapes:
        completion, prompt = (int(x) for x in spec.split(":"))
        if not 1 <= completion <= t:
            raise SystemExit(f"--shapes {spec}: completion tokens must be in [1, {t}]")
        hostmem.release_free_heap()
        t0 = time.perf_counter()
        state, _ = step(state, synthetic_groups(setup, completion, prompt, rng))
        row = {
            "shape": spec,
            "seconds": round(time.perf_counter() - t0, 2),
            "rss_gib": round(_rss_gib(), 3),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
            "heap_in_use_gib": round((hostmem.heap_bytes_in_use() or 0) / 2**30, 3),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine, "command": " ".join(sys.argv), "steps": rows}
    result["machine"]["load_avg_after"] = os.getloadavg()
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
