"""Token log-probabilities and entropies from logits, in f32 and with bounded memory.

With z = logits / τ (upcast to f32 first, whatever the model dtype):

    log π(y_t) = z[y_t] − logsumexp(z)
    H_t        = logsumexp(z) − Σ_v softmax(z)_v · z_v = Σ_v p_v · (logsumexp(z) − z_v)

(the entropy is summed in the last form, whose terms are all ≥ 0, so it stays accurate for
peaked rows). The f32 copy of ``[B, T, V]`` logits is the largest array of an RL update step (for
B·T = 64k tokens and V = 152k it is 39 GB), so ``chunk_size`` computes the result
``chunk_size`` positions at a time: a ``jax.lax.scan`` over time chunks, each slicing the
(bf16) logits and reducing over V at once, so only a few ``[B, chunk_size, V]`` f32 blocks
live. The chunk body is rematerialised (``jax.checkpoint``), so the backward pass does not
store the per-chunk softmax either. Chunked and unchunked results are equal up to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.core import _contracts


def _check_logits(
    fn: str, logits_btv: chex.Array, temperature: float, chunk_size: int | None
) -> None:
    _contracts.check_rank(fn, "logits_btv", logits_btv, 3, "[B, T, V]")
    _contracts.check_float(fn, "logits_btv", logits_btv)
    _contracts.check_positive(fn, "temperature", temperature)
    if chunk_size is not None:
        if not isinstance(chunk_size, int):
            raise TypeError(
                f"{fn}: argument `chunk_size` must be an int or None, got {chunk_size!r}"
            )
        _contracts.check_positive(fn, "chunk_size", chunk_size)


def _check_tokens(fn: str, tokens_bt: chex.Array, logits_btv: chex.Array) -> None:
    _contracts.check_rank(fn, "tokens_bt", tokens_bt, 2, "[B, T]")
    _contracts.check_int(fn, "tokens_bt", tokens_bt)
    if tuple(tokens_bt.shape) != tuple(logits_btv.shape[:2]):
        raise ValueError(
            f"{fn}: argument `tokens_bt` has shape {tuple(tokens_bt.shape)} but must equal the "
            f"leading [B, T] = {tuple(logits_btv.shape[:2])} of `logits_btv`"
        )


def _scaled(logits_btv: chex.Array, temperature: float) -> chex.Array:
    z = _contracts.f32(logits_btv)
    return z if temperature == 1.0 else z / temperature


def _tempered(
    logits_btv: chex.Array, tokens_bt: chex.Array, temperature: float
) -> tuple[chex.Array, chex.Array, chex.Array]:
    """``(z, logsumexp(z), log π(tokens))`` with ``z = logits / τ`` in f32."""
    z = _scaled(logits_btv, temperature)
    lse = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.take_along_axis(z, tokens_bt[..., None], axis=-1)[..., 0]
    return z, lse, picked - lse


def _logprob(logits_btv: chex.Array, tokens_bt: chex.Array, temperature: float) -> chex.Array:
    return _tempered(logits_btv, tokens_bt, temperature)[2]


def _entropy(z: chex.Array, lse: chex.Array) -> chex.Array:
    # H = Σ_v p_v·(lse − z_v): every term is ≥ 0, so unlike lse − Σ p·z there is no
    # cancellation for peaked (low-entropy) rows. Logits of −inf (masked vocabulary) have p = 0
    # and contribute 0; replacing them before the subtraction avoids 0·inf = NaN, in the
    # gradient too.
    p = jnp.exp(z - lse[..., None])
    surprise = lse[..., None] - jnp.where(jnp.isfinite(z), z, lse[..., None])
    return jnp.sum(p * surprise, axis=-1)


def _logprob_and_entropy(
    logits_btv: chex.Array, tokens_bt: chex.Array, temperature: float
) -> tuple[chex.Array, chex.Array]:
    z, lse, logp = _tempered(logits_btv, tokens_bt, temperature)
    return logp, _entropy(z, lse)


def _over_time_chunks(
    fn: Callable[..., tuple[chex.Array, ...]],
    num_outputs: int,
    logits_btv: chex.Array,
    tokens_bt: chex.Array | None,
    chunk_size: int | None,
) -> tuple[chex.Array, ...]:
    """Applies ``fn(logits[:, s:s+C], tokens[:, s:s+C]) -> num_outputs × [B, C]`` over all T.

    Chunk starts are ``min(k·C, T − C)``: when C does not divide T the last chunk is shifted
    left to end at T and overlaps the previous one; it is written last, so the overlapping
    positions hold its (identical) values and, in the backward pass, only it receives their
    cotangents. This avoids padding (a full copy of the logits).

    Observed on XLA:CPU, which emulates bf16: for a bf16 forward pass without gradient the
    compiler may convert the whole logits array to f32 before the loop (f32/f16 logits, and
    the gradient pass, stay chunked). Backends with native bf16 have no reason to do this.
    """
    batch, time = logits_btv.shape[:2]
    if chunk_size is None or chunk_size >= time:
        return fn(logits_btv, tokens_bt)
    num_chunks = -(-time // chunk_size)
    starts = jnp.minimum(jnp.arange(num_chunks, dtype=jnp.int32) * chunk_size, time - chunk_size)

    @jax.checkpoint
    def _chunk(start: chex.Array) -> tuple[chex.Array, ...]:
        logits = jax.lax.dynamic_slice_in_dim(logits_btv, start, chunk_size, axis=1)
        if tokens_bt is None:
            return fn(logits, None)
        tokens = jax.lax.dynamic_slice_in_dim(tokens_bt, start, chunk_size, axis=1)
        return fn(logits, tokens)

    def _body(
        outputs: tuple[chex.Array, ...], start: chex.Array
    ) -> tuple[tuple[chex.Array, ...], None]:
        values = _chunk(start)
        outputs = tuple(
            jax.lax.dynamic_update_slice_in_dim(out, value, start, axis=1)
            for out, value in zip(outputs, values, strict=True)
        )
        return outputs, None

    init = tuple(jnp.zeros((batch, time), jnp.float32) for _ in range(num_outputs))
    outputs, _ = jax.lax.scan(_body, init, starts)
    return outputs


def token_logprobs(
    logits_btv: chex.Array,
    tokens_bt: chex.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> chex.Array:
    """Log-probability of each token under softmax(logits / τ), in f32.

        log π(y_t) = z_t[y_t] − logsumexp(z_t),   z_t = logits_t / τ

    The policy is the sampling distribution, so τ must be the rollout temperature (verl,
    TRL and OpenRLHF divide the logits by it too).

    Args:
      logits_btv: float ``[B, T, V]`` (bf16 allowed; upcast to f32 chunk by chunk). Row t holds
        the logits that predict ``tokens_bt[:, t]`` (already shifted by the caller).
      tokens_bt: int ``[B, T]`` token ids in [0, V) (an id outside [−V, V) gives NaN). Padding
        positions may hold any id in range; mask their outputs downstream.
      temperature: τ > 0.
      chunk_size: if set, positions are processed ``chunk_size`` at a time so at most
        ``[B, chunk_size, V]`` f32 values live at once (any T works). None: all at once.

    Returns:
      f32 ``[B, T]``.
    """
    fn = "token_logprobs"
    _check_logits(fn, logits_btv, temperature, chunk_size)
    _check_tokens(fn, tokens_bt, logits_btv)
    one = lambda logits, tokens: (_logprob(logits, tokens, temperature),)
    return _over_time_chunks(one, 1, logits_btv, tokens_bt, chunk_size)[0]


def token_entropy(
    logits_btv: chex.Array, *, temperature: float = 1.0, chunk_size: int | None = None
) -> chex.Array:
    """Entropy of softmax(logits / τ) at each position, in f32.

        H_t = logsumexp(z_t) − Σ_v softmax(z_t)_v · z_t,v,   z_t = logits_t / τ

    (verl/TRL entropy bonus and metrics). Vocabulary entries with logit −inf contribute 0.

    Args:
      logits_btv: float ``[B, T, V]`` (bf16 allowed).
      temperature: τ > 0.
      chunk_size: as in ``token_logprobs``.

    Returns:
      f32 ``[B, T]``, ≥ 0 up to rounding.
    """
    fn = "token_entropy"
    _check_logits(fn, logits_btv, temperature, chunk_size)

    def one(logits: chex.Array, tokens: None) -> tuple[chex.Array]:
        del tokens
        z = _scaled(logits, temperature)
        return (_entropy(z, jax.nn.logsumexp(z, axis=-1)),)

    return _over_time_chunks(one, 1, logits_btv, None, chunk_size)[0]


def token_logprobs_and_entropy(
    logits_btv: chex.Array,
    tokens_bt: chex.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[chex.Array, chex.Array]:
    """``token_logprobs`` and ``token_entropy`` in one pass over the logits (one logsumexp).

    Args:
      logits_btv: float ``[B, T, V]`` (bf16 allowed).
      tokens_bt: int ``[B, T]`` token ids in [0, V).
      temperature: τ > 0.
      chunk_size: as in ``token_logprobs``.

    Returns:
      ``(logp_bt, entropy_bt)``, both f32 ``[B, T]``.
    """
    fn = "token_logprobs_and_entropy"
    _check_logits(fn, logits_btv, temperature, chunk_size)
    _check_tokens(fn, tokens_bt, logits_btv)
    one = lambda logits, tokens: _logprob_and_entropy(logits, tokens, temperature)
    return _over_time_chunks(one, 2, logits_btv, tokens_bt, chunk_size)


def token_logprobs_and_log_sum_sq(
    logits_btv: chex.Array,
    tokens_bt: chex.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[chex.Array, chex.Array]:
    """``token_logprobs`` and ``log Σ_v π(v)²`` at each position, in one pass, in f32.

        log Σ_v π(v)² = logsumexp(2 z_t) − 2·logsumexp(z_t),   z_t = logits_t / τ

    ``log Σ_v π(v)²`` is the log-prob a token drawn from π itself gets on average
    (E_{v∼π}[π(v)] = Σ_v π(v)²); WPO subtracts it from each answer token's log-prob
    (:func:`jaxrl_llm.core.preference.wpo_weights`). It lies in
    [−log V, 0]: −log V for a uniform π, 0 for a one-hot one.

    Args:
      logits_btv: float ``[B, T, V]`` (bf16 allowed).
      tokens_bt: int ``[B, T]`` token ids in [0, V).
      temperature: τ > 0.
      chunk_size: as in ``token_logprobs``.

    Returns:
      ``(logp_bt, log_sum_sq_bt)``, both f32 ``[B, T]``.
    """
    fn = "token_logprobs_and_log_sum_sq"
    _check_logits(fn, logits_btv, temperature, chunk_size)
    _check_tokens(fn, tokens_bt, logits_btv)

    def one(logits: chex.Array, tokens: chex.Array) -> tuple[chex.Array, chex.Array]:
        z, lse, logp = _tempered(logits, tokens, temperature)
        return logp, jax.nn.logsumexp(2.0 * z, axis=-1) - 2.0 * lse

    return _over_time_chunks(one, 2, logits_btv, tokens_bt, chunk_size)
