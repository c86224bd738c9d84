"""Trackers (jaxrl_llm.train.tracking): W&B offline, trackio, TensorBoard, behind MetricsLogger.

The files the trackers write are read back with small readers of their on-disk formats (W&B's
``.wandb`` file is a LevelDB log of ``Record`` protos; TensorBoard's events file is TFRecords of
``Event`` protos), so the tests check what a user would see after ``wandb sync`` or in
TensorBoard, not what we passed to the libraries.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from jaxrl_llm.train import metrics as M
from jaxrl_llm.train import tracking as T

EXPLAIN = [("Where does the KL go?", "nowhere (β = 0)"), ("What is finally optimised?", "x | y")]


def _wandb_records(run_file: Path) -> list:
    """The ``Record`` protos of a W&B ``run-ID.wandb`` file (LevelDB log format, 32 KiB
    blocks of ``crc32 | length | type`` chunks after a 7-byte ``:W&B`` header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = run_file.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is zero padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 or pos + 7 + length > len(data):  # the end, or a chunk still being written
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: a whole record
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _complete_records(run_file: Path, timeout_s: float = 30.0) -> list:
    """The records of a run file once it ends with the ``exit`` record: ``finish()`` returns
    before W&B's service process has flushed an offline run's file."""
    from google.protobuf.message import DecodeError

    deadline, error = time.monotonic() + timeout_s, None
    while True:
        try:
            records = _wandb_records(run_file)
        except DecodeError as e:  # read while W&B's service was writing a record
            records, error = [], e
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        assert time.monotonic() < deadline, f"{run_file} not completed in {timeout_s} s ({error})"
        time.sleep(0.1)


def _wandb_runs(run_dir: Path) -> list[dict]:
    """The offline runs of ``RUN_DIR/wandb`` in start order: id, config, history rows."""
    runs = []
    for run_file in (run_dir / "wandb").glob("offline-run-*/run-*.wandb"):
        run: dict = {"id": None, "start": None, "config": {}, "history": []}
        for record in _complete_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"] = record.run.run_id
                run["start"] = (record.run.start_time.seconds, record.run.start_time.nanos)
                updates = record.run.config.update
            elif kind == "config":
                updates = record.config.update
            elif kind == "history":
                item = record.history.item
                run["history"].append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in item}
                )
                continue
            else:
                continue
            run["config"].update({u.key: json.loads(u.value_json) for u in updates})
        runs.append(run)
    assert runs, "no offline W&B run was written"
    return sorted(runs, key=lambda r: r["start"])


def _tensorboard_events(run_dir: Path) -> list:
    """The ``Event`` protos of ``RUN_DIR/tensorboard`` (TFRecord: length, crc, data, crc)."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted((run_dir / "tensorboard").glob("events.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[pos + 12 : pos + 12 + length])
            events.append(event)
            pos += 12 + length + 4
    return events


def _offline(**kw) -> T.TrackingPlan:
    return T.TrackingPlan(tensorboard=False, wandb=T.WandbSettings(mode="offline", **kw))


# completions.jsonl records of one step: a training prompt and an evaluation one
RECORDS = [
    {
        "step": 2,
        "prompt": "<|im_start|>user\nWhat is 1 + 1?",
        "reward_mean": 0.5,
        "samples": [
            {
                "completion": "2 | two\nok",
                "reward": 1.0,
                "num_tokens": 4,
                "truncated": False,
                "trained": True,
            },
            {
                "completion": "11",
                "reward": 0.0,
                "num_tokens": 8,
                "truncated": True,
                "trained": False,
            },
        ],
    },
    {
        "step": 2,
        "eval": True,
        "prompt": "What is 2 + 2?",
        "reward_mean": 1.0,
        "samples": [{"completion": "4", "reward": 1.0, "num_tokens": 2, "truncated": False}],
    },
]


def test_completion_tables_and_markdown():
    assert T.completion_rows(RECORDS) == [
        ["train", RECORDS[0]["prompt"], "2 | two\nok", 1.0, 4, False, True],
        ["train", RECORDS[0]["prompt"], "11", 0.0, 8, True, False],
        ["eval", "What is 2 + 2?", "4", 1.0, 2, False, None],
    ]
    text = T.completions_markdown(RECORDS)
    assert (
        "**training prompt** (reward mean 0.5)\n\n```\n<|im_start|>user\nWhat is 1 + 1?\n```"
        in text
    )
    assert "1. reward 1, 4 tokens\n\n```\n2 | two\nok\n```" in text  # verbatim
    assert "2. reward 0, 8 tokens, truncated, not trained" in text
    assert "**evaluation prompt** (reward mean 1)" in text


def test_completion_tables_show_each_terms_score_and_the_reported_columns():
    """Records with per-term scores and reported columns (``rewards`` / ``extra``): one
    column each, in first-seen order, None where a sample lacks one; lists as JSON text."""
    records = json.loads(json.dumps(RECORDS))
    first, second = records[0]["samples"]
    first.update(rewards={"acc": 1.0, "fmt": 0.5}, extra={"pred": "2", "steps": [1, 2]})
    second.update(rewards={"acc": 0.0, "fmt": 0.0}, extra={"pred": None})
    assert T.completion_columns(records) == [
        *T.COMPLETION_COLUMNS,
        "reward/acc",
        "reward/fmt",
        "extra/pred",
        "extra/steps",
    ]
    rows = T.completion_rows(records)
    assert [r[len(T.COMPLETION_COLUMNS) :] for r in rows] == [
        [1.0, 0.5, "2", "[1, 2]"],
        [0.0, 0.0, None, None],
        [None, None, None, None],  # the evaluation's sample reports nothing
    ]
    text = T.completions_markdown(records)
    assert "1. reward 1, acc 1, fmt 0.5, pred: 2, steps: [1, 2], 4 tokens" in text


def _log_steps(run_dir: Path, plan: T.TrackingPlan, start: int, stop: int, **kw) -> None:
    with M.MetricsLogger(
        run_dir, max_steps=stop, start_step=start, progress=False, tracking=plan, **kw
    ) as logger:
        for step in range(start + 1, stop + 1):
            logger.log(step, {"reward/mean": step / 10, "kl": float("nan")})
            if step == 2:
                logger.log_completions(step, RECORDS)


def test_wandb_offline_run_has_the_config_the_explain_table_and_every_step(tmp_path):
    config = {"algorithm": {"name": "grpo"}, "optim": {"lr": 1e-6}}
    _log_steps(
        tmp_path, _offline(project="p", tags=("a",)), 0, 3, run_config=config, explanation=EXPLAIN
    )
    [run] = _wandb_runs(tmp_path)
    assert run["config"]["algorithm"] == {"name": "grpo"} and run["config"]["optim"]["lr"] == 1e-6
    explain = [h for h in run["history"] if "explain/_type" in h]
    assert len(explain) == 1 and explain[0]["explain/nrows"] == 2 and explain[0]["step"] == 0
    steps = [(h["step"], h["reward/mean"]) for h in run["history"] if "reward/mean" in h]
    assert steps == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert not any("kl" in h for h in run["history"])  # non-finite values are skipped
    table = next((tmp_path / "wandb").glob("offline-run-*/files/media/table/explain_*.json"))
    assert json.loads(table.read_text())["data"][1] == ["What is finally optimised?", "x | y"]
    table = next((tmp_path / "wandb").glob("offline-run-*/files/media/table/completions_*.json"))
    assert json.loads(table.read_text())["columns"] == T.COMPLETION_COLUMNS
    assert json.loads(table.read_text())["data"] == T.completion_rows(RECORDS)
    logged = [h for h in run["history"] if "completions/_type" in h]
    assert [h["step"] for h in logged] == [2]
    assert json.loads((tmp_path / T.TRACKING_FILE).read_text())["wandb_run_id"] == run["id"]
    assert (tmp_path / M.METRICS_FILE).exists()  # metrics.jsonl is always written


def test_resumed_run_continues_the_same_wandb_run_and_a_fresh_one_does_not(tmp_path):
    _log_steps(tmp_path, _offline(), 0, 2, run_config={"a": 1}, explanation=EXPLAIN)
    [first] = _wandb_runs(tmp_path)
    _log_steps(tmp_path, _offline(), 1, 3, run_config={"a": 1}, explanation=EXPLAIN)  # resume at 1
    runs = _wandb_runs(tmp_path)
    resumed = runs[-1]
    assert len(runs) == 2 and resumed["id"] == first["id"]
    assert [h["step"] for h in resumed["history"] if "reward/mean" in h] == [2, 3]
    assert not any("explain/_type" in h for h in resumed["history"])  # logged once, at the start
    assert [r["step"] for r in M.read_metrics(tmp_path)] == [1, 2, 3]  # the jsonl is truncated
    _log_steps(tmp_path, _offline(), 0, 1)  # started over at step 0: a new W&B run
    runs = _wandb_runs(tmp_path)
    assert len(runs) == 3 and runs[-1]["id"] != first["id"]


def test_tensorboard_gets_the_config_and_explain_table_as_text_once(tmp_path):
    plan = T.TrackingPlan(tensorboard=True)
    _log_steps(tmp_path, plan, 0, 2, run_config={"optim": {"lr": 0.5}}, explanation=EXPLAIN)
    events = _tensorboard_events(tmp_path)
    texts = {
        v.tag: v.tensor.string_val[0].decode()
        for e in events
        for v in e.summary.value
        if v.tensor.string_val
    }
    assert "lr: 0.5" in texts["config/text_summary"]
    assert "| Where does the KL go? | nowhere (β = 0) |" in texts["explain/text_summary"]
    assert "x / y" in texts["explain/text_summary"]  # a | in an answer cannot split the table
    assert texts["completions/text_summary"] == T.completions_markdown(RECORDS)
    scalars = [
        (e.step, v.tag, v.simple_value)
        for e in events
        for v in e.summary.value
        if v.tag == "reward/mean"
    ]
    assert scalars == [
        (1, "reward/mean", pytest.approx(0.1)),
        (2, "reward/mean", pytest.approx(0.2)),
    ]


def test_trackio_run_is_written_and_resumed_by_name(tmp_path):
    # trackio reads TRACKIO_DIR when imported, so the run happens in a fresh interpreter.
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from jaxrl_llm.train import metrics as M, tracking as T
        plan = T.TrackingPlan(tensorboard=False, trackio=T.TrackioSettings(project="proj"))
        run = Path({str(tmp_path / "run")!r})
        for start, stop in ((0, 2), (1, 3)):
            with M.MetricsLogger(run, max_steps=stop, start_step=start, progress=False,
                                 tracking=plan, run_config={{"lr": 0.5}},
                                 explanation=[("q", "a")]) as logger:
                for step in range(start + 1, stop + 1):
                    logger.log(step, {{"reward/mean": step / 10}})
                logger.log_completions(stop, [{{"step": stop, "prompt": "p", "reward_mean": 1.0,
                    "samples": [{{"completion": "c", "reward": 1.0, "num_tokens": 1,
                                 "truncated": False, "trained": True}}]}}])
        """
    )
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")}
    subprocess.run(
        [sys.executable, "-c", script], env=env, check=True, capture_output=True, timeout=120
    )
    import sqlite3

    with sqlite3.connect(tmp_path / "trackio" / "proj.db") as db:
        rows = db.execute("SELECT run_name, step, metrics FROM metrics ORDER BY id").fetchall()
        configs = db.execute("SELECT config FROM configs").fetchall()
    name = json.loads((tmp_path / "run" / T.TRACKING_FILE).read_text())["trackio_run_name"]
    assert name.startswith("run-") and {r[0] for r in rows} == {name}  # one run, resumed
    reward = [
        (step, json.loads(m)["reward/mean"])
        for _, step, m in rows
        if "reward/mean" in json.loads(m)
    ]
    assert reward == [(1, 0.1), (2, 0.2), (2, 0.2), (3, 0.3)]  # step 2 re-logged after resume
    logged = [(step, json.loads(m)) for _, step, m in rows]
    tables = [(step, m["completions"]) for step, m in logged if "completions" in m]
    assert [step for step, _ in tables] == [2, 3] and "c" in json.dumps(tables[0][1])
    assert any("explain" in json.loads(m) for _, _, m in rows)
    assert any(json.loads(c[0]).get("lr") == 0.5 for c in configs)


def test_a_tracker_that_is_not_installed_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "trackio", None)  # import trackio raises ImportError
    plan = T.TrackingPlan(tensorboard=True, trackio=T.TrackioSettings())
    with pytest.raises(
        T.TrackerError, match=r"logging.trackio is set but trackio is not installed"
    ):
        M.MetricsLogger(tmp_path, max_steps=1, progress=False, tracking=plan)
    assert not (tmp_path / M.METRICS_FILE).exists()  # nothing was truncated or opened


def test_wandb_init_failure_is_a_clear_error(tmp_path, monkeypatch):
    import wandb

    def refuse(**_):
        raise wandb.errors.UsageError("api_key not configured (no-tty)")

    monkeypatch.setattr(wandb, "init", refuse)
    plan = T.TrackingPlan(tensorboard=False, wandb=T.WandbSettings(mode="online"))
    with pytest.raises(T.TrackerError, match=r"wandb.init failed .*mode=offline"):
        M.MetricsLogger(tmp_path, max_steps=1, progress=False, tracking=plan)


def test_disabled_wandb_writes_nothing(tmp_path):
    plan = T.TrackingPlan(tensorboard=False, wandb=T.WandbSettings(mode="disabled"))
    _log_steps(tmp_path, plan, 0, 1)
    assert not (tmp_path / "wandb").exists() and not (tmp_path / T.TRACKING_FILE).exists()


def test_the_logging_section_becomes_the_tracking_plan():
    from jaxrl_llm.train.setup import tracking_plan
    from tests.train import helpers as H

    config = H.config(
        "tiny.yaml",
        "logging.wandb={project: p, mode: offline, tags: [x]}",
        "logging.tensorboard=false",
    )
    assert tracking_plan(config) == T.TrackingPlan(
        tensorboard=False, wandb=T.WandbSettings(project="p", mode="offline", tags=("x",))
    )


@pytest.mark.slow
def test_a_resumed_training_run_continues_its_wandb_run(tmp_path):
    from jaxrl_llm.train import loop
    from tests.train import helpers as H

    run_dir = tmp_path / "run"
    overrides = ("data.eval_size=0", "train.save_every=1", "logging.wandb={mode: offline}")
    loop.train(H.config("tiny.yaml", *overrides), run_dir=run_dir, max_steps=1, progress=False)
    loop.train(H.config("tiny.yaml", *overrides), run_dir=run_dir, max_steps=2, progress=False)
    first, resumed = _wandb_runs(run_dir)
    assert resumed["id"] == first["id"]
    assert first["config"]["algorithm"]["name"] == "grpo"  # the resolved config, as saved
    assert [h["step"] for h in first["history"] if "reward/mean" in h] == [1]
    assert [h["step"] for h in resumed["history"] if "reward/mean" in h] == [2]
    rows = [h for h in first["history"] if "explain/_type" in h]
    assert len(rows) == 1 and not any("explain/_type" in h for h in resumed["history"])
