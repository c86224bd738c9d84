"""RUN_DIR/completions.jsonl (jaxrl_llm.train.completions): records of a step's groups, their
schedule, and the resume rule."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxrl_llm.train.completions import COMPLETIONS_FILE, CompletionLog, group_records
from jaxrl_llm.train.step import Groups

EOS = 2  # SmolLM2's <|im_end|>


def _groups(tokenizer) -> Groups:
    """Two prompts × three samples, T = 6: one stopped, one cut at the budget, one cut and
    given no loss (mask_truncated_completions); the last sample dropped by the selection."""
    prompt = tokenizer("Hi there")["input_ids"]
    p = len(prompt) + 2
    prompt_ids = np.zeros((2, p), np.int32)
    prompt_mask = np.zeros((2, p), bool)
    prompt_ids[:, 2:], prompt_mask[:, 2:] = prompt, True  # left-padded
    twelve = tokenizer(" 12")["input_ids"]
    long = tokenizer(" one two three four five six seven")["input_ids"][:6]
    tokens = np.zeros((2, 3, 6), np.int32)
    mask = np.zeros((2, 3, 6), bool)
    tokens[:, 0, : len(twelve) + 1] = [*twelve, EOS]
    mask[:, 0, : len(twelve) + 1] = True
    tokens[:, 1], mask[:, 1] = long, True
    tokens[:, 2] = long  # mask all False: the cut completion's loss is masked
    reward = np.array([[1.0, 0.0, 0.5], [0.0, 0.0, 0.0]], np.float32)
    member = np.array([[True, True, False], [True, True, True]])
    zeros = np.zeros((2, 3, 6), np.float32)
    return Groups(prompt_ids, prompt_mask, tokens, mask, zeros, reward, member)


def test_records_of_a_steps_groups(smollm2_tokenizer):
    tok = smollm2_tokenizer
    groups = _groups(tok)
    records = group_records(tok, groups, 7, 1, stop_ids=(EOS,))
    assert len(records) == 1  # the first group only
    (r,) = records
    assert r["step"] == 7 and r["prompt"] == "Hi there" and r["reward_mean"] == pytest.approx(0.5)
    text = tok.decode(groups.tokens_bgt[0, 1].tolist(), skip_special_tokens=True)
    stopped = int(groups.mask_bgt[0, 0].sum())  # " 12" and the EOS
    assert r["samples"] == [
        {
            "completion": " 12",
            "reward": 1.0,
            "num_tokens": stopped,
            "truncated": False,
            "trained": True,
        },
        {"completion": text, "reward": 0.0, "num_tokens": 6, "truncated": True, "trained": True},
        {"completion": text, "reward": 0.5, "num_tokens": 6, "truncated": True, "trained": False},
    ]
    assert [x["step"] for x in group_records(tok, groups, 7, 5)] == [7, 7]  # at most B
    json.dumps(records)  # plain JSON values


def test_the_log_writes_at_logged_steps_and_drops_later_lines_on_resume(
    tmp_path, smollm2_tokenizer
):
    groups = _groups(smollm2_tokenizer)

    def run(start, steps, **kw):
        log = CompletionLog(
            tmp_path, smollm2_tokenizer, num_groups=2, max_steps=5, start_step=start, **kw
        )
        for step in steps:
            log.step = step
            log.record(groups)

    def logged():
        return [json.loads(x)["step"] for x in (tmp_path / COMPLETIONS_FILE).open()]

    run(0, range(1, 5), log_every=2)  # steps 2 and 4 (two groups each), and a killed life
    assert logged() == [2, 2, 4, 4]
    run(2, [3, 4, 5], log_every=2)  # resumed from checkpoint 2: step 4's lines are redone
    assert logged() == [2, 2, 4, 4, 5, 5]  # and the last step is always logged
    CompletionLog(tmp_path, smollm2_tokenizer, num_groups=0, log_every=1, max_steps=5, start_step=5)
    assert logged() == [2, 2, 4, 4, 5, 5]


def test_a_run_logs_its_steps_and_evaluations(tmp_path, capsys):
    from jaxrl_llm.train import loop
    from tests.train import helpers as H

    config = H.config(
        "tiny.yaml", "data.eval_size=3", "logging.completions=2", "train.save_every=1"
    )

    def logged():
        rows = [json.loads(x) for x in (tmp_path / COMPLETIONS_FILE).open()]
        return [(r["step"], r.get("eval", False), len(r["samples"])) for r in rows]

    loop.train(config, run_dir=tmp_path, max_steps=2, progress=False, log=lambda *_: None)
    evals, steps = [(0, True, 1)] * 2, [(1, False, 2)] * 2 + [(2, False, 2)] * 2
    assert logged() == evals + steps + [(2, True, 1)] * 2  # evaluations: one greedy sample
    with (tmp_path / COMPLETIONS_FILE).open("a") as f:  # a later step of a killed life
        f.write(json.dumps({"step": 3, "prompt": "", "samples": []}) + "\n")
    loop.train(config, run_dir=tmp_path, max_steps=3, progress=False, log=lambda *_: None)
    assert logged() == evals + steps + [(2, True, 1)] * 2 + [(3, False, 2)] * 2 + [(3, True, 1)] * 2
    # jaxrl-llm evaluate --show N prints N held-out prompts with their completions
    from jaxrl_llm.cli import main

    capsys.readouterr()
    assert main(["evaluate", "--run-dir", str(tmp_path), "--show", "2"]) == 0
    out = capsys.readouterr().out
    assert "### held-out prompt 1/2\n<|im_start|>" in out and "### held-out prompt 2/2" in out
    assert out.count("--- reward ") == 2 and '"eval/reward_mean"' in out
    assert main(["evaluate", "--run-dir", str(tmp_path), "--show", "-1"]) == 2
    assert "--show -1: expected an integer ≥ 0" in capsys.readouterr().err


REPORTING_REWARDS = """
def progress(prompts, completions, trainer_state, log_extra, log_metric, **kwargs):
    log_metric("global_step", trainer_state.global_step)
    log_metric("max_steps", trainer_state.max_steps)
    log_extra("first_char", [c[:1] for c in completions])
    return [0.0] * len(completions)

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.5, "length": len(solution_str), "truth": ground_truth}
"""


@pytest.mark.parametrize("staleness", [0, 1])
def test_what_rewards_report_reaches_the_logged_completions_and_the_metrics(tmp_path, staleness):
    """A TRL function's trainer_state (the step's global_step, the same at any staleness),
    log_metric and log_extra, and a verl dict's extra keys, through a training run: each
    logged completion lists every term's score and the reported columns, the metrics the
    scalars and the numeric columns' means; evaluations too."""
    from jaxrl_llm.train import loop
    from jaxrl_llm.train import metrics as M
    from tests.train import helpers as H

    (tmp_path / "report_rw.py").write_text(REPORTING_REWARDS)
    terms = (
        "rewards=[integer_answer, "
        f"{{type: trl, function: '{tmp_path}/report_rw.py:progress'}}, "
        f"{{type: verl, function: '{tmp_path}/report_rw.py:compute_score', "
        "ground_truth_field: answer}]"
    )
    config = H.config(
        "tiny.yaml",
        terms,
        "data.eval_size=2",
        "logging.completions=1",
        "train.eval_every=2",
        f"train.max_staleness={staleness}",
    )
    run_dir = tmp_path / "run"
    loop.train(config, run_dir=run_dir, max_steps=2, progress=False, log=lambda *_: None)
    records = [json.loads(x) for x in (run_dir / COMPLETIONS_FILE).open()]
    train = [r for r in records if not r.get("eval")]
    assert [r["step"] for r in train] == [1, 2]
    for r in records:
        for x in r["samples"]:
            assert set(x["rewards"]) == {"integer_answer", "progress", "compute_score"}
            assert x["rewards"]["progress"] == 0.0 and x["rewards"]["compute_score"] == 0.5
            assert x["extra"]["first_char"] == x["completion"][:1]
            assert x["extra"]["length"] == len(x["completion"])
        truths = {x["extra"]["truth"] for x in r["samples"]}  # the prompt's answer column
        assert len(truths) == 1 and str(truths.pop()).strip()
    assert any(r.get("eval") for r in records)
    rows = [m for m in M.read_metrics(run_dir) if "reward/progress/global_step" in m]
    assert [(m["step"], m["reward/progress/global_step"]) for m in rows] == [(1, 0.0), (2, 1.0)]
    assert all(m["reward/progress/max_steps"] == 2.0 for m in rows)
    assert all(m["reward/compute_score/length/mean"] >= 0.0 for m in rows)
    assert all("reward/compute_score/truth/mean" not in m for m in rows)  # text


def test_reported_values_of_several_processes_are_merged_in_process_order(monkeypatch):
    """_gather_reported: process 1 reported another column and scalar than process 0; the
    columns are joined in process order (None where a process had none), a scalar is the mean
    over the processes that reported it (two processes simulated over host_allgather)."""
    from jaxrl_llm import rewards as R
    from jaxrl_llm.train import collect

    def output(extras, reported):
        return R.RewardOutput(
            np.zeros(2, np.float32),
            {"t": np.zeros(2, np.float32)},
            {"t": 0},
            None,
            extras,
            reported,
        )

    mine = output({"t": {"pred": ["1", "2"]}}, {"t": {"m": 1.0}})
    other = output({"t": {"length": [3, 4]}}, {"t": {"m": 3.0, "k": 5.0}})
    captured = {}

    def two_processes(tree, *, what, tiled):
        assert tiled and what == "reported reward values"
        monkeypatch.setattr(collect.dist, "host_allgather", original)
        theirs = collect._gather_reported(other)  # one process: its own values
        captured["theirs"] = theirs
        rows, scalars = tree
        other_rows = np.asarray([json.dumps({"t": {"length": v}}) for v in (3, 4)], dtype=np.str_)
        other_scalars = np.asarray([json.dumps(other.reported)], dtype=np.str_)
        return np.concatenate([rows, other_rows]), np.concatenate([scalars, other_scalars])

    original = collect.dist.host_allgather
    monkeypatch.setattr(collect.dist, "host_allgather", two_processes)
    extras, reported = collect._gather_reported(mine)
    assert captured["theirs"] == ({"t": {"length": [3, 4]}}, {"t": {"m": 3.0, "k": 5.0}})
    assert extras == {"t": {"pred": ["1", "2", None, None], "length": [None, None, 3, 4]}}
    assert reported == {"t": {"m": 2.0, "k": 5.0}}
