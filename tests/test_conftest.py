"""The suite's own machinery in ``tests/conftest.py``: JAX's caches are dropped at a test
module's end once the process holds 40% of the kernel's memory-mapping limit, a test that
crashes its pytest-xdist worker is run once more (``tests/xdist_crashes.py``), and a fake
device late to a collective does not abort the process before 300 s."""

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import jax

from jaxrl_llm import memory_maps
from tests import conftest


def _item(path: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(path=path)


def test_caches_are_dropped_at_a_module_end_past_the_mapping_threshold(monkeypatch):
    cleared = []
    monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(True))
    monkeypatch.setattr(memory_maps, "limit", lambda: 1000)
    monkeypatch.setattr(memory_maps, "count", lambda: 401)
    conftest.pytest_runtest_teardown(_item("a.py"), _item("a.py"))  # same module: kept
    assert cleared == []
    conftest.pytest_runtest_teardown(_item("a.py"), _item("b.py"))
    conftest.pytest_runtest_teardown(_item("b.py"), None)  # the last test
    assert cleared == [True, True]
    monkeypatch.setattr(memory_maps, "count", lambda: 400)  # at 40%, not past it: kept
    conftest.pytest_runtest_teardown(_item("b.py"), _item("c.py"))
    assert len(cleared) == 2


PYTEST_ARGS = ("-n", "2", "--dist", "worksteal", "-p", "no:cacheprovider")


def _run_python(
    args: list[str], timeout: float, cwd: Path | None = None, **env: str
) -> subprocess.CompletedProcess:
    """This Python on ``args`` in a child with ``env`` added to ours, its output captured."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _run_pytest_n2(tmp_path, body: str) -> subprocess.CompletedProcess:
    """``pytest -n 2 --dist worksteal`` (the suite's scheduler) on one test file in ``tmp_path``
    with this suite's crash hooks."""
    (tmp_path / "conftest.py").write_text("from tests.xdist_crashes import *  # noqa: F403\n")
    (tmp_path / "test_crashing.py").write_text(textwrap.dedent(body))
    args = ["-m", "pytest", *PYTEST_ARGS, str(tmp_path)]
    return _run_python(args, 300, cwd=tmp_path, PYTHONPATH=str(Path(__file__).parents[1]))


CRASHES = """
    import os, pathlib

    def test_fine():
        pass

    def test_crashes():
        marks = pathlib.Path(__file__).parent / "crashes"
        n = int(marks.read_text()) if marks.exists() else 0
        if n < {limit}:
            marks.write_text(str(n + 1))
            os.abort()  # the worker dies as in a segfault
"""


def test_a_test_that_crashes_its_worker_once_is_rerun_and_named(tmp_path):
    run = _run_pytest_n2(tmp_path, CRASHES.format(limit=1))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 passed" in run.stdout and "1 rerun" in run.stdout
    assert "test_crashing.py::test_crashes: crashed 1x (rerun)" in run.stdout


def test_a_test_that_crashes_its_worker_twice_fails(tmp_path):
    run = _run_pytest_n2(tmp_path, CRASHES.format(limit=2))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "1 failed" in run.stdout and "1 passed" in run.stdout
    assert "test_crashing.py::test_crashes: crashed 2x (failed)" in run.stdout


# Eight fake devices meet in XLA:CPU's collective rendezvous; device 0 arrives ``late_s`` late.
LATE_PARTICIPANT = """
import sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
late_s = float(sys.argv[1])
mesh = jax.make_mesh((8,), ("d",))

def late(i):
    if int(i) == 0:
        time.sleep(late_s)
    return np.float32(0)

def body(x):
    delay = jax.experimental.io_callback(
        late, jax.ShapeDtypeStruct((), jnp.float32), jax.lax.axis_index("d"))
    return jax.lax.psum(x + delay, "d")

f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P()))
x = jax.device_put(jnp.ones(8), NamedSharding(mesh, P("d")))
print("sum", float(f(x)[0]))
"""


def _late_participant(flags: str, late_s: float) -> subprocess.CompletedProcess:
    args = ["-c", LATE_PARTICIPANT, str(late_s)]
    return _run_python(args, 120, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")


def test_a_late_fake_device_aborts_only_past_the_suites_rendezvous_timeout():
    """XLA:CPU aborts the process (SIGABRT, the message on stderr) when one participant of a
    collective is later than ``--xla_cpu_collective_call_terminate_timeout_seconds``, checked
    once the warn-stuck timeout has passed. The suite's flags raise the terminate timeout from
    XLA's 40 s to 300 s (tests/conftest.py): with them, the same late device only warns."""
    suite = os.environ["XLA_FLAGS"]  # tests/conftest.py's, unless XLA_FLAGS was set outside
    limit = "--xla_cpu_collective_call_terminate_timeout_seconds=300"
    assert limit in suite.split(), f"XLA_FLAGS={suite!r} lacks {limit}"
    warn_1s = " --xla_cpu_collective_call_warn_stuck_timeout_seconds=1"
    aborted = _late_participant(
        suite + warn_1s + " --xla_cpu_collective_call_terminate_timeout_seconds=2", 4.0
    )
    assert aborted.returncode != 0 and "sum" not in aborted.stdout
    assert "Termination timeout" in aborted.stderr, aborted.stderr[-3000:]
    waited = _late_participant(suite + warn_1s, 4.0)
    assert waited.returncode == 0 and "sum 8.0" in waited.stdout, waited.stderr[-3000:]
    assert "may be stuck" in waited.stderr  # late past the warning, not past the suite's limit
