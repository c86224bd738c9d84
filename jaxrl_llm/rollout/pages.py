"""The paged KV cache: page pool layout, a host-side page allocator, attention over pages.

Keys and values live in a pool of fixed-size pages per layer (Kwon et al. 2023, "Efficient
Memory Management for Large Language Model Serving with PagedAttention", vLLM):

    pool.k, pool.v   [L, num_pages, page_size, K, Dh]

and sequence ``n`` reads its context through a page table: its token ``s`` sits at
``pool[:, table[n, s // page_size], s % page_size]``. Page :data:`TRASH_PAGE` takes every
write nobody reads (padded tokens, idle slots) and fills table entries past a sequence's
pages (always masked). The engine that schedules sequences over this pool is ``paged.py``.

Attention is a pure function (:func:`paged_attention_reference`, plain JAX: gather the pages
by table, mask by length and window); :func:`pallas_gpu_decode_attention` wires JAX's Pallas
GPU ``paged_attention`` kernel to the same layout (checked in interpret mode on CPU).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

TRASH_PAGE = 0
"""The page that takes every write nobody reads (padding, idle slots, unused table entries)."""


class PagePool(NamedTuple):
    """Keys and values of every layer, ``[L, num_pages, page_size, K, Dh]`` each."""

    k: jax.Array
    v: jax.Array


class PageAllocator:
    """Host-side page bookkeeping: a free list, reference counts and a reservation count.

    ``reserve(n)`` promises ``n`` pages to a request (fails when fewer than ``n`` free pages are
    unpromised); ``take(n)`` converts promised pages into pages; ``release(pages)`` drops one
    reference from each and frees those that reach zero; ``unreserve(n)`` returns promises.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.free = list(range(num_pages - 1, TRASH_PAGE, -1))  # pop() gives low ids first
        self.refcount = np.zeros((num_pages,), np.int64)
        self.reserved = 0
        self.peak = 0

    @property
    def in_use(self) -> int:
        return self.num_pages - 1 - len(self.free)

    @property
    def available(self) -> int:
        return len(self.free) - self.reserved

    def reserve(self, n: int) -> bool:
        if n > self.available:
            return False
        self.reserved += n
        return True

    def unreserve(self, n: int) -> None:
        assert 0 <= n <= self.reserved
        self.reserved -= n

    def take(self, n: int, refs: int = 1) -> list[int]:
        assert 0 <= n <= self.reserved and n <= len(self.free), (n, self.reserved)
        self.reserved -= n
        pages = [self.free.pop() for _ in range(n)]
        self.refcount[pages] = refs
        self.peak = max(self.peak, self.in_use)
        return pages

    def release(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refcount[p] > 0, p
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self.free.append(p)


# ---------------------------------------------------------------------------------------------
# Attention over pages (pure functions).


def gather_pages(pool_x: jax.Array, layer: jax.Array | int, table_bw: jax.Array) -> jax.Array:
    """``[B, W·page_size, K, Dh]``: layer ``layer``'s context of each row, in token order.

    One gather from the whole pool ``[L, P, page_size, K, Dh]`` (no per-layer slice copy).
    """
    x_bwpkd = pool_x[layer, table_bw]
    b, w, ps, k, d = x_bwpkd.shape
    return x_bwpkd.reshape(b, w * ps, k, d)


def paged_attention_reference(
    q_bthd: jax.Array,
    k_new_btkd: jax.Array,
    v_new_btkd: jax.Array,
    k_ctx_bskd: jax.Array,
    v_ctx_bskd: jax.Array,
    ctx_len_b: jax.Array,
    new_valid_bt: jax.Array,
    window: jax.Array | int,
) -> jax.Array:
    """Attention of T new tokens over a row's cached context and over themselves.

    Query ``t`` of row ``b`` has position ``c_b + t`` (``c_b = ctx_len_b[b]``). It reads
    context key ``s`` iff ``s < c_b`` and ``c_b + t - s < window``, and new key ``j`` iff
    ``j <= t``, ``new_valid_bt[b, j]`` and ``t - j < window``:

        out = Σ_s p_s v_ctx[s] + Σ_j p_j v_new[j],   p = softmax over both key sets of
        q·k / sqrt(Dh)

    (grouped-query: query head ``h`` reads kv head ``h // (H / K)``). Scores and softmax in
    float32; the two key sets are never concatenated (no copy of the gathered context).
    """
    b, t, h, hd = q_bthd.shape
    kv_heads = k_ctx_bskd.shape[2]
    s = k_ctx_bskd.shape[1]
    dtype = jnp.promote_types(q_bthd.dtype, k_ctx_bskd.dtype)
    q = (q_bthd.astype(dtype) * jnp.asarray(hd**-0.5, dtype)).reshape(
        b, t, kv_heads, h // kv_heads, hd
    )
    sc_ctx = jnp.einsum(
        "btkgd,bskd->bkgts", q, k_ctx_bskd.astype(dtype), preferred_element_type=jnp.float32
    )
    sc_new = jnp.einsum(
        "btkgd,bjkd->bkgtj", q, k_new_btkd.astype(dtype), preferred_element_type=jnp.float32
    )
    q_pos_bt = ctx_len_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    slot_s = jnp.arange(s, dtype=jnp.int32)
    ok_ctx_bts = (slot_s[None, None] < ctx_len_b[:, None, None]) & (
        q_pos_bt[:, :, None] - slot_s[None, None] < window
    )
    tj = jnp.arange(t, dtype=jnp.int32)
    diff_tj = tj[:, None] - tj[None, :]
    ok_new_btj = (diff_tj >= 0)[None] & (diff_tj < window)[None] & new_valid_bt[:, None, :]
    neg = jnp.finfo(jnp.float32).min
    sc_ctx = jnp.where(ok_ctx_bts[:, None, None], sc_ctx, neg)
    sc_new = jnp.where(ok_new_btj[:, None, None], sc_new, neg)
    m = jnp.maximum(jnp.max(sc_ctx, axis=-1), jnp.max(sc_new, axis=-1))[..., None]
    e_ctx, e_new = jnp.exp(sc_ctx - m), jnp.exp(sc_new - m)
    z = jnp.sum(e_ctx, axis=-1, keepdims=True) + jnp.sum(e_new, axis=-1, keepdims=True)
    out = jnp.einsum(
        "bkgts,bskd->btkgd",
        (e_ctx / z).astype(dtype),
        v_ctx_bskd.astype(dtype),
        preferred_element_type=jnp.float32,
    ) + jnp.einsum(
        "bkgtj,bjkd->btkgd",
        (e_new / z).astype(dtype),
        v_new_btkd.astype(dtype),
        preferred_element_type=jnp.float32,
    )
    return out.reshape(b, t, h, hd).astype(q_bthd.dtype)


def pallas_gpu_decode_attention(
    q_bhd: jax.Array,
    pool_k_pskd: jax.Array,
    pool_v_pskd: jax.Array,
    table_bw: jax.Array,
    lengths_b: jax.Array,
    *,
    interpret: bool = False,
) -> jax.Array:
    """One query per row over ``lengths_b`` pooled tokens with JAX's Pallas GPU kernel.

    ``jax.experimental.pallas.ops.gpu.paged_attention.paged_attention`` takes pages as
    ``[K, P, page_size, Dh]`` and unscaled queries; this pool is ``[P, page_size, K, Dh]`` per
    layer, so the pages are transposed and ``q`` scaled by ``1/sqrt(Dh)`` here. ``interpret``
    runs it on CPU (the wiring test).
    """
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged

    hd = q_bhd.shape[-1]
    k_kpsd = jnp.transpose(pool_k_pskd, (2, 0, 1, 3))
    v_kpsd = jnp.transpose(pool_v_pskd, (2, 0, 1, 3))
    q = (q_bhd.astype(jnp.float32) * hd**-0.5).astype(k_kpsd.dtype)
    pages_per_block = min(8, table_bw.shape[1])
    return gpu_paged.paged_attention(
        q,
        k_kpsd,
        v_kpsd,
        table_bw.astype(jnp.int32),
        lengths_b.astype(jnp.int32),
        pages_per_compute_block=pages_per_block,
        k_splits=1,
        interpret=interpret,
    ).astype(q_bhd.dtype)


def write_pages(
    pool_x: jax.Array, page_idx: jax.Array, offset_idx: jax.Array, values: jax.Array
) -> jax.Array:
    """``pool_x[:, page_idx, offset_idx] = values`` for every layer (one scatter).

    ``values`` is ``[L, *page_idx.shape, K, Dh]``; padded entries point at the trash page.
    """
    return pool_x.at[:, page_idx, offset_idx].set(values.astype(pool_x.dtype))
