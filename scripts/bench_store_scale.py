"""The coordination service's load as processes grow: :func:`jaxrl_llm.distributed.host_allgather`
(publish, one barrier, one read of the round's folder, one delete: 4 requests per process,
``4·N`` a call) against the way it read before (one blocking read per other process's key:
``N·(N+1)`` requests a call).

Multi-process runs exchange small host values several times a step (stop signals, reward
scores, row counts, checkpoint flags), and every request goes to one coordinator, process 0's
service. ``N`` processes on this machine (``jax.distributed`` over loopback, one CPU device
each, nothing else running), each exchanging an ``int32[8]``; both ways alternate, ``--rounds``
calls each, after one warm-up call. A process here shares the machine's cores with every other
process (a pod host has its own), so the absolute times are pessimistic and the ratio is what
to read; the per-call request counts are exact.

    python scripts/bench_store_scale.py --processes 2 4 8 16 32 --rounds 20 \\
        --out bench_results/store_scale.json

Writes the JSON with the machine's ``lscpu`` model and flags and the load average before and
after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import json, statistics, sys, time
from jaxrl_llm import distributed as dist
port, pid, n, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
dist.initialize(f"127.0.0.1:{port}", n, pid)
import numpy as np
client = dist._kv_client()
value = np.arange(8, dtype=np.int32) + pid
last = []

def per_key(r):
    # host_allgather before: publish, then one blocking read per other process's key (the
    # same packing of the values)
    key = f"bench/per_key/{r}/"
    client.key_value_set_bytes(key + str(pid), dist._pack([value], "bench"))
    out = [dist._unpack(client.blocking_key_value_get_bytes(key + str(p), 60_000), "bench", p, 1)[0]
           if p != pid else value for p in range(n)]
    for old in last:
        client.key_value_delete(old)
    last[:] = [key + str(pid)]
    return np.stack(out)

def barrier_read(r):
    return dist.host_allgather(value, what="bench")

times = {"host_allgather": [], "per_key": []}
expected = np.arange(8, dtype=np.int32)[None] + np.arange(n, dtype=np.int32)[:, None]
client.wait_at_barrier("bench/start", 600_000)
for r in range(rounds + 1):
    for name, f in (("host_allgather", barrier_read), ("per_key", per_key)):
        t0 = time.perf_counter()
        out = f(r)
        if r:
            times[name].append(time.perf_counter() - t0)
        assert (out == expected).all(), (name, out)
client.wait_at_barrier("bench/end", 600_000)
print("RESULT " + json.dumps({k: statistics.median(v) for k, v in times.items()}), flush=True)
"""


def run(n: int, rounds: int) -> dict:
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    from _bench_common import free_port

    port, children = free_port(), []
    t0 = time.monotonic()
    for i in range(n):
        cmd = [sys.executable, "-c", CHILD, str(port), str(i), str(n), str(rounds)]
        children.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    outputs = [c.communicate(timeout=1800)[0].decode(errors="replace") for c in children]
    medians = []
    for i, (child, out) in enumerate(zip(children, outputs, strict=True)):
        lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
        if child.returncode != 0 or not lines:
            raise RuntimeError(f"process {i} of {n} failed ({child.returncode}):\n{out[-3000:]}")
        medians.append(json.loads(lines[-1][len("RESULT ") :]))
    row = {"processes": n, "wall_s": round(time.monotonic() - t0, 1)}
    for name, requests in (("host_allgather", 4 * n), ("per_key", n * (n + 1))):
        per_process = [m[name] for m in medians]
        row[name] = {
            "median_ms_process_0": round(per_process[0] * 1e3, 3),
            "median_ms_mean_over_processes": round(sum(per_process) / n * 1e3, 3),
            "requests_per_call": requests,
        }
    row["per_key_over_host_allgather"] = round(
        row["per_key"]["median_ms_mean_over_processes"]
        / row["host_allgather"]["median_ms_mean_over_processes"],
        2,
    )
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default="bench_results/store_scale.json")
    args = parser.parse_args(argv)
    from _bench_common import machine_info

    result = {**machine_info(), "command": sys.argv}
    result["rows"] = []
    for n in args.processes:
        row = run(n, args.rounds)
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
    result["load_avg_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
