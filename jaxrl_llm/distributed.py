"""Multi-process runs with plain ``jax.distributed``: starting it, and moving batches in and out.

JAX runs one Python process per host (TPU VM, GPU node) or per GPU; every process runs the same
program, owns its local devices, and jitted computations span the global mesh. This module
holds the two things the trainer needs on top of that:

1. :func:`initialize` resolves the settings (flags, then environment variables, then JAX's own
   cluster detection) and calls ``jax.distributed.initialize`` once, before anything else
   touches a JAX backend. With no settings at all it does nothing: a single-process run is
   exactly what it was.

   ========================  ==========================================================
   setting                   sources, in order
   ========================  ==========================================================
   coordinator HOST:PORT     ``--coordinator``; ``JAX_COORDINATOR_ADDRESS`` (read by JAX)
   number of processes N     ``--num-processes``; ``JAX_NUM_PROCESSES``
   this process's id I       ``--process-id``; ``JAX_PROCESS_ID``
   auto-detection            ``--distributed``: ``jax.distributed.initialize()`` without
                             arguments, which reads the cluster (Cloud TPU VMs, SLURM
                             ``srun`` steps, Open MPI, Kubernetes); also used for any of
                             the three above that is not given
   heartbeat timeout         ``--heartbeat-timeout S`` (JAX's default 100 s): how long the
                             other processes go on after one stops answering (killed, out of
                             memory, a lost host) before JAX ends them
   start-up timeout          ``--init-timeout S`` (JAX's default 300 s): how long each process
                             waits for all N to connect
   ========================  ==========================================================

   (JAX 0.10 itself reads ``JAX_COORDINATOR_ADDRESS``, ``JAX_COORDINATOR_PORT`` for detected
   clusters, and ``JAX_LOCAL_DEVICE_IDS``; ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` are read
   here and passed on.) On CPU the cross-process collectives are gloo's: without
   ``jax_cpu_collectives_implementation = "gloo"`` JAX answers "Multiprocess computations
   aren't implemented on the CPU backend", so it is set unless the user chose one.

2. Batches. A global batch of ``R`` rows is split by process into contiguous blocks, in process
   order, so the global order is the one a single process would see: process ``p`` owns the
   rows its devices hold under the batch sharding (:func:`process_rows`). Each process turns
   its block into the global array with ``jax.make_array_from_process_local_data``
   (:func:`to_global`), and reads results back with a compiled all-gather (:func:`gather`,
   :func:`to_host`). In a single process these are the identity (``process_rows`` is every
   row). Host values that every process holds whole go onto a sharding with :func:`put`.

   Neither uses ``jax.experimental.multihost_utils.process_allgather`` (nor ``assert_equal``,
   which ``jax.device_put`` runs for a host value onto a sharding over every process): it
   reads the first local device's rows of its all-gather and returns, while the all-gather may
   still run on this process's other devices. On CPU the next program's gloo collectives on
   those devices then meet it in another order on each process, and gloo aborts ("op.preamble.
   length <= op.nbytes ... Is there a distributed collective mismatch in your code?"; seen in
   the two-process async test). Here every such program is waited for on all local devices.

3. Host values. :func:`host_allgather` exchanges small host data (flags, stop signals, row
   counts, rewards, per-row lengths) through the key-value store of JAX's coordination
   service, with no device program: ``multihost_utils.process_allgather`` runs a compiled
   all-gather on every device of the job, so it waits for whatever those devices still run (in
   the async loop, the update in flight) and, on CPU, puts its gloo collectives beside another
   program's, which gloo does not match across processes.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import os
import threading
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"
NUM_PROCESSES_ENV = "JAX_NUM_PROCESSES"
PROCESS_ID_ENV = "JAX_PROCESS_ID"


# Settings field -> its flag, and the name ``jax.distributed.initialize`` takes it by.
_TIMEOUTS = {
    "heartbeat_timeout_s": ("--heartbeat-timeout", "heartbeat_timeout_seconds"),
    "init_timeout_s": ("--init-timeout", "initialization_timeout"),
}


class DistributedError(ValueError):
    """Distributed settings that cannot start a run (the message names the flag or variable)."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """What :func:`initialize` passes to ``jax.distributed.initialize`` (``None``: detected)."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout_s: int | None = None  # None: JAX's default (100 s)
    init_timeout_s: int | None = None  # None: JAX's default (300 s)


def _int_setting(value: Any, what: str) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DistributedError(f"{what} = {value!r}: expected an integer") from None


def _check_coordinator(address: str, what: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(
            f"{what} = {address!r}: expected HOST:PORT (process 0's address and a free port, "
            "e.g. 10.0.0.1:1234)"
        )


def resolve(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
    heartbeat_timeout_s: int | None = None,
    init_timeout_s: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings | None:
    """The settings for ``jax.distributed.initialize``, or ``None`` for a single-process run.

    Flags win over environment variables. Explicit settings must be complete (coordinator,
    N and I together) unless ``auto`` lets JAX detect the rest. The two timeouts (whole
    seconds ≥ 1) apply to a multi-process run only.

    Raises:
      DistributedError: an incomplete or invalid combination, naming the flag or variable.
    """
    env = os.environ if environ is None else environ
    coord_what, n_what, id_what = "--coordinator", "--num-processes", "--process-id"
    if coordinator is None and env.get(COORDINATOR_ENV):
        coordinator, coord_what = env[COORDINATOR_ENV], COORDINATOR_ENV
    if num_processes is None and env.get(NUM_PROCESSES_ENV):
        num_processes, n_what = env[NUM_PROCESSES_ENV], NUM_PROCESSES_ENV
    if process_id is None and env.get(PROCESS_ID_ENV):
        process_id, id_what = env[PROCESS_ID_ENV], PROCESS_ID_ENV
    n = _int_setting(num_processes, n_what)
    i = _int_setting(process_id, id_what)
    timeouts = {}
    for field, value in (
        ("heartbeat_timeout_s", heartbeat_timeout_s),
        ("init_timeout_s", init_timeout_s),
    ):
        flag = _TIMEOUTS[field][0]
        seconds = _int_setting(value, flag)
        if seconds is not None and seconds < 1:
            raise DistributedError(f"{flag} = {seconds}: expected whole seconds ≥ 1")
        if seconds is not None:
            timeouts[field] = seconds
    if coordinator is None and n is None and i is None:
        if auto:
            return Settings(**timeouts)
        if timeouts:
            raise DistributedError(
                f"{' and '.join(_TIMEOUTS[f][0] for f in timeouts)} given for a single-process "
                "run: it applies with --coordinator, --num-processes and --process-id (or their "
                "variables, or --distributed)"
            )
        return None
    if coordinator is not None:
        _check_coordinator(str(coordinator), coord_what)
    if n is not None and n < 1:
        raise DistributedError(f"{n_what} = {n}: expected a number of processes ≥ 1")
    if i is not None and n is not None and not 0 <= i < n:
        raise DistributedError(
            f"{id_what} = {i}: expected a process id in [0, {n}) ({n_what} = {n})"
        )
    if i is not None and i < 0:
        raise DistributedError(f"{id_what} = {i}: expected a process id ≥ 0")
    missing = [
        what
        for what, value in (
            ("--coordinator HOST:PORT", coordinator),
            ("--num-processes N", n),
            ("--process-id I", i),
        )
        if value is None
    ]
    if missing and not auto:
        given = [w for w, v in ((coord_what, coordinator), (n_what, n), (id_what, i)) if v]
        raise DistributedError(
            f"{' and '.join(given)} given without {' and '.join(missing)}: a multi-process run "
            "needs all three on every process (or the variables "
            f"{COORDINATOR_ENV}, {NUM_PROCESSES_ENV}, {PROCESS_ID_ENV}), or --distributed to "
            "let JAX detect the cluster (TPU VM, SLURM, Open MPI)"
        )
    return Settings(coordinator=coordinator, num_processes=n, process_id=i, **timeouts)


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    auto: bool = False,
    heartbeat_timeout_s: int | None = None,
    init_timeout_s: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings | None:
    """Starts ``jax.distributed`` for the :func:`resolve` d settings (nothing without any).

    Must run before any JAX computation or device query in the process (JAX raises
    otherwise). Returns the settings used, or ``None`` when the run is single-process.
    """
    settings = resolve(
        coordinator,
        num_processes,
        process_id,
        auto=auto,
        heartbeat_timeout_s=heartbeat_timeout_s,
        init_timeout_s=init_timeout_s,
        environ=environ,
    )
    if settings is None:
        return None
    if jax.distributed.is_initialized():
        return settings
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeouts = {
        jax_name: getattr(settings, field)
        for field, (_, jax_name) in _TIMEOUTS.items()
        if getattr(settings, field) is not None
    }
    jax.distributed.initialize(
        coordinator_address=settings.coordinator,
        num_processes=settings.num_processes,
        process_id=settings.process_id,
        **timeouts,
    )
    return settings


# ---------------------------------------------------------------------------------------------
# Batches across processes.


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_primary() -> bool:
    """Whether this process writes the run's files (process 0)."""
    return jax.process_index() == 0


def process_rows(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> slice:
    """The rows ``[start, stop)`` of a global ``shape`` array this process's devices hold.

    Raises:
      ValueError: the rows are not one contiguous block (a mesh whose device order interleaves
        processes along the batch axis), so a process could not feed them from one slice.
    """
    if not is_multiprocess():
        return slice(0, shape[0])
    blocks = {
        (idx[0].start or 0, shape[0] if idx[0].stop is None else idx[0].stop)
        for idx in sharding.addressable_devices_indices_map(tuple(shape)).values()
    }
    start, stop = min(b[0] for b in blocks), max(b[1] for b in blocks)
    covered = np.zeros(stop - start, bool)
    for a, b in blocks:
        covered[a - start : b - start] = True
    if not covered.all() or (stop - start) * jax.process_count() != shape[0]:
        raise ValueError(
            f"process {jax.process_index()} holds rows {sorted(blocks)} of a batch of "
            f"{shape[0]}, not one block of {shape[0] // jax.process_count()}: the mesh must "
            "list each process's devices together along its data/fsdp axes (build it from "
            "jax.devices(), which is in process order)"
        )
    return slice(start, stop)


def to_global(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """The global array of a host batch ``x`` (every process holds the same global ``x``):
    each process contributes only its :func:`process_rows` with
    ``jax.make_array_from_process_local_data``."""
    x = np.asarray(x)
    rows = process_rows(sharding, x.shape)
    return jax.make_array_from_process_local_data(sharding, x[rows], x.shape)


def _spans_processes(sharding: jax.sharding.Sharding) -> bool:
    return len({d.process_index for d in sharding.device_set}) > 1


def _put_one(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        moves = not x.sharding.is_equivalent_to(sharding, x.ndim)
        out = jax.device_put(x, sharding)  # if it moves: a reshard, a program with collectives
        return wait(out) if moves and one_collective_program_at_a_time() else out
    if not _spans_processes(sharding):
        return jax.device_put(x, sharding)
    value = np.asarray(x)  # a host value, or an array on this process's devices only
    value = value.astype(jax.dtypes.canonicalize_dtype(value.dtype), copy=False)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def put(tree: Any, shardings: Any) -> Any:
    """``jax.device_put(tree, shardings)`` where every process passes the same host values.

    ``shardings``: one sharding, or a tree of them that is a prefix of ``tree`` (as
    ``jax.device_put``). A leaf already spread over several processes is moved by
    ``jax.device_put``, one leaf at a time on CPU (:func:`one_collective_program_at_a_time`:
    each leaf's reshard is a program with collectives, and ``jax.device_put`` of a tree
    dispatches them all at once); any other leaf bound for a sharding over several processes (a
    numpy array, a scalar, an array on this process's devices) is read on the host and each
    process places the slices its devices hold (``jax.make_array_from_callback``).
    ``jax.device_put`` would first check with ``multihost_utils.assert_equal`` that every
    process passed the same value: an all-gather it does not wait for on all local devices
    (module docstring)."""
    if not is_multiprocess():
        return jax.device_put(tree, shardings)
    return jax.tree.map(
        lambda s, sub: jax.tree.map(lambda x: _put_one(x, s), sub),
        shardings,
        tree,
        is_leaf=lambda s: isinstance(s, jax.sharding.Sharding),
    )


def wait(tree: Any) -> Any:
    """``jax.block_until_ready(tree)``: every array ready on every local device. Read a
    cross-process program's result through this: ``np.asarray`` / ``jax.device_get`` of a
    replicated global array wait for one local device only, while the program may still run
    collectives on the others (module docstring)."""
    return jax.block_until_ready(tree)


def _first_shard(out: jax.Array) -> np.ndarray:
    """The first local shard of ``out``, once ``out`` is ready on every local device."""
    return np.asarray(wait(out).addressable_data(0))


def gather(tree: Any, mesh: jax.sharding.Mesh | None = None) -> Any:
    """Concatenates every process's rows (axis 0, in process order) into global host arrays;
    the identity in a single process. Each leaf must have the same shape on every process.

    Over every device of the job, or over ``mesh``'s devices only when given: the async loop
    gathers a sampled batch over the rollout mesh, idle then, while the train devices may still
    run the update (an all-device gather would wait for it). Small host values go through
    :func:`host_allgather` instead."""
    if not is_multiprocess():
        return tree
    if mesh is None:
        mesh = jax.sharding.Mesh(np.array(jax.devices()), ("devices",))
    return jax.tree.map(lambda x: np.concatenate(list(x)), _stack_over(mesh, tree))


def _identity(x: jax.Array) -> jax.Array:
    return x


def _stack_over(mesh: jax.sharding.Mesh, tree: Any) -> Any:
    """Every process's ``tree`` of host arrays stacked in process order (a new leading axis),
    all-gathered over ``mesh``'s devices (each process must have one there)."""
    from jax.sharding import NamedSharding, PartitionSpec

    devices = list(mesh.devices.flat)
    me = jax.process_index()
    flat = jax.sharding.Mesh(np.array(devices), ("devices",))
    first: dict[int, int] = {}  # each process's first device in the mesh
    for i, d in enumerate(devices):
        first.setdefault(d.process_index, i)
    if len(first) != jax.process_count():
        raise ValueError(
            f"gather over a mesh of processes {sorted(first)}: every one of the "
            f"{jax.process_count()} processes needs a device on it"
        )

    def one(x: Any) -> np.ndarray:
        x = np.asarray(x)
        pieces = [jax.device_put(x[None], d) for d in devices if d.process_index == me]
        whole = jax.make_array_from_single_device_arrays(
            (len(devices), *x.shape), NamedSharding(flat, PartitionSpec("devices")), pieces
        )
        out = jax.jit(_identity, out_shardings=NamedSharding(flat, PartitionSpec()))(whole)
        rows = _first_shard(out)
        return rows[[first[p] for p in sorted(first)]]

    return jax.tree.map(one, tree)


# ---------------------------------------------------------------------------------------------
# Host values across processes, without devices.

_KV_PREFIX = "jaxrl_llm/host_allgather"
_KV_BARRIER = _KV_PREFIX + "/barrier"  # one id for every round: the service counts its uses
_WHAT = "__what__"
_kv_lock = threading.Lock()
_kv_rounds = itertools.count()
_kv_last: list[str] = []  # this process's keys of earlier rounds, deleted after a good round


def _kv_client() -> Any:
    """The client of JAX's coordination service (the key-value store and barriers every process
    of a ``jax.distributed`` run shares). JAX keeps it in ``jax._src.distributed``, which is
    private; orbax (``multihost.get_jax_distributed_client``) reads it the same way."""
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is None:
        raise RuntimeError(
            f"host_allgather: {jax.process_count()} processes but no jax.distributed client in "
            "this process; start the run with jaxrl_llm.distributed.initialize (or "
            "jax.distributed.initialize) before anything touches a JAX backend"
        )
    return client


def npz_bytes(**arrays: Any) -> bytes:
    """``arrays`` as one ``.npz`` blob (no pickle): how host values cross processes through
    the coordination service's key-value store."""
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def npz_arrays(blob: bytes) -> dict[str, np.ndarray]:
    """The arrays of an :func:`npz_bytes` blob, by name (object arrays refused)."""
    with np.load(io.BytesIO(blob), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _pack(leaves: list[np.ndarray], what: str) -> bytes:
    return npz_bytes(**{f"arr_{i}": x for i, x in enumerate(leaves)}, **{_WHAT: np.asarray(what)})


def _unpack(blob: bytes, what: str, process: int, n: int) -> list[np.ndarray]:
    z = npz_arrays(blob)
    theirs = str(z[_WHAT])
    if theirs != what:
        raise RuntimeError(
            f"host_allgather({what!r}): process {process} called host_allgather({theirs!r}) "
            "at the same point; every process must make the same calls in the same order"
        )
    leaves = [z[f"arr_{i}"] for i in range(len(z) - 1)]
    if len(leaves) != n:
        raise RuntimeError(
            f"host_allgather({what!r}): process {process} sent {len(leaves)} arrays, this "
            f"process {n}; every process must pass a tree of the same structure"
        )
    return leaves


def host_allgather(tree: Any, *, what: str, tiled: bool = False, timeout_s: float = 1800.0) -> Any:
    """Every process's ``tree`` of host values (numpy arrays, scalars), in process order:
    stacked on a new leading axis (``tiled=False``: shapes must agree), or concatenated along
    axis 0 (``tiled=True``: the other dimensions must agree). The semantics of
    ``multihost_utils.process_allgather`` for host data; one process: its own values so
    shaped.

    The values go through the coordination service's key-value store, not through devices:
    no compiled program, nothing waits for device work in flight, and no collective runs
    beside another program's. Each process publishes one ``.npz`` blob under a key of this
    call's round, waits at the service's barrier, reads the round's folder in one request and
    deletes its key of the round before: 4 requests per process to the coordinator (process
    0's service), ``4·N`` a call for ``N`` processes, where one blocking read per other
    process's key made it ``N·(N+1)`` (``scripts/bench_store_scale.py`` measures both). For
    small data: the store moves ~15 MB/s (two processes on one host: 8 MiB each in 0.4 s, 64
    MiB in 3–4 s), and every process receives every blob, so batches of tokens go over the
    devices (:func:`gather`). Every process must call it, in the same order (like a collective),
    with the same ``what`` (checked) and tree structure. Each process deletes its earlier
    keys at the end of a round that every process reached (so every process has read them):
    the store holds one key per process.

    Raises:
      TimeoutError: a process did not reach the round within ``timeout_s`` (crashed, or took
        another path; the processes that had not published are named).
      RuntimeError: another process was at a different call (``what``) or sent another tree.
      ValueError: the shapes do not stack (or tile) across processes.
    """
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [np.asarray(x) for x in leaves]
    for i, x in enumerate(leaves):
        if x.dtype == object:
            raise ValueError(
                f"host_allgather({what!r}): leaf {i} is an object array; expected numbers, "
                "booleans or strings"
            )
    if not is_multiprocess():
        per_process = [leaves]
    else:
        client, me, count = _kv_client(), jax.process_index(), jax.process_count()
        with _kv_lock:
            r = next(_kv_rounds)
            key = f"{_KV_PREFIX}/{r}/"
            client.key_value_set_bytes(key + str(me), _pack(leaves, what))
            try:
                try:
                    client.wait_at_barrier(_KV_BARRIER, int(timeout_s * 1e3))
                except Exception as e:  # jax raises its runtime error (deadline, a dead task)
                    absent = _unpublished(client, key, count)
                    raise TimeoutError(
                        f"host_allgather({what!r}) round {r}: processes {absent} published "
                        f"nothing within {timeout_s:.0f} s ({e}); every process must make the "
                        "same calls in the same order (did one fail, or take another path?)"
                    ) from e
                blobs = dict(client.key_value_dir_get_bytes(key))
                per_process = [
                    leaves if p == me else _unpack(blobs[key + str(p)], what, p, len(leaves))
                    for p in range(count)
                ]
                for old in _kv_last:  # every process has read it: they all published round r
                    client.key_value_delete(old)
                _kv_last.clear()
            finally:
                _kv_last.append(key + str(me))
    out = []
    for i, parts in enumerate(zip(*per_process, strict=True)):
        shapes = [x.shape[1:] if tiled else x.shape for x in parts]
        if (tiled and any(x.ndim == 0 for x in parts)) or len(set(shapes)) > 1:
            raise ValueError(
                f"host_allgather({what!r}): leaf {i} has shapes "
                f"{[x.shape for x in parts]} on processes 0..{len(parts) - 1}; expected "
                + ("the same shape but for axis 0 (tiled)" if tiled else "the same shape")
            )
        out.append(np.concatenate(parts) if tiled else np.stack(parts))
    return jax.tree.unflatten(treedef, out)


def _unpublished(client: Any, key: str, count: int) -> list[int]:
    """The processes without a key under ``key`` (a round's folder) in the store."""
    try:
        published = {k for k, _ in client.key_value_dir_get_bytes(key)}
    except Exception:  # the service itself is gone: nothing is known
        return list(range(count))
    return [p for p in range(count) if key + str(p) not in published]


def one_collective_program_at_a_time() -> bool:
    """Whether independent programs with cross-process collectives must not be in flight at
    once: several processes on XLA:CPU. XLA:CPU runs programs that do not depend on each other
    concurrently, and gloo matches collectives across processes by order alone, so two such
    programs can meet in a different order on each process: measured here, 40 small
    all-reduce programs dispatched back to back hung two processes, and the checkpoint's 64
    per-array checksum programs hung them in 1 of 2 runs. A GPU or TPU runs each device's
    programs in the order they were enqueued."""
    return jax.process_count() > 1 and jax.default_backend() == "cpu"


def to_host(x: Any) -> np.ndarray:
    """``np.asarray`` that also reads a global array spread over several processes: replicated
    by a compiled all-gather on its own devices, waited for on all of them."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        sharding, everything = x.sharding, jax.sharding.PartitionSpec()
        if isinstance(sharding, jax.sharding.NamedSharding):
            replicated = sharding.update(spec=everything)
        else:  # the same devices in the same order, which jit requires of in and out
            devices = np.array(sharding._device_assignment)
            replicated = jax.sharding.NamedSharding(
                jax.sharding.Mesh(devices, ("devices",)), everything
            )
        return _first_shard(jax.jit(_identity, out_shardings=replicated)(x))
    return np.asarray(x)


__all__ = [
    "COORDINATOR_ENV",
    "NUM_PROCESSES_ENV",
    "PROCESS_ID_ENV",
    "DistributedError",
    "Settings",
    "gather",
    "host_allgather",
    "initialize",
    "is_multiprocess",
    "is_primary",
    "npz_arrays",
    "npz_bytes",
    "one_collective_program_at_a_time",
    "process_rows",
    "put",
    "resolve",
    "to_global",
    "to_host",
    "wait",
]
