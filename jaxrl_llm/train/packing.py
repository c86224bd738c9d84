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

Shared prompts (``group_n`` / ``shared_n`` of :func:`make_plan`; "Prefix Grouper", Liu et al.
2025). The G samples of a prompt repeat its P tokens in G sequences, so the update computes the
prompt G times. With sharing, a group's first ``P − 1`` tokens are placed once, as a *prefix*
segment, followed by one *branch* per sample: its last prompt token and its completion. A
branch token reads its own branch (causal) and the prefix (``prefix_ids`` below); the prefix
reads only itself. Every branch token sees exactly the tokens and positions it sees unpacked
(the prompt's last token is repeated in each branch so that the state predicting a branch's
first completion token is in the branch), so per-token outputs equal the unpacked ones and a
prefix token's gradient is the sum of what the G samples send it, as the unpacked sum over
rows. A group whose prefix and branches do not fit a row is split into several units, each
with its own copy of the prefix. Sharing widens rows (a unit holds a whole group), and the
reference attention's cost per token grows with the width, so :func:`make_plan` picks the
width among the buckets by an estimate of the computed FLOPs (``attn_per_width``).

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
from typing import Any

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


def attention_per_width(model_config: Any) -> float:
    """The reference attention's FLOPs per token per unit of row width, relative to the other
    per-token FLOPs of a layer: it scores every key of the row (``2·2·H·Dh`` per key: q·k and
    p·v), while the projections and MLP cost ``2·(2·D·H·Dh + 2·D·K·Dh + 3·D·I)`` per token."""
    c = model_config
    attn = 4.0 * c.num_heads * c.head_dim
    dense = (
        2.0
        * c.hidden_size
        * (2 * c.num_heads * c.head_dim + 2 * c.num_kv_heads * c.head_dim + 3 * c.intermediate_size)
    )
    return attn / dense


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
      width: W, tokens per row (bucketed; ≤ L without shared prompts).
      shared: the plan shares prompts (the packed rows carry ``prefix_ids``).
      targets: C, the most completion tokens of any one row, rounded up to a quarter of W
        (≤ W; few shapes), when the plan knows them (``make_plan(target_n=...)``): the LM
        head then runs on C gathered states per row (the packed rows carry ``targets``), not
        on all W; None: on every column.
    """

    num_minibatches: int
    slots: int
    rows: int
    width: int
    shared: bool = False
    targets: int | None = None

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
      offset_n: ``int32[N]`` the column of its first token after the shared prefix (its first
        column when it shares nothing).
      count_m: ``int32[M]`` micro-batches used by each minibatch (≥ 1).
      lengths_n: ``int[N]`` real tokens of each sequence (host only; for statistics).
      prefix_n: ``int32[N]`` its leading tokens held by its unit's shared prefix (0: none);
        ``None`` without shared prompts, as the two below.
      owner_n: ``int32[N]`` the sequence whose tokens fill its unit's prefix (itself if none).
      prefix_off_n: ``int32[N]`` the prefix's first column.
    """

    def __init__(
        self,
        shape: PackShape,
        micro_n: np.ndarray,
        row_n: np.ndarray,
        offset_n: np.ndarray,
        count_m: np.ndarray,
        lengths_n: np.ndarray,
        prefix_n: np.ndarray | None = None,
        owner_n: np.ndarray | None = None,
        prefix_off_n: np.ndarray | None = None,
    ) -> None:
        self.shape = shape
        self.micro_n, self.row_n, self.offset_n = micro_n, row_n, offset_n
        self.count_m, self.lengths_n = count_m, lengths_n
        self.prefix_n, self.owner_n, self.prefix_off_n = prefix_n, owner_n, prefix_off_n

    def device_arrays(self) -> PlanArrays:
        """The arrays the device step takes (the only host → device transfer of packing)."""
        return PlanArrays(
            self.micro_n,
            self.row_n,
            self.offset_n,
            self.count_m,
            self.prefix_n,
            self.owner_n,
            self.prefix_off_n,
        )

    def placed_tokens(self) -> int:
        """Tokens the packed rows hold: the real tokens less the prefixes' repeats."""
        if self.prefix_n is None:
            return int(self.lengths_n.sum())
        owners = self.owner_n == np.arange(self.owner_n.size)
        return int(self.lengths_n.sum() - self.prefix_n[~owners].sum())

    def padding_fraction(self) -> float:
        """Fraction of the packed slots ``M·K·rows·W`` *used by minibatches* that hold padding."""
        s = self.shape
        used = int(self.count_m.sum()) * s.rows * s.width
        return 1.0 - float(self.placed_tokens()) / max(used, 1)


class PlanArrays(tuple):
    """``(micro_n, row_n, offset_n, count_m, prefix_n, owner_n, prefix_off_n)``: a plain pytree
    (a tuple) of int32 arrays; the last three are ``None`` without shared prompts."""

    __slots__ = ()

    def __new__(
        cls,
        micro_n: Any,
        row_n: Any,
        offset_n: Any,
        count_m: Any,
        prefix_n: Any = None,
        owner_n: Any = None,
        prefix_off_n: Any = None,
    ) -> PlanArrays:
        return super().__new__(
            cls, (micro_n, row_n, offset_n, count_m, prefix_n, owner_n, prefix_off_n)
        )

    micro_n = property(lambda self: self[0])
    row_n = property(lambda self: self[1])
    offset_n = property(lambda self: self[2])
    count_m = property(lambda self: self[3])
    prefix_n = property(lambda self: self[4])
    owner_n = property(lambda self: self[5])
    prefix_off_n = property(lambda self: self[6])


jax.tree_util.register_pytree_node(
    PlanArrays, lambda p: (tuple(p), None), lambda _, xs: PlanArrays(*xs)
)


def _units(
    members: np.ndarray, lengths_n: np.ndarray, shared_n: np.ndarray | None, width: int
) -> list[tuple[list[int], int]]:
    """One group's packing units ``(sequences, prefix tokens)``: its sequences in order, as
    few units as fit ``width`` (each unit repeats the prefix); a unit of one sequence, or a
    group sharing nothing, has prefix 0 (the sequences are placed whole)."""
    p = 0 if shared_n is None else int(shared_n[members[0]])
    if p == 0 or len(members) == 1:
        return [([int(m)], 0) for m in members]
    units: list[list[int]] = [[]]
    fill = p
    for m in members:
        branch = int(lengths_n[m]) - p
        if units[-1] and fill + branch > width:
            units.append([])
            fill = p
        units[-1].append(int(m))
        fill += branch
    return [(u, p if len(u) > 1 else 0) for u in units]


def _layout(
    per_mb: list[np.ndarray],
    lengths_n: np.ndarray,
    group_n: np.ndarray | None,
    shared_n: np.ndarray | None,
    width: int,
) -> tuple[list[list[tuple[list[int], int, int, int]]], list[int]]:
    """Per minibatch, each unit ``(sequences, prefix, row, column)`` first-fit-decreasing into
    rows of ``width``; and the rows each minibatch needs."""
    placed, rows_needed = [], []
    for idx in per_mb:
        if group_n is None:
            groups = [idx[i : i + 1] for i in range(idx.size)]
        else:  # this minibatch's sequences of each group, groups in order of first appearance
            _, first = np.unique(group_n[idx], return_index=True)
            order = group_n[idx][np.sort(first)]
            groups = [idx[group_n[idx] == gid] for gid in order]
        units = [u for members in groups for u in _units(members, lengths_n, shared_n, width)]
        unit_len = np.asarray(
            [p + sum(int(lengths_n[m]) - p for m in seqs) for seqs, p in units], np.int64
        )
        row_u, off_u = first_fit_decreasing(unit_len, width)
        placed.append(
            [(seqs, p, int(r), int(o)) for (seqs, p), r, o in zip(units, row_u, off_u, strict=True)]
        )
        rows_needed.append(int(row_u.max()) + 1)
    return placed, rows_needed


def make_plan(
    lengths_n: np.ndarray,
    *,
    max_len: int,
    num_minibatches: int = 1,
    micro_batch_tokens: int | None = None,
    row_multiple: int = 1,
    group_n: np.ndarray | None = None,
    shared_n: np.ndarray | None = None,
    attn_per_width: float = 0.0,
    max_width: int | None = None,
    width_multiple: int = 1,
    target_n: np.ndarray | None = None,
) -> PackPlan:
    """The packing plan of N sequences of ``lengths_n`` real tokens (host, NumPy).

    Args:
      lengths_n: real tokens (prompt + completion) of each sequence.
      max_len: L, the unpacked row width; W never exceeds it without shared prompts.
      num_minibatches: M; minibatch j holds sequences ``{i·M + j}`` (the unpacked split).
      micro_batch_tokens: the token budget of one micro-batch *per device*
        (``rows·W ≤ budget·row_multiple``); None: one micro-batch per minibatch.
      row_multiple: D, the data-parallel size: rows per micro-batch are a multiple of it, so
        each device gets whole rows.
      group_n: ``int[N]`` the prompt of each sequence: sequences of one group *in one
        minibatch* share their first ``shared_n`` tokens (shared prompts, module docstring);
        None: nothing is shared.
      shared_n: ``int[N]`` tokens shared within the group (equal in a group, < each length:
        the prompt's real tokens less one).
      attn_per_width: the attention FLOPs per token per unit of row width, relative to the
        rest of the model's per-token FLOPs (reference attention reads the whole row). With
        shared prompts the width W minimises ``slots·W·(1 + attn_per_width·W)`` over the
        buckets from the unshared width up to a whole group, ``max_width`` and the budget.
      max_width: the widest row shared prompts may use (None: 8x the unshared width).
      width_multiple: W is rounded up to a multiple of this (128 for splash attention, whose
        blocks are multiples of 128 lanes; it may then exceed ``max_len``).
      target_n: ``int[N]`` completion tokens of each sequence (its last real tokens, the ones
        whose log-probs the update reads): sets ``PackShape.targets``, so the LM head skips
        the prompt positions (the unpacked path starts at the completion too). None: the LM
        head runs on every column of the rows.

    Raises:
      ValueError: N does not split into M minibatches, a length exceeds ``max_len``, the
        budget cannot hold ``row_multiple`` rows of the longest sequence, or ``group_n`` /
        ``shared_n`` are malformed.
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
    if (group_n is None) != (shared_n is None):
        raise ValueError("make_plan: group_n and shared_n go together (shared prompts)")
    if group_n is not None:
        group_n, shared_n = np.asarray(group_n, np.int64), np.asarray(shared_n, np.int64)
        if group_n.shape != (n,) or shared_n.shape != (n,):
            raise ValueError(
                f"make_plan: group_n and shared_n must be [N] = [{n}], got "
                f"{group_n.shape} and {shared_n.shape}"
            )
        bad = np.flatnonzero((shared_n < 0) | (shared_n >= np.maximum(lengths_n, 1)))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"make_plan: shared_n[{i}] = {int(shared_n[i])} must be in [0, length "
                f"{int(lengths_n[i])}) (a branch keeps at least one token)"
            )
        for gid in np.unique(group_n):
            if np.ptp(shared_n[group_n == gid]):
                raise ValueError(f"make_plan: group {int(gid)} has different shared_n values")
    align = lambda w: -(-w // width_multiple) * width_multiple
    width_seq = align(min(bucket(longest, minimum=8), max_len))
    per_mb = [np.arange(j, n, num_minibatches) for j in range(num_minibatches)]

    def rows_of(width: int, rows_needed: list[int]) -> int:
        if micro_batch_tokens is None:
            return math.ceil(bucket(max(rows_needed)) / row_multiple) * row_multiple
        return (micro_batch_tokens // width) * row_multiple

    def cost(width: int, rows_needed: list[int]) -> float:
        rows = rows_of(width, rows_needed)
        slots = sum(math.ceil(r / rows) for r in rows_needed) * rows * width
        return slots * (1.0 + attn_per_width * width)

    widths = [width_seq]
    if group_n is not None:  # the buckets up to a whole group's unit (shared prompts)
        whole = max(
            int(shared_n[m[0]]) + sum(int(lengths_n[i] - shared_n[i]) for i in m)
            for idx in per_mb
            for m in (idx[group_n[idx] == gid] for gid in np.unique(group_n[idx]))
        )
        cap = 8 * width_seq if max_width is None else max(int(max_width), width_seq)
        if micro_batch_tokens is not None:
            cap = min(cap, max(micro_batch_tokens, width_seq))
        while widths[-1] < min(whole, cap):
            nxt = align(bucket(widths[-1] + 1))
            if nxt > cap:
                break
            widths.append(nxt)
    layouts = {w: _layout(per_mb, lengths_n, group_n, shared_n, w) for w in widths}
    width = (
        widths[0] if len(widths) == 1 else min(widths, key=lambda w: (cost(w, layouts[w][1]), w))
    )
    placed, rows_needed = layouts[width]
    rows = rows_of(width, rows_needed)
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
    prefix_n = np.zeros(n, np.int32)
    owner_n = np.arange(n, dtype=np.int32)
    prefix_off_n = np.zeros(n, np.int32)
    for j, units in enumerate(placed):
        for seqs, p, r, o in units:
            col = o + p
            for m in seqs:
                micro_n[m] = j * slots + r // rows
                row_n[m] = r % rows
                offset_n[m], prefix_n[m], owner_n[m], prefix_off_n[m] = col, p, seqs[0], o
                col += int(lengths_n[m]) - p
    shared = group_n is not None
    targets = None
    if target_n is not None:
        target_n = np.asarray(target_n, np.int64)
        if target_n.shape != (n,):
            raise ValueError(f"make_plan: target_n must be [N] = [{n}], got {target_n.shape}")
        bad = np.flatnonzero((target_n < 0) | (target_n >= lengths_n))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"make_plan: target_n[{i}] = {int(target_n[i])} must be in [0, length "
                f"{int(lengths_n[i])}) (a sequence keeps at least one prompt token)"
            )
        per_row = np.zeros((num_minibatches * slots, rows), np.int64)
        np.add.at(per_row, (micro_n, row_n), target_n)
        quarter = max(width // 4, 1)  # C in quarters of W: at most 4 shapes per W
        targets = min(-(-max(int(per_row.max()), 1) // quarter) * quarter, width)
    shape = PackShape(num_minibatches, slots, rows, width, shared, targets)
    extra = (prefix_n, owner_n, prefix_off_n) if shared else ()
    return PackPlan(shape, micro_n, row_n, offset_n, counts, lengths_n, *extra)


# ---------------------------------------------------------------------------------------------
# Device side (traceable; also runs on NumPy inputs).


class Packed(tuple):
    """``(tokens, segment_ids, positions, prefix_ids, targets)``: the first four ``int32[M·K,
    rows, W]``; segment 0 = padding; ``prefix_ids`` (shared prompts only, else ``None``) is the
    other segment a token may read: its group's prefix (its own segment where it shares
    nothing). ``targets`` (``PackShape.targets`` = C set, else ``None``): ``int32[M·K, rows,
    C]``, the columns of each row's completion tokens in order, −1 after the last."""

    __slots__ = ()

    def __new__(
        cls,
        tokens: Any,
        segment_ids: Any,
        positions: Any,
        prefix_ids: Any = None,
        targets: Any = None,
    ) -> Packed:
        return super().__new__(cls, (tokens, segment_ids, positions, prefix_ids, targets))

    tokens = property(lambda self: self[0])
    segment_ids = property(lambda self: self[1])
    positions = property(lambda self: self[2])
    prefix_ids = property(lambda self: self[3])
    targets = property(lambda self: self[4])


jax.tree_util.register_pytree_node(Packed, lambda p: (tuple(p), None), lambda _, xs: Packed(*xs))


def _compact_index_nl(input_mask_nl: jax.Array) -> jax.Array:
    """``int32[N, L]``: the index of each real token among its row's real tokens (−1 on
    padding)."""
    counts = jnp.cumsum(input_mask_nl.astype(jnp.int32), axis=1) - 1
    return jnp.where(input_mask_nl, counts, -1)


def pack_rows(
    tokens_nl: jax.Array,
    input_mask_nl: jax.Array,
    plan: PlanArrays,
    shape: PackShape,
    completion_len: int | None = None,
) -> Packed:
    """Scatter the real tokens of ``[N, L]`` rows into the packed ``[M·K, rows, W]`` layout.

    Sequence n's j-th real token goes to ``[micro_n, row_n, offset_n + j]`` with segment id
    ``n + 1`` and position j (the position the unpacked model gives it: the count of real tokens
    before it). Every other slot is token 0, segment 0, position 0.

    Shared prompts (``shape.shared``): token ``j < prefix_n`` belongs to the prefix: the owner
    ``o = owner_n`` writes it at ``prefix_off_n + j`` with segment id ``N + 1 + o`` (the other
    sequences' copies are dropped); token ``j ≥ prefix_n`` goes to ``offset_n + j − prefix_n``
    with segment ``n + 1`` and prefix id ``N + 1 + o`` (its own segment if ``prefix_n = 0``).
    Positions stay j.

    With ``shape.targets`` (C) the last ``completion_len`` = T columns of the rows are the
    completions, and ``Packed.targets`` lists each packed row's completion columns (ascending,
    −1 after the last; the plan guarantees at most C per row).
    """
    if shape.targets is not None and completion_len is None:
        raise ValueError("pack_rows: shape.targets is set, so completion_len (T) is required")
    n, _ = tokens_nl.shape
    j_nl = _compact_index_nl(input_mask_nl)
    micro = jnp.broadcast_to(jnp.asarray(plan.micro_n)[:, None], j_nl.shape)
    row = jnp.broadcast_to(jnp.asarray(plan.row_n)[:, None], j_nl.shape)
    seg = jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.int32)[:, None], j_nl.shape)
    offset = jnp.asarray(plan.offset_n)[:, None]
    out_shape = (shape.num_micro, shape.rows, shape.width)
    if shape.shared:
        prefix = jnp.asarray(plan.prefix_n)[:, None]
        owner = jnp.asarray(plan.owner_n)[:, None]
        in_prefix = j_nl < prefix
        is_owner = owner == jnp.arange(n, dtype=jnp.int32)[:, None]
        prefix_seg = n + 1 + owner
        col = jnp.where(
            in_prefix,
            jnp.where(is_owner, jnp.asarray(plan.prefix_off_n)[:, None] + j_nl, shape.width),
            offset + j_nl - prefix,
        )
        prefix_ids = jnp.where((prefix > 0) | in_prefix, prefix_seg, seg)
        seg = jnp.where(in_prefix, prefix_seg, seg)
    else:
        col, prefix_ids = offset + j_nl, None
    col = jnp.where(input_mask_nl, col, shape.width)
    idx = (micro, row, col)  # padding tokens (and prefix copies) point past the row: dropped

    def scatter(values: jax.Array) -> jax.Array:
        zeros = jnp.zeros(out_shape, jnp.int32)
        return zeros.at[idx].set(values.astype(jnp.int32), mode="drop", unique_indices=True)

    return Packed(
        scatter(tokens_nl),
        scatter(seg),
        scatter(jnp.maximum(j_nl, 0)),
        None if prefix_ids is None else scatter(prefix_ids),
        None if shape.targets is None else _targets(input_mask_nl, plan, shape, completion_len),
    )


def _targets(
    input_mask_nl: jax.Array, plan: PlanArrays, shape: PackShape, completion_len: int
) -> jax.Array:
    """``int32[M·K, rows, C]``: :attr:`Packed.targets` (the rank of a completion token among
    its row's, by column, is its slot)."""
    micro, row, col, valid = unpack_index(input_mask_nl, plan, completion_len)
    w, c = shape.width, shape.targets
    grid = (shape.num_micro, shape.rows, w)
    is_target = (
        jnp.zeros(grid, jnp.int32).at[micro, row, jnp.where(valid, col, w)].set(1, mode="drop")
    )
    rank = jnp.cumsum(is_target, axis=2) - 1
    slot = jnp.where(valid, rank[micro, row, col], c)
    out = jnp.full((shape.num_micro, shape.rows, c), -1, jnp.int32)
    return out.at[micro, row, slot].set(col, mode="drop")


def unpack_index(
    input_mask_nl: jax.Array, plan: PlanArrays, completion_len: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Where each completion token's packed output is: ``(micro, row, col, valid)``, ``[N, T]``.

    ``valid`` marks real tokens (the rest point at column 0 of their row, a harmless slot to
    read; mask them). A per-token packed output ``y[M·K, rows, W]`` indexed by its *target*
    column (``y[.., w]`` belongs to the token at column w) unpacks as ``y[micro, row, col]``.
    (Completion tokens are never in a shared prefix: column ``offset_n + j − prefix_n``.)
    """
    j_nt = _compact_index_nl(input_mask_nl)[:, -completion_len:]
    valid = j_nt >= 0
    micro = jnp.broadcast_to(jnp.asarray(plan.micro_n)[:, None], j_nt.shape)
    row = jnp.broadcast_to(jnp.asarray(plan.row_n)[:, None], j_nt.shape)
    start = jnp.asarray(plan.offset_n)[:, None]
    if plan.prefix_n is not None:
        start = start - jnp.asarray(plan.prefix_n)[:, None]
    col = jnp.where(valid, start + j_nt, 0)
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
    "attention_per_width",
    "bucket",
    "first_fit_decreasing",
    "make_plan",
    "pack_rows",
    "predictions_to_targets",
    "shift_to_targets",
    "unpack",
    "unpack_index",
]
