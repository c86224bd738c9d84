"""Run logs: ``metrics.jsonl``, TensorBoard events, a progress bar and the end-of-run plot.

``RUN_DIR/metrics.jsonl`` holds one JSON object per line, each with an integer ``step`` and
float metrics named ``group/name`` (``reward/mean``, ``eval/accuracy``, ``actor/kl_ref``, ...);
non-finite values are written as ``null``. Training steps and evaluations are separate lines
(an evaluation line has only ``step`` and ``eval/*`` keys). TensorBoard event files go to
``RUN_DIR/tensorboard`` (``tensorboardX``), one scalar per metric; W&B and trackio are the
other trackers (:mod:`jaxrl_llm.train.tracking`, the ``logging:`` config section).

On resume from step ``k`` the lines of steps after ``k`` (written by the interrupted run after
its last checkpoint) are dropped, and TensorBoard purges them, so the logs read as one run.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxrl_llm.train.tracking import ExplainRows, TrackingPlan, open_trackers

METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"  # jaxrl_llm.train.completions
PLOT_FILE = "curves.png"


def _value(x: Any) -> float | int | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(v):
        return None
    return int(v) if isinstance(x, int | bool) else v


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file (or of ``RUN_DIR/metrics.jsonl``).

    A torn last line (a run killed while writing it; it is not JSON) is left out with a
    ``UserWarning`` and dropped by the next resume (:func:`_truncate`).

    Raises:
      ValueError: a line before the last is not a JSON object (``path:line`` named).
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    records = []
    for i, (number, line) in enumerate(lines):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if i == len(lines) - 1:
                import warnings

                warnings.warn(
                    f"{path}:{number}: the last line is torn (a run killed while writing it?): "
                    f"{line[:60]!r}; left out (a resume drops it)",
                    stacklevel=2,
                )
                break
            raise ValueError(
                f"{path}:{number}: not a JSON metrics record ({e}): {line[:80]!r}"
            ) from None
        records.append(record)
    return records


def _truncate(path: Path, last_step: int) -> None:
    """Drops the lines of steps after ``last_step``, and a torn last line (atomically)."""
    if not path.exists():
        return
    kept = [r for r in read_metrics(path) if int(r.get("step", 0)) <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    os.replace(tmp, path)


class MetricsLogger:
    """Writes metrics to ``metrics.jsonl`` and the run's trackers; shows a tqdm progress bar.

    Args:
      run_dir: the run directory.
      max_steps: the bar's total.
      start_step: the step the run starts (or resumes) from; later lines are dropped.
      tensorboard: write TensorBoard event files (ignored when ``tracking`` is given).
      progress: show the progress bar (stderr).
      tracking: the trackers besides ``metrics.jsonl`` (TensorBoard, W&B, trackio; see
        :mod:`jaxrl_llm.train.tracking`); default TensorBoard alone, as ``tensorboard`` says.
      run_config: the run's config as a plain mapping (the trackers' run config).
      explanation: the ``explain`` table as ``(question, answer)`` rows, given to the trackers
        once, when the run starts at step 0 (a resumed run's trackers have it).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        max_steps: int,
        start_step: int = 0,
        tensorboard: bool = True,
        progress: bool = True,
        tracking: TrackingPlan | None = None,
        run_config: Mapping[str, Any] | None = None,
        explanation: ExplainRows = (),
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        plan = tracking if tracking is not None else TrackingPlan(tensorboard=tensorboard)
        self.trackers = open_trackers(self.run_dir, plan, start_step=start_step, config=run_config)
        _truncate(self.path, start_step)
        self._file = self.path.open("a", encoding="utf-8")
        if start_step == 0:
            for tracker in self.trackers:
                tracker.start(explanation)
        self._bar = None
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True
            )

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Appends one record (flushed at once) and hands it to every tracker; returns it."""
        record: dict[str, Any] = {"step": int(step)}
        record.update({k: _value(v) for k, v in metrics.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for tracker in self.trackers:
            tracker.log(int(step), record)
        return record

    def log_completions(self, step: int, records: list[dict[str, Any]]) -> None:
        """Hands a step's ``completions.jsonl`` records to every tracker (a table each)."""
        for tracker in self.trackers:
            tracker.log_completions(int(step), records)

    def progress(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Moves the bar to ``step`` and shows reward, KL and tokens/s."""
        if self._bar is None:
            return
        shown = {}
        for label, key in (
            ("reward", "reward/mean"),
            ("acc", "accuracy"),
            ("kl", "kl"),
            ("loss", "actor/loss"),
            ("tok/s", "perf/tokens_per_s"),
        ):
            value = _value(metrics.get(key))
            if value is not None:
                shown[label] = f"{value:.3g}" if label != "tok/s" else f"{value:.0f}"
        self._bar.set_postfix(shown, refresh=False)
        self._bar.update(int(step) - self._bar.n)

    def write(self, message: str) -> None:
        """Prints a line without breaking the bar."""
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        self._file.close()
        for tracker in self.trackers:
            tracker.close()
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NullLogger:
    """A :class:`MetricsLogger` that writes nothing: the other processes of a multi-process run
    (process 0 alone writes the run's logs)."""

    def __init__(self, run_dir: str | os.PathLike, **_: Any):
        self.path = Path(run_dir) / METRICS_FILE

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        return {"step": int(step), **{k: _value(v) for k, v in metrics.items()}}

    def log_completions(self, step: int, records: list[dict[str, Any]]) -> None:
        pass

    def progress(self, step: int, metrics: Mapping[str, Any]) -> None:
        pass

    def write(self, message: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NullLogger:
        return self

    def __exit__(self, *exc) -> None:
        pass


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


_AT_K = re.compile(r"^eval/(mean|best|pass|maj)@(\d+)$")


def _at_k_keys(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, str]]]:
    """The sampled-evaluation keys present: ``{"pass": [(1, "eval/pass@1"), ...], ...}``."""
    found: dict[str, set[tuple[int, str]]] = {}
    for record in records:
        for key in record:
            m = _AT_K.match(key)
            if m:
                found.setdefault(m.group(1), set()).add((int(m.group(2)), key))
    return {kind: sorted(keys) for kind, keys in found.items()}


def _plot_band(ax: Any, records: list[dict[str, Any]], key: str, label: str) -> None:
    """``key`` against the step, with its bootstrap interval (``_ci_low``/``_ci_high``) shaded."""
    xs, ys = _series(records, key)
    (line,) = ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=label)
    band = [
        (r["step"], r[key + "_ci_low"], r[key + "_ci_high"])
        for r in records
        if r.get(key) is not None
        and r.get(key + "_ci_low") is not None
        and r.get(key + "_ci_high") is not None
    ]
    if band:
        steps, low, high = zip(*band, strict=True)
        ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.15, linewidth=0)


def plot_run(run_dir: str | os.PathLike, *, out: str | os.PathLike | None = None) -> Path | None:
    """Draws the training reward and held-out accuracy (or mean reward) against the step.

    With sampled evaluation (``train.eval_num_samples`` K > 1) two more panels: mean@K,
    pass@K, maj@K and best@K against the step with their 95% bootstrap intervals shaded, and
    pass@k against k (1, 2, 4, ..., K) at the first and the last evaluation.

    Writes ``RUN_DIR/curves.png`` (or ``out``) and returns its path; ``None`` when there is
    nothing to plot.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    panels = [
        ("training reward", [("reward/mean", "reward (mean)"), ("accuracy", "accuracy")]),
        ("held-out evaluation", [("eval/accuracy", "accuracy"), ("eval/reward_mean", "reward")]),
        (
            "preference (dpo)",
            [
                ("dpo/reward_accuracy", "reward accuracy"),
                ("eval/preference_accuracy", "eval preference accuracy"),
            ],
        ),
    ]
    panels = [(t, [(k, lbl) for k, lbl in s if _series(records, k)[0]]) for t, s in panels]
    panels = [(t, s) for t, s in panels if s]
    at_k = _at_k_keys(records)
    # The @K panel shows the largest K of each kind; the pass@k panel needs two k or more.
    over_steps = [keys[-1] for kind in ("mean", "pass", "maj", "best") if (keys := at_k.get(kind))]
    pass_keys = at_k.get("pass", [])
    n_panels = len(panels) + bool(over_steps) + (len(pass_keys) > 1)
    if not n_panels:
        return None
    fig, axes = plt.subplots(1, n_panels, figsize=(5.5 * n_panels, 4), squeeze=False)
    axes = list(axes[0])
    for ax, (title, series) in zip(axes, panels, strict=False):
        for key, label in series:
            xs, ys = _series(records, key)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
    axes = axes[len(panels) :]
    if over_steps:
        ax = axes.pop(0)
        for _, key in over_steps:
            _plot_band(ax, records, key, key.removeprefix("eval/"))
        ax.set_title("held-out, K samples per prompt (95% CI)")
        ax.set_xlabel("step")
    if len(pass_keys) > 1:
        ax = axes.pop(0)
        evals = [r for r in records if r.get(pass_keys[-1][1]) is not None]
        for record in {id(r): r for r in (evals[0], evals[-1])}.values():
            ks = [k for k, key in pass_keys if record.get(key) is not None]
            ys = [record[key] for k, key in pass_keys if record.get(key) is not None]
            ax.plot(ks, ys, marker="o", label=f"step {record['step']}")
        ax.set_xscale("log", base=2)
        ax.set_title("pass@k (unbiased estimator)")
        ax.set_xlabel("k")
    for ax in fig.axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(out) if out is not None else run_dir / PLOT_FILE
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


__all__ = ["METRICS_FILE", "PLOT_FILE", "MetricsLogger", "NullLogger", "plot_run", "read_metrics"]
