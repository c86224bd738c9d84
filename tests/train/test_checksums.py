"""jaxrl_llm.train.checksums against a slow numpy loop: dtypes, layouts, flipped bits, moves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.train import checksums

WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}


def ref_checksum(x: np.ndarray) -> list[int]:
    """The module docstring's formulas, one word at a time with Python integers."""
    x = np.asarray(x)
    flat = x.reshape(-1)
    words = flat.astype(np.uint32) if x.dtype == bool else flat.view(WORD[x.dtype.itemsize])
    plain = weighted = 0
    for i, w in enumerate(words.tolist()):
        plain = (plain + w) % 2**32
        weighted = (weighted + w * (i + 1)) % 2**32
    return [plain, weighted]


def _random(dtype, shape, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    return (rng.standard_normal(shape) * 100).astype(dtype)


DTYPES = [np.float32, jnp.bfloat16, np.float16, np.int32, np.int8, np.uint8, np.uint32, np.bool_]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 3, 4), (0, 4)])
def test_matches_the_loop(dtype, shape):
    x = _random(dtype, shape)
    got = checksums.array_checksum(jnp.asarray(x))
    assert got.dtype == jnp.uint32 and got.shape == (2,)
    assert [int(v) for v in got] == ref_checksum(x)


def test_values_are_full_uint32_sums_without_overflow_errors():
    x = np.full((4, 1000), 0xFFFFFFFF, np.uint32)  # every sum wraps around many times
    assert [int(v) for v in checksums.array_checksum(jnp.asarray(x))] == ref_checksum(x)


def test_eight_byte_dtypes_are_two_words_per_element():
    with jax.enable_x64(True):
        for x in (np.arange(-5, 7, dtype=np.int64) * 3_000_000_007, np.linspace(-1, 1, 9)):
            assert x.dtype.itemsize == 8
            got = checksums.array_checksum(jnp.asarray(x))
            assert [int(v) for v in got] == ref_checksum(x)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int32], ids=str)
@pytest.mark.parametrize(
    "spec", [P("a"), P(None, "a"), P(("a", "b")), P("a", "b"), P("b", ("a", "c")), P()], ids=str
)
def test_sharded_equals_unsharded(dtype, spec):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("a", "b", "c"))
    x = _random(dtype, (8, 12), seed=1)
    sharded = jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))
    assert len(sharded.sharding.device_set) == 8
    expected = ref_checksum(x)
    assert [int(v) for v in checksums.array_checksum(sharded)] == expected
    assert [int(v) for v in checksums.array_checksum(jnp.asarray(x))] == expected


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int8], ids=str)
def test_any_flipped_bit_changes_the_plain_sum(dtype):
    x = _random(dtype, (3, 4), seed=2)
    base = [int(v) for v in checksums.array_checksum(jnp.asarray(x))]
    words = x.reshape(-1).view(WORD[x.dtype.itemsize])
    for element in (0, 5, words.size - 1):
        for bit in range(8 * x.dtype.itemsize):
            flipped = words.copy()
            flipped[element] ^= words.dtype.type(1 << bit)
            y = flipped.view(x.dtype).reshape(x.shape)
            got = [int(v) for v in checksums.array_checksum(jnp.asarray(y))]
            assert got[0] != base[0], (element, bit)
            assert got == ref_checksum(y)


def test_moved_elements_keep_the_plain_sum_and_change_the_weighted_one():
    x = _random(np.float32, (16, 24), seed=3)
    base = ref_checksum(x)
    for moved in (x[[1, 0, *range(2, 16)]], x.T.copy().reshape(x.shape), np.roll(x, 1, axis=1)):
        got = [int(v) for v in checksums.array_checksum(jnp.asarray(moved))]
        assert got[0] == base[0] and got[1] != base[1]


def test_compute_and_find_mismatches():
    arrays = {
        "params/w": jnp.asarray(_random(np.float32, (4, 6))),
        "params/h": jnp.asarray(_random(jnp.bfloat16, (3,))),
        "step": jnp.asarray(7, jnp.int32),
        "keep": jnp.arange(5) % 2 == 0,
        "host": np.arange(3, dtype=np.int32),  # a numpy leaf is moved to the device
    }
    saved = checksums.compute_checksums(arrays)
    assert list(saved) == list(arrays)
    assert saved == {k: ref_checksum(np.asarray(v)) for k, v in arrays.items()}
    assert all(isinstance(v, int) and 0 <= v < 2**32 for s in saved.values() for v in s)
    assert checksums.find_mismatches(arrays, saved) == []
    changed = {**arrays, "step": jnp.asarray(8, jnp.int32)}
    assert checksums.find_mismatches(changed, saved) == ["step"]
    del saved["params/h"]  # e.g. an array added to the state since the save
    assert checksums.find_mismatches(arrays, saved) == ["params/h"]


def test_the_checkpointers_names_and_sums():
    """What ``Checkpointer.save`` writes: the flattened state's paths joined with ``/``."""
    from jaxrl_llm.train.checkpoint import _by_name, flatten_state

    state = {"opt": ({"mu": jnp.ones((2, 3))}, jnp.asarray(1, jnp.int32)), "rng": jnp.arange(2)}
    named = _by_name(flatten_state(state))
    assert list(named) == ["opt/0/mu", "opt/1", "rng"]
    assert checksums.compute_checksums(named)["opt/0/mu"] == ref_checksum(np.ones((2, 3), "f4"))
