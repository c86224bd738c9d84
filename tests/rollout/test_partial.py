"""Partial rollouts (rollout/partial.py) on tiny random models: segmented generation equals one
``generate(engine="paged")`` call when the weights do not change, the version tags and
log-probs when they do, done samples left alone, bounded compiles, bad input."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import rollout
from jaxrl_llm.models.transformer import CausalLM
from jaxrl_llm.rollout import paged, paged_dp, partial
from tests.rollout.test_generate import prompts, training_logprobs
from tests.rollout.test_paged import CompileCounter, assert_same

LENGTHS = (9, 4, 1, 6, 23)  # ragged; 23 > prefill_chunk: chunked (re-)prefills
T, G = 12, 2
BUDGETS = np.array([[12, 3], [1, 12], [7, 8], [12, 5], [2, 9]], np.int32)
SMALL = paged.PagedOptions(page_size=4, num_slots=4, steps_per_dispatch=4, prefill_chunk=16)
KW = dict(max_new_tokens=T, num_samples=G, max_new_tokens_bg=BUDGETS, paged_options=SMALL)


def one_shot(model, ids, mask, **kw):
    return rollout.generate(model, ids, mask, engine="paged", **{**KW, **kw})


def stop_ids(model, ids, mask, **kw) -> tuple[int, ...]:
    """The 3 tokens most sampled mid-sequence here, so that stop ids really end samples."""
    out = one_shot(model, ids, mask, stop_token_ids=(), **kw)
    tokens = np.asarray(out.tokens)[:, :, 2:8][np.asarray(out.mask)[:, :, 2:8]]
    values, counts = np.unique(tokens, return_counts=True)
    return tuple(int(v) for v in values[np.argsort(-counts, kind="stable")[:3]])


def other_weights(model):
    """A second initialisation of the same tiny architecture (same graph: no recompiles)."""
    return nnx.split(CausalLM(model.config, rngs=nnx.Rngs(1)))


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.0), dict(temperature=1.0, top_k=20)], ids=["greedy", "sampled"]
)
def test_segmented_equals_one_shot_with_the_same_weights(tiny_pair, sampling):
    _, model = tiny_pair("llama3")
    ids, mask = prompts(seed=2, lengths=LENGTHS)
    rng = jax.random.key(5)
    stop = stop_ids(model, ids, mask, rng=rng, **sampling)
    ref = one_shot(model, ids, mask, rng=rng, stop_token_ids=stop, **sampling)
    stopped = (np.asarray(ref.mask).sum(-1) < BUDGETS) & ~np.asarray(ref.truncated)
    assert stopped.sum() >= 2  # the stop id ends some samples before their budget
    assert np.asarray(ref.truncated).sum() >= 2  # and budgets end others
    for segment in (1, 3, T + 4):
        out = partial.generate_partial(
            [model], ids, mask, rng=rng, segment_tokens=segment, stop_token_ids=stop,
            **KW, **sampling,
        )  # fmt: skip
        np.testing.assert_array_equal(np.asarray(out.mask), np.asarray(ref.mask))
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
        np.testing.assert_array_equal(np.asarray(out.truncated), np.asarray(ref.truncated))
        np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=1e-5)
        assert (np.asarray(out.version) == np.where(np.asarray(ref.mask), 0, -1)).all()


@pytest.mark.parametrize("layout", ["fsdp4_tp2", "data2"])
def test_sharded_segments_run_generates_engines_and_equal_one_shot(tiny_pair, layout):
    """As ``generate`` runs them: ``tensor_parallel=2`` on an FSDP mesh of 4, each segment on 2
    two-device engines (the weights split over each engine's devices); a data-parallel mesh
    of 2, one engine per data shard (not one engine over both devices). Either gives the
    one-device one-shot tokens."""
    from jaxrl_llm.models import sharding

    _, model = tiny_pair("llama3")
    ids, mask = prompts(seed=2, lengths=LENGTHS)
    rng = jax.random.key(5)
    ref = one_shot(model, ids, mask, rng=rng, temperature=1.0)
    graphdef, state = nnx.split(model)
    if layout == "fsdp4_tp2":
        mesh = sharding.make_mesh(fsdp=4, devices=jax.devices()[:4])
        options = dataclasses.replace(SMALL, tensor_parallel=2)
    else:
        mesh = sharding.make_mesh(data=2, devices=jax.devices()[:2])
        options = SMALL
    params = jax.device_put(nnx.to_pure_dict(state), sharding.param_shardings(state, mesh))
    out = partial.generate_partial(
        [(graphdef, params)], ids, mask, rng=rng, segment_tokens=5, temperature=1.0,
        **{**KW, "paged_options": options},
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.mask), np.asarray(ref.mask))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=1e-5)
    # Default slots and pool: each engine sized for its share of the whole rollout (3 of the 5
    # prompts x G), the same in every segment, not for the rows and contexts a segment has left.
    runs = []
    run = paged.run

    def recording_run(*args, **kwargs):
        arrays, stats = run(*args, **kwargs)
        runs.append((kwargs["options"].num_slots, stats.pool_pages))
        return arrays, stats

    with pytest.MonkeyPatch.context() as m:
        m.setattr(paged, "run", recording_run)
        default = dataclasses.replace(options, num_slots=None)
        again = partial.generate_partial(
            [(graphdef, params)], ids, mask, rng=rng, segment_tokens=2, temperature=1.0,
            **{**KW, "paged_options": default},
        )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(ref.tokens))
    width = ids.shape[1]
    assert len(runs) > 4 and set(runs) == {(8, paged.pool_pages(8, width, T, SMALL))}, runs
    stats = []  # two engines in every segment
    state = partial.start(len(LENGTHS), G, T, max_new_tokens_bg=BUDGETS)
    partial.advance(
        (graphdef, params), ids, mask, state, rng=rng, version=0, segment_tokens=2,
        temperature=1.0, paged_options=options, stats=stats,
    )  # fmt: skip
    (seg_stats,) = stats
    assert isinstance(seg_stats, paged_dp.DataParallelStats) and len(seg_stats.shards) == 2


def test_static_engine_draws_the_paged_engines_tokens(tiny_pair):
    """The static engine with per-row keys: segmented static == one-shot paged (same keys;
    top-p and the model's EOS as stop id), whatever the segmentation."""
    _, model = tiny_pair("qwen2")
    ids, mask = prompts(seed=7, lengths=LENGTHS)
    kw = dict(rng=jax.random.key(3), temperature=1.0, top_p=0.9)
    ref = one_shot(model, ids, mask, **kw)
    for segment in (3, T + 4):
        out = partial.generate_partial(
            [model], ids, mask, segment_tokens=segment, engine="static", **KW, **kw
        )
        np.testing.assert_array_equal(np.asarray(out.mask), np.asarray(ref.mask))
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
        np.testing.assert_array_equal(np.asarray(out.truncated), np.asarray(ref.truncated))
        np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=1e-5)


def test_weights_switch_between_segments(tiny_pair):
    _, model_a = tiny_pair("llama3")
    model_b = other_weights(model_a)
    ids, mask = prompts(seed=3, lengths=LENGTHS)
    kw = dict(rng=jax.random.key(9), temperature=1.0, stop_token_ids=())
    first = 4
    state = partial.start(len(LENGTHS), G, T, BUDGETS)
    state = partial.advance(
        model_a, ids, mask, state, version=0, segment_tokens=first, paged_options=SMALL, **kw
    )
    np.testing.assert_array_equal(state.num_new_bg, np.minimum(BUDGETS, first))
    while not state.done_bg.all():
        state = partial.advance(
            model_b, ids, mask, state, version=1, segment_tokens=3, paged_options=SMALL, **kw
        )
    out = partial.finish(state)
    tokens, valid, version = (np.asarray(x) for x in (out.tokens, out.mask, out.version))
    position = np.arange(T)[None, None]
    np.testing.assert_array_equal(version, np.where(valid, (position >= first).astype(int), -1))
    # Segment 1 is version 0 and A's one-shot prefix.
    only_a = one_shot(model_a, ids, mask, **kw)
    head = valid & (position < first)
    np.testing.assert_array_equal(tokens[head], np.asarray(only_a.tokens)[head])
    # Each token's log-prob is the trainer's under the version that sampled it.
    for v, m in ((0, model_a), (1, nnx.merge(*model_b))):
        ref = training_logprobs(m, ids, mask, out, temperature=1.0)
        tagged = version == v
        assert tagged.sum() > 10
        np.testing.assert_allclose(np.asarray(out.logprobs)[tagged], ref[tagged], atol=1e-4)
    # The switch happened: after it the tokens are not A's.
    tail = valid & (position >= first)
    assert (tokens[tail] != np.asarray(only_a.tokens)[tail]).mean() > 0.5


def test_done_samples_are_not_continued(tiny_pair, monkeypatch):
    _, model = tiny_pair("llama3")
    ids, mask = prompts(seed=4, lengths=LENGTHS)
    rows = []
    run = paged.run

    def counting_run(graphdef, mesh, params, contexts, budgets, **kw):
        rows.append((len(contexts), budgets.size))  # (contexts prefilled, samples)
        return run(graphdef, mesh, params, contexts, budgets, **kw)

    monkeypatch.setattr(partial.paged, "run", counting_run)
    kw = dict(rng=jax.random.key(1), segment_tokens=3, paged_options=SMALL, stop_token_ids=())
    state = partial.start(len(LENGTHS), G, T, BUDGETS)
    state = partial.advance(model, ids, mask, state, version=0, **kw)
    done = state.done_bg.copy()
    np.testing.assert_array_equal(done, BUDGETS <= 3)
    before = state
    state = partial.advance(model, ids, mask, state, version=2, **kw)
    # Segment 1 prefills each prompt once for its G samples; segment 2 runs the live ones only.
    assert rows == [(len(LENGTHS), len(LENGTHS) * G), (int((~done).sum()),) * 2]
    for name in ("tokens_bgt", "mask_bgt", "logp_bgt", "version_bgt", "num_new_bg"):
        np.testing.assert_array_equal(getattr(state, name)[done], getattr(before, name)[done])
    fresh = state.mask_bgt & ~before.mask_bgt
    assert fresh.sum() == (np.minimum(BUDGETS, 6) - 3)[~done].sum()
    assert (state.version_bgt[fresh] == 2).all()
    while not state.done_bg.all():
        state = partial.advance(model, ids, mask, state, version=2, **kw)
    calls = len(rows)
    again = partial.advance(model, ids, mask, state, version=3, **kw)
    assert len(rows) == calls  # all done: nothing runs
    np.testing.assert_array_equal(again.tokens_bgt, state.tokens_bgt)
    assert again.segments == state.segments and again.last_version == 3


def test_later_segments_prefill_a_prompts_pages_once_for_its_samples(tiny_pair):
    """After the first segment each continuing sample is its own context, prompt ⧺ tokens so
    far; with prefix sharing the samples of a prompt seated together (16 slots: all) share its
    whole pages (prefilled once)."""
    _, model = tiny_pair("llama3")
    ids, mask = prompts(seed=2, lengths=(20, 33, 17))
    shared = {}
    for share in (True, False):
        options = dataclasses.replace(SMALL, num_slots=16, prefix_sharing=share)
        state, stats = partial.start(3, 4, 12), []
        while not state.done_bg.all():
            state = partial.advance(
                model, ids, mask, state, rng=jax.random.key(0), version=0, segment_tokens=4,
                paged_options=options, stats=stats, stop_token_ids=(),
            )  # fmt: skip
        shared[share] = [(s.shared_prompt_tokens, s.prefill_tokens) for s in stats]
    # 3 of each prompt's 4 samples take its whole 4-token pages (20 + 32 + 16 tokens) from the
    # first: 3 · 68 = 204 tokens not prefilled in each later segment
    assert [s for s, _ in shared[True]] == [0, 204, 204]
    assert [s for s, _ in shared[False]] == [0, 0, 0]
    for (_, ran), (_, alone) in zip(shared[True][1:], shared[False][1:], strict=True):
        assert ran + 204 == alone


def test_a_second_batch_compiles_nothing(tiny_pair):
    """Every segment's shapes come from (B, G, T, P): a second batch of the same shapes, with
    other prompts, weights and key, reuses the first one's programs."""
    _, model = tiny_pair("llama3")
    own = dataclasses.replace(SMALL, steps_per_dispatch=5)  # this test's own programs
    kw = dict(segment_tokens=5, temperature=1.0, stop_token_ids=(), **{**KW, "paged_options": own})
    ids, mask = prompts(seed=5, lengths=LENGTHS)
    with CompileCounter() as first:
        partial.generate_partial([model], ids, mask, rng=jax.random.key(0), **kw)
    ids, mask = prompts(seed=6, lengths=LENGTHS)
    other = other_weights(model)  # its initialisation compiles (alone, nothing had before)
    with CompileCounter() as second:
        out = partial.generate_partial([model, other], ids, mask, rng=jax.random.key(1), **kw)
        jax.block_until_ready(out)
    assert first.count > 0 and second.count == 0
    assert set(np.unique(np.asarray(out.version))) == {-1, 0, 1}  # the last model serves segment 3


def test_memory_utilization_fits_one_pool_for_the_whole_rollout(tiny_pair, monkeypatch):
    """On a device that reports its memory (faked), every segment runs the pool fitted once
    for the whole rollout (B, G, T, P), not for its own contexts, and samples one-shot's
    tokens; its reserve covers the later segments' programs (each sequence prefilled alone
    from its context), so it is at least a one-shot call's."""
    _, model = tiny_pair("llama3")
    ids, mask = prompts(seed=3, lengths=LENGTHS)
    kw = dict(rng=jax.random.key(2), temperature=1.0, stop_token_ids=(), **KW)
    ref = one_shot(model, ids, mask, **kw)  # a CPU reports no memory: the default pool
    pools = []
    run = paged.run

    def recording_run(*args, **kwargs):
        arrays, stats = run(*args, **kwargs)
        pools.append((stats.pool_pages, stats.preemptions))
        return arrays, stats

    worst_cases = []
    worst = paged.worst_case_programs

    def recording_worst(*args, **kwargs):
        sizes = ("num_prompts", "num_samples", "longest_prompt", "max_new_tokens")
        worst_cases.append(tuple(kwargs[k] for k in sizes))
        return worst(*args, **kwargs)

    memory = {"bytes_limit": 1 << 30, "bytes_in_use": 0}
    monkeypatch.setattr(paged, "_memory_stats", lambda device: dict(memory))
    monkeypatch.setattr(paged, "_FITTED", {})
    monkeypatch.setattr(partial.paged, "run", recording_run)
    monkeypatch.setattr(paged, "worst_case_programs", recording_worst)
    # Plenty of memory: every live sequence's worst case of the whole rollout, every segment.
    cap = paged.pool_pages(SMALL.num_slots, ids.shape[1], T, SMALL)  # 4 slots < B·G = 10
    out = partial.generate_partial([model], ids, mask, segment_tokens=3, **kw)
    assert_same(ref, out)
    assert len(pools) >= 3 and {p for p, _ in pools} == {cap}, pools
    (fit,) = paged._FITTED.values()
    b, p = len(LENGTHS), ids.shape[1]
    # the first segment's programs, and a later one's: each sequence alone, a P + T - 1 context
    assert set(worst_cases) == {(b, G, p, T), (b * G, 1, p + T - 1, 1)}, worst_cases
    with monkeypatch.context() as m:  # a one-shot call's fit, for comparison
        m.setattr(paged, "_FITTED", {})
        one_shot(model, ids, mask, **kw)
        (one,) = paged._FITTED.values()
    assert fit.reserve >= one.reserve > 0 and fit.page_bytes == one.page_bytes

    # Memory for one sequence's worst case: every segment gets that pool, preempts, and still
    # samples one-shot's tokens.
    pages = paged.pool_pages(1, ids.shape[1], T, SMALL)
    memory["bytes_in_use"] = int(0.9 * (1 << 30)) - fit.reserve - pages * fit.page_bytes
    paged._FITTED.clear()
    pools.clear()
    out = partial.generate_partial([model], ids, mask, segment_tokens=3, **kw)
    assert_same(ref, out)
    assert {p for p, _ in pools} == {pages} and sum(n for _, n in pools) > 0, pools


def test_bad_input_is_a_clear_error(tiny_pair):
    _, model = tiny_pair("llama3")
    ids, mask = prompts(seed=0, lengths=(9, 4))
    state = partial.start(2, G, 6)
    kw = dict(rng=jax.random.key(0), paged_options=SMALL, stop_token_ids=())
    with pytest.raises(ValueError, match="segment_tokens must be >= 1, got 0"):
        partial.advance(model, ids, mask, state, version=0, segment_tokens=0, **kw)
    later = partial.advance(model, ids, mask, state, version=3, segment_tokens=2, **kw)
    with pytest.raises(ValueError, match=r"version 2 goes backwards.*by version 3"):
        partial.advance(model, ids, mask, later, version=2, segment_tokens=2, **kw)
    with pytest.raises(ValueError, match="3 prompts, but this in-flight batch has B = 2"):
        partial.advance(
            model, *prompts(seed=0, lengths=(9, 4, 2)), state, version=0, segment_tokens=2, **kw
        )
    with pytest.raises(ValueError, match="rng differs from the key of this batch's earlier"):
        partial.advance(
            model, ids, mask, later, version=3, segment_tokens=2, rng=jax.random.key(1)
        )  # fmt: skip
    with pytest.raises(ValueError, match="engine must be 'paged' or 'static', got 'vllm'"):
        partial.advance(model, ids, mask, state, version=0, segment_tokens=2, engine="vllm", **kw)
    with pytest.raises(TypeError, match=r"inflight must be a partial\.InFlight"):
        partial.advance(model, ids, mask, {}, version=0, segment_tokens=2, **kw)
    with pytest.raises(ValueError, match=r"max_new_tokens_bg\[0, 1\] = 7 is outside"):
        partial.start(2, G, 6, [[1, 7], [2, 2]])
    with pytest.raises(ValueError, match=r"4 samples are not done.*prompt 0, sample 0, 2 of 6"):
        partial.finish(later)
    out = partial.finish(later, allow_unfinished=True)
    assert np.asarray(out.truncated).all() and (np.asarray(out.version)[..., :2] == 3).all()


# ---------------------------------------------------------------------------------------------
# Two processes (jax.distributed on CPU, gloo), two devices each: every process passes the whole
# batch, samples its share of each segment's rows and gets back the one-process rollout.

LONG_ONE = np.array([[12, 3], [1, 2], [3, 4], [2, 5], [2, 3]], np.int32)  # late segments: 1 row

CHILD = """\
import sys

from jaxrl_llm import distributed as dist

port, pid, model_dir, batch, out = sys.argv[1], int(sys.argv[2]), *sys.argv[3:]
dist.initialize(f"127.0.0.1:{port}", 2, pid)

import jax
import numpy as np
from flax import nnx

from jaxrl_llm import models
from jaxrl_llm.models import sharding
from jaxrl_llm.rollout import paged, partial

assert jax.process_count() == 2 and len(jax.local_devices()) == 2
data = np.load(batch)
small = paged.PagedOptions(page_size=4, num_slots=4, steps_per_dispatch=4, prefill_chunk=16)
kw = dict(max_new_tokens=int(data["T"]), num_samples=int(data["G"]), segment_tokens=3,
          paged_options=small)
results = {}
# data2_tensor2: one two-device engine per process; fsdp4: two one-device engines per process
for name, sizes in (("data2_tensor2", dict(data=2, tensor=2)), ("fsdp4", dict(fsdp=4))):
    model = models.from_pretrained(model_dir, mesh=sharding.make_mesh(**sizes))
    graphdef, state = nnx.split(model)
    later = (graphdef, jax.tree.map(lambda x: x * 0.9, nnx.to_pure_dict(state)))
    for case, budgets, temperature, stop in (
        ("sampled", data["budgets"], 1.0, tuple(data["stop"])),
        ("long_one", data["long_one"], 0.0, ()),
    ):
        seen = []

        def pick(i):  # version 0 for the first segment, then the other weights
            seen.append(i)
            return (model, 0) if i == 0 else (later, 1)

        got = partial.generate_partial(
            pick, data["ids"], data["mask"], rng=jax.random.key(5), temperature=temperature,
            max_new_tokens_bg=budgets, stop_token_ids=stop, **kw,
        )
        for field in ("tokens", "mask", "logprobs", "truncated", "version"):
            results[f"{name}/{case}/{field}"] = np.asarray(getattr(got, field))
        results[f"{name}/{case}/segments"] = len(seen)
try:  # process 1 passes other prompts: both processes refuse, neither hangs
    partial.generate_partial(
        [model], data["ids"] + pid, data["mask"], rng=jax.random.key(5), **kw
    )
except ValueError as e:
    results["different_prompts"] = str(e)
try:
    partial.generate_partial(
        [model], data["ids"], data["mask"], rng=jax.random.key(5), engine="static", **kw
    )
except ValueError as e:
    results["static"] = str(e)
np.savez(out, **results)
print("done", flush=True)
"""


@pytest.mark.slow
def test_two_processes_sample_their_shares_and_get_the_one_process_rollout(tiny_pair, tmp_path):
    """Two processes, two devices each, two layouts (one tensor-parallel engine per process;
    two one-device engines per process): every process returns the one-process partial
    rollout (weights switched after the first segment), also when a late segment has one
    unfinished sample (process 1's share empty). Different prompts, and the static engine,
    are clear errors."""
    from tests.rollout.test_paged_dp import run_two_processes

    hf, model = tiny_pair("llama3")
    ids, mask = prompts(seed=2, lengths=LENGTHS)
    rng = jax.random.key(5)
    stop = stop_ids(model, ids, mask, rng=rng, temperature=1.0)
    graphdef, state = nnx.split(model)
    later = (graphdef, jax.tree.map(lambda x: x * 0.9, nnx.to_pure_dict(state)))
    kw = dict(max_new_tokens=T, num_samples=G, segment_tokens=3, paged_options=SMALL)
    refs = {}
    for case, budgets, temperature, s in (
        ("sampled", BUDGETS, 1.0, stop),
        ("long_one", LONG_ONE, 0.0, ()),
    ):
        refs[case] = partial.generate_partial(
            lambda i: (model, 0) if i == 0 else (later, 1), ids, mask, rng=rng,
            temperature=temperature, max_new_tokens_bg=budgets, stop_token_ids=s, **kw,
        )  # fmt: skip
    assert (np.asarray(refs["sampled"].version) == 1).sum() > 10  # both versions sampled
    hf.save_pretrained(tmp_path / "model")
    np.savez(
        tmp_path / "batch.npz", ids=ids, mask=mask, budgets=BUDGETS, long_one=LONG_ONE,
        stop=np.asarray(stop), T=T, G=G,
    )  # fmt: skip
    args = [str(tmp_path / "model"), str(tmp_path / "batch.npz")]
    got = run_two_processes(CHILD, args, tmp_path, "partial rollouts on two processes", limit=300)
    for name in ("data2_tensor2", "fsdp4"):
        for case, ref in refs.items():
            for g in got:  # every process holds the whole batch
                out = partial.PartialGeneration(
                    **{f: g[f"{name}/{case}/{f}"] for f in ref._fields if f != "full_logprobs"}
                )
                assert_same(ref, out, logp_atol=1e-4)
                np.testing.assert_array_equal(np.asarray(out.version), np.asarray(ref.version))
    # the long one continues alone for its last segments: 4 segments (3 + 3 + 3 + 3 tokens)
    assert all(int(g["fsdp4/long_one/segments"]) == 4 for g in got)
    for g in got:
        assert "the processes passed different prompts" in str(g["different_prompts"])
        assert "engine='static' runs in one process (2 processes here)" in str(g["static"])
