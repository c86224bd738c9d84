"""Debugging aid: logs the programs with collectives that a multi-process JAX run dispatches,
and every dispatch made while an earlier such program is still running on a local device.

XLA:CPU runs programs that do not depend on each other concurrently, and gloo matches the
collectives of two processes by their order alone, so two programs with collectives in flight
at once on one process can abort a run ("op.preamble.length <= op.nbytes ... distributed
collective mismatch") or hang it, rarely. This finds such pairs whether or not the run fails.

Use: put this folder first on ``PYTHONPATH`` and name a folder for the logs::

    TRACE_DIR=/tmp/trace PYTHONPATH=scripts/collective_trace:$PWD \\
        python -m pytest -n 2 tests/train/test_async.py -k process
    python scripts/collective_trace/summary.py /tmp/trace

(Python imports the first ``sitecustomize`` on its path, so this one replaces any other for
the run.) Every process that imports ``jaxrl_llm.distributed`` (the test's children; not
pytest's own processes) writes ``TRACE_DIR/trace.PID.log``:

- ``PROGRAM name sha=... collectives=N`` once per compiled program with collectives, and its
  collective instructions from the compiled HLO (shapes, replica groups);
- one line per dispatch of such a program: time, a counter, the name, its devices, the thread
  and the caller (the last frames of the stack);
- ``OVERLAP #n name while in flight: [...]`` when an earlier logged program's outputs were not
  yet ready on every local device at that dispatch (a false alarm only if the new program
  consumes those outputs: XLA orders that);
- ``PROCESS_ALLGATHER caller`` for each ``multihost_utils.process_allgather`` (and so
  ``assert_equal``, and ``jax.device_put`` of a host value onto a sharding over every
  process), which reads its first local device's rows without waiting for the others.

"Cross-process" means devices of more than one process; ``TRACE_ALL_DEVICES=1`` logs every
program over more than one device instead (a single process with fake CPU devices, as in the
test of this script). To see every call, JAX's C++ fast path for jitted calls is switched off
(``pjit._get_fastpath_data``), so dispatch is slower. Patches private JAX internals
(``pxla.ExecuteReplicated.__call__``; written against jax 0.10): a debugging tool, not part of
the library.
"""

import importlib.abc
import os
import re
import sys
import threading
import time
import traceback

_COLLECTIVE = re.compile(
    r"= .*\b(all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter)(-start)?\("
)


def _caller(limit: int = 60, keep: int = 8) -> str:
    """The innermost ``keep`` frames of the stack outside JAX's internals, innermost first."""
    frames = traceback.extract_stack(limit=limit)[:-2]
    names = []
    for f in frames:
        path = f.filename.split("site-packages/")[-1].split("jaxrl_llm/")[-1]
        if not path.startswith("jax/_src/"):
            names.append(f"{path}:{f.lineno}:{f.name}")
    return " <- ".join(reversed(names[-keep:]))


def install(trace_dir: str) -> None:
    import jax
    from jax._src import pjit
    from jax._src.interpreters import pxla
    from jax.experimental import multihost_utils

    every = os.environ.get("TRACE_ALL_DEVICES") == "1"
    log = open(os.path.join(trace_dir, f"trace.{os.getpid()}.log"), "w", buffering=1)  # noqa: SIM115
    lock = threading.Lock()
    collectives: dict[int, int] = {}  # id(executable) -> number of collective instructions
    in_flight: list[tuple[int, str, list]] = []
    count = [0]

    pjit._get_fastpath_data = lambda *args, **kwargs: None
    execute = pxla.ExecuteReplicated.__call__

    def devices_of(self) -> list:
        for sharding in getattr(self.in_handler, "in_shardings", ()):
            return list(sharding._device_assignment)
        return []

    def logged(self) -> bool:
        devices = devices_of(self)
        me = jax.process_index()
        spans = len(devices) > 1 if every else any(d.process_index != me for d in devices)
        if not spans:
            return False
        key = id(self.xla_executable)
        if key not in collectives:
            text = "\n".join(m.to_string() for m in self.xla_executable.hlo_modules())
            lines = [ln.strip()[:200] for ln in text.splitlines() if _COLLECTIVE.search(ln)]
            collectives[key] = len(lines)
            if lines:
                log.write(f"PROGRAM {self.name} collectives={len(lines)}\n")
                log.write("".join(f"    {ln}\n" for ln in lines[:40]))
        return collectives[key] > 0

    def ready(outputs: list) -> bool:
        return all(x.is_ready() for x in outputs)

    def call(self, *args):
        if not logged(self):
            return execute(self, *args)
        with lock:
            count[0] += 1
            n = count[0]
            busy = [(m, name) for m, name, outs in in_flight if not ready(outs)]
            in_flight[:] = [e for e in in_flight if not ready(e[2])]
        devices = [d.id for d in devices_of(self)]
        thread = threading.current_thread().name
        log.write(f"{time.time():.4f} #{n} {self.name} devices={devices} thread={thread} ")
        log.write(f"caller={_caller()}\n")
        if busy:
            log.write(f"OVERLAP #{n} {self.name} while in flight: {busy}\n")
        out = execute(self, *args)
        arrays = [x for x in jax.tree.leaves(out) if isinstance(x, jax.Array)]
        with lock:
            in_flight.append((n, self.name, arrays))
        return out

    pxla.ExecuteReplicated.__call__ = call
    allgather = multihost_utils.process_allgather

    def process_allgather(*args, **kwargs):
        if jax.process_count() > 1:
            log.write(f"PROCESS_ALLGATHER caller={_caller()}\n")
        return allgather(*args, **kwargs)

    multihost_utils.process_allgather = process_allgather


class _OnDistributedImport(importlib.abc.MetaPathFinder):
    """Installs the logging when ``jaxrl_llm.distributed`` is first imported (jax is loaded
    by then), in processes that are not pytest's own."""

    def find_spec(self, name, path, target=None):
        if name == "jaxrl_llm.distributed":
            sys.meta_path.remove(self)
            if "pytest" not in sys.modules or os.environ.get("TRACE_ALL_DEVICES") == "1":
                install(os.environ["TRACE_DIR"])
        return None


if os.environ.get("TRACE_DIR"):
    sys.meta_path.insert(0, _OnDistributedImport())
