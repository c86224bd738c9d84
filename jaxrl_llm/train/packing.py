"""Sequence packing: variable-length sequences into a few fixed-shape rows, and back.

The update and its forward passes (π_old, π_ref, V) otherwise run on ``[N, L]`` rows, L = P + T
padded to the longest prompt and the longest completion; RL completions are heavy-tailed, so
most of those FLOPs are padding. Packing puts the *real* tokens of each sequence (its prompt and
completion tokens, in order) contiguously into rows of width W, several sequences per row, each
with its own segment id (attention never crosses segments) and its own positions 0, 1, … (so a
packed sequence sees exactly the tokens and positions it sees unpacked). This is verl's
``use_remove_padding`` + ``use_dynamic_bsz`` and OpenRLHF's ``packing_samples``.

The plan (:func:`make_plan`) is computed **on the host**, after generation, from the sequence
lengths only: first-fit-decreasing bin packing is a sequential greedy loop (cheap in NumPy, awkward
on an accelerator), the host already holds the rollout's masks (``collect.py`` reads the tokens
to score them), and the plan's output is small: three ``int32[N]`` placements and an
``int32[M]`` micro-batch count go to the device, never a token or a ``[R, W]`` array. The device
builds the packed tokens, segment ids and positions from them by one scatter
(:func:`pack_rows`) and reads per-token outputs back to the ``[N, T]`` completion layout by one
gather (:func:`unpack_index`), so the advantage chain still sees ``[B, G, T]``.

Layout. The N sequences are first split into M minibatches exactly as the unpacked update
splits them (strided: minibatch j holds sequences ``{i·M + j}``). Each minibatch's sequences are
packed first-fit-decreasing into rows of width W, and its rows grouped, in order, into
micro-batches of ``rows_per_micro`` rows. The packed buffer is ``[M·K, rows_per_micro, W]``
(slot ``j·K + k`` is micro-batch k of minibatch j); minibatch j uses its first ``count[j] ≤ K``
slots, the rest are empty (segment id 0 everywhere) and are never computed (the loops over them
have a traced trip count).

Buckets (so that steady state does not recompile): W is the sequence-length bucket of the
longest sequence, capped at L (never wider than the unpacked row); K (the micro-batch slots per
minibatch) and, without a token budget, the rows of the single micro-batch are bucketed too.
The buckets are ``{2^k, 3·2^(k−1)}`` (1, 2, 3, 4, 6, 8, 12, 16, 24, …): at most 1.5x slack, and
few shapes. With a token budget B per device (``optim.micro_batch_tokens``, like verl's
``ppo_max_token_len_per_gpu``), a micro-batch is ``floor(B / W)`` rows per device (times the
data-parallel size D), so each device's memory is bounded by tokens and the number of
micro-batches follows the real tokens of each minibatch.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


def bucket(n: int, *, minimum: int = 1) -> int:
    """The smallest of ``{2^k, 3·2^(k−1)}`` (1, 2, 3, 4, 6, 8, 12, 16, …) that is ≥ ``max(n,
    minimum)``."""
    n = max(int(n), int(minimum), 1)
    p = 1 << (n - 1).bit_length()  # the power of two ≥ n
    three = 3 * p // 4
    return three if p >= 4 and three >= n else p


def first_fit_decreasing(lengths: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Bin-pack sequences of ``lengths`` into rows of ``width`` tokens (first-fit decreasing).

    Sequences are placed longest first (ties by index, so the plan is deterministic) into the
    first row with room, a new row when none has. FFD uses at most 11/9·OPT + 6/9 rows (Dósa
    2007). Returns ``(row_n, offset_n)``: the row of each sequence and its first column; rows are
    numbered in order of creation. Empty sequences (length 0) go to row 0 at its end, taking no
    room.

    Raises:
      ValueError: a sequence is longer than ``width``.
    """
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and lengths.max() > width:
        raise ValueError(
            f"first_fit_decreasing: a sequence of {int(lengths.max())} tokens does not fit a row "
            f"of {width}"
        )
    order = np.lexsort((np.arange(lengths.size), -lengths))
    used: list[int] = []
    row_n = np.zeros(lengths.size, np.int32)
    offset_n = np.zeros(lengths.size, np.int32)
    for i in order:
        need = int(lengths[i])
        if need == 0:
            continue
        r = next((r for r, fill in enumerate(used) if fill + need <= width), len(used))
        if r == len(used):
            used.append(0)
        row_n[i], offset_n[i] = r, used[r]
        used[r] += need
    for i in np.flatnonzero(lengths == 0):
        row_n[i], offset_n[i] = 0, used[0] if used else 0
    return row_n, offset_n


@dataclasses.dataclass(frozen=True)
class PackShape:
    """The static shape of a packed batch (one compiled program per distinct value).

    Attributes:
      num_minibatches: M.
      slots: K, micro-batch slots per minibatch (bucketed).
      rows: rows per micro-batch.
      width: W, tokens per row (bucketed, ≤ L).
    """

    num_minibatches: int
    slots: int
    rows: int
    width: int

    @property
    def num_micro(self) -> int:
        """M·K, the micro-batch slots of the whole batch."""
        return self.num_minibatches * self.slots


class PackPlan:
    """Where each sequence goes (host arrays; ``int32``): see the module docstring.

    Attributes:
      shape: the static :class:`PackShape`.
      micro_n: ``int32[N]`` the flat micro-batch slot ``j·K + k`` of sequence n.
      row_n: ``int32[N]`` its row in that micro-batch.
      offset_n: ``int32[N]`` its first column in that row.
      count_m: ``int32[M]`` micro-batches used by each minibatch (≥ 1).
      lengths_n: ``int[N]`` real tokens of each sequence (host only; for statistics).
    """

    def __init__(
        self,
        shape: PackShape,
        micro_n: np.ndarray,
        row_n: np.ndarray,
        offset_n: np.ndarray,
        count_m: np.ndarray,
        lengths_n: np.ndarray,
    ) -> None:
        self.shape = shape
        self.micro_n, self.row_n, self.offset_n = micro_n, row_n, offset_n
        self.count_m, self.lengths_n = count_m, lengths_n

    def device_arrays(self) -> PlanArrays:
        """The arrays the device step takes (the only host → device transfer of packing)."""
        return PlanArrays(self.micro_n, self.row_n, self.offset_n, self.count_m)

    def padding_fraction(self) -> float:
        """Fraction of the packed slots ``M·K·rows·W`` *used by minibatches* that hold padding."""
        s = self.shape
        used = int(self.count_m.sum()) * s.rows * s.width
        return 1.0 - float(self.lengths_n.sum()) / max(used, 1)


class PlanArrays(tuple):
    """``(micro_n, row_n, offset_n, count_m)``: a plain pytree (a tuple) of int32 arrays."""

    __slots__ = ()

    def __new__(cls, micro_n, row_n, offset_n, count_m) -> PlanArrays:  # noqa: ANN001
        return super().__new__(cls, (micro_n, row_n, offset_n, count_m))

    micro_n = property(lambda self: self[0])
    row_n = property(lambda self: self[1])
    offset_n = property(lambda self: self[2])
    count_m = property(lambda self: self[3])


jax.tree_util.register_pytree_node(
    PlanArrays, lambda p: (tuple(p), None), lambda _, xs: PlanArrays(*xs)
)


def make_plan(
    lengths_n: np.ndarray,
    *,
    max_len: int,
    num_minibatches: int = 1,
    micro_batch_tokens: int | None = None,
    row_multiple: int = 1,
) -> PackPlan:
    """The packing plan of N sequences of ``lengths_n`` real tokens (host, NumPy).

    Args:
      lengths_n: real tokens (prompt + completion) of each sequence.
      max_len: L, the unpacked row width; W never exceeds it.
      num_minibatches: M; minibatch j holds sequences ``{i·M + j}`` (the unpacked split).
      micro_batch_tokens: the token budget of one micro-batch *per device*
        (``rows·W ≤ budget·row_multiple``); None: one micro-batch per minibatch.
      row_multiple: D, the data-parallel size: rows per micro-batch are a multiple of it, so
        each device gets whole rows.

    Raises:
      ValueError: N does not split into M minibatches, a length exceeds ``max_len``, or the
        budget cannot hold ``row_multiple`` rows of the longest sequence.
    """
    lengths_n = np.asarray(lengths_n, np.int64)
    n = lengths_n.size
    if n == 0 or n % num_minibatches:
        raise ValueError(
            f"make_plan: {n} sequences do not split into {num_minibatches} minibatches"
        )
    longest = int(lengths_n.max())
    if longest > max_len:
        raise ValueError(f"make_plan: a sequence of {longest} tokens exceeds max_len={max_len}")
    width = min(bucket(longest, minimum=8), max_len)
    per_mb = [np.arange(j, n, num_minibatches) for j in range(num_minibatches)]
    packed = [first_fit_decreasing(lengths_n[idx], width) for idx in per_mb]
    rows_needed = [int(r.max()) + 1 for r, _ in packed]
    if micro_batch_tokens is None:
        rows = bucket(max(rows_needed))
        rows = math.ceil(rows / row_multiple) * row_multiple
    else:
        rows = (micro_batch_tokens // width) * row_multiple
        if rows < 1:
            raise ValueError(
                f"optim.micro_batch_tokens={micro_batch_tokens} (per device) cannot hold one row "
                f"of {width} tokens (the longest sequence has {longest}, bucketed to {width}); "
                f"expected at least {width}"
            )
    counts = np.asarray([math.ceil(r / rows) for r in rows_needed], np.int32)
    slots = bucket(int(counts.max()))
    micro_n = np.zeros(n, np.int32)
    row_n = np.zeros(n, np.int32)
    offset_n = np.zeros(n, np.int32)
    for j, (idx, (r, o)) in enumerate(zip(per_mb, packed, strict=True)):
        micro_n[idx] = j * slots + r // rows
        row_n[idx] = r % rows
        offset_n[idx] = o
    shape = PackShape(num_minibatches, slots, rows, width)
    return PackPlan(shape, micro_n, row_n, offset_n, counts, lengths_n)


# ---------------------------------------------------------------------------------------------
# Device side (traceable; also runs on NumPy inputs).


class Packed(tuple):
    """``(tokens, segment_ids, positions)``, each ``int32[M·K, rows, W]``; segment 0 = padding."""

    __slots__ = ()

    def __new__(cls, tokens, segment_ids, positions) -> Packed:  # noqa: ANN001
        return super().__new__(cls, (tokens, segment_ids, positions))

    tokens = property(lambda self: self[0])
    segment_ids = property(lambda self: self[1])
    positions = property(lambda self: self[2])


jax.tree_util.register_pytree_node(Packed, lambda p: (tuple(p), None), lambda _, xs: Packed(*xs))


def _compact_index_nl(input_mask_nl: jax.Array) -> jax.Array:
    """``int32[N, L]``: the index of each real token among its row's real tokens (−1 on
    padding)."""
    counts = jnp.cumsum(input_mask_nl.astype(jnp.int32), axis=1) - 1
    return jnp.where(input_mask_nl, counts, -1)


def pack_rows(
    tokens_nl: jax.Array, input_mask_nl: jax.Array, plan: PlanArrays, shape: PackShape
) -> Packed:
    """Scatter the real tokens of ``[N, L]`` rows into the packed ``[M·K, rows, W]`` layout.

    Sequence n's j-th real token goes to ``[micro_n, row_n, offset_n + j]`` with segment id
    ``n + 1`` and position j (the position the unpacked model gives it: the count of real tokens
    before it). Every other slot is token 0, segment 0, position 0.
    """
    n, _ = tokens_nl.shape
    j_nl = _compact_index_nl(input_mask_nl)
    micro = jnp.broadcast_to(jnp.asarray(plan.micro_n)[:, None], j_nl.shape)
    row = jnp.broadcast_to(jnp.asarray(plan.row_n)[:, None], j_nl.shape)
    col = jnp.where(input_mask_nl, jnp.asarray(plan.offset_n)[:, None] + j_nl, shape.width)
    seg = jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.int32)[:, None], j_nl.shape)
    out_shape = (shape.num_micro, shape.rows, shape.width)
    idx = (micro, row, col)  # padding tokens point past the row and are dropped

    def scatter(values: jax.Array) -> jax.Array:
        zeros = jnp.zeros(out_shape, jnp.int32)
        return zeros.at[idx].set(values.astype(jnp.int32), mode="drop", unique_indices=True)

    return Packed(scatter(tokens_nl), scatter(seg), scatter(jnp.maximum(j_nl, 0)))


def unpack_index(
    input_mask_nl: jax.Array, plan: PlanArrays, completion_len: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Where each completion token's packed output is: ``(micro, row, col, valid)``, ``[N, T]``.

    ``valid`` marks real tokens (the rest point at column 0 of their row, a harmless slot to
    read; mask them). A per-token packed output ``y[M·K, rows, W]`` indexed by its *target*
    column (``y[.., w]`` belongs to the token at column w) unpacks as ``y[micro, row, col]``.
    """
    j_nt = _compact_index_nl(input_mask_nl)[:, -completion_len:]
    valid = j_nt >= 0
    micro = jnp.broadcast_to(jnp.asarray(plan.micro_n)[:, None], j_nt.shape)
    row = jnp.broadcast_to(jnp.asarray(plan.row_n)[:, None], j_nt.shape)
    col = jnp.where(valid, jnp.asarray(plan.offset_n)[:, None] + j_nt, 0)
    return micro, row, col, valid


def unpack(
    y_krw: jax.Array,
    index: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    fill: float = 0.0,
) -> jax.Array:
    """``[N, T]``: the packed per-token output at each completion token (``fill`` on padding)."""
    micro, row, col, valid = index
    return jnp.where(valid, y_krw[micro, row, col], jnp.asarray(fill, y_krw.dtype))


def predictions_to_targets(y_rv: jax.Array) -> jax.Array:
    """``[rows, W − 1] -> [rows, W]``: outputs over the W − 1 predicted tokens (``y[:, w]``
    belongs to the token at column w + 1, e.g. log-probs of ``tokens[:, 1:]`` from ``h[:, :-1]``)
    moved to their target columns; column 0 is 0."""
    return jnp.pad(y_rv, ((0, 0), (1, 0)))


def shift_to_targets(y_rw: jax.Array) -> jax.Array:
    """``y[:, w−1] -> out[:, w]``: an output of the state at column w−1 (which predicts the token
    at w) moved to its target column; column 0 (no predecessor) is 0."""
    pad = [(0, 0)] * y_rw.ndim
    pad[1] = (1, 0)
    return jnp.pad(y_rw[:, :-1], pad)


__all__ = [
    "PackPlan",
    "PackShape",
    "Packed",
    "PlanArrays",
    "bucket",
    "first_fit_decreasing",
    "make_plan",
    "pack_rows",
    "predictions_to_targets",
    "shift_to_targets",
    "unpack",
    "unpack_index",
]
