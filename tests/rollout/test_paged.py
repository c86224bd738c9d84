"""The paged engine (rollout/paged.py, rollout/pages.py) on tiny random models: the static
engine's greedy tokens and log-probs for ragged prompts and budgets, per-sequence randomness,
the trainer's log-probs, page accounting, bad input, compile reuse, sharded parameters and the
Pallas GPU kernel's wiring."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import rollout
from jaxrl_llm.rollout import paged, pages
from jaxrl_llm.train.hostmem import BACKEND_COMPILE_EVENT
from tests.rollout.test_generate import prompts, training_logprobs

LENGTHS = (9, 4, 1, 6, 23)  # ragged; 23 > prefill_chunk below: a chunked prefill
T, G = 12, 2
BUDGETS = np.array([[12, 3], [1, 12], [7, 8], [12, 5], [2, 9]], np.int32)
SMALL = paged.PagedOptions(page_size=4, num_slots=4, steps_per_dispatch=4, prefill_chunk=16)


class CompileCounter:
    """Counts XLA backend compiles while active."""

    def __init__(self):
        self.count = 0

    def __call__(self, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def both(model, ids, mask, options=SMALL, **kw):
    kw = dict(rng=jax.random.key(0), max_new_tokens=T, num_samples=G, **kw)
    static = rollout.generate(model, ids, mask, **kw)
    out, stats = rollout.generate(
        model, ids, mask, engine="paged", paged_options=options, return_stats=True, **kw
    )
    return static, out, stats


def assert_same(a, b, logp_atol=1e-5):
    np.testing.assert_array_equal(np.asarray(a.mask), np.asarray(b.mask))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.truncated), np.asarray(b.truncated))
    np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=logp_atol)


@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen2", "qwen3"])
def test_greedy_equals_static_engine_with_ragged_prompts_and_budgets(tiny_pair, family):
    _, model = tiny_pair(family)  # mistral: sliding window 5; qwen3: q/k norm; qwen2: biases
    ids, mask = prompts(seed=1, lengths=LENGTHS)
    static, out, stats = both(model, ids, mask, temperature=0.0, max_new_tokens_bg=BUDGETS)
    assert_same(static, out)
    assert np.asarray(out.mask).sum(-1).max() <= T
    assert (np.asarray(out.mask).sum(-1) <= BUDGETS).all()
    assert stats.pages_in_use_at_end == 0
    if family != "llama3":
        return
    # No stop ids: every sample makes exactly its budget, truncated, in both engines.
    static, out, _ = both(
        model, ids, mask, temperature=0.0, max_new_tokens_bg=BUDGETS, stop_token_ids=()
    )
    assert_same(static, out)
    np.testing.assert_array_equal(np.asarray(out.mask).sum(-1), BUDGETS)
    assert np.asarray(out.truncated).all()
    # Without budgets: every row runs to T or its stop id, as in the static engine.
    static, out, stats = both(model, ids, mask, temperature=0.0)
    assert_same(static, out)
    assert stats.pages_in_use_at_end == 0


def test_page_size_not_dividing_the_chunk_and_one_slot_group(tiny_pair):
    _, model = tiny_pair("llama3")
    ids, mask = prompts(seed=4, lengths=LENGTHS)
    options = paged.PagedOptions(page_size=3, num_slots=2, steps_per_dispatch=3, prefill_chunk=8)
    static, out, stats = both(model, ids, mask, options, temperature=0.0, max_new_tokens_bg=BUDGETS)
    assert_same(static, out)
    assert stats.pages_in_use_at_end == 0


def test_a_long_dispatch_returns_when_the_live_rows_fit_a_smaller_bucket(tiny_pair):
    _, model = tiny_pair("llama3")
    ids, mask = prompts(seed=3, lengths=LENGTHS)
    # 10 sequences in 16 slots: 6 end after their second token, leaving 4 (bucket 8). A
    # dispatch of up to 64 steps returns then, and the tail runs in one more, 8 rows wide.
    budgets = np.array([[12, 2], [2, 12], [2, 2], [12, 2], [2, 12]], np.int32)
    options = dataclasses.replace(SMALL, num_slots=16, steps_per_dispatch=64)
    static, out, stats = both(
        model, ids, mask, options, temperature=0.0, max_new_tokens_bg=budgets, stop_token_ids=()
    )
    assert_same(static, out)
    np.testing.assert_array_equal(np.asarray(out.mask).sum(-1), budgets)
    assert stats.decode_dispatches == 2 and stats.pages_in_use_at_end == 0


def test_sampled_tokens_do_not_depend_on_slots_order_or_neighbours(tiny_pair):
    _, model = tiny_pair("qwen2")
    ids, mask = prompts(seed=2, lengths=LENGTHS)
    kw = dict(
        rng=jax.random.key(7),
        max_new_tokens=T,
        num_samples=G,
        temperature=1.0,
        top_k=20,
        max_new_tokens_bg=BUDGETS,
        engine="paged",
    )
    one_group = dataclasses.replace(SMALL, num_slots=2)  # admits one prompt at a time
    one_group = rollout.generate(model, ids, mask, paged_options=one_group, **kw)
    # 16 slots for 10 sequences: rows 16, then 8 as they finish (the live slots repacked).
    wide = dataclasses.replace(SMALL, num_slots=16)
    wide, stats = rollout.generate(model, ids, mask, paged_options=wide, return_stats=True, **kw)
    # All 5 prompts prefilled together: chunk 1 of every prompt, then chunk 2 of the 23-token one.
    assert stats.prefill_calls == 2
    assert_same(one_group, wide)
    # A pool just big enough for the largest prompt's worst case (9 pages): admission waits
    # for pages and sequences are preempted and recomputed; the samples are the same.
    tight = dataclasses.replace(SMALL, num_pages=10)
    tight, stats = rollout.generate(model, ids, mask, paged_options=tight, return_stats=True, **kw)
    assert_same(tight, wide)
    assert stats.peak_pages <= 9 and stats.pages_in_use_at_end == 0 and stats.preemptions > 0
    # The first two prompts alone (other neighbours, other admission times) sample the same.
    kw["max_new_tokens_bg"] = BUDGETS[:2]
    alone = rollout.generate(model, ids[:2], mask[:2], paged_options=SMALL, **kw)
    for field in ("tokens", "mask", "truncated"):
        np.testing.assert_array_equal(
            np.asarray(getattr(alone, field)), np.asarray(getattr(wide, field))[:2]
        )
    # And the key matters: another key gives other tokens.
    kw["rng"] = jax.random.key(8)
    other = rollout.generate(model, ids[:2], mask[:2], paged_options=SMALL, **kw)
    assert not np.array_equal(np.asarray(other.tokens), np.asarray(alone.tokens))


def full_run(seed: int, temperature: float) -> dict:
    """``generate`` keywords of a paged run of every token (no stop id) that returns full
    log-probs and stats."""
    return dict(
        rng=jax.random.key(seed),
        max_new_tokens=T,
        num_samples=G,
        temperature=temperature,
        top_k=20,
        stop_token_ids=(),
        engine="paged",
        return_full_logprobs=True,
        return_stats=True,
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_pool_smaller_than_the_live_tokens_preempts_and_recomputes_the_same_tokens(
    tiny_pair, temperature
):
    """11 usable pages for 10 sequences that need up to 9 each: decoding together, they
    outgrow the pool; the latest admitted are preempted, recomputed and continued. Tokens,
    log-probs and full log-probs are those of a pool that holds them all."""
    _, model = tiny_pair("llama3")
    ids, mask = prompts(seed=6, lengths=LENGTHS)
    kw = full_run(4, temperature)
    wide = dataclasses.replace(SMALL, num_slots=16)
    ref, ref_stats = rollout.generate(model, ids, mask, paged_options=wide, **kw)
    assert ref_stats.preemptions == 0
    tight = dataclasses.replace(wide, num_pages=12)
    out, stats = rollout.generate(model, ids, mask, paged_options=tight, **kw)
    assert stats.preemptions >= 3 and stats.peak_pages <= 11 and stats.pages_in_use_at_end == 0
    assert_same(ref, out)
    np.testing.assert_allclose(
        np.asarray(out.full_logprobs), np.asarray(ref.full_logprobs), atol=1e-5
    )
    np.testing.assert_array_equal(np.asarray(out.mask).sum(-1), T)  # every token made
    with CompileCounter() as compiles:  # the recompute prefill's shapes are reused
        again, again_stats = rollout.generate(model, ids, mask, paged_options=tight, **kw)
        jax.block_until_ready(again)
    assert compiles.count == 0 and again_stats.preemptions == stats.preemptions
    assert_same(out, again, logp_atol=0.0)


def test_a_recomputed_sequence_starts_after_the_prompt_pages_still_held(tiny_pair):
    """Sharing on recompute (prefix sharing's default): a preempted sequence is prefilled
    again from after its prompt's full pages that are still held, by its sibling, or by the
    sibling recomputed first when both were preempted (the second waits one prefill call for
    those pages). Tokens, log-probs and full log-probs equal those of a pool that never
    preempts and of a tight pool that recomputes every page; fewer tokens are run and every
    page comes back."""
    _, model = tiny_pair("llama3")
    ids, mask = prompts(seed=6, lengths=(13, 17, 9, 21, 14))  # 2-5 full pages of 4 tokens
    kw = full_run(4, 1.0)
    wide = dataclasses.replace(SMALL, num_slots=16)
    ref, ref_stats = rollout.generate(model, ids, mask, paged_options=wide, **kw)
    tight = dataclasses.replace(wide, num_pages=12)
    own, own_stats = rollout.generate(
        model, ids, mask, paged_options=dataclasses.replace(tight, prefix_sharing=False), **kw
    )
    out, stats = rollout.generate(model, ids, mask, paged_options=tight, **kw)
    for run in (own, out):
        assert_same(ref, run)
        np.testing.assert_allclose(
            np.asarray(run.full_logprobs), np.asarray(ref.full_logprobs), atol=1e-5
        )
    assert ref_stats.preemptions == 0 and own_stats.preemptions > 0 and stats.preemptions > 0
    # No two prompts begin alike: every shared token is a recomputed sequence's.
    assert ref_stats.shared_prompt_tokens == own_stats.shared_prompt_tokens == 0
    assert stats.shared_prompt_tokens > 0 and stats.shared_prompt_tokens % 4 == 0
    assert stats.prefill_tokens < own_stats.prefill_tokens
    assert stats.pages_in_use_at_end == own_stats.pages_in_use_at_end == 0
    assert stats.peak_pages <= 11


def test_admission_follows_live_tokens_not_the_worst_case(tiny_pair):
    """A pool that holds two groups' worst case (7 pages each: 4-token prompts, G = 2, T =
    12) admits all four prompts in one prefill call when their tokens fit: each sequence here
    stops by its third token (a stop id), so nothing is preempted and the tokens are those of
    a larger pool. Reserving the worst case would have admitted two prompts at a time."""
    _, model = tiny_pair("llama3")
    ids, mask = prompts(seed=7, lengths=(4, 4, 4, 4))
    kw = dict(
        rng=jax.random.key(5),
        max_new_tokens=T,
        num_samples=G,
        temperature=0.0,
        engine="paged",
        return_stats=True,
    )
    options = paged.PagedOptions(page_size=4, num_slots=8, steps_per_dispatch=4)
    free_run, _ = rollout.generate(model, ids, mask, paged_options=options, stop_token_ids=(), **kw)
    stop = sorted(set(np.asarray(free_run.tokens)[:, :, 2].ravel().tolist()))
    ref, _ = rollout.generate(model, ids, mask, paged_options=options, stop_token_ids=stop, **kw)
    assert np.asarray(ref.mask).sum(-1).max() <= 3
    tight = dataclasses.replace(options, num_pages=1 + 2 * 7)
    out, stats = rollout.generate(model, ids, mask, paged_options=tight, stop_token_ids=stop, **kw)
    assert stats.prefill_calls == 1 and stats.preemptions == 0
    assert_same(ref, out)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_training_side(tiny_pair, temperature):
    _, model = tiny_pair("llama3")
    ids, mask = prompts(seed=3, lengths=LENGTHS)
    out = rollout.generate(
        model,
        ids,
        mask,
        rng=jax.random.key(3),
        max_new_tokens=T,
        num_samples=G,
        temperature=temperature,
        max_new_tokens_bg=BUDGETS,
        engine="paged",
        paged_options=SMALL,
    )
    ref = training_logprobs(model, ids, mask, out, temperature=temperature)
    valid = np.asarray(out.mask)
    assert valid.sum() > 40
    np.testing.assert_allclose(np.asarray(out.logprobs)[valid], ref[valid], atol=1e-4)
    assert (np.asarray(out.logprobs)[~valid] == 0).all()


def test_samples_share_the_prompt_pages(tiny_pair):
    """A 32-token prompt in 4-token pages, G = 4, 3 new tokens each: 8 shared prompt pages,
    and one page per sample for positions 32-33 (the last token is never written)."""
    _, model = tiny_pair("llama3")
    ids, mask = prompts(seed=5, lengths=(32,))
    out, stats = rollout.generate(
        model,
        ids,
        mask,
        rng=jax.random.key(0),
        max_new_tokens=3,
        num_samples=4,
        temperature=1.0,
        stop_token_ids=(),
        engine="paged",
        paged_options=paged.PagedOptions(page_size=4, num_slots=4, steps_per_dispatch=2),
        return_stats=True,
    )
    assert np.asarray(out.mask).all()
    assert stats.peak_pages == 8 + 4
    assert stats.pages_in_use_at_end == 0
    # An odd length: the partial last prompt page exists once per sample (7 shared + 4 tails).
    ids, mask = prompts(seed=5, lengths=(30,))
    _, stats = rollout.generate(
        model,
        ids,
        mask,
        rng=jax.random.key(0),
        max_new_tokens=3,
        num_samples=4,
        stop_token_ids=(),
        engine="paged",
        paged_options=paged.PagedOptions(page_size=4, num_slots=4, steps_per_dispatch=2),
        return_stats=True,
    )
    assert stats.peak_pages == 7 + 4


def shared_prefix_prompts(seed: int = 9):
    """Left-padded prompts in 4-token pages, six beginning with the same 10 tokens (their 2
    whole pages shared): row 1 and row 3 share 16 tokens (4 pages), row 5 is a copy of row 1
    (all its pages but its last token's), row 2 is row 1's first 12 tokens (its third page,
    its last token's, the same as row 1's), row 6 has 22 more tokens after the shared 8 (two
    16-token chunks from offset 8), row 4 shares nothing."""
    rng = np.random.RandomState(seed)
    head, more = rng.randint(3, 90, size=10), rng.randint(3, 90, size=6)
    rows = [
        np.r_[head, rng.randint(3, 90, size=5)],
        np.r_[head, more, rng.randint(3, 90, size=3)],
        np.r_[head, more[:2]],
        np.r_[head, more, rng.randint(3, 90, size=9)],
        rng.randint(3, 90, size=7),
    ]
    rows += [rows[1].copy(), np.r_[head, rng.randint(3, 90, size=20)]]
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), bool)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = row, True
    return ids, mask


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_prompts_with_a_common_prefix_share_its_pages_and_sample_the_same(tiny_pair, temperature):
    """Prefix sharing across prompts: the tokens, log-probs and full log-probs of a run whose
    prompts point at each other's pages equal those of a run where each prompt has its own;
    the shared pages are prefilled once (the prompts that would read them wait one prefill
    call), fewer pages are held, every page comes back, and a pool that preempts (recomputed
    sequences get pages of their own) samples the same again."""
    _, model = tiny_pair("llama3")
    ids, mask = shared_prefix_prompts()
    kw = full_run(11, temperature)
    wide = dataclasses.replace(SMALL, num_slots=16)
    own, own_stats = rollout.generate(
        model, ids, mask, paged_options=dataclasses.replace(wide, prefix_sharing=False), **kw
    )
    out, stats = rollout.generate(model, ids, mask, paged_options=wide, **kw)
    assert_same(own, out)  # log-probs to float noise: other chunk widths, other neighbours
    np.testing.assert_allclose(
        np.asarray(out.full_logprobs), np.asarray(own.full_logprobs), atol=1e-5
    )
    # Shared pages: rows 1, 2 and 6 find row 0's two head pages; rows 3 and 5 row 1's four
    # (written in the call they wait for).
    assert own_stats.shared_prompt_tokens == 0
    assert stats.shared_prompt_tokens == 4 * (2 + 2 + 4 + 4 + 2)
    lengths = mask.sum(1)
    assert own_stats.prefill_tokens == lengths.sum()
    assert stats.prefill_tokens == lengths.sum() - stats.shared_prompt_tokens
    assert own_stats.prefill_calls == 2  # the 25- and 30-token prompts' second chunks
    # rows 0 and 4; rows 1, 2 and 6 (two chunks: 16 + 6 after the shared 8); rows 3 and 5
    assert stats.prefill_calls == 4
    assert stats.peak_pages == own_stats.peak_pages - (2 + 2 + 4 + 4 + 2)
    assert stats.pages_in_use_at_end == own_stats.pages_in_use_at_end == 0
    # Sequences that end at their first token free their pages at once: the pages the
    # deferred prompts wait for are pinned until they are admitted.
    one = {**kw, "max_new_tokens": 1}
    first, first_stats = rollout.generate(model, ids, mask, paged_options=wide, **one)
    assert first_stats.shared_prompt_tokens == stats.shared_prompt_tokens
    assert first_stats.prefill_calls == 4 and first_stats.pages_in_use_at_end == 0
    np.testing.assert_array_equal(np.asarray(first.tokens), np.asarray(own.tokens)[..., :1])
    tight, tight_stats = rollout.generate(
        model, ids, mask, paged_options=dataclasses.replace(wide, num_pages=14), **kw
    )
    assert tight_stats.preemptions > 0 and tight_stats.pages_in_use_at_end == 0
    assert_same(own, tight)


def test_allocator_reference_counts():
    alloc = pages.PageAllocator(6)  # page 0 is the trash page: 5 usable
    assert alloc.reserve(4) and not alloc.reserve(2)
    shared = alloc.take(2, refs=3)
    own = alloc.take(1)
    assert pages.TRASH_PAGE not in shared + own and alloc.in_use == 3
    alloc.release(shared)
    alloc.release(shared)
    assert alloc.in_use == 3  # one reference left
    alloc.release(shared + own)
    alloc.unreserve(1)
    assert alloc.in_use == 0 and alloc.available == 5 and alloc.peak == 3


def test_no_recompilation_for_new_prompts_and_keys(tiny_pair):
    _, model = tiny_pair("llama3")
    kw = dict(
        max_new_tokens=T,
        num_samples=G,
        temperature=1.0,
        max_new_tokens_bg=BUDGETS,
        engine="paged",
        paged_options=dataclasses.replace(SMALL, steps_per_dispatch=3),  # this test's own
    )
    ids, mask = prompts(seed=6, lengths=LENGTHS)
    with CompileCounter() as first:
        jax.block_until_ready(rollout.generate(model, ids, mask, rng=jax.random.key(0), **kw))
    assert first.count > 0  # the decode program is compiled here...
    ids, mask = prompts(seed=7, lengths=LENGTHS)  # other tokens, same lengths
    with CompileCounter() as compiles:
        out = rollout.generate(model, ids, mask, rng=jax.random.key(1), **kw)
        jax.block_until_ready(out)
    assert compiles.count == 0  # ...and reused


def test_a_pool_sized_for_max_prompt_length_compiles_nothing_for_new_prompt_lengths(tiny_pair):
    """The pool's shape is in every program: sized from each call's longest prompt, a batch
    whose longest prompt crosses a page recompiles the engine; sized for ``max_prompt_length``
    (the trainer's ``data.max_prompt_length``), prompts up to it share one pool."""
    _, model = tiny_pair("llama3")
    kw = dict(max_new_tokens=T, num_samples=G, temperature=1.0, engine="paged", return_stats=True)
    longer = tuple(n + 9 for n in LENGTHS)  # 32 tokens at most: 2 more pages of 4 tokens
    bounded = dataclasses.replace(SMALL, max_prompt_length=max(longer))
    counts = {}
    for name, options in (("per call", SMALL), ("bounded", bounded)):
        for i, lengths in enumerate((LENGTHS, longer)):
            ids, mask = prompts(seed=10 + i, lengths=lengths)
            with CompileCounter() as compiles:
                out, stats = rollout.generate(
                    model, ids, mask, rng=jax.random.key(i), paged_options=options, **kw
                )
                jax.block_until_ready(out)
            assert stats.pages_in_use_at_end == 0
            counts[name, i] = compiles.count
    assert counts["per call", 1] > 0  # a larger pool: every program again
    assert counts["bounded", 1] == 0, counts
    # A prompt longer than the bound still runs: the pool grows to hold it (and compiles).
    ids, mask = prompts(seed=12, lengths=(40, 3))
    tight = dataclasses.replace(SMALL, max_prompt_length=8)
    out, stats = rollout.generate(
        model, ids, mask, rng=jax.random.key(3), paged_options=tight, **kw
    )
    assert np.asarray(out.mask).sum() > 0 and stats.pages_in_use_at_end == 0
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=r"max_prompt_length must be an int >= 1 or None"):
            rollout.generate(
                model,
                ids,
                mask,
                rng=jax.random.key(0),
                paged_options=dataclasses.replace(SMALL, max_prompt_length=bad),
                **kw,
            )


def test_memory_utilization_sizes_the_pool_from_the_devices_memory(tiny_pair, monkeypatch):
    """On a device that reports its memory (GPU, TPU; faked here), the default pool is what
    ``memory_utilization`` of it leaves after the memory in use and the engine's largest
    program, up to every live sequence's worst case: sized once, then kept. A tight pool
    preempts and samples the same tokens; too little memory is a clear error; ``num_pages``
    wins."""
    _, model = tiny_pair("llama3")
    ids, mask = prompts(seed=0, lengths=LENGTHS)
    kw = dict(
        rng=jax.random.key(5),
        max_new_tokens=T,
        num_samples=G,
        temperature=1.0,
        max_new_tokens_bg=BUDGETS,
        engine="paged",
        return_stats=True,
    )
    options = dataclasses.replace(SMALL, steps_per_dispatch=2)
    # A CPU reports no memory: the default pool.
    base, base_stats = rollout.generate(model, ids, mask, paged_options=options, **kw)
    default = paged.resolve_options(
        options, num_seqs=10, num_samples=G, longest_prompt=max(LENGTHS), max_new_tokens=T
    )
    assert base_stats.pool_pages == default.num_pages and default.memory_utilization == 0.9

    memory = {"bytes_limit": 1 << 30, "bytes_in_use": 0}
    monkeypatch.setattr(paged, "_memory_stats", lambda device: dict(memory))
    monkeypatch.setattr(paged, "_FITTED", {})
    # Plenty of memory: every slot's worst case (4 slots x ceil((23 + 12) / 4) pages).
    per_seq = -(-(max(LENGTHS) + T) // SMALL.page_size)
    out, stats = rollout.generate(model, ids, mask, paged_options=options, **kw)
    assert stats.pool_pages == 1 + SMALL.num_slots * per_seq and stats.preemptions == 0
    assert_same(base, out)
    (fit,) = paged._FITTED.values()
    assert fit.page_bytes == base_stats.page_bytes  # the run's own page, measured apart
    assert fit.reserve > 0 and fit.limit == 1 << 30

    # Memory for one sequence's worst case and the trash page: the pool the run gets.
    pages = 1 + per_seq
    memory["bytes_in_use"] = int(0.9 * (1 << 30)) - fit.reserve - pages * fit.page_bytes
    paged._FITTED.clear()
    out, stats = rollout.generate(model, ids, mask, paged_options=options, **kw)
    assert stats.pool_pages == pages and stats.preemptions > 0
    assert stats.pages_in_use_at_end == 0
    assert_same(base, out)
    # Sized once: more memory in use later keeps the pool's shape (nothing recompiles).
    memory["bytes_in_use"] += 10 * fit.page_bytes
    with CompileCounter() as compiles:
        again, stats = rollout.generate(model, ids, mask, paged_options=options, **kw)
        jax.block_until_ready(again)
    assert compiles.count == 0 and stats.pool_pages == pages
    # Less than one sequence's worst case: a clear error, naming the figures.
    paged._FITTED.clear()
    with pytest.raises(
        ValueError,
        match=r"at memory_utilization=0\.9 the pool gets \d+ pages of \d+ bytes, fewer than "
        r"one sequence's worst case \(9 pages of 4 tokens.*GiB are in use.*set num_pages",
    ):
        rollout.generate(model, ids, mask, paged_options=options, **kw)
    # num_pages given (or no memory_utilization): the device's memory is not read.
    for given in (dict(num_pages=60), dict(memory_utilization=None)):
        out, stats = rollout.generate(
            model, ids, mask, paged_options=dataclasses.replace(options, **given), **kw
        )
        assert stats.pool_pages == given.get("num_pages", default.num_pages)
        assert_same(base, out)
    for bad in (0, 1.5, True, "0.9"):
        with pytest.raises(ValueError, match=r"memory_utilization must be a fraction in \(0, 1\]"):
            rollout.generate(
                model,
                ids,
                mask,
                paged_options=dataclasses.replace(options, memory_utilization=bad),
                **kw,
            )


def test_a_reserve_that_grows_with_the_pool_is_taken_off_the_pool(tiny_pair, monkeypatch):
    """Where the engine's programs hold temporaries that grow with the pool (XLA:CPU converts
    a bf16 pool to f32 to scatter into it: a real case, no fake), the smallest pool's reserve
    underestimates a larger pool's; the fitted pool with its own reserve still fits the
    memory, where the pool that estimate alone gives would not."""
    _, model = tiny_pair("llama3")
    graphdef, params = nnx.split(model)
    cfg = model.config
    bf16 = jnp.dtype(jnp.bfloat16)
    weights = paged.engine_params(params, cfg.jnp_dtype)
    abstract = paged.EngineParams(
        *jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), weights)
    )
    sizes = dict(
        num_prompts=len(LENGTHS), num_samples=G, longest_prompt=max(LENGTHS), max_new_tokens=T
    )
    program = dict(
        greedy=False, top_k=0, top_p=1.0, pad_token_id=0, num_stop_ids=8, full_logprobs=False
    )
    options = paged.resolve_options(
        SMALL,
        num_seqs=len(LENGTHS) * G,
        num_samples=G,
        longest_prompt=max(LENGTHS),
        max_new_tokens=T,
    )

    def reserve(num_pages: int) -> int:
        worst = paged.worst_case_programs(
            cfg,
            abstract,
            dataclasses.replace(options, num_pages=num_pages),
            None,
            cache_dtype=bf16,
            **sizes,
            **program,
        )
        return paged._program_reserve(graphdef, worst, None)

    cap = paged.pool_pages(SMALL.num_slots, max(LENGTHS), T, SMALL)
    minimum = paged.pool_pages(1, max(LENGTHS), T, SMALL)
    page_bytes = 2 * cfg.num_layers * SMALL.page_size * cfg.num_kv_heads * cfg.head_dim * 2
    assert reserve(cap - 1) > reserve(minimum)  # grows with the pool: what this test is about
    free = reserve(minimum) + (cap - 1) * page_bytes  # the smallest reserve's estimate: cap - 1
    memory = {"bytes_limit": 1 << 30, "bytes_in_use": int(0.9 * (1 << 30)) - free}
    monkeypatch.setattr(paged, "_memory_stats", lambda device: dict(memory))
    monkeypatch.setattr(paged, "_FITTED", {})
    fitted = paged.fit_pool_to_memory(
        graphdef, cfg, None, weights, options, None, cache_dtype=bf16, **sizes, **program
    ).num_pages
    assert minimum < fitted < cap - 1
    assert fitted * page_bytes + reserve(fitted) <= free  # it fits, with its own reserve
    assert (fitted + 1) * page_bytes + reserve(fitted + 1) > free  # and one page more would not
    assert (cap - 1) * page_bytes + reserve(cap - 1) > free  # the estimate alone would not


def test_bad_input_is_a_clear_error(tiny_pair):
    _, model = tiny_pair("llama3")
    ids, mask = prompts(seed=0, lengths=(9, 4))
    kw = dict(rng=jax.random.key(0), max_new_tokens=8, num_samples=2, engine="paged")
    with pytest.raises(ValueError, match=r"prompt 0 \(9 tokens.*needs \d+ pages.*raise num_pages"):
        rollout.generate(
            model, ids, mask, paged_options=paged.PagedOptions(page_size=4, num_pages=4), **kw
        )
    with pytest.raises(ValueError, match="num_pages=1 leaves no page"):
        rollout.generate(model, ids, mask, paged_options=paged.PagedOptions(num_pages=1), **kw)
    with pytest.raises(ValueError, match="num_slots=1 is smaller than num_samples=2"):
        rollout.generate(model, ids, mask, paged_options=paged.PagedOptions(num_slots=1), **kw)
    with pytest.raises(ValueError, match=r"max_new_tokens_bg\[1, 0\] = 9 is outside \[1, "):
        rollout.generate(model, ids, mask, max_new_tokens_bg=[[8, 8], [9, 1]], **kw)
    with pytest.raises(ValueError, match=r"max_new_tokens_bg must have shape \[B, G\]"):
        rollout.generate(model, ids, mask, max_new_tokens_bg=[8, 8], **kw)
    with pytest.raises(ValueError, match="longer than the model's context"):
        rollout.generate(model, ids, mask, **{**kw, "max_new_tokens": 250})
    with pytest.raises(ValueError, match=r"engine must be one of \('auto', 'paged', 'static'\)"):
        rollout.generate(model, ids, mask, **{**kw, "engine": "vllm"})
    with pytest.raises(ValueError, match="prefill_chunk must be a power of two"):
        rollout.generate(model, ids, mask, paged_options=paged.PagedOptions(prefill_chunk=24), **kw)


def test_reference_attention_equals_a_dense_softmax():
    """The two-part softmax (pooled context + new tokens) against one dense masked softmax."""
    rng = np.random.RandomState(0)
    b, t, h, k, d, s = 2, 3, 4, 2, 8, 12
    q = rng.randn(b, t, h, d).astype(np.float32)
    k_new, v_new = (rng.randn(b, t, k, d).astype(np.float32) for _ in range(2))
    k_ctx, v_ctx = (rng.randn(b, s, k, d).astype(np.float32) for _ in range(2))
    ctx_len = np.array([5, 0], np.int32)
    valid = np.array([[1, 1, 1], [1, 1, 0]], bool)
    for window in (3, 2**30):
        got = pages.paged_attention_reference(q, k_new, v_new, k_ctx, v_ctx, ctx_len, valid, window)
        for i in range(b):
            keys = np.concatenate([k_ctx[i, : ctx_len[i]], k_new[i]])
            vals = np.concatenate([v_ctx[i, : ctx_len[i]], v_new[i]])
            key_ok = np.concatenate([np.ones(ctx_len[i], bool), valid[i]])
            pos = np.arange(len(keys))
            for j in range(t):
                qp = ctx_len[i] + j
                ok = key_ok & (pos <= qp) & (qp - pos < window)
                for hh in range(h):
                    sc = keys[:, hh // 2] @ q[i, j, hh] / np.sqrt(d)
                    sc = np.where(ok, sc, -np.inf)
                    p = np.exp(sc - sc.max())
                    want = (p / p.sum()) @ vals[:, hh // 2]
                    np.testing.assert_allclose(np.asarray(got)[i, j, hh], want, atol=1e-5)


def test_a_dispatch_writes_its_new_tokens_back_to_the_pool_once():
    """``write_back`` against a loop: row n's valid steps j (its first ones: a stopped row stays
    stopped) copy dense slot ``lens_n + j`` to its table's page and offset; other pages keep
    their values, and only the trash page takes the invalid steps."""
    rng = np.random.RandomState(3)
    n, k, kv, d, ps, w, num_pages = 3, 4, 2, 5, 4, 3, 10
    s = w * ps
    table = np.array([[1, 2, 3], [4, 5, 0], [6, 7, 8]], np.int32)  # row 1 has 2 pages
    lens = np.array([2, 6, 11], np.int32)  # row 2 may write 1 token, at slot 11
    valid = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]], bool)  # [k, N]
    keys_nkds = rng.randn(n, kv, d, s).astype(np.float32)
    values_nksd = rng.randn(n, kv, s, d).astype(np.float32)
    pool_k, pool_v = (rng.randn(num_pages, ps, kv, d).astype(np.float32) for _ in range(2))
    got = paged.write_back(
        pages.PagePool((jnp.asarray(pool_k),), (jnp.asarray(pool_v),)),
        paged.DenseContext((jnp.asarray(keys_nkds),), (jnp.asarray(values_nksd),)),
        jnp.asarray(table),
        jnp.asarray(lens),
        jnp.asarray(valid),
        ps,
    )
    want_k, want_v = pool_k.copy(), pool_v.copy()
    for row in range(n):
        for j in range(k):
            if valid[j, row]:
                pos = lens[row] + j
                page, off = table[row, pos // ps], pos % ps
                want_k[page, off] = keys_nkds[row, :, :, pos]
                want_v[page, off] = values_nksd[row, :, pos]
    live = np.arange(num_pages) != pages.TRASH_PAGE
    np.testing.assert_array_equal(np.asarray(got.k[0])[live], want_k[live])
    np.testing.assert_array_equal(np.asarray(got.v[0])[live], want_v[live])


def test_pallas_gpu_paged_attention_wiring_in_interpret_mode():
    """JAX's Pallas GPU paged-attention kernel on this pool layout equals the reference."""
    rng = np.random.RandomState(1)
    n, h, kv, d, ps, num_pages = 3, 4, 2, 16, 4, 9
    pool_k, pool_v = (rng.randn(num_pages, ps, kv, d).astype(np.float32) for _ in range(2))
    table = np.array([[3, 1, 5, 0], [2, 0, 0, 0], [8, 7, 6, 4]], np.int32)
    lengths = np.array([10, 3, 16], np.int32)
    q = rng.randn(n, h, d).astype(np.float32)
    got = pages.pallas_gpu_decode_attention(q, pool_k, pool_v, table, lengths, interpret=True)
    # The reference with the last pooled token as the "new" one.
    k_all = pages.gather_pages(jnp.asarray(pool_k)[None], 0, table)
    v_all = pages.gather_pages(jnp.asarray(pool_v)[None], 0, table)
    last = lengths - 1
    k_new = k_all[np.arange(n), last][:, None]
    v_new = v_all[np.arange(n), last][:, None]
    want = pages.paged_attention_reference(
        q[:, None], k_new, v_new, k_all, v_all, last, np.ones((n, 1), bool), 2**30
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want)[:, 0], atol=1e-5)


@pytest.mark.parametrize("preset", ["dp", "fsdp_tp"])
def test_sharded_parameters_give_the_single_device_tokens(tiny_pair, preset):
    from flax import nnx

    from jaxrl_llm.models import sharding

    _, model = tiny_pair("llama3")
    assert len(jax.devices()) == 8
    ids, mask = prompts(seed=8, lengths=LENGTHS)
    kw = dict(
        rng=jax.random.key(5),
        max_new_tokens=T,
        num_samples=G,
        temperature=1.0,
        max_new_tokens_bg=BUDGETS,
        engine="paged",
        paged_options=SMALL,
    )
    single = rollout.generate(model, ids, mask, **kw)
    graphdef, state = nnx.split(model)
    mesh, rules = sharding.preset(preset)
    params = jax.device_put(nnx.to_pure_dict(state), sharding.param_shardings(state, mesh, rules))
    out = rollout.generate((graphdef, params), ids, mask, **kw)
    assert_same(single, out)


def test_rollout_engine_config_reaches_the_sampler():
    from jaxrl_llm.config import ConfigError
    from jaxrl_llm.train import setup as S
    from tests.train import helpers as H

    small = ("rollout.prompts_per_step=2", "rollout.num_samples=2", "data.eval_size=4")
    engine = lambda *o: S.resolve(H.config("tiny.yaml", *small, *o)).sampler.engine
    # auto (the default): paged, as completions stop at EOS; static when none can stop early.
    assert engine() == "paged"
    assert engine("rollout.stop_token_ids=[]") == "static"
    assert engine("rollout.engine=static") == "static"
    assert engine("rollout.engine=paged", "rollout.stop_token_ids=[]") == "paged"
    setup = S.resolve(H.config("tiny.yaml", *small, "rollout.engine=paged"))
    assert setup.sampler.engine == "paged" and setup.sampler.greedy().engine == "paged"
    with pytest.raises(ConfigError, match="engine"):
        H.config("tiny.yaml", "rollout.engine=vllm")
    # The slots and the pool: the engine's defaults, or the config's (tokens -> whole pages).
    options = setup.sampler.paged_options()
    assert options.num_slots is None and options.num_pages is None
    # the default pool is sized once, for data.max_prompt_length (one pool shape per run)
    assert options.max_prompt_length == H.config("tiny.yaml").data.max_prompt_length
    assert setup.sampler.greedy().paged_options().max_prompt_length == options.max_prompt_length
    # on a GPU/TPU, sized by the fraction of device memory in use while sampling
    assert options.memory_utilization == 0.9
    tight = S.resolve(H.config("tiny.yaml", *small, "rollout.memory_utilization=0.5"))
    assert tight.sampler.paged_options().memory_utilization == 0.5
    for bad in ("0", "1.2"):
        with pytest.raises(ConfigError, match="memory_utilization"):
            H.config("tiny.yaml", f"rollout.memory_utilization={bad}")
    sized = ("rollout.max_num_seqs=8", "rollout.max_total_tokens=100")
    options = S.resolve(H.config("tiny.yaml", *small, *sized)).sampler.paged_options()
    assert options.num_slots == 8 and options.num_pages == 1 + 7  # 16-token pages
    with pytest.raises(ConfigError, match="max_total_tokens"):
        H.config("tiny.yaml", "rollout.max_total_tokens=-1")
    with pytest.raises(
        ConfigError, match=r"max_num_seqs = 1 is smaller than rollout\.num_samples = 2:"
    ):
        H.config("tiny.yaml", *small, "rollout.max_num_seqs=1")


@pytest.mark.slow
def test_smollm2_greedy_equals_transformers_generate(smollm2, smollm2_hf, smollm2_tokenizer):
    """The real default model (fp32): paged greedy tokens = transformers' greedy tokens."""
    import torch

    from tests.rollout.test_smollm2 import PROMPTS

    tok = smollm2_tokenizer
    ids, mask = rollout.encode_prompts(tok, PROMPTS)
    out = rollout.generate(
        smollm2,
        ids,
        mask,
        rng=jax.random.key(0),
        max_new_tokens=24,
        temperature=0.0,
        engine="paged",
        paged_options=paged.PagedOptions(num_slots=2, steps_per_dispatch=8, prefill_chunk=16),
    )
    tokens, valid = np.asarray(out.tokens[:, 0]), np.asarray(out.mask[:, 0])
    for i in range(len(PROMPTS)):
        prompt = ids[i][mask[i]]
        assert len(prompt) > 16  # a chunked prefill
        with torch.no_grad():
            ref = smollm2_hf.generate(
                torch.tensor(prompt[None], dtype=torch.long),
                do_sample=False,
                max_new_tokens=24,
                pad_token_id=tok.pad_token_id,
            )[0, len(prompt) :].tolist()
        assert tokens[i][valid[i]].tolist() == ref, f"prompt {i}"


def _parameter_shapes(compiled) -> set[str]:
    """The shapes (``f32[3,40,88]``) of a compiled program's entry parameters."""
    hlo = compiled.as_text()
    entry = hlo[hlo.index("\nENTRY") :]
    return set(re.findall(r"= (\w+\[[\d,]*\])\S* parameter\(", entry.split("\n}\n")[0]))


def test_programs_take_the_layer_weights_sliced_once_per_run():
    """run slices the stacked [L, ...] layer weights once (paged.engine_params) and passes the
    per-layer copies, with the other parameters but not the stacked layers, to every _prefill
    and _decode call, so no call copies them again and no run holds the stacked copy beside
    its slices: the compiled programs take the per-layer copies, not the stacked weights.
    Without the copies (layers_l None, the whole parameters) they take the stacked weights.
    (That run passes these arguments: test_paged_worst_case_shapes_are_what_run_passes in
    tests/train/test_plan.py.)"""
    from flax import nnx

    from jaxrl_llm import models
    from jaxrl_llm.models.tiny import tiny_random_config
    from jaxrl_llm.rollout import engine

    cfg = tiny_random_config(vocab_size=96, num_layers=3, hidden_size=40, intermediate_size=88)
    graphdef, state = nnx.split(models.CausalLM(cfg, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)
    shape = dict(num_samples=2, longest_prompt=8, max_new_tokens=8)
    options = paged.resolve_options(SMALL, num_seqs=4, **shape)
    worst = paged.worst_case_programs(
        cfg,
        params,
        options,
        None,
        num_prompts=2,
        **shape,
        greedy=True,
        top_k=0,
        top_p=1.0,
        pad_token_id=0,
        cache_dtype=jnp.float32,
        num_stop_ids=engine._stop_ids((), cfg).shape[0],
    )
    leaves = jax.tree.leaves(params["model"]["layers"])
    stacked = {f"f32[{','.join(map(str, x.shape))}]" for x in leaves}
    per_layer = {f"f32[{','.join(map(str, x.shape[1:]))}]" for x in leaves}
    for call in (worst.prefill, worst.decode):
        rest, layers_l = call.args[:2]
        assert len(layers_l) == cfg.num_layers and "layers" not in rest["model"]
        whole = jax.eval_shape(lambda: params)
        for given in (layers_l, None):
            args = (rest if given is not None else whole, given, *call.args[2:])
            taken = _parameter_shapes(call.fn.lower(graphdef, *args, static=call.static).compile())
            assert bool(taken & stacked) == (given is None), (call.fn.__name__, sorted(taken))
            if given is not None:
                assert per_layer <= taken
