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
them, so the caller adds ``acc`` only to the others (the embedding, the final norm, heads).

The match is by identity: the leaves the layer scan reads must be the very arrays being
differentiated (no cast or copy in between), every floating-point leaf of the layer stack must
match, and each accumulator is handed out once per trace. Anything else (LoRA's frozen bases,
a second pass over the same layers, ``remat`` other than ``"full"``) falls back to the plain
scan, which is always correct.
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
    """The accumulators of one gradient trace, keyed by the ids of the differentiated leaves."""

    def __init__(self, params: Sequence[Any], acc: Sequence[jax.Array]) -> None:
        self.params = list(params)  # held, so that the ids stay those of these objects
        self.acc = list(acc)
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
    sink = _Sink(p_leaves, acc_leaves)
    token = _SINK.set(sink)
    try:
        yield sink.added
    finally:
        _SINK.reset(token)


def _is_inexact(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _match(sink: _Sink, state_leaves: Sequence[Any]) -> list[int] | None:
    """The sink indices of ``state_leaves`` if a fused scan may take them all, else None:
    every leaf floating-point, one of the differentiated arrays, its accumulator not yet
    handed out and of its shape and dtype."""
    found = []
    for leaf in state_leaves:
        i = sink.index.get(id(leaf)) if _is_inexact(leaf) else None
        if i is None or i in sink.handed:
            return None
        a = sink.acc[i]
        if a.shape != leaf.shape or a.dtype != leaf.dtype:
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
    if sink is None:
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


__all__ = ["accumulating_into", "scan"]
