"""jaxrl_llm.train.metrics: metrics.jsonl, TensorBoard, resume truncation, the plot."""

from __future__ import annotations

import json
import math

import pytest

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


def test_plot_shows_sampled_evaluation_with_intervals_and_pass_at_k_against_k(
    tmp_path, monkeypatch
):
    import matplotlib.figure

    def at_k(step: int, base: float) -> dict:
        values = {"mean@4": base, "best@4": base + 0.3, "maj@4": base + 0.1}
        values |= {f"pass@{k}": base + 0.1 * k for k in (1, 2, 4)}
        out = {"eval/accuracy": base}
        for name, v in values.items():
            out |= {f"eval/{name}": v, f"eval/{name}_ci_low": v - 0.05}
            out |= {f"eval/{name}_ci_high": v + 0.05}
        return out

    with MetricsLogger(tmp_path, max_steps=2, tensorboard=False, progress=False) as log:
        log.log(0, at_k(0, 0.1))
        log.log(1, {"reward/mean": 0.2})
        log.log(2, at_k(2, 0.3))
    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    plot_run(tmp_path)
    [fig] = saved
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert set(axes) == {
        "training reward",
        "held-out evaluation",
        "held-out, K samples per prompt (95% CI)",
        "pass@k (unbiased estimator)",
    }
    over_steps = axes["held-out, K samples per prompt (95% CI)"]
    lines = {line.get_label(): list(line.get_ydata()) for line in over_steps.get_lines()}
    assert lines == {
        "mean@4": [0.1, 0.3],
        "pass@4": [pytest.approx(0.5), pytest.approx(0.7)],
        "maj@4": [pytest.approx(0.2), pytest.approx(0.4)],
        "best@4": [pytest.approx(0.4), pytest.approx(0.6)],
    }
    assert len(over_steps.collections) == 4  # one shaded interval per metric
    by_k = axes["pass@k (unbiased estimator)"]
    curves = {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
        for line in by_k.get_lines()
    }
    assert curves["step 0"] == (
        [1, 2, 4],
        [pytest.approx(0.2), pytest.approx(0.3), pytest.approx(0.5)],
    )
    assert set(curves) == {"step 0", "step 2"}
