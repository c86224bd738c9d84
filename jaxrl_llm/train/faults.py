"""An opt-in phase log, so fault-injection tests can aim a ``kill -9`` at a named moment.

With ``JAXRL_LLM_PHASE_LOG=FILE`` in the environment, the training loop appends one line
``"<phase> <step> <unix time>"`` to ``FILE`` as it enters each phase of a step:

    start      the state is built or restored (``step`` = steps already done)
    rollout    generation, rewards and the advantage chain of step ``step`` begin
    update     the jitted update of step ``step`` is dispatched
    save       the asynchronous checkpoint of step ``step`` was started and is being written in
               the background

``step`` counts from 1 for the step being computed (the number its metrics and checkpoint
carry). Each line is written with one ``write`` on a freshly opened file, so a reader sees whole
lines, also after the writer is killed. Without the variable the hook costs one dictionary
lookup; nothing else in the package reads or depends on it. ``tests/train/test_faults.py``
watches the file and sends SIGKILL a seeded random delay after a chosen phase begins.
"""

from __future__ import annotations

import os
import time

PHASE_LOG_ENV = "JAXRL_LLM_PHASE_LOG"
PHASES = ("start", "rollout", "update", "save")


def mark_phase(phase: str, step: int) -> None:
    """Appends ``"phase step time"`` to ``$JAXRL_LLM_PHASE_LOG`` when it is set (else nothing)."""
    path = os.environ.get(PHASE_LOG_ENV)
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{phase} {int(step)} {time.time():.6f}\n")


__all__ = ["PHASES", "PHASE_LOG_ENV", "mark_phase"]
