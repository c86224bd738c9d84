"""checked_call: every way a reward can fail, in both on_error modes."""

import math
import pickle

import numpy as np
import pytest

from jaxrl_llm.rewards import RewardError, Scores, checked_call, checked_scores

PROMPTS = ["What is 1 + 1?", "What is 2 + 2?", "What is 3 + 3?"]
COMPLETIONS = ["2", "4", "boom"]


def fails_on_boom(prompts, completions, **fields):
    out = []
    for c in completions:
        if c == "boom":
            raise ZeroDivisionError("division by zero")
        out.append(1.0)
    return out


def returns(values):
    def fn(prompts, completions, **fields):
        return values[: len(completions)] if len(completions) == 1 else values

    return fn


def test_good_reward_passes_through_as_f32():
    scores, errors = checked_call(
        lambda p, c, **f: [1, 0.5, np.float64(2.0)], PROMPTS, COMPLETIONS, name="ok"
    )
    assert scores.dtype == np.float32
    np.testing.assert_array_equal(scores, [1.0, 0.5, 2.0])
    assert errors == 0


def test_accepts_arrays_and_bools():
    scores, _ = checked_call(
        lambda p, c, **f: np.array([True, False, True]), PROMPTS, COMPLETIONS, name="b"
    )
    np.testing.assert_array_equal(scores, [1.0, 0.0, 1.0])


def test_raise_names_reward_sample_and_prompt():
    with pytest.raises(RewardError) as info:
        checked_call(fails_on_boom, PROMPTS, COMPLETIONS, name="my_reward")
    message = str(info.value)
    assert "'my_reward'" in message
    assert "ZeroDivisionError" in message
    assert "sample 2" in message and "'What is 3 + 3?'" in message and "'boom'" in message
    assert info.value.reward == "my_reward" and info.value.index == 2
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_zero_mode_scores_only_the_failing_sample_zero():
    scores, errors = checked_call(
        fails_on_boom, PROMPTS, COMPLETIONS, name="my_reward", on_error="zero"
    )
    np.testing.assert_array_equal(scores, [1.0, 1.0, 0.0])
    assert errors == 1


@pytest.mark.parametrize(
    "bad", [math.nan, math.inf, -math.inf, None, "1.0", 1j, np.complex64(1), np.float32("nan")]
)
def test_non_finite_or_non_number(bad):
    fn = lambda p, c, **f: [1.0, bad, 2.0]
    with pytest.raises(RewardError, match=r"'r' returned .* sample 1 \(prompt 'What is 2 \+ 2\?'"):
        checked_call(fn, PROMPTS, COMPLETIONS, name="r")
    scores, errors = checked_call(fn, PROMPTS, COMPLETIONS, name="r", on_error="zero")
    np.testing.assert_array_equal(scores, [1.0, 0.0, 2.0])
    assert errors == 1


@pytest.mark.parametrize(
    "bad", [[1.0, 2.0], [1.0] * 4, 3.0, None, "abc", np.ones((3, 1)), {"a": 1}]
)
def test_wrong_count_raises(bad):
    with pytest.raises(
        RewardError, match=r"'r' returned .* for 3 samples; a reward must return one"
    ):
        checked_call(lambda p, c, **f: bad, PROMPTS, COMPLETIONS, name="r")


def test_wrong_count_zero_mode_falls_back_to_one_by_one():
    # Right for one sample at a time, wrong for the batch: the one-by-one scores are kept.
    fn = lambda p, c, **f: [float(len(x)) for x in c][:2]
    scores, errors = checked_call(fn, PROMPTS, COMPLETIONS, name="r", on_error="zero")
    np.testing.assert_array_equal(scores, [1.0, 1.0, 4.0])
    assert errors == 0
    # Wrong even for one sample: every sample is an error.
    scores, errors = checked_call(
        lambda p, c, **f: [], PROMPTS, COMPLETIONS, name="r", on_error="zero"
    )
    np.testing.assert_array_equal(scores, [0.0, 0.0, 0.0])
    assert errors == 3


def test_batch_only_failure():
    def fn(prompts, completions, **fields):
        if len(completions) > 1:
            raise MemoryError("batch too big")
        return [1.0]

    with pytest.raises(RewardError, match="MemoryError: batch too big on a batch of 3 samples"):
        checked_call(fn, PROMPTS, COMPLETIONS, name="r")
    scores, errors = checked_call(fn, PROMPTS, COMPLETIONS, name="r", on_error="zero")
    np.testing.assert_array_equal(scores, [1.0, 1.0, 1.0])
    assert errors == 0


def test_fields_are_sliced_per_sample_in_fallback():
    seen = []

    def fn(prompts, completions, *, answer, **fields):
        seen.append(list(answer))
        if len(completions) > 1:
            raise RuntimeError("nope")
        return [float(answer[0])]

    scores, _ = checked_call(
        fn, PROMPTS, COMPLETIONS, {"answer": [1, 2, 3]}, name="r", on_error="zero"
    )
    np.testing.assert_array_equal(scores, [1.0, 2.0, 3.0])
    assert seen == [[1, 2, 3], [1], [2], [3]]


def test_long_text_is_excerpted():
    with pytest.raises(RewardError) as info:
        checked_call(lambda p, c, **f: [math.nan], ["x" * 500], ["y"], name="r")
    assert "x" * 60 + "'…" in str(info.value) and "x" * 61 not in str(info.value)


def test_input_mismatch_and_bad_mode():
    with pytest.raises(ValueError, match="2 prompts for 3 completions"):
        checked_call(lambda p, c, **f: [], PROMPTS[:2], COMPLETIONS, name="r")
    with pytest.raises(ValueError, match="field 'answer' has 1 values for 3 samples"):
        checked_call(lambda p, c, **f: [], PROMPTS, COMPLETIONS, {"answer": [1]}, name="r")
    with pytest.raises(ValueError, match="field 'answer' must be a list"):
        checked_call(lambda p, c, **f: [], PROMPTS, COMPLETIONS, {"answer": "abc"}, name="r")
    with pytest.raises(ValueError, match="on_error must be one of"):
        checked_call(lambda p, c, **f: [], PROMPTS, COMPLETIONS, name="r", on_error="skip")


def test_reward_error_pickles():
    err = pickle.loads(pickle.dumps(RewardError("boom", reward="r", index=3)))
    assert (str(err), err.reward, err.index) == ("boom", "r", 3)


def test_empty_batch():
    scores, errors = checked_call(lambda p, c, **f: [], [], [], name="r")
    assert scores.shape == (0,) and errors == 0


def test_reported_columns_and_metrics_are_checked_and_kept_one_sample_at_a_time():
    """Scores' extras and metrics through checked_scores: a column of the wrong length and a
    non-finite metric are wiring errors in both on_error modes; when a batch falls back to
    one call per sample, each sample's columns come from its own call."""

    def reports(prompts, completions, **fields):
        if len(completions) > 1 and "boom" in completions:
            raise ValueError("batch fails")
        if completions == ["boom"]:
            raise ValueError("this one fails")
        return Scores(
            [1.0] * len(completions),
            extras={"text": list(completions)},
            metrics={"n": float(len(completions))},
        )

    checked = checked_scores(reports, ["p"] * 2, ["a", "b"], name="r")
    assert checked.extras == {"text": ["a", "b"]} and checked.metrics == {"n": 2.0}
    checked = checked_scores(reports, ["p"] * 3, ["a", "boom", "c"], name="r", on_error="zero")
    np.testing.assert_allclose(checked.scores_n, [1.0, 0.0, 1.0])
    assert checked.num_errors == 1
    assert checked.extras == {"text": ["a", None, "c"]} and checked.metrics == {"n": 1.0}
    assert checked_call(reports, ["p"], ["a"], name="r")[1] == 0  # the public pair, unchanged
    for scores, match in (
        (Scores([1.0, 1.0], extras={"c": [1]}), r"reported the column 'c' with 1 values for 2"),
        (Scores([1.0, 1.0], metrics={"m": float("nan")}), r"reported the metric 'm' = nan"),
    ):
        for on_error in ("raise", "zero"):
            with pytest.raises(RewardError, match=match):
                checked_scores(
                    lambda p, c, s=scores: s, ["p"] * 2, ["a", "b"], name="r", on_error=on_error
                )


def test_an_async_reward_is_awaited_with_or_without_a_timeout_and_inside_a_running_loop():
    """The reward protocol takes ``async def`` functions: awaited in a fresh event loop (in a
    thread of its own under a caller's running loop, as in a notebook), in the batched call,
    the one-by-one retries and the timeout's worker thread alike."""
    import asyncio

    async def lengths(prompts, completions, **fields):
        await asyncio.sleep(0)
        if "bad" in completions and len(completions) > 1:
            raise ValueError("the batch fails")
        return [float(len(c)) for c in completions]

    for timeout in (None, 10.0):
        checked = checked_scores(lengths, ["p"] * 2, ["ab", "c"], name="r", timeout=timeout)
        np.testing.assert_allclose(checked.scores_n, [2.0, 1.0])
    checked = checked_scores(lengths, ["p"] * 2, ["bad", "c"], name="r", on_error="zero")
    np.testing.assert_allclose(checked.scores_n, [3.0, 1.0])  # one by one, each scores

    async def in_a_notebook():
        return checked_call(lengths, ["p"], ["abcd"], name="r")

    assert asyncio.run(in_a_notebook())[0].tolist() == [4.0]
