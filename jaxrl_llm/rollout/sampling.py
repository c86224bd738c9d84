"""Next-token selection from one row of logits per sequence: greedy, temperature, top-k, top-p.

For logits ``l`` and temperature ``τ > 0`` the sampler draws from

    π(v) ∝ exp(l_v / τ) · [v ∈ K],   K = top-k set ∩ top-p set (of the top-k-filtered softmax)

which is Hugging Face's warper order (temperature, then top-k, then top-p; Holtzman et al. 2020,
"The Curious Case of Neural Text Degeneration", for top-p). It returns the sampled token and
``log π(token)`` of exactly that (filtered, renormalised) distribution; with no filter this is
``log softmax(l / τ)``, the quantity the trainer recomputes (``core.logprobs.token_logprobs``).

Written for XLA:CPU, where a full-vocabulary sort or a Gumbel draw per entry dominates a decode
step (measured at [32, 49152]: sort ~250 ms, ``jax.random.categorical`` ~14 ms, the whole step
~40 ms), so:

- sampling is by inverse CDF: one uniform per row, ``token = #{v : cdf_v ≤ u · cdf_V}``,
  in two levels (blocks of 128 entries, then inside the chosen block) so no full-vocabulary
  cumsum is formed. A token whose probability is below float32 resolution of its running sum
  (~6e-8 of the kept mass) has a zero-width interval and is never drawn;
- top-k takes the k-th largest value with ``lax.top_k``; ties with it are kept (as HF);
- top-p finds its probability threshold by bisection on the float32 bit pattern (31 masked sums
  over the vocabulary instead of a sort): the kept set is every token whose strictly-more-likely
  tokens hold less than ``p`` of the mass, i.e. the smallest prefix of the sorted distribution
  reaching ``p`` (ties at the boundary are all kept);
- greedy is the first index of the maximum (a max then a min-reduction; XLA:CPU's argmax is
  several times slower).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf


def argmax_first(x_nv: jax.Array) -> jax.Array:
    """int32[N]: the first index of each row's maximum (``jnp.argmax``, faster on XLA:CPU)."""
    v = x_nv.shape[-1]
    top_n = jnp.max(x_nv, axis=-1)
    iota = jax.lax.broadcasted_iota(jnp.int32, x_nv.shape, 1)
    return jnp.min(jnp.where(x_nv == top_n[:, None], iota, v), axis=-1)


def top_k_mask(z_nv: jax.Array, k: int) -> jax.Array:
    """bool[N, V]: entries at least as large as each row's k-th largest (ties kept)."""
    kth_n = jax.lax.top_k(z_nv, k)[0][:, -1]
    return z_nv >= kth_n[:, None]


def top_p_mask(z_nv: jax.Array, top_p: jax.Array | float) -> jax.Array:
    """bool[N, V]: the nucleus of softmax(z) per row (``-inf`` entries are never kept).

    Token ``v`` is kept iff ``Σ_{w: π_w > π_v} π_w < p``. With ``M(t) = Σ_{w: π_w > t} π_w``
    (non-increasing, stepping down at each ``π_v``) the kept set is ``{v: π_v ≥ t*}``,
    ``t* = min{t: M(t) < p}``, which bisection over the bit patterns of non-negative float32
    (ordered like the floats) finds exactly in 31 steps.
    """
    p_nv = jnp.exp(z_nv - jnp.max(z_nv, axis=-1, keepdims=True))  # max entry is exactly 1
    target_n = jnp.asarray(top_p, jnp.float32) * jnp.sum(p_nv, axis=-1)
    n = z_nv.shape[0]

    def mass_above(bits_n: jax.Array) -> jax.Array:
        t_n = jax.lax.bitcast_convert_type(bits_n, jnp.float32)
        return jnp.sum(jnp.where(p_nv > t_n[:, None], p_nv, 0.0), axis=-1)

    def body(
        _: int | jax.Array, bounds: tuple[jax.Array, jax.Array]
    ) -> tuple[jax.Array, jax.Array]:
        lo_n, hi_n = bounds  # M(lo) >= target > M(hi)
        mid_n = lo_n + (hi_n - lo_n) // 2
        high_mass_n = mass_above(mid_n) >= target_n
        return jnp.where(high_mass_n, mid_n, lo_n), jnp.where(high_mass_n, hi_n, mid_n)

    one_bits = jax.lax.bitcast_convert_type(jnp.float32(1.0), jnp.int32)
    lo_n = jnp.zeros((n,), jnp.int32)
    hi_n = jnp.full((n,), one_bits, jnp.int32)
    _, hi_n = jax.lax.fori_loop(0, 31, body, (lo_n, hi_n))
    threshold_n = jax.lax.bitcast_convert_type(hi_n, jnp.float32)
    return (p_nv >= threshold_n[:, None]) & (p_nv > 0)


def inverse_cdf(
    p_nv: jax.Array, u_n: jax.Array, *, block: int = 128
) -> tuple[jax.Array, jax.Array]:
    """``(index int32[N], total f32[N])``: ``cdf_{i-1} ≤ u·total < cdf_i`` (unnormalised p ≥ 0).

    Two levels, so no full-vocabulary cumsum (XLA:CPU's is a slow reduce-window): block masses
    of ``block`` entries and their cumsum pick the block, a cumsum inside it picks the entry.
    The threshold is kept strictly below each total, so entries of zero mass (filtered out)
    are never picked even when ``u·total`` rounds up.
    """
    n, v = p_nv.shape
    if v % block:
        p_nv = jnp.pad(p_nv, ((0, 0), (0, -v % block)))
    p_nbk = p_nv.reshape(n, -1, block)
    cdf_nb = jnp.cumsum(jnp.sum(p_nbk, axis=-1), axis=-1)
    total_n = cdf_nb[:, -1]
    threshold_n = jnp.minimum(u_n * total_n, jnp.nextafter(total_n, 0.0))
    block_n = jnp.sum(cdf_nb <= threshold_n[:, None], axis=-1, dtype=jnp.int32)
    below_n = jnp.where(
        block_n > 0,
        jnp.take_along_axis(cdf_nb, jnp.maximum(block_n - 1, 0)[:, None], axis=-1)[:, 0],
        0.0,
    )
    local_cdf_nk = jnp.cumsum(
        jnp.take_along_axis(p_nbk, block_n[:, None, None], axis=1)[:, 0], axis=-1
    )
    local_total_n = local_cdf_nk[:, -1]
    local_n = jnp.minimum(threshold_n - below_n, jnp.nextafter(local_total_n, 0.0))
    index_n = jnp.sum(local_cdf_nk <= local_n[:, None], axis=-1, dtype=jnp.int32)
    return block_n * block + index_n, total_n


def full_logprobs(logits_nv: jax.Array, token_n: jax.Array) -> jax.Array:
    """float32[N]: each row's token under the whole vocabulary at temperature 1.

        full_n = log softmax(logits_n)[token_n] = logits_n[token_n] − logsumexp(logits_n)

    No temperature, no top-k/top-p: the model's own distribution, which the trainer recomputes
    (``core.logprobs.token_logprobs`` at τ = 1), whatever filter the token was sampled
    through. Importance-sampling corrections that need π(y) rather than the truncated
    sampling distribution's μ(y) read this (``generate(return_full_logprobs=True)``); for
    greedy decoding it is also :func:`sample`'s log-prob.

    Args:
      logits_nv: float ``[N, V]`` (upcast to f32).
      token_n: int ``[N]`` token ids in ``[0, V)``.
    """
    logits_nv = logits_nv.astype(jnp.float32)
    lse_n = jax.nn.logsumexp(logits_nv, axis=-1)
    picked_n = jnp.take_along_axis(logits_nv, token_n[:, None], axis=-1)[:, 0]
    return picked_n - lse_n


def sample(
    logits_nv: jax.Array,
    key: jax.Array,
    *,
    temperature: jax.Array | float,
    top_k: int = 0,
    top_p: jax.Array | float | None = None,
    greedy: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """One token per row and its log-probability under the distribution it was drawn from.

        z = logits / τ,   π = softmax(z restricted to K),   token ~ π,   logp = log π(token)

    Args:
      logits_nv: float ``[N, V]`` (upcast to f32).
      key: PRNG key (one uniform per row is drawn from it), or ``[N]`` keys, one per row (each
        row's draw then depends on its own key only: what the paged engine needs so that a
        sequence's tokens do not depend on its slot or its neighbours).
      temperature: τ > 0 (may be traced); ignored when ``greedy``.
      top_k: static; 0 keeps the whole vocabulary.
      top_p: nucleus mass in (0, 1] (may be traced); ``None`` skips the filter entirely.
      greedy: static; the first maximum, with ``log softmax(logits)`` (τ = 1) as its log-prob.

    Returns:
      ``(tokens int32[N], logprobs float32[N])``.
    """
    logits_nv = logits_nv.astype(jnp.float32)
    if greedy:
        token_n = argmax_first(logits_nv)
        return token_n, full_logprobs(logits_nv, token_n)
    z_nv = logits_nv / jnp.asarray(temperature, jnp.float32)
    if top_k:
        z_nv = jnp.where(top_k_mask(z_nv, top_k), z_nv, _NEG_INF)
    if top_p is not None:
        z_nv = jnp.where(top_p_mask(z_nv, top_p), z_nv, _NEG_INF)
    max_n = jnp.max(z_nv, axis=-1)
    if key.ndim == 1:
        u_n = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(key)
    else:
        u_n = jax.random.uniform(key, (z_nv.shape[0],), jnp.float32)
    token_n, total_n = inverse_cdf(jnp.exp(z_nv - max_n[:, None]), u_n)
    lse_n = max_n + jnp.log(total_n)
    picked_n = jnp.take_along_axis(z_nv, token_n[:, None], axis=-1)[:, 0]
    return token_n, picked_n - lse_n
