"""``scripts/collective_trace``: the dispatch log finds two programs with collectives in flight
at once, and only then (one process, 4 fake CPU devices, ``TRACE_ALL_DEVICES=1``)."""

import os
import subprocess
import sys

from tests.scripts import SCRIPTS, load_script

CHILD = """\
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxrl_llm.distributed  # noqa: F401  (installs the logging)

mesh = jax.make_mesh((4,), ("d",))
x = jax.device_put(np.full((4, 256, 256), 1e-3, np.float32), NamedSharding(mesh, P("d")))


@jax.jit
def heavy(x):  # some work on each device, then an all-reduce over the four
    y = jax.lax.fori_loop(0, 40, lambda i, y: jnp.tanh(y @ y), x)
    return jnp.sum(y)


heavy(x).block_until_ready()  # compiled
a = heavy(x)
b = heavy(x)  # dispatched while `a` still runs: logged as an overlap
jax.block_until_ready((a, b))
c = heavy(x).block_until_ready()
d = heavy(x)  # after `c` finished: not an overlap
d.block_until_ready()
print("done", flush=True)
"""


PATH = os.environ.get("PYTHONPATH", "")


def test_the_log_finds_two_collective_programs_in_flight_at_once(tmp_path):
    env = {
        **os.environ,
        "TRACE_DIR": str(tmp_path),
        "TRACE_ALL_DEVICES": "1",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(SCRIPTS / "collective_trace"), str(SCRIPTS.parent), PATH])
        ),
    }
    run = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and "done" in run.stdout, run.stderr[-3000:]
    summary = load_script("collective_trace/summary")
    out = summary.main([str(tmp_path), "--json", str(tmp_path / "summary.json")])
    (log,) = tmp_path.glob("trace.*.log")
    text = log.read_text()
    assert "PROGRAM jit(heavy) collectives=1\n" in text and "all-reduce(" in text, text
    assert out["dispatches"] == 5 and out["process_allgather"] == 0, out
    assert out["overlaps"] == 1, text
    ((site, n),) = out["overlaps_by_site"]
    assert n == 1 and site.startswith("jit(heavy) beside jit(heavy) | "), site
    assert (tmp_path / "summary.json").exists()
