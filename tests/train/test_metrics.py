"""jaxrl_llm.train.metrics: metrics.jsonl, TensorBoard, resume truncation, the plot."""

from __future__ import annotations

import json
import math

from jaxrl_llm.train.metrics import MetricsLogger, plot_run, read_metrics


def test_jsonl_tensorboard_and_plot(tmp_path):
    with MetricsLogger(tmp_path, max_steps=4) as log:
        for step in range(1, 5):
            m = {
                "reward/mean": step / 4,
                "accuracy": step / 8,
                "kl": 0.01 * step,
                "perf/tokens_per_s": 100.0,
                "actor/grad_norm": math.nan,
            }
            log.log(step, m)
            log.progress(step, m)
        log.log(4, {"eval/accuracy": 0.5, "eval/reward_mean": 0.4})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # strict JSON per line
    assert len(records) == 5 and records[0]["step"] == 1 and records[0]["reward/mean"] == 0.25
    assert records[0]["actor/grad_norm"] is None  # NaN is written as null
    assert records[-1] == {"step": 4, "eval/accuracy": 0.5, "eval/reward_mean": 0.4}
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    png = plot_run(tmp_path)
    assert png.name == "curves.png" and png.read_bytes()[:4] == b"\x89PNG"


def test_resume_drops_the_lines_after_the_checkpoint(tmp_path):
    with MetricsLogger(tmp_path, max_steps=5, tensorboard=False, progress=False) as log:
        for step in range(1, 6):
            log.log(step, {"reward/mean": step})
    with MetricsLogger(
        tmp_path, max_steps=5, start_step=2, tensorboard=False, progress=False
    ) as log:
        log.log(3, {"reward/mean": 30})
    assert [(r["step"], r["reward/mean"]) for r in read_metrics(tmp_path)] == [
        (1, 1),
        (2, 2),
        (3, 30),
    ]
    assert plot_run(tmp_path / "nothing") is None
