"""Memory mappings that XLA:CPU's compiled programs hold in this process (a measurement, Linux).

1. Per program: ``/proc/self/maps`` lines added by the first ``rollout.generate`` call of each
   engine (``static``, ``paged``) for the tiny 2-layer test model and for SmolLM2-135M-Instruct
   (``--no-smollm2`` skips it), with the programs each call compiled.
2. ``--sweep N``: ``generate`` on the tiny model with ``max_new_tokens`` = 1 .. N (one new
   program each), the mappings after every call and the calls where
   ``jaxrl_llm.memory_maps.relieve`` dropped the compiled programs. ``--no-guard`` disables
   the guard: the process then aborts once the mappings reach ``vm.max_map_count`` (run it
   in its own process; the JSON so far is written after every 25 calls).

    JAX_PLATFORMS=cpu python scripts/measure_memory_maps.py --sweep 240 --out maps.json
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
import warnings

import jax
import numpy as np

from jaxrl_llm import memory_maps, models, rollout


def _tiny_model():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.models import hf_tiny

    hf = hf_tiny.build_hf("llama3")
    folder = tempfile.mkdtemp()
    hf.save_pretrained(folder)
    return models.from_pretrained(folder), hf.config.vocab_size, hf_tiny


def per_program(model, ids, mask) -> dict:
    compiles: collections.Counter = collections.Counter()

    def listen(event: str, secs: float, **kw) -> None:
        if event.endswith("backend_compile_duration"):
            compiles[kw.get("fun_name", "?")] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    out = {}
    try:
        for engine in ("static", "paged"):
            compiles.clear()
            before = memory_maps.count()
            rollout.generate(
                model, ids, mask, rng=jax.random.key(0), max_new_tokens=4, temperature=0.0,
                engine=engine, stop_token_ids=(),
            )  # fmt: skip
            out[engine] = {
                "mappings_added": memory_maps.count() - before,
                "compiled": dict(compiles),
            }
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", type=int, default=0)
    ap.add_argument("--no-guard", action="store_true")
    ap.add_argument("--no-smollm2", action="store_true")
    ap.add_argument("--out", default="memory_maps.json")
    args = ap.parse_args()
    result: dict = {"limit": memory_maps.limit(), "start": memory_maps.count()}
    tiny, vocab, hf_tiny = _tiny_model()
    ids, mask = hf_tiny.left_padded_batch(np.random.RandomState(0), [9, 4], 9, vocab)
    result["tiny"] = per_program(tiny, ids, mask)
    if not args.no_smollm2:
        smol = models.from_pretrained(str(models.default_model_path()))
        result["smollm2"] = per_program(smol, ids.clip(0, 100), mask)
    print(json.dumps(result, indent=1), flush=True)
    if args.sweep:
        if args.no_guard:
            memory_maps.relieve = lambda *a, **k: False  # what the library did before
        jax.clear_caches()
        sweep, relieved, t0 = [], [], time.perf_counter()
        for t in range(1, args.sweep + 1):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                rollout.generate(
                    tiny, ids, mask, rng=jax.random.key(0), max_new_tokens=t, stop_token_ids=()
                )
            if any("memory mappings" in str(w.message) for w in caught):
                relieved.append(t)
            sweep.append((t, memory_maps.count(), round(time.perf_counter() - t0, 1)))
            if t % 25 == 0 or t == args.sweep:
                result["sweep"] = {
                    "guard": not args.no_guard,
                    "relieved_at": relieved,
                    "calls": sweep,
                }
                _write(result, args.out)  # so far: without the guard the process may abort
                print(sweep[-1], "relieved at", relieved, flush=True)
    _write(result, args.out)


def _write(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
