"""Trace-time shape and dtype contracts shared by every function in ``core``.

These wrap chex assertions so that a failure names the function and the argument, states what
was expected (rank, layout, dtype) and what arrived. They run on static shapes and dtypes only,
so under ``jax.jit`` they fire once, at trace time, and cost nothing at run time.
"""

from __future__ import annotations

from collections.abc import Mapping

import chex
import jax.numpy as jnp


def _where(fn: str, name: str) -> str:
    return f"{fn}: argument `{name}`"


def check_rank(fn: str, name: str, x: chex.Array, rank: int, layout: str = "") -> None:
    """Asserts that ``x`` has ``rank`` dimensions; ``layout`` (e.g. "[B, G, T]") names them."""
    shape = getattr(x, "shape", None)
    if shape is None:
        raise TypeError(f"{_where(fn, name)} must be an array {layout}, got {type(x).__name__}")
    expected = f"rank {rank} {layout}".strip()
    chex.assert_rank(x, rank, custom_message=f"{_where(fn, name)} must have {expected}")


def check_float(fn: str, name: str, x: chex.Array) -> None:
    """Asserts a floating dtype (bf16, f16, f32 or f64 are accepted; math is done in f32)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{_where(fn, name)} must be a floating-point array, got dtype {x.dtype}")


def check_bool(fn: str, name: str, x: chex.Array) -> None:
    """Asserts a boolean mask (masks are never 0/1 floats in this package)."""
    if x.dtype != jnp.bool_:
        raise TypeError(
            f"{_where(fn, name)} must be a boolean mask, got dtype {x.dtype}; "
            f"convert with `{name}.astype(bool)`"
        )


def check_int(fn: str, name: str, x: chex.Array) -> None:
    """Asserts an integer dtype (token ids, indices, lengths)."""
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{_where(fn, name)} must be an integer array, got dtype {x.dtype}")


def check_same_shape(fn: str, arrays: Mapping[str, chex.Array]) -> None:
    """Asserts that every named array has the same shape."""
    items = list(arrays.items())
    first_name, first = items[0]
    for name, x in items[1:]:
        if tuple(x.shape) != tuple(first.shape):
            raise ValueError(
                f"{fn}: argument `{name}` has shape {tuple(x.shape)} but `{first_name}` has "
                f"shape {tuple(first.shape)}; they must match"
            )


def check_leading_shape(fn: str, name: str, x: chex.Array, shape: tuple[int, ...], of: str) -> None:
    """Asserts that ``x.shape`` starts with ``shape`` (the shape of argument ``of``)."""
    if tuple(x.shape[: len(shape)]) != tuple(shape):
        raise ValueError(
            f"{fn}: argument `{name}` has shape {tuple(x.shape)}, whose leading dimensions must "
            f"equal the shape {tuple(shape)} of `{of}`"
        )


def check_positive(fn: str, name: str, value: float | int, *, allow_zero: bool = False) -> None:
    """Asserts a positive (or non-negative) static hyperparameter."""
    ok = value >= 0 if allow_zero else value > 0
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{_where(fn, name)} must be {bound}, got {value!r}")


def f32(x: chex.Array) -> chex.Array:
    """Upcasts to float32: all RL math in this package runs in f32 whatever the model dtype."""
    return jnp.asarray(x, jnp.float32)
