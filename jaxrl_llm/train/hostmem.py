"""Host memory of the training process: its peak RSS, and freed heap handed back to the OS.

On CPU every buffer XLA allocates is host memory, and the largest allocation of an RL step is
the update's scratch (about 1 GiB for SmolLM2-135M at 32 x 128 tokens, fp32), made afresh at
each call. Pages that smaller allocations freed before it (the rollout's decode buffers,
host-side reward work, LLVM's working memory while compiling) stay inside the process under
glibc's allocator unless it is asked to return them, and then add to that peak.
:func:`release_free_heap` asks (glibc ``malloc_trim(0)``): the trainer calls it before every
rollout, update and checkpoint and, through a ``jax.monitoring`` listener, after every XLA
compilation.
On the SmolLM2 GRPO benchmark (``scripts/bench_train_step.py``) this lowers the peak RSS of the
training steps by about 0.2 GiB; it does nothing on an accelerator's memory, and nothing where
the C library has no ``malloc_trim`` (macOS, musl).

:func:`peak_rss_gib` is the process's high-water mark, logged as ``perf/peak_rss_gib``.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None


def release_free_heap() -> bool:
    """Returns the C heap's free pages to the OS; ``False`` where that is not possible."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def peak_rss_gib() -> float:
    """This process's peak resident set size so far (``ru_maxrss``) in GiB; 0.0 if unknown."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20  # bytes / KiB


#: XLA:CPU's memory-optimised instruction scheduler, for the update programs. XLA:CPU's default
#: scheduler keeps the layer scan's stacked zero gradient buffers (0.5 GiB for SmolLM2-135M in
#: float32) live from before the forward pass; this one schedules them later. On the GRPO
#: benchmark (``scripts/bench_train_step.py``): update temporaries 1.22 -> 1.09 GiB
#: (``jaxrl-llm plan``), peak RSS 3.95 -> 3.84 GiB, the quickstart's 3.75 -> 3.68 GiB, at the
#: same step time (BENCHMARKS.md, "Packed, token-budget updates").
CPU_UPDATE_COMPILER_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def update_compiler_options(mesh: jax.sharding.Mesh | None) -> dict[str, str] | None:
    """``jax.jit(compiler_options=...)`` for an update program on ``mesh`` (None: the default
    device): :data:`CPU_UPDATE_COMPILER_OPTIONS` where its devices are CPUs, where device
    memory is host memory; None elsewhere (GPU and TPU schedulers are left as XLA sets them)."""
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    return dict(CPU_UPDATE_COMPILER_OPTIONS) if device.platform == "cpu" else None


def _after_compile(event: str, duration_secs: float, **_) -> None:
    if event == BACKEND_COMPILE_EVENT:
        release_free_heap()


@functools.cache
def release_after_compiles() -> None:
    """Registers, once per process, a listener that releases free heap after each compilation."""
    if _malloc_trim() is not None:
        jax.monitoring.register_event_duration_secs_listener(_after_compile)


__all__ = [
    "CPU_UPDATE_COMPILER_OPTIONS",
    "peak_rss_gib",
    "release_after_compiles",
    "release_free_heap",
    "update_compiler_options",
]
