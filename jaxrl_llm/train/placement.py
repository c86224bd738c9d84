"""Where the rollout and the update run, and the rollout's verified copy of the policy.

``placement.mode: colocated`` (the default) runs generation and the update on the one mesh of
``mesh:``. ``split`` carves each process's devices (:func:`carve_devices`): its first
``k = rollout_fraction × local`` devices form the rollout mesh (``placement.rollout_mesh``),
the rest the train mesh (``mesh:``), so with ``jax.distributed`` every process takes part in
both (8 devices at 0.25: 2 rollout + 6 train). The two meshes have their own shardings (a
replicated ``dp`` rollout next to an ``fsdp`` update, say).

:class:`RolloutWeights` is the rollout side's copy of the policy. :meth:`RolloutWeights.sync`
moves the trainer's parameters onto the rollout shardings and verifies the copy:

1. transfer: one process: ``jax.device_put(params, rollout_shardings)``, which reshards device
   to device (no gather on one device or the host). Several processes: jax 0.10 refuses a
   ``device_put`` between two disjoint device sets that span the same processes ("For a
   cross-host reshard in multi-controller JAX, input and target sharding should have the same
   set of devices"; its cross-host transfers are TPU-only and need different process sets), so
   :func:`transfer` does it in two steps: a jitted reshard *on the train mesh* (collectives
   there work) to a layout in which every process's train devices hold what its rollout
   devices need, then local device-to-device copies on each process assembled with
   ``jax.make_array_from_single_device_arrays`` (see docs/placement.md).
2. verification: the layout-independent checksums of :mod:`jaxrl_llm.train.checksums`
   (``[Σ w_i, Σ w_i·(i+1)] mod 2**32`` over each array's bit words), computed under jit where
   each array lies (the trainer's on the train mesh, the copy's on the rollout mesh), must be
   equal, and every copied array must sit on the rollout shardings (colocated: in buffers of
   its own). A difference raises :class:`WeightSyncError` naming the arrays; the copy and its
   version are then left as they were. A version that does not increase is an error too: a
   sync that did not happen is never silent (TRL #5312 is the failure this guards against).

Under LoRA only the adapters (the TrainState's ``params``) move at each sync; the frozen base
is copied to the rollout mesh once, when the :class:`RolloutWeights` is built with ``params``
(a shape template) or else at its first sync, and checked then. ``colocated`` gives the
same interface: :meth:`RolloutWeights.sync` then makes a jitted copy on the same shardings, so
the rollout's copy survives the update's donated buffers (an asynchronous loop samples from
version ``v`` while the update makes ``v + 1``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm import distributed as dist
from jaxrl_llm.models import sharding as shd
from jaxrl_llm.train import checksums

COLOCATED = "colocated"
SPLIT = "split"
NO_VERSION = -1  # the version of a RolloutWeights before its first sync


class WeightSyncError(RuntimeError):
    """A weight sync that did not happen as asked: a copied array differs from the trainer's
    (checksum), is not on the rollout's devices, or the version did not increase."""


# ---------------------------------------------------------------------------------------------
# Carving the devices.


def _by_process(devices: Sequence[Any], process_count: int) -> list[list[Any]]:
    """``devices`` as one list per process, in process order.

    Devices of ``process_count`` distinct processes are grouped by ``process_index``; devices
    of one process with ``process_count > 1`` (a simulation on fake CPU devices) are cut into
    ``process_count`` contiguous blocks, as ``jax.devices()`` lists them process by process.
    """
    indices = sorted({d.process_index for d in devices})
    if len(indices) == process_count:
        return [[d for d in devices if d.process_index == p] for p in indices]
    if len(indices) == 1 and len(devices) % process_count == 0:
        local = len(devices) // process_count
        return [list(devices[i * local : (i + 1) * local]) for i in range(process_count)]
    raise ValueError(
        f"carve_devices: {len(devices)} devices of processes {indices} cannot be split into "
        f"{process_count} processes' equal shares"
    )


def carve_devices(
    devices: Sequence[Any], fraction: float, process_count: int | None = None
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``(rollout_devices, train_devices)``: per process, its first ``k = fraction × local``
    devices go to the rollout and the other ``local - k`` to training.

    Both tuples are in process order (process 0's devices first), so a mesh built from either
    holds each process's devices together along its leading axis and spans every process.

    Args:
      devices: every device of the run, in ``jax.devices()`` order.
      fraction: the rollout's share, ``0 < fraction < 1``; ``fraction × local`` must be a
        whole number in ``[1, local - 1]`` (``local``: devices per process).
      process_count: processes (default ``jax.process_count()``); on one process's fake
        devices a larger count simulates the carving of a multi-process run.

    Raises:
      ValueError: the fraction or the device counts do not give each side a whole, non-empty
        share on every process (the config's check, ``check_devices``, says it first).
    """
    devices = list(devices)
    process_count = jax.process_count() if process_count is None else int(process_count)
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"carve_devices: fraction = {fraction!r}: expected 0 < fraction < 1")
    groups = _by_process(devices, process_count)
    local = len(groups[0])
    if any(len(g) != local for g in groups):
        raise ValueError(
            f"carve_devices: processes hold {[len(g) for g in groups]} devices; expected the "
            "same number on each"
        )
    share = fraction * local
    k = round(share)
    if abs(share - k) > 1e-6 or not 1 <= k <= local - 1:
        raise ValueError(
            f"carve_devices: fraction = {fraction!r} of {local} devices per process is "
            f"{share:g}: expected a whole number of rollout devices in [1, {local - 1}]"
        )
    rollout = tuple(d for g in groups for d in g[:k])
    train = tuple(d for g in groups for d in g[k:])
    return rollout, train


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """Where the rollout runs.

    Attributes:
      mode: ``"colocated"`` or ``"split"``.
      rollout_mesh: the mesh the rollout samples on (colocated: the train mesh).
      rollout_rules: its logical-axis rules (colocated: the train rules).
      train_devices: the devices of the train side (colocated: the train mesh's).
      rollout_devices: those of the rollout mesh (colocated: the same).
    """

    mode: str
    rollout_mesh: Mesh
    rollout_rules: shd.Rules
    train_devices: tuple[Any, ...]
    rollout_devices: tuple[Any, ...]

    def __post_init__(self) -> None:
        if self.mode not in (COLOCATED, SPLIT):
            raise ValueError(f"Placement: mode = {self.mode!r}: expected 'colocated' or 'split'")
        if self.mode == SPLIT and set(self.train_devices) & set(self.rollout_devices):
            shared = sorted(d.id for d in set(self.train_devices) & set(self.rollout_devices))
            raise ValueError(f"Placement: split with devices {shared} on both sides")

    @property
    def split(self) -> bool:
        return self.mode == SPLIT

    @classmethod
    def colocated(cls, mesh: Mesh, rules: shd.Rules) -> Placement:
        """Rollout and update on ``mesh`` (today's behaviour)."""
        devices = tuple(mesh.devices.flat)
        return cls(COLOCATED, mesh, rules, devices, devices)


def split_placement(
    devices: Sequence[Any],
    *,
    fraction: float,
    rollout_sizes: dict[str, int],
    rollout_rules: shd.Rules,
    process_count: int | None = None,
) -> Placement:
    """A split :class:`Placement`: :func:`carve_devices`, then the rollout mesh of axis
    ``rollout_sizes`` (``data``/``fsdp``/``tensor``, resolved, their product dividing the
    rollout devices; a smaller mesh takes the first of them, process by process)."""
    rollout, train = carve_devices(devices, fraction, process_count)
    n = int(np.prod(list(rollout_sizes.values())))
    if len(rollout) % n:
        raise ValueError(
            f"split_placement: rollout mesh {rollout_sizes} needs a divisor of the "
            f"{len(rollout)} rollout devices"
        )
    mesh = shd.make_mesh(**rollout_sizes, devices=rollout[:n])
    return Placement(SPLIT, mesh, rollout_rules, train, rollout)


# ---------------------------------------------------------------------------------------------
# Moving arrays between disjoint device sets.


def _contains(outer: tuple[slice, ...], inner: tuple[slice, ...], shape: tuple[int, ...]) -> bool:
    for o, i, n in zip(outer, inner, shape, strict=True):
        o0, o1, _ = o.indices(n)
        i0, i1, _ = i.indices(n)
        if not (o0 <= i0 and i1 <= o1):
            return False
    return True


def _local_plan(
    src: jax.sharding.Sharding, dst: jax.sharding.Sharding, shape: tuple[int, ...]
) -> bool:
    """Whether every process's ``dst`` shards lie inside a ``src`` shard of the same process
    (decided from the global device maps, so every process decides the same)."""
    src_map = src.devices_indices_map(shape)
    dst_map = dst.devices_indices_map(shape)
    by_process: dict[int, list[tuple[slice, ...]]] = {}
    for d, idx in src_map.items():
        by_process.setdefault(d.process_index, []).append(idx)
    return all(
        any(_contains(s, idx, shape) for s in by_process.get(d.process_index, ()))
        for d, idx in dst_map.items()
    )


def _staging(x: jax.Array, dst: NamedSharding) -> jax.sharding.Sharding:
    """A sharding on ``x``'s devices from which every process can fill its own ``dst`` shards:
    ``x``'s own, else ``dst``'s spec on ``x``'s mesh, else replicated (the fallback: each
    train device then holds the whole array for a moment, as a replicated rollout does)."""
    shape = tuple(x.shape)
    if _local_plan(x.sharding, dst, shape):
        return x.sharding
    if not isinstance(x.sharding, NamedSharding):
        raise TypeError(
            f"transfer: a multi-process array of shape {shape} must have a NamedSharding, got "
            f"{type(x.sharding).__name__}"
        )
    mesh = x.sharding.mesh
    try:
        same_spec = NamedSharding(mesh, dst.spec)
        same_spec.shard_shape(shape)
        if _local_plan(same_spec, dst, shape):
            return same_spec
    except (ValueError, KeyError):  # the spec names an axis the mesh lacks, or does not divide
        pass
    return NamedSharding(mesh, PartitionSpec())


def _identity(x: jax.Array) -> jax.Array:
    return x


@functools.cache
def _reshard(stage: NamedSharding) -> Any:
    """The jitted reshard onto ``stage``, one per staging sharding (not a new jit object, and
    a new trace, for every array of every sync)."""
    return jax.jit(_identity, out_shardings=stage)


def _local_copy(x: jax.Array, dst: NamedSharding) -> jax.Array:
    """``x`` on ``dst`` from this process's own shards of ``x`` (device-to-device copies of
    the slices each ``dst`` shard needs), assembled into the global array."""
    shape = tuple(x.shape)
    pieces = []
    for device, idx in dst.addressable_devices_indices_map(shape).items():
        for shard in x.addressable_shards:
            if _contains(shard.index, idx, shape):
                rel = tuple(
                    slice(i.indices(n)[0] - s.indices(n)[0], i.indices(n)[1] - s.indices(n)[0])
                    for s, i, n in zip(shard.index, idx, shape, strict=True)
                )
                full = all(r == slice(0, m) for r, m in zip(rel, shard.data.shape, strict=True))
                if full:
                    piece = shard.data
                else:  # sliced where the shard lies (its own one-device mesh as context)
                    with jax.set_mesh(Mesh(np.asarray([shard.device]), ("shard",))):
                        piece = shard.data[rel]
                pieces.append(jax.device_put(piece, device))
                break
        else:  # _staging guarantees a shard; this is a bug, not bad input
            raise AssertionError(f"no local shard of {shape} holds {idx} for {device}")
    return jax.make_array_from_single_device_arrays(shape, dst, pieces)


def transfer(tree: Any, shardings: Any) -> Any:
    """``tree``'s arrays on ``shardings`` (a matching tree of NamedShardings), copied.

    The source and target device sets are disjoint (split placement; on one device set
    use a jitted copy). One process: ``jax.device_put`` (device to device). Several
    processes, where that refuses disjoint device sets: per array a jitted reshard on its own
    devices to a
    :func:`_staging` layout (often none is needed: a replicated or same-spec source), then
    per-process local copies (:func:`_local_copy`). No array is gathered on one device or on
    the host unless the target itself replicates it.
    """
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    leaves, treedef = jax.tree.flatten(tree)
    targets = treedef.flatten_up_to(shardings)
    out = []
    for x, dst in zip(leaves, targets, strict=True):
        stage = _staging(x, dst)
        if stage != x.sharding:
            with jax.set_mesh(stage.mesh):
                x = _reshard(stage)(x)
            if dist.one_collective_program_at_a_time():  # before the next leaf's reshard
                x = jax.block_until_ready(x)
        out.append(_local_copy(x, dst))
    return jax.tree.unflatten(treedef, out)


def _copy_tree(tree: Any) -> Any:
    return jax.tree.map(jnp.copy, tree)


def _copy(tree: Any) -> Any:
    """A copy of every array on its own sharding (exactly), in new buffers: a jitted
    ``jnp.copy`` (``device_put`` onto the same sharding may return the very same buffers)."""
    shardings = jax.tree.map(lambda x: x.sharding, tree)
    return jax.jit(_copy_tree, out_shardings=shardings)(tree)


# ---------------------------------------------------------------------------------------------
# Verification.


def _named(tree: Any) -> dict[str, jax.Array]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {
        "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): leaf
        for path, leaf in flat
    }


@jax.jit
def _tree_checksums(tree: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Every array's ``uint32[2]`` checksum (:func:`jaxrl_llm.train.checksums.array_checksum`)
    in one program, each reduced where its array lies."""
    return {name: checksums.array_checksum(x) for name, x in tree.items()}


def _own_mesh(tree: Any) -> Any:
    """``jax.set_mesh`` of the mesh ``tree``'s arrays lie on (so that a caller's context mesh,
    e.g. the train mesh's, does not clash with the rollout's arrays); a no-op without one."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return jax.set_mesh(sharding.mesh)
    return contextlib.nullcontext()


def tree_checksums(tree: Any) -> dict[str, tuple[int, int]]:
    """``{name: (plain, weighted)}`` of every array of ``tree`` (names: the leaf paths joined
    by ``/``), computed on the arrays' own devices (under their own mesh); one host read. A
    collective under several processes (every process passes the same global arrays)."""
    named = _named(tree)
    with _own_mesh(named):
        sums = jax.device_get(dist.wait(_tree_checksums(named)))
    return {name: (int(s[0]), int(s[1])) for name, s in sums.items()}


def _describe(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _pointers(x: jax.Array) -> set[int]:
    return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


def verify_copy(
    source: Any, copy: Any, shardings: Any, *, what: str, expected: dict | None = None
) -> dict[str, tuple[int, int]]:
    """Checks that ``copy`` holds ``source``'s bits on ``shardings``, in buffers of its own.

    Returns the copy's checksums. ``expected``: the source's checksums when already known.

    Raises:
      WeightSyncError: naming the arrays whose checksum differs, that are not on their target
        sharding's devices, or that share a buffer with ``source``; ``what`` says which sync.
    """
    src, dst, targets = _named(source), _named(copy), _named(shardings)
    if sorted(src) != sorted(dst):
        missing = sorted(set(src) ^ set(dst))
        raise WeightSyncError(f"{what}: the copy's arrays differ from the trainer's: {missing}")
    misplaced = [
        n
        for n, x in dst.items()
        if not isinstance(x, jax.Array) or x.sharding.device_set != targets[n].device_set
    ]
    if not misplaced:
        misplaced = [n for n, x in dst.items() if x is src[n] or _pointers(x) & _pointers(src[n])]
    if misplaced:
        raise WeightSyncError(
            f"{what}: {len(misplaced)} of {len(dst)} arrays are not copies on the rollout's "
            f"devices ({_describe(misplaced)}): the transfer did not happen"
        )
    want = tree_checksums(source) if expected is None else expected
    got = tree_checksums(copy)
    bad = [n for n in want if got.get(n) != want[n]]
    if bad:
        raise WeightSyncError(
            f"{what}: {len(bad)} of {len(want)} arrays differ from the trainer's after the "
            f"transfer (checksum; {_describe(bad)}); the rollout keeps its previous weights"
        )
    return got


# ---------------------------------------------------------------------------------------------
# The rollout's copy of the policy.


@dataclasses.dataclass(frozen=True)
class SyncReport:
    """One sync: the version now on the rollout side, the seconds it took (transfer and
    verification, until ready), the bytes and the number of arrays moved."""

    version: int
    seconds: float
    bytes: int
    num_arrays: int

    def metrics(self, prefix: str = "sync/") -> dict[str, float]:
        return {
            f"{prefix}seconds": self.seconds,
            f"{prefix}bytes": float(self.bytes),
            f"{prefix}arrays": float(self.num_arrays),
            f"{prefix}version": float(self.version),
        }


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def rollout_shardings(
    models: Any, params: Any, mesh: Mesh, rules: shd.Rules
) -> tuple[dict, dict | None]:
    """``(params, frozen)`` shardings of the policy on ``mesh`` under ``rules``, from the
    parameters' logical axes (kept in ``models.graphdef``); ``params``: the TrainState's
    (arrays or ``jax.ShapeDtypeStruct``s: only shapes are read); ``frozen`` is None without
    LoRA."""
    from jaxrl_llm.models import lora

    abstract = _abstract(params)
    if models.frozen is not None:
        abstract = lora.combine(_abstract(models.frozen), abstract)
    module = nnx.merge(models.graphdef, abstract)
    if models.frozen is None:
        return shd.param_shardings(nnx.state(module, nnx.Param), mesh, rules), None
    frozen_state, trainable_state = lora.split_states(module, lora.trainable_filter(None))
    return (
        shd.param_shardings(trainable_state, mesh, rules),
        shd.param_shardings(frozen_state, mesh, rules),
    )


class RolloutWeights:
    """The rollout side's copy of the policy, versioned and verified (module docstring).

    Build with :meth:`build` (from a :class:`Placement`), :meth:`colocated` or :meth:`split`;
    then ``report = weights.sync(state.params, version)`` after each update (the first sync
    may be of any version ≥ 0) and ``graphdef, params = weights.sampling_policy()`` for the
    sampler.

    Args:
      models: the run's :class:`~jaxrl_llm.train.setup.Models` (the train side).
      placement: where the copy lives.
      params: split only, optional: the TrainState's ``params`` (arrays or
        ``jax.ShapeDtypeStruct``s) whose shapes give the rollout shardings now, and under
        LoRA copy the frozen base now; without it both happen at the first :meth:`sync`.

    Attributes:
      placement, mesh: where the copy lives (``mesh``: the rollout mesh).
      shardings: the copy's shardings (of the TrainState ``params``: the adapters under LoRA;
        None until known, split without ``params``).
      frozen: under LoRA, the frozen base on the rollout mesh (split: copied once and
        verified; colocated: the train side's own, which no update donates); else None.
      params: the synced copy (None before the first sync).
      version: the version of ``params`` (:data:`NO_VERSION` before the first sync).
      last_report: the last sync's :class:`SyncReport`.
      frozen_report: split LoRA: the frozen base's one copy (version :data:`NO_VERSION`).
    """

    def __init__(self, models: Any, placement: Placement, params: Any = None) -> None:
        self.models = models
        self.placement = placement
        self.mesh = placement.rollout_mesh
        self.params: dict | None = None
        self.version = NO_VERSION
        self.last_report: SyncReport | None = None
        self.frozen_report: SyncReport | None = None
        self._merged: tuple[int, dict] | None = None
        self.shardings: Any = None
        self.frozen: dict | None = None
        if not placement.split:
            self.shardings = models.state_sharding.params
            self.frozen = models.frozen
        elif params is not None:
            self._place(params)

    def _place(self, params: Any) -> None:
        """Split: the rollout shardings of ``params``' shapes; under LoRA the frozen base's
        one verified copy."""
        m = self.models
        self.shardings, frozen_sh = rollout_shardings(
            m, params, self.placement.rollout_mesh, self.placement.rollout_rules
        )
        if m.frozen is not None:
            t0 = time.perf_counter()
            frozen = jax.block_until_ready(transfer(m.frozen, frozen_sh))
            verify_copy(m.frozen, frozen, frozen_sh, what="the frozen base's copy")
            self.frozen = frozen
            self.frozen_report = SyncReport(NO_VERSION, time.perf_counter() - t0, *_size(frozen))

    @classmethod
    def build(
        cls, models: Any, placement: Placement | None = None, params: Any = None
    ) -> RolloutWeights:
        """On ``placement`` (default: colocated on ``models.mesh``)."""
        return cls(models, placement or Placement.colocated(models.mesh, models.rules), params)

    @classmethod
    def colocated(cls, models: Any) -> RolloutWeights:
        """On the train mesh itself; :meth:`sync` makes a copy in new buffers."""
        return cls(models, Placement.colocated(models.mesh, models.rules))

    @classmethod
    def split(cls, models: Any, placement: Placement, params: Any = None) -> RolloutWeights:
        """On a split ``placement``'s rollout mesh."""
        if not placement.split:
            raise ValueError("RolloutWeights.split: the placement is colocated")
        return cls(models, placement, params)

    def sync(self, params: dict, version: int) -> SyncReport:
        """Copies the trainer's ``params`` (the TrainState's: the adapters under LoRA) onto the
        rollout shardings as ``version``, and verifies the copy (module docstring).

        ``seconds`` covers the trainer's checksums, the transfer and the copy's checksums,
        until all are ready. Call it before anything donates ``params``.

        Raises:
          WeightSyncError: ``version`` is not above the current one, or the copy is wrong
            (checksum, devices, shared buffers); the previous copy and version are kept.
        """
        if isinstance(version, bool) or not isinstance(version, int | np.integer):
            raise TypeError(f"RolloutWeights.sync: version must be an int, got {version!r}")
        version = int(version)
        if version <= self.version:
            raise WeightSyncError(
                f"weight sync to version {version}: expected a version above the rollout "
                f"copy's {self.version} (each policy version is synced once, in increasing "
                "order)"
            )
        if self.shardings is None:
            self._place(params)
        t0 = time.perf_counter()
        expected = tree_checksums(params)  # on the train mesh
        if self.placement.split:
            copy = transfer(params, self.shardings)
        else:
            with _own_mesh(params):
                copy = _copy(params)
        copy = jax.block_until_ready(copy)
        verify_copy(
            params,
            copy,
            self.shardings,
            what=f"weight sync to version {version}",
            expected=expected,
        )
        self.params, self.version, self._merged = copy, version, None
        self.last_report = SyncReport(version, time.perf_counter() - t0, *_size(copy))
        return self.last_report

    def sampling_policy(self) -> tuple[nnx.GraphDef, dict]:
        """``(graphdef, parameters)`` the sampler runs, on the rollout mesh: as
        ``Models.sampling_policy`` of the synced copy (LoRA: the base's graph with the
        adapters merged in when ``merge_for_sampling``, once per version; else the adapters on
        the frozen base, unmerged).

        Raises:
          WeightSyncError: nothing has been synced yet.
        """
        if self.params is None:
            raise WeightSyncError(
                "RolloutWeights.sampling_policy: no weights synced yet; call "
                "sync(params, version) first"
            )
        m = self.models
        if m.frozen is None:
            return m.graphdef, self.params
        from jaxrl_llm.models import lora

        if not m.merge_for_sampling:
            return m.graphdef, lora.combine(self.frozen, self.params)
        if self._merged is None or self._merged[0] != self.version:
            with _own_mesh(self.params):
                merged = lora.merged_params(m.graphdef, self.frozen, self.params)
            self._merged = (self.version, merged)
        return m.ref_graphdef, self._merged[1]


def _size(tree: Any) -> tuple[int, int]:
    leaves = jax.tree.leaves(tree)
    return sum(int(x.nbytes) for x in leaves), len(leaves)


__all__ = [
    "COLOCATED",
    "NO_VERSION",
    "SPLIT",
    "Placement",
    "RolloutWeights",
    "SyncReport",
    "WeightSyncError",
    "carve_devices",
    "rollout_shardings",
    "split_placement",
    "transfer",
    "tree_checksums",
    "verify_copy",
]
