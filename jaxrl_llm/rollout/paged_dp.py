"""Data-parallel paged engines: one scheduler, page pool and allocator per data shard.

On a mesh whose batch axes (``data`` × ``fsdp``,
:func:`~jaxrl_llm.models.sharding.data_parallel_size`) have size ``D > 1``,
``generate(engine="paged")`` runs ``D`` independent paged engines (``paged.run``), one per data
shard, as vLLM's data-parallel deployment runs one engine per replica: the prompts are cut into
``D`` contiguous shards by prompt (the G samples of a prompt stay together; with ``B`` not a
multiple of ``D`` the first ``B mod D`` shards get one prompt more, and a shard with no prompt
runs nothing), shard ``d`` runs on the sub-mesh of the devices of data shard ``d`` (the mesh
with its batch axes cut to that one coordinate, every other axis kept: weights
tensor-parallel within the shard, replicated across shards), and the outputs are put back in
prompt order. On a one-device sub-mesh (a pure ``data`` mesh) an engine may use the
accelerator attention kernels, which refuse a mesh of several devices. With
``PagedOptions.work_stealing`` (the default) a shard is where an engine starts: an engine out
of prompts takes the prompts another engine, of the process or of another process, has
waiting for room (:mod:`~jaxrl_llm.rollout.stealing`); the outputs are put back in prompt
order all the same.

Equal tokens. Sample ``g`` of the batch's prompt ``b`` keeps its global sequence id
``b·G + g`` (``paged.run(seq_ids_bg=)``), so its token ``t`` is drawn with
``fold_in(fold_in(rng, b·G + g), t)`` whatever shard, slot or neighbours it gets: the tokens
equal the one-device run's, the log-probs up to float rounding (the tensor-parallel matmuls sum
in another order).

Concurrency. The ``D`` host schedulers run in ``D`` threads. Each visits the host once per
decode dispatch (``steps_per_dispatch`` tokens); JAX's dispatch, XLA's compilation and the
waits for device results release the GIL, so the shards' device work overlaps and only the
schedulers' Python (page tables, bookkeeping) is serialised.

Weights. The parameters are moved once per call (not cached: an RL loop passes new weights at
every step, and a cached copy would stay resident through the update): each leaf is resharded
on its own mesh to its spec without the batch axes (``jax.device_put``: nothing happens when
the weights are already replicated over the batch axes, as with the ``dp`` preset; an
all-gather over ``fsdp`` otherwise, the same bytes one FSDP forward gathers, against a rollout
that reads the weights in every decode step), then each shard's arrays are assembled from the
device buffers its own devices already hold (``jax.make_array_from_single_device_arrays``, no
copy). Each pool is created on its shard's first device (``jax.default_device``), not on
device 0.

Multi-process (``jax.process_count() > 1``): as the static engine's contract in
``generate``, each process passes its own rows of the global batch (contiguous, in process
order; here any number of rows, not necessarily the same on every process, none included:
such a process still takes part in the weights' reshard and the exchange below) and gets
back theirs. It runs the engines of the data shards whose devices are all its own (its rows split
over them as above) with the global sequence ids (its rows' offset in the global batch comes
from an exchange of the row counts through the coordination service,
:func:`~jaxrl_llm.distributed.host_allgather`, which no device work in flight delays). With
work stealing, prompts waiting for room are lent to the other processes' engines through the
same service's key-value store and their outputs come back the same way
(:class:`~jaxrl_llm.rollout.stealing.Lending`); no other cross-process traffic but the
weights' reshard. A data
shard whose devices span processes is refused (a clear error): its engine would need one
scheduler driving two processes.

Stats (:class:`DataParallelStats`): the shards' :class:`~jaxrl_llm.rollout.paged.PagedStats`
summed (peak KV: the sum of the pools' peaks; dispatches and prefills: the sums; pages held
at the end: the sum, 0 when every pool got all its pages back), and each shard's own in
``shards``. Multi-process: this process's shards only.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm import distributed as dist
from jaxrl_llm.models import sharding
from jaxrl_llm.rollout import paged, stealing

Params = dict[str, Any]

_LENDING_PREFIX = "jaxrl_llm/paged_lending"
_lending_last: list[str] = []  # the namespace of this process's previous call


def _forget_lending(namespace: str) -> None:
    """Deletes the previous call's lending keys (process 0, once every process has reached
    this call's exchange, so none reads them any more) and remembers ``namespace``."""
    if _lending_last and jax.process_index() == 0:
        dist._kv_client().key_value_delete(_lending_last[0] + "/")
    _lending_last[:] = [namespace]


class DataParallelStats(paged.PagedStats):
    """:class:`~jaxrl_llm.rollout.paged.PagedStats` summed over the data shards (the fields'
    meaning as there; ``peak_pages``: the sum of the shards' peaks), with ``shards``: each
    shard's own stats, in shard order (``None`` for a shard that had no prompt)."""

    shards: tuple[paged.PagedStats | None, ...]

    @classmethod
    def combine(cls, shards: Sequence[paged.PagedStats | None]) -> DataParallelStats:
        ran = [s for s in shards if s is not None]
        out = cls(
            peak_pages=sum(s.peak_pages for s in ran),
            page_bytes=ran[0].page_bytes if ran else 0,
            decode_dispatches=sum(s.decode_dispatches for s in ran),
            prefill_calls=sum(s.prefill_calls for s in ran),
            pages_in_use_at_end=sum(s.pages_in_use_at_end for s in ran),
            preemptions=sum(s.preemptions for s in ran),
            pool_pages=sum(s.pool_pages for s in ran),
            prefill_tokens=sum(s.prefill_tokens for s in ran),
            shared_prompt_tokens=sum(s.shared_prompt_tokens for s in ran),
            decode_steps=sum(s.decode_steps for s in ran),
            prompts_stolen=sum(s.prompts_stolen for s in ran),
        )
        out.shards = tuple(shards)
        return out


def is_data_parallel(mesh: Mesh | None) -> bool:
    """Whether ``generate(engine="paged")`` runs one engine per data shard on ``mesh``."""
    return mesh is not None and sharding.data_parallel_size(mesh) > 1


def _batch_axes(mesh: Mesh) -> list[str]:
    return [a for a in sharding.BATCH_AXES if a in mesh.axis_names]


def data_shard_meshes(mesh: Mesh) -> list[Mesh]:
    """The sub-mesh of each data shard, in batch order (shard ``d`` holds rows ``d`` of a
    ``PartitionSpec(("data", "fsdp"))`` batch: ``d = data_index · fsdp + fsdp_index``).

    Each keeps every axis of ``mesh``, the batch axes with size 1, so the parameters' specs
    and the model's sharding constraints apply unchanged."""
    names = list(mesh.axis_names)
    axes = _batch_axes(mesh)
    out = []
    for coords in np.ndindex(*(mesh.shape[a] for a in axes)):
        index = [slice(None)] * len(names)
        for a, c in zip(axes, coords, strict=True):
            index[names.index(a)] = slice(c, c + 1)
        out.append(Mesh(mesh.devices[tuple(index)], mesh.axis_names, axis_types=mesh.axis_types))
    return out


def _without_batch_axes(spec: PartitionSpec, mesh: Mesh) -> PartitionSpec:
    axes = set(_batch_axes(mesh))

    def keep(entry: Any) -> Any:
        if entry is None:
            return None
        names = (entry,) if isinstance(entry, str) else tuple(entry)
        kept = tuple(n for n in names if n not in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return PartitionSpec(*(keep(e) for e in spec))


def shard_params(params: Any, mesh: Mesh, shards: Sequence[Mesh]) -> list[Any]:
    """``params`` on each of ``shards`` (sub-meshes of ``mesh``, :func:`data_shard_meshes`),
    each leaf with its spec minus the batch axes (module docstring: one reshard on ``mesh``
    where a leaf is split over a batch axis, then no copy). Leaves not on ``mesh`` are
    replicated onto each shard (this process's own arrays only)."""
    leaves, treedef = jax.tree.flatten(params)
    on_mesh = [
        isinstance(x, jax.Array)
        and isinstance(x.sharding, NamedSharding)
        and x.sharding.mesh == mesh
        for x in leaves
    ]
    targets = [
        NamedSharding(mesh, _without_batch_axes(x.sharding.spec, mesh)) if ok else None
        for x, ok in zip(leaves, on_mesh, strict=True)
    ]
    moving = [i for i, t in enumerate(targets) if t is not None and leaves[i].sharding != t]
    if moving:  # one reshard of every leaf split over a batch axis (a collective)
        moved = dist.put([leaves[i] for i in moving], [targets[i] for i in moving])
        for i, x in zip(moving, moved, strict=True):
            leaves[i] = x
    for i, (x, ok) in enumerate(zip(leaves, on_mesh, strict=True)):
        if not ok and isinstance(x, jax.Array) and not x.is_fully_addressable:
            raise ValueError(
                f"generate(engine='paged'): parameter leaf {i} (shape {x.shape}) spans "
                f"processes on a sharding other than the parameters' mesh "
                f"{dict(mesh.shape)}; put every parameter on that mesh"
            )
    out = []
    for sub in shards:
        local = []
        for x, t in zip(leaves, targets, strict=True):
            if t is None:
                local.append(jax.device_put(x, NamedSharding(sub, PartitionSpec())))
                continue
            by_device = {s.device: s.data for s in x.addressable_shards}
            pieces = [by_device[d] for d in sub.devices.flat]
            local.append(
                jax.make_array_from_single_device_arrays(
                    x.shape, NamedSharding(sub, t.spec), pieces
                )
            )
        out.append(jax.tree.unflatten(treedef, local))
    return out


def abstract_shard_params(params: Params, mesh: Mesh, shard: Mesh) -> Params:
    """:func:`shard_params` in shapes: the abstract ``params`` (``jax.ShapeDtypeStruct``s on
    ``mesh``) as one data shard's engine gets them on ``shard`` (each leaf's spec without the
    batch axes; a leaf not on ``mesh``, replicated). For ``jaxrl-llm plan``."""

    def one(x: Any) -> jax.ShapeDtypeStruct:
        s = getattr(x, "sharding", None)
        spec = PartitionSpec()
        if isinstance(s, NamedSharding) and s.mesh == mesh:
            spec = _without_batch_axes(s.spec, mesh)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(shard, spec))

    return jax.tree.map(one, params)


def regroup_mesh(mesh: Mesh, tensor_parallel: int) -> Mesh:
    """``mesh``'s devices regrouped for engines of ``tensor_parallel`` devices each: a
    ``(data, fsdp, tensor) = (n / t, 1, t)`` mesh over the same ``n`` devices, engine ``d``
    on the ``t`` consecutive devices ``d·t .. d·t + t - 1`` of ``mesh``'s order (process by
    process, stably, so a group stays in one process where the layout allows; a train mesh's
    ``tensor`` neighbours are consecutive in it).

    Raises:
      ValueError: ``tensor_parallel`` is not a divisor of the device count, or does not
        divide each process's devices (a group would span processes).
    """
    devices = sorted(mesh.devices.flat, key=lambda d: d.process_index)
    n, t = len(devices), tensor_parallel
    if isinstance(t, bool) or not isinstance(t, int) or t < 1 or n % t:
        raise ValueError(
            f"generate(engine='paged'): tensor_parallel must be an int >= 1 dividing the "
            f"parameters' mesh's {n} devices, got {t!r}"
        )
    for d in range(n // t):
        group = devices[d * t : (d + 1) * t]
        if len({dev.process_index for dev in group}) > 1:
            raise ValueError(
                f"generate(engine='paged'): tensor_parallel={t} puts engine {d} on devices "
                f"{[dev.id for dev in group]} of processes "
                f"{sorted({dev.process_index for dev in group})}; an engine's devices must "
                "belong to one process (give a tensor_parallel dividing each process's devices)"
            )
    grid = np.asarray(devices, dtype=object).reshape(n // t, 1, t)
    return Mesh(grid, sharding.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def _is_axes(x: Any) -> bool:
    """A leaf's logical axis names (a tuple of names), not a node of the tree."""
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def _engine_axes(lm: nnx.Module, num_layers: int) -> paged.EngineParams:
    """The logical axis names of each leaf of the engine's weights (the model ``lm``'s
    metadata), as an :class:`~jaxrl_llm.rollout.paged.EngineParams` of tuples: a layer
    slice's are its stacked leaf's without the first (layer) axis."""
    axes = sharding.logical_axes(lm)
    one = jax.tree.map(lambda a: a[1:], axes["model"]["layers"], is_leaf=_is_axes)
    return paged.EngineParams(paged.without_layers(axes), (one,) * num_layers)


def _tensor_specs(
    graphdef: nnx.GraphDef, params: paged.EngineParams, rmesh: Mesh
) -> list[PartitionSpec]:
    """Each leaf's spec on a :func:`regroup_mesh` mesh: heads, MLP and vocabulary split over
    ``tensor`` (``models.sharding.FSDP_TP_RULES``, the batch axes of size 1 there), a dim the
    axis does not divide replicated (quietly: a quantized base's block scales have such dims;
    heads that do not divide get one warning, as the engine's attention then runs whole)."""
    lm = nnx.merge(graphdef, paged.stacked_shapes(params))  # shapes only: config, metadata
    cfg, t = lm.config, rmesh.shape["tensor"]
    if cfg.num_heads % t or cfg.num_kv_heads % t:
        warnings.warn(
            f"generate(engine='paged'): tensor_parallel={t} does not divide the model's "
            f"{cfg.num_heads} query / {cfg.num_kv_heads} KV heads; the projections of the "
            "heads it does not divide stay whole on each engine's device (the MLP and "
            "vocabulary still split; the attention kernels fall back to the reference)",
            stacklevel=3,
        )
    axes = jax.tree.leaves(_engine_axes(lm, len(params.layers)), is_leaf=_is_axes)
    return [
        sharding.logical_to_spec(a, x.shape, rmesh, sharding.FSDP_TP_RULES, warn=False)
        for a, x in zip(axes, jax.tree.leaves(params), strict=True)
    ]


def regroup(
    graphdef: nnx.GraphDef, mesh: Mesh | None, params: paged.EngineParams, tensor_parallel: int
) -> tuple[Mesh, paged.EngineParams]:
    """``(rollout mesh, params on it)`` for engines of ``tensor_parallel`` devices each, from
    the parameters' own ``mesh`` (``rollout.tensor_parallel``, vLLM's and verl's rollout
    tensor-parallel size, independent of the train mesh's layout): the devices regrouped
    (:func:`regroup_mesh`) and every leaf moved onto that mesh split over its engine's
    devices (heads, MLP, vocabulary; one ``jax.device_put``, an all-to-all from an FSDP
    layout). Each engine then holds ``1/t`` of the weights instead of a whole gathered copy:
    how a model larger than one device's memory samples on the paged engine.

    Raises:
      ValueError: no mesh (the parameters on one device), or a :func:`regroup_mesh` error.
    """
    if mesh is None:
        raise ValueError(
            f"generate(engine='paged'): tensor_parallel={tensor_parallel} needs the parameters "
            "on a mesh (models.sharding.shard_model); they are on one device"
        )
    rmesh = regroup_mesh(mesh, tensor_parallel)
    leaves, treedef = jax.tree.flatten(params)
    targets = [NamedSharding(rmesh, s) for s in _tensor_specs(graphdef, params, rmesh)]
    return rmesh, jax.tree.unflatten(treedef, dist.put(leaves, targets))


def engines(
    graphdef: nnx.GraphDef,
    mesh: Mesh | None,
    params: paged.EngineParams,
    options: paged.PagedOptions,
    requested: paged.PagedOptions | None,
) -> tuple[Any, Mesh | None, paged.EngineParams]:
    """``(run, mesh, params)``: how ``generate`` (and a partial rollout's segment) runs the
    paged engine on the parameters' ``mesh``: regrouped into engines of
    ``options.tensor_parallel`` devices when set (:func:`regroup`); then one engine
    (``paged.run``) or one per data shard (:func:`run`, each resolving ``requested``'s
    defaults for its share) when the mesh has a batch axis > 1 or the job several processes."""
    if options.tensor_parallel:
        mesh, params = regroup(graphdef, mesh, params, options.tensor_parallel)
    if is_data_parallel(mesh) or jax.process_count() > 1:
        return functools.partial(run, requested=requested or paged.PagedOptions()), mesh, params
    return paged.run, mesh, params


def abstract_regroup(
    graphdef: nnx.GraphDef, params: paged.EngineParams, rmesh: Mesh
) -> paged.EngineParams:
    """:func:`regroup` in shapes: abstract ``params`` on the :func:`regroup_mesh` mesh
    ``rmesh``, each leaf with the spec ``regroup`` gives it. For ``jaxrl-llm plan``."""
    leaves, treedef = jax.tree.flatten(params)
    specs = _tensor_specs(graphdef, params, rmesh)
    return jax.tree.unflatten(
        treedef,
        [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(rmesh, s))
            for x, s in zip(leaves, specs, strict=True)
        ],
    )


def split_rows(b: int, d: int) -> list[slice]:
    """``b`` prompts over ``d`` shards, contiguous: the first ``b mod d`` get one more."""
    sizes = [b // d + (i < b % d) for i in range(d)]
    starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    return [slice(starts[i], starts[i + 1]) for i in range(d)]


def _process_of(mesh: Mesh, d: int) -> int:
    procs = sorted({dev.process_index for dev in mesh.devices.flat})
    if len(procs) > 1:
        raise ValueError(
            f"generate(engine='paged'): data shard {d} of the mesh spans processes {procs} "
            f"(its devices {[dev.id for dev in mesh.devices.flat]}); each data shard's "
            "devices (the non-batch axes, e.g. tensor) must belong to one process. Lay the "
            "mesh out process by process along data/fsdp, or use engine='static'"
        )
    return procs[0]


def run_shards(
    graphdef: nnx.GraphDef,
    mesh: Mesh,
    params: Params,
    prompts: list[np.ndarray],
    budgets_bg: np.ndarray,
    *,
    rng: jax.Array,
    max_new_tokens: int,
    options: paged.PagedOptions,
    requested: paged.PagedOptions | None = None,
    seq_ids_bg: np.ndarray | None = None,
    token_offsets_bg: np.ndarray | None = None,
    **kwargs: Any,
) -> tuple[tuple[np.ndarray, ...], list[paged.PagedStats | None]]:
    """:func:`run`, with each data shard's stats (``None`` where a shard had no prompt; in a
    multi-process run, also for the shards of other processes)."""
    b_count, g = budgets_bg.shape
    shards = data_shard_meshes(mesh)
    d_count = len(shards)
    multi = jax.process_count() > 1
    owners = [_process_of(m, d) for d, m in enumerate(shards)] if multi else [0] * d_count
    mine = [d for d in range(d_count) if owners[d] == jax.process_index()]
    offset = 0
    if multi:
        if not mine:
            raise ValueError(
                f"generate(engine='paged'): process {jax.process_index()} holds no data shard "
                f"of the parameters' mesh {dict(mesh.shape)}; every process needs devices on it"
            )
        key_data = np.asarray(jax.random.key_data(rng))
        nonce = np.frombuffer(os.urandom(8), np.uint32)  # names this call's lending keys
        longest_here = np.int32(max((len(p) for p in prompts), default=0))
        counts_p, keys_p, nonces_p, longest_p = dist.host_allgather(
            (np.int32(b_count), key_data, nonce, longest_here),
            what="paged engine: rows and rng key",
        )
        offset = int(counts_p[: jax.process_index()].sum())
        namespace = f"{_LENDING_PREFIX}/{nonces_p[0, 0]:08x}{nonces_p[0, 1]:08x}"
        _forget_lending(namespace)
        if not (keys_p == key_data[None]).all():
            raise ValueError(
                "generate(engine='paged'): processes passed different rng keys; pass the same key"
            )
        # A key replicated over every process's devices (the trainer's) cannot be put on one
        # shard's devices as it is: rebuild it from its data on this host.
        rng = jax.random.wrap_key_data(key_data, impl=jax.random.key_impl(rng))
    if seq_ids_bg is None:
        seq_ids_bg = (offset + np.arange(b_count))[:, None] * g + np.arange(g)[None]
    seq_ids_bg = np.asarray(seq_ids_bg, np.int32)
    if token_offsets_bg is None:
        token_offsets_bg = np.zeros((b_count, g), np.int32)
    longest = max((len(p) for p in prompts), default=0)
    rows = dict(zip(mine, split_rows(b_count, len(mine)), strict=True))
    todo = [d for d in mine if rows[d].stop > rows[d].start]
    local_params = dict(
        zip(mine, shard_params(params, mesh, [shards[d] for d in mine]), strict=True)
    )

    # A partial rollout's segment (``whole_rollout``: its rollout's (B, G, P, T)): each engine
    # sized for its share of the whole rollout, as one generate call would be, not for the
    # segment's rows and contexts, so that every segment runs the same slots and pool.
    whole = kwargs.pop("whole_rollout", None)
    share = None
    if whole is not None:
        wb, wg, wp, wt = whole
        share = (-(-wb // d_count), wg, wp, wt)  # the largest data shard's prompts

    # Work stealing (``PagedOptions.work_stealing``, rollout/stealing.py): every engine sees
    # all of this process's rows and starts with its share in a queue of its own; with
    # several processes, the queues lend what waits to every process's engines.
    queues = lending = None
    steal = (requested or options).work_stealing
    if steal and (multi or len(todo) > 1):
        book = stealing.Rows(prompts, budgets_bg, seq_ids_bg, token_offsets_bg)
        if multi:
            book.longest = int(longest_p.max())  # any process's prompt may come here
            lending = stealing.Lending(
                dist._kv_client(), namespace, jax.process_index(), jax.process_count(), book
            )
        queues = stealing.PromptQueues(
            [range(rows[d].start, rows[d].stop) for d in todo], book, lending
        )

    def one(d: int) -> tuple[tuple[np.ndarray, ...], paged.PagedStats]:
        r, sub = rows[d], shards[d]
        n = r.stop - r.start
        mine_r = slice(None) if queues is not None else r
        opts = options
        if requested is not None:
            b_, g_, p_, t_ = share or (n, g, longest, max_new_tokens)
            opts = paged.resolve_options(
                requested, num_seqs=b_ * g_, num_samples=g_, longest_prompt=p_, max_new_tokens=t_
            )
        first = sub.devices.flat[0]
        try:
            with jax.default_device(first):
                return paged.run(
                    graphdef,
                    sub,
                    local_params[d],
                    prompts[mine_r],
                    budgets_bg[mine_r],
                    rng=jax.device_put(rng, NamedSharding(sub, PartitionSpec())),
                    max_new_tokens=max_new_tokens,
                    options=opts,
                    seq_ids_bg=seq_ids_bg[mine_r],
                    token_offsets_bg=token_offsets_bg[mine_r],
                    whole_rollout=share,
                    queue=None if queues is None else queues.engine(todo.index(d)),
                    **kwargs,
                )
        except Exception as e:
            if queues is not None:  # the other engines stop waiting for this one's prompts
                queues.abort(f"data shard {d}: {type(e).__name__}: {e}")
            where = f"whose prompt i is this call's prompt {r.start} + i"
            if queues is not None:
                where = "its prompts numbered as the call's"
            e.add_note(
                f"in data shard {d} of {d_count} (devices "
                f"{[dev.id for dev in sub.devices.flat]}), {where}"
            )
            raise

    if not todo:  # a process with no rows in this call (a partial rollout's late segment)
        if lending is not None:
            lending.drained()  # nothing to lend; its engines run nothing, so take nothing
        t = max_new_tokens
        arrays = (
            np.zeros((0, g, t), np.int32),
            np.zeros((0, g, t), bool),
            np.zeros((0, g, t), np.float32),
            np.zeros((0, g), bool),
        ) + ((np.zeros((0, g, t), np.float32),) if kwargs.get("full_logprobs") else ())
        return arrays, [None] * d_count
    if len(todo) == 1:
        results = {todo[0]: one(todo[0])}
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(todo)) as pool:
            futures = {d: pool.submit(one, d) for d in todo}
            results = {d: f.result() for d, f in futures.items()}
    arrays = tuple(
        np.concatenate([results[d][0][i] for d in todo], axis=0)
        for i in range(len(results[todo[0]][0]))
    )
    if queues is not None:  # each engine's rows are the prompts it ran: back in prompt order
        order = np.concatenate([np.asarray(r, np.int64) for r in queues.ran])
        back = {} if lending is None else lending.collect_results()
        if back:  # this process's prompts that other processes ran
            order = np.concatenate([order, np.fromiter(back, np.int64, len(back))])
            arrays = tuple(
                np.concatenate([x, np.stack([v[i] for v in back.values()])])
                for i, x in enumerate(arrays)
            )
        assert np.array_equal(np.sort(order), np.arange(b_count)), "work stealing lost a prompt"
        arrays = tuple(x[np.argsort(order)] for x in arrays)
    stats: list[paged.PagedStats | None] = [
        results[d][1] if d in results else None for d in range(d_count)
    ]
    return arrays, stats


def run(
    graphdef: nnx.GraphDef,
    mesh: Mesh | None,
    params: Params,
    prompts: list[np.ndarray],
    budgets_bg: np.ndarray,
    **kwargs: Any,
) -> tuple[tuple[np.ndarray, ...], DataParallelStats]:
    """``paged.run``'s contract (same arguments, same outputs in prompt order) over the data
    shards of ``mesh``, one engine each (module docstring); the stats summed
    (:class:`DataParallelStats`).

    ``requested`` (optional): the caller's unresolved
    :class:`~jaxrl_llm.rollout.paged.PagedOptions`; each shard resolves its defaults from it
    for its own share of the batch (its ``num_slots`` from its own sequences, the pool from the
    batch's longest prompt), or, for a partial rollout's segment (``whole_rollout``, as
    ``paged.run`` takes it), for its share of the whole rollout: every segment then runs the
    same slots and pool, whatever rows and contexts it has left. Without it every shard uses
    ``options`` as given. Explicit sizes
    (``num_slots``, ``num_pages``) are per engine, so the whole run holds ``D`` pools of
    ``num_pages``. Each shard runs in a thread of its own, which does not inherit the caller's
    thread-local JAX contexts (``jax.set_mesh``, ``jax.default_device``, ...): ``paged.run``
    sets the shard's mesh, and the shard's first device is made the default device.
    """
    if mesh is None:
        if jax.process_count() > 1:
            raise ValueError(
                "generate(engine='paged'): in a multi-process run the parameters must live on "
                "a mesh over every process's devices (e.g. models.sharding.shard_model)"
            )
        raise ValueError("paged_dp.run: the parameters have no mesh")
    arrays, stats = run_shards(graphdef, mesh, params, prompts, budgets_bg, **kwargs)
    return arrays, DataParallelStats.combine(stats)


__all__ = [
    "DataParallelStats",
    "abstract_regroup",
    "abstract_shard_params",
    "data_shard_meshes",
    "engines",
    "is_data_parallel",
    "regroup",
    "regroup_mesh",
    "run",
    "run_shards",
    "shard_params",
    "split_rows",
]
