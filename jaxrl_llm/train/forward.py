"""Forward passes before the update: old/reference log-probs and critic values.

:func:`completion_logprobs_nt` and :func:`completion_values_nt` are traceable (the RL step calls
them inside its jit); each ``make_*`` factory returns one jitted as a function of ``(params,
tokens_nl, input_mask_nl)`` with the completion length static. ``micro_batch_size`` bounds
memory the way the update does: the N rows are processed in strided micro-batches (row
``i·S + s`` in micro-batch ``s``, so each device works on its own rows) under ``lax.map``, and
put back in order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
from flax import nnx

from jaxrl_llm.models.logprobs import completion_logprobs

if TYPE_CHECKING:
    pass


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


def make_logprob_fn(
    graphdef: nnx.GraphDef,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = 256,
    micro_batch_size: int | None = None,
) -> Callable[..., jax.Array]:
    """:func:`completion_logprobs_nt` jitted: ``fn(params, tokens_nl, input_mask_nl, *,
    completion_len) -> f32[N, T]``."""
    return jax.jit(
        functools.partial(
            completion_logprobs_nt,
            graphdef,
            temperature=temperature,
            chunk_size=chunk_size,
            micro_batch_size=micro_batch_size,
        ),
        static_argnames=("completion_len",),
    )


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
]
