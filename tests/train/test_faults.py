"""Faults: kill -9 at random moments, corrupt checkpoints, a full disk, NaN/inf updates.

The kill test runs ``jaxrl-llm train`` (the CLI's ``main``) in child processes forked from a
``multiprocessing`` forkserver that has already imported JAX, transformers and the package, and
shares one persistent XLA compilation cache: a restart then costs the model setup and the
tracing of the jitted functions, not the ~5 s of imports and the compiles. Each child is a real
process killed with SIGKILL, so no Python cleanup (``finally``, atexit, orbax's wait) runs.
"""

from __future__ import annotations

import errno
import gc
import logging
import multiprocessing
import os
import random
import signal
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm.train import checkpoint as C
from jaxrl_llm.train import loop, setup
from jaxrl_llm.train import metrics as M
from jaxrl_llm.train.faults import PHASE_LOG_ENV
from tests.train import helpers as H

REC = H.recipe("grpo")

# A reward the random model's gibberish scores unevenly, so advantages (and updates) are not 0.
VARIED = [
    "rewards.terms=[{type: length_penalty, kwargs: {target: 10, unit: chars, coef: 0.1}},"
    " {type: regex, weight: 0.5, kwargs: {pattern: '[aeiou]'}}]"
]


def _state(seed=0):
    return H.fresh_state(H.tiny_lm(seed), optax.adam(1e-2), REC, seed=seed)[2]


def _bump(state, k):
    """A distinguishable state for step ``k``."""
    return state._replace(
        step=jnp.asarray(k, jnp.int32),
        params=jax.tree.map(lambda x: x + k, state.params),
    )


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------------------------------------
# A corrupt, truncated or incomplete latest checkpoint; a full disk.


def _largest(folder: Path) -> Path:
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _truncate(step_dir: Path) -> str:
    path = _largest(step_dir / "state")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return "truncated"


def _garble(step_dir: Path) -> str:
    path = _largest(step_dir / "state")
    data = bytearray(path.read_bytes())
    data[len(data) // 4 :] = bytes(range(256)) * (len(data[len(data) // 4 :]) // 256 + 1)
    path.write_bytes(bytes(data[: len(path.read_bytes())]))
    return "garbled"


def _delete_data(step_dir: Path) -> str:
    _largest(step_dir / "state").unlink()
    return "deleted"


def _truncate_meta(step_dir: Path) -> str:
    path = step_dir / "meta" / "metadata"
    path.write_text(path.read_text()[:40])
    return "truncated meta"


@pytest.mark.parametrize("damage", [_truncate, _garble, _delete_data, _truncate_meta])
def test_an_unreadable_latest_checkpoint_falls_back_to_the_previous_one(
    tmp_path, damage, monkeypatch, caplog
):
    s = _state()
    with C.Checkpointer(tmp_path / "c", max_to_keep=3) as ckpt:
        for k in (1, 2, 3):
            ckpt.save(k, _bump(s, k), meta={"k": k})
    damage(tmp_path / "c" / "3")
    ckpt = C.Checkpointer(tmp_path / "c", max_to_keep=3, save_every=1)
    assert ckpt.latest_step() == 3
    unraisable = []  # what would be printed as "Exception ignored in: ..."
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.warns(C.CheckpointFallbackWarning) as caught:
        restored, meta = ckpt.restore(_state())
    gc.collect()
    # the failed read's abandoned coroutines (a truncated file left ~50, 2,000 lines) are gone
    assert unraisable == [] and sys.unraisablehook == unraisable.append
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    message = str(caught[0].message)
    assert f"step 3 ({tmp_path / 'c' / '3'}) is unreadable" in message, message
    assert f"previous good checkpoint, step 2 ({tmp_path / 'c' / '2'})" in message, message
    assert int(restored.step) == 2 and meta["k"] == 2
    _assert_same(restored, _bump(s, 2))
    # nothing deleted: the bad step is kept aside, no longer listed, and step 3 can be saved again
    assert (tmp_path / "c" / "unreadable" / "3").is_dir() and ckpt.all_steps() == [1, 2]
    assert ckpt.should_save(3)
    ckpt.save(3, _bump(s, 3))
    ckpt.close()
    with C.Checkpointer(tmp_path / "c") as ckpt:
        _assert_same(ckpt.restore(_state())[0], _bump(s, 3))


def test_only_orbaxs_abandoned_reads_are_dropped(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)

    class Raises:
        def __del__(self):
            raise ValueError("from __del__")

    # a coroutine whose code is orbax's, suspended in an await and then abandoned
    source = (
        "import types\n"
        "pause = types.coroutine(lambda: (yield))\n"
        "async def read():\n"
        "    try:\n"
        "        await pause()\n"
        "    finally:\n"
        "        raise OSError('the read error, raised again when it is closed')\n"
    )
    namespace = {}
    exec(compile(source, os.path.join("site", "orbax", "serialization.py"), "exec"), namespace)
    failures = [(3, None, None)]
    with C._closing_abandoned_reads(failures, Path("/ckpt")):
        coroutine = namespace["read"]()
        coroutine.send(None)
        del coroutine  # closed: its OSError is dropped
        Raises()  # anything else still reaches the installed hook
    assert failures == [] and [type(u.exc_value) for u in seen] == [ValueError]
    assert sys.unraisablehook == seen.append

    def record(message):
        return logging.LogRecord("asyncio", logging.ERROR, "", 0, message, (), None)

    keep = C._abandoned_task_filter([os.path.join("ckpt", "3")])
    orbax_task = f"Task exception was never retrieved\nfuture: <Task coro=<read() {os.sep}orbax"
    assert not keep(record(orbax_task + os.sep))
    # tensorstore's futures name the failed step's folder
    folder = os.path.join("ckpt", "3", "state")
    assert not keep(record(f"Future exception was never retrieved\n... local file {folder}"))
    gathering = f"_GatheringFuture exception was never retrieved\n... 'path': '{folder}'"
    assert not keep(record(gathering))
    assert keep(record("Task exception was never retrieved\nfuture: <mine>"))
    other = os.path.join("ckpt", "2", "state")
    assert keep(record(f"Future exception was never retrieved\n... local file {other}"))


CLOSED_LOOP = """Traceback (most recent call last):
  File "/usr/lib/python3.11/asyncio/base_events.py", line 806, in call_soon_threadsafe
    self._check_closed()
  File "/usr/lib/python3.11/asyncio/base_events.py", line 519, in _check_closed
    raise RuntimeError('Event loop is closed')
RuntimeError: Event loop is closed
"""


def test_the_fallback_drops_tensorstores_closed_event_loop_tracebacks(capsys):
    """A zero-filled latest checkpoint made tensorstore print one ``Event loop is closed``
    traceback per read still in flight (68 through the CLI on the tiny config; they come from
    its threads, interleaved, after the failed read returns): while restore tries the steps
    they are dropped and everything else passes."""
    import threading

    with C._quiet_unreadable():
        writers = [
            threading.Thread(
                target=lambda: [sys.stderr.write(x) for x in CLOSED_LOOP.splitlines(True)]
            )
            for _ in range(8)
        ]
        for w in writers:
            w.start()
        sys.stderr.write("a real message\n")
        for w in writers:
            w.join()
        sys.stderr.write("no newline yet")
    assert capsys.readouterr().err == "a real message\nno newline yet"


def test_no_readable_checkpoint_is_a_clear_error(tmp_path):
    with C.Checkpointer(tmp_path / "c") as ckpt:
        ckpt.save(1, _state())
    _delete_data(tmp_path / "c" / "1")
    with C.Checkpointer(tmp_path / "c") as ckpt, pytest.raises(FileNotFoundError) as info:
        ckpt.restore(_state())
    assert f"no readable checkpoint in {tmp_path / 'c'}: step 1:" in str(info.value)


def test_disk_full_during_a_save_is_a_clear_error_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch
):
    from orbax.checkpoint._src.handlers import json_checkpoint_handler as J

    s = _state()
    ckpt = C.Checkpointer(tmp_path / "c", max_to_keep=1)
    ckpt.save(1, _bump(s, 1))
    ckpt.wait()

    async def no_space(self, x, directory):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / "metadata"))

    monkeypatch.setattr(J.JsonCheckpointHandler, "_save_fn", no_space)
    ckpt.save(2, _bump(s, 2))  # the write fails in the background ...
    with pytest.raises(C.CheckpointSaveError) as info:
        ckpt.save(3, _bump(s, 3))  # ... and surfaces here, once
    message = str(info.value)
    assert f"saving checkpoint step 2 to {tmp_path / 'c'} failed (the disk is full)" in message
    assert "No space left on device" in message
    assert f"the previous checkpoint, step 1 in {tmp_path / 'c' / '1'}, is intact" in message
    assert info.value.errno == errno.ENOSPC and info.value.step == 2
    ckpt.close()  # does not raise the same error again
    monkeypatch.undo()
    with C.Checkpointer(tmp_path / "c") as ckpt:  # max_to_keep=1 did not delete step 1
        assert ckpt.all_steps() == [1]
        _assert_same(ckpt.restore(_state())[0], _bump(s, 1))


# ---------------------------------------------------------------------------------------------
# NaN / inf in the loss or the gradient.


def _poison_step(monkeypatch, bad_step: int):
    """Makes one reward, hence the advantages of its group, of training step ``bad_step``
    (from 1) NaN: the host hands the device step a NaN it must not write into the state."""
    original = loop.collect

    def poisoned(setup, params, iterator, key, *, step):
        groups, metrics = original(setup, params, iterator, key, step=step)
        if step == bad_step:
            reward_bg = np.array(groups.reward_bg)
            reward_bg[0, 0] = np.nan
            groups = groups._replace(reward_bg=reward_bg)
        return groups, metrics

    monkeypatch.setattr(loop, "collect", poisoned)


def test_a_nonfinite_update_is_skipped_and_counted(tmp_path, monkeypatch, capsys):
    config = H.config(
        "tiny.yaml",
        "train.max_steps=3",
        "train.save_every=1",
        "train.keep_checkpoints=3",
        "data.eval_size=0",
        "train.on_nonfinite=skip",
        *VARIED,
    )
    seen = {}
    original = M.MetricsLogger.log

    def log(self, step, metrics):
        seen[step] = dict(metrics)
        return original(self, step, metrics)

    monkeypatch.setattr(M.MetricsLogger, "log", log)
    _poison_step(monkeypatch, 2)
    final = loop.train(config, run_dir=tmp_path, progress=False, log=lambda *_: None)
    assert final["step"] == 3 and final["train/skipped_steps"] == 1
    assert [seen[k]["update/nonfinite"] for k in (1, 2, 3)] == [0, 1, 0]
    assert [seen[k]["train/skipped_steps"] for k in (1, 2, 3)] == [0, 1, 1]
    assert "step 2: non-finite loss or gradient, update skipped" in capsys.readouterr().out
    # step 2 left parameters and optimizer state as step 1 had them (only the count moved)
    with C.Checkpointer(tmp_path / "checkpoints") as ckpt:
        template = setup.resolve(config).state
        assert ckpt.all_steps() == [1, 2, 3]
        (one, _), (two, meta) = ckpt.restore(template, step=1), ckpt.restore(template, step=2)
        three = ckpt.restore(template, step=3)[0]
    assert meta["skipped_steps"] == 1
    _assert_same((one.params, one.opt_state), (two.params, two.opt_state))
    assert H.tree_max_diff(two.params, three.params) > 0  # step 3 trained again
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(three))


def test_a_nonfinite_update_stops_the_run_with_the_step_number(tmp_path, monkeypatch):
    config = H.config(
        "tiny.yaml", "train.max_steps=3", "train.save_every=1", "data.eval_size=0", *VARIED
    )
    assert config.train.on_nonfinite == "raise"
    _poison_step(monkeypatch, 2)
    with pytest.raises(FloatingPointError, match=r"^step 2: non-finite loss or gradient"):
        loop.train(config, run_dir=tmp_path, progress=False, log=lambda *_: None)
    with C.Checkpointer(tmp_path / "checkpoints") as ckpt:
        assert ckpt.all_steps() == [1]  # step 1 is kept; nothing of step 2 is written


# ---------------------------------------------------------------------------------------------
# kill -9 at 20 moments, then resume: the same parameters as an uninterrupted run.

KILLS = 20
MAX_STEPS = 10
# Upper bounds of the seeded delay between a phase's marker and the SIGKILL, in seconds: within
# a tiny model's rollout (~40 ms), update (~300 ms) and background checkpoint write (~35 MB).
DELAY = {"rollout": 0.03, "update": 0.2, "save": 0.15}
# What a life imports, imported once by the forkserver: the tiny model's LlamaConfig alone pulls
# in ~850 modules (torch.distributed, sympy, accelerate) through transformers, 0.85 s of CPU
# (2.5 s of wall on the loaded 2 cores) in every life when it was left to the lives.
PRELOAD = [
    "jaxrl_llm.cli",
    "jaxrl_llm.train.cli",
    "jaxrl_llm.train.loop",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.configuration_llama",
    "tensorboardX",
]


def _life(argv: list[str], phase_log: str, cache_dir: str, output: str) -> None:
    """One life of the run, in a forked child: ``jaxrl-llm train ...`` with the phase log on."""
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ[PHASE_LOG_ENV] = phase_log
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from jaxrl_llm.cli import main

    sys.exit(main(argv))


class _Lives:
    """Starts lives of one run configuration and waits for their phase markers."""

    def __init__(self, tmp_path: Path):
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(PRELOAD)
        self.tmp = tmp_path
        self.count = 0

    def start(self, run_dir: Path, extra: tuple[str, ...] = ()):
        self.t0 = time.monotonic()
        self.count += 1
        self.log = self.tmp / f"phases_{self.count}.txt"
        self.output = self.tmp / f"output_{self.count}.txt"
        argv = [
            "train",
            "--config",
            str(H.CONFIGS / "tiny.yaml"),
            "--run-dir",
            str(run_dir),
            "--max-steps",
            str(MAX_STEPS),
            "--no-progress",
            "model.path=tiny-random",
            "mesh.data=1",
            "data.eval_size=0",
            "train.save_every=1",
            "train.keep_checkpoints=2",
            *VARIED,
            *extra,
        ]
        args = (argv, str(self.log), str(self.tmp / "xla_cache"), str(self.output))
        self.process = self.ctx.Process(target=_life, args=args)
        self.process.start()
        return self.process

    def wait_for(self, phase: str, step: int | None = None, timeout: float = 300.0) -> int:
        """Blocks until the current life logs ``phase`` (at ``step``); returns its step."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.log.exists():
                for line in self.log.read_text().splitlines():
                    name, at, _ = line.split()
                    if name == phase and (step is None or int(at) == step):
                        return int(at)
            if not self.process.is_alive():
                tail = self.output.read_text()[-3000:] if self.output.exists() else ""
                raise AssertionError(
                    f"life {self.count} ended (exit {self.process.exitcode}) before "
                    f"{phase} {step}:\n{tail}"
                )
            time.sleep(0.002)
        raise AssertionError(f"life {self.count}: no {phase} {step} within {timeout} s")


def _check_on_disk(folder: Path, template) -> tuple[list[int], set[str]]:
    """Every step folder is complete and restores; returns (steps, names of tmp folders)."""
    names = [p.name for p in folder.iterdir()] if folder.exists() else []
    tmp = {n for n in names if ".orbax-checkpoint-tmp" in n}
    steps = sorted(int(n) for n in names if n.isdigit())
    with warnings.catch_warnings():
        warnings.simplefilter("error", C.CheckpointFallbackWarning)
        with C.Checkpointer(folder) as ckpt:
            assert ckpt.all_steps() == steps and ckpt.latest_step() == (steps or [None])[-1]
            for step in steps:
                assert (folder / str(step) / "commit_success.txt").exists(), step
                restored, meta = ckpt.restore(template, step=step)
                assert int(restored.step) == step and meta["step"] == step
    return steps, tmp


@pytest.mark.slow
def test_kill_9_at_20_moments_then_resume_ends_with_the_same_parameters(tmp_path):
    lives = _Lives(tmp_path)
    t0 = time.monotonic()
    full = lives.start(tmp_path / "uninterrupted")  # also fills the compilation cache
    full.join(300)
    assert full.exitcode == 0, lives.output.read_text()[-3000:]
    t_full = time.monotonic() - t0
    config = H.config("tiny.yaml", "data.eval_size=0", *VARIED)
    template = setup.resolve(config).state

    rng = random.Random(6)
    phases = (["rollout", "update", "save"] * KILLS)[:KILLS]
    rng.shuffle(phases)
    run_dir = tmp_path / "killed"
    history, tmp_seen = [], set()
    for phase in phases:
        process = lives.start(run_dir)
        start = lives.wait_for("start")
        t_start = time.monotonic() - lives.t0
        target = min(start + 1 + rng.randint(0, 2), MAX_STEPS)
        if target == MAX_STEPS:
            phase = "rollout"  # later, the final step could finish and save before the kill
        delay = rng.uniform(0.0, DELAY[phase])
        lives.wait_for(phase, target)
        time.sleep(delay)
        process.kill()
        process.join(60)
        assert process.exitcode == -signal.SIGKILL, process.exitcode
        process.close()
        steps, tmp = _check_on_disk(run_dir / "checkpoints", template)
        mid_save = bool(tmp - tmp_seen)  # this kill interrupted a checkpoint write
        tmp_seen |= tmp
        life = (round(t_start, 1), round(time.monotonic() - lives.t0, 1))
        history.append((start, phase, target, round(delay, 3), steps, mid_save, life))
    lives.start(run_dir).join(300)
    assert lives.process.exitcode == 0, lives.output.read_text()[-3000:]
    print(f"\nuninterrupted: {t_full:.1f} s; kills (resumed at, phase, step, delay, steps on disk,")
    print("a checkpoint write interrupted, (s to the start marker, s to the kill)):")
    print("\n".join(map(str, history)))

    states = []
    for name in ("uninterrupted", "killed"):
        steps, _ = _check_on_disk(tmp_path / name / "checkpoints", template)
        assert steps[-1] == MAX_STEPS
        with C.Checkpointer(tmp_path / name / "checkpoints") as ckpt:
            states.append(ckpt.restore(template)[0])
    assert H.tree_max_diff(states[0].params, template.params) > 0  # it trained
    _assert_same(*states)  # bit-identical: params, optimizer state, key, data position
    # the kills landed in all three phases, and some mid-save (a tmp folder was left)
    assert {h[1] for h in history} == {"rollout", "update", "save"}
    assert any(h[5] for h in history), history


# ---------------------------------------------------------------------------------------------
# Preemption: SIGTERM, then Ctrl-C, each mid-step; the resumed run is the uninterrupted one.

UNSTEADY = ("time/", "perf/")  # wall-clock and memory: the only metrics that may differ


def _steady(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(UNSTEADY)} for r in records]


@pytest.mark.slow
def test_sigterm_and_ctrl_c_save_a_checkpoint_and_the_resume_is_exact(tmp_path):
    lives = _Lives(tmp_path)
    extra = ("train.save_every=50", "train.log_every=1")  # no checkpoint but the signal's
    full = lives.start(tmp_path / "uninterrupted", extra)
    full.join(300)
    assert full.exitcode == 0, lives.output.read_text()[-3000:]
    config = H.config("tiny.yaml", "data.eval_size=0", *VARIED)
    template = setup.resolve(config).state

    run_dir = tmp_path / "stopped"
    stops = []
    for signum, at in ((signal.SIGTERM, 3), (signal.SIGINT, 6)):
        process = lives.start(run_dir, extra)
        lives.wait_for("update", at)  # the step is being computed
        os.kill(process.pid, signum)
        process.join(120)
        output = lives.output.read_text()
        assert process.exitcode == 128 + signum, output[-3000:]
        assert "Traceback" not in output, output[-3000:]
        name = signal.Signals(signum).name
        assert f"{name}: finishing this step, then saving a checkpoint" in output
        # the step in flight finishes (rarely the next one has begun when the signal lands)
        step = next(k for k in (at, at + 1) if f"stopped by {name} after step {k}:" in output)
        assert (
            f"checkpoint step {step} is in {run_dir / 'checkpoints' / str(step)}. Rerun the same "
            f"command to resume (exit status {128 + signum})." in output
        ), output[-3000:]
        steps, _ = _check_on_disk(run_dir / "checkpoints", template)
        assert steps[-1] == step
        assert [r["step"] for r in M.read_metrics(run_dir)] == list(range(1, step + 1))
        stops.append(step)
    lives.start(run_dir, extra).join(300)
    assert lives.process.exitcode == 0, lives.output.read_text()[-3000:]

    metrics = [_steady(M.read_metrics(tmp_path / name)) for name in ("uninterrupted", "stopped")]
    assert [r["step"] for r in metrics[1]] == list(range(1, MAX_STEPS + 1))
    assert metrics[0] == metrics[1]  # every line, in order: rewards, losses, KL, ...
    states = []
    for name in ("uninterrupted", "stopped"):
        with C.Checkpointer(tmp_path / name / "checkpoints") as ckpt:
            states.append(ckpt.restore(template)[0])
    _assert_same(*states)
    print(f"\nstopped after steps {stops} (SIGTERM, SIGINT), resumed to {MAX_STEPS}")
