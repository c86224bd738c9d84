"""The paged KV cache: page pool layout, a host-side page allocator, attention over pages.

Keys and values live in a pool of fixed-size pages per layer (Kwon et al. 2023, "Efficient
Memory Management for Large Language Model Serving with PagedAttention", vLLM):

    pool.k, pool.v   [L, num_pages, page_size, K, Dh]

and sequence ``n`` reads its context through a page table: its token ``s`` sits at
``pool[:, table[n, s // page_size], s % page_size]``. Page :data:`TRASH_PAGE` takes every
write nobody reads (padded tokens, idle slots) and fills table entries past a sequence's
pages (always masked). The engine that schedules sequences over this pool is ``paged.py``.

Attention is a pure function chosen by name (:data:`ATTENTION_BACKENDS`, resolved for a model
and a platform by :func:`resolve_attention`):

- ``"reference"`` (plain JAX: gather the pages by table, mask by position and window). The
  engine's pool holds one ``[num_pages, page_size, K, Dh]`` buffer per layer (the layout above
  without its L axis, a tuple of L; :func:`init_pool`), and each layer writes its new
  keys/values before it attends (:func:`paged_attention_written`);
  :func:`paged_attention_reference` (the chunk's own keys apart) is the tests' reference.
- ``"pallas_gpu"``: decode through JAX's Pallas GPU ``paged_attention`` kernel
  (:func:`pallas_gpu_paged_decode`), prefill through ``jax.nn.dot_product_attention``
  (``implementation="cudnn"`` on GPU, ``"xla"`` elsewhere) over the gathered pages
  (:func:`dense_prefill_attention`). Pool ``[K, L·num_pages, page_size, Dh]`` each (the
  kernel's ``[K, pages, page_size, Dh]`` with the layers folded into the pages: layer ``l``'s
  page ``p`` is page ``l·num_pages + p``, so the kernel reads the whole pool buffer with an
  offset table, no per-layer slice or transpose).
- ``"ragged_tpu"``: JAX's TPU ``ragged_paged_attention`` for both (:func:`ragged_tpu_attention`).
  Pool ``k = [L·num_pages, page_size, 2K, Dh']`` with keys and values interleaved on the head
  axis (the kernel's ``kv_pages``: key head ``i`` at ``2i``, value head ``i`` at ``2i + 1``),
  ``Dh'`` the head dim padded with zeros to a multiple of 128 (TPU lanes); ``v`` unused (None).

The kernels read the current tokens from the pool, so with them the engine writes each layer's
new keys/values into the pool first (:func:`write_layer`, inside the layer scan) and then
attends (``paged.forward_paged_kernel``).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

TRASH_PAGE = 0
"""The page that takes every write nobody reads (padding, idle slots, unused table entries)."""


class PagePool(NamedTuple):
    """Keys and values of every layer. The reference engine's pool (:func:`init_pool`) holds
    one ``[num_pages, page_size, K, Dh]`` buffer per layer (tuples of L); the module's
    functions on the stacked ``[L, num_pages, page_size, K, Dh]`` form take it as one array;
    the kernels' layouts are in the module docstring."""

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...] | None


class PageAllocator:
    """Host-side page bookkeeping: a free list, reference counts and a reservation count.

    ``reserve(n)`` promises ``n`` pages to a request (fails when fewer than ``n`` free pages are
    unpromised); ``take(n)`` converts promised pages into pages; ``share(pages)`` adds a
    reference to pages in use; ``release(pages)`` drops one reference from each and frees
    those that reach zero; ``unreserve(n)`` returns promises.
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

    def share(self, pages: list[int], refs: int = 1) -> None:
        """Adds ``refs`` references to each of ``pages``, which are held (in use)."""
        for p in pages:
            assert self.refcount[p] > 0, p
            self.refcount[p] += refs

    def release(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refcount[p] > 0, p
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self.free.append(p)


# ---------------------------------------------------------------------------------------------
# Attention over pages (pure functions).


def gather_pages(
    pool_x: jax.Array, layer: jax.Array | int | None, table_bw: jax.Array
) -> jax.Array:
    """``[B, W·page_size, K, Dh]``: layer ``layer``'s context of each row, in token order.

    One gather from the whole pool ``[L, P, page_size, K, Dh]`` (no per-layer slice copy), or
    with ``layer=None`` from one layer's buffer ``[P, page_size, K, Dh]``.
    """
    x_bwpkd = pool_x[table_bw] if layer is None else pool_x[layer, table_bw]
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


def paged_attention_written(
    q_bthd: jax.Array,
    k_ctx_bskd: jax.Array,
    v_ctx_bskd: jax.Array,
    ctx_len_b: jax.Array,
    window: jax.Array | int,
) -> jax.Array:
    """:func:`paged_attention_reference` when the T new tokens' keys/values are already in the
    gathered context (written to the pool first, as the kernels and the static engine do).

    Query ``t`` of row ``b`` (position ``q = c_b + t``, ``c_b = ctx_len_b[b]``) reads context
    key ``s`` iff ``s <= q`` and ``q - s < window``: ``out = softmax(q·k / sqrt(Dh)) v`` over
    those keys, grouped-query, scores and softmax in float32. (Entries of a padded query, past
    a row's valid tokens, may read stale slots; their outputs are discarded by the caller.)
    """
    b, t, h, hd = q_bthd.shape
    kv_heads, s = k_ctx_bskd.shape[2], k_ctx_bskd.shape[1]
    dtype = jnp.promote_types(q_bthd.dtype, k_ctx_bskd.dtype)
    q = (q_bthd.astype(dtype) * jnp.asarray(hd**-0.5, dtype)).reshape(
        b, t, kv_heads, h // kv_heads, hd
    )
    sc = jnp.einsum(
        "btkgd,bskd->bkgts", q, k_ctx_bskd.astype(dtype), preferred_element_type=jnp.float32
    )
    q_pos_bt = ctx_len_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    diff_bts = q_pos_bt[:, :, None] - jnp.arange(s, dtype=jnp.int32)[None, None]
    ok_bts = (diff_bts >= 0) & (diff_bts < window)
    sc = jnp.where(ok_bts[:, None, None], sc, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(sc, axis=-1).astype(dtype)
    out = jnp.einsum(
        "bkgts,bskd->btkgd", p, v_ctx_bskd.astype(dtype), preferred_element_type=jnp.float32
    )
    return out.reshape(b, t, h, hd).astype(q_bthd.dtype)


def _pages_per_block(width: int, cap: int = 8) -> int:
    """The largest divisor of the table width ``width`` that is at most ``cap``."""
    return max(d for d in range(1, min(cap, width) + 1) if width % d == 0)


GPU_DECODE_TUNING: dict[str, int] = {
    "pages_per_compute_block": 8,
    "k_splits": 1,
    "block_h": 16,
    "num_warps": 8,
    "num_stages": 2,
}
"""The Pallas GPU decode kernel's launch parameters and our defaults (jax's, but one kv split:
a decode row's context is short next to the batch, which already fills the grid).
``k_splits`` and ``pages_per_compute_block`` are caps: the kernel gets the largest divisor of
the page table's width up to the first, and of a split's width up to the second.
``PagedOptions.kernel_tuning`` overrides any of them. On an H200 the defaults ran at ~35% of
HBM bandwidth (BENCHMARKS.md, "Accelerator runs"); ``scripts/bench_accelerator.py``'s
``decode_tuning`` part times a few others."""


def check_kernel_tuning(
    tuning: Any, where: str = "generate(engine='paged'): kernel_tuning"
) -> tuple[tuple[str, int], ...]:
    """``tuning`` (a mapping or pairs of :data:`GPU_DECODE_TUNING`'s keys) as sorted ``(key,
    value)`` pairs; a clear error, naming ``where`` it was given, for an unknown key or a value
    that is not an int >= 1."""
    try:
        pairs = tuple(sorted(dict(tuning or {}).items()))
    except (TypeError, ValueError):
        raise ValueError(f"{where} must map launch parameters to ints, got {tuning!r}") from None
    for key, value in pairs:
        if key not in GPU_DECODE_TUNING:
            raise ValueError(
                f"{where} has an unknown key {key!r}; expected some of {sorted(GPU_DECODE_TUNING)}"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}[{key!r}] must be an int >= 1, got {value!r}")
        if key == "block_h" and value % 16:  # the kernel's own rule (its MMA tiles)
            raise ValueError(f"{where}['block_h'] must be a multiple of 16, got {value}")
    return pairs


def pallas_gpu_paged_decode(
    q_bhd: jax.Array,
    k_kpsd: jax.Array,
    v_kpsd: jax.Array,
    table_bw: jax.Array,
    lengths_b: jax.Array,
    *,
    interpret: bool = False,
    tuning: tuple[tuple[str, int], ...] = (),
) -> jax.Array:
    """One query per row over ``lengths_b`` pooled tokens, pages in the kernel's own layout.

    ``jax.experimental.pallas.ops.gpu.paged_attention.paged_attention(q [B, H, Dh],
    k_pages [K, P, page_size, Dh], v_pages, block_tables [B, W], lengths [B])`` with unscaled
    queries: ``q`` is scaled by ``1/sqrt(Dh)`` here. Launch parameters
    :data:`GPU_DECODE_TUNING`, overridden by ``tuning`` (:func:`check_kernel_tuning`);
    ``k_splits`` the largest divisor of ``W`` up to its value and ``pages_per_compute_block``
    that of ``W / k_splits`` (the kernel wants the table split evenly). ``interpret`` runs the
    kernel on CPU (tests).
    """
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged

    kw = GPU_DECODE_TUNING | dict(tuning)
    width = table_bw.shape[1]  # both split the table: caps, met by the largest divisors
    kw["k_splits"] = _pages_per_block(width, kw["k_splits"])
    kw["pages_per_compute_block"] = _pages_per_block(
        width // kw["k_splits"], kw["pages_per_compute_block"]
    )
    hd = q_bhd.shape[-1]
    q = (q_bhd.astype(jnp.float32) * hd**-0.5).astype(k_kpsd.dtype)
    return gpu_paged.paged_attention(
        q,
        k_kpsd,
        v_kpsd,
        table_bw.astype(jnp.int32),
        lengths_b.astype(jnp.int32),
        interpret=interpret,
        **kw,
    ).astype(q_bhd.dtype)


def pallas_gpu_decode_attention(
    q_bhd: jax.Array,
    pool_k_pskd: jax.Array,
    pool_v_pskd: jax.Array,
    table_bw: jax.Array,
    lengths_b: jax.Array,
    *,
    interpret: bool = False,
) -> jax.Array:
    """:func:`pallas_gpu_paged_decode` on one layer of the reference layout
    ``[P, page_size, K, Dh]`` (transposed to the kernel's ``[K, P, page_size, Dh]`` here; the
    engine keeps its pool in the kernel's layout instead and needs no transpose)."""
    k_kpsd = jnp.transpose(pool_k_pskd, (2, 0, 1, 3))
    v_kpsd = jnp.transpose(pool_v_pskd, (2, 0, 1, 3))
    return pallas_gpu_paged_decode(q_bhd, k_kpsd, v_kpsd, table_bw, lengths_b, interpret=interpret)


def dense_prefill_attention(
    q_bthd: jax.Array,
    k_bskd: jax.Array,
    v_bskd: jax.Array,
    ctx_len_b: jax.Array,
    window: jax.Array | int,
    *,
    implementation: Literal["xla", "cudnn"] = "xla",
) -> jax.Array:
    """A prefill chunk over its gathered pages, the chunk's own keys already in them.

    Query ``t`` of row ``b`` sits at position ``q = ctx_len_b[b] + t`` and reads key ``s`` of
    ``k_bskd`` (the row's pooled tokens in order) iff ``s <= q`` and ``q - s < window``:
    ``jax.nn.dot_product_attention`` with that boolean mask and scale ``1/sqrt(Dh)`` (cuDNN
    takes the mask as an additive bias; chunk positions past the row's valid tokens only feed
    padded queries, whose outputs are discarded). Where cuDNN refuses the shapes at trace time
    this warns and uses ``implementation="xla"``.
    """
    t, hd = q_bthd.shape[1], q_bthd.shape[3]
    s = k_bskd.shape[1]
    q_pos_bt = ctx_len_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    slot_s = jnp.arange(s, dtype=jnp.int32)
    diff_bts = q_pos_bt[:, :, None] - slot_s[None, None]
    ok_bts = (diff_bts >= 0) & (diff_bts < window)
    attend = functools.partial(
        jax.nn.dot_product_attention,
        q_bthd,
        k_bskd.astype(q_bthd.dtype),
        v_bskd.astype(q_bthd.dtype),
        mask=ok_bts[:, None],
        scale=hd**-0.5,
    )
    if implementation == "cudnn":
        try:  # cuDNN's shape/dtype/version checks run at trace time
            return attend(implementation="cudnn")
        except (ValueError, NotImplementedError, RuntimeError) as e:
            warnings.warn(
                f"paged prefill: cuDNN attention refused {q_bthd.shape} {q_bthd.dtype} "
                f"({type(e).__name__}: {e}); using implementation='xla'",
                stacklevel=2,
            )
    return attend(implementation="xla")


def ragged_tpu_attention(
    q_bthd: jax.Array,
    kv_pages: jax.Array,
    table_bw: jax.Array,
    ctx_len_b: jax.Array,
    *,
    window: int | None = None,
    kernel: Callable[..., jax.Array] | None = None,
    block_sizes: tuple[int, int] | None = None,
) -> jax.Array:
    """T queries per row at positions ``ctx_len_b + t`` over the row's pooled tokens
    ``[0, ctx_len_b + T)`` (the chunk already written) with JAX's TPU ``ragged_paged_attention``.

    The kernel's arguments (jax 0.10.2, ``jax.experimental.pallas.ops.tpu.
    ragged_paged_attention``): ``q [tokens, H, Dh']`` (rows' queries concatenated),
    ``kv_pages [pages, page_size, 2K, Dh']`` (keys and values interleaved on the head axis),
    ``kv_lens [B]`` (each row's tokens incl. its queries: ``ctx_len_b + T``),
    ``page_indices [B, W]``, ``cu_q_lens [B + 1]`` (here ``b·T``: every row has T queries; a
    padded query past a row's valid tokens only reads keys at or before it and is discarded),
    ``num_seqs [1]``, ``sm_scale = 1/sqrt(Dh)``, ``sliding_window`` (key ``s`` is visible iff
    ``q - s < window``, as in :func:`paged_attention_reference`). ``Dh' >= Dh`` is the pool's
    padded head dim: ``q`` is zero-padded (scores unchanged) and the output sliced back.
    ``kernel`` replaces the kernel by a function of the same arguments (the tests pass the
    module's own ``ref_ragged_paged_attention``); ``block_sizes`` = ``(kv pages, queries)``
    per block, default the kernel's tuned table on a TPU and ``(128, 32)`` (its default)
    clipped to the shapes when compiling without one.
    """
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

    b, t, h, hd = q_bthd.shape
    dp = kv_pages.shape[-1]
    q = jnp.pad(q_bthd.astype(kv_pages.dtype), ((0, 0), (0, 0), (0, 0), (0, dp - hd)))
    q = q.reshape(b * t, h, dp)
    args = (
        q,
        kv_pages,
        (ctx_len_b + t).astype(jnp.int32),
        table_bw.astype(jnp.int32),
        (jnp.arange(b + 1, dtype=jnp.int32) * t),
        jnp.asarray([b], jnp.int32),
    )
    kw: dict = {"sm_scale": hd**-0.5, "sliding_window": window}
    if kernel is None:
        kernel = rpa.ragged_paged_attention
        if block_sizes is None:
            block_sizes = _ragged_block_sizes(q, kv_pages, table_bw.shape[1])
        kw["num_kv_pages_per_block"], kw["num_queries_per_block"] = block_sizes
    out = kernel(*args, **kw)
    return out.reshape(b, t, h, dp)[..., :hd].astype(q_bthd.dtype)


RAGGED_VMEM_BUDGET = 8 * 2**20
"""The most VMEM (as :func:`ragged_vmem_bytes` estimates it) that the TPU kernel's blocks are
sized to when its tuned table has no entry for the shapes. The kernel compiles under XLA's
scoped-VMEM limit, 16 MiB on a v5e by default, and fails past it (``CompileTimeScopedVmemOom``).
The table's default, 128 pages per block, needs 16 MiB for a 1B Llama's keys and values alone
(16 interleaved heads, head dim padded to 128, bf16, 16-token pages): every context of 2,048
tokens or more failed to compile for a v5e. Mosaic's own temporaries come on top of the scratch
(up to ~7 MiB more in the compiles measured for a v5e, growing with the query block), hence half
the limit (``tests/rollout/test_paged_kernels.py`` compiles the shapes it was fitted on)."""


def ragged_vmem_bytes(
    pages_per_block: int,
    queries_per_block: int,
    *,
    page_size: int,
    num_q_heads: int,
    num_combined_kv_heads: int,
    head_dim: int,
    q_dtype: jnp.dtype,
    kv_dtype: jnp.dtype,
) -> int:
    """The VMEM scratch of the TPU ``ragged_paged_attention`` kernel (jax 0.10.2) for these
    blocks, from its scratch shapes, per head block (``get_min_heads_per_blk``; an estimate:
    Mosaic's own temporaries come on top): the double-buffered key/value
    pages ``2 × pages × page_size × kv_heads_blk × Dh'``, the running max and sum
    ``2 × kv_heads_blk/2 × queries·ratio × 128`` f32, the accumulator ``queries × q_heads_blk ×
    Dh'`` f32, and the query and output blocks (double-buffered by the pipeline)."""
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

    hq, hkv = rpa.kernel.get_min_heads_per_blk(
        num_q_heads, num_combined_kv_heads, q_dtype, kv_dtype
    )
    ratio = 2 * num_q_heads // num_combined_kv_heads
    kv = 2 * pages_per_block * page_size * hkv * head_dim * jnp.dtype(kv_dtype).itemsize
    lm = 2 * (hkv // 2) * queries_per_block * ratio * 128 * 4
    acc = queries_per_block * hq * head_dim * 4
    q_out = 2 * 2 * queries_per_block * hq * head_dim * jnp.dtype(q_dtype).itemsize
    return kv + lm + acc + q_out


def _ragged_block_sizes(q: jax.Array, kv_pages: jax.Array, width: int) -> tuple[int, int]:
    """``(pages, queries)`` per block: the kernel's tuned table's entry on a TPU (the table reads
    the attached chip's kind); for shapes it has not tuned, and off a TPU, its default ``(128,
    32)`` clipped to the shapes, with the pages halved until :func:`ragged_vmem_bytes` is within
    :data:`RAGGED_VMEM_BUDGET` (the default does not fit long contexts of wide models)."""
    from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

    tokens, h, dp = q.shape
    _, page_size, combined, _ = kv_pages.shape
    pages, queries = default = min(width, 128), min(tokens, 32)
    if jax.devices()[0].platform == "tpu":
        hq, hkv = rpa.kernel.get_min_heads_per_blk(h, combined, q.dtype, kv_pages.dtype)
        tuned = rpa.get_tuned_block_sizes(
            q.dtype, kv_pages.dtype, hq, hkv // 2, dp, page_size, tokens, width
        )
        if tuned != default:  # an entry of the table, which was compiled on the chip
            return tuned

    def vmem(pages: int) -> int:
        return ragged_vmem_bytes(
            pages,
            queries,
            page_size=page_size,
            num_q_heads=h,
            num_combined_kv_heads=combined,
            head_dim=dp,
            q_dtype=q.dtype,
            kv_dtype=kv_pages.dtype,
        )

    while pages > 1 and vmem(pages) > RAGGED_VMEM_BUDGET:
        pages //= 2
    return pages, queries


# ---------------------------------------------------------------------------------------------
# Choosing a backend, and the kernels' pools.

AttentionName = Literal["auto", "reference", "pallas_gpu", "ragged_tpu"]
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "reference", "pallas_gpu", "ragged_tpu")
"""``PagedOptions.attention`` values; ``auto``: TPU -> ragged_tpu, GPU -> pallas_gpu, else (or
when that kernel cannot serve the model) reference."""

_AUTO = {"tpu": "ragged_tpu", "gpu": "pallas_gpu"}


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """A kernel backend as the compiled programs see it (static, hashable).

    Attributes:
      name: ``"pallas_gpu"`` or ``"ragged_tpu"``.
      num_pages: pages per layer (layer ``l``'s page ``p`` is pool page ``l·num_pages + p``).
      page_size: tokens per page.
      head_dim: the model's head dim ``Dh`` (the TPU pool's may be padded).
      window: the model's one sliding window, None for full attention (ragged_tpu: the
        kernel's static ``sliding_window``; pallas_gpu refuses windowed models).
      interpret: run the Pallas GPU kernel in interpret mode (off a GPU: the tests).
      prefill_impl: ``jax.nn.dot_product_attention``'s implementation for pallas_gpu prefill
        (``"cudnn"`` on GPU, for half-precision inputs with ``Dh <= 128``; else ``"xla"``).
      tuning: the pallas_gpu decode kernel's launch parameters that differ from
        :data:`GPU_DECODE_TUNING` (sorted pairs; :func:`check_kernel_tuning`).
    """

    name: str
    num_pages: int
    page_size: int
    head_dim: int
    window: int | None = None
    interpret: bool = False
    prefill_impl: str = "xla"
    tuning: tuple[tuple[str, int], ...] = ()


def kernel_refusal(
    name: str,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    windows: tuple[int | None, ...],
    cache_dtype: jnp.dtype,
) -> str | None:
    """Why kernel ``name`` cannot serve a model of these shapes (None: it can)."""
    if name == "pallas_gpu":
        if any(w is not None for w in windows):
            return (
                f"it has sliding-window layers (windows {sorted({w for w in windows if w})}); "
                "the Pallas GPU paged_attention kernel has no window"
            )
        if head_dim % 16:
            return f"head_dim {head_dim} is not a multiple of 16 (Triton dot tiles)"
        if num_heads % num_kv_heads:
            return f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        return None
    if name == "ragged_tpu":
        if len(set(windows)) > 1:
            return (
                f"its layers have different windows {sorted(set(windows), key=str)}; the TPU "
                "kernel's sliding_window is one static int per call"
            )
        from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

        try:
            rpa.kernel.get_min_heads_per_blk(
                num_heads, 2 * num_kv_heads, jnp.dtype(cache_dtype), jnp.dtype(cache_dtype)
            )
        except (ValueError, AssertionError) as e:
            return f"{2 * num_kv_heads} interleaved kv heads in {jnp.dtype(cache_dtype)}: {e}"
        return None
    raise ValueError(f"kernel_refusal: {name!r} is not a kernel backend")


def resolve_attention(
    name: str,
    *,
    platform: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    windows: tuple[int | None, ...],
    cache_dtype: jnp.dtype,
) -> str:
    """The backend that runs: ``name``, or for ``"auto"`` the platform's kernel if it can serve
    the model, else ``"reference"`` (the whole model; there is no per-layer fallback).

    Raises a ValueError for an unknown name, a kernel that cannot serve the model, and
    ``ragged_tpu`` off a TPU (its interpret mode fails in jax 0.10.2: the interpreter has no
    reshaped-ref loads). ``pallas_gpu`` off a GPU runs in interpret mode (slow; tests).
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"generate(engine='paged'): attention must be one of {ATTENTION_BACKENDS}, got {name!r}"
        )
    shapes = dict(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        windows=windows,
        cache_dtype=cache_dtype,
    )
    if name == "auto":
        want = _AUTO.get(platform)
        return want if want is not None and kernel_refusal(want, **shapes) is None else "reference"
    if name == "reference":
        return name
    why = kernel_refusal(name, **shapes)
    if why is not None:
        raise ValueError(
            f"generate(engine='paged'): attention={name!r} cannot serve this model: {why}; "
            "use attention='reference' (or 'auto', which falls back to it)"
        )
    if name == "ragged_tpu" and platform != "tpu":
        raise ValueError(
            f"generate(engine='paged'): attention='ragged_tpu' runs on TPU only (the "
            f"parameters are on {platform!r}; the kernel has no working CPU interpret mode in "
            "jax 0.10.2); use 'auto' or 'reference'"
        )
    return name


def kernel_spec(
    name: str,
    *,
    num_pages: int,
    page_size: int,
    head_dim: int,
    window: int | None,
    platform: str,
    tuning: Any = (),
) -> KernelSpec | None:
    """The :class:`KernelSpec` of a resolved backend (None for ``"reference"``). ``tuning``
    (:func:`check_kernel_tuning`) is the pallas_gpu decode kernel's; the other backends take
    none (ragged_tpu reads jax's tuned block-size table) and ignore it, so that one config
    serves every platform."""
    tuning = check_kernel_tuning(tuning)
    if name == "reference":
        return None
    on_gpu = platform == "gpu"
    return KernelSpec(
        name=name,
        num_pages=num_pages,
        page_size=page_size,
        head_dim=head_dim,
        window=window,
        interpret=name == "pallas_gpu" and not on_gpu,
        prefill_impl="cudnn" if on_gpu else "xla",
        tuning=tuning if name == "pallas_gpu" else (),
    )


def _padded_head_dim(head_dim: int) -> int:
    return -(-head_dim // 128) * 128


def init_pool(
    spec: KernelSpec | None,
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: jnp.dtype,
) -> PagePool:
    """A zero pool in the backend's layout (module docstring)."""
    if spec is None:  # one buffer per layer (updated in place by the unrolled layers)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        return PagePool(
            tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        )
    if spec.name == "pallas_gpu":
        shape = (num_kv_heads, num_layers * num_pages, page_size, head_dim)
        return PagePool(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    shape = (num_layers * num_pages, page_size, 2 * num_kv_heads, _padded_head_dim(head_dim))
    return PagePool(jnp.zeros(shape, dtype), None)


def pool_spec(spec: KernelSpec | None, num_kv_heads: int, tensor: int) -> PartitionSpec:
    """The pool's layout on an engine whose mesh has a ``tensor`` axis of that size: each
    buffer's KV-head axis split over it (a device holds its own heads' keys and values, as
    vLLM's tensor-parallel workers do), when ``tensor`` divides K; else replicated. The
    reference layout ``[P, page_size, K, Dh]`` and the TPU one ``[L·P, page_size, 2K, Dh']``
    (each head's key and value adjacent, so a contiguous split keeps them together) split
    axis 2, the GPU one ``[K, L·P, page_size, Dh]`` axis 0."""
    if tensor <= 1 or num_kv_heads % tensor:
        return PartitionSpec()
    if spec is not None and spec.name == "pallas_gpu":
        return PartitionSpec("tensor", None, None, None)
    return PartitionSpec(None, None, "tensor", None)


def constrain_pool(pool: PagePool, spec: KernelSpec | None, num_kv_heads: int) -> PagePool:
    """``pool`` held in :func:`pool_spec`'s layout inside a program run under
    ``jax.set_mesh`` (a no-op without a ``tensor`` axis): the layout the engine put it in, so
    a donated pool comes back as it went in."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "tensor" not in mesh.axis_names:
        return pool
    layout = NamedSharding(mesh, pool_spec(spec, num_kv_heads, mesh.shape["tensor"]))
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, layout), pool)


def write_layer(
    spec: KernelSpec,
    pool: PagePool,
    layer: jax.Array | int,
    page_idx: jax.Array,
    offset_idx: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
) -> PagePool:
    """Layer ``layer``'s new keys/values ``[*page_idx.shape, K, Dh]`` into a kernel pool at
    ``(page_idx, offset_idx)`` (padded entries point at the trash page); one scatter each."""
    page = layer * spec.num_pages + page_idx
    if spec.name == "pallas_gpu":
        return PagePool(
            pool.k.at[:, page, offset_idx].set(jnp.moveaxis(k_new, -2, 0).astype(pool.k.dtype)),
            pool.v.at[:, page, offset_idx].set(jnp.moveaxis(v_new, -2, 0).astype(pool.v.dtype)),
        )
    *lead, kv_heads, hd = k_new.shape
    kv = jnp.stack([k_new, v_new], axis=-2).reshape(*lead, 2 * kv_heads, hd)
    pad = [(0, 0)] * (kv.ndim - 1) + [(0, pool.k.shape[-1] - hd)]
    return PagePool(pool.k.at[page, offset_idx].set(jnp.pad(kv, pad).astype(pool.k.dtype)), None)


def kernel_attention(
    spec: KernelSpec,
    pool: PagePool,
    layer: jax.Array | int,
    q_bthd: jax.Array,
    table_bw: jax.Array,
    ctx_len_b: jax.Array,
    window: jax.Array | int,
) -> jax.Array:
    """Layer ``layer``'s T queries per row (positions ``ctx_len_b + t``) over the pool, the
    current tokens already written (:func:`write_layer`): T = 1 is a decode step."""
    table = layer * spec.num_pages + table_bw
    t = q_bthd.shape[1]
    if spec.name == "ragged_tpu":
        return ragged_tpu_attention(q_bthd, pool.k, table, ctx_len_b, window=spec.window)
    if t == 1:
        out_bhd = pallas_gpu_paged_decode(
            q_bthd[:, 0],
            pool.k,
            pool.v,
            table,
            ctx_len_b + 1,
            interpret=spec.interpret,
            tuning=spec.tuning,
        )
        return out_bhd[:, None]
    impl = spec.prefill_impl
    if q_bthd.dtype not in (jnp.bfloat16, jnp.float16) or spec.head_dim > 128:
        impl = "xla"  # cuDNN flash attention: half precision, Dh <= 128
    k_bskd, v_bskd = (_gather_kernel_layout(x, table) for x in (pool.k, pool.v))
    return dense_prefill_attention(q_bthd, k_bskd, v_bskd, ctx_len_b, window, implementation=impl)


def _gather_kernel_layout(x_kpsd: jax.Array, table_bw: jax.Array) -> jax.Array:
    """``[B, W·page_size, K, Dh]`` from the GPU layout ``[K, pages, page_size, Dh]``."""
    x_kbwpd = x_kpsd[:, table_bw]
    k, b, w, ps, d = x_kbwpd.shape
    return jnp.transpose(x_kbwpd, (1, 2, 3, 0, 4)).reshape(b, w * ps, k, d)


def write_pages(
    pool_x: jax.Array, page_idx: jax.Array, offset_idx: jax.Array, values: jax.Array
) -> jax.Array:
    """``pool_x[:, page_idx, offset_idx] = values`` for every layer (one scatter).

    ``values`` is ``[L, *page_idx.shape, K, Dh]``; padded entries point at the trash page.
    """
    return pool_x.at[:, page_idx, offset_idx].set(values.astype(pool_x.dtype))
