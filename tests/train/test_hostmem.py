"""Host memory helpers: the peak-RSS metric and handing freed heap pages back to the OS."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from jaxrl_llm.train import hostmem

# Run in a fresh interpreter: the pages freed and trimmed must be this script's own.
_SCRIPT = """
import json
from jaxrl_llm.train import hostmem

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

blocks = [bytearray(64 * 1024) for _ in range(4000)]  # 250 MiB of heap (not mmap) chunks
keep = blocks[-1]  # the top of the heap stays in use, so free() alone cannot shrink it
allocated = rss_mib()
del blocks
freed = rss_mib()
released = hostmem.release_free_heap()
print(json.dumps({"allocated": allocated, "freed": freed, "trimmed": rss_mib(),
                  "released": released, "peak_gib": hostmem.peak_rss_gib()}))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or hostmem._malloc_trim() is None,
    reason="needs /proc and glibc's malloc_trim",
)
def test_release_free_heap_returns_freed_pages_to_the_os():
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, check=True
    ).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["released"] is True
    assert r["freed"] > r["allocated"] - 50  # freed chunks stay resident without a trim
    assert r["trimmed"] < r["freed"] - 200  # the trim gives (most of) the 250 MiB back
    assert r["peak_gib"] * 1024 >= r["allocated"] - 1  # the high-water mark saw the peak


def test_peak_rss_is_positive_and_never_decreases():
    first = hostmem.peak_rss_gib()
    data = bytearray(64 * 2**20)
    assert first > 0
    assert hostmem.peak_rss_gib() >= first
    del data


def test_release_after_compiles_registers_one_listener(monkeypatch):
    registered = []
    monkeypatch.setattr(
        hostmem.jax.monitoring, "register_event_duration_secs_listener", registered.append
    )
    hostmem.release_after_compiles.cache_clear()
    try:
        hostmem.release_after_compiles()
        hostmem.release_after_compiles()
    finally:
        hostmem.release_after_compiles.cache_clear()
    assert len(registered) == (1 if hostmem._malloc_trim() is not None else 0)
    calls = []
    monkeypatch.setattr(hostmem, "release_free_heap", lambda: calls.append(1))
    hostmem._after_compile("/jax/some/other_event", 0.1)
    hostmem._after_compile(hostmem.BACKEND_COMPILE_EVENT, 0.1)
    assert calls == [1]


def test_jax_still_reports_the_backend_compile_event():
    """The listener keys on jax's event name; a rename in jax would silently disable it."""
    import jax
    import jax.numpy as jnp

    seen = []

    def listener(event, *_, **__):
        seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0)).block_until_ready()  # a fresh compile
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert hostmem.BACKEND_COMPILE_EVENT in seen


def test_update_compiler_options_are_for_cpu_meshes_only():
    import jax
    import numpy as np

    cpu = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("data",))
    assert hostmem.update_compiler_options(cpu) == hostmem.CPU_UPDATE_COMPILER_OPTIONS
    assert hostmem.update_compiler_options(None) == hostmem.CPU_UPDATE_COMPILER_OPTIONS

    class Accelerator:
        platform = "tpu"

    tpu = type("Mesh", (), {"devices": np.array([Accelerator()], dtype=object)})()
    assert hostmem.update_compiler_options(tpu) is None


def test_the_update_programs_are_compiled_with_the_cpu_options(monkeypatch):
    """Both update jits (the RL step's and ``accumulate.jit_step``'s, on a mesh and without)
    hand the options to XLA: an invalid scheduler name makes their compile fail naming it."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxrl_llm.train import accumulate as acc
    from jaxrl_llm.train.step import make_rl_step
    from tests.train import test_step as T

    monkeypatch.setattr(
        hostmem, "CPU_UPDATE_COMPILER_OPTIONS", {"xla_cpu_scheduler_type": "NOT_A_SCHEDULER"}
    )
    setup = T.resolve()
    step = make_rl_step(setup.recipe, setup.models, setup.update)
    with pytest.raises(Exception, match="xla_cpu_scheduler_type"):
        step(T.copy(setup.state), T.make_groups(setup, 0))
    mesh = setup.models.mesh
    on_mesh = {"mesh": mesh, "state_sharding": NamedSharding(mesh, PartitionSpec())}
    for kw in ({}, on_mesh):
        jitted = acc.jit_step(lambda s, b: (s + b, {}), **kw)
        with pytest.raises(Exception, match="xla_cpu_scheduler_type"):
            jitted(jnp.zeros(3), jnp.ones(3))


@pytest.mark.skipif(hostmem.heap_bytes_in_use() is None, reason="needs glibc >= 2.33 (mallinfo2)")
def test_peak_heap_growth_sees_a_buffer_that_is_freed_before_the_call_returns():
    """A 64 MiB buffer allocated and freed inside the call (never touched, so no resident
    page) is in the peak growth; one that existed before the call is not."""
    import numpy as np

    before = np.empty(16 * 2**20, np.uint8)  # exists before: not growth

    def allocate_and_free():
        buffer = np.empty(64 * 2**20, np.uint8)  # malloc'ed, pages never touched
        time.sleep(0.05)  # the sampler runs while it lives
        del buffer
        return "done"

    result, growth = hostmem.peak_heap_growth(allocate_and_free)
    assert result == "done"
    assert 64 * 2**20 <= growth < 64 * 2**20 + 8 * 2**20, growth
    del before
