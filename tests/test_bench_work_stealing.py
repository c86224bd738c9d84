"""`scripts/bench_work_stealing.py` on the tiny random model, so the benchmark cannot rot."""

import json

import pytest

from tests.scripts import load_script


def test_bench_work_stealing_tiny(tmp_path):
    bench = load_script("bench_work_stealing")
    out = tmp_path / "stealing.json"
    argv = ["--model", "tiny-random", "--engines", "2", "--prompts", "8", "--samples", "2"]
    argv += ["--short", "1", "2", "--long", "20", "24", "--slots", "2"]
    result = bench.main([*argv, "--steps-per-dispatch", "4", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert "cpu" in result and len(result["load_avg_after"]) == 3
    assert set(result["modes"]) == {"split", "stealing"}
    for mode in result["modes"].values():
        assert len(mode["decode_steps"]) == 2 and mode["critical_path_steps"] > 0
        assert mode["useful_tokens_per_s"] > 0
    assert result["modes"]["split"]["prompts_stolen"] == [0, 0]
    # The budgets are the workload's: every useful token counted (the script checks), and the
    # same tokens in both modes on this model.
    assert 8 * 2 <= result["budgets"]["useful"] <= 8 * 2 * 24
    assert result["agreement"]["samples"] == 16 and result["agreement"]["samples_differing"] == 0
    assert result["critical_path_ratio"] > 0


@pytest.mark.slow
def test_bench_work_stealing_two_processes_tiny(tmp_path):
    """``--processes 2``: two processes of a jax.distributed job, one engine each, the
    processes' figures merged (an engine per process, in process order)."""
    bench = load_script("bench_work_stealing")
    out = tmp_path / "stealing.json"
    argv = ["--model", "tiny-random", "--processes", "2", "--engines", "1", "--prompts", "8"]
    argv += ["--samples", "2", "--short", "1", "2", "--long", "20", "24", "--slots", "2"]
    result = bench.main([*argv, "--steps-per-dispatch", "4", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["processes"] == 2 and "--processes 2" in result["command"]
    for mode in result["modes"].values():
        assert len(mode["decode_steps"]) == 2 and len(mode["prompts_stolen"]) == 2
        assert mode["critical_path_steps"] == max(mode["decode_steps"]) > 0
    assert result["agreement"]["samples"] == 16 and result["agreement"]["samples_differing"] == 0
