"""Experiment trackers behind one interface: TensorBoard, Weights & Biases, trackio.

A tracker is opened with the run's config (a plain mapping), receives the ``explain`` table
once when the run starts at step 0 (:meth:`Tracker.start`), and then one record per step
(:meth:`Tracker.log`: ``{"group/name": float | None}``; ``None`` is a non-finite value, which
trackers skip), and the logged steps' ``completions.jsonl`` records
(:meth:`Tracker.log_completions`: a ``completions`` table, Markdown text in TensorBoard).
``metrics.jsonl`` is written by
:class:`~jaxrl_llm.train.metrics.MetricsLogger` itself and is always on; the trackers here are
what ``logging:`` in the config turns on::

    logging:
      tensorboard: true                 # RUN_DIR/tensorboard (tensorboardX)
      wandb: {project: my-rl, entity: me, mode: offline}   # RUN_DIR/wandb
      trackio: {project: my-rl}        # trackio's local database (TRACKIO_DIR)

**Resuming.** A run's tracker identities live in ``RUN_DIR/tracking.json``: a resumed run
continues the same W&B run (``wandb.init(id=..., resume="allow")``) and the same trackio run
(by name, ``resume="allow"``); a fresh run (step 0) gets new ones. W&B keeps every point it was
sent, so the steps an interrupted run logged after its last checkpoint are logged again by the
resumed run. To keep that readable every W&B metric is plotted against our own ``step`` key
(``define_metric("*", step_metric="step")``), not W&B's monotonic internal ``_step``, which
would drop the repeated steps. TensorBoard purges them (``purge_step``).

``mode: offline`` (W&B) writes ``RUN_DIR/wandb/offline-run-*`` without any network; upload
later with ``wandb sync RUN_DIR/wandb/offline-run-*``. ``mode: disabled`` turns W&B into a
no-op. wandb and trackio are optional dependencies (``pip install wandb`` / ``trackio``; both
are in the ``tracking`` extra); asking for one that is not installed is an error at start.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

TRACKING_FILE = "tracking.json"

Record = Mapping[str, float | int | None]
ExplainRows = Sequence[tuple[str, str]]


class TrackerError(RuntimeError):
    """A tracker that was asked for cannot start (not installed, bad settings)."""


@dataclasses.dataclass(frozen=True)
class WandbSettings:
    """Where a W&B run goes (the ``logging.wandb`` section)."""

    project: str = "jaxrl_llm"
    entity: str | None = None
    mode: Literal["online", "offline", "disabled"] = "online"
    name: str | None = None
    group: str | None = None
    tags: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class TrackioSettings:
    """Where a trackio run goes (the ``logging.trackio`` section)."""

    project: str = "jaxrl_llm"
    name: str | None = None
    space_id: str | None = None


@dataclasses.dataclass(frozen=True)
class TrackingPlan:
    """Which trackers a run writes to, besides ``metrics.jsonl``."""

    tensorboard: bool = True
    wandb: WandbSettings | None = None
    trackio: TrackioSettings | None = None


class Tracker(Protocol):
    """What every tracker does."""

    def start(self, explanation: ExplainRows) -> None:
        """Records the run's ``explain`` table (once, when the run starts at step 0)."""

    def log(self, step: int, record: Record) -> None:
        """Records one step's metrics."""

    def log_completions(self, step: int, records: list[dict[str, Any]]) -> None:
        """Records a step's ``completions.jsonl`` records (:mod:`~jaxrl_llm.train.completions`)
        as a table."""

    def close(self) -> None:
        """Flushes and ends the run."""


COMPLETION_COLUMNS = [
    "kind",
    "prompt",
    "completion",
    "reward",
    "num_tokens",
    "truncated",
    "trained",
]


def completion_columns(records: list[dict[str, Any]]) -> list[str]:
    """The table's columns for ``records``: :data:`COMPLETION_COLUMNS`, then ``reward/<name>``
    for each reward term and ``extra/<column>`` for each column the rewards reported (in the
    order they first appear)."""
    terms: dict[str, None] = {}
    extras: dict[str, None] = {}
    for r in records:
        for x in r["samples"]:
            terms.update(dict.fromkeys(x.get("rewards", ())))
            extras.update(dict.fromkeys(x.get("extra", ())))
    return COMPLETION_COLUMNS + [f"reward/{t}" for t in terms] + [f"extra/{k}" for k in extras]


def _cell(value: Any) -> Any:
    """A reported value as a table cell: lists and mappings as their JSON text."""
    return json.dumps(value) if isinstance(value, list | dict) else value


def completion_rows(records: list[dict[str, Any]]) -> list[list[Any]]:
    """One row per sample of ``completions.jsonl`` records, in :func:`completion_columns`
    (``kind`` is ``train`` or ``eval``; ``trained`` is None for an evaluation's samples; a
    term or column a sample lacks is None)."""
    columns = completion_columns(records)
    wanted = [(c.split("/", 1)[0], c.split("/", 1)[1]) for c in columns[len(COMPLETION_COLUMNS) :]]
    return [
        [
            "eval" if r.get("eval") else "train",
            r["prompt"],
            x["completion"],
            x["reward"],
            x["num_tokens"],
            x["truncated"],
            x.get("trained"),
        ]
        + [
            _cell(x.get("rewards" if kind == "reward" else "extra", {}).get(key))
            for kind, key in wanted
        ]
        for r in records
        for x in r["samples"]
    ]


def completions_markdown(records: list[dict[str, Any]]) -> str:
    """``completions.jsonl`` records as Markdown: each prompt, then its samples, verbatim in
    code blocks (completions hold newlines and pipes that a table would break on)."""
    parts = []
    for r in records:
        kind = "evaluation" if r.get("eval") else "training"
        head = f"**{kind} prompt** (reward mean {r['reward_mean']:g})"
        parts.append(f"{head}\n\n```\n{r['prompt']}\n```")
        for i, x in enumerate(r["samples"], 1):
            parts.append(f"{i}. {sample_summary(x)}\n\n```\n{x['completion']}\n```")
    return "\n\n".join(parts)


def sample_summary(sample: dict[str, Any]) -> str:
    """One line on a ``completions.jsonl`` sample: its reward, each term's score, what the
    rewards reported, its length, and whether it was cut or left out of the update, e.g.
    ``reward 1, gsm8k 1, format 0, pred: 12, 9 tokens, truncated``."""
    terms = "".join(f", {k} {v:g}" for k, v in sample.get("rewards", {}).items())
    extra = "".join(f", {k}: {_cell(v)}" for k, v in sample.get("extra", {}).items())
    cut = ", truncated" if sample["truncated"] else ""
    dropped = ", not trained" if sample.get("trained") is False else ""
    return f"reward {sample['reward']:g}{terms}{extra}, {sample['num_tokens']} tokens{cut}{dropped}"


def _finite(record: Record) -> dict[str, float | int]:
    return {k: v for k, v in record.items() if k != "step" and v is not None}


def explain_markdown(explanation: ExplainRows) -> str:
    """The ``explain`` rows as a two-column Markdown table."""
    lines = ["| question | answer |", "|---|---|"]
    lines += [f"| {q} | {a.replace('|', '/')} |" for q, a in explanation]
    return "\n".join(lines)


class TensorBoardTracker:
    """``RUN_DIR/tensorboard`` event files: one scalar per metric, the config and the
    ``explain`` table as text."""

    def __init__(self, run_dir: Path, config: Mapping[str, Any], *, start_step: int):
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(
            str(run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None
        )
        self._config = config

    def start(self, explanation: ExplainRows) -> None:
        import yaml

        text = yaml.safe_dump(dict(self._config), sort_keys=False, allow_unicode=True)
        self._writer.add_text("config", "```yaml\n" + text + "```", 0)
        self._writer.add_text("explain", explain_markdown(explanation), 0)

    def log(self, step: int, record: Record) -> None:
        for key, value in _finite(record).items():
            self._writer.add_scalar(key, value, int(step))

    def log_completions(self, step: int, records: list[dict[str, Any]]) -> None:
        self._writer.add_text("completions", completions_markdown(records), int(step))

    def close(self) -> None:
        self._writer.close()


def _import(name: str, section: str) -> Any:
    try:
        return __import__(name)
    except ImportError:
        raise TrackerError(
            f"logging.{section} is set but {name} is not installed: pip install {name} "
            f"(or pip install 'jaxrl_llm[tracking]'), or remove logging.{section}"
        ) from None


class _Identity:
    """``RUN_DIR/tracking.json``: the trackers' run ids, kept across resumes."""

    def __init__(self, run_dir: Path, *, resumed: bool):
        self.path = run_dir / TRACKING_FILE
        self.ids: dict[str, str] = {}
        if resumed and self.path.is_file():
            try:
                self.ids = {str(k): str(v) for k, v in json.loads(self.path.read_text()).items()}
            except (ValueError, AttributeError):
                self.ids = {}  # unreadable: the resumed run starts new tracker runs

    def get(self, key: str, make: Any) -> str:
        if key not in self.ids:
            self.ids[key] = make()
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(self.ids, indent=1) + "\n")
            os.replace(tmp, self.path)
        return self.ids[key]


class WandbTracker:
    """A W&B run in ``RUN_DIR/wandb``, resumed by id (see the module docstring)."""

    def __init__(
        self,
        run_dir: Path,
        config: Mapping[str, Any],
        settings: WandbSettings,
        identity: _Identity,
    ):
        wandb = _import("wandb", "wandb")
        run_id = identity.get("wandb_run_id", lambda: secrets.token_hex(4))
        self._wandb = wandb
        try:
            self._run = wandb.init(
                project=settings.project,
                entity=settings.entity,
                mode=settings.mode,
                name=settings.name or run_dir.name,
                group=settings.group,
                tags=list(settings.tags) or None,
                id=run_id,
                resume="allow",
                config=dict(config),
                allow_val_change=True,
                dir=str(run_dir),
                settings=wandb.Settings(console="off", silent=True),
            )
        except Exception as e:  # wandb's own errors: no API key, no network, bad entity
            raise TrackerError(
                f"logging.wandb: wandb.init failed ({type(e).__name__}: {e}); set "
                "logging.wandb.mode=offline to write the run without network"
            ) from e
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    @property
    def run_id(self) -> str:
        return self._run.id

    def start(self, explanation: ExplainRows) -> None:
        table = self._wandb.Table(
            columns=["question", "answer"], data=[list(r) for r in explanation]
        )
        self._run.log({"explain": table, "step": 0})

    def log(self, step: int, record: Record) -> None:
        self._run.log({**_finite(record), "step": int(step)})

    def log_completions(self, step: int, records: list[dict[str, Any]]) -> None:
        table = self._wandb.Table(
            columns=completion_columns(records), data=completion_rows(records)
        )
        self._run.log({"completions": table, "step": int(step)})

    def close(self) -> None:
        self._run.finish()


class TrackioTracker:
    """A trackio run (local SQLite database under ``TRACKIO_DIR``, or a Space), resumed by
    name."""

    def __init__(
        self,
        run_dir: Path,
        config: Mapping[str, Any],
        settings: TrackioSettings,
        identity: _Identity,
    ):
        trackio = _import("trackio", "trackio")
        name = identity.get(
            "trackio_run_name", lambda: settings.name or f"{run_dir.name}-{secrets.token_hex(3)}"
        )
        self._trackio = trackio
        self._run = trackio.init(
            project=settings.project,
            name=name,
            space_id=settings.space_id,
            config=dict(config),
            resume="allow",
            embed=False,
            auto_log_cpu=False,
            auto_log_gpu=False,
        )

    @property
    def run_name(self) -> str:
        return self._run.name

    def start(self, explanation: ExplainRows) -> None:
        table = self._trackio.Table(
            columns=["question", "answer"], data=[list(r) for r in explanation]
        )
        self._trackio.log({"explain": table}, step=0)

    def log(self, step: int, record: Record) -> None:
        self._trackio.log(_finite(record), step=int(step))

    def log_completions(self, step: int, records: list[dict[str, Any]]) -> None:
        table = self._trackio.Table(
            columns=completion_columns(records), data=completion_rows(records)
        )
        self._trackio.log({"completions": table}, step=int(step))

    def close(self) -> None:
        self._trackio.finish()


def open_trackers(
    run_dir: str | os.PathLike,
    plan: TrackingPlan,
    *,
    start_step: int,
    config: Mapping[str, Any] | None = None,
) -> list[Tracker]:
    """The trackers of ``plan`` for the run in ``run_dir`` starting (or resuming) at
    ``start_step``, given the run's ``config`` (a plain mapping). A tracker that fails to
    start closes the ones already open and raises."""
    run_dir, config = Path(run_dir), dict(config or {})
    identity = _Identity(run_dir, resumed=start_step > 0)
    makers = []
    if plan.tensorboard:
        makers.append(lambda: TensorBoardTracker(run_dir, config, start_step=start_step))
    if plan.wandb is not None and plan.wandb.mode != "disabled":
        makers.append(lambda: WandbTracker(run_dir, config, plan.wandb, identity))
    if plan.trackio is not None:
        makers.append(lambda: TrackioTracker(run_dir, config, plan.trackio, identity))
    trackers: list[Tracker] = []
    try:
        for make in makers:
            trackers.append(make())
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    return trackers


__all__ = [
    "TRACKING_FILE",
    "TensorBoardTracker",
    "Tracker",
    "TrackerError",
    "TrackingPlan",
    "TrackioSettings",
    "TrackioTracker",
    "WandbSettings",
    "WandbTracker",
    "explain_markdown",
    "open_trackers",
]
