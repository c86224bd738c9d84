"""A test whose pytest-xdist worker dies (a segfault, an abort) is run once more, on a fresh
worker, instead of failing the suite at once; a second crash of the same test fails it.

Why: CI (2 cores, ``-n 2``) once lost a worker inside
``tests/train/test_step.py::test_sharded_step_equals_one_device[grpo-groups-split-fsdp]``,
about 6 minutes into the run. A local run reached that point with 13,248 memory mappings (20%
of Linux's limit) and at least 12.6 GB of the machine's memory free, and passed. The same
test later aborted its worker here once (SIGABRT while waiting for the 8-device step's
result; 1 of 3 runs of the ten heaviest in-process test files, 0 of 10 narrower runs). Its
likely cause is XLA:CPU's collective rendezvous timeout, which ``tests/conftest.py`` now
raises; the abort's own message went to pytest's captured stderr and was lost. A rerun is
never silent: the test is reported ``RERUN`` and the run's summary names it with the crash.

Uses pytest-xdist's own ``pytest_handlecrashitem`` hook (controller side); without ``-n``
nothing changes. Loaded by ``tests/conftest.py``.
"""

from __future__ import annotations

import pytest

#: How many times a test is rerun after crashing its worker.
CRASH_RERUNS = 1

_crashes: dict[str, int] = {}  # node id -> crashes so far (on the controller)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    _crashes[crashitem] = _crashes.get(crashitem, 0) + 1
    if _crashes[crashitem] <= CRASH_RERUNS:
        sched.mark_test_pending(crashitem)  # on whichever worker is free next
        report.outcome = "rerun"


def pytest_report_teststatus(report):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None


def pytest_terminal_summary(terminalreporter):
    if _crashes:
        terminalreporter.write_sep("=", "tests that crashed their worker", yellow=True)
        for nodeid, n in _crashes.items():
            verdict = "rerun" if n <= CRASH_RERUNS else "failed"
            terminalreporter.write_line(f"{nodeid}: crashed {n}x ({verdict})")
