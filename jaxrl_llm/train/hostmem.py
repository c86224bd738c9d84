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
:func:`heap_bytes_in_use` and :func:`peak_heap_growth` count allocated bytes instead (glibc
``mallinfo2``), which is how the tests measure an update program's peak on CPU against
``jaxrl-llm plan``.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

T = TypeVar("T")


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


#: ``struct mallinfo2`` (glibc >= 2.33, <malloc.h>): ten ``size_t`` fields, in this order.
_MALLINFO2_FIELDS = (
    "arena",  # bytes from sbrk
    "ordblks",
    "smblks",
    "hblks",  # chunks served by mmap
    "hblkhd",  # their bytes
    "usmblks",
    "fsmblks",
    "uordblks",  # bytes in use in the arenas
    "fordblks",
    "keepcost",
)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS]


@functools.cache
def _mallinfo2() -> Callable[[], _Mallinfo2] | None:
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):  # not glibc, or glibc < 2.33
        return None
    fn.restype = _Mallinfo2
    return fn


def heap_bytes_in_use() -> int | None:
    """Bytes the C heap has handed out and not yet freed: glibc ``mallinfo2()``'s
    ``uordblks + hblkhd`` (chunks in use in every arena, plus the chunks served by ``mmap``).

    On XLA:CPU a program's buffers are ``posix_memalign`` allocations, so this counts them
    whether or not their pages were touched (the resident set, :func:`peak_rss_gib`, misses
    untouched pages and keeps freed ones). It counts every allocation of the process (Python's
    objects, other threads, libraries' scratch), malloc's chunk headers (16 bytes each) and the
    page rounding of ``mmap``-served chunks. None where the C library has no ``mallinfo2``
    (musl, macOS, glibc < 2.33).
    """
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        return None
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


def peak_heap_growth(fn: Callable[[], T], *, interval_s: float = 0.0) -> tuple[T, int | None]:
    """Runs ``fn()`` and returns its result with the peak of :func:`heap_bytes_in_use` while
    it ran, less its value just before::

        growth = max over samples of heap_bytes_in_use() − heap_bytes_in_use() before fn

    sampled by a background thread every ``interval_s`` seconds (0: as fast as it can, about
    a microsecond a sample when the GIL is free; a compiled XLA program releases the GIL while
    it runs). Arrays that exist before the call (a program's arguments) are not in the growth;
    an allocation that lives shorter than one sampling period can be missed, so this is a
    lower bound on the true peak. ``fn`` should wait for its work (``jax.block_until_ready``).
    Growth is None where :func:`heap_bytes_in_use` is.
    """
    before = heap_bytes_in_use()
    if before is None:
        return fn(), None
    peak = [before]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            now = heap_bytes_in_use() or 0
            if now > peak[0]:
                peak[0] = now
            if interval_s:
                stop.wait(interval_s)

    sampler = threading.Thread(target=sample, name="peak_heap_growth", daemon=True)
    sampler.start()
    try:
        result: Any = fn()
    finally:
        stop.set()
        sampler.join()
    return result, max(peak[0], heap_bytes_in_use() or 0) - before


#: XLA:CPU's memory-optimised instruction scheduler, for the update programs. XLA:CPU's default
#: scheduler keeps the layer scan's stacked zero gradient buffers (0.5 GiB for SmolLM2-135M in
#: float32) live from before the forward pass; this one schedules them later. On the GRPO
#: benchmark (``scripts/bench_train_step.py``): update temporaries 1.22 -> 1.09 GiB
#: (``jaxrl-llm plan``), peak RSS 3.95 -> 3.84 GiB, the quickstart's 3.75 -> 3.68 GiB, at the
#: same step time on a 2-core AMD EPYC Zen 4 (AVX-512); the quickstart's 3.77 -> 3.68-3.70 GiB,
#: also at the same update time, on a Zen 3 (AVX2) (BENCHMARKS.md, "Packed, token-budget
#: updates").
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
    "heap_bytes_in_use",
    "peak_heap_growth",
    "peak_rss_gib",
    "release_after_compiles",
    "release_free_heap",
    "update_compiler_options",
]
