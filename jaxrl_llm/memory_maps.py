"""Keeping XLA:CPU's compiled programs under Linux's limit on a process's memory mappings.

XLA:CPU loads every compiled program's machine code into the process: each kernel (fusion)
gets its own code, read-only and read-write mappings. A jitted function keeps its programs
until it is deleted or ``jax.clear_caches()`` runs, and the library's programs are
module-level jitted functions, so a process's mappings grow with every *distinct* program it
compiles (a new batch size, ``max_new_tokens``, bucket). Linux refuses new mappings past
``vm.max_map_count`` (65,530 by default), and XLA then aborts the process in its next compile
(``LLVM ERROR: Unable to allocate section memory!``), taking a notebook's kernel with it.

Measured (2-core AMD EPYC Zen 4, jaxlib 0.10.2, default XLA flags; BENCHMARKS.md "Memory
mappings of compiled programs", ``scripts/measure_memory_maps.py``): ~360 mappings per
static-engine program of the test suite's tiny llama, ~150 per paged-engine program of it,
~940 per static and ~390 per paged program (prefill or decode) of SmolLM2-135M. A loop
calling ``rollout.generate`` on the tiny model with ``max_new_tokens`` = 1, 2, 3, ...
aborted at the 176th value. A training run reuses a bounded set of bucketed programs (the
quickstart: 4,300 mappings, flat from its second step).

:func:`relieve` is the guard: when the process holds more than a fraction of the limit it
drops JAX's compiled programs (``jax.clear_caches()``; they are compiled again when next
called) and warns, saying how to raise the limit. :func:`jaxrl_llm.rollout.generate` calls it
on entry, the paged engine before each prefill and decode call (one call of it may compile
dozens of bucketed programs), and the trainer before each step. A computation already
dispatched keeps its program alive until it finishes. Off Linux (no ``/proc``) it does
nothing.
"""

from __future__ import annotations

import functools
import gc
import threading
import warnings

import jax

MAPS_FILE = "/proc/self/maps"
LIMIT_FILE = "/proc/sys/vm/max_map_count"
DEFAULT_FRACTION = 0.75
"""Relieve above this fraction of ``vm.max_map_count``: the rest leaves room for the programs
one more call compiles (a SmolLM2-135M rollout compiles a few, ~1,000 mappings each)."""

_lock = threading.Lock()
_floor = 0  # mappings left after the last clear (those JAX could not release)
_compiles = 0  # programs XLA compiled or loaded in this process (the listeners below)
_looked_at = -1  # the value of _compiles at the last look at /proc/self/maps

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # loaded from the persistent cache


def _count_compile(event: str, *args, **kwargs) -> None:
    global _compiles
    if event in (_COMPILE_EVENT, _CACHE_HIT_EVENT):
        _compiles += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)
jax.monitoring.register_event_listener(_count_compile)


def count() -> int | None:
    """This process's memory mappings (lines of ``/proc/self/maps``); None off Linux."""
    try:
        with open(MAPS_FILE, "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return None


@functools.cache  # the kernel's setting, read once per process
def limit() -> int | None:
    """Linux's ``vm.max_map_count``, the most mappings a process may hold; None off Linux."""
    try:
        with open(LIMIT_FILE) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def relieve(fraction: float = DEFAULT_FRACTION, *, where: str = "jaxrl_llm") -> bool:
    """Drops JAX's compiled programs if this process holds more than ``fraction`` of the
    mappings Linux allows it; returns whether it did.

    Cheap enough to call before every compiled call: it reads ``/proc/self/maps`` only when
    XLA compiled (or loaded from JAX's persistent cache) a program since its last look
    (``jax.monitoring`` listeners count them). After a clear, the mappings JAX could not
    release (other libraries', arrays') set a floor: the next clear waits until the count has
    grown by another ``(1 − fraction)`` of the limit above it, so a process whose mappings are
    not JAX's is warned once, not cleared at every call. ``where`` names the caller in the warning.
    """
    global _floor, _looked_at
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"memory_maps.relieve: fraction must be in (0, 1), got {fraction!r}")
    if _compiles == _looked_at:
        return False  # nothing compiled since the last look: nothing new mapped by XLA
    _looked_at = _compiles
    most = limit()
    if most is None:
        return False
    with _lock:  # one look at a time: threads past the threshold together clear once
        held = count()
        if held is None or held <= max(fraction * most, _floor + (1.0 - fraction) * most):
            return False
        jax.clear_caches()
        gc.collect()
        _floor = after = count() or 0
    warnings.warn(
        f"{where}: this process held {held:,} of the {most:,} memory mappings Linux allows "
        f"(vm.max_map_count), mostly XLA:CPU's compiled programs; a further compile could "
        f"abort the process. JAX's compiled programs were dropped ({after:,} mappings now) "
        f"and are compiled again when next used. To keep them, raise the limit: "
        f"sudo sysctl -w vm.max_map_count=262144 (jaxrl_llm/memory_maps.py).",
        RuntimeWarning,
        stacklevel=2,
    )
    return True


__all__ = ["DEFAULT_FRACTION", "count", "limit", "relieve"]
