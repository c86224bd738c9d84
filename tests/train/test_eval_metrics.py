"""jaxrl_llm.train.eval_metrics (pass@k, mean@K, best@K, maj@K, bootstrap) and sampled
evaluation end to end on configs/tiny.yaml (``evaluate --num-samples K``)."""

from __future__ import annotations

import argparse
import itertools
import json
import math

import numpy as np
import pytest

from jaxrl_llm.train import cli, loop
from jaxrl_llm.train import eval_metrics as EM
from jaxrl_llm.train.evaluation import answer_extractor
from tests.train import helpers as H

# ---------------------------------------------------------------------------------------------
# pass@k


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    """The fraction of the k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_enumerating_every_k_subset(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            got = float(EM.pass_at_k(n, c, k))
            assert got == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12), (n, c, k)
            assert got == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_vectorised_and_stable():
    n = np.array([10, 10, 10, 200, 200])
    c = np.array([0, 3, 10, 1, 150])
    got = EM.pass_at_k(n, c, 5)
    want = [1 - math.comb(int(a - b), 5) / math.comb(int(a), 5) for a, b in zip(n, c, strict=True)]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    assert EM.pass_at_k(n, c, 1) == pytest.approx(c / n)
    # Binomials far past float range: the product form stays finite and in [0, 1].
    big = float(EM.pass_at_k(5000, 1, 2500))
    assert big == pytest.approx(0.5) and np.isfinite(big)
    assert float(EM.pass_at_k(5000, 0, 2500)) == 0.0


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError):
        EM.pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        EM.pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        EM.pass_at_k(4, 1, 0)
    with pytest.raises(TypeError):
        EM.pass_at_k(4.0, 1, 1)


def test_pass_at_k_is_unbiased_on_random_data():
    """E[estimate from n samples] = 1 − (1 − p)^k, the pass@k of k independent samples."""
    rng = np.random.default_rng(0)
    n, trials = 10, 200_000
    for p in (0.05, 0.3, 0.7):
        correct = rng.random((trials, n)) < p
        for k in (1, 2, 5, 10):
            est = EM.pass_at_k_values(correct, k).mean()
            assert est == pytest.approx(1 - (1 - p) ** k, abs=4e-3), (p, k)
    # Exactly: averaging over c ~ Binomial(n, p) gives the true value.
    for p in (0.1, 0.5):
        for k in range(1, n + 1):
            exact = sum(
                math.comb(n, c) * p**c * (1 - p) ** (n - c) * float(EM.pass_at_k(n, c, k))
                for c in range(n + 1)
            )
            assert exact == pytest.approx(1 - (1 - p) ** k, abs=1e-12)


def test_pass_ks():
    assert EM.pass_ks(1) == [1]
    assert EM.pass_ks(4) == [1, 2, 4]
    assert EM.pass_ks(6) == [1, 2, 4, 6]
    assert EM.pass_ks(16) == [1, 2, 4, 8, 16]


# ---------------------------------------------------------------------------------------------
# mean@K, best@K, maj@K


def test_mean_and_best():
    r = np.array([[0.0, 1.0, 0.5], [-1.0, -2.0, -0.5]])
    np.testing.assert_allclose(EM.mean_values(r), [0.5, -3.5 / 3])
    np.testing.assert_allclose(EM.best_values(r), [1.0, -0.5])


def test_majority_vote_ties_are_deterministic():
    assert EM.majority_vote(["a", "b", "b", "a"]) == 0  # tie: the answer seen first
    assert EM.majority_vote(["b", "a", "a", "b"]) == 0
    assert EM.majority_vote(["a", "b", "b"]) == 1
    assert EM.majority_vote([None, "x", None, None]) == 1  # no answer does not vote
    assert EM.majority_vote([None, None]) is None
    assert EM.majority_vote([-1, 3, 3, -1, -1], invalid=-1) == 1
    assert EM.majority_vote([2, 1, 1, 2], invalid=-1) == 0


def test_majority_values():
    answers = [["7", "8", "8", "7"], ["7", "8", "8", "9"], [None, None, None, None]]
    correct = [[True, False, False, True], [True, False, False, False], [False] * 4]
    np.testing.assert_array_equal(EM.majority_values(answers, correct), [1.0, 0.0, 0.0])
    ids = np.array([[0, 1, 1, -1], [-1, -1, -1, -1]])
    np.testing.assert_array_equal(
        EM.majority_values(ids, [[False, True, True, False], [True] * 4], invalid=-1), [1.0, 0.0]
    )
    with pytest.raises(ValueError):
        EM.majority_values([["a"]], [[True, False]])


# ---------------------------------------------------------------------------------------------
# bootstrap


def test_bootstrap_ci_is_seeded_and_contains_the_point():
    rng = np.random.default_rng(1)
    for size in (1, 2, 5, 50, 500):
        values = (rng.random(size) < 0.4).astype(float)
        low, high = EM.bootstrap_ci(values, seed=3)
        assert low <= values.mean() <= high
        assert (low, high) == EM.bootstrap_ci(values, seed=3)
    values = rng.random(200)
    assert EM.bootstrap_ci(values, seed=0) != EM.bootstrap_ci(values, seed=1)
    low, high = EM.bootstrap_ci(values)
    se = values.std() / np.sqrt(values.size)  # the normal interval, roughly
    assert high - low == pytest.approx(2 * 1.96 * se, rel=0.15)
    narrow = EM.bootstrap_ci(values, confidence=0.5)
    assert low < narrow[0] < narrow[1] < high
    assert EM.bootstrap_ci([0.25, 0.25, 0.25]) == (0.25, 0.25)
    assert all(np.isnan(EM.bootstrap_ci([])))


def test_sampled_metrics_keys_and_order():
    rng = np.random.default_rng(2)
    correct = rng.random((30, 8)) < 0.3
    reward = correct + 0.1 * rng.random((30, 8))
    answers = np.where(correct, 0, rng.integers(1, 4, (30, 8)))
    out = EM.sampled_metrics(reward, correct, answers, invalid=-1, seed=5)
    names = ["mean@8", "best@8", "pass@1", "pass@2", "pass@4", "pass@8", "maj@8"]
    assert list(out) == [f"eval/{m}{s}" for m in names for s in ("", "_ci_low", "_ci_high")]
    for m in names:
        assert out[f"eval/{m}_ci_low"] <= out[f"eval/{m}"] <= out[f"eval/{m}_ci_high"]
    assert out["eval/pass@1"] == pytest.approx(correct.mean())
    assert out["eval/pass@8"] == pytest.approx(correct.any(1).mean())
    assert out["eval/best@8"] == pytest.approx(reward.max(1).mean())
    assert out == EM.sampled_metrics(reward, correct, answers, invalid=-1, seed=5)
    # Without verdicts only the reward metrics.
    assert set(EM.sampled_metrics(reward)) == {
        f"eval/{m}{s}" for m in ("mean@8", "best@8") for s in ("", "_ci_low", "_ci_high")
    }


def test_answer_extractor_follows_the_accuracy_term():
    from jaxrl_llm import rewards as R

    def reward(fn):
        return R.WeightedSum([R.RewardTerm("acc", fn)])

    ints = answer_extractor(reward(R.IntegerAnswer()))
    assert ints("so 3 + 4 = 7.") == ints("answer: 7.0") and ints("none") is None
    gsm = answer_extractor(reward(R.Gsm8kAnswer()))
    assert gsm("x #### 1,234") == 1234 and gsm("1234") is None
    assert answer_extractor(reward(R.Gsm8kAnswer(strict=False)))("1234") == 1234
    boxed = answer_extractor(reward(R.BoxedAnswer()))
    assert boxed("\\boxed{1/2}") == boxed("so \\boxed{ 0.5 }") == 0.5
    assert boxed("\\boxed{ x + 1 }") == "x+1" and boxed("no box") is None
    text = answer_extractor(None)
    assert text(" a  b ") == "a b" and text("  ") is None


# ---------------------------------------------------------------------------------------------
# End to end: evaluate on the tiny random model.

_TODAY = {"eval/reward_mean", "eval/response_length", "eval/num_prompts", "eval/accuracy"}


def test_evaluate_with_num_samples_on_tiny(tmp_path, capsys):
    config = H.config("tiny.yaml")
    run_dir = tmp_path / "run"
    greedy = loop.evaluate(config, run_dir=run_dir, log=lambda *a: None)
    assert set(greedy) == _TODAY | {"eval/time"}  # eval_num_samples=1: today's keys exactly

    parser = argparse.ArgumentParser()
    cli.add_train_parsers(parser.add_subparsers(dest="command", required=True))
    argv = ["evaluate", "--config", str(H.CONFIGS / "tiny.yaml"), "--run-dir", str(run_dir)]
    args = parser.parse_args([*argv, "--num-samples", "4", "model.path=tiny-random", "mesh.data=1"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    metrics = ["mean@4", "best@4", "pass@1", "pass@2", "pass@4", "maj@4"]
    want = {f"eval/{m}{s}" for m in metrics for s in ("", "_ci_low", "_ci_high")}
    assert set(out) == _TODAY | want | {"eval/num_samples", "eval/time"}
    assert out["eval/num_samples"] == 4 and out["eval/num_prompts"] == 8
    assert 0 <= out["eval/pass@1"] <= out["eval/pass@2"] <= out["eval/pass@4"] <= 1
    assert out["eval/pass@1"] == pytest.approx(out["eval/accuracy"])
    assert out["eval/mean@4"] == pytest.approx(out["eval/reward_mean"])
    assert out["eval/mean@4"] <= out["eval/best@4"]
    for m in metrics:
        assert out[f"eval/{m}_ci_low"] <= out[f"eval/{m}"] <= out[f"eval/{m}_ci_high"]

    # The config knob gives the same; an explicit greedy with K > 1 is a config error.
    knob = loop.evaluate(
        H.config("tiny.yaml", "train.eval_num_samples=4"), run_dir=run_dir, log=lambda *a: None
    )
    assert {k: v for k, v in knob.items() if k != "eval/time"} == {
        k: v for k, v in out.items() if k != "eval/time"
    }
    args = parser.parse_args([*argv, "--num-samples", "4", "--mode", "greedy"])
    assert args.func(args) == 2
    assert "--mode greedy" in capsys.readouterr().err


def test_training_logs_the_sampled_metrics(tmp_path):
    from jaxrl_llm.train import metrics as M

    config = H.config("tiny.yaml", "train.eval_num_samples=2", "train.max_steps=1")
    final = loop.train(config, run_dir=tmp_path / "run", progress=False)
    evals = [r for r in M.read_metrics(tmp_path / "run") if "eval/num_prompts" in r]
    assert [r["step"] for r in evals] == [0, 1]  # before the first step and after the last
    for record in [*evals, final]:
        assert record["eval/num_samples"] == 2
        assert 0 <= record["eval/pass@1"] <= record["eval/pass@2"] <= 1
        for m in ("mean@2", "best@2", "pass@1", "pass@2", "maj@2"):
            assert record[f"eval/{m}_ci_low"] <= record[f"eval/{m}"] <= record[f"eval/{m}_ci_high"]


GROUPED_REWARDS = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(len(solution_str) % 3), "odd": len(solution_str) % 2 == 1,
            "pred": solution_str[:3]}

def judge(completions, log_metric, **kwargs):
    log_metric("batch_size", len(completions))
    return [0.0] * len(completions)
"""


def test_evaluation_splits_by_data_source_and_evaluates_what_rewards_report(tmp_path):
    """verl's validation metrics: with a data_source column every eval metric is also given
    per source (the per-source values weigh back to the overall ones), and the numeric
    columns and scalars the rewards report are evaluated; eval_group_by=null turns the split
    off."""
    rows = [("What is 2 + 3?", "5", "gsm8k")] * 3 + [("What is 4 - 1?", "3", "math/easy")] * 2
    data = tmp_path / "eval.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": p, "answer": a, "data_source": s}) + "\n" for p, a, s in rows)
    )
    (tmp_path / "grouped_rw.py").write_text(GROUPED_REWARDS)
    terms = (
        f"rewards=[integer_answer, {{type: verl, function: '{tmp_path}/grouped_rw.py:"
        "compute_score', ground_truth_field: answer}, "
        f"{{type: trl, function: '{tmp_path}/grouped_rw.py:judge'}}]"
    )
    base = (
        "tiny.yaml",
        terms,
        "data.source=file",
        f"data.path={data}",
        f"data.eval_path={data}",
        "train.eval_num_samples=2",
    )
    out = loop.evaluate(H.config(*base), run_dir=tmp_path / "run", log=lambda *a: None)
    assert out["eval/num_prompts"] == 5
    assert out["eval/gsm8k/num_prompts"] == 3 and out["eval/math/easy/num_prompts"] == 2
    for name in (
        "reward_mean",
        "accuracy",
        "mean@2",
        "response_length",
        "reward/compute_score/odd/mean",
    ):
        parts = 3 * out[f"eval/gsm8k/{name}"] + 2 * out[f"eval/math/easy/{name}"]
        assert parts / 5 == pytest.approx(out[f"eval/{name}"]), name
    assert out["eval/math/easy/num_samples"] == 2 and "eval/gsm8k/pass@2" in out
    assert 0.0 <= out["eval/reward/compute_score/odd/mean"] <= 1.0
    assert "eval/reward/compute_score/pred/mean" not in out  # text: not averaged
    assert out["eval/reward/judge/batch_size"] == 10.0  # one batch of 5 prompts x 2 samples
    assert "eval/gsm8k/reward/judge/batch_size" not in out  # scalars are not split
    off = loop.evaluate(
        H.config(*base, "train.eval_group_by=null"), run_dir=tmp_path / "run", log=lambda *a: None
    )
    assert not [k for k in off if k.startswith(("eval/gsm8k/", "eval/math/"))]
    assert {k: v for k, v in off.items() if k != "eval/time"} == {
        k: v
        for k, v in out.items()
        if k != "eval/time" and "/gsm8k/" not in k and "/math/" not in k
    }
