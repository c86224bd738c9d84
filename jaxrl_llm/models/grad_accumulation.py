"""Gradient accumulation fused into the layer scan's backward pass.

A micro-batched update sums one gradient per micro-batch, ``acc ← acc + ∇θ L_k``. Written as
plain JAX, ``∇θ L_k`` is a whole gradient tree that exists beside ``acc`` until the add: two
gradient-sized buffers (2 × 0.5 GiB for a 135 M-parameter model in float32), where torch holds
one (autograd's ``AccumulateGrad`` adds each parameter's gradient into ``.grad`` as soon as it
is formed; Megatron-LM's ``gradient_accumulation_fusion`` adds it inside the weight-gradient
GEMM).

Here the accumulator goes into the backward pass instead. Inside :func:`accumulating_into`, a
rematerialised :func:`~jaxrl_llm.models.transformer.scan_layers` over parameters that are the
differentiated ones runs :func:`scan`, a ``jax.custom_vjp`` scan whose backward pass walks the
layers in reverse, recomputes layer ``l`` (what ``remat="full"`` does anyway), and adds its
weight gradients into ``acc[l]`` in place (a dynamic-update-slice of a loop carry). The
stacked weights' cotangent it returns is ``acc + ∇``: the stacked gradient never exists on its
own. :func:`accumulating_into` reports which leaves came back with the accumulator already in
them, so the caller adds ``acc`` only to the others (the final norm, value heads, an untied
embedding).

The LM head goes the same way (:func:`map_chunks`): the log-probs are formed chunk by chunk,
each chunk recomputed in the backward pass, and a plain ``lax.scan`` over the chunks sums the
head's gradient in a carry of its own, a ``[V, D]`` float32 buffer beside the accumulator (for
a 1B Llama's 128,256 × 2,048 head, 1 GiB). The fused chunk loop adds each chunk's head
gradient into the head's accumulator instead, optionally in blocks of the head's rows, so
that not even one chunk's whole ``[V, D]`` gradient exists beside the accumulator. A gradient
with no running sum (one micro-batch) gets the same loop inside :func:`own_accumulators`, the
head's accumulator then made as zeros in the backward pass.

The match is by identity: the leaves the layer scan (or the chunk loop) reads must be the very
arrays being differentiated (no cast or copy in between), every floating-point leaf of the
layer stack must match, and each accumulator is handed out once per trace. Anything else
(LoRA's frozen bases, a second pass over the same layers or the same head, ``remat`` other
than ``"full"`` for the layers) falls back to the plain scan, which is always correct.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class _Sink:
    """The accumulators of one gradient trace, keyed by the ids of the differentiated leaves.

    With ``own``, there are no accumulators to hand out: :func:`map_chunks` forms its weight's
    gradient in one of its own, made by ``own(index)`` inside its backward pass, and
    :func:`scan` runs plain."""

    def __init__(
        self,
        params: Sequence[Any],
        acc: Sequence[jax.Array | None],
        own: Callable[[int], jax.Array] | None = None,
    ) -> None:
        self.params = list(params)  # held, so that the ids stay those of these objects
        self.acc = list(acc)
        self.own = own
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.handed: set[int] = set()  # accumulators handed to a fused scan
        self.added: set[int] = set()  # accumulators a fused scan's backward pass added in


_SINK: contextvars.ContextVar[_Sink | None] = contextvars.ContextVar("grad_sink", default=None)


@contextlib.contextmanager
def accumulating_into(params: Any, acc: Any) -> Iterator[set[int]]:
    """Within the block, fused layer scans over leaves of ``params`` add their gradients into
    the matching leaves of ``acc`` (a pytree like ``params``).

    Use it inside the function being differentiated, on its own arguments (the tracers
    ``jax.grad`` passes in). Yields a set that, once the gradient has been computed (inside the
    same trace), holds the flat indices (``jax.tree.leaves(params)`` order) of the leaves whose
    gradient already includes their accumulator; the caller adds ``acc`` to the rest.
    """
    p_leaves, acc_leaves = jax.tree.leaves(params), jax.tree.leaves(acc)
    if len(p_leaves) != len(acc_leaves):
        raise ValueError(
            f"accumulating_into: params has {len(p_leaves)} leaves but acc has "
            f"{len(acc_leaves)}; expected one accumulator per parameter"
        )
    with _active(_Sink(p_leaves, acc_leaves)) as sink:
        yield sink.added


@contextlib.contextmanager
def own_accumulators(params: Any, shardings: Any = None) -> Iterator[None]:
    """Within the block, fused chunk loops (:func:`map_chunks`, the LM head's log-probs) over a
    leaf of ``params`` form its gradient in an accumulator of their own: zeros of the leaf's
    shape and dtype, made in the backward pass and laid out by the matching leaf of
    ``shardings`` (a pytree of shardings like ``params``, or None: XLA's choice), into which
    each chunk's gradient is added in blocks of the weight's rows.

    For a gradient with no running sum to add into (one micro-batch). The plain chunk loop
    would form each chunk's whole ``[V, D]`` head gradient before adding it to its loop's
    carry (under FSDP, on each device, as a partial sum before the reduce-scatter); here no
    more than one block of it exists. The returned gradient is the accumulator: the caller
    adds nothing. Layer scans run plain, and so does a head of one chunk: with no sum over
    chunks its product is the gradient itself (XLA:CPU temporaries of a 2 MiB head in eighths:
    4.6 MiB plain, 5.5 in blocks; over 5 chunks 5.1 plain, 3.7 in blocks).
    """
    p_leaves = jax.tree.leaves(params)
    if shardings is None:
        s_leaves: list[Any] = [None] * len(p_leaves)
    else:
        s_leaves = jax.tree.leaves(shardings, is_leaf=lambda x: x is None)
        if len(s_leaves) != len(p_leaves):
            raise ValueError(
                f"own_accumulators: params has {len(p_leaves)} leaves but shardings has "
                f"{len(s_leaves)}; expected one sharding (or None) per parameter"
            )

    def own(i: int) -> jax.Array:
        zeros = jnp.zeros(p_leaves[i].shape, p_leaves[i].dtype)
        if s_leaves[i] is None:
            return zeros
        return jax.lax.with_sharding_constraint(zeros, s_leaves[i])

    with _active(_Sink(p_leaves, [None] * len(p_leaves), own)):
        yield


@contextlib.contextmanager
def _active(sink: _Sink) -> Iterator[_Sink]:
    token = _SINK.set(sink)
    try:
        yield sink
    finally:
        _SINK.reset(token)


def _is_inexact(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _match(sink: _Sink, state_leaves: Sequence[Any]) -> list[int] | None:
    """The sink indices of ``state_leaves`` if a fused scan may take them all, else None:
    every leaf floating-point, one of the differentiated arrays, its accumulator not yet
    handed out and of its shape and dtype (or to be made by :func:`own_accumulators`)."""
    found = []
    for leaf in state_leaves:
        i = sink.index.get(id(leaf)) if _is_inexact(leaf) else None
        if i is None or i in sink.handed:
            return None
        a = sink.acc[i]
        if a is not None and (a.shape != leaf.shape or a.dtype != leaf.dtype):
            return None
        found.append(i)
    return found or None


def scan(
    step: Callable[[Any, tuple[Any, Any]], tuple[Any, Any]],
    carry: Any,
    state: Any,
    xs: Any,
) -> tuple[Any, Any] | None:
    """``lax.scan(step, carry, (state, xs))`` whose backward pass adds the gradient of the
    stacked ``state`` into the active accumulators; None where the fused form does not apply
    (no :func:`accumulating_into` block, leaves not matched, floating-point ``xs``, an integer
    carry or output): then the caller runs the plain scan.

    ``step`` is not saved per layer: the backward pass recomputes each layer from its input
    carry (``remat="full"``'s cost), then adds its weight gradients into ``acc[l]``.
    """
    sink = _SINK.get()
    if sink is None or sink.own is not None:
        return None
    if any(map(_is_inexact, jax.tree.leaves(xs))):
        return None  # per-layer float inputs would need their own cotangents
    if not all(map(_is_inexact, jax.tree.leaves(carry))):
        return None  # an integer carry would need float0 cotangents in the reverse scan
    leaves, treedef = jax.tree.flatten(state)
    claimed = _match(sink, leaves)
    if claimed is None:
        return None
    first = jax.tree.map(lambda x: x[0], (state, xs))
    converted, consts = jax.closure_convert(step, carry, first)  # the one trace of ``step``
    if not all(
        map(_is_inexact, jax.tree.leaves(jax.eval_shape(converted, carry, first, *consts)[1]))
    ):
        return None  # integer per-layer outputs, likewise
    sink.handed.update(claimed)
    acc = [sink.acc[i] for i in claimed]

    def step_of(c: Any, layer: list[jax.Array], x: Any, k: Sequence[jax.Array]) -> Any:
        return converted(c, (jax.tree.unflatten(treedef, layer), x), *k)

    @jax.custom_vjp
    def run(c: Any, layers: list[jax.Array], acc: list[jax.Array], k: list[jax.Array]) -> Any:
        del acc
        return jax.lax.scan(lambda c, per: step_of(c, per[0], per[1], k), c, (layers, xs))

    def fwd(c: Any, layers: list[jax.Array], acc: list[jax.Array], k: list[jax.Array]):
        def body(c: Any, per: tuple[list[jax.Array], Any]) -> tuple[Any, tuple[Any, Any]]:
            c_next, y = step_of(c, per[0], per[1], k)
            return c_next, (y, c)  # each layer's input carry, for the recomputation

        c_out, (ys, c_in) = jax.lax.scan(body, c, (layers, xs))
        return (c_out, ys), (c_in, layers, acc, k)

    def bwd(res: tuple, ct: tuple[Any, Any]) -> tuple:
        c_in, layers, acc, k = res
        ct_c, ct_ys = ct
        sink.added.update(claimed)  # traced now, inside the gradient's trace
        num_layers = leaves[0].shape[0]

        def body(carry: tuple, per: tuple) -> tuple[tuple, None]:
            ct_c, acc, ct_k = carry
            c_l, layer, x_l, ct_y, at = per
            _, vjp = jax.vjp(lambda c, w, kk: step_of(c, w, x_l, kk), c_l, layer, k)
            d_c, d_w, d_k = vjp((ct_c, ct_y))
            acc = [
                jax.lax.dynamic_update_index_in_dim(a, a[at] + g.astype(a.dtype), at, 0)
                for a, g in zip(acc, d_w, strict=True)
            ]
            return (d_c, acc, jax.tree.map(jnp.add, ct_k, d_k)), None

        ct_k0 = jax.tree.map(jnp.zeros_like, k)
        per = (c_in, layers, xs, ct_ys, jnp.arange(num_layers, dtype=np.int32))
        (d_c, acc, d_k), _ = jax.lax.scan(body, (ct_c, acc, ct_k0), per, reverse=True)
        return d_c, acc, None, d_k

    run.defvjp(fwd, bwd)
    return run(carry, leaves, acc, list(consts))


def map_chunks(
    project: Callable[[jax.Array, Any, Any], Any],
    reduce: Callable[[Any, Any], Any],
    weight: jax.Array,
    xs: Any,
    ids: Any,
    *,
    prepare: Callable[[jax.Array], Any] = lambda w: None,
    weight_block_rows: int | None = None,
) -> Any | None:
    """``lax.map`` of ``reduce(project(weight, prepare(weight), x_k), ids_k)`` over the chunks
    ``k`` of ``(xs, ids)`` (leading axis ``K``), whose backward pass adds ``weight``'s gradient
    into its accumulator (or, inside :func:`own_accumulators`, into one of its own, which is
    then the weight's gradient); None where that does not apply (no such block,
    ``weight`` not one of the differentiated arrays or its accumulator already handed out,
    non-float ``xs`` or outputs, non-integer ``ids``): then the caller runs the plain loop.

    ``project`` is the product with the weight (the LM head's logits ``z = x Wᵀ``), ``reduce``
    what follows it (log-probs of the targets ``ids``). ``xs`` are differentiated (their
    cotangents come back per chunk), ``ids`` are not (token ids). ``prepare`` runs once per
    pass, outside the chunks (a cast of the weight); its output gets no gradient, so
    ``project`` must send the gradient to ``weight`` itself (as
    :func:`~jaxrl_llm.models.transformer.low_precision_dot` does with its ``b_cast``). No
    chunk's intermediates are saved: the backward pass recomputes each chunk, as
    ``jax.checkpoint`` would, so the backward holds the accumulator and one chunk's weight
    gradient, never a separate sum of the chunks'.

    ``weight_block_rows``: form that one chunk's weight gradient ``∂z/∂W = dzᵀ x`` in blocks of
    this many rows of ``weight``, each added into its rows of the accumulator before the next
    is formed. Then the backward never holds a whole ``[V, D]`` gradient beside the
    accumulator: a temporary the size of the weight on XLA:CPU, which writes the product to a
    buffer of its own before the add, and under FSDP on every backend, where each device forms
    its partial sum before the reduce-scatter. It requires
    ``project`` to be row-wise in the weight: ``z[..., v]`` reads only ``weight[v]`` (and the
    prepared ``weight[v]``), and ``z``'s last axis runs over the weight's rows, as a product
    ``x Wᵀ`` is. None: one block.
    """
    sink = _SINK.get()
    if sink is None:
        return None
    if sink.own is not None and jax.tree.leaves(xs)[0].shape[0] == 1:
        return None  # one chunk and no running sum: the plain product is the gradient itself
    if not all(map(_is_inexact, jax.tree.leaves(xs))):
        return None
    if any(map(_is_inexact, jax.tree.leaves(ids))):
        return None  # float per-chunk inputs would need cotangents: pass them as xs
    claimed = _match(sink, [weight])
    if claimed is None:
        return None
    first_x, first_i = jax.tree.map(lambda a: a[0], (xs, ids))
    cast = jax.eval_shape(prepare, weight)
    project_c, k_p = jax.closure_convert(project, weight, cast, first_x)
    z_shape = jax.eval_shape(project_c, weight, cast, first_x, *k_p)
    reduce_c, k_r = jax.closure_convert(reduce, z_shape, first_i)
    out_shape = jax.eval_shape(reduce_c, z_shape, first_i, *k_r)
    if not all(map(_is_inexact, jax.tree.leaves(out_shape))):
        return None
    rows = weight.shape[0]
    if weight_block_rows is not None:
        if weight_block_rows < 1:
            raise ValueError(f"map_chunks: weight_block_rows = {weight_block_rows}; expected ≥ 1")
        if not isinstance(z_shape, jax.ShapeDtypeStruct) or z_shape.shape[-1:] != (rows,):
            raise ValueError(
                "map_chunks: weight_block_rows needs project to return one array whose last "
                f"axis runs over the weight's {rows} rows; it returned {z_shape}"
            )
    block = rows if weight_block_rows is None else min(weight_block_rows, rows)
    full, rest = divmod(rows, block)

    # ``project`` traced at each block's shape; its consts ``k_b`` are arguments of ``run``.
    block_fns: dict[int, Callable[..., Any]] = {}
    k_b: dict[int, list[Any]] = {}
    for size in {block, rest} - {0, rows}:
        shape = lambda a, size=size: jax.ShapeDtypeStruct((size, *a.shape[1:]), a.dtype)
        block_fns[size], k = jax.closure_convert(
            project, shape(weight), jax.tree.map(shape, cast), first_x
        )
        k_b[size] = list(k)
    sink.handed.update(claimed)
    (index,) = claimed

    def chunks(w: jax.Array, xs: Any, k_p: list[jax.Array], k_r: list[jax.Array]) -> Any:
        c = prepare(w)
        return jax.lax.map(
            lambda per: reduce_c(project_c(w, c, per[0], *k_p), per[1], *k_r), (xs, ids)
        )

    @jax.custom_vjp
    def run(w: jax.Array, acc: jax.Array, xs: Any, k_p: list, k_r: list, k_b: dict) -> Any:
        del acc, k_b
        return chunks(w, xs, k_p, k_r)

    def fwd(w: Any, acc: Any, xs: Any, k_p: Any, k_r: Any, k_b: Any):
        w, acc, xs, k_p, k_r, k_b = jax.tree.map(
            lambda p: p.value,
            (w, acc, xs, k_p, k_r, k_b),
            is_leaf=lambda p: isinstance(p, jax.custom_derivatives.CustomVJPPrimal),
        )
        return chunks(w, xs, k_p, k_r), (w, acc, xs, k_p, k_r, k_b)

    def bwd(res: tuple, ct_outs: Any) -> tuple:
        w, acc, xs, k_p, k_r, k_b = res
        sink.added.add(index)  # traced now, inside the gradient's trace
        if acc is None:  # own_accumulators: made here, where the backward pass needs it
            acc = sink.own(index)
        c = jax.lax.stop_gradient(prepare(w))
        # Outputs nobody differentiates (a logged entropy) are left out of the recomputation.
        ct_leaves = jax.tree.leaves(
            ct_outs, is_leaf=lambda t: isinstance(t, jax.custom_derivatives.SymbolicZero)
        )
        keep = [not isinstance(t, jax.custom_derivatives.SymbolicZero) for t in ct_leaves]
        cts = [t for t, kept in zip(ct_leaves, keep, strict=True) if kept]

        def kept_outs(z: Any, i: Any, kk: list[jax.Array]) -> list[jax.Array]:
            outs = jax.tree.leaves(reduce_c(z, i, *kk))
            return [o for o, kept in zip(outs, keep, strict=True) if kept]

        def add_weight_grad(acc: jax.Array, x: Any, d_z: Any, lo: Any, size: int) -> jax.Array:
            """``acc[lo : lo + size] += ∂/∂W[lo : lo + size]`` of ``⟨d_z, project(W, x)⟩``."""

            def part(a: Any) -> Any:
                return jax.lax.dynamic_slice_in_dim(a, lo, size, 0)

            if size == rows:  # one block: no slicing
                _, vjp = jax.vjp(lambda w_: project_c(w_, c, x, *k_p), w)
                return acc + vjp(d_z)[0].astype(acc.dtype)
            w_b, c_b = part(w), jax.tree.map(part, c)
            d_z_b = jax.lax.dynamic_slice_in_dim(d_z, lo, size, d_z.ndim - 1)
            _, vjp = jax.vjp(lambda w_: block_fns[size](w_, c_b, x, *k_b[size]), w_b)
            (d_w,) = vjp(d_z_b)
            return jax.lax.dynamic_update_slice_in_dim(
                acc, part(acc) + d_w.astype(acc.dtype), lo, 0
            )

        def body(carry: tuple, per: tuple) -> tuple[tuple, Any]:
            acc, ct_kp, ct_kr = carry
            x, i, ct = per
            z, vjp_p = jax.vjp(lambda x_, kk: project_c(w, c, x_, *kk), x, k_p)
            _, vjp_r = jax.vjp(lambda z_, kk: kept_outs(z_, i, kk), z, k_r)
            d_z, d_kr = vjp_r(ct)
            d_x, d_kp = vjp_p(d_z)  # the weight's part of this pullback is not formed
            if full == 1:
                acc = add_weight_grad(acc, x, d_z, 0, block)
            else:  # the blocks one at a time, in place
                acc = jax.lax.fori_loop(
                    0, full, lambda j, a: add_weight_grad(a, x, d_z, j * block, block), acc
                )
            if rest:
                acc = add_weight_grad(acc, x, d_z, full * block, rest)
            add = lambda a, b: jax.tree.map(jnp.add, a, b)
            return (acc, add(ct_kp, d_kp), add(ct_kr, d_kr)), d_x

        zeros = lambda k: jax.tree.map(jnp.zeros_like, k)
        (acc, d_kp, d_kr), d_xs = jax.lax.scan(body, (acc, zeros(k_p), zeros(k_r)), (xs, ids, cts))
        return acc, None, d_xs, d_kp, d_kr, None

    run.defvjp(fwd, bwd, symbolic_zeros=True)
    return run(weight, sink.acc[index], xs, list(k_p), list(k_r), k_b)


__all__ = ["accumulating_into", "map_chunks", "own_accumulators", "scan"]
