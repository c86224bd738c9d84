"""jaxrl_llm.memory_maps: XLA:CPU's compiled programs kept under Linux's vm.max_map_count."""

import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import memory_maps, rollout

pytestmark = pytest.mark.skipif(
    memory_maps.count() is None or memory_maps.limit() is None, reason="needs Linux's /proc"
)


@pytest.fixture(autouse=True)
def fresh_floor(monkeypatch):
    monkeypatch.setattr(memory_maps, "_floor", 0)
    monkeypatch.setattr(memory_maps, "_looked_at", -1)  # as if something was just compiled


def _compile_programs(n: int) -> list:
    """n distinct programs, kept alive by their jitted functions (as module-level ones are)."""
    fns = []
    for i in range(n):
        f = jax.jit(lambda x, i=i: jnp.tanh(x * (i + 1)).sum() + jnp.cumsum(x)[-1])
        f(jnp.ones(i + 3)).block_until_ready()
        fns.append(f)
    return fns


def test_count_and_limit_read_proc():
    with open("/proc/self/maps", "rb") as f:
        lines = f.read().count(b"\n")
    assert abs(memory_maps.count() - lines) < 200  # the two reads a moment apart
    with open("/proc/sys/vm/max_map_count") as f:
        assert memory_maps.limit() == int(f.read())


def test_nothing_happens_below_the_threshold(monkeypatch):
    cleared = []
    monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(1))
    monkeypatch.setattr(memory_maps, "limit", lambda: 10 * memory_maps.count())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert memory_maps.relieve() is False
    assert not cleared


def test_past_the_threshold_the_compiled_programs_are_released(monkeypatch):
    """The mappings really go: programs compiled, the limit set just under the count, the
    clear gives them back, and the warning names the numbers and the fix."""
    fns = _compile_programs(40)
    held = memory_maps.count()
    monkeypatch.setattr(memory_maps, "limit", lambda: int(held / 0.8))  # 80% held: over 75%
    with pytest.warns(RuntimeWarning, match=r"(?s)test caller: .*vm\.max_map_count.*sysctl"):
        assert memory_maps.relieve(where="test caller") is True
    # The jitted functions still work: their programs are compiled again on the next call.
    del fns
    after = memory_maps.count()
    assert after < held - 40 * 3, (held, after)
    assert memory_maps._floor == pytest.approx(after, abs=50)


def test_a_process_whose_mappings_are_not_jaxs_is_warned_once(monkeypatch):
    """After a clear that left the count high, the next clear waits for more growth."""
    cleared = []
    monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(1))
    held = memory_maps.count()
    monkeypatch.setattr(memory_maps, "limit", lambda: int(held / 0.8))  # 80% held: over 75%
    with pytest.warns(RuntimeWarning):
        assert memory_maps.relieve() is True
    monkeypatch.setattr(memory_maps, "_looked_at", -1)  # (past the no-compile shortcut)
    assert memory_maps.relieve() is False  # nothing released: the floor is where we are
    assert len(cleared) == 1
    monkeypatch.setattr(memory_maps, "_floor", held - int(0.5 * held / 0.8))
    monkeypatch.setattr(memory_maps, "_looked_at", -1)
    with pytest.warns(RuntimeWarning):
        assert memory_maps.relieve() is True  # grown by more than a quarter of the limit
    assert len(cleared) == 2


def test_maps_are_read_only_after_a_compile(monkeypatch):
    """Cheap before every compiled call: /proc/self/maps is read again only once XLA has
    compiled something since the last look."""
    reads = []
    real = memory_maps.count
    monkeypatch.setattr(memory_maps, "count", lambda: reads.append(1) or real())
    memory_maps.relieve()
    assert len(reads) == 1
    memory_maps.relieve()
    jax.jit(lambda x: x - 7.0)(jnp.ones(5)).block_until_ready()  # a new program
    assert len(reads) == 1  # the second call had nothing new to look at
    memory_maps.relieve()
    assert len(reads) == 2


def test_programs_loaded_from_the_persistent_cache_count_as_compiles():
    """A persistent-cache hit maps a program too: JAX's event for it (jax/_src/compiler.py)
    is counted like a backend compile."""
    before = memory_maps._compiles
    jax.monitoring.record_event("/jax/compilation_cache/cache_hits")
    assert memory_maps._compiles == before + 1
    jax.monitoring.record_event("/jax/compilation_cache/compile_requests_use_cache")
    assert memory_maps._compiles == before + 1


def test_the_paged_engine_looks_before_its_prefill_and_decode_calls(monkeypatch):
    """One paged call compiles a program per bucket it meets: the guard runs inside it too."""
    from jaxrl_llm.rollout import paged
    from tests.models import hf_tiny
    from tests.train import helpers as H

    where = []
    real = memory_maps.relieve
    monkeypatch.setattr(memory_maps, "relieve", lambda **kw: where.append(kw["where"]) or real())
    ids, mask = hf_tiny.left_padded_batch(np.random.RandomState(2), [7, 2, 5], 7, H.VOCAB)
    options = paged.PagedOptions(page_size=4, num_slots=2, steps_per_dispatch=2, prefill_chunk=4)
    rollout.generate(
        H.tiny_lm(0), ids, mask, rng=jax.random.key(0), max_new_tokens=5, engine="paged",
        paged_options=options, stop_token_ids=(),
    )  # fmt: skip
    assert where[0] == "rollout.generate"
    assert where.count("rollout.generate (paged prefill)") >= 3  # 3 prompts, 2 slots, chunks
    assert where.count("rollout.generate (paged decode)") >= 3


def test_bad_fraction_is_a_clear_error():
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\), got 1\.5"):
        memory_maps.relieve(1.5)


def test_generate_relieves_before_it_compiles(monkeypatch):
    """A process near the limit: generate drops the old programs, warns, and samples as
    before (greedy tokens equal those of a call under no pressure)."""
    from tests.models import hf_tiny
    from tests.train import helpers as H

    model = H.tiny_lm(0)
    ids, mask = hf_tiny.left_padded_batch(np.random.RandomState(1), [5, 3], 5, H.VOCAB)
    kw = dict(rng=jax.random.key(0), max_new_tokens=4, temperature=0.0, stop_token_ids=())
    calm = rollout.generate(model, ids, mask, **kw)
    held = memory_maps.count()
    monkeypatch.setattr(memory_maps, "limit", lambda: int(held / 0.9))
    with pytest.warns(RuntimeWarning, match="rollout.generate: this process held"):
        pressed = rollout.generate(model, ids, mask, **kw)
    np.testing.assert_array_equal(np.asarray(calm.tokens), np.asarray(pressed.tokens))
    assert memory_maps._floor > 0


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
def test_off_linux_it_does_nothing(monkeypatch):
    monkeypatch.setattr(memory_maps, "MAPS_FILE", "/nonexistent/maps")
    assert memory_maps.count() is None
    assert memory_maps.relieve() is False
