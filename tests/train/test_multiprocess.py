"""Multi-process training with ``jax.distributed`` on CPU (gloo collectives, loopback only).

The end-to-end test trains ``configs/tiny.yaml`` (with a regex reward, so that rewards vary
within groups and the update is not zero) twice on the same global mesh ``data=2``:

* one process with two CPU devices (in this pytest process, on 2 of its 8 fake devices);
* two processes with one CPU device each, started here as ``jaxrl-llm train --coordinator
  127.0.0.1:PORT --num-processes 2 --process-id I`` on a free port, in two launches: the first
  stops after step 1 (``--max-steps 1``; the learning rate is constant, so the horizon changes
  nothing), the second is the same command without ``--max-steps`` on the same run directory,
  so both processes restore the step-1 checkpoint (orbax, on every process) and do step 2.

Both must end with the same parameters, within ``atol = 1e-5``, so resuming a multi-process
run continues it exactly like an uninterrupted run. So must a third run: a copy of the two
processes' step-1 run directory resumed by one process (this one, on the same ``data=2`` mesh
over its 2 devices), as a job relaunched on fewer hosts would. Not bit for bit: both runs
compile one global program for the same mesh, and the gradient all-reduce (XLA's in-process
one vs gloo's) adds two partial sums, which is exact, but the host-fed arrays of the advantage
chain and the forward passes are single-device arrays in one process and batch-sharded global
arrays in two, so XLA fuses and orders some float sums differently (1-ulp differences). Adam
divides by √v, so an ulp-level change of a near-zero gradient can move a weight by a visible
fraction of lr = 1e-4 per step. Measured here: at most 5e-8 (a few ulps of these ~0.02
weights); with a reward that gave every answer the same score (zero advantages, gradients of
pure rounding noise) up to 6e-6. A real mistake (a wrong share of prompts, a group split
across processes, rewards in the wrong order) moves weights by ~lr = 1e-4, ten times the
tolerance.

The children get their own environment (one device each: the suite's other XLA_FLAGS, not its
8 devices), run under a timeout, and are killed if the test fails, so a hang fails instead of
blocking CI.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from jaxrl_llm import distributed as dist

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # per launch, a safety net; the test takes ~2 minutes on 2 loaded CPU cores

CONFIG = """\
base: {tiny}
rollout:
  prompts_per_step: 4   # 2 per process
rewards:
  terms:
    - type: regex       # at most 52 characters: about half of the random completions
      weight: 1.0
      kwargs: {{pattern: ".{{0,52}}", mode: fullmatch}}
data:
  eval_size: 4
train:
  max_steps: 2
  save_every: 1
"""


# ---------------------------------------------------------------------------------------------
# Settings: flags, environment, errors (no JAX backend is touched).


def test_no_settings_is_a_single_process_run():
    assert dist.resolve(environ={}) is None
    assert dist.resolve(auto=True, environ={}) == dist.Settings()


def test_flags_and_environment():
    s = dist.resolve("10.0.0.1:1234", 4, 3, environ={})
    assert s == dist.Settings("10.0.0.1:1234", 4, 3)
    env = {"JAX_COORDINATOR_ADDRESS": "h:99", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    assert dist.resolve(environ=env) == dist.Settings("h:99", 2, 1)
    assert dist.resolve(process_id=0, environ=env) == dist.Settings("h:99", 2, 0)  # flag wins
    # With --distributed, whatever is missing is left to JAX's cluster detection.
    assert dist.resolve(num_processes=2, auto=True, environ={}) == dist.Settings(None, 2, None)
    # The timeouts go with any multi-process run; None leaves JAX's defaults.
    assert dist.resolve("h:1", 2, 0, heartbeat_timeout_s=20, environ={}) == dist.Settings(
        "h:1", 2, 0, heartbeat_timeout_s=20
    )
    assert dist.resolve(auto=True, heartbeat_timeout_s="30", init_timeout_s=600, environ={}) == (
        dist.Settings(heartbeat_timeout_s=30, init_timeout_s=600)
    )


@pytest.mark.parametrize(
    "kwargs, env, message",
    [
        (dict(process_id=2, num_processes=2, coordinator="h:1"), {}, r"--process-id = 2.*\[0, 2\)"),
        (dict(process_id=-1, coordinator="h:1", num_processes=2), {}, r"--process-id = -1"),
        (dict(num_processes=2), {}, r"--num-processes given without --coordinator"),
        (dict(num_processes=0, coordinator="h:1", process_id=0), {}, r"--num-processes = 0"),
        (dict(coordinator="10.0.0.1", num_processes=2, process_id=0), {}, r"HOST:PORT"),
        ({}, {"JAX_PROCESS_ID": "one"}, r"JAX_PROCESS_ID = 'one': expected an integer"),
        ({}, {"JAX_COORDINATOR_ADDRESS": "h:1"}, r"JAX_COORDINATOR_ADDRESS given without"),
        (
            dict(heartbeat_timeout_s=0, coordinator="h:1", num_processes=2, process_id=0),
            {},
            r"--heartbeat-timeout = 0: expected whole seconds ≥ 1",
        ),
        (dict(init_timeout_s="soon", auto=True), {}, r"--init-timeout = 'soon': expected an int"),
        (
            dict(heartbeat_timeout_s=30, init_timeout_s=60),
            {},
            r"--heartbeat-timeout and --init-timeout given for a single-process run",
        ),
    ],
)
def test_bad_settings_name_what_was_wrong(kwargs, env, message):
    with pytest.raises(dist.DistributedError, match=message):
        dist.resolve(**kwargs, environ=env)


def test_cli_reports_bad_settings(capsys, tmp_path):
    from jaxrl_llm.cli import main

    argv = ["train", "--config", str(REPO / "configs/tiny.yaml"), "--run-dir", str(tmp_path)]
    assert main([*argv, "--num-processes", "2", "--process-id", "0"]) == 2
    assert "without --coordinator" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "evaluate", "export"])
def test_every_run_command_takes_the_multiprocess_flags(command):
    from jaxrl_llm.cli import build_parser

    def settings(argv):
        a = build_parser().parse_args([command, "--config", "c.yaml", "--run-dir", "r", *argv])
        assert a.overrides == ["optim.lr=1e-6"]
        return (
            a.coordinator,
            a.num_processes,
            a.process_id,
            a.distributed,
            a.heartbeat_timeout,
            a.init_timeout,
        )

    assert settings(["optim.lr=1e-6"]) == (None, None, None, False, None, None)
    flags = ["--coordinator", "10.0.0.1:1234", "--num-processes", "2", "--process-id", "1"]
    flags += ["--heartbeat-timeout", "20", "--init-timeout", "900"]
    assert settings([*flags, "--distributed", "optim.lr=1e-6"]) == (
        "10.0.0.1:1234",
        2,
        1,
        True,
        20,
        900,
    )


@pytest.mark.parametrize("command", ["evaluate", "export"])
def test_evaluate_and_export_report_bad_settings(command, capsys, tmp_path):
    from jaxrl_llm.cli import main

    # Checked before the config is read or JAX is touched (no config.yaml in tmp_path).
    assert main([command, "--run-dir", str(tmp_path), "--process-id", "1"]) == 2
    assert f"jaxrl-llm {command}: --process-id given without" in capsys.readouterr().err


@pytest.mark.parametrize("primary", [True, False])
def test_only_process_0_prints_evaluate_and_export(primary, monkeypatch, capsys, tmp_path):
    from jaxrl_llm.cli import main
    from jaxrl_llm.train import loop

    started = []
    monkeypatch.setattr(dist, "initialize", lambda *a, **k: started.append((a, k)))
    monkeypatch.setattr(dist, "is_primary", lambda: primary)

    def fake_evaluate(config, *, log, **kwargs):
        log("restored step 2")
        return {"eval/accuracy": 0.5}

    def fake_export(config, *, log, out=None, **kwargs):
        log("restored step 2")
        return tmp_path / "export"

    monkeypatch.setattr(loop, "evaluate", fake_evaluate)
    monkeypatch.setattr(loop, "export", fake_export)
    argv = ["--config", str(REPO / "configs/tiny.yaml"), "--run-dir", str(tmp_path)]
    flags = ["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "0"]
    for command in ("evaluate", "export"):
        assert main([command, *argv, *flags, "--heartbeat-timeout", "15"]) == 0
        out = capsys.readouterr().out
        if primary:
            assert "restored step 2" in out and ("accuracy" in out or "exported to" in out)
        else:
            assert out == ""
    timeouts = {"heartbeat_timeout_s": 15, "init_timeout_s": None}
    assert started == [(("127.0.0.1:1234", 2, 0), {"auto": False, **timeouts})] * 2


def test_single_process_rows_are_every_row():
    import jax

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    assert dist.process_rows(sharding, (6, 3)) == slice(0, 6)
    x = np.arange(6)
    assert dist.gather({"x": x})["x"] is x


# ---------------------------------------------------------------------------------------------
# Two processes train like one.


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(devices: int = 1) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_"))
    }
    # ``devices`` each (one by default); the suite's other XLA flags (tests/conftest.py) are
    # kept, so the children compile with the same code generation as the one-process run they
    # are compared with.
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform" not in f]
    env.update(
        XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    )
    return env


def _params(run_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(run_dir / "export" / "model.safetensors")


def _spawn(
    children: list, logs: list[Path], argv: Callable[[int, int], list[str]], devices: int = 1
) -> None:
    """Starts ``python *argv(PORT, I)`` for each process ``I`` of ``len(logs)``, on one free port
    (appended to ``children`` as they start, so that the caller kills them however this fails;
    output in ``logs``)."""
    port = _free_port()
    for i, log in enumerate(logs):
        with log.open("w") as out:
            children.append(
                subprocess.Popen(
                    [sys.executable, *argv(port, i)],
                    cwd=REPO,
                    env=_child_env(devices),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )


def _start_children(
    children: list, code: str, logs: list[Path], *args: str, devices: int = 1
) -> None:
    """:func:`_spawn` of ``python -c code PORT I *args``."""
    _spawn(children, logs, lambda port, i: ["-c", code, str(port), str(i), *args], devices)


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no output)"


def _launch(children: list, config_path: Path, run_dir: Path, logs: list[Path], *extra: str):
    """Starts the two processes of one multi-process ``train`` (appended to ``children``, so
    that the caller kills them however this fails; output in ``logs``)."""

    def argv(port: int, i: int) -> list[str]:
        return [
            "-m",
            "tests.train.multiprocess_cli",  # jaxrl_llm.cli, refusing process_allgather
            "train",
            "--config",
            str(config_path),
            "--run-dir",
            str(run_dir),
            "--no-progress",
            "--coordinator",
            f"127.0.0.1:{port}",
            "--num-processes",
            "2",
            "--process-id",
            str(i),
            *extra,
            "mesh.data=2",
        ]

    _spawn(children, logs, argv)


def _wait(children: list, logs: list[Path], started: float, what: str, limit=TIMEOUT_S) -> None:
    for i, child in enumerate(children):
        left = max(1.0, limit - (time.monotonic() - started))
        try:
            code = child.wait(timeout=left)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{what}: process {i} still running after {limit} s:\n{_tail(logs[i])}")
        assert code == 0, f"{what}: process {i} exited with {code}:\n{_tail(logs[i])}"


# A checkpoint step that one process cannot read (e.g. a damaged file of a shard only it reads):
# both processes must fall back to the same older step and afterwards list the same steps.
# (Without agreement, process 0 restored step 2 and process 1 step 1: one global array made of
# shards of two different steps, silently.)
FALLBACK_CHILD = """\
import sys, warnings
from pathlib import Path

from jaxrl_llm import distributed as dist

port, pid, directory = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.initialize(f"127.0.0.1:{port}", 2, pid)

import jax
import numpy as np
from jax.experimental import multihost_utils
from orbax.checkpoint._src.handlers import composite_checkpoint_handler as cch

from jaxrl_llm.train.checkpoint import CheckpointFallbackWarning, Checkpointer


def device_collective(*args, **kwargs):
    raise AssertionError("a barrier or flag exchange ran as a device collective")


# barriers and flags go through the coordination service, not through the devices
multihost_utils.sync_global_devices = device_collective
multihost_utils.process_allgather = device_collective
multihost_utils.broadcast_one_to_all = device_collective

mesh = jax.make_mesh((2,), ("data",))
sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))


def state(value):
    return {"w": dist.to_global(np.full((2, 3), value, np.float32), sharding)}


ckpt = Checkpointer(directory, save_every=1)
for step in (1, 2):
    ckpt.save(step, state(step))
ckpt.close()

read = cch.CompositeCheckpointHandler.restore


def restore(self, step_dir, *args, **kwargs):
    if pid == 1 and Path(step_dir).name == "2":
        raise OSError("simulated unreadable shard")
    return read(self, step_dir, *args, **kwargs)


cch.CompositeCheckpointHandler.restore = restore
ckpt = Checkpointer(directory, save_every=1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    restored, _ = ckpt.restore(state(0))
warned = sum(issubclass(w.category, CheckpointFallbackWarning) for w in caught)
w = np.asarray(restored["w"].addressable_data(0))  # this process's row
print(f"restored {w.min():g}..{w.max():g} steps {ckpt.all_steps()}", end=" ")
print(f"save {ckpt.should_save(2)} warned {warned}")
ckpt.save(2, state(2))  # a collective: hangs or fails if the processes disagree
ckpt.close()
print("saved", flush=True)
"""


@pytest.mark.slow
def test_processes_agree_on_the_fallback_from_an_unreadable_step(tmp_path):
    children: list = []
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    t0 = time.monotonic()
    try:
        _start_children(children, FALLBACK_CHILD, logs, str(tmp_path / "c"))
        _wait(children, logs, t0, "fallback", limit=120)  # ~6 s; a disagreement hangs
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=30)
    for log in logs:
        assert "restored 1..1 steps [1] save True warned 1\nsaved" in _tail(log), _tail(log)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["1", "2", "unreadable"]


@pytest.mark.slow
def test_two_processes_end_with_the_parameters_of_one(tmp_path):
    from jaxrl_llm.config import load_config
    from jaxrl_llm.train.loop import train
    from jaxrl_llm.train.metrics import read_metrics

    config_path = tmp_path / "mp.yaml"
    config_path.write_text(CONFIG.format(tiny=REPO / "configs" / "tiny.yaml"))
    multi_dir, single_dir = tmp_path / "two", tmp_path / "one"
    moved_dir = tmp_path / "two_then_one"  # the two processes' step 1, resumed by one process
    first = [tmp_path / f"first{i}.log" for i in range(2)]
    second = [tmp_path / f"second{i}.log" for i in range(2)]
    children: list = []
    try:
        t0 = time.monotonic()
        _launch(children, config_path, multi_dir, first, "--max-steps", "1")
        # The one-process reference runs here meanwhile, on 2 of this process's devices.
        config = load_config(config_path, ["mesh.data=2"])
        train(config, run_dir=single_dir, progress=False, log=lambda *_: None)
        _wait(children, first, t0, "first launch (--max-steps 1)")
        assert sorted(p.name for p in (multi_dir / "checkpoints").iterdir()) == ["1"]
        shutil.copytree(multi_dir, moved_dir)
        t0 = time.monotonic()
        _launch(children, config_path, multi_dir, second)  # resumes from step 1
        # Meanwhile one process (this one, 2 devices) resumes a copy of the same checkpoint: a
        # run saved by N processes resumes on another process count (orbax reads global arrays).
        resumed = []
        train(config, run_dir=moved_dir, progress=False, log=resumed.append)
        _wait(children[2:], second, t0, "second launch (resume)")
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=30)

    one, two, moved = _params(single_dir), _params(multi_dir), _params(moved_dir)
    assert sorted(one) == sorted(two) == sorted(moved)
    for name in one:
        np.testing.assert_allclose(two[name], one[name], rtol=0, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(moved[name], one[name], rtol=0, atol=1e-5, err_msg=name)
    assert any("from step 1" in str(line) for line in resumed), resumed
    assert sorted(p.name for p in (moved_dir / "checkpoints").iterdir()) == ["1", "2"]

    # Written once, by process 0: one line per step and evaluation, the same numbers (the first
    # launch also evaluated at its last step, 1).
    records_one, records_two = read_metrics(single_dir), read_metrics(multi_dir)
    assert [r["step"] for r in records_one] == [0, 1, 2, 2]
    assert [r["step"] for r in records_two] == [0, 1, 1, 2, 2]
    train_lines = [r for r in records_two if "reward/mean" in r]
    assert [r["step"] for r in train_lines] == [1, 2]
    assert any(r["reward/std"] > 0 for r in train_lines), "no reward signal: the test is vacuous"
    # the paged engines' KV metrics: one engine per process, gathered; one per data shard there
    kv = ("rollout/kv_peak_gib", "rollout/kv_pool_gib", "rollout/decode_dispatches")
    assert all(k in r for r in train_lines for k in kv), train_lines
    two_by_step = {(r["step"], "reward/mean" in r): r for r in records_two}
    for a in records_one:
        b = two_by_step[a["step"], "reward/mean" in a]
        for key in ("reward/mean", "reward/std", "actor/pg_loss", "eval/reward_mean", *kv):
            if key in a:
                assert b[key] == pytest.approx(a[key], abs=1e-6), (a["step"], key)
    assert (multi_dir / "config.yaml").exists() and (multi_dir / "curves.png").exists()
    assert sorted(p.name for p in (multi_dir / "checkpoints").iterdir()) == ["1", "2"]
    for logs in (first, second):
        assert "final: " in _tail(logs[0]) and "final: " not in _tail(logs[1])
    assert "from step 1" in _tail(second[0]) and "resuming" not in _tail(second[1])


# ---------------------------------------------------------------------------------------------
# Host values across processes: the coordination service's key-value store, not devices.


def test_host_allgather_in_one_process_stacks_or_tiles_its_own_values():
    out = dist.host_allgather(
        {"flag": np.int32(3), "rows": np.ones((2, 3)), "none": None, "name": np.asarray("a")},
        what="one process",
    )
    assert out["flag"].tolist() == [3] and out["rows"].shape == (1, 2, 3)
    assert out["none"] is None and out["name"].tolist() == ["a"]
    (tiled,) = dist.host_allgather((np.arange(3),), what="tiled", tiled=True)
    assert tiled.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match=r"host_allgather\('bad'\): leaf 0 is an object array"):
        dist.host_allgather([np.array([{}], object)], what="bad")
    with pytest.raises(ValueError, match=r"leaf 0 has shapes \[\(\)\].*axis 0 \(tiled\)"):
        dist.host_allgather(np.int32(1), what="scalar", tiled=True)


HOST_CHILD = """\
import sys

from jaxrl_llm import distributed as dist

port, pid = sys.argv[1], int(sys.argv[2])
dist.initialize(f"127.0.0.1:{port}", 2, pid)
from tests.train.multiprocess_cli import refuse_process_allgather

refuse_process_allgather()  # what jaxrl_llm must not use (see that module)

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl_llm.train import step as S

# process order; stacked, tiled with a different number of rows per process; None and strings
out = dist.host_allgather(
    {"flag": np.int32(pid + 1), "none": None, "name": np.asarray(f"p{pid}")}, what="stack"
)
print("stack", out["flag"].tolist(), out["name"].tolist(), out["none"])
tiled = dist.host_allgather(np.arange(pid + 1) + 10 * pid, what="tiled", tiled=True)
print("tiled", tiled.tolist())
try:  # shapes that do not stack: both processes raise
    dist.host_allgather(np.zeros(pid + 1), what="ragged")
except ValueError as e:
    print("ragged:", e)

# a program with a collective in every iteration, over every device, in flight meanwhile
mesh = jax.make_mesh((4,), ("data",))
x = dist.to_global(np.ones((4, 256, 256), np.float32), NamedSharding(mesh, P("data")))


@jax.jit
def busy(x):
    body = lambda i, y: jnp.tanh(y @ jnp.full((256, 256), 1e-3)) + y.sum() * 1e-9
    return jax.lax.fori_loop(0, 300, body, x).sum()


busy(x).block_until_ready()
out = busy(x)
dist.host_allgather(np.int32(0), what="beside a program in flight")
print("in flight", not out.is_ready())
out.block_until_ready()

# the packing plan's row sums: rows split over processes, and replicated over a second axis
mask = np.arange(4 * 3 * 5).reshape(4, 3, 5) % 4 > 0
for shape, names in (((4,), ("data",)), ((2, 2), ("data", "tensor"))):
    m = jax.make_mesh(shape, names)
    g = dist.to_global(mask, NamedSharding(m, P("data")))
    print("row sums", shape, bool((S._row_sums(g, "mask") == mask.sum(-1)).all()))

# Many independent programs with collectives (XLA:CPU runs them concurrently; gloo matches
# their collectives by order only): the checkpoint's per-array checksums and a weight sync's
# per-array reshards, 64 arrays split over both processes, equal to one array at a time.
from jaxrl_llm.train import checksums, placement

arrays = {
    f"a{i}": dist.to_global(np.full((4, i + 1), i, np.float32), NamedSharding(mesh, P("data")))
    for i in range(64)
}
one_by_one = {k: np.asarray(dist.wait(checksums.array_checksum(x))).tolist()
              for k, x in arrays.items()}
print("checksums", all(checksums.compute_checksums(arrays) == one_by_one for _ in range(3)))
local = [[d for d in jax.devices() if d.process_index == p] for p in range(2)]
train = jax.sharding.Mesh(np.array([mine[0] for mine in local]), ("data",))
rollout = jax.sharding.Mesh(np.array([mine[1] for mine in local]), ("data",))
on_train = {k: dist.to_global(np.full((2, 3), i, np.float32), NamedSharding(train, P("data")))
            for i, k in enumerate(arrays)}
moved = placement.transfer(on_train, {k: NamedSharding(rollout, P()) for k in on_train})
print("transfer", all(
    (np.asarray(moved[k].addressable_data(0)) == i).all() for i, k in enumerate(on_train)
))

# dist.gather over every device, dist.to_host of a global array; dist.put: host values (and
# arrays on this process's devices) onto a sharding over every process, with no check program
# (jax.device_put would run multihost_utils.assert_equal, refused here as in the trainer's
# two-process runs: tests/train/multiprocess_cli.py).
every = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("p", "l"))
print("gather", dist.gather({"r": np.full((1, 2), pid)})["r"].tolist())
put = dist.put(
    {"f": np.arange(8.0).reshape(4, 2), "i": np.int32(3), "local": jnp.ones(3)},
    {"f": NamedSharding(every, P("p")), "i": NamedSharding(every, P()),
     "local": NamedSharding(every, P())},
)
print("put", {k: (str(v.dtype), v.shape) for k, v in put.items()},
      dist.to_host(put["f"]).tolist() == np.arange(8.0).reshape(4, 2).tolist(),
      int(put["i"].addressable_data(0)), float(put["local"].addressable_data(1).sum()))
print("put one sharding", dist.put((np.zeros(2), np.ones(2)), NamedSharding(every, P()))[1]
      .addressable_data(0).tolist())
try:
    jax.device_put(np.zeros(2), NamedSharding(every, P()))
except AssertionError as e:
    print("refused:", str(e).splitlines()[0])

try:  # another call at the same point: both processes raise, naming the other's call
    dist.host_allgather(np.int32(0), what=f"call of process {pid}")
except RuntimeError as e:
    print("mismatch:", e)

# the store keeps one key per process (the last round's)
dist.host_allgather(np.int32(0), what="last")
client = dist._kv_client()
client.wait_at_barrier("after last", 60_000)
print("keys", len(client.key_value_dir_get_bytes("jaxrl_llm/host_allgather/")))
client.wait_at_barrier("counted", 60_000)

if pid == 0:  # process 1 skips this call
    try:
        dist.host_allgather(np.int32(0), what="alone", timeout_s=2)
    except TimeoutError as e:
        print("timeout:", e)
client.wait_at_barrier("end", 60_000)
print("done", flush=True)
"""


@pytest.mark.slow
def test_host_values_and_collective_programs_across_two_processes(tmp_path):
    """host_allgather: values in process order; no wait for device work; mismatched calls,
    shapes and a missing process are clear errors; the store is left with one key per process.
    And the checksums and reshards of many arrays, each a program with collectives, complete
    with the values of one array at a time; ``dist.gather``, ``dist.to_host`` and
    ``dist.put`` run without ``multihost_utils.process_allgather``."""
    children: list = []
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    t0 = time.monotonic()
    try:
        _start_children(children, HOST_CHILD, logs, devices=2)
        _wait(children, logs, t0, "host_allgather", limit=180)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=30)
    for pid, log in enumerate(logs):
        text = _tail(log, 20000)
        assert "stack [1, 2] ['p0', 'p1'] None\ntiled [0, 10, 11]\n" in text, text
        assert "ragged: host_allgather('ragged'): leaf 0 has shapes [(1,), (2,)]" in text, text
        assert "in flight True\n" in text, text
        assert "row sums (4,) True\nrow sums (2, 2) True\n" in text, text
        assert "checksums True\n" in text and "transfer True\n" in text, text
        assert "gather [[0, 0], [1, 1]]\n" in text, text
        assert (
            "put {'f': ('float32', (4, 2)), 'i': ('int32', ()), 'local': ('float32', (3,))} "
            "True 3 3.0\nput one sharding [1.0, 1.0]\n" in text
        ), text
        assert "refused: multihost_utils.process_allgather ran in a multi-process run" in text
        other = 1 - pid
        assert (
            f"mismatch: host_allgather('call of process {pid}'): process {other} called "
            f"host_allgather('call of process {other}')" in text
        ), text
        assert "keys 2\n" in text and "done" in text, text
    assert "timeout: host_allgather('alone') round " in _tail(logs[0], 20000)
    assert ": processes [1] published nothing within 2 s" in _tail(logs[0], 20000)


HEARTBEAT_CHILD = """\
import sys, time

from jaxrl_llm import distributed as dist

port, pid = sys.argv[1], int(sys.argv[2])
dist.initialize(f"127.0.0.1:{port}", 2, pid, heartbeat_timeout_s=3)

import jax

print("up", jax.process_count(), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_dead_process_ends_the_others_after_the_heartbeat_timeout(tmp_path):
    """``heartbeat_timeout_s`` reaches JAX's coordination service: when process 1 is killed,
    process 0 ends ~3 s later (JAX's default is 100 s, which this test would not see)."""
    children: list = []
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    try:
        _start_children(children, HEARTBEAT_CHILD, logs)
        deadline = time.monotonic() + 180
        while not all("up 2" in _tail(log) for log in logs):
            assert all(c.poll() is None for c in children), [_tail(log) for log in logs]
            assert time.monotonic() < deadline, [_tail(log) for log in logs]
            time.sleep(0.2)
        children[1].kill()
        killed = time.monotonic()
        try:
            code = children[0].wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"process 0 still running 60 s after process 1 died:\n{_tail(logs[0])}")
        waited = time.monotonic() - killed
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=30)
    assert code != 0 and waited < 30, (code, waited, _tail(logs[0]))
    assert "another task died" in _tail(logs[0], 20000), _tail(logs[0])


@pytest.mark.slow
def test_a_process_whose_peers_never_come_ends_after_the_init_timeout(tmp_path):
    """``init_timeout_s`` reaches JAX: process 0 of 2 started alone gives up after ~2 s of
    waiting (JAX's default is 300 s, which this test would not see)."""
    child = "\n".join(
        [
            "import sys",
            "from jaxrl_llm import distributed as dist",
            "dist.initialize(f'127.0.0.1:{sys.argv[1]}', 2, int(sys.argv[2]), init_timeout_s=2)",
            "print('up', flush=True)",
        ]
    )
    log, started = tmp_path / "process0.log", []
    _start_children(started, child, [log])  # process 0 only
    (process,) = started
    try:
        code = process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)
        pytest.fail(f"process 0 still waiting for its peer after 120 s:\n{_tail(log)}")
    assert code != 0 and "up" not in _tail(log).splitlines(), _tail(log)
    assert "DEADLINE_EXCEEDED" in _tail(log, 20000), _tail(log)
