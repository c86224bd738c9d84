"""Symbolic answer checking with Hugging Face's ``math-verify``, under a hard per-answer time limit.

math-verify parses LaTeX (and plain expressions) into sympy and compares the results
(``1/2`` = ``0.5`` = ``\\frac{1}{2}``, intervals, sets, ``x = 3`` vs ``3``, units in ``\\text{}``
dropped). sympy can take unbounded time on a pathological expression, and math-verify's own
timeouts use ``signal.alarm``, which works only in the main thread (it raises ``ValueError``
elsewhere) and only with whole seconds. So here the work runs in a separate, long-lived worker
process (``_math_verify_worker.py``, started with ``sys.executable``; it imports math-verify but
not JAX) and the caller waits at most ``timeout`` seconds for each answer: on a timeout the
worker is killed and a fresh one is started for the next answer. This works from any thread
(calls are serialised by a lock), and the worker is not forked from the (multi-threaded) JAX
process. A timeout raises :class:`VerificationTimeout`; the rewards score that answer
``incorrect`` and count it as an error.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

_WORKER = Path(__file__).with_name("_math_verify_worker.py")
#: Seconds a fresh worker may take to import math-verify and sympy (not part of any answer's time).
STARTUP_TIMEOUT = 120.0


class VerificationTimeout(TimeoutError):
    """One answer took longer than the time limit to parse and verify."""


class VerifierError(RuntimeError):
    """The worker could not start (math-verify missing?) or died while verifying."""


class MathVerifier:
    """A math-verify worker process; :meth:`verify` checks one answer against its gold.

    The process starts on the first call and is restarted after a timeout or a crash.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._pid = os.getpid()
        self._buffer = b""
        atexit.register(self.close)

    def _start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._proc = subprocess.Popen(
            [sys.executable, "-P", str(_WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._buffer = b""
        reply = self._read_line(STARTUP_TIMEOUT)
        if reply is None or "fatal" in reply or not reply.get("ready"):
            why = "did not start in time" if reply is None else reply.get("fatal", reply)
            self._kill()
            raise VerifierError(
                f"the math-verify worker {why}; is math-verify installed (pip install math-verify)?"
            )

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc is not None:
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()

    def close(self) -> None:
        """Stops the worker (a later call starts a new one)."""
        with self._lock:
            if os.getpid() == self._pid:
                self._kill()

    def _read_line(self, timeout: float) -> dict | None:
        """The worker's next JSON reply, or ``None`` after ``timeout`` seconds."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise VerifierError(f"the math-verify worker exited (code {self._proc.wait()})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def verify(self, gold: str, answer: str, *, extract: bool, timeout: float) -> bool:
        """Whether ``answer`` equals ``gold`` (math-verify's comparison; gold first).

        Args:
          gold: the bare expected answer (LaTeX or plain, without ``$``).
          answer: the bare answer (``extract=False``, e.g. a ``\\boxed{}``'s contents) or a whole
            completion to find the answer in (``extract=True``, math-verify's extraction).
          timeout: seconds for parsing both and comparing them.

        Raises:
          VerificationTimeout: it took longer than ``timeout`` (the worker is restarted).
          VerifierError: the worker could not start or died.
        """
        request = json.dumps({"gold": gold, "answer": answer, "extract": extract}) + "\n"
        with self._lock:
            if os.getpid() != self._pid:  # forked: the parent's worker is not ours
                self._proc, self._pid, self._buffer = None, os.getpid(), b""
            if self._proc is None or self._proc.poll() is not None:
                self._kill()
                self._start()
            assert self._proc is not None and self._proc.stdin is not None
            try:
                self._proc.stdin.write(request.encode("utf-8"))
                self._proc.stdin.flush()
                reply = self._read_line(timeout)
            except (OSError, VerifierError) as exc:
                self._kill()
                raise VerifierError(f"the math-verify worker failed: {exc}") from exc
            if reply is None:
                self._kill()
                raise VerificationTimeout(f"math-verify took more than {timeout:g}s")
        if "error" in reply:
            raise VerifierError(f"math-verify failed: {reply['error']}")
        return bool(reply["ok"])


_SHARED: MathVerifier | None = None
_SHARED_LOCK = threading.Lock()


def shared_verifier() -> MathVerifier:
    """The process-wide :class:`MathVerifier` every math-verify reward uses."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = MathVerifier()
        return _SHARED
