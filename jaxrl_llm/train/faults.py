"""Preemption (SIGTERM / SIGINT stop a run cleanly) and an opt-in phase log for fault tests.

Preemption. While the loop runs, :class:`StopSignals` catches SIGTERM (what SLURM, Kubernetes and
spot VMs send before they kill) and SIGINT (Ctrl-C): the step being computed finishes (a jitted
step cannot be cut short, and a finished step keeps the resume exact), its checkpoint is saved
(unless this step was already saved) and written to disk, and :class:`TrainingInterrupted` says
so; ``jaxrl-llm train`` prints its message and exits with ``128 + signal``: **143** after SIGTERM,
**130** after SIGINT (what a shell reports for a process the signal killed, so schedulers read it
as "terminated"). Rerunning the same command resumes and computes what the uninterrupted run
would have. A second Ctrl-C stops at once without saving (``KeyboardInterrupt``; the newest
complete checkpoint is kept); a second SIGTERM is ignored. The grace period of the scheduler
(SLURM's ``KillWait``, Kubernetes' ``terminationGracePeriodSeconds``) must cover one step and one
save. With several processes each step ends with all processes agreeing whether any was
signalled (one small all-gather), so they stop after the same step.

Phase log.

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
import signal
import threading
import time
from types import FrameType

PHASE_LOG_ENV = "JAXRL_LLM_PHASE_LOG"
PHASES = ("start", "rollout", "update", "save")


def mark_phase(phase: str, step: int) -> None:
    """Appends ``"phase step time"`` to ``$JAXRL_LLM_PHASE_LOG`` when it is set (else nothing)."""
    path = os.environ.get(PHASE_LOG_ENV)
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{phase} {int(step)} {time.time():.6f}\n")


class NonFiniteUpdateError(FloatingPointError):
    """A step's loss or gradient was NaN / inf with ``train.on_nonfinite: raise``; nothing of
    the step was written (no metrics line, no checkpoint, ``config.yaml`` untouched)."""


class TrainingInterrupted(Exception):
    """The run stopped on a signal after saving its checkpoint; ``exit_status`` is
    ``128 + signum`` (143 SIGTERM, 130 SIGINT)."""

    def __init__(self, message: str, *, signum: int, step: int):
        super().__init__(message)
        self.signum, self.step = signum, step
        self.exit_status = 128 + signum


class StopSignals:
    """While entered (in the main thread), SIGTERM and SIGINT request a stop instead of ending
    the process: :attr:`signum` is set, one line is printed, and the loop stops after its step
    (see the module docstring). A second SIGINT raises ``KeyboardInterrupt``. Elsewhere than the
    main thread, or outside the ``with``, the signals keep their handlers."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        name = signal.Signals(signum).name
        if self.signum is not None:
            if signum == signal.SIGINT:
                os.write(2, b"\nsecond Ctrl-C: stopping now, without saving this step\n")
                raise KeyboardInterrupt
            return
        self.signum = signum
        again = " (Ctrl-C again stops at once, without saving)" if signum == signal.SIGINT else ""
        os.write(2, f"\n{name}: finishing this step, then saving a checkpoint{again}\n".encode())

    def install(self) -> None:
        """Catches the signals (in the main thread; elsewhere nothing)."""
        if threading.current_thread() is threading.main_thread() and not self._previous:
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)

    def uninstall(self) -> None:
        """Gives the signals their previous handlers back."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def __enter__(self) -> StopSignals:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


__all__ = [
    "PHASES",
    "PHASE_LOG_ENV",
    "NonFiniteUpdateError",
    "StopSignals",
    "TrainingInterrupted",
    "mark_phase",
]
