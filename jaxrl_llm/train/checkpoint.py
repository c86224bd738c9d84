"""Checkpoints of the full RL state with orbax: async, keep-N, restorable onto any mesh.

A checkpoint of step ``s`` is the folder ``RUN_DIR/checkpoints/s`` with two items:

* ``state``: every array of the :class:`~jaxrl_llm.train.state.TrainState` (policy, critic,
  both optimizer states, step, PRNG key data, KL controller state, data position) as a nested
  dict with string keys (``opt_state/1/0/mu/model/...``), saved by orbax's
  ``PyTreeCheckpointHandler`` without compression (see below);
* ``meta``: JSON with the shape, dtype and checksum of every array, the data iterator's state
  (epoch, index, seed, number of examples), the resolved config as YAML, and any extra host
  values;
* ``host`` (optional): named host arrays saved with the step, e.g. the async loop's buffered
  rollouts (:mod:`jaxrl_llm.train.asynchronous`); ``meta`` holds their shapes, dtypes and
  sha256, checked on restore.

Checksums, not compression. Each array's checksum is two uint32 sums over its bits, a plain one
and one weighted by position, computed on device and the same for any sharding and mesh
(:mod:`jaxrl_llm.train.checksums` gives the formulas), so a restore onto another layout checks
them too. Restoring recomputes them and treats a mismatch like an unreadable file
(:class:`CheckpointCorruptError`). Without
them, corruption inside a data file was caught only by zstd failing to decode it; and with
compression on, tensorstore holds each array's compressed chunks in memory while it writes,
which on CPU raised the host peak of a save by about the size of the state (1.36 GiB for
SmolLM2-135M's policy and Adam moments; nothing without compression). Checkpoints written
compressed (before this) still restore; those without checksums are restored unchecked.

Restoring builds ``jax.ShapeDtypeStruct`` targets from a template state and its shardings, so a
checkpoint restores onto the same or a different mesh (each device reads its shard). The
shapes in ``meta`` are compared with the template first: a checkpoint of another model (or a
run with / without a critic) fails with a :class:`CheckpointMismatchError` naming the arrays,
instead of an orbax error deep in tensorstore.

Saving is asynchronous: ``save`` returns once the arrays are copied to the host and the files
are written in a background thread; an interrupted save leaves a ``*.orbax-checkpoint-tmp``
folder that ``latest_step`` ignores (commits are atomic). Paths are made absolute (orbax
requires it).

Faults (``tests/train/test_faults.py`` kills runs with SIGKILL at random moments):

* *No half-written and no half-deleted step folder.* Orbax writes a step into a tmp folder and
  renames it when complete. Checkpoints beyond ``max_to_keep`` are not ``rmtree``'d in place
  (a kill during that would leave a partial step folder that still lists as a step): orbax
  renames them into ``to_delete/`` (its ``todelete_subdir`` option, one atomic rename), and
  ``save`` empties that folder before it starts the next checkpoint.
* *A corrupt or truncated latest checkpoint.* ``restore()`` without a step tries the steps from
  the newest down; a step that fails to read (a truncated or missing file, bad JSON, a
  tensorstore decode error, a checksum mismatch) is moved aside to ``unreadable/STEP`` (kept for
  inspection, no longer listed) and a :class:`CheckpointFallbackWarning` names it, its error and
  the step restored instead. A :class:`CheckpointMismatchError` (a checkpoint of another model)
  is not corruption and is raised at once. With several processes every process tries each step,
  and they agree before going on: a step unreadable on any process is unreadable for all
  (process 0 moves it aside, then every process re-lists the steps), so all restore the same
  step and later agree on which steps exist (``should_save``).
* *A failed save (disk full, ...).* Errors of the background write surface at the next
  ``save``, ``wait`` or ``close`` as one :class:`CheckpointSaveError` naming the step, the folder,
  the cause and the newest complete checkpoint, which is intact (orbax deletes old checkpoints
  only after a successful commit; the partial tmp folder is ignored).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrl_llm import distributed as dist
from jaxrl_llm.train import checksums
from jaxrl_llm.train.state import TrainState


class CheckpointMismatchError(ValueError):
    """A checkpoint whose arrays do not fit this run (another model shape, recipe or layout)."""


class CheckpointSaveError(OSError):
    """Writing a checkpoint failed (e.g. the disk is full); earlier checkpoints are intact."""


class CheckpointCorruptError(OSError):
    """A checkpoint read without error but its arrays do not match their saved checksums."""


class CheckpointFallbackWarning(UserWarning):
    """The newest checkpoint could not be read; an older one was restored instead."""


TRASH_DIR = "to_delete"  # orbax's todelete_subdir: old steps are renamed here, then removed
UNREADABLE_DIR = "unreadable"  # corrupt steps are moved here by restore()
HOST_ITEM = "host"  # the orbax item of save(host=...): named host arrays (buffered rollouts)
HOST_ARRAYS = "host_arrays"  # meta key: their description on disk, the arrays after restore
# Orbax's barriers are named PREFIX_NAME (the prefix set here: orbax's default differs between
# its sync and async checkpointers). Orbax 0.12 ends every restore with the barrier
# "Checkpointer:restore" on every process; a process whose read raised never reached it.
_BARRIER_PREFIX = "jaxrl_llm"
_ORBAX_RESTORE_BARRIER = ocp.multihost.unique_barrier_key(
    "Checkpointer:restore", prefix=_BARRIER_PREFIX
)


def _failed_processes(ok: bool) -> list[int]:
    """The processes whose attempt failed, the same list on every process (a collective: every
    process must call it; over the coordination service)."""
    if jax.process_count() == 1:
        return [] if ok else [0]
    flags = dist.host_allgather(np.int32(ok), what="checkpoint step readable")
    return [int(i) for i in np.flatnonzero(flags.reshape(-1) == 0)]


def _every_process() -> set[int] | None:
    """Orbax's ``active_processes``: every process of a multi-process run (``None`` in one).

    Given explicitly so that orbax's barriers go through the coordination service
    (``wait_at_barrier``): with ``None``, orbax 0.12 syncs the main thread's barriers with a
    device all-reduce over every device of the job (``multihost_utils.sync_global_devices``)
    unless its ``experimental_orbax_use_distributed_barrier`` flag is set. A device barrier
    waits for whatever the devices still run, and on CPU its gloo collectives may run beside
    another program's, which gloo does not match across processes (``host_allgather``)."""
    return set(range(jax.process_count())) if jax.process_count() > 1 else None


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        ocp.multihost.sync_global_processes(name, processes=_every_process())


class _DropClosedLoopTracebacks:
    """A ``sys.stderr`` that drops the lines of the ``RuntimeError: Event loop is closed``
    tracebacks tensorstore prints when a read fails: its other reads complete after orbax's
    event loop closed and their callbacks cannot reach it (about 9 per unreadable checkpoint,
    printed from tensorstore's threads, interleaved). Everything else is passed on."""

    DROPPED = (
        "Traceback (most recent call last):",
        "asyncio/base_events.py",
        "self._check_closed()",
        "raise RuntimeError('Event loop is closed')",
        "RuntimeError: Event loop is closed",
    )

    def __init__(self, stream: Any):
        self._stream, self._pending, self._lock = stream, "", threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            *lines, self._pending = self._pending.split("\n")
            kept = [line for line in lines if not any(d in line for d in self.DROPPED)]
            if kept:
                self._stream.write("\n".join(kept) + "\n")
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self._pending and not any(d in self._pending for d in self.DROPPED):
                self._stream.write(self._pending)
            self._pending = ""
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _quiet_unreadable() -> Any:
    """While restore tries the steps: no closed-event-loop tracebacks, and no absl error logs
    (orbax logs an unparsable metadata file with its whole content, NUL bytes and all); the
    :class:`CheckpointFallbackWarning` (or the error) says what was wrong, once."""
    absl = logging.getLogger("absl")
    level, stderr = absl.level, sys.stderr
    absl.setLevel(logging.CRITICAL)
    sys.stderr = quiet = _DropClosedLoopTracebacks(stderr)
    try:
        yield
    finally:
        if sys.stderr is quiet:
            sys.stderr = stderr
        quiet.flush()
        absl.setLevel(level)


def _abandoned_read(unraisable: Any) -> bool:
    """Whether an unraisable exception is a leftover of a failed restore: one of orbax's array
    reads left un-awaited (``asyncio.gather`` returns at the first error and the others are
    never awaited; closing such a coroutine raises its read error again, ignored but printed
    with the whole tensorstore spec, ~40 lines a read), or a late tensorstore callback that
    finds orbax's event loop closed."""
    error = unraisable.exc_value
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return True
    code = getattr(unraisable.object, "cr_code", None)
    return (
        code is not None
        and f"{os.sep}orbax{os.sep}" in code.co_filename
        and isinstance(error, Exception)
    )


@contextlib.contextmanager
def _closing_abandoned_reads(failures: list, directory: Path) -> Any:
    """Around restore's tries of the steps: when one failed (``failures``: ``(step, ...)``
    tuples, not empty), the reads it abandoned are closed here by a garbage collection whose
    :func:`_abandoned_read` exceptions, and asyncio's reports of the failed steps' tasks and
    futures (:func:`_abandoned_task_filter`), are dropped, instead of printing ~2,000 lines at
    some later collection after the :class:`CheckpointFallbackWarning` said what was wrong.
    Every other unraisable exception goes to the hook that was installed."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not _abandoned_read(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        if failures:
            folders = [str(directory / str(f[0])) for f in failures]
            failures.clear()  # their tracebacks hold the abandoned reads
            drop = _abandoned_task_filter(folders)
            asyncio_log = logging.getLogger("asyncio")
            asyncio_log.addFilter(drop)
            try:
                gc.collect()
            finally:
                asyncio_log.removeFilter(drop)
        if sys.unraisablehook is hook:
            sys.unraisablehook = previous


def _one_line(error: BaseException) -> str:
    """An unreadable step's error in one line: orbax's read errors go on to print the whole
    TensorStore spec (~100 lines per array)."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def _abandoned_task_filter(folders: list[str]) -> Any:
    """A logging filter, False for asyncio's "... exception was never retrieved" of a failed
    restore's reads: orbax's tasks (the leftovers of :func:`_abandoned_read`, wrapped in tasks),
    its gathers' futures and tensorstore's, whose errors name the step folder (one of
    ``folders``)."""

    def keep(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.split("\n", 1)[0].endswith("exception was never retrieved"):
            return True  # (Task, Future, _GatheringFuture: "<kind> exception was never ...")
        ours = f"{os.sep}orbax{os.sep}" in message or any(f in message for f in folders)
        return not ours

    return keep


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def flatten_state(state: Any) -> dict[tuple[str, ...], Any]:
    """``{path: leaf}`` with string path components, in ``jax.tree`` order."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(state)
    return {tuple(_key_name(k) for k in path): leaf for path, leaf in leaves}


def _nest(flat: Mapping[tuple[str, ...], Any]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def _unnest(tree: Mapping, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(_unnest(value, (*prefix, str(key))))
        else:
            flat[(*prefix, str(key))] = value
    return flat


def _by_name(flat: Mapping[tuple[str, ...], Any]) -> dict[str, Any]:
    """``{"a/b/c": leaf}``: the names ``meta`` uses for the arrays."""
    return {"/".join(path): x for path, x in flat.items()}


def _sha256(x: np.ndarray) -> str:
    import hashlib

    return hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()


def _verify(state: Any, meta: Mapping[str, Any], step: int, where: str) -> None:
    saved = meta.get("checksums")
    if saved is None:  # written before checksums existed
        return
    bad = checksums.find_mismatches(_by_name(flatten_state(state)), saved)
    if bad:
        raise CheckpointCorruptError(
            f"checkpoint step {step} in {where}: {len(bad)} arrays do not match their saved "
            f"checksums (the files were changed or damaged after the save), e.g. {bad[:3]}"
        )


def _describe(flat: Mapping[tuple[str, ...], Any]) -> dict[str, list]:
    return {
        name: [list(np.shape(x)), str(np.dtype(getattr(x, "dtype", np.float32)))]
        for name, x in _by_name(flat).items()
    }


def _check_fits(
    saved: Mapping[str, list], template: Mapping[str, list], step: int, where: str
) -> None:
    missing = [k for k in template if k not in saved]
    extra = [k for k in saved if k not in template]
    changed = [
        f"{k}: checkpoint {tuple(saved[k][0])} {saved[k][1]}, this run {tuple(v[0])} {v[1]}"
        for k, v in template.items()
        if k in saved and (list(saved[k][0]) != list(v[0]) or saved[k][1] != v[1])
    ]
    if not (missing or extra or changed):
        return
    lines = [f"checkpoint {where}/{step} does not fit this run:"]
    if changed:
        lines.append(f"  {len(changed)} arrays changed shape or dtype, e.g.")
        lines += [f"    {c}" for c in changed[:5]]
        lines.append("  (a different model.path or model architecture than the saved run?)")
    if missing:
        lines.append(f"  missing from the checkpoint: {', '.join(missing[:5])}")
    if extra:
        lines.append(f"  not in this run: {', '.join(extra[:5])}")
    if missing or extra:
        lines.append("  (a different algorithm, optimizer or critic than the saved run?)")
    lines.append("Use a new --run-dir, or the config the run was started with.")
    raise CheckpointMismatchError("\n".join(lines))


class Checkpointer:
    """Saves and restores :class:`TrainState` s under ``directory`` (see the module docstring).

    Args:
      directory: the checkpoints folder (made absolute).
      max_to_keep: checkpoints kept on disk (the oldest are deleted).
      save_every: :meth:`should_save` is true every this many steps (0: only when forced).
      async_save: write in a background thread.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int = 3,
        save_every: int = 0,
        async_save: bool = True,
    ):
        self.directory = Path(directory).expanduser().absolute()
        self.save_every = save_every
        self._pending: int | None = None  # the step being written in the background
        self._reported: BaseException | None = None  # a save error already raised
        processes = ocp.options.MultiprocessingOptions(
            barrier_sync_key_prefix=_BARRIER_PREFIX, active_processes=_every_process()
        )
        # every process creates it (orbax refuses create=True with active_processes set)
        self.directory.mkdir(parents=True, exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            create=False,
            todelete_subdir=TRASH_DIR,
            multiprocessing_options=processes,
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.PyTreeCheckpointHandler(
                    use_compression=False, multiprocessing_options=processes
                ),
                "meta": ocp.JsonCheckpointHandler(multiprocessing_options=processes),
                HOST_ITEM: ocp.PyTreeCheckpointHandler(
                    use_compression=False, multiprocessing_options=processes
                ),
            },
        )

    def should_save(self, step: int, *, final: bool = False) -> bool:
        """Every ``save_every`` steps, and at the end (``final``), unless already saved."""
        if step in self.all_steps():
            return False
        return final or (self.save_every > 0 and step % self.save_every == 0)

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(
        self,
        step: int,
        state: TrainState,
        *,
        meta: Mapping[str, Any] | None = None,
        host: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Starts saving ``state`` as step ``step`` (returns before the files are written).

        ``host``: named host arrays saved with the step in their own item (the async loop's
        buffered rollouts); their shapes, dtypes and sha256 go in ``meta`` and are checked on
        restore, which returns them as ``meta[HOST_ARRAYS]``. Every process passes the same
        values."""
        self.wait()  # raises a CheckpointSaveError for a failed previous save
        if jax.process_index() == 0:
            shutil.rmtree(self.directory / TRASH_DIR, ignore_errors=True)
        flat = flatten_state(state)
        body = {
            "step": int(step),
            "arrays": _describe(flat),
            "checksums": checksums.compute_checksums(_by_name(flat)),
            **dict(meta or {}),
        }
        items = {"state": ocp.args.PyTreeSave(_nest(flat))}
        if host:
            host = {name: np.ascontiguousarray(x) for name, x in host.items()}
            body[HOST_ARRAYS] = {
                name: [list(x.shape), str(x.dtype), _sha256(x)] for name, x in host.items()
            }
            items[HOST_ITEM] = ocp.args.PyTreeSave(dict(host))
        items["meta"] = ocp.args.JsonSave(body)
        self._pending = int(step)
        try:
            self._manager.save(int(step), args=ocp.args.Composite(**items))
        except OSError as e:
            raise self._save_error(e) from e

    def _save_error(self, cause: BaseException) -> CheckpointSaveError:
        step, self._pending = self._pending, None
        self._manager.reload()
        good = self.latest_step()
        full = " (the disk is full)" if getattr(cause, "errno", None) == errno.ENOSPC else ""
        kept = (
            f"the previous checkpoint, step {good} in {self.directory / str(good)}, is intact"
            if good is not None
            else "there is no earlier checkpoint"
        )
        err = CheckpointSaveError(
            f"saving checkpoint step {step} to {self.directory} failed{full}: "
            f"{type(cause).__name__}: {cause}. Nothing of step {step} is used on resume (its "
            f"partial *.orbax-checkpoint-tmp folder is ignored); {kept}. Free space (or fix "
            "the cause) and rerun the same command to resume."
        )
        err.step, err.directory, err.errno = step, self.directory, getattr(cause, "errno", None)
        self._reported = err
        return err

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The JSON ``meta`` item of ``step`` (default: the latest)."""
        step = self._resolve(step)
        out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def _resolve(self, step: int | None) -> int:
        self.wait()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
        return int(step)

    def restore(
        self, template: TrainState, sharding: Any = None, step: int | None = None
    ) -> tuple[TrainState, dict[str, Any]]:
        """``(state, meta)`` of ``step`` (default: the latest readable one), laid out like
        ``sharding``.

        ``template`` gives the tree structure, shapes and dtypes (e.g. a freshly built state;
        its values are not used); ``sharding`` a matching tree of shardings (default: the
        template arrays' own). Without ``step``, an unreadable newest checkpoint is moved aside
        and the next older one restored, with a :class:`CheckpointFallbackWarning` (see the
        module docstring).

        Raises:
          CheckpointMismatchError: the checkpoint's arrays do not match the template's.
          CheckpointCorruptError: ``step`` was given and its arrays fail their checksums.
          FileNotFoundError: no checkpoint, or none readable (each step's error is listed).
        """
        if step is not None:
            step = self._resolve(step)
            state, meta = self._restore(template, sharding, step)
            _verify(state, meta, step, str(self.directory))
            return state, meta
        self._resolve(None)  # waits; FileNotFoundError without any checkpoint
        failed: list[tuple[int, Path, BaseException]] = []
        # the late callbacks of a failed read come after it, its abandoned reads at a later GC
        with _quiet_unreadable(), _closing_abandoned_reads(failed, self.directory):
            return self._restore_latest(template, sharding, failed)

    def _restore_latest(
        self, template: TrainState, sharding: Any, failed: list[tuple[int, Path, BaseException]]
    ) -> tuple[TrainState, dict[str, Any]]:
        for candidate in sorted(self.all_steps(), reverse=True):
            error: BaseException | None = None
            try:
                out = self._restore(template, sharding, candidate)
            except CheckpointMismatchError:  # the same meta on every process: all raise
                raise
            except Exception as e:  # a truncated, missing or undecodable file
                error = e
            bad = _failed_processes(error is None)  # every process takes the same branch
            if not bad:
                try:  # a collective, once every process has read the step
                    _verify(*out, candidate, str(self.directory))
                except CheckpointCorruptError as e:  # the same sums, so on every process
                    error, bad = e, list(range(jax.process_count()))
            if bad:
                if error is None:
                    error = OSError(f"unreadable on process {', '.join(map(str, bad))}")
                failed.append((candidate, self._move_aside(candidate), error))
                error = None  # held by ``failed`` alone, which drops it at the end
                continue
            if failed:
                warnings.warn(
                    "; ".join(
                        f"checkpoint step {s} ({self.directory / str(s)}) is unreadable "
                        f"({_one_line(e)}), moved to {moved}"
                        for s, moved, e in failed
                    )
                    + f"; resuming from the previous good checkpoint, step {candidate} "
                    f"({self.directory / str(candidate)})",
                    CheckpointFallbackWarning,
                    stacklevel=3,
                )
            return out
        raise FileNotFoundError(
            f"no readable checkpoint in {self.directory}: "
            + "; ".join(f"step {s}: {_one_line(e)}" for s, _, e in failed)
            + f" (moved to {self.directory / UNREADABLE_DIR})"
        )

    def _move_aside(self, step: int) -> Path:
        """Renames the step folder to ``unreadable/STEP`` (nothing is deleted). With several
        processes every process calls it: process 0 renames, and the others re-list the steps
        only after that (a barrier), so that all agree the step is gone."""
        src = self.directory / str(step)
        dst = self.directory / UNREADABLE_DIR / str(step)
        if jax.process_index() == 0 and src.exists():
            if dst.exists():
                dst = dst.with_name(f"{step}-{time.time_ns()}")
            dst.parent.mkdir(parents=True, exist_ok=True)
            src.rename(dst)
        _barrier(f"jaxrl_llm:checkpoint:move_aside:{step}")
        self._manager.reload()
        return dst

    def _orbax_restore(
        self, step: int, args: ocp.args.Composite, *, barriers: int
    ) -> ocp.args.Composite:
        """``CheckpointManager.restore``. Orbax ends each restore with a barrier on every
        process; a process whose read raises joins the ``barriers`` it would now skip (this one
        and the rest of :meth:`_restore`'s), so that a read that fails on some processes only
        leaves every process at the same collective; :meth:`restore` then agrees on the outcome.
        """
        try:
            return self._manager.restore(step, args=args)
        except Exception:
            for _ in range(barriers):
                _barrier(_ORBAX_RESTORE_BARRIER)
            raise

    def _restore(
        self, template: TrainState, sharding: Any, step: int
    ) -> tuple[TrainState, dict[str, Any]]:
        self.wait()
        meta_args = ocp.args.Composite(meta=ocp.args.JsonRestore())
        meta = dict(self._orbax_restore(step, meta_args, barriers=2)["meta"])
        if "step" in meta and int(meta["step"]) != step:  # the same meta on every process
            folder = self.directory / str(step)
            link = f" (a link to {os.path.realpath(folder)})" if folder.is_symlink() else ""
            raise CheckpointMismatchError(
                f"checkpoint folder {folder}{link} holds step {int(meta['step'])}, not {step} "
                "(a renamed copy, or another run's step?). Orbax never saves below its newest "
                "step, so every later save would silently do nothing. Move the folder out of "
                f"{self.directory} (or name it after its step) and rerun."
            )
        flat = flatten_state(template)
        _check_fits(meta.get("arrays", {}), _describe(flat), step, str(self.directory))
        if sharding is None:
            shardings = [getattr(x, "sharding", None) for x in flat.values()]
        else:
            shardings = jax.tree.leaves(sharding)
            if len(shardings) != len(flat):
                raise ValueError("restore: the sharding tree does not match the template")
        targets = {
            path: jax.ShapeDtypeStruct(np.shape(x), np.dtype(x.dtype), sharding=s)
            for (path, x), s in zip(flat.items(), shardings, strict=True)
        }
        nested = _nest(targets)
        state_args = ocp.args.PyTreeRestore(
            item=nested, restore_args=ocp.checkpoint_utils.construct_restore_args(nested)
        )
        items = {"state": state_args, "meta": ocp.args.JsonRestore()}
        described = meta.get(HOST_ARRAYS) or {}
        if described:
            host_targets = {
                name: np.zeros(shape, np.dtype(dtype))
                for name, (shape, dtype, _) in described.items()
            }
            items[HOST_ITEM] = ocp.args.PyTreeRestore(
                item=host_targets,
                restore_args={
                    name: ocp.RestoreArgs(restore_type=np.ndarray) for name in host_targets
                },
            )
        out = self._orbax_restore(step, ocp.args.Composite(**items), barriers=1)
        restored = _unnest(out["state"])
        leaves = [restored[path] for path in flat]
        treedef = jax.tree.structure(template)
        meta = dict(out["meta"])
        if described:
            host = {name: np.asarray(x) for name, x in dict(out[HOST_ITEM]).items()}
            bad = [
                name
                for name, (shape, dtype, digest) in described.items()
                if name not in host
                or list(host[name].shape) != list(shape)
                or str(host[name].dtype) != dtype
                or _sha256(host[name]) != digest
            ]
            if bad:
                raise CheckpointCorruptError(
                    f"checkpoint step {step} in {self.directory}: {len(bad)} buffered host "
                    f"arrays do not match their saved sha256, e.g. {bad[:3]}"
                )
            meta[HOST_ARRAYS] = host
        return jax.tree.unflatten(treedef, leaves), meta

    def wait(self) -> None:
        """Blocks until pending saves are on disk.

        Raises:
          CheckpointSaveError: the pending save failed (raised once; see the module docstring).
        """
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            if self._reported is not None:  # orbax re-raises a failed save on every wait
                return
            raise self._save_error(e) from e
        self._pending = None

    def close(self) -> None:
        self.wait()
        try:
            self._manager.close()
        except Exception:
            if self._reported is None:
                raise

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = [
    "HOST_ARRAYS",
    "CheckpointCorruptError",
    "CheckpointFallbackWarning",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "Checkpointer",
    "flatten_state",
]
