"""The regex format reward and the linear length penalty."""

import pytest

from jaxrl_llm.rewards import (
    NUM_TOKENS_FIELD,
    LengthPenalty,
    RegexFormat,
    RewardError,
    checked_call,
)

THINK = r"<think>.*</think>\s*<answer>.*</answer>"


def test_regex_modes():
    completions = ["  42\n", "answer: 42", "42 apples"]
    assert RegexFormat(r"\d+", mode="fullmatch")(["p"] * 3, completions) == [1.0, 0.0, 0.0]
    assert RegexFormat(r"\d+", mode="match")(["p"] * 3, completions) == [1.0, 0.0, 1.0]
    assert RegexFormat(r"\d+", mode="search")(["p"] * 3, completions) == [1.0, 1.0, 1.0]


def test_regex_dotall_spans_lines_and_strip():
    text = "<think>a\nb</think>\n<answer>4</answer>\n"
    assert RegexFormat(THINK, mode="fullmatch")(["p"], [text]) == [1.0]
    assert RegexFormat(THINK, mode="fullmatch", dotall=False)(["p"], [text]) == [0.0]
    assert RegexFormat(THINK, mode="fullmatch", strip=False)(["p"], [text]) == [0.0]


def test_regex_reward_penalty_and_case():
    fn = RegexFormat("yes", ignore_case=True, reward=0.5, penalty=-0.5)
    assert fn(["p", "p"], ["YES", "no"]) == [0.5, -0.5]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"pattern": "(unclosed"}, ValueError, "not a valid regex"),
        ({"pattern": "a", "mode": "find"}, ValueError, "`mode` must be one of"),
        ({"pattern": 3}, TypeError, "`pattern` must be a string"),
        ({"pattern": "a", "reward": "1"}, TypeError, "`reward` must be a number"),
        ({"pattern": "a", "dotall": "yes"}, TypeError, "`dotall` must be true or false"),
    ],
)
def test_regex_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        RegexFormat(**kwargs)


def test_length_penalty_tokens():
    fn = LengthPenalty(target=10, coef=0.1)
    scores = fn(["p"] * 4, ["a", "b", "c", "d"], **{NUM_TOKENS_FIELD: [5, 10, 11, 30]})
    assert scores == pytest.approx([0.0, 0.0, -0.1, -2.0])


def test_length_penalty_chars_and_cap():
    fn = LengthPenalty(target=3, coef=1.0, unit="chars", max_penalty=2.0)
    assert fn(["p"] * 3, ["abc", "abcd", "abcdefgh"]) == [0.0, -1.0, -2.0]
    assert fn.required_fields == ()


def test_length_penalty_tokens_needs_the_field_whatever_on_error():
    fn = LengthPenalty(target=3)
    for on_error in ("raise", "zero"):
        with pytest.raises(RewardError, match="completion_num_tokens"):
            checked_call(fn, ["p"], ["c"], {}, name="length_penalty", on_error=on_error)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target": -1}, "`target` must be >= 0"),
        ({"target": 1.5}, "`target` must be an integer"),
        ({"target": 1, "coef": -1.0}, "`coef` must be >= 0"),
        ({"target": 1, "unit": "words"}, "`unit` must be one of"),
        ({"target": 1, "max_penalty": float("inf")}, "`max_penalty` must be finite"),
    ],
)
def test_length_penalty_bad_options(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        LengthPenalty(**kwargs)
