"""The math-verify rewards (``math_verify``, ``boxed_answer``): equivalences the old hand-written
boxed parser got wrong, answers that must stay wrong, the per-answer timeout, the config path."""

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jaxrl_llm.config import ConfigError, load_config
from jaxrl_llm.config.validation import REWARD_TYPES as CONFIG_REWARD_TYPES
from jaxrl_llm.rewards import (
    BoxedAnswer,
    MathVerifier,
    MathVerifyAnswer,
    RewardConfigError,
    RewardError,
    Scores,
    VerificationTimeout,
    build_reward,
    checked_call,
    math_answers_equal,
)
from jaxrl_llm.rewards import verify as verify_module

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# sympy evaluates the power tower exactly: minutes at least, so it always hits the limit.
PATHOLOGICAL = r"9^{9^{9^{9}}}"


def _boxed(answer: str) -> str:
    return rf"so the answer is \boxed{{{answer}}}."


# (completion's boxed answer, gold): the old normaliser said "different", math-verify "equal".
OLD_PARSER_WRONG = [
    ("x = 3", "3"),
    ("x=3", "3"),
    (r"\{2,1\}", r"\{1,2\}"),
    ("1+x", "x+1"),
    (r"\frac{1}{\sqrt{2}}", r"\sqrt{2}/2"),
    (r"\sqrt{8}", r"2\sqrt{2}"),
    (r"\sqrt{3}", r"\sqrt3"),
    (r"\pi/2", r"\frac{\pi}{2}"),
    (r"5\text{ cm}", "5"),
    (r"12\text{ dollars}", "12"),
    (r"\text{5}", "5"),
    (r"\$5", "5"),
    ("0.3333333", r"\frac{1}{3}"),
    ("2^{10}", "1024"),
    ("1000", "10^{3}"),
    ("10{,}000", "10000"),
    (r"[1,2]", r"x \in [1,2]"),
    (r"(-\infty,\infty)", r"\mathbb{R}"),
    (r"\text{Monday}", "Monday"),
]

# Must stay wrong.
STAYS_WRONG = [
    ("(1,2)", "[1,2]"),  # open vs closed interval
    (r"[1, 2)", r"(1, 2]"),
    (r"\{1,3\}", r"\{1,2\}"),
    ("1/3", "1/2"),
    ("0.333", r"\frac{1}{3}"),  # not close enough
    ("10.5", "10.05"),
    ("-5", "5"),
    ("2x", "2"),
    ("x^3", "x^2"),
    ("3.14159", r"\pi"),
    (r"90^\circ", r"\frac{\pi}{2}"),
    ("3, 4", "3"),
    ("B", "A"),
    (r"\frac{2}{0}", r"\frac{1}{0}"),
]


@pytest.mark.parametrize(("answer", "gold"), OLD_PARSER_WRONG)
def test_boxed_equivalences_the_old_parser_missed(answer, gold):
    assert BoxedAnswer()(["p"], [_boxed(answer)], answer=[gold]) == [1.0]
    assert MathVerifyAnswer()(["p"], [_boxed(answer)], answer=[gold]) == [1.0]


@pytest.mark.parametrize(("answer", "gold"), STAYS_WRONG)
def test_wrong_answers_stay_wrong(answer, gold):
    assert BoxedAnswer()(["p"], [_boxed(answer)], answer=[gold]) == [0.0]
    assert MathVerifyAnswer()(["p"], [_boxed(answer)], answer=[gold]) == [0.0]
    assert not math_answers_equal(answer, gold)


@pytest.mark.parametrize(
    ("completion", "gold"),
    [
        (r"The answer is $\frac{1}{2}$.", "0.5"),
        ("The answer is 0.5", r"\frac12"),
        (r"Hence $x \in [1, 2)$.", r"[1,2)"),
        (r"so \boxed{\dfrac{3}{4}}", r"the solution ... \boxed{0.75}"),  # a MATH solution as gold
        (r"$\{1, 2\}$", r"\{2,1\}"),
    ],
)
def test_math_verify_finds_the_answer_in_the_completion(completion, gold):
    assert MathVerifyAnswer()(["p"], [completion], answer=[gold]) == [1.0]


def test_boxed_needs_a_box_and_math_verify_does_not():
    assert BoxedAnswer()(["p"], ["the answer is 1/2"], answer=["0.5"]) == [0.0]
    assert MathVerifyAnswer()(["p"], ["the answer is 1/2"], answer=["0.5"]) == [1.0]
    assert MathVerifyAnswer()(["p"], ["I have no idea"], answer=["0.5"]) == [0.0]
    assert BoxedAnswer()(["p"], [r"\boxed{}"], answer=["0.5"]) == [0.0]


def test_custom_field_scores_and_number_gold():
    fn = MathVerifyAnswer(field="target", correct=2.0, incorrect=-1.0)
    assert fn(["p", "p"], [r"\boxed{30}", r"\boxed{31}"], target=[30, 30.0]) == [2.0, -1.0]
    assert fn.required_fields == ("target",)


def test_bad_gold_is_a_named_data_error():
    with pytest.raises(RewardError, match="is empty on sample 1"):
        checked_call(
            MathVerifyAnswer(), ["p", "p"], ["1", "2"], {"answer": ["1", r"\boxed{}"]}, name="mv"
        )


@pytest.mark.parametrize("on_error", ["raise", "zero"])
def test_a_timeout_scores_incorrect_and_is_counted(on_error):
    reward = build_reward(
        [{"type": "math_verify", "timeout": 1.0, "incorrect": -0.5}], on_error=on_error
    )
    completions = [r"\boxed{1}", _boxed(PATHOLOGICAL), r"\boxed{2}"]
    start = time.monotonic()
    out = reward(["p"] * 3, completions, answer=["1", "1", "2"])
    # One timeout (1s) plus restarting the worker; never the minutes sympy would take.
    assert time.monotonic() - start < 30
    np.testing.assert_array_equal(out.components["math_verify"], [1.0, -0.5, 1.0])
    assert out.num_errors == {"math_verify": 1}
    assert out.metrics()["reward/math_verify/num_errors"] == 1.0
    np.testing.assert_array_equal(out.correct_n, [True, False, True])


def test_the_timeout_is_enforced_outside_the_main_thread():
    # math-verify's own signal.alarm timeouts raise ValueError off the main thread.
    verifier = MathVerifier()
    results = {}

    def work():
        try:
            verifier.verify("1", PATHOLOGICAL, extract=False, timeout=0.5)
        except VerificationTimeout as exc:
            results["timeout"] = exc
        results["after"] = verifier.verify(r"\frac{1}{2}", "0.5", extract=False, timeout=30)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60)
    verifier.close()
    assert not thread.is_alive()
    assert "timeout" in results and results["after"] is True


def test_math_answers_equal_raises_on_timeout():
    start = time.monotonic()
    with pytest.raises(VerificationTimeout, match=r"more than 0\.5s"):
        math_answers_equal(PATHOLOGICAL, "1", timeout=0.5)
    assert time.monotonic() - start < 30


def test_soft_errors_keep_their_score_in_checked_call():
    def reward(prompts, completions, **fields):
        return Scores([1.0, 0.25, 0.0], soft_errors=[1])

    scores, errors = checked_call(reward, ["p"] * 3, ["a", "b", "c"], name="r", on_error="raise")
    np.testing.assert_array_equal(scores, [1.0, 0.25, 0.0])
    assert errors == 1


def test_a_missing_worker_is_an_error_not_a_zero(monkeypatch):
    monkeypatch.setattr(verify_module, "_WORKER", Path(sys.prefix) / "no_such_worker.py")
    with pytest.raises(verify_module.VerifierError, match="math-verify worker"):
        MathVerifier().verify("1", "1", extract=False, timeout=5)


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf")])
def test_bad_timeout_is_a_config_error(timeout):
    with pytest.raises(RewardConfigError, match="timeout"):
        build_reward([{"type": "math_verify", "timeout": timeout}])


def test_math_verify_through_a_config():
    assert "math_verify" in CONFIG_REWARD_TYPES
    config = load_config(
        CONFIGS / "tiny.yaml",
        ["rewards.terms=[{type: math_verify, weight: 1.0, kwargs: {timeout: 2.0}}]"],
    )
    (term,) = config.rewards.terms
    assert term.type == "math_verify" and term.kwargs == {"timeout": 2.0}
    from jaxrl_llm.train import setup as train_setup

    reward = train_setup.build_reward(config)
    assert reward.names == ("math_verify",) and reward.accuracy == "math_verify"
    out = reward(["p", "p"], [r"\boxed{\frac{1}{2}}", r"\boxed{0.4}"], answer=["0.5", "0.5"])
    np.testing.assert_array_equal(out.components["math_verify"], [1.0, 0.0])
    with pytest.raises(ConfigError, match="did you mean 'math_verify'"):
        load_config(CONFIGS / "tiny.yaml", ["rewards.terms=[{type: math_verfy}]"])
