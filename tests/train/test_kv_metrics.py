"""The trainer logs the paged engine's KV-cache use: the pool, its busiest moment, preemptions
(``collect.kv_metrics``), and warns once a run when the pool made the engine preempt."""

from __future__ import annotations

import jax
import pytest

from jaxrl_llm.data import BatchIterator
from jaxrl_llm.rollout.paged import PagedStats
from jaxrl_llm.rollout.paged_dp import DataParallelStats
from jaxrl_llm.train import loop
from jaxrl_llm.train import setup as setup_lib
from jaxrl_llm.train.collect import collect, engine_rows, kv_metrics
from jaxrl_llm.train.metrics import read_metrics
from tests.train import helpers as H

GIB = 2.0**30


def _stats(peak, pool, preempt, dispatches, page_bytes=1024, ran=30, shared=10, steps=0, stolen=0):
    return PagedStats(
        peak_pages=peak,
        page_bytes=page_bytes,
        decode_dispatches=dispatches,
        prefill_calls=3,
        pages_in_use_at_end=0,
        preemptions=preempt,
        pool_pages=pool,
        prefill_tokens=ran,
        shared_prompt_tokens=shared,
        decode_steps=steps,
        prompts_stolen=stolen,
    )


def test_kv_metrics_take_the_busiest_engine_and_sum_the_preemptions():
    one = engine_rows(_stats(peak=6, pool=9, preempt=1, dispatches=5, steps=40))
    assert one.tolist() == [[6, 9, 1024, 1, 5, 30, 10, 40, 0]]
    shards = DataParallelStats.combine(
        [_stats(3, 9, 0, 7, steps=50), None, _stats(8, 9, 2, 4, steps=60, stolen=2)]
    )
    two = engine_rows(shards)  # one row per engine that ran; the empty shard has none
    assert two.tolist() == [[3, 9, 1024, 0, 7, 30, 10, 50, 0], [8, 9, 1024, 2, 4, 30, 10, 60, 2]]
    assert engine_rows(None).shape == (0, 9)  # the static engine

    m = kv_metrics([one, two])  # two rounds (DAPO's refills)
    assert m["rollout/kv_peak_gib"] == 8 * 1024 / GIB  # the busiest engine, not a sum
    assert m["rollout/kv_pool_gib"] == 9 * 1024 / GIB
    assert m["rollout/kv_usage_peak"] == 8 / 8  # of the pool's usable pages (trash excluded)
    assert m["rollout/preemptions"] == 3  # every engine's, every round's
    assert m["rollout/decode_dispatches"] == 5 + 7  # each round's busiest engine
    assert m["rollout/decode_steps"] == 40 + 60  # each round's busiest engine
    assert m["rollout/prompts_stolen"] == 2
    assert m["rollout/prefix_shared_frac"] == 3 * 10 / (3 * (30 + 10))  # of every engine's
    assert kv_metrics([engine_rows(None)]) == {} == kv_metrics([])


def test_engine_rows_saved_before_the_work_stealing_columns_read_them_as_zero():
    """An in-flight batch checkpointed with 7-column rows (before decode_steps and
    prompts_stolen) restores with those two columns 0, not misread."""
    from jaxrl_llm.train import asynchronous as A

    old = [[6, 9, 1024, 1, 5, 30, 10], [3, 9, 1024, 0, 7, 30, 10]]
    assert A._kv_rows(old).tolist() == [[*r, 0, 0] for r in old]
    assert A._kv_rows([]).shape == (0, 9)
    new = engine_rows(_stats(6, 9, 1, 5, steps=40, stolen=1)).tolist()
    assert A._kv_rows(new).tolist() == new


def _collect(*overrides: str) -> dict[str, float]:
    no_stop = "rollout.stop_token_ids=[]"
    cfg = H.config("tiny.yaml", "data.max_prompt_length=64", no_stop, *overrides)
    s = setup_lib.resolve(cfg)
    it = BatchIterator(s.data.train, s.loop.batch_size, seed=0, shuffle=False, pad_multiple=8)
    return collect(s, s.state.params, it, jax.random.key(0))[1]


def test_collect_reports_the_paged_pool_and_nothing_for_the_static_engine():
    m = _collect("rollout.engine=paged")
    assert m["rollout/preemptions"] == 0  # the default pool holds every live sequence
    assert 0 < m["rollout/kv_peak_gib"] < m["rollout/kv_pool_gib"]
    assert 0 < m["rollout/kv_usage_peak"] <= 1 and m["rollout/decode_dispatches"] >= 1
    assert 0 <= m["rollout/prefix_shared_frac"] < 1
    # 8 new tokens, the first from the prefill: at most 7 decode steps, in every dispatch
    assert m["rollout/decode_dispatches"] <= m["rollout/decode_steps"] <= 7
    assert m["rollout/prompts_stolen"] == 0  # the prompts fit at once: nothing waits
    static = _collect("rollout.engine=static")
    assert not [k for k in static if k.startswith("rollout/")]
    assert static["perf/generated_tokens"] == m["perf/generated_tokens"]  # no early stop: 2·2·8


def test_a_pool_too_small_for_every_sequence_is_logged_and_warned_once(tmp_path, capsys):
    # One sequence's worst case (a ≤ 64-token prompt and 8 new tokens) and no more: the 2 × 2
    # samples take turns, preempting one another.
    config = H.config(
        "tiny.yaml",
        "data.max_prompt_length=64",
        "rollout.stop_token_ids=[]",
        "rollout.engine=paged",
        "rollout.max_total_tokens=72",
        "train.max_steps=2",
        "train.save_every=0",
        "data.eval_size=0",
    )
    loop.train(config, run_dir=tmp_path, progress=False, log=lambda *_: None)
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "rollout/preemptions" in r]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["rollout/preemptions"] > 0
        assert r["rollout/kv_pool_gib"] == pytest.approx(records[0]["rollout/kv_pool_gib"])
        assert r["rollout/kv_peak_gib"] <= r["rollout/kv_pool_gib"]
        assert r["rollout/kv_usage_peak"] > 0.5
    out = capsys.readouterr().out
    assert out.count("sequences were preempted and recomputed") == 1, out
    assert "step 1: the rollout's KV-cache pool" in out and "rollout.max_total_tokens" in out
