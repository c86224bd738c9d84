"""Logical axis names -> mesh axes: how parameters and activations are laid out on devices.

Every parameter carries logical axis names (``Param(..., logical_axes=("embed", "mlp"))``). A
rules table maps each logical name onto zero or more axes of one mesh with the axes
``("data", "fsdp", "tensor")``; names a table does not mention are replicated. The same model
then runs under any preset by changing only the mesh shape and the table:

==========  ==================  ===============================================================
preset      mesh (data,fsdp,tp)  parameters
==========  ==================  ===============================================================
``dp``      ``(n, 1, 1)``        replicated; the batch is split over ``data``
``fsdp``    ``(1, n, 1)``        the ``embed`` axis of every matrix split over ``fsdp`` (ZeRO-3)
``fsdp_tp`` ``(1, n/t, t)``      as fsdp, plus heads / mlp / vocab split over ``tensor``
==========  ==================  ===============================================================

The batch axis of activations always goes over ``("data", "fsdp")``. A dimension that does not
divide its mesh axes (SmolLM2-135M's 9 query heads on ``tensor=2``) is replicated instead, with
a warning, rather than failing: every sharded dimension must divide its mesh axis in XLA.

Use: ``mesh, rules = preset("fsdp")``; ``model = shard_model(model, mesh, rules)`` (or
``from_pretrained(path, mesh=mesh, rules=rules)``); run the jitted step under
``jax.set_mesh(mesh)`` so the activation constraints inside the model apply.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxrl_llm import distributed as dist

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")
Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

BATCH_AXES = ("data", "fsdp")  # the mesh axes a batch is split over, in every preset
_BATCH = (("batch", BATCH_AXES),)
DP_RULES: Rules = _BATCH
FSDP_RULES: Rules = (*_BATCH, ("embed", "fsdp"))
FSDP_TP_RULES: Rules = (
    *FSDP_RULES,
    ("vocab", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
)
# Works on any mesh: an axis of size 1 shards nothing.
DEFAULT_RULES: Rules = FSDP_TP_RULES
PRESETS: dict[str, Rules] = {"dp": DP_RULES, "fsdp": FSDP_RULES, "fsdp_tp": FSDP_TP_RULES}


def make_mesh(
    data: int = 1, fsdp: int = 1, tensor: int = 1, devices: Sequence[Any] | None = None
) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh with Auto axes (jit in/out shardings drive layout).

    One of the sizes may be ``-1``: it takes all remaining devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError("at most one mesh axis size may be -1")
    if -1 in sizes:
        rest = math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = len(devices) // rest
    if math.prod(sizes) != len(devices):
        raise ValueError(
            f"mesh (data={sizes[0]}, fsdp={sizes[1]}, tensor={sizes[2]}) needs "
            f"{math.prod(sizes)} devices, got {len(devices)}"
        )
    grid = np.asarray(devices, dtype=object).reshape(sizes)
    return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def preset(name: str, devices: Sequence[Any] | None = None, tensor: int = 2) -> tuple[Mesh, Rules]:
    """``(mesh, rules)`` for ``dp``, ``fsdp`` or ``fsdp_tp`` over ``devices`` (default: all)."""
    if name not in PRESETS:
        raise ValueError(f"unknown sharding preset {name!r}; choose from {sorted(PRESETS)}")
    if name == "dp":
        mesh = make_mesh(data=-1, devices=devices)
    elif name == "fsdp":
        mesh = make_mesh(fsdp=-1, devices=devices)
    else:
        mesh = make_mesh(fsdp=-1, tensor=tensor, devices=devices)
    return mesh, PRESETS[name]


def _axis_sizes(mesh: Mesh | AbstractMesh) -> dict[str, int]:
    return dict(
        zip(
            mesh.axis_names,
            mesh.axis_sizes if hasattr(mesh, "axis_sizes") else mesh.devices.shape,
            strict=True,
        )
    )


def logical_to_spec(
    axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh | AbstractMesh,
    rules: Rules = DEFAULT_RULES,
    *,
    warn: bool = True,
) -> PartitionSpec:
    """The PartitionSpec for an array of ``shape`` whose dims are named ``axes``.

    A mesh axis is used at most once per array; a dim that does not divide the product of its
    mesh axes is replicated (and logged).
    """
    table = dict(rules)
    sizes = _axis_sizes(mesh)
    used: set[str] = set()
    entries: list[Any] = []
    for name, dim in zip(axes, shape, strict=True):
        target = table.get(name) if name is not None else None
        if target is None:
            entries.append(None)
            continue
        mesh_axes = tuple(
            a
            for a in ((target,) if isinstance(target, str) else target)
            if a in sizes and a not in used
        )
        total = math.prod(sizes[a] for a in mesh_axes)
        if not mesh_axes or total == 1:
            entries.append(None)
            continue
        if dim % total:
            if warn:
                log.warning(
                    "axis %r of size %d does not divide mesh axes %s (size %d); replicating it",
                    name,
                    dim,
                    mesh_axes,
                    total,
                )
            entries.append(None)
            continue
        used.update(mesh_axes)
        entries.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*entries)


def constrain(x: jax.Array, axes: Sequence[str | None], rules: Rules = DEFAULT_RULES) -> jax.Array:
    """``with_sharding_constraint`` by logical names; a no-op unless a mesh is set.

    The mesh comes from ``jax.set_mesh(mesh)`` around the jitted call.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(MESH_AXES) & set(mesh.axis_names):
        return x
    spec = logical_to_spec(axes, x.shape, mesh, rules, warn=False)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _nested(flat: dict[tuple, Any]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def logical_axes(model_or_state: nnx.Module | nnx.State) -> dict:
    """Pure dict (as ``nnx.to_pure_dict``) of every parameter's logical axis names."""
    state = (
        model_or_state
        if isinstance(model_or_state, nnx.State)
        else nnx.state(model_or_state, nnx.Param)
    )
    flat = {}
    for path, var in nnx.to_flat_state(state):
        meta = var.get_metadata()
        if "logical_axes" not in meta:
            raise ValueError(f"parameter {'/'.join(map(str, path))} has no logical_axes")
        flat[tuple(path)] = tuple(meta["logical_axes"])
    return _nested(flat)


def param_specs(
    model_or_state: nnx.Module | nnx.State, mesh: Mesh | AbstractMesh, rules: Rules = DEFAULT_RULES
) -> dict:
    """Pure dict of PartitionSpecs for every parameter of a (possibly abstract) model."""
    state = (
        model_or_state
        if isinstance(model_or_state, nnx.State)
        else nnx.state(model_or_state, nnx.Param)
    )
    flat = {}
    for path, var in nnx.to_flat_state(state):
        axes = var.get_metadata()["logical_axes"]
        flat[tuple(path)] = logical_to_spec(axes, var.get_value().shape, mesh, rules)
    return _nested(flat)


def param_shardings(
    model_or_state: nnx.Module | nnx.State, mesh: Mesh, rules: Rules = DEFAULT_RULES
) -> dict:
    """Pure dict of NamedShardings (for ``jax.jit`` in/out shardings and ``device_put``)."""
    specs = param_specs(model_or_state, mesh, rules)
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, PartitionSpec)
    )


def shard_model(model: nnx.Module, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> nnx.Module:
    """Moves ``model``'s parameters onto ``mesh`` per ``rules`` (in place; returns ``model``)."""
    state = nnx.state(model, nnx.Param)
    shardings = param_shardings(state, mesh, rules)
    values = dist.put(nnx.to_pure_dict(state), shardings)
    nnx.replace_by_pure_dict(state, values)
    nnx.update(model, state)
    return model


def data_parallel_size(mesh: Mesh) -> int:
    """How many ways a batch is split: the product of the mesh's ``data`` and ``fsdp`` sizes."""
    sizes = _axis_sizes(mesh)
    return math.prod(sizes.get(a, 1) for a in BATCH_AXES)


def batch_sharding(mesh: Mesh, rank: int = 2, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    """Sharding for a ``[B, ...]`` batch array: batch over the rules' ``batch`` axes."""
    target = dict(rules).get("batch")
    return NamedSharding(mesh, PartitionSpec(target, *([None] * (rank - 1))))
