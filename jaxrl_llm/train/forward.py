"""Forward passes before the update: old/reference log-probs and critic values.

:func:`completion_logprobs_nt` and :func:`completion_values_nt` are traceable (the RL step calls
them inside its jit); each ``make_*`` factory returns one jitted as a function of ``(params,
tokens_nl, input_mask_nl)`` with the completion length static. ``micro_batch_size`` bounds
memory the way the update does: the N rows are processed in strided micro-batches (row
``i·S + s`` in micro-batch ``s``, so each device works on its own rows) under ``lax.map``, and
put back in order.

Packed (:mod:`jaxrl_llm.train.packing`): :func:`packed_logprobs_nt` and :func:`packed_values_nt`
run the model on the packed ``[M·K, rows, W]`` micro-batches of a plan, one micro-batch at a
time in a ``lax.fori_loop`` whose trip count is the number of *used* slots (traced: it changes
with the batch's real tokens without recompiling; empty slots are never computed), and read the
per-token outputs back to the ``[N, T]`` completion layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm.models.logprobs import completion_logprobs
from jaxrl_llm.train import packing as pk
from jaxrl_llm.train import update as up


def _by_micro_batches(fn: Callable, micro_batch_size: int | None, *arrays: jax.Array):
    n = arrays[0].shape[0]
    if micro_batch_size is None or micro_batch_size >= n:
        return fn(*arrays)
    if n % micro_batch_size:
        raise ValueError(f"{n} rows do not split into micro-batches of {micro_batch_size}")
    steps = n // micro_batch_size
    split = [x.reshape(micro_batch_size, steps, *x.shape[1:]).swapaxes(0, 1) for x in arrays]
    out = jax.lax.map(lambda xs: fn(*xs), split)
    return jax.tree.map(lambda y: y.swapaxes(0, 1).reshape(n, *y.shape[2:]), out)


def completion_logprobs_nt(
    graphdef: nnx.GraphDef,
    params: dict,
    tokens_nl: jax.Array,
    input_mask_nl: jax.Array,
    *,
    completion_len: int,
    temperature: float = 1.0,
    chunk_size: int | None = 256,
    micro_batch_size: int | None = None,
) -> jax.Array:
    """``f32[N, T]`` log-probs of the last ``completion_len`` tokens under the model
    ``(graphdef, params)`` at ``temperature`` (π_old with the policy's params, π_ref with the
    reference's); traceable, in micro-batches of ``micro_batch_size`` rows."""
    model = nnx.merge(graphdef, params)
    start = tokens_nl.shape[1] - completion_len

    def one(tokens: jax.Array, mask: jax.Array) -> jax.Array:
        return completion_logprobs(
            model, tokens, mask, start=start, temperature=temperature, chunk_size=chunk_size
        )

    return _by_micro_batches(one, micro_batch_size, tokens_nl, input_mask_nl)


def completion_values_nt(
    critic_graphdef: nnx.GraphDef,
    params: dict,
    tokens_nl: jax.Array,
    input_mask_nl: jax.Array,
    *,
    completion_len: int,
    micro_batch_size: int | None = None,
) -> jax.Array:
    """``f32[N, T]``: V(s_t) at the state before each of the last ``completion_len`` tokens (the
    position that predicts it); traceable, in micro-batches of ``micro_batch_size`` rows."""
    critic = nnx.merge(critic_graphdef, params)
    start = tokens_nl.shape[1] - completion_len

    def one(tokens: jax.Array, mask: jax.Array) -> jax.Array:
        return critic(tokens, mask)[:, start - 1 : -1]

    return _by_micro_batches(one, micro_batch_size, tokens_nl, input_mask_nl)


def _over_used_slots(
    fn: Callable[[up.PackedMicro], jax.Array],
    packed: pk.Packed,
    count_m: jax.Array,
    shape: pk.PackShape,
    constrain: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """``f32[M·K, rows, W]``: ``fn`` on every used micro-batch slot (0 on the unused ones).

    Used slot i (of Σ count) is minibatch j's k-th, with j the first minibatch whose running
    count exceeds i: a loop over exactly the used slots, with a traced trip count."""
    count_m = jnp.asarray(count_m, jnp.int32)
    ends_m = jnp.cumsum(count_m)
    out = jnp.zeros((shape.num_micro, shape.rows, shape.width), jnp.float32)

    def body(i: jax.Array, out: jax.Array) -> jax.Array:
        j = jnp.searchsorted(ends_m, i, side="right")
        slot = j * shape.slots + i - (ends_m[j] - count_m[j])
        micro = up.PackedMicro.of(
            packed, slot, lambda x: constrain(jax.lax.dynamic_index_in_dim(x, slot, keepdims=False))
        )
        y = fn(micro).astype(jnp.float32)
        return jax.lax.dynamic_update_index_in_dim(out, y, slot, 0)

    return jax.lax.fori_loop(0, ends_m[-1], body, out)


def packed_logprobs_nt(
    graphdef: nnx.GraphDef,
    params: dict,
    packed: pk.Packed,
    plan: pk.PlanArrays,
    shape: pk.PackShape,
    index: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    *,
    temperature: float = 1.0,
    chunk_size: int | None = 256,
    constrain: Callable[[jax.Array], jax.Array] = lambda x: x,
) -> jax.Array:
    """``f32[N, T]`` completion log-probs from the packed rows (:func:`completion_logprobs_nt`'s
    numbers; 0 on padding); ``index`` is :func:`~jaxrl_llm.train.packing.unpack_index`."""
    model = nnx.merge(graphdef, params)

    def one(micro: up.PackedMicro) -> jax.Array:
        h_rwd = up.packed_hidden(model.model, micro)
        (logp,) = up.packed_target_logprobs(
            model, h_rwd, micro, temperature=temperature, chunk_size=chunk_size
        )
        return logp

    return pk.unpack(_over_used_slots(one, packed, plan.count_m, shape, constrain), index)


def packed_values_nt(
    critic_graphdef: nnx.GraphDef,
    params: dict,
    packed: pk.Packed,
    plan: pk.PlanArrays,
    shape: pk.PackShape,
    index: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    *,
    constrain: Callable[[jax.Array], jax.Array] = lambda x: x,
) -> jax.Array:
    """``f32[N, T]`` critic values V(s_t) from the packed rows (0 on padding)."""
    critic = nnx.merge(critic_graphdef, params)
    one = lambda micro: up.packed_values(critic, micro)
    return pk.unpack(_over_used_slots(one, packed, plan.count_m, shape, constrain), index)


def make_logprob_fn(
    graphdef: nnx.GraphDef,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = 256,
    micro_batch_size: int | None = None,
) -> Callable[..., jax.Array]:
    """:func:`completion_logprobs_nt` jitted: ``fn(params, tokens_nl, input_mask_nl, *,
    completion_len, graphdef=graphdef) -> f32[N, T]``; another (static) ``graphdef`` runs
    another architecture's parameters (LoRA's base without the adapters, for instance)."""
    jitted = jax.jit(
        functools.partial(
            completion_logprobs_nt,
            temperature=temperature,
            chunk_size=chunk_size,
            micro_batch_size=micro_batch_size,
        ),
        static_argnames=("graphdef", "completion_len"),
    )

    def fn(
        params: dict,
        tokens_nl: jax.Array,
        input_mask_nl: jax.Array,
        *,
        completion_len: int,
        graphdef: nnx.GraphDef = graphdef,
    ) -> jax.Array:
        return jitted(
            graphdef=graphdef,
            params=params,
            tokens_nl=tokens_nl,
            input_mask_nl=input_mask_nl,
            completion_len=completion_len,
        )

    return fn


def make_value_fn(
    critic_graphdef: nnx.GraphDef, *, micro_batch_size: int | None = None
) -> Callable[..., jax.Array]:
    """:func:`completion_values_nt` jitted: ``fn(critic_params, tokens_nl, input_mask_nl, *,
    completion_len) -> f32[N, T]``."""
    return jax.jit(
        functools.partial(completion_values_nt, critic_graphdef, micro_batch_size=micro_batch_size),
        static_argnames=("completion_len",),
    )


__all__ = [
    "completion_logprobs_nt",
    "completion_values_nt",
    "make_logprob_fn",
    "make_value_fn",
    "packed_logprobs_nt",
    "packed_values_nt",
]
