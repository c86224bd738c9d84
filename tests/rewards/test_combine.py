"""WeightedSum, its metrics and score_groups (B prompts × G completions → reward_bg)."""

import asyncio
import math
import threading

import numpy as np
import pytest

from jaxrl_llm.rewards import (
    NUM_TOKENS_FIELD,
    IntegerAnswer,
    RegexFormat,
    RewardError,
    RewardModelReward,
    RewardTerm,
    Routed,
    TrlReward,
    VerlScore,
    WeightedSum,
    build_reward,
    score_groups,
)
from jaxrl_llm.rewards.base import is_async_reward


def test_weighted_sum_numbers_and_components():
    reward = build_reward(
        [
            {"type": "integer_answer"},
            {"type": "regex", "pattern": r"\d+", "mode": "fullmatch", "weight": 0.5},
            {"type": "length_penalty", "target": 2, "coef": 0.25, "unit": "chars", "weight": 2.0},
        ]
    )
    out = reward(["p"] * 3, ["30", "it is 30", "12"], answer=["30", "30", "30"])
    # 1*correct + 0.5*format + 2*(-0.25*max(0, len-2))
    np.testing.assert_allclose(out.total_n, [1.5, 1.0 - 3.0, 0.5])
    np.testing.assert_array_equal(out.components["integer_answer"], [1, 1, 0])
    np.testing.assert_array_equal(out.components["regex"], [1, 0, 1])
    np.testing.assert_allclose(out.components["length_penalty"], [0, -1.5, 0])
    assert out.num_errors == {"integer_answer": 0, "regex": 0, "length_penalty": 0}
    np.testing.assert_array_equal(out.correct_n, [True, True, False])
    assert out.total_n.dtype == np.float32


def test_metrics():
    reward = build_reward(["integer_answer", {"type": "regex", "pattern": "x"}])
    out = reward(["p"] * 4, ["1", "2", "x", "1"], answer=[1, 1, 1, 1])
    assert out.metrics() == pytest.approx(
        {
            "reward/mean": 0.75,
            "reward/std": math.sqrt(0.1875),
            "reward/integer_answer/mean": 0.5,
            "reward/integer_answer/num_errors": 0.0,
            "reward/regex/mean": 0.25,
            "reward/regex/num_errors": 0.0,
            "accuracy": 0.5,
        }
    )


def test_accuracy_term_choice():
    assert build_reward([{"type": "regex", "pattern": "a"}]).accuracy is None
    reward = build_reward([{"type": "regex", "pattern": "a"}, "gsm8k_answer"])
    assert reward.accuracy == "gsm8k_answer"
    reward = build_reward([{"type": "regex", "pattern": "a"}], accuracy="regex")
    out = reward(["p", "p"], ["a", "b"])
    np.testing.assert_array_equal(out.correct_n, [True, False])
    assert (
        "accuracy" not in build_reward([{"type": "regex", "pattern": "a"}])(["p"], ["a"]).metrics()
    )


def test_on_error_zero_counts_per_reward():
    def flaky(prompts, completions, **fields):
        return [math.nan if c == "bad" else 1.0 for c in completions]

    terms = [RewardTerm("flaky", flaky, 2.0), RewardTerm("answer", IntegerAnswer())]
    out = WeightedSum(terms, on_error="zero")(["p"] * 3, ["1", "bad", "1"], answer=[1, 1, 2])
    np.testing.assert_allclose(out.total_n, [3.0, 0.0, 2.0])
    assert out.num_errors == {"flaky": 1, "answer": 0}
    assert out.metrics()["reward/flaky/num_errors"] == 1.0
    with pytest.raises(RewardError, match="'flaky' returned nan for sample 1"):
        WeightedSum(terms)(["p"] * 3, ["1", "bad", "1"], answer=[1, 1, 2])


def test_weighted_sum_validation():
    with pytest.raises(ValueError, match="at least one term"):
        WeightedSum([])
    with pytest.raises(ValueError, match="unique"):
        WeightedSum([RewardTerm("a", IntegerAnswer()), RewardTerm("a", IntegerAnswer())])
    with pytest.raises(TypeError, match="must be callable"):
        RewardTerm("a", 3)
    assert repr(WeightedSum([RewardTerm("a", IntegerAnswer(), 0.5)])) == (
        "WeightedSum(0.5·a, on_error='raise')"
    )


def test_score_groups_repeats_prompts_and_fields():
    seen = {}

    def spy(prompts, completions, **fields):
        seen.update(prompts=prompts, completions=completions, **fields)
        return [float(n) for n in fields[NUM_TOKENS_FIELD]]

    reward = WeightedSum([RewardTerm("spy", spy), RewardTerm("answer", IntegerAnswer())])
    completions_bg = [["1", "2", "3"], ["4", "5", "6"]]
    reward_bg, out = score_groups(
        reward,
        ["p0", "p1"],
        completions_bg,
        {"answer": [2, 6]},
        num_tokens_bg=[[1, 2, 3], [4, 5, 6]],
        tokens_bgt=np.arange(2 * 3 * 6).reshape(2, 3, 6),
        mask_bgt=np.arange(6) < np.array([[1, 2, 3], [4, 5, 6]])[..., None],
    )
    ids = seen["completion_ids"]  # read on access
    assert (
        len(ids) == 6
        and ids[1] == [6, 7]
        and list(ids[4:]) == [[24, 25, 26, 27, 28], list(range(30, 36))]
    )
    assert reward_bg.shape == (2, 3) and reward_bg.dtype == np.float32
    np.testing.assert_allclose(reward_bg, [[1, 3, 3], [4, 5, 7]])
    assert seen["prompts"] == ["p0"] * 3 + ["p1"] * 3
    assert seen["completions"] == ["1", "2", "3", "4", "5", "6"]
    assert seen["answer"] == [2, 2, 2, 6, 6, 6]
    assert out.total_n.shape == (6,)


def test_score_groups_shape_errors():
    reward = build_reward(["integer_answer"])
    with pytest.raises(ValueError, match="2 completion groups for 1 prompts"):
        score_groups(reward, ["p"], [["1"], ["2"]], {"answer": [1]})
    with pytest.raises(ValueError, match="one size G"):
        score_groups(reward, ["p", "q"], [["1"], ["2", "3"]], {"answer": [1, 2]})
    with pytest.raises(ValueError, match="field 'answer' has 1 values for 2 prompts"):
        score_groups(reward, ["p", "q"], [["1"], ["2"]], {"answer": [1]})
    with pytest.raises(ValueError, match=r"num_tokens_bg has shape \(2,\)"):
        score_groups(reward, ["p"], [["1", "2"]], {"answer": [1]}, num_tokens_bg=[1, 2])
    with pytest.raises(ValueError, match=r"tokens_bgt \(1, 1, 1\) and mask_bgt \(1, 1, 1\)"):
        score_groups(
            reward, ["p"], [["1", "2"]], {"answer": [1]}, tokens_bgt=[[[1]]], mask_bgt=[[[1]]]
        )


def test_reward_model_adapter():
    rm = RewardModelReward(lambda p, c: [len(x) * 0.5 for x in c])
    reward = WeightedSum([RewardTerm("rm", rm), RewardTerm("fmt", RegexFormat("a"))])
    out = reward(["p", "p"], ["aa", "bbbb"])
    np.testing.assert_allclose(out.total_n, [2.0, 2.0])
    with pytest.raises(TypeError, match="callable"):
        RewardModelReward(3)
    wrong = WeightedSum([RewardTerm("rm", RewardModelReward(lambda p, c: np.ones((len(c), 2))))])
    with pytest.raises(RewardError, match="'rm' returned 4 scores for 2 samples"):
        wrong(["p", "p"], ["a", "b"])


def test_async_terms_score_a_batch_at_the_same_time_and_errors_come_in_term_order():
    """Two async terms (a plain ``async def`` and a TRL function) overlap: each waits until the
    other has started, which one after the other would never see (it would time out and
    fail). A sync term beside them runs as before. Errors: the first term's, in term order."""
    started = {"judge": threading.Event(), "trl_judge": threading.Event()}

    async def wait_for(me, other):
        started[me].set()
        for _ in range(3000):  # up to 30 s
            if started[other].is_set():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{me} scored alone: the async terms did not overlap")

    async def judge(prompts, completions, **fields):
        await wait_for("judge", "trl_judge")
        return [1.0] * len(completions)

    async def trl_judge(prompts, completions, **kwargs):
        await wait_for("trl_judge", "judge")
        return [0.5] * len(completions)

    terms = [
        RewardTerm("judge", judge),
        RewardTerm("exact", IntegerAnswer()),
        RewardTerm("trl_judge", TrlReward(trl_judge), weight=2.0),
    ]
    out = WeightedSum(terms)(["p", "q"], ["3", "4"], answer=["3", "5"])
    np.testing.assert_allclose(out.total_n, [3.0, 2.0])
    assert set(started) == {k for k, e in started.items() if e.is_set()}
    # which terms count as async: what an adapter or a route wraps decides
    assert [is_async_reward(t.fn) for t in terms] == [True, False, True]
    assert VerlScore(judge_free).is_async and not VerlScore(lambda **kw: 1.0).is_async
    assert Routed({"a": IntegerAnswer()}, default=judge_free).is_async
    assert not Routed({"a": IntegerAnswer()}).is_async

    async def broken(prompts, completions, **fields):
        raise ValueError("judge server down")

    async def also_broken(prompts, completions, **fields):
        raise KeyError("later")

    both = WeightedSum([RewardTerm("first", broken), RewardTerm("second", also_broken)])
    with pytest.raises(RewardError, match=r"'first'.*judge server down"):
        both(["p"], ["3"])
    zeroed = WeightedSum(
        [RewardTerm("first", broken), RewardTerm("second", judge_free)], on_error="zero"
    )(["p"], ["3"])
    assert zeroed.num_errors == {"first": 1, "second": 0}
    np.testing.assert_allclose(zeroed.total_n, [0.25])


async def judge_free(prompts, completions, **fields):
    return [0.25] * len(completions)
