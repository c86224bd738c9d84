"""The run directory's failure paths (issue 19), through ``jaxrl-llm`` in-process.

Each case checks the exit status, the message (what was wrong, where, what to do), that no
traceback is printed, and that nothing of the run directory was lost: every file of it
(checkpoints, export/, every metrics line, config.yaml) is byte-identical afterwards.

Most cases fail in the run directory's preflight (:mod:`jaxrl_llm.train.rundir`), before a model
is built, on a *fake* run: the files a run leaves, with step folders that hold only their
``meta`` JSON. The cases that resume use a *real* run (a tiny random model's state saved as
step 1, built once per module, no compile); two cases train one step and are marked slow. The
preemption test (SIGTERM / SIGINT in a subprocess, then an exact resume) is in
``tests/train/test_faults.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import textwrap
from pathlib import Path

import pytest

from jaxrl_llm.cli import main
from jaxrl_llm.config import load_config, save_config, to_yaml
from jaxrl_llm.train import rundir

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = str(CONFIGS / "tiny.yaml")
METRICS = [{"step": 1, "reward/mean": 0.25}, {"step": 2, "reward/mean": 0.5}]


def _train(run_dir: Path | str, *extra: str) -> list[str]:
    return ["train", "--config", TINY, "--run-dir", str(run_dir), "--no-progress",
            "data.eval_size=0", *extra]  # fmt: skip


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    status = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return status, err


def _snapshot(folder: Path) -> dict[str, str]:
    """Every entry under ``folder``: a file's sha256, a link's target, a folder's marker."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[rel] = "/"
    return out


def _fake_run(run_dir: Path, steps: tuple[int, ...] = (2,)) -> Path:
    """The files a finished run leaves: config.yaml, metrics.jsonl, tensorboard/, export/ and
    step folders (only their meta JSON)."""
    run_dir.mkdir(parents=True)
    save_config(load_config(TINY), run_dir / "config.yaml")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in METRICS))
    (run_dir / "tensorboard").mkdir()
    (run_dir / "tensorboard" / "events.out.tfevents.1").write_bytes(b"events")
    (run_dir / "export").mkdir()
    (run_dir / "export" / "config.json").write_text("{}")
    (run_dir / "export" / "model.safetensors").write_bytes(b"the trained weights")
    for step in steps:
        meta = run_dir / "checkpoints" / str(step) / "meta"
        meta.mkdir(parents=True)
        (meta / "metadata").write_text(json.dumps({"step": step}))
    return run_dir


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    """A resumable run: the tiny model's fresh state saved as step 1, config.yaml, metrics."""
    from jaxrl_llm.data import BatchIterator
    from jaxrl_llm.train import setup
    from jaxrl_llm.train.checkpoint import Checkpointer
    from jaxrl_llm.train.loop import data_fingerprint

    run_dir = tmp_path_factory.mktemp("failure_paths") / "real"
    config = load_config(TINY, ["data.eval_size=0"])
    run = setup.resolve(config, run_dir)
    it = BatchIterator(run.data.train, config.rollout.prompts_per_step, seed=0, pad_multiple=32)
    it.next_batch()
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        meta = {
            "data": it.state_dict(),
            "data_fingerprint": data_fingerprint(run.data.train),
            "config": to_yaml(config),
        }
        ckpt.save(1, run.state._replace(step=run.state.step + 1), meta=meta)
    save_config(config, run_dir / "config.yaml")
    (run_dir / "metrics.jsonl").write_text(json.dumps(METRICS[0]) + "\n")
    return run_dir


@pytest.fixture
def run_copy(real_run, tmp_path) -> Path:
    return Path(shutil.copytree(real_run, tmp_path / "run", symlinks=True))


# ---------------------------------------------------------------------------------------------
# A run without a usable checkpoint is never silently restarted.


def _delete_checkpoints(run: Path) -> str:
    shutil.rmtree(run / "checkpoints")
    return "checkpoints is missing (deleted?)"


def _checkpoints_a_file(run: Path) -> str:
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").write_text("not a folder")
    return "checkpoints is a file, not the checkpoints folder"


def _all_unreadable(run: Path) -> str:
    (run / "checkpoints" / "unreadable").mkdir()
    (run / "checkpoints" / "2").rename(run / "checkpoints" / "unreadable" / "2")
    return "every checkpoint was unreadable (moved to"


def _step_folders_deleted(run: Path) -> str:
    (run / ".checkpointed").write_text('{"step": 2}\n')
    shutil.rmtree(run / "checkpoints" / "2")
    return "step 2 was checkpointed"


@pytest.mark.parametrize(
    "damage", [_delete_checkpoints, _checkpoints_a_file, _all_unreadable, _step_folders_deleted]
)
def test_a_run_without_a_usable_checkpoint_is_refused(tmp_path, capsys, damage):
    run = _fake_run(tmp_path / "run")
    why = damage(run)
    before = _snapshot(run)
    status, err = _cli(_train(run), capsys)
    assert status == 2
    for fragment in (f"{run} holds a run but no usable checkpoint", why,
                     "export holds the exported weights", "metrics.jsonl has steps 1-2",
                     "rerun with --overwrite", "or use a new --run-dir"):  # fmt: skip
        assert fragment in err, err
    assert _snapshot(run) == before  # no .lock left either


def test_a_run_killed_before_its_first_checkpoint_restarts(tmp_path):
    """What a resume loses anyway (no record of a checkpoint, no export) is not a refusal."""
    run = tmp_path / "run"
    run.mkdir()
    save_config(load_config(TINY), run / "config.yaml")
    (run / "checkpoints" / "1.orbax-checkpoint-tmp-123").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps(METRICS[0]) + "\n")
    assert rundir.check_run_dir(run) == []


def test_every_step_unreadable_then_the_rerun_is_refused(run_copy, capsys):
    data = max((p for p in (run_copy / "checkpoints/1/state").rglob("*") if p.is_file()),
               key=lambda p: p.stat().st_size)  # fmt: skip
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    metrics = (run_copy / "metrics.jsonl").read_bytes()
    status, err = _cli(_train(run_copy), capsys)
    assert status == 2
    assert f"no readable checkpoint in {run_copy / 'checkpoints'}: step 1:" in err, err
    assert "jaxrl-llm train" in err and len(err.splitlines()) <= 3, err  # not TensorStore's spec
    assert "rerun with --overwrite" in err
    assert (run_copy / "checkpoints" / "unreadable" / "1").is_dir()  # kept for inspection
    before = _snapshot(run_copy)
    status, err = _cli(_train(run_copy), capsys)
    assert status == 2 and "every checkpoint was unreadable" in err, err
    assert _snapshot(run_copy) == before and (run_copy / "metrics.jsonl").read_bytes() == metrics


# ---------------------------------------------------------------------------------------------
# Step folders named after another step; the export folder.


def test_a_step_folder_holding_another_step_is_refused(tmp_path, capsys):
    run = _fake_run(tmp_path / "run")
    shutil.copytree(run / "checkpoints" / "2", run / "checkpoints" / "7")  # a renamed copy
    before = _snapshot(run)
    status, err = _cli(_train(run), capsys)
    assert status == 2
    assert f"{run / 'checkpoints' / '7'} holds step 2" in err, err
    assert "every later save would silently do nothing" in err
    assert _snapshot(run) == before
    other = _fake_run(tmp_path / "other", steps=(3,))
    shutil.rmtree(run / "checkpoints" / "7")
    (run / "checkpoints" / "9").symlink_to(other / "checkpoints" / "3")  # another run's step
    status, err = _cli(_train(run), capsys)
    assert status == 2
    assert f"9 (a link to {other / 'checkpoints' / '3'}) holds step 3" in err, err


def test_a_renamed_checkpoint_fails_its_restore(tmp_path):
    """The check behind the preflight's: ``Checkpointer.restore`` compares the folder's number
    with the step its meta records."""
    import optax

    from jaxrl_llm.train import checkpoint as C
    from tests.train import helpers as H

    state = H.fresh_state(H.tiny_lm(0), optax.adam(1e-2), H.recipe("grpo"), seed=0)[2]
    with C.Checkpointer(tmp_path / "c") as ckpt:
        ckpt.save(1, state)
    shutil.copytree(tmp_path / "c" / "1", tmp_path / "c" / "5")
    with C.Checkpointer(tmp_path / "c") as ckpt, pytest.raises(C.CheckpointMismatchError) as e:
        ckpt.restore(state)
    assert f"{tmp_path / 'c' / '5'} holds step 1, not 5" in str(e.value)
    assert (tmp_path / "c" / "5").is_dir()  # not treated as corruption: nothing moved


def test_an_export_symlink_is_not_written_through(tmp_path, capsys):
    run = _fake_run(tmp_path / "run")
    elsewhere = tmp_path / "someone_elses"
    shutil.move(run / "export", elsewhere)
    (run / "export").symlink_to(elsewhere)
    before, theirs = _snapshot(run), _snapshot(elsewhere)
    for argv in (_train(run), ["export", "--run-dir", str(run)]):
        status, err = _cli(argv, capsys)
        assert status == 2
        assert f"{run / 'export'} is a symlink (to {elsewhere})" in err, err
        assert "would write through it" in err
    assert _snapshot(run) == before and _snapshot(elsewhere) == theirs


def test_export_out_replaces_a_stale_sharded_model_and_refuses_foreign_folders(
    run_copy, tmp_path, capsys
):
    out = tmp_path / "out"
    out.mkdir()
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for name in shards:
        (out / name).write_bytes(b"old weights")
    index = {"metadata": {}, "weight_map": {"lm_head.weight": shards[1]}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text("{}")
    (out / "README.md").write_text("my notes")
    status, err = _cli(["export", "--run-dir", str(run_copy), "--out", str(out)], capsys)
    assert status == 0, err
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in names and "README.md" in names
    assert not set(shards) & set(names) and "model.safetensors.index.json" not in names
    assert (out / "README.md").read_text() == "my notes"
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out)  # the new weights load
    assert model.config.num_hidden_layers >= 1

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    status, err = _cli(["export", "--run-dir", str(run_copy), "--out", str(foreign)], capsys)
    assert status == 2
    assert f"the export folder {foreign} is not empty and holds no model" in err, err
    assert (foreign / "notes.txt").read_text() == "mine" and len(list(foreign.iterdir())) == 1
    status, err = _cli(["export", "--run-dir", str(run_copy), "--out", str(foreign / "notes.txt")],
                       capsys)  # fmt: skip
    assert status == 2 and "is a file; give a folder (--out DIR)" in err, err


# ---------------------------------------------------------------------------------------------
# One writer per run directory.


def test_a_second_trainer_is_refused_naming_the_holder(tmp_path, capsys):
    run = _fake_run(tmp_path / "run")
    lock = rundir.RunLock(run)
    lock.acquire()
    try:
        before = _snapshot(run)
        for argv in (_train(run), ["export", "--run-dir", str(run)]):
            status, err = _cli(argv, capsys)
            assert status == 2
            assert f"another process is writing to {run}" in err, err
            assert f"pid {os.getpid()} on {socket.gethostname()}" in err
        assert _snapshot(run) == before
    finally:
        lock.release()
    assert not (run / ".lock").exists()


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    (tmp_path / ".lock").write_text('{"pid": 999999999, "host": "gone", "since": "then"}\n')
    lock = rundir.RunLock(tmp_path)
    lock.acquire()  # the kernel released the dead process's flock: nothing blocks
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / ".lock").exists()


# ---------------------------------------------------------------------------------------------
# OS errors on the run directory, found before the model loads.


def _cases(tmp: Path) -> list[tuple[list[str], str]]:
    run = _fake_run(tmp / "run")
    (tmp / "a_file").write_text("x")
    metrics_dir = _fake_run(tmp / "metrics_dir")
    (metrics_dir / "metrics.jsonl").unlink()
    (metrics_dir / "metrics.jsonl").mkdir()
    tb_file = _fake_run(tmp / "tb_file")
    shutil.rmtree(tb_file / "tensorboard")
    (tb_file / "tensorboard").write_text("x")
    notes = _fake_run(tmp / "notes")
    shutil.rmtree(notes / "export")
    (notes / "export").mkdir()
    (notes / "export" / "notes.txt").write_text("not a model")
    torn_mid = _fake_run(tmp / "torn_mid")
    (torn_mid / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "re\n{"step": 3}\n')
    return [
        (_train(tmp / "a_file"), f"the run directory {tmp / 'a_file'} is a file"),
        (_train(tmp / "a_file" / "run"), f"cannot create the run directory {tmp / 'a_file'}"),
        (_train(tmp / "a_file" / "run"), "which is a file"),
        (_train(metrics_dir), f"{metrics_dir / 'metrics.jsonl'} is a folder"),
        (_train(tb_file), f"{tb_file / 'tensorboard'} is a file"),
        (_train(notes), f"the export folder {notes / 'export'} is not empty and holds no model"),
        (_train(torn_mid), f"{torn_mid / 'metrics.jsonl'}:2: not a JSON metrics record"),
        (_train(""), "--run-dir is empty (an unset shell variable?)"),
        (["evaluate", "--run-dir", ""], "--run-dir is empty"),
        (["export", "--run-dir", "", "--config", TINY], "--run-dir is empty"),
        (["evaluate", "--run-dir", str(tmp / "a_file"), "--config", TINY], "is a file"),
        (["export", "--run-dir", str(run), "--out", str(tmp / "a_file")], "is a file"),
    ]


def test_run_dir_os_errors_are_one_message_each(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # `--run-dir ""` must not write into the current directory
    cases = _cases(tmp_path)
    before = _snapshot(tmp_path)
    for argv, fragment in cases:
        status, err = _cli(argv, capsys)
        assert status == 2, (argv, err)
        assert fragment in err, (argv, err)
        assert len(err.strip().splitlines()) == 1, err  # one message
    assert _snapshot(tmp_path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_run_dir_is_refused_before_loading(tmp_path, capsys):
    run = _fake_run(tmp_path / "run")
    run.chmod(0o555)
    try:
        status, err = _cli(_train(run), capsys)
    finally:
        run.chmod(0o755)
    assert status == 2 and f"the run directory {run} is not writable" in err, err


def test_ctrl_c_while_loading_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    from jaxrl_llm.train import loop

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "resolve", interrupted)
    status, err = _cli(_train(tmp_path / "run"), capsys)
    assert status == 130
    assert "interrupted (Ctrl-C)" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run" / ".lock").exists()


# ---------------------------------------------------------------------------------------------
# Resuming: a torn metrics line, a changed data set, a huge reward.


def test_a_torn_last_metrics_line_is_dropped_on_resume(run_copy, capsys):
    good = (run_copy / "metrics.jsonl").read_text()
    with (run_copy / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "reward/me')  # killed mid-write
    with pytest.warns(UserWarning, match=r"metrics.jsonl:2: the last line is torn"):
        status, err = _cli(_train(run_copy, "--max-steps", "1"), capsys)  # resumes at the end
    assert status == 0, err
    assert (run_copy / "metrics.jsonl").read_text() == good  # repaired, step 1 kept
    assert (run_copy / "export" / "model.safetensors").is_file()


def test_resuming_with_a_changed_data_set_is_a_clear_error(run_copy, capsys):
    (run_copy / ".lock").write_text('{"pid": 999999999, "host": "gone", "since": "then"}\n')
    before = _snapshot(run_copy)
    status, err = _cli(_train(run_copy, "data.arithmetic.train_size=32"), capsys)
    assert status == 2
    assert f"cannot resume {run_copy} from step 1: data state was saved for 64 examples" in err
    assert "resume with the same data" in err and "--overwrite" in err
    after = _snapshot(run_copy)
    assert {k: v for k, v in after.items() if not k.startswith("tensorboard")} == {
        k: v
        for k, v in before.items()
        if k != ".lock"  # the stale lock was taken over
    }


def test_resuming_on_other_data_of_the_same_size_is_a_clear_error(run_copy, capsys):
    before = _snapshot(run_copy)
    status, err = _cli(_train(run_copy, "data.arithmetic.max_operand=50"), capsys)
    assert status == 2
    assert f"cannot resume {run_copy} from step 1: the training examples differ" in err, err
    assert "(the same number, 64, but other prompts or order)" in err
    after = _snapshot(run_copy)
    assert {k: v for k, v in after.items() if not k.startswith("tensorboard")} == before


REWARD_MODULE = "jaxrl_failure_paths_rewards"


@pytest.mark.slow
def test_a_huge_reward_leaves_nothing_of_its_step(run_copy, tmp_path, capsys, monkeypatch):
    (tmp_path / f"{REWARD_MODULE}.py").write_text(
        textwrap.dedent("""
        def huge(prompts, completions, **fields):
            return [1e300 * (i % 2) for i in range(len(completions))]
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    kept = ("checkpoints", "metrics.jsonl", "config.yaml", ".checkpointed")
    before = {k: v for k, v in _snapshot(run_copy).items() if k.split("/")[0] in kept}
    reward = f"rewards.terms=[{{type: '{REWARD_MODULE}:huge', name: huge}}]"
    status, err = _cli(_train(run_copy, "train.save_every=1", reward), capsys)
    assert status == 2
    assert "step 2: non-finite loss or gradient" in err, err
    assert "nothing of step 2 was written" in err
    assert "out of float32's range" in err and "reward/huge/mean=inf" in err
    after = {k: v for k, v in _snapshot(run_copy).items() if k.split("/")[0] in kept}
    assert after == before  # no metrics line, no checkpoint, config.yaml not rewritten


@pytest.mark.slow
def test_overwrite_starts_the_run_over(tmp_path, capsys):
    run = _fake_run(tmp_path / "run")
    (run / "checkpoints" / "unreadable").mkdir()
    (run / "checkpoints" / "2").rename(run / "checkpoints" / "unreadable" / "2")
    status, err = main(_train(run, "--overwrite", "--max-steps", "1")), capsys.readouterr()
    assert status == 0, err.err
    assert "--overwrite: removed config.yaml, metrics.jsonl, tensorboard, checkpoints, export" in (
        err.out
    )
    assert [
        r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    ] == [1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]
    assert (run / "export" / "model.safetensors").read_bytes() != b"the trained weights"
