"""The run directory before any model is loaded: checks, the one-writer lock, ``--overwrite``.

``train`` calls :func:`open_run` before it builds anything (a second or two instead of the 20-30 s
of loading a model); ``export`` calls it too, ``evaluate`` only :func:`check_run_dir` (it writes
nothing). Each problem is one :class:`RunDirError` (the CLI prints it, exit status 2):

* ``--run-dir ""`` (an unset shell variable): refused, instead of training into the CWD;
* the run directory, or ``--out``, is a file; its parent cannot be created or written; the run
  directory (or its ``checkpoints/``) is read-only; ``metrics.jsonl`` / ``config.yaml`` is a
  folder, ``checkpoints`` / ``tensorboard`` a file; ``RUN_DIR/export`` is a symlink (the export
  would write through it into another folder);
* a mid-file line of ``metrics.jsonl`` that is not JSON (a torn *last* line, left by a kill
  during a write, is dropped on resume with a warning instead; :func:`~jaxrl_llm.train.metrics.
  read_metrics`);
* a step folder whose checkpoint holds another step (``checkpoints/7`` a renamed copy of step 3,
  or a link to another run's step): orbax never saves below its newest step, so every later
  save would be a silent no-op and the next resume would go back;
* a run that cannot be resumed and would be lost by starting over. A run directory that holds a
  run (``export/``, steps moved to ``checkpoints/unreadable/``, a ``checkpoints`` that is not a
  folder, a ``config.yaml`` without ``checkpoints/``, or the :data:`CHECKPOINTED` record of a
  checkpoint that is gone) but no checkpoint is refused: restarting would truncate
  ``metrics.jsonl`` and overwrite ``export/``, possibly the only copy of the trained weights.
  ``--overwrite`` (``train(overwrite=True)``) deletes the run's own files (:data:`RUN_FILES`)
  and starts at step 0, as ``--overwrite_output_dir`` does in Hugging Face's Trainer; a new
  ``--run-dir`` keeps the old one. A run killed before its first checkpoint completed (no
  record) restarts silently, as before: it lost only what a resume loses.

One run directory has one writer: :class:`RunLock` holds an exclusive ``flock`` on
``RUN_DIR/.lock`` (which names the holder's pid, host and start time) for as long as ``train`` or
``export`` runs; a second one exits 2 naming the holder. The kernel releases the lock when its
process ends, however it ends (``kill -9`` too), so a ``.lock`` left by a dead process never blocks
a new run: it is taken over. On a filesystem without ``flock`` (some FUSE mounts) a warning says
the run is not locked. With several processes, process 0 alone takes the lock and every process
learns whether the checks passed (:func:`agree`).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import shutil
import socket
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from jaxrl_llm.train.metrics import COMPLETIONS_FILE, METRICS_FILE, PLOT_FILE, read_metrics

CONFIG_FILE = "config.yaml"
EXPORT_DIR = "export"
CRITIC_EXPORT_DIR = "critic"  # inside an export folder: a PPO run's critic (export --critic)
ADAPTER_DIR = "adapter"  # setup.ADAPTER_DIR: a LoRA run's adapter in PEFT's format
CHECKPOINT_DIR = "checkpoints"
TENSORBOARD_DIR = "tensorboard"
UNREADABLE_DIR = "unreadable"  # checkpoint.UNREADABLE_DIR (not imported: no orbax here)
LOCK_FILE = ".lock"
# {"step": N}: the newest step known to have been checkpointed; outlives checkpoints/ (deleted
# to free disk), so a run whose checkpoints are gone is not mistaken for a fresh one.
CHECKPOINTED = ".checkpointed"
RUN_FILES = (
    CONFIG_FILE,
    METRICS_FILE,
    METRICS_FILE + ".tmp",
    COMPLETIONS_FILE,
    COMPLETIONS_FILE + ".tmp",
    TENSORBOARD_DIR,
    CHECKPOINT_DIR,
    EXPORT_DIR,
    ADAPTER_DIR,
    PLOT_FILE,
    CHECKPOINTED,
)
# What a Hugging Face model folder holds that `export` writes (stale copies are removed first).
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
MODEL_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "pytorch_model*.bin",
    "*.bin.index.json",
)
START_OVER = (
    "To start over, rerun with --overwrite (deletes this run's config.yaml, metrics.jsonl, "
    "completions.jsonl, tensorboard/, checkpoints/ and export/) or use a new --run-dir."
)


class RunDirError(ValueError):
    """The run directory (or an output folder) cannot be used as asked; the message says why and
    what to do."""


def run_dir_path(run_dir: str | os.PathLike | None, config_run_dir: str | None = None) -> Path:
    """The absolute run directory of ``--run-dir`` (or the config's ``run_dir``).

    Raises:
      RunDirError: it is empty or blank (``--run-dir "$UNSET"``), or neither is given.
    """
    for given, where in ((run_dir, "--run-dir"), (config_run_dir, "run_dir in the config")):
        if given is None:
            continue
        if not str(given).strip():
            raise RunDirError(
                f"{where} is empty (an unset shell variable?); give the run directory, e.g. "
                "--run-dir runs/my_run"
            )
        return Path(given).expanduser().absolute()
    raise RunDirError("give a run directory (--run-dir or run_dir in the config)")


def _probe_writable(folder: Path, what: str) -> None:
    try:
        fd, name = tempfile.mkstemp(prefix=".write_test_", dir=folder)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        raise RunDirError(
            f"{what} {folder} is not writable ({e.strerror or e}); training writes its "
            "checkpoints and metrics there. Fix its permissions (or the read-only mount), or "
            "use another --run-dir."
        ) from e


def step_folders(checkpoints: Path) -> list[int]:
    """The committed steps in ``checkpoints/`` (orbax's numbered folders; tmp folders are not)."""
    if not checkpoints.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit() and p.is_dir())


def _saved_step(step_dir: Path) -> int | None:
    """The step recorded in a checkpoint's ``meta`` item (None when it cannot be read: the
    restore's fallback deals with unreadable checkpoints)."""
    try:
        meta = json.loads((step_dir / "meta" / "metadata").read_text(encoding="utf-8"))
        return int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_step_numbers(checkpoints: Path) -> None:
    """Raises :class:`RunDirError` for a step folder whose checkpoint holds another step."""
    wrong = []
    for step in step_folders(checkpoints):
        saved = _saved_step(checkpoints / str(step))
        if saved is not None and saved != step:
            folder = checkpoints / str(step)
            link = f" (a link to {os.path.realpath(folder)})" if folder.is_symlink() else ""
            wrong.append(f"{folder}{link} holds step {saved}")
    if wrong:
        raise RunDirError(
            "checkpoint folders named after another step than the one they hold: "
            + "; ".join(wrong)
            + ". Orbax never saves below its newest step, so every later save would silently do "
            "nothing. Move the misnamed folder out of checkpoints/ (or name it after its step) "
            "and rerun."
        )


def _entry_types(run_dir: Path) -> None:
    for name in (CONFIG_FILE, METRICS_FILE, COMPLETIONS_FILE, PLOT_FILE):
        if (run_dir / name).is_dir():
            raise RunDirError(
                f"{run_dir / name} is a folder; the trainer writes a file there. Move it away."
            )
    for name in (TENSORBOARD_DIR,):
        path = run_dir / name
        if path.exists() and not path.is_dir():
            raise RunDirError(f"{path} is a file; the trainer writes a folder there. Move it away.")
    export = run_dir / EXPORT_DIR
    if export.is_symlink():
        raise RunDirError(
            f"{export} is a symlink (to {os.path.realpath(export)}); the export would write "
            "through it into that folder. Remove the link (or export elsewhere with "
            "`jaxrl-llm export --out DIR`)."
        )
    if export.exists() and not export.is_dir():
        raise RunDirError(f"{export} is a file; the export writes a folder there. Move it away.")


def _metrics_steps(run_dir: Path) -> list[int]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the torn-tail warning is given on resume
            records = read_metrics(run_dir / METRICS_FILE)
    except ValueError as e:
        raise RunDirError(f"{e}. Fix or delete that line and rerun.") from e
    except OSError as e:
        raise RunDirError(f"cannot read {run_dir / METRICS_FILE}: {e.strerror or e}") from e
    return sorted({int(r.get("step", 0)) for r in records})


def _lost_run(run_dir: Path) -> list[str]:
    """Why ``run_dir`` holds a run that a restart would destroy (empty: nothing to lose)."""
    checkpoints = run_dir / CHECKPOINT_DIR
    why = []
    if checkpoints.exists() and not checkpoints.is_dir():
        why.append(f"{checkpoints} is a file, not the checkpoints folder")
    elif not checkpoints.exists() and (run_dir / CONFIG_FILE).exists():
        why.append(f"{checkpoints} is missing (deleted?)")
    unreadable = checkpoints / UNREADABLE_DIR
    if unreadable.is_dir() and any(unreadable.iterdir()):
        names = sorted(p.name for p in unreadable.iterdir())
        why.append(f"every checkpoint was unreadable (moved to {unreadable}: {', '.join(names)})")
    record = run_dir / CHECKPOINTED
    if record.is_file() and not why:
        try:
            step = json.loads(record.read_text(encoding="utf-8"))["step"]
        except (OSError, ValueError, KeyError, TypeError):
            step = "?"
        why.append(f"step {step} was checkpointed ({record}) but no step folder is left")
    export = run_dir / EXPORT_DIR
    if export.is_dir() and any(export.iterdir()):
        why.append(f"{export} holds the exported weights of a finished run")
    return why


def check_run_dir(run_dir: Path, *, writing: bool = True, overwrite: bool = False) -> list[int]:
    """The checks of the module docstring that read only (no lock, nothing removed); returns
    the checkpointed steps. ``writing=False``: only what ``evaluate`` needs."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"the run directory {run_dir} is a file; give a folder (--run-dir)")
    if not writing:
        return step_folders(run_dir / CHECKPOINT_DIR)
    if not run_dir.exists():
        return []
    if overwrite:  # the run's files are removed, whatever they are
        return []
    _entry_types(run_dir)
    check_export_dir(run_dir / EXPORT_DIR, default=True)  # else refused after training
    checkpoints = run_dir / CHECKPOINT_DIR
    steps = step_folders(checkpoints)
    if steps:
        check_step_numbers(checkpoints)
    metrics = _metrics_steps(run_dir)
    if not steps:
        why = _lost_run(run_dir)
        if why:
            trained = f"; metrics.jsonl has steps {metrics[0]}-{metrics[-1]}" if metrics else ""
            raise RunDirError(
                f"{run_dir} holds a run but no usable checkpoint: "
                + "; ".join(why)
                + f"{trained}. Training again would start at step 0 and replace metrics.jsonl "
                "and export/. " + START_OVER + " To keep the trained weights, copy export/ "
                "first; `jaxrl-llm generate --model RUN_DIR/export` uses them as they are."
            )
    return steps


def _remove_run_files(run_dir: Path, log: Callable[..., None]) -> None:
    removed = []
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        else:
            continue
        removed.append(name)
    if removed:
        log(f"--overwrite: removed {', '.join(removed)} from {run_dir}; starting at step 0")


def record_checkpointed(run_dir: Path) -> None:
    """Writes :data:`CHECKPOINTED` with the newest committed step (atomically; nothing when
    there is none)."""
    steps = step_folders(run_dir / CHECKPOINT_DIR)
    if not steps:
        return
    tmp = run_dir / (CHECKPOINTED + ".tmp")
    tmp.write_text(json.dumps({"step": steps[-1]}) + "\n", encoding="utf-8")
    os.replace(tmp, run_dir / CHECKPOINTED)


class RunLock:
    """An exclusive ``flock`` on ``RUN_DIR/.lock`` (see the module docstring)."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise RunDirError(f"cannot create the lock {self.path}: {e.strerror or e}") from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = self._holder(fd)
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise RunDirError(
                        f"another process is writing to {self.path.parent} ({holder}): one run "
                        "directory has one writer. Wait for it to end or stop it, or use another "
                        "--run-dir. (The lock ends with its process, also after kill -9; a "
                        f"leftover {self.path} does not block.)"
                    ) from e
                warnings.warn(
                    f"cannot lock {self.path} ({e.strerror}; a filesystem without flock?): "
                    "nothing stops a second trainer on this run directory",
                    stacklevel=2,
                )
                return
            # Released and unlinked by its holder between our open and flock: lock the new file.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            info = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            }
            os.ftruncate(fd, 0)
            os.write(fd, (json.dumps(info) + "\n").encode())
            self._fd = fd
            return

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
            return f"pid {info['pid']} on {info['host']}, since {info['since']}"
        except (OSError, ValueError, KeyError):
            return "holder unknown"

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()  # while still locked: a waiter re-checks the inode (acquire)
        os.close(self._fd)
        self._fd = None


def agree(ok: bool, what: str) -> None:
    """With several processes: raises on every process when the checks failed on any (a
    collective, over the coordination service); one process: nothing."""
    import jax

    if jax.process_count() == 1:
        return
    import numpy as np

    from jaxrl_llm import distributed as dist

    flags = dist.host_allgather(np.int32(ok), what=f"agree: {what}").reshape(-1)
    if not ok:
        return  # this process raises its own error
    bad = [int(i) for i in np.flatnonzero(flags == 0)]
    if bad:
        raise RunDirError(f"{what}: refused on process {', '.join(map(str, bad))} (see its output)")


@contextlib.contextmanager
def open_run(
    run_dir: Path,
    *,
    overwrite: bool = False,
    primary: bool = True,
    multiprocess: bool = False,
    log: Callable[..., None] = print,
) -> Iterator[list[int]]:
    """Checks ``run_dir``, creates it, takes its lock (process 0) and, with ``overwrite``,
    removes the previous run's files; yields the checkpointed steps; releases the lock."""
    lock = RunLock(run_dir)
    try:
        error, steps = None, []
        try:
            steps = check_run_dir(run_dir, overwrite=overwrite)
            if primary:
                _create(run_dir)
                _probe_writable(run_dir, "the run directory")
                if (run_dir / CHECKPOINT_DIR).is_dir():
                    _probe_writable(run_dir / CHECKPOINT_DIR, "the checkpoints folder")
                lock.acquire()
                if overwrite:
                    _remove_run_files(run_dir, log)
        except RunDirError as e:
            error = e
        if multiprocess:
            agree(error is None, f"run directory {run_dir}")
        if error is not None:
            raise error
        yield steps
    finally:
        lock.release()


@contextlib.contextmanager
def locked(run_dir: Path, *, primary: bool = True, multiprocess: bool = False) -> Iterator[None]:
    """Holds ``run_dir``'s lock (process 0) for a command that writes into it (``export``)."""
    lock = RunLock(run_dir)
    try:
        error = None
        try:
            if primary:
                lock.acquire()
        except RunDirError as e:
            error = e
        if multiprocess:
            agree(error is None, f"run directory {run_dir}")
        if error is not None:
            raise error
        yield
    finally:
        lock.release()


def _create(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parent = next((p for p in run_dir.parents if p.exists()), run_dir.parent)
        kind = "" if parent.is_dir() else ", which is a file"
        raise RunDirError(
            f"cannot create the run directory {run_dir}: {e.strerror or e} (its nearest "
            f"existing parent is {parent}{kind}); give a --run-dir you can write to"
        ) from e


def _model_files(out: Path) -> set[Path]:
    owned = {p for pattern in MODEL_PATTERNS for p in out.glob(pattern) if p.is_file()}
    return owned | {out / n for n in MODEL_FILES if (out / n).is_file()}


def check_export_dir(out: Path, *, default: bool) -> None:
    """Raises :class:`RunDirError` when ``out`` cannot take an export: a file, ``RUN_DIR/export``
    as a symlink (``default``; it would write through the link), or a non-empty folder that
    holds no model (someone else's files: left untouched)."""
    if default and out.is_symlink():
        raise RunDirError(
            f"{out} is a symlink (to {os.path.realpath(out)}); the export would write through it "
            "into that folder. Remove the link, or pass --out DIR."
        )
    if out.exists() and not out.is_dir():
        raise RunDirError(f"the export folder {out} is a file; give a folder (--out DIR)")
    if not out.is_dir():
        return
    owned = _model_files(out)
    others = sorted(p.name for p in out.iterdir() if p not in owned)
    is_model = (out / "config.json").is_file() or any(p.suffix == ".safetensors" for p in owned)
    if others and not is_model:
        shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        raise RunDirError(
            f"the export folder {out} is not empty and holds no model ({len(others)} entries: "
            f"{shown}); give an empty or new folder (--out DIR), or one holding a model to replace"
        )


def prepare_export_dir(out: Path, *, default: bool) -> list[str]:
    """Makes ``out`` ready for a model (:func:`check_export_dir`, then removes the weights,
    shard index, config and tokenizer files a previous export left: a stale
    ``model.safetensors.index.json`` would load the old shards); returns the removed names.
    Other files (a README, ...) are kept."""
    check_export_dir(out, default=default)
    if not out.is_dir():
        return []
    owned = _model_files(out)
    for path in owned:
        path.unlink()
    return sorted(p.name for p in owned)


__all__ = [
    "CHECKPOINTED",
    "CRITIC_EXPORT_DIR",
    "LOCK_FILE",
    "RUN_FILES",
    "START_OVER",
    "RunDirError",
    "RunLock",
    "check_export_dir",
    "check_run_dir",
    "locked",
    "open_run",
    "prepare_export_dir",
    "record_checkpointed",
    "run_dir_path",
    "step_folders",
]
