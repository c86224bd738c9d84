"""Loss aggregation: per-token losses to one scalar, as an additive ``(sum, denominator)`` pair.

Inputs are a per-token loss ``loss_bgt`` and a bool ``mask_bgt`` of the same shape. The token
axis is the last axis; a *sequence* is one index into all the other axes (``[B, G, T]`` has
B·G sequences, ``[N, T]`` has N, ``[T]`` has one). |y_i| = Σ_t m_it is the number of valid
tokens of sequence i. Every mode returns two f32 scalars ``(sum, denominator)``, and

    finalize(sum, denominator) = sum / max(denominator, 1).

Modes (m = mask, ℓ = loss, masked entries never enter a sum):

    mode                       sum                          denominator
    token-mean                 Σ_it m ℓ                     Σ_it m                (valid tokens)
    token-sum                  Σ_it m ℓ                     0                     (plain sum)
    seq-mean-token-mean        Σ_i Σ_t m ℓ / max(|y_i|, 1)  #{i : |y_i| ≥ 1}
    seq-mean-token-sum         Σ_it m ℓ                     #{i : |y_i| ≥ 1}
    seq-mean-token-sum-norm    Σ_it m ℓ                     #{i : |y_i| ≥ 1} · S

The rules, decided once:

* Both parts are additive. Splitting a batch into micro-batches (along B, along G, or into any
  sets of whole sequences) and adding the pairs — :func:`combine`, or ``jax.lax.psum`` across
  data-parallel shards (the ``axis_name`` keyword does it for you inside ``jax.shard_map``) —
  gives exactly the pair of the whole batch, hence exactly its loss. Under ``jax.jit`` with a
  sharded batch the sums are global automatically.
* Empty input never gives NaN: ``max(denominator, 1)`` turns 0/0 into 0. Because denominators
  are counts (or counts · S with S ≥ 1), the max never changes a non-empty denominator.
* token-sum's denominator is 0, so ``finalize`` returns the plain sum.
* The seq-* modes count only sequences with at least one valid token: an empty completion slot
  (a filtered-out group member, a padding row) neither adds loss nor dilutes the mean.
* S (``norm``) is Dr. GRPO's constant length normaliser, the maximum completion length; it
  defaults to T = ``loss_bgt.shape[-1]``. Pass it explicitly when micro-batches may be padded to
  different lengths, or the pairs stop being comparable.
* Gradient accumulation: the denominator depends only on the mask, so compute the global
  denominator first and backpropagate sum_k / max(D, 1) per micro-batch; or accumulate
  gradients of sum_k and divide once at the end (finalize is linear in the sum).

How this maps onto verl's ``agg_loss`` (verl-project/verl@1dda039, which divides each
micro-batch by global counts and multiplies by the data-parallel size D so that DDP's averaging
cancels; with N = valid tokens of the global mini-batch, G = sequences in it):

* token-mean: verl Σ mℓ / N · D  →  ours (Σ mℓ, N). Identical.
* token-sum: verl Σ mℓ · D  →  ours (Σ mℓ, 0). Identical.
* seq-mean-token-mean: verl Σ_i Σ_t mℓ / (|y_i| + 1e-8) / G · D  →  ours divides by
  max(|y_i|, 1) (no 1e-8 relative shift) and by the number of non-empty sequences.
* seq-mean-token-sum: verl Σ mℓ / G · D  →  ours (Σ mℓ, #non-empty).
* seq-mean-token-sum-norm: verl (since #5366/#5417, Feb 2026) Σ mℓ / (G · S) · D  →  ours
  (Σ mℓ, #non-empty · S). Before that change verl divided by S only (no batch size).

verl's G is the mini-batch size in sequences when the trainer passes global counts, and the
number of sequences with ≥ 1 valid token otherwise; ours is always the latter, so the two agree
unless a batch holds empty completions (rare: a completion normally holds at least EOS).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.core._contracts import check_bool, check_float, check_same_shape, f32

Pair = tuple[chex.Array, chex.Array]


def _check_inputs(fn: str, loss_bgt: chex.Array, mask_bgt: chex.Array) -> None:
    for name, x in (("loss_bgt", loss_bgt), ("mask_bgt", mask_bgt)):
        if not hasattr(x, "shape"):
            raise TypeError(f"{fn}: argument `{name}` must be an array, got {type(x).__name__}")
    check_float(fn, "loss_bgt", loss_bgt)
    check_bool(fn, "mask_bgt", mask_bgt)
    if loss_bgt.ndim < 1:
        raise ValueError(f"{fn}: argument `loss_bgt` must have rank >= 1 [..., T], got a scalar")
    check_same_shape(fn, {"loss_bgt": loss_bgt, "mask_bgt": mask_bgt})


def _check_norm(fn: str, norm: float) -> None:
    if not norm >= 1:
        raise ValueError(
            f"{fn}: argument `norm` must be >= 1 (a length, so that finalize's max(denominator, 1)"
            f" never changes the denominator), got {norm!r}"
        )


def _masked_loss(loss_bgt: chex.Array, mask_bgt: chex.Array) -> chex.Array:
    return jnp.where(mask_bgt, f32(loss_bgt), 0.0)


def _count(mask: chex.Array, **kwargs) -> chex.Array:
    # Integer count, then f32: exact for any realistic number of tokens.
    return jnp.sum(mask, dtype=jnp.int32, **kwargs).astype(jnp.float32)


def _num_sequences(mask_bgt: chex.Array) -> chex.Array:
    return _count(jnp.any(mask_bgt, axis=-1))


def _out(total: chex.Array, denominator: chex.Array, axis_name: str | None) -> Pair:
    if axis_name is not None:
        total, denominator = jax.lax.psum((total, denominator), axis_name)
    return total, denominator


def token_mean(loss_bgt: chex.Array, mask_bgt: chex.Array, *, axis_name: str | None = None) -> Pair:
    """Mean over every valid token of the batch: (Σ_it m ℓ, Σ_it m).

    The DAPO / BNPO / verl-default "token-mean": long completions weigh more than short ones.

    Reference: Q. Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
    arXiv:2503.14476 (2025), §3.3 (token-level policy-gradient loss).

    Args:
      loss_bgt: per-token losses, float ``[..., T]``.
      mask_bgt: bool, same shape; True on tokens that count.
      axis_name: inside ``jax.shard_map``, the mesh axis to ``psum`` both parts over.

    Returns:
      ``(sum, denominator)``, f32 scalars; ``finalize`` gives the loss.
    """
    _check_inputs("token_mean", loss_bgt, mask_bgt)
    return _out(jnp.sum(_masked_loss(loss_bgt, mask_bgt)), _count(mask_bgt), axis_name)


def token_sum(loss_bgt: chex.Array, mask_bgt: chex.Array, *, axis_name: str | None = None) -> Pair:
    """Plain sum over every valid token: (Σ_it m ℓ, 0); ``finalize`` returns the sum itself.

    Useful when the scale is set elsewhere (a learning rate tuned for summed losses, verl's
    ``token-sum`` #7197). Arguments and return as in :func:`token_mean`.
    """
    _check_inputs("token_sum", loss_bgt, mask_bgt)
    return _out(jnp.sum(_masked_loss(loss_bgt, mask_bgt)), jnp.zeros((), jnp.float32), axis_name)


def seq_mean_token_mean(
    loss_bgt: chex.Array, mask_bgt: chex.Array, *, axis_name: str | None = None
) -> Pair:
    """Mean over sequences of each sequence's token mean.

        (Σ_i Σ_t m_it ℓ_it / max(|y_i|, 1),  #{i : |y_i| ≥ 1})

    Every completion weighs the same whatever its length: the original GRPO objective (and the
    aggregation GSPO needs). Empty sequences contribute 0 to both parts.

    Reference: Z. Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in
    Open Language Models", arXiv:2402.03300 (2024), eq. 3.

    Arguments and return as in :func:`token_mean`.
    """
    _check_inputs("seq_mean_token_mean", loss_bgt, mask_bgt)
    per_sequence = jnp.sum(_masked_loss(loss_bgt, mask_bgt), axis=-1)
    length = _count(mask_bgt, axis=-1)
    total = jnp.sum(per_sequence / jnp.maximum(length, 1.0))
    return _out(total, _num_sequences(mask_bgt), axis_name)


def seq_mean_token_sum(
    loss_bgt: chex.Array, mask_bgt: chex.Array, *, axis_name: str | None = None
) -> Pair:
    """Mean over sequences of each sequence's token sum: (Σ_it m ℓ, #{i : |y_i| ≥ 1}).

    The sequence-level loss of REINFORCE-style objectives (loss of a whole completion, averaged
    over completions). Arguments and return as in :func:`token_mean`.
    """
    _check_inputs("seq_mean_token_sum", loss_bgt, mask_bgt)
    total = jnp.sum(_masked_loss(loss_bgt, mask_bgt))
    return _out(total, _num_sequences(mask_bgt), axis_name)


def seq_mean_token_sum_norm(
    loss_bgt: chex.Array,
    mask_bgt: chex.Array,
    *,
    norm: float | None = None,
    axis_name: str | None = None,
) -> Pair:
    """Token sum over a constant length normaliser: (Σ_it m ℓ, #{i : |y_i| ≥ 1} · S).

    Dr. GRPO's unbiased aggregation: dividing by a constant S instead of each |y_i| removes
    GRPO's length bias (short wrong answers are not pushed harder than long wrong ones).

    Reference: Z. Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective",
    arXiv:2503.20783 (2025).

    Args:
      loss_bgt, mask_bgt, axis_name: as in :func:`token_mean`.
      norm: S ≥ 1, the maximum completion length (verl's ``loss_scale_factor``); None means
        T = ``loss_bgt.shape[-1]``.
    """
    fn = "seq_mean_token_sum_norm"
    _check_inputs(fn, loss_bgt, mask_bgt)
    norm = loss_bgt.shape[-1] if norm is None else norm
    _check_norm(fn, norm)
    total = jnp.sum(_masked_loss(loss_bgt, mask_bgt))
    return _out(total, _num_sequences(mask_bgt) * jnp.float32(norm), axis_name)


def finalize(total: chex.Array, denominator: chex.Array) -> chex.Array:
    """The loss of a ``(sum, denominator)`` pair: sum / max(denominator, 1).

    An empty batch (0, 0) gives 0, never NaN; token-sum's (s, 0) gives s.
    """
    return f32(total) / jnp.maximum(f32(denominator), 1.0)


def combine(parts: Iterable[Pair]) -> Pair:
    """Adds ``(sum, denominator)`` pairs of micro-batches: the pair of their union.

    ``finalize(*combine(pairs))`` equals the loss of the concatenated batch exactly (up to
    floating-point summation order).
    """
    parts = tuple(parts)
    if not parts:
        raise ValueError("combine: argument `parts` is empty; give at least one (sum, den) pair")
    total = functools.reduce(jnp.add, (f32(p[0]) for p in parts))
    denominator = functools.reduce(jnp.add, (f32(p[1]) for p in parts))
    return total, denominator
