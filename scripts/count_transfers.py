"""Host↔device transfers of one training step of ``jaxrl-llm train`` (GRPO, tiny config).

Trains ``configs/tiny.yaml`` (a 2-layer random Llama; no evaluation; one checkpoint at the end)
for ``--short`` and then ``--long`` steps, each in a fresh child process, and reports per step
the difference of the two runs' totals divided by the difference in steps (set-up, compilation,
the final checkpoint and the export cancel out):

* host → device transfers: every transfer JAX's transfer guard reports
  (``jax_transfer_guard_host_to_device=log_explicit``: one log line per array put on a device,
  implicit or explicit), with their bytes where the line gives the array's type;
* device → host reads: calls of ``jax.Array._value`` (what ``float(x)``, ``x.item()`` and
  ``jax.device_get`` go through; NumPy's zero-copy view of a CPU array is not counted, so on
  CPU this is a lower bound).

It imports ``jaxrl_llm`` from the working directory, so the same file measures another checkout:
``cd OTHER_CHECKOUT && python /path/to/scripts/count_transfers.py``.

    python scripts/count_transfers.py --json bench_results/transfers.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.getcwd())

_AVAL = re.compile(r"host-to-device transfer: aval=ShapedArray\((\w+)\[([\d,]*)\]")
_BYTES = {"bool": 1, "int8": 1, "uint8": 1, "bfloat16": 2, "float16": 2, "int32": 4,
          "uint32": 4, "float32": 4, "int64": 8, "float64": 8}  # fmt: skip


def _h2d(lines: list[str]) -> tuple[int, int]:
    count = size = 0
    for line in lines:
        m = _AVAL.search(line)
        if m:
            count += 1
            dims = [int(d) for d in m.group(2).split(",") if d]
            size += _BYTES.get(m.group(1), 4) * math.prod(dims)
    return count, size


def child(steps: int, out: str) -> None:
    """One run of ``steps`` steps; writes its totals to ``out``."""
    # The guard logs from C++ to stderr: send fd 2 to a file and read it at the end.
    log_path = Path(out).with_suffix(".stderr")
    os.dup2(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)

    import jax
    from jax._src import array as _array

    from jaxrl_llm.config import load_config
    from jaxrl_llm.train import loop

    jax.config.update("jax_transfer_guard_host_to_device", "log_explicit")
    reads = [0]
    value = _array.ArrayImpl._value

    def counted(self):
        reads[0] += 1
        return value.fget(self)

    _array.ArrayImpl._value = property(counted)
    config = load_config(
        "configs/tiny.yaml",
        [f"train.max_steps={steps}", "data.eval_size=0", f"train.save_every={steps}"],
    )
    with tempfile.TemporaryDirectory() as run_dir:
        loop.train(config, run_dir=run_dir, progress=False, log=lambda *_: None)
    sys.stderr.flush()
    text = log_path.read_text(errors="replace")
    count = text.count("host-to-device transfer:")
    _, size = _h2d(text.splitlines())
    Path(out).write_text(json.dumps({"h2d": count, "h2d_bytes": size, "d2h_reads": reads[0]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", type=int, default=3)
    ap.add_argument("--long", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(int(args.child[0]), args.child[1])
        return
    totals = {}
    with tempfile.TemporaryDirectory() as tmp:
        for steps in (args.short, args.long):
            out = str(Path(tmp) / f"{steps}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", str(steps), out]
            subprocess.run(cmd, check=True, cwd=os.getcwd())
            totals[steps] = json.loads(Path(out).read_text())
    span = args.long - args.short
    per_step = {k: (totals[args.long][k] - totals[args.short][k]) / span for k in totals[args.long]}
    result = {"cwd": os.getcwd(), "config": "configs/tiny.yaml", "totals": totals,
              "per_step": per_step}  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
