"""Host values across processes: ``multihost_utils.process_allgather`` (a compiled all-gather
on every device) against :func:`jaxrl_llm.distributed.host_allgather` (the coordination
service's key-value store), idle and beside a program in flight.

Two processes with ``--devices`` fake CPU devices each (gloo collectives, loopback), one small
``int32`` per process, the medians of ``--rounds`` calls:

* ``idle``: nothing else runs;
* ``beside update on all devices``: a program with a collective in every iteration (an update's
  stand-in) over every device has just been dispatched (colocated placement);
* ``beside update on train devices``: the same program on each process's first device only, the
  gather over all (a split placement: what the async loop's rollout gathers while the update
  runs).

The program's own time is reported beside. A device gather that waits for the program costs
its remaining time; one over the coordination service does not.

    python scripts/bench_host_gather.py --rounds 5 --out bench_results/host_gather.json

Writes the JSON with the machine's ``lscpu`` model and flags and the load average before and
after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import json, statistics, sys, time
from jaxrl_llm import distributed as dist
port, pid, rounds, size, iters = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:6])
dist.initialize(f"127.0.0.1:{port}", 2, pid)
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

def program(devices):
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    rows = np.ones((len(devices), size, size), np.float32)
    x = dist.to_global(rows, NamedSharding(mesh, P("data")))
    w = jnp.full((size, size), 1e-3)
    step = jax.jit(lambda x: jax.lax.fori_loop(
        0, iters, lambda i, y: jnp.tanh(y @ w) + y.sum() * 1e-9, x).sum())
    step(x).block_until_ready()
    return lambda: step(x)

def timed(f):
    t0 = time.perf_counter(); f(); return time.perf_counter() - t0

device = lambda: multihost_utils.process_allgather(np.int32(pid))
kv = lambda: dist.host_allgather(np.int32(pid), what="bench")
device(); kv()
devices = jax.devices()
cases = {"idle": None, "beside update on all devices": program(devices),
         "beside update on train devices": program(  # each process's first device
             [next(d for d in devices if d.process_index == p) for p in range(2)])}
out = {}
for name, busy in cases.items():
    row = {}
    for label, gather in (("process_allgather", device), ("host_allgather", kv)):
        times, own = [], []
        for _ in range(rounds):
            dist.host_allgather(np.int32(0), what="line up")
            if busy is None:
                times.append(timed(gather)); continue
            t0 = time.perf_counter(); y = busy(); times.append(timed(gather))
            y.block_until_ready(); own.append(time.perf_counter() - t0)
        row[label + "_ms"] = 1e3 * statistics.median(times)
        if own:
            row["program_ms"] = 1e3 * statistics.median(own)
    out[name] = row
if pid == 0:
    print("RESULT " + json.dumps(out), flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--devices", type=int, default=2, help="fake CPU devices per process")
    parser.add_argument("--size", type=int, default=256, help="the program's matrix size")
    parser.add_argument("--iters", type=int, default=300, help="the program's iterations")
    parser.add_argument("--out", default="bench_results/host_gather.json")
    args = parser.parse_args()
    from _bench_common import free_port, machine_info

    info = machine_info()
    port = free_port()
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "force_host" not in f]
    env = dict(
        os.environ,
        XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={args.devices}"]),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    extra = [str(args.rounds), str(args.size), str(args.iters)]
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(port), str(i), *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [c.communicate(timeout=900)[0] for c in children]
    if any(c.returncode for c in children):
        raise SystemExit(f"a child failed: {[c.returncode for c in children]}\n{outputs}")
    (line,) = [x for x in outputs[0].splitlines() if x.startswith("RESULT ")]
    result = {**info, "args": vars(args), "cases": json.loads(line[len("RESULT ") :])}
    result["load_avg_after"] = os.getloadavg()
    for name, row in result["cases"].items():
        print(f"{name:32s} " + "  ".join(f"{k} {v:8.1f}" for k, v in row.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
