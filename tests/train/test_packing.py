"""jaxrl_llm.train.packing: the plan's properties, and pack → unpack is the identity."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jaxrl_llm.train import packing as pk


def ragged(seed: int, n: int, p: int, t: int):
    """Left-padded prompts of 1..P real tokens, prefix completions of 0..T (heavy-tailed)."""
    rng = np.random.default_rng(seed)
    p_len = rng.integers(1, p + 1, n)
    c_len = np.minimum(rng.pareto(1.2, n).astype(int) + 1, t)
    c_len[0] = 0  # an empty completion
    c_len[1] = t
    prompt_mask = np.arange(p)[None] >= (p - p_len)[:, None]
    mask = np.arange(t)[None] < c_len[:, None]
    input_mask = np.concatenate([prompt_mask, mask], axis=1)
    tokens = np.where(input_mask, rng.integers(1, 1000, (n, p + t)), 0).astype(np.int32)
    return tokens, input_mask


N, P, T = 24, 6, 20  # sequences, prompt and completion widths of ragged_plan


def ragged_plan(seed: int, num_minibatches: int, budget: int | None, *, targets=False, **kw):
    """``ragged(seed, N, P, T)`` and its plan (``targets``: with ``target_n``)."""
    tokens, input_mask = ragged(seed, N, P, T)
    plan = pk.make_plan(
        input_mask.sum(1),
        max_len=P + T,
        num_minibatches=num_minibatches,
        micro_batch_tokens=budget,
        target_n=input_mask[:, P:].sum(1) if targets else None,
        **kw,
    )
    return tokens, input_mask, plan


def test_bucket_values():
    assert [pk.bucket(i) for i in range(1, 14)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
    assert pk.bucket(3, minimum=8) == 8
    for n in range(1, 2000):
        b = pk.bucket(n)
        assert n <= b <= max(1.5 * n, 2)


def test_first_fit_decreasing_is_valid_and_tight():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 33, 200)
    row, off = pk.first_fit_decreasing(lengths, 32)
    fill = np.zeros(row.max() + 1, int)
    for r, o, n in zip(row, off, lengths, strict=True):
        assert o + n <= 32
        fill[r] += n
    assert fill.max() <= 32
    # No two sequences of a row overlap.
    for r in range(row.max() + 1):
        spans = sorted((o, o + n) for rr, o, n in zip(row, off, lengths, strict=True) if rr == r)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    # FFD bound: ≤ 11/9·OPT + 6/9 with OPT ≥ ⌈Σ/W⌉.
    assert row.max() + 1 <= 11 / 9 * np.ceil(lengths.sum() / 32) + 1
    with pytest.raises(ValueError, match="does not fit a row of 32"):
        pk.first_fit_decreasing(np.array([33]), 32)


@pytest.mark.parametrize(
    ("num_minibatches", "budget", "multiple"), [(1, None, 1), (2, None, 2), (2, 96, 1), (1, 32, 4)]
)
def test_plan_properties_and_round_trip(num_minibatches, budget, multiple):
    n, p, t = N, P, T
    tokens, input_mask, plan = ragged_plan(1, num_minibatches, budget, row_multiple=multiple)
    lengths = input_mask.sum(1)
    s = plan.shape
    assert s.width == min(pk.bucket(lengths.max(), minimum=8), p + t)
    assert s.rows % multiple == 0
    if budget is not None:
        assert s.rows * s.width <= budget * multiple
    else:
        assert s.slots == 1
    assert s.slots == pk.bucket(plan.count_m.max())
    # Minibatches: sequence n is in minibatch n % M, in one of its first count slots.
    j = plan.micro_n // s.slots
    assert np.array_equal(j, np.arange(n) % num_minibatches)
    assert np.all(plan.micro_n % s.slots < plan.count_m[j])
    assert np.all(plan.offset_n + lengths <= s.width)

    packed = pk.pack_rows(tokens, input_mask, plan.device_arrays(), s)
    toks, seg, pos = (np.asarray(x) for x in packed[:3])
    assert packed.prefix_ids is None
    assert toks.shape == (s.num_micro, s.rows, s.width)
    # Every real token exactly once: segment k+1 holds exactly sequence k's real tokens, in
    # order, contiguously, with positions 0..len-1.
    for i in range(n):
        where = np.argwhere(seg == i + 1)
        assert len(where) == lengths[i]
        if lengths[i] == 0:
            continue
        assert len({(a, b) for a, b, _ in where}) == 1  # one row
        cols = where[:, 2]
        assert np.array_equal(cols, np.arange(cols[0], cols[0] + lengths[i]))  # contiguous
        a, b = where[0, :2]
        np.testing.assert_array_equal(toks[a, b, cols], tokens[i][input_mask[i]])
        np.testing.assert_array_equal(pos[a, b, cols], np.arange(lengths[i]))
    assert np.all(toks[seg == 0] == 0)
    assert (seg > 0).sum() == lengths.sum()
    # Unused slots are empty.
    for jj in range(num_minibatches):
        assert np.all(seg[jj * s.slots + plan.count_m[jj] : (jj + 1) * s.slots] == 0)
    # Round trip: the packed tokens unpack to the completion tokens.
    index = pk.unpack_index(input_mask, plan.device_arrays(), t)
    back = np.asarray(pk.unpack(packed.tokens, index, fill=-1))
    np.testing.assert_array_equal(back, np.where(input_mask[:, p:], tokens[:, p:], -1))
    assert 0.0 <= plan.padding_fraction() < 1.0


@pytest.mark.parametrize(("num_minibatches", "budget"), [(1, None), (2, 64)])
def test_targets_list_each_rows_completion_columns(num_minibatches, budget):
    """``PackShape.targets`` is the most completion tokens of a row (rounded up to a quarter
    of W), and ``Packed.targets`` lists each row's completion columns in order, −1 after."""
    n, p, t = N, P, T
    tokens, input_mask, plan = ragged_plan(3, num_minibatches, budget, targets=True)
    lengths, target = input_mask.sum(1), input_mask[:, p:].sum(1)
    s = plan.shape
    packed = pk.pack_rows(tokens, input_mask, plan.device_arrays(), s, t)
    got = np.asarray(packed.targets)
    assert got.shape == (s.num_micro, s.rows, s.targets)
    want: dict[tuple[int, int], list[int]] = {}
    for i in range(n):  # sequence i's completion: its last target[i] real tokens
        first = plan.offset_n[i] + lengths[i] - target[i]
        cols = range(first, plan.offset_n[i] + lengths[i])
        want.setdefault((plan.micro_n[i], plan.row_n[i]), []).extend(cols)
    most = max(len(v) for v in want.values())
    assert s.targets == min(-(-most // (s.width // 4)) * (s.width // 4), s.width)
    for m, r in itertools.product(range(s.num_micro), range(s.rows)):
        cols = sorted(want.get((m, r), []))
        np.testing.assert_array_equal(got[m, r], cols + [-1] * (s.targets - len(cols)))
    # The listed columns hold exactly the completion tokens.
    toks = np.asarray(packed.tokens)
    listed = [toks[m, r, c] for m, r in np.ndindex(got.shape[:2]) for c in got[m, r] if c >= 0]
    assert sorted(listed) == sorted(tokens[:, p:][input_mask[:, p:]].tolist())
    with pytest.raises(ValueError, match="completion_len"):
        pk.pack_rows(tokens, input_mask, plan.device_arrays(), s)
    with pytest.raises(ValueError, match="target_n"):
        pk.make_plan(lengths, max_len=p + t, target_n=lengths)  # no prompt token left


def test_shift_to_targets():
    y = np.arange(12).reshape(2, 6)
    np.testing.assert_array_equal(np.asarray(pk.shift_to_targets(y))[:, 1:], y[:, :-1])
    assert np.all(np.asarray(pk.shift_to_targets(y))[:, 0] == 0)


def test_plan_shapes_come_from_few_buckets():
    """Steady state: 50 ragged batches of one config give a handful of static shapes."""
    shapes = set()
    for seed in range(50):
        _, input_mask = ragged(seed, 32, 8, 64)
        lengths = input_mask.sum(1)
        plan = pk.make_plan(lengths, max_len=72, num_minibatches=2, micro_batch_tokens=256)
        shapes.add(plan.shape)
    assert len(shapes) <= 4, shapes


def test_plan_errors():
    with pytest.raises(ValueError, match="do not split into 3 minibatches"):
        pk.make_plan(np.ones(4, int), max_len=8, num_minibatches=3)
    with pytest.raises(ValueError, match="exceeds max_len=8"):
        pk.make_plan(np.array([9]), max_len=8)
    with pytest.raises(ValueError, match=r"micro_batch_tokens=12 \(per device\) cannot hold"):
        pk.make_plan(np.array([16, 3, 2, 1]), max_len=16, micro_batch_tokens=12, row_multiple=4)
