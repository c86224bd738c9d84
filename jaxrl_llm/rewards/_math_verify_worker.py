"""The child process behind :mod:`jaxrl_llm.rewards.verify`: math-verify's parse + verify.

Run as a script (``python -P _math_verify_worker.py``), never imported by the trainer, so it loads
only ``math_verify`` (and sympy), not JAX or the trainer. Protocol: JSON lines. It writes
``{"ready": true}`` (or ``{"fatal": "..."}``) once, then for each request
``{"gold": str, "answer": str, "extract": bool}`` one reply ``{"ok": bool}`` or
``{"error": "..."}``. ``extract`` false: ``answer`` is already the bare answer (the contents of a
``\\boxed{}``) and is parsed as LaTeX math; true: math-verify finds the answer in the whole
completion (its default extraction: ``\\boxed{}``, ``$...$``, "the final answer is", plain
expressions). The gold is always a bare answer. math-verify's own signal-based timeouts are off:
the parent enforces the time limit by killing this process.
"""

from __future__ import annotations

import json
import logging
import os
import sys


def _as_math(text: str) -> str:
    return "$" + text.replace("$", " ") + "$"


def main() -> None:
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")  # the protocol channel
    os.dup2(2, 1)  # anything a library prints goes to stderr, not into the protocol
    logging.disable(logging.CRITICAL)  # math-verify warns "timeout is disabled" by design
    try:
        from math_verify import parse, verify
    except Exception as exc:
        out.write(json.dumps({"fatal": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        return
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            gold = parse(_as_math(request["gold"]), parsing_timeout=None)
            answer = request["answer"]
            target = parse(answer if request["extract"] else _as_math(answer), parsing_timeout=None)
            ok = bool(gold and target and verify(gold, target, timeout_seconds=None))
            reply = {"ok": ok}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
