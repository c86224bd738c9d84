"""Per-array checksums of a checkpoint: two uint32 sums over each array's bits, on device.

Each element is read as unsigned integer words ``w``: its bits zero-extended to uint32 for 1-,
2- and 4-byte types (bool as 0 / 1; bf16 and f16 through uint16, int8 through uint8), and two
uint32 words for 8-byte types (a trailing axis of size 2). With ``i`` the row-major index of a
word in the array of words (0-based) and every sum taken modulo 2**32:

    plain    = Σ_i w_i
    weighted = Σ_i w_i · (i + 1)          (the weight (i + 1) itself modulo 2**32)

An array's checksum is the pair ``[plain, weighted]``. A changed element changes ``plain``
(flipping bit k adds or subtracts 2**k, never 0 modulo 2**32); moving elements keeps ``plain``
and, in general, changes ``weighted``.

Layout independence: integer addition modulo 2**32 is associative and commutative, so the sums
do not depend on the order XLA adds the words in; ``array_checksum`` is computed under ``jit``
where the array lies (each device reduces its shard, then the partial sums are combined), and
gives the same two numbers for any sharding, mesh or number of processes. A checkpoint saved
from one layout is therefore checked when it is restored onto another.

:class:`~jaxrl_llm.train.checkpoint.Checkpointer` stores :func:`compute_checksums` of the state
in the checkpoint's ``meta`` and calls :func:`find_mismatches` after a restore; a non-empty
result is reported as corruption.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import distributed as dist

_WORD_OF_ITEMSIZE = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}


def _as_uint32(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as uint32 (8-byte types gain a trailing axis of two words)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    word = _WORD_OF_ITEMSIZE[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, word).astype(jnp.uint32)


@jax.jit
def array_checksum(x: jax.Array) -> jax.Array:
    """uint32 ``[Σ_i w_i, Σ_i w_i · (i + 1)]`` of one array, both modulo 2**32 (see above).

    One variadic reduction, so XLA fuses the bit cast and the weights into it (no array-sized
    temporary); the index is built from per-axis iotas rather than a reshape, so a sharded
    array is summed where it lies.

    Args:
      x: an array of any shape, dtype and sharding (a numpy array is moved to the device).

    Returns:
      ``uint32[2]``, replicated.
    """
    bits = _as_uint32(x)
    index = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(bits.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= bits.shape[axis]
    zero = jnp.uint32(0)
    total, weighted = jax.lax.reduce(
        (bits, bits * (index + jnp.uint32(1))),
        (zero, zero),
        lambda a, b: (a[0] + b[0], a[1] + b[1]),
        tuple(range(bits.ndim)),
    )
    return jnp.stack([total, weighted])


def compute_checksums(arrays: Mapping[str, jax.typing.ArrayLike]) -> dict[str, list[int]]:
    """``{name: [plain, weighted]}`` (Python ints in [0, 2**32)) of every array, in order.

    One array at a time (no stacked copy of the state). A collective under several processes:
    every process must call it with the same (global) arrays; on CPU each array's program is
    then read before the next is dispatched
    (:func:`~jaxrl_llm.distributed.one_collective_program_at_a_time`).
    """
    serial = dist.one_collective_program_at_a_time()
    sums = []
    for x in arrays.values():
        s = array_checksum(jnp.asarray(x))
        sums.append(np.asarray(dist.wait(s)) if serial else s)  # every local device
    return {name: [int(v) for v in np.asarray(s)] for name, s in zip(arrays, sums, strict=True)}


def find_mismatches(
    arrays: Mapping[str, jax.typing.ArrayLike], saved: Mapping[str, list[int]]
) -> list[str]:
    """The names whose checksum differs from ``saved[name]`` (or is missing from ``saved``).

    ``saved`` is what :func:`compute_checksums` returned at save time, read back from JSON.
    A collective, like :func:`compute_checksums`.
    """
    return [name for name, sums in compute_checksums(arrays).items() if saved.get(name) != sums]


__all__ = ["array_checksum", "compute_checksums", "find_mismatches"]
