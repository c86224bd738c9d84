"""The paged rollout engine: continuous batching over a paged KV cache (``engine="paged"``).

Memory: the page pool of ``pages.py`` (``[L, num_pages, page_size, K, Dh]`` keys and values,
page tables, page 0 a trash page). A host-side :class:`~jaxrl_llm.rollout.pages.PageAllocator`
hands pages out of a free list as a sequence grows and takes them back when it ends, so KV
memory follows the live tokens, not ``rows x (P + T)``. The G samples of a prompt share the
prompt's full pages (prefill once, no copy, reference-counted); only the partially filled last
prompt page exists once per sample, written G times by the prefill itself (copy-on-write done
eagerly for that one page). Prompts that begin alike share those whole pages too
(``PagedOptions.prefix_sharing``; automatic prefix caching within a call, as vLLM's and
SGLang's): a host index of the held full prompt pages, keyed by the page before and the
page's tokens, gives a prompt its leading pages, and its prefill starts after them.

Scheduling (continuous batching, Yu et al. 2022, "Orca"; admission and preemption as in vLLM,
Kwon et al. 2023): ``num_slots`` decode slots. A prompt is admitted when G slots are free and
the free pages hold its prompt and its samples' next dispatch, not its worst case: KV memory,
and so the number of sequences decoding at once, follows the live tokens. Before each decode
dispatch every live slot takes the pages its next tokens need; when the pool cannot give them,
the dispatch runs fewer steps, and when it cannot give even one step's, the most recently
admitted sequence is preempted: its pages go back to the pool and it waits, first in the queue,
to be recomputed (its prompt and tokens so far prefilled again; with prefix sharing, from
after the leading prompt pages still held, by its siblings or a prompt alike) and continued
from the token it had reached with the same keys. Up to 32 admitted prompts are
prefilled together, in chunks of at most ``prefill_chunk`` tokens (chunked prefill, Agrawal et
al. 2023, "Sarathi"), between decode dispatches; each decode dispatch is a ``lax.while_loop`` of
``steps_per_dispatch`` one-token steps over the live slots, packed into the smallest power-of-two
row bucket that holds them (at least 8, at most ``num_slots``: the batch's long tail decodes
at the width of what is left), so the host is visited once per k tokens. A slot whose sequence
stops (a stop id, or its own budget ``max_new_tokens_bg[b, g]``) idles until the dispatch ends;
with prompts waiting, a dispatch ends early (a ``while_loop``) as soon as G slots are free, and
the slots are refilled. Compiled shapes are bucketed (rows in powers of two, prefill chunk
widths 16, 32, 48, 64, 96, 128, ..., page-table width in multiples of 128 tokens), so a run
compiles a handful of programs and a second run with the same buckets compiles none.

Model. No second model definition: both programs run the model's own
:class:`~jaxrl_llm.models.transformer.DecoderLayer` modules with an ``attend`` callable. The
stacked layer's weights are sliced into per-layer copies once per :func:`run`
(:func:`engine_params`, passed to every call) and the layers run unrolled: a ``scan`` over the
stacked weights copies each layer's kernels out of the stack at every step (XLA:CPU and
XLA:GPU both). On the reference path (:func:`forward_paged`) each layer has its own pool
buffer: it writes its new keys/values there first (in place) and then attends over its
gathered pages (:func:`~jaxrl_llm.rollout.pages.paged_attention_written`).
So LoRA adapters and quantised kernels (``_Proj``), q/k norms, biases, RoPE schedules and
sliding windows are the trainer's.

Randomness. Token ``t`` of sample ``g`` of prompt ``b`` is drawn with the key
``fold_in(fold_in(rng, b·G + g), t)`` (one uniform per row, ``sampling.sample`` with per-row
keys), so a sequence's tokens do not depend on its slot, admission order or neighbours;
``run(seq_ids_bg=, token_offsets_bg=)`` replaces ``b·G + g`` and starts ``t`` at an offset, so a
partial rollout (``partial.py``) continues a sequence with the keys it would have had. (The
static engine draws from ``fold_in(rng, t)`` per batch: sampled tokens differ between the two
engines for the same key; greedy tokens agree.)

Kernels. ``PagedOptions.attention`` picks the attention (``pages.py``): ``"reference"``
(above), ``"pallas_gpu"`` (decode through JAX's Pallas GPU ``paged_attention``, prefill through
``jax.nn.dot_product_attention``, cuDNN on GPU, over the gathered pages), ``"ragged_tpu"`` (JAX's
TPU ``ragged_paged_attention`` for both) or ``"auto"`` (default: TPU -> ragged_tpu, GPU ->
pallas_gpu, where the kernel can serve the model on one device; else reference; on CPU always
reference). The kernels read the current tokens from the pool, so with a kernel each layer
writes its new keys/values into the pool first and then attends (:func:`forward_paged_kernel`,
one pool buffer for all layers, threaded through them and updated in place, kept in the
kernel's own layout: no per-step transpose).
Verified: the GPU kernel
path in interpret mode on CPU (attention = reference; the whole engine = the reference engine's
greedy tokens, log-probs within 1e-5); the TPU path's layout with the kernel module's own
reference, and its programs compiled for a v5e chip through libtpu (no TPU; its interpret mode
fails in jax 0.10.2). Neither kernel has been run on its hardware here.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import memory_maps
from jaxrl_llm.models.rope import rope_cos_sin, rope_frequencies
from jaxrl_llm.models.transformer import CausalLM, DecoderLayer, layer_windows
from jaxrl_llm.rollout import pages as pages_lib
from jaxrl_llm.rollout import sampling, stealing
from jaxrl_llm.rollout.decode import _attention as dense_decode_attention
from jaxrl_llm.rollout.decode import unstack_layers
from jaxrl_llm.rollout.pages import (
    TRASH_PAGE,
    KernelSpec,
    PageAllocator,
    PagePool,
    gather_pages,
    paged_attention_written,
)

Params = dict[str, Any]


_MIN_TABLE_TOKENS = 128
"""Page tables are a multiple of this many tokens wide: a few compiled widths per run."""

_PREFILL_ROWS = 32
"""At most this many prompts are prefilled in one call (rows bucketed to powers of two)."""


def _chunk_width(n: int) -> int:
    """A prefill chunk's width bucket for ``n`` tokens: the next of 16, 32, 48, 64, 96, 128,
    192, 256, ... (powers of two and 1.5x them): at most a third of padding, few shapes."""
    w = 16
    while w < n:
        w = w * 3 // 2 if w & (w - 1) == 0 and w >= 32 else _next_pow2(w + 1)
    return w


_MIN_SLOT_BUCKET = 8
"""Decode dispatches run at least this many rows (or ``num_slots``): fewer compiled shapes."""

_DEFAULT_MAX_SLOTS = 256
"""The default ``num_slots`` is at most this (vLLM's default ``max_num_seqs``)."""

_DEFAULT_POOL_SEQS = 64
"""The default pool holds this many sequences' worst case (a longest prompt and
``max_new_tokens``), or ``num_slots`` if fewer; more, shorter ones decode in it at once."""


@dataclasses.dataclass(frozen=True)
class PagedOptions:
    """Sizes of the paged engine (all optional; defaults fit the request).

    Attributes:
      page_size: tokens per page.
      num_slots: decode slots (the most sequences decoded at once; vLLM's ``max_num_seqs``);
        default ``min(next_pow2(B·G), 256)`` and at least G. Must be >= G (a prompt's G
        samples are admitted together).
      num_pages: pages in the pool, the trash page included; default enough for
        ``min(num_slots, 64)`` sequences to hold a longest prompt (``max_prompt_length``, or
        the call's longest prompt if longer) plus ``max_new_tokens`` each (the static engine's
        memory for that many rows), plus the trash page. The pool is
        allocated at this size and caps KV memory: sequences are admitted while their live
        tokens fit, and preempted (recomputed later) when they outgrow it. Each sample's
        worst case alone must fit.
      steps_per_dispatch: the most decode steps per compiled dispatch (the host visits once
        per k tokens); a dispatch returns earlier when G slots free up for waiting prompts, or
        when the live rows fit half its row bucket (none waiting).
      prefill_chunk: longest prefill chunk in tokens (a power of two); longer prompts are
        prefilled in several chunks.
      attention: the attention backend (``pages.ATTENTION_BACKENDS``): ``"reference"`` (plain
        JAX, any platform), ``"pallas_gpu"`` (Pallas GPU ``paged_attention`` for decode,
        ``jax.nn.dot_product_attention``, cuDNN on GPU, for prefill; interpret mode off a GPU),
        ``"ragged_tpu"`` (TPU ``ragged_paged_attention``; TPU only) or ``"auto"``: the
        platform's kernel (TPU -> ragged_tpu, GPU -> pallas_gpu) when it can serve the model
        on one device, else reference. A kernel named explicitly that cannot serve the model
        (pallas_gpu: sliding windows, head dim not a multiple of 16; ragged_tpu: layers with
        different windows, kv heads the kernel cannot tile) is an error; ``auto`` falls back
        to reference for the whole model (no per-layer mix).
      kernel_tuning: launch parameters of the pallas_gpu decode kernel that replace
        ``pages.GPU_DECODE_TUNING``'s (``pages_per_compute_block``, ``k_splits``, ``block_h``,
        ``num_warps``, ``num_stages``), as a mapping or ``(key, value)`` pairs; the other
        backends ignore them (one config for every platform), an unknown key is an error.
      tensor_parallel: devices per engine (``generate``; vLLM's ``tensor_parallel_size``,
        verl's rollout ``tensor_model_parallel_size``): ``0``, one engine per data shard of
        the parameters' mesh (its ``tensor`` axis within it); ``t >= 1``, the mesh's ``n``
        devices regrouped into ``n / t`` engines of ``t`` consecutive devices, the weights
        split over each engine's devices (heads, MLP, vocabulary), whatever the train layout
        (``paged_dp.regroup``): under FSDP alone each engine otherwise holds a whole copy.
      max_prompt_length: the longest prompt the default pool is sized for (vLLM sizes its
        pool once, not per request). The pool's shape is part of every compiled program, so
        a pool sized from each call's longest prompt recompiles the engine whenever a batch's
        longest prompt crosses a page; with this set (the trainer sets
        ``data.max_prompt_length``), calls whose prompts are no longer share one pool shape.
        ``None``: each call's longest prompt.
      memory_utilization: with ``num_pages`` not given, on devices that report their memory
        (GPU, TPU; ``Device.memory_stats``), the fraction of each device's memory
        (``bytes_limit``) that may be in use while the engine samples (vLLM's and verl's
        ``gpu_memory_utilization``): the pool takes what is left of it after the arrays
        resident when the engine starts (the trainer's state, the engine's weights) and the
        temporaries of the engine's largest programs (compiled once to measure them), up to
        every live sequence's worst case. Sized at an engine's first call and kept for the
        process (one pool shape, no recompiles; :func:`fit_pool_to_memory`). ``None``, a
        CPU, or ``num_pages`` given: the default above.
      prefix_sharing: prompts that begin with the same tokens share those pages (automatic
        prefix caching within a call, as vLLM's and SGLang's; the G samples of a prompt share
        its pages either way): a prompt whose leading full pages are already in the pool,
        written by an earlier prompt of the call and still held (or pinned for it), points its
        page table at them and is prefilled from there on. A prompt whose match another
        prompt of the same prefill call would write waits for the next call (SGLang's
        in-batch deferral), so the common prefix is computed once. A preempted sequence is
        recomputed the same way: from after its prompt's leading full pages that are still
        held (by its G siblings, another prompt alike, or a sibling recomputed in an earlier
        prefill call: siblings preempted together wait one call for the first one's prompt
        pages). ``False``: every prompt's and every recomputed sequence's pages are its own.
      work_stealing: with several data-parallel engines in a process (``paged_dp``), an
        engine that has run its own share of the prompts and has room takes the last prompts
        another engine has waiting for room (:mod:`~jaxrl_llm.rollout.stealing`), so a share
        of long completions does not hold up the call while other engines idle; in a
        ``jax.distributed`` job, across processes too (the prompts lent through the
        coordination service's key-value store, their outputs sent back the same way). Only
        prompts that wait for slots or pages move: a call whose every share fits its engine at
        once runs the contiguous split. A moved sample keeps its keys (its global sequence id), so
        its tokens are the split run's up to float rounding (beside other rows its logits may
        differ in the last bits, and a near-tie then samples another token, as between any
        two batch layouts); which engine runs a moved prompt (the per-engine stats) depends on
        timing. ``False``: each engine runs its contiguous share only.
    """

    page_size: int = 16
    num_slots: int | None = None
    num_pages: int | None = None
    steps_per_dispatch: int = 64
    prefill_chunk: int = 256
    attention: str = "auto"
    kernel_tuning: Any = ()
    tensor_parallel: int = 0
    max_prompt_length: int | None = None
    memory_utilization: float | None = 0.9
    prefix_sharing: bool = True
    work_stealing: bool = True


class PagedStats(NamedTuple):
    """What a paged run used: peak pages held (trash excluded), bytes per page (keys and
    values of every layer), compiled-program calls, pages still held at the end (0), how
    many times a sequence was preempted (its pages taken back, to be recomputed), the
    pool's pages (the trash page included; :attr:`PagedOptions.num_pages` as run, after
    :attr:`PagedOptions.memory_utilization`), the context tokens the prefill calls ran
    (recomputations included), the prompt tokens they did not run because pages already
    held them (another prompt's, or for a recomputed sequence its siblings';
    :attr:`PagedOptions.prefix_sharing`), and the decode steps
    the dispatches ran (a dispatch's ``steps_per_dispatch`` or fewer: the engine's
    sequential decode work, the time it takes where a step's time barely depends on its rows,
    as on an accelerator), and the prompts it took from another engine's queue, of its own
    process or another (:attr:`PagedOptions.work_stealing`)."""

    peak_pages: int
    page_bytes: int
    decode_dispatches: int
    prefill_calls: int
    pages_in_use_at_end: int
    preemptions: int = 0
    pool_pages: int = 0
    prefill_tokens: int = 0
    shared_prompt_tokens: int = 0
    decode_steps: int = 0
    prompts_stolen: int = 0

    @property
    def peak_kv_bytes(self) -> int:
        return self.peak_pages * self.page_bytes


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


# ---------------------------------------------------------------------------------------------
# The model over the pool.


def _embed_at(
    lm: CausalLM, tokens_bt: jax.Array, positions_bt: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The token embeddings ``[B, T, D]`` and RoPE ``cos``/``sin`` at ``positions_bt``."""
    c = lm.config
    dtype = c.jnp_dtype
    x_btd = lm.model.embed_tokens(tokens_bt, dtype)
    inv_freq, rope_scaling = rope_frequencies(c)
    cos, sin = rope_cos_sin(positions_bt, inv_freq, rope_scaling, dtype)
    return x_btd, cos, sin


def _new_positions(ctx_len_b: jax.Array, t: int) -> jax.Array:
    """Positions ``[B, T]`` of T new tokens after a context of ``ctx_len_b``."""
    return ctx_len_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None]


def _per_copy(
    write_page_bt: jax.Array, k_btkd: jax.Array, v_btkd: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Keys/values broadcast to the G copies of a prefill chunk when ``write_page_bt`` is
    ``[B, T, G]``; unchanged for ``[B, T]``."""
    if write_page_bt.ndim == 3:
        shape = (*write_page_bt.shape, *k_btkd.shape[2:])
        k_btkd = jnp.broadcast_to(k_btkd[:, :, None], shape)
        v_btkd = jnp.broadcast_to(v_btkd[:, :, None], shape)
    return k_btkd, v_btkd


def forward_paged(
    lm: CausalLM,
    layers: tuple[DecoderLayer, ...],
    pool: PagePool,
    tokens_bt: jax.Array,
    ctx_len_b: jax.Array,
    table_bw: jax.Array,
    write_page_bt: jax.Array,
    write_off_bt: jax.Array,
) -> tuple[jax.Array, PagePool]:
    """The model on T new tokens per row whose context is in the (reference, per-layer) pool.

    Returns the final hidden states ``[B, T, D]`` and the pool with the new tokens' keys and
    values written at ``(write_page_bt, write_off_bt)`` (``[B, T]``, or ``[B, T, G]`` for the G
    copies of a prefill chunk, the offsets of the same shape; padding at the trash page).
    Positions are ``ctx_len_b + t``; ``table_bw`` must cover ``[0, ctx_len_b + T)``.
    The layers are the model's own modules on per-layer weights (:func:`engine_params`, sliced
    once per :func:`run`), run unrolled
    (as ``decode.py``), each layer with its own pool buffer: it first writes its new
    keys/values into that buffer (in place) and then attends over its gathered pages
    (:func:`pages.paged_attention_written`), the order of the kernels and of the static
    engine. Measured on XLA:CPU (BENCHMARKS.md "Rollout engines"): a ``scan`` over the stacked
    layers copies each layer's weights (``dynamic-slice``) at every step, and attending before
    writing (the new keys apart) made XLA copy every layer's buffers twice per step (the
    gather and the in-place scatter of one buffer are unordered without a data dependence).
    """
    c = lm.config
    decoder = lm.model
    x_btd, cos, sin = _embed_at(lm, tokens_bt, _new_positions(ctx_len_b, tokens_bt.shape[1]))
    windows = layer_windows(c)
    new_k, new_v = list(pool.k), list(pool.v)
    for i, layer in enumerate(layers):

        def attend(
            q_bthd: jax.Array, k_btkd: jax.Array, v_btkd: jax.Array, i: int = i
        ) -> jax.Array:
            k_btkd, v_btkd = _per_copy(write_page_bt, k_btkd, v_btkd)
            for buf, x in ((new_k, k_btkd), (new_v, v_btkd)):
                buf[i] = buf[i].at[write_page_bt, write_off_bt].set(x.astype(buf[i].dtype))
            return paged_attention_written(
                q_bthd,
                gather_pages(new_k[i], None, table_bw),
                gather_pages(new_v[i], None, table_bw),
                ctx_len_b,
                windows[i],
            )

        x_btd, _ = layer(x_btd, cos, sin, attend)
    return decoder.norm(x_btd), PagePool(tuple(new_k), tuple(new_v))


class DenseContext(NamedTuple):
    """One decode dispatch's contexts, gathered from the pool once per dispatch, per layer:
    keys ``[N, K, Dh, S]`` and values ``[N, K, S, Dh]`` (``decode.py``'s layout; ``S`` = the
    page table's tokens; row ``n``'s token at position ``s`` in slot ``s``)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]


def gather_dense(pool: PagePool, table_nw: jax.Array) -> DenseContext:
    """:class:`DenseContext` of the rows' tables (one gather per layer and pool array)."""

    def keys(x: jax.Array) -> jax.Array:
        return jnp.transpose(gather_pages(x, None, table_nw), (0, 2, 3, 1))

    def values(x: jax.Array) -> jax.Array:
        return jnp.transpose(gather_pages(x, None, table_nw), (0, 2, 1, 3))

    return DenseContext(tuple(map(keys, pool.k)), tuple(map(values, pool.v)))


def forward_decode_dense(
    lm: CausalLM,
    layers: tuple[DecoderLayer, ...],
    dense: DenseContext,
    token_n: jax.Array,
    lens_n: jax.Array,
    alive_n: jax.Array,
) -> tuple[jax.Array, DenseContext]:
    """One decode step of the reference engine over a dispatch's :class:`DenseContext`.

    Row ``n`` feeds ``token_n`` at position ``lens_n``: each layer writes its new key/value
    into the dense context at slot ``lens_n`` (live rows only), then attends over slots
    ``s <= lens_n`` inside its window (``decode._attention``, the static engine's). The same
    numbers as :func:`forward_paged` (same keys, same masks, f32 softmax), without gathering
    the pages at every step: XLA:CPU's gather of a layer's context (~3 MB at 32 rows x 128
    tokens) costs about as much as the rest of the attention, 60 of them per step. The pool
    is not written here: :func:`write_back` copies a dispatch's new keys and values into it
    once, after its last step.
    Returns the final hidden states ``[N, 1, D]`` and the dense context.
    """
    c = lm.config
    decoder = lm.model
    x_n1d, cos, sin = _embed_at(lm, token_n[:, None], lens_n[:, None])
    s = dense.k[0].shape[-1]
    slot_s = jnp.arange(s, dtype=jnp.int32)
    dense_pos_n = jnp.where(alive_n, lens_n, s)  # out of range: dropped
    rows = jnp.arange(token_n.shape[0])
    allowed: dict[int | None, jax.Array] = {}
    for window in {c.window(i) for i in range(c.num_layers)}:
        ok_ns = slot_s[None] <= lens_n[:, None]
        if window is not None:
            ok_ns = ok_ns & (lens_n[:, None] - slot_s[None] < window)
        allowed[window] = ok_ns
    dk, dv = list(dense.k), list(dense.v)
    for i, layer in enumerate(layers):

        def attend(
            q_bthd: jax.Array, k_btkd: jax.Array, v_btkd: jax.Array, i: int = i
        ) -> jax.Array:
            k_nkd, v_nkd = k_btkd[:, 0], v_btkd[:, 0]
            dk[i] = dk[i].at[rows, :, :, dense_pos_n].set(k_nkd.astype(dk[i].dtype), mode="drop")
            dv[i] = dv[i].at[rows, :, dense_pos_n].set(v_nkd.astype(dv[i].dtype), mode="drop")
            out_nhd = dense_decode_attention(q_bthd[:, 0], dk[i], dv[i], allowed[c.window(i)])
            return out_nhd[:, None]

        x_n1d, _ = layer(x_n1d, cos, sin, attend)
    return decoder.norm(x_n1d), DenseContext(tuple(dk), tuple(dv))


def write_back(
    pool: PagePool,
    dense: DenseContext,
    table_nw: jax.Array,
    lens_n: jax.Array,
    valid_kn: jax.Array,
    page_size: int,
) -> PagePool:
    """The pool with a decode dispatch's new keys and values copied in from its dense context.

    Row ``n`` decoded at step ``j`` of the dispatch (``valid_kn[j, n]``) wrote position
    ``lens_n + j`` (``lens_n``: its length when the dispatch began; a row that stops stays
    stopped, so its valid steps are the first ones); that slot of the dense context goes to
    page ``table_nw[n, pos // page_size]``, offset ``pos % page_size``, and invalid steps to
    the trash page. One gather and one scatter per layer and pool array per dispatch, in
    place of two small scatters per layer at every step, and the pool stays out of the decode
    loop's carry (on XLA:CPU the rollout benchmark moved by less than its run-to-run noise:
    BENCHMARKS.md "Rollout engines").
    """
    k = valid_kn.shape[0]
    pos_nk = lens_n[:, None] + jnp.arange(k, dtype=jnp.int32)[None]
    valid_nk = valid_kn.T
    slot_nk = jnp.where(valid_nk, pos_nk, 0)  # invalid steps read slot 0, write the trash
    rows_n1 = jnp.arange(lens_n.shape[0])[:, None]
    page_nk = jnp.where(valid_nk, table_nw[rows_n1, slot_nk // page_size], TRASH_PAGE)
    off_nk = jnp.where(valid_nk, slot_nk % page_size, 0)

    def write(buf: jax.Array, new_nkkd: jax.Array) -> jax.Array:
        return buf.at[page_nk, off_nk].set(new_nkkd.astype(buf.dtype))

    # dense keys [N, K, Dh, S] and values [N, K, S, Dh]: both give [N, k, K, Dh] here
    new_k = [write(b, x[rows_n1, :, :, slot_nk]) for b, x in zip(pool.k, dense.k, strict=True)]
    new_v = [write(b, x[rows_n1, :, slot_nk]) for b, x in zip(pool.v, dense.v, strict=True)]
    return PagePool(tuple(new_k), tuple(new_v))


def forward_paged_kernel(
    lm: CausalLM,
    layers: Sequence[DecoderLayer],
    pool: PagePool,
    tokens_bt: jax.Array,
    ctx_len_b: jax.Array,
    table_bw: jax.Array,
    write_page_bt: jax.Array,
    write_off_bt: jax.Array,
    kernel: KernelSpec,
) -> tuple[jax.Array, PagePool]:
    """:func:`forward_paged` for a kernel backend: write first, then attend.

    The kernels read the current tokens' keys/values from the pool, so each layer first
    scatters its new keys/values into the pool (:func:`pages.write_layer`, at
    ``write_page_bt``/``write_off_bt``: ``[B, T]``, or ``[B, T, G]`` for the G copies of a
    prefill chunk; padding at the trash page) and then attends over it
    (:func:`pages.kernel_attention`, a row's queries at ``ctx_len_b + t`` reading the pooled
    tokens ``[0, ctx_len_b + T)`` through ``table_bw``, which must cover them). The pool (one
    buffer for all layers) is threaded through the layers and updated in place, so this
    returns ``(hidden [B, T, D], pool)``. Same numbers as the reference order when the cache
    dtype is the compute dtype (here the new tokens are read back in the cache dtype).

    The layers run unrolled on per-layer weights (:func:`engine_params`, sliced once per
    :func:`run`), as on the reference path: in a ``scan`` over the stacked layers XLA:GPU
    copied each of a layer's 7 projection kernels out of the stack at every decode step
    (measured on an H200, 1B-class model at batch 256: 70 of the 273 µs a layer took per
    step; BENCHMARKS.md, "Accelerator runs").
    """
    decoder = lm.model
    x_btd, cos, sin = _embed_at(lm, tokens_bt, _new_positions(ctx_len_b, tokens_bt.shape[1]))
    windows = layer_windows(lm.config)
    for index, layer in enumerate(layers):
        written: list[PagePool] = []

        def write_and_attend(
            pool: PagePool,
            q_bthd: jax.Array,
            k_btkd: jax.Array,
            v_btkd: jax.Array,
            write_page_bt: jax.Array,
            write_off_bt: jax.Array,
            table_bw: jax.Array,
            ctx_len_b: jax.Array,
            index: int = index,
        ) -> tuple[PagePool, jax.Array]:
            new_pool = pages_lib.write_layer(
                kernel, pool, index, write_page_bt, write_off_bt, k_btkd, v_btkd
            )
            out = pages_lib.kernel_attention(
                kernel, new_pool, index, q_bthd, table_bw, ctx_len_b, windows[index]
            )
            return new_pool, out

        def attend(
            q_bthd: jax.Array,
            k_btkd: jax.Array,
            v_btkd: jax.Array,
            pool: PagePool = pool,
            written: list[PagePool] = written,
            write_and_attend: Any = write_and_attend,
        ) -> jax.Array:
            k_btkd, v_btkd = _per_copy(write_page_bt, k_btkd, v_btkd)
            new_pool, out = _per_kv_head_shard(write_and_attend, kernel, pool, k_btkd.ndim)(
                pool, q_bthd, k_btkd, v_btkd, write_page_bt, write_off_bt, table_bw, ctx_len_b
            )
            written.append(new_pool)
            return out

        x_btd, _ = layer(x_btd, cos, sin, attend)
        (pool,) = written
    return decoder.norm(x_btd), pool


def _per_kv_head_shard(fn: Any, kernel: KernelSpec, pool: PagePool, kv_rank: int) -> Any:
    """``fn(pool, q, k, v, *replicated)`` (a kernel's write and attention) per device under
    ``jax.shard_map`` when the engine's mesh has a ``tensor`` axis > 1 (a tensor-parallel
    engine, ``attention_kernel`` having checked that it divides the heads): each device runs
    the kernel on its own query heads, its own KV heads' new keys/values and its own part of
    the pool (:func:`pages.pool_spec`), whole GQA groups, no communication. Else ``fn``."""
    mesh = jax.sharding.get_abstract_mesh()
    t = 1 if mesh.empty or "tensor" not in mesh.axis_names else mesh.shape["tensor"]
    if t == 1:
        return fn
    kv_heads = pool.k.shape[0] if kernel.name == "pallas_gpu" else pool.k.shape[2] // 2
    pool_spec = pages_lib.pool_spec(kernel, kv_heads, t)
    pool_specs = PagePool(pool_spec, None if pool.v is None else pool_spec)
    q_spec = jax.P(None, None, "tensor", None)
    kv_spec = jax.P(*([None] * (kv_rank - 2)), "tensor", None)
    rep = jax.P()
    return jax.shard_map(
        fn,
        in_specs=(pool_specs, q_spec, kv_spec, kv_spec, rep, rep, rep, rep),
        out_specs=(pool_specs, q_spec),
        check_vma=False,
    )


# ---------------------------------------------------------------------------------------------
# The compiled programs.


@dataclasses.dataclass(frozen=True)
class _Static:
    greedy: bool
    top_k: int
    use_top_p: bool
    pad_token_id: int
    page_size: int
    steps: int
    full_logprobs: bool = False  # also the full-vocabulary τ = 1 log-probs
    kernel: KernelSpec | None = None  # None: the reference attention (pages.py)


def _row_keys(rng: jax.Array, seq_id_n: jax.Array, pos_n: jax.Array) -> jax.Array:
    """``fold_in(fold_in(rng, sequence id), token index)`` per row: slot-independent keys."""
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.fold_in(rng, s), t))(seq_id_n, pos_n)


def _pick(
    logits_nv: jax.Array,
    keys_n: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    static: _Static,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """``(tokens, logprobs, full-vocabulary τ = 1 log-probs or None)``, all ``[N]``."""
    token_n, logp_n = sampling.sample(
        logits_nv,
        keys_n,
        temperature=temperature,
        top_k=static.top_k,
        top_p=top_p if static.use_top_p else None,
        greedy=static.greedy,
    )
    full_n = sampling.full_logprobs(logits_nv, token_n) if static.full_logprobs else None
    return token_n, logp_n, full_n


LayerParams = tuple[Params, ...]


class EngineParams(NamedTuple):
    """The weights the engine's programs take (:func:`engine_params`): ``rest``, the pure
    parameter dict without the stacked decoder layers (``model.layers``), and ``layers``, those
    layers as ``L`` per-layer trees (copies), made once per :func:`run` and passed to every
    :func:`_prefill` and :func:`_decode` call: a program that slices the stacked weights itself
    copies them again in each call (measured on XLA:CPU and on an H200: BENCHMARKS.md,
    "Rollout engines" and "Accelerator runs"). The stacked weights are not an argument, so a
    run holds one copy of the layers, not the stacked ones and their slices both."""

    rest: Params
    layers: LayerParams


def without_layers(params: Params) -> Params:
    """``params`` without the stacked decoder layers (``model.layers``): :class:`EngineParams`'s
    ``rest`` (the same leaves, no copy)."""
    return {**params, "model": {k: v for k, v in params["model"].items() if k != "layers"}}


def _wider(x: Any, dtype: jnp.dtype | None) -> bool:
    """``x`` is a float wider than ``dtype`` (None: no cast), the engine's cast rule."""
    return (
        dtype is not None
        and jnp.issubdtype(x.dtype, jnp.floating)
        and x.dtype.itemsize > jnp.dtype(dtype).itemsize
    )


def _without_stacked_axis(x: Any) -> Any:
    """The sharding of one layer's slice of a stacked leaf: its spec without the layer axis."""
    s = getattr(x, "sharding", None)
    if isinstance(s, NamedSharding):
        return NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec[1:]))
    return None


def _slice_cast(stacked: Params, dtype: jnp.dtype | None) -> LayerParams:
    num_layers = jax.tree.leaves(stacked)[0].shape[0]
    return tuple(
        cast_wider(jax.tree.map(lambda x, i=i: x[i], stacked), dtype) for i in range(num_layers)
    )


def cast_wider(tree: Params, dtype: jnp.dtype | None) -> Params:
    """``tree``'s floats wider than ``dtype`` cast to it (None: none)."""
    return jax.tree.map(lambda x: x.astype(dtype) if _wider(x, dtype) else x, tree)


@functools.lru_cache(maxsize=64)
def _slicer(treedef: Any, shardings: tuple[NamedSharding, ...] | None, num_layers: int) -> Any:
    """The jitted slice-and-cast; each slice with the sharding of its leaf in ``shardings``
    (a layer's tree flattened; None: XLA's choice)."""
    out = None if shardings is None else (jax.tree.unflatten(treedef, shardings),) * num_layers
    return jax.jit(_slice_cast, static_argnums=1, out_shardings=out)


_cast_jit = jax.jit(cast_wider, static_argnums=1)


def engine_params(params: Params, dtype: jax.typing.DTypeLike | None = None) -> EngineParams:
    """``params`` as the engine runs on them (:class:`EngineParams`), floats wider than
    ``dtype`` cast to it (None: as they are). The layers are sliced and cast in one program,
    each slice keeping its stacked leaf's sharding (less the layer axis), so neither a cast
    copy of the stacked weights nor a gathered one is held while the engine runs: on a
    data-parallel mesh each engine gathers the per-layer slices (``paged_dp.shard_params``),
    one copy of the weights per device where there were two (a gathered stacked copy and its
    slices: ``jaxrl-llm plan`` of Qwen2.5-7B on v5p-32 put the rollout's peak at 33.9 GiB per
    chip, 6.2 of it the train state)."""
    dtype = None if dtype is None else jnp.dtype(dtype)
    rest = without_layers(params)
    if any(_wider(x, dtype) for x in jax.tree.leaves(rest)):
        rest = _cast_jit(rest, dtype)
    stacked = params["model"]["layers"]
    leaves, treedef = jax.tree.flatten(stacked)
    shardings = tuple(_without_stacked_axis(x) for x in leaves)
    named = all(isinstance(sh, NamedSharding) for sh in shardings)
    slicer = _slicer(treedef, shardings if named else None, leaves[0].shape[0])
    return EngineParams(rest, slicer(stacked, dtype))


def abstract_engine_params(
    params: Params, dtype: jax.typing.DTypeLike | None = None
) -> EngineParams:
    """:func:`engine_params` in shapes, for abstract ``params`` (``jax.ShapeDtypeStruct``s),
    their shardings kept as ``engine_params`` keeps them (``jax.eval_shape`` drops them):
    ``jaxrl-llm plan``."""
    dtype = None if dtype is None else jnp.dtype(dtype)

    def like(x: Any, shape: tuple[int, ...], sharding: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(
            shape, dtype if _wider(x, dtype) else x.dtype, sharding=sharding
        )

    rest = jax.tree.map(
        lambda x: like(x, x.shape, getattr(x, "sharding", None)), without_layers(params)
    )
    stacked = params["model"]["layers"]
    one = jax.tree.map(lambda x: like(x, x.shape[1:], _without_stacked_axis(x)), stacked)
    return EngineParams(rest, (one,) * jax.tree.leaves(stacked)[0].shape[0])


def _with_stacked(params: Params, layers_l: LayerParams | None, make: Any) -> Params:
    """``params`` with ``model.layers`` (``make(per-layer leaves)`` of each leaf) put back where
    :func:`engine_params` took it out, for ``nnx.merge``; as it is when it has them."""
    if layers_l is None or "layers" in params["model"]:
        return params
    stacked = jax.tree.map(lambda *xs: make(xs), *layers_l)
    return {**params, "model": {**params["model"], "layers": stacked}}


def merged_model(graphdef: nnx.GraphDef, params: Params, layers_l: LayerParams | None) -> CausalLM:
    """The model inside a program: the stacked layers, when not passed, stand in as zeros
    that nothing reads (the layers run on ``layers_l``), so XLA removes them."""

    def zeros(xs: tuple[jax.Array, ...]) -> jax.Array:
        return jnp.zeros((len(xs), *xs[0].shape), xs[0].dtype)

    return nnx.merge(graphdef, _with_stacked(params, layers_l, zeros))


def layer_modules(lm: CausalLM, layers_l: LayerParams | None) -> tuple[DecoderLayer, ...]:
    """Per-layer modules: of ``layers_l`` (:class:`EngineParams`) when given, else sliced here."""
    if layers_l is None:
        return unstack_layers(lm.model.layers)
    layer_def = nnx.graphdef(lm.model.layers)
    return tuple(nnx.merge(layer_def, state) for state in layers_l)


@functools.partial(jax.jit, static_argnames=("graphdef", "static"), donate_argnames=("pool",))
def _prefill(
    graphdef: nnx.GraphDef,
    params: Params,
    layers_l: LayerParams | None,
    pool: PagePool,
    tokens_rc: jax.Array,
    valid_rc: jax.Array,
    ctx_len_r: jax.Array,
    table_rw: jax.Array,
    write_page_rcg: jax.Array,
    write_off_rc: jax.Array,
    last_index_r: jax.Array,
    seq_id_rg: jax.Array,
    pos_rg: jax.Array,
    rng: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    *,
    static: _Static,
) -> tuple[PagePool, jax.Array, jax.Array, jax.Array | None]:
    """One prefill chunk of R prompts: writes it for each prompt's G samples and samples their
    first token from the logits at ``last_index_r`` (used by the caller where the prompt ends),
    with the keys of sequence ``seq_id_rg`` at completion index ``pos_rg`` (0 but in partial
    rollouts). ``layers_l``: the per-layer weights (:class:`EngineParams`, ``params`` then
    without the stacked layers; None: ``params`` whole, sliced in this call)."""
    lm: CausalLM = merged_model(graphdef, params, layers_l)
    r, g = seq_id_rg.shape
    off_rcg = jnp.broadcast_to(write_off_rc[:, :, None], write_page_rcg.shape)
    layers = layer_modules(lm, layers_l)
    if static.kernel is not None:  # write first, then attend (table_rw covers the chunk)
        h_rcd, pool = forward_paged_kernel(
            lm, layers, pool, tokens_rc, ctx_len_r, table_rw, write_page_rcg, off_rcg, static.kernel
        )
    else:
        h_rcd, pool = forward_paged(
            lm, layers, pool, tokens_rc, ctx_len_r, table_rw, write_page_rcg, off_rcg
        )
    h_rd = jnp.take_along_axis(h_rcd, last_index_r[:, None, None], axis=1)[:, 0]
    logits_rv = lm.logits(h_rd)
    logits_nv = jnp.broadcast_to(logits_rv[:, None], (r, g, logits_rv.shape[-1])).reshape(r * g, -1)
    seq_id_n = seq_id_rg.reshape(-1)
    keys_n = _row_keys(rng, seq_id_n, pos_rg.reshape(-1))
    token_n, logp_n, full_n = _pick(logits_nv, keys_n, temperature, top_p, static)
    full_rg = None if full_n is None else full_n.reshape(r, g)
    pool = pages_lib.constrain_pool(pool, static.kernel, lm.config.num_kv_heads)
    return pool, token_n.reshape(r, g), logp_n.reshape(r, g), full_rg


class _SlotState(NamedTuple):
    lens_n: jax.Array  # tokens in the pool per slot (= position of token_n)
    token_n: jax.Array  # the last sampled token (not yet in the pool)
    alive_n: jax.Array  # token_n is to be fed and a next token sampled
    remaining_n: jax.Array  # tokens still to sample
    gen_pos_n: jax.Array  # index of the next token in its completion
    seq_id_n: jax.Array  # b·G + g


@functools.partial(jax.jit, static_argnames=("graphdef", "static"), donate_argnames=("pool",))
def _decode(
    graphdef: nnx.GraphDef,
    params: Params,
    layers_l: LayerParams | None,
    pool: PagePool,
    table_nw: jax.Array,
    state: _SlotState,
    rng: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    stop_ids_s: jax.Array,
    refill_at: jax.Array,
    shrink_at: jax.Array,
    max_steps: jax.Array,
    *,
    static: _Static,
) -> tuple[PagePool, _SlotState, jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Up to ``min(static.steps, max_steps)`` decode steps of every slot (``max_steps``: what
    the pages the host gave the slots hold): ``(pool, state, tokens, logps,
    valid, full logps or None)``, the last four ``[k, N]``. Returns early, after the step in which
    ``refill_at`` of the slots have finished (the host has prompts waiting for that many
    slots; a large value: never), or in which the live slots drop to ``shrink_at`` (they fit
    the next smaller slot bucket; -1: never). ``layers_l`` as in :func:`_prefill`."""
    lm: CausalLM = merged_model(graphdef, params, layers_l)
    k, n = static.steps, table_nw.shape[0]
    ps = static.page_size
    rows = jnp.arange(n)
    layers = layer_modules(lm, layers_l)  # unrolled, on per-layer weights (forward_paged_kernel)

    def step(carry: tuple) -> tuple:
        i, (pool, dense), st, tok_kn, logp_kn, valid_kn, full_kn = carry
        if static.kernel is not None:  # write first, then attend
            page_n = jnp.where(st.alive_n, table_nw[rows, st.lens_n // ps], TRASH_PAGE)
            off_n = jnp.where(st.alive_n, st.lens_n % ps, 0)
            # An idle row's stale length may exceed its (trash) table: read one token.
            h_n1d, pool = forward_paged_kernel(
                lm,
                layers,
                pool,
                st.token_n[:, None],
                jnp.where(st.alive_n, st.lens_n, 0),
                table_nw,
                page_n[:, None],
                off_n[:, None],
                static.kernel,
            )
        else:
            h_n1d, dense = forward_decode_dense(
                lm, layers, dense, st.token_n, st.lens_n, st.alive_n
            )
        logits_nv = lm.logits(h_n1d[:, 0])
        new_n, logp_n, full_n = _pick(
            logits_nv, _row_keys(rng, st.seq_id_n, st.gen_pos_n), temperature, top_p, static
        )
        alive = st.alive_n
        tok_kn = tok_kn.at[i].set(jnp.where(alive, new_n, static.pad_token_id))
        logp_kn = logp_kn.at[i].set(jnp.where(alive, logp_n, 0.0))
        valid_kn = valid_kn.at[i].set(alive)
        if full_kn is not None:
            full_kn = full_kn.at[i].set(jnp.where(alive, full_n, 0.0))
        step_n = alive.astype(jnp.int32)
        remaining = st.remaining_n - step_n
        stop_n = jnp.any(new_n[:, None] == stop_ids_s[None, :], axis=1)
        st = _SlotState(
            lens_n=st.lens_n + step_n,
            token_n=jnp.where(alive, new_n, st.token_n),
            alive_n=alive & ~stop_n & (remaining > 0),
            remaining_n=remaining,
            gen_pos_n=st.gen_pos_n + step_n,
            seq_id_n=st.seq_id_n,
        )
        return i + 1, (pool, dense), st, tok_kn, logp_kn, valid_kn, full_kn

    def cond(carry: tuple) -> jax.Array:
        i, _, st, *_ = carry
        finished = jnp.sum(state.alive_n & ~st.alive_n)
        live = jnp.sum(st.alive_n)
        return (
            (i < jnp.minimum(k, max_steps))
            & (finished < refill_at)
            & (live > shrink_at)
            & (live > 0)
        )

    # The reference path gathers the rows' contexts once per dispatch (``DenseContext``) and
    # writes the pool once after it (``write_back``); the kernels write the pool at every step.
    dense = gather_dense(pool, table_nw) if static.kernel is None else None
    carry = (
        jnp.int32(0),
        (pool if dense is None else None, dense),
        state,
        jnp.full((k, n), static.pad_token_id, jnp.int32),
        jnp.zeros((k, n), jnp.float32),
        jnp.zeros((k, n), bool),
        jnp.zeros((k, n), jnp.float32) if static.full_logprobs else None,
    )
    _, (kernel_pool, dense), st, tok_kn, logp_kn, valid_kn, full_kn = jax.lax.while_loop(
        cond, step, carry
    )
    if dense is None:
        pool = kernel_pool
    else:
        pool = write_back(pool, dense, table_nw, state.lens_n, valid_kn, ps)
    pool = pages_lib.constrain_pool(pool, static.kernel, lm.config.num_kv_heads)
    return pool, st, tok_kn, logp_kn, valid_kn, full_kn


# ---------------------------------------------------------------------------------------------
# The host-side scheduler.


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass
class _Seq:
    prompt: int
    sample: int
    prompt_len: int
    budget: int
    pages: list[int]
    admitted: int  # admission order (prompts are admitted in order): latest preempted first
    tokens: list[int] = dataclasses.field(default_factory=list)
    logps: list[float] = dataclasses.field(default_factory=list)
    full_logps: list[float] = dataclasses.field(default_factory=list)
    stopped: bool = False


def prompt_group_pages(
    prompt_len: int, budgets_g: Sequence[int], page_size: int, horizon: int
) -> int:
    """Pages a prompt's G samples (budgets ``budgets_g``) hold with up to ``horizon`` tokens
    each decoded: the shared full prompt pages once, then each sample's partial last prompt
    page and new pages."""
    n_full = prompt_len // page_size
    per = [_ceil_div(prompt_len + min(horizon, int(x)) - 1, page_size) for x in budgets_g]
    return n_full + sum(max(q, n_full) - n_full for q in per)


def least_prompt_pages(prompt_len: int, budgets_g: Sequence[int], page_size: int) -> int:
    """The pool pages (trash page excluded) :func:`run` needs for a prompt: admitted, its
    prompt and first tokens' pages; alone, each sample must be able to finish (every other
    sequence preempted)."""
    alone = max(_ceil_div(prompt_len + int(x) - 1, page_size) for x in budgets_g)
    return max(prompt_group_pages(prompt_len, budgets_g, page_size, 1), alone)


def pool_pages(
    num_seqs: int, longest_prompt: int, max_new_tokens: int, options: PagedOptions | None = None
) -> int:
    """``num_pages`` for a pool that holds ``num_seqs`` sequences' worst case at once (a
    longest prompt and ``max_new_tokens`` each, in ``options.page_size`` pages) plus the trash
    page: the static engine's memory for that many rows, and a pool in which those sequences
    never preempt."""
    page_size = (options or PagedOptions()).page_size
    return 1 + num_seqs * _ceil_div(longest_prompt + max_new_tokens, page_size)


def resolve_options(
    options: PagedOptions | None,
    *,
    num_seqs: int,
    num_samples: int,
    longest_prompt: int,
    max_new_tokens: int,
) -> PagedOptions:
    """Fills the defaults of :class:`PagedOptions` and checks the sizes (clear errors)."""
    o = options or PagedOptions()
    for name in ("page_size", "steps_per_dispatch", "prefill_chunk"):
        value = getattr(o, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"generate(engine='paged'): {name} must be an int >= 1, got {value!r}")
    t = o.tensor_parallel
    if isinstance(t, bool) or not isinstance(t, int) or t < 0:
        raise ValueError(
            f"generate(engine='paged'): tensor_parallel must be an int >= 0, got {t!r}"
        )
    if o.prefill_chunk & (o.prefill_chunk - 1):
        raise ValueError(
            f"generate(engine='paged'): prefill_chunk must be a power of two, got {o.prefill_chunk}"
        )
    if o.attention not in pages_lib.ATTENTION_BACKENDS:
        raise ValueError(
            f"generate(engine='paged'): attention must be one of "
            f"{pages_lib.ATTENTION_BACKENDS}, got {o.attention!r}"
        )
    slots = o.num_slots
    if slots is None:
        slots = max(min(_next_pow2(num_seqs), _DEFAULT_MAX_SLOTS), _next_pow2(num_samples))
    if slots < num_samples:
        raise ValueError(
            f"generate(engine='paged'): num_slots={slots} is smaller than num_samples="
            f"{num_samples}; a prompt's G samples are admitted together, so num_slots >= G"
        )
    for name in ("prefix_sharing", "work_stealing"):
        if not isinstance(getattr(o, name), bool):
            raise ValueError(
                f"generate(engine='paged'): {name} must be a bool, got {getattr(o, name)!r}"
            )
    bound = o.max_prompt_length
    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 1):
        raise ValueError(
            f"generate(engine='paged'): max_prompt_length must be an int >= 1 or None, got "
            f"{bound!r}"
        )
    util = o.memory_utilization
    if util is not None and (
        isinstance(util, bool) or not isinstance(util, int | float) or not 0 < util <= 1
    ):
        raise ValueError(
            f"generate(engine='paged'): memory_utilization must be a fraction in (0, 1] or "
            f"None, got {util!r}"
        )
    pages = o.num_pages
    if pages is None:
        sized_for = max(longest_prompt, bound or 0)
        pages = pool_pages(min(slots, _DEFAULT_POOL_SEQS), sized_for, max_new_tokens, o)
    else:
        util = None  # the pool asked for is the pool run
    if pages < 2:
        raise ValueError(
            f"generate(engine='paged'): num_pages={pages} leaves no page for tokens (page "
            f"{TRASH_PAGE} is the trash page); give at least 2"
        )
    tuning = pages_lib.check_kernel_tuning(o.kernel_tuning)  # hashable pairs, checked early
    return dataclasses.replace(
        o, num_slots=slots, num_pages=pages, kernel_tuning=tuning, memory_utilization=util
    )


# ---------------------------------------------------------------------------------------------
# The compiled programs' shapes: what ``run`` passes, and what ``jaxrl-llm plan`` lowers.


def _table_step(page_size: int) -> int:
    """Pages of :data:`_MIN_TABLE_TOKENS` tokens: the page tables' width step."""
    return _ceil_div(_MIN_TABLE_TOKENS, page_size)


def max_table_width(longest_prompt: int, max_new_tokens: int, page_size: int) -> int:
    """The widest decode page table: ``⌈P + T⌉`` pages (``P`` the longest prompt), rounded up
    to a multiple of :data:`_MIN_TABLE_TOKENS` tokens' pages."""
    step = _table_step(page_size)
    return _ceil_div(_ceil_div(longest_prompt + max_new_tokens, page_size), step) * step


def decode_table_width(pages: int, page_size: int, max_width: int) -> int:
    """A decode dispatch's page-table width for rows holding up to ``pages`` pages: the next
    multiple of :data:`_MIN_TABLE_TOKENS` tokens' pages, at most ``max_width``.

    Multiples rather than powers of two: attention reads the whole width, and a 550-token
    context would otherwise read 1024 slots."""
    step = _table_step(page_size)
    return min(max(_ceil_div(pages, step), 1) * step, max_width)


def slot_bucket(live: int, num_slots: int) -> int:
    """A decode dispatch's rows for ``live`` live slots: the next power of two, at least
    :data:`_MIN_SLOT_BUCKET`, at most ``num_slots``."""
    return min(num_slots, max(_next_pow2(live), _MIN_SLOT_BUCKET))


def prefill_rows(prompts: int) -> int:
    """A prefill call's rows for ``prompts`` prompts: the next power of two, at most
    :data:`_PREFILL_ROWS`."""
    return min(_next_pow2(prompts), _PREFILL_ROWS)


def max_prefill_group(num_prompts: int, num_samples: int, num_slots: int) -> int:
    """The most prompts ``run`` admits (and prefills) together: at most :data:`_PREFILL_ROWS`,
    the prompts there are, and ``num_slots // G`` (a prompt's G samples take G free slots).
    Also the most preempted sequences recomputed in one prefill call."""
    return max(1, min(_PREFILL_ROWS, num_prompts, num_slots // num_samples))


def prefill_chunk_shape(
    start: int, tokens: int, prefill_chunk: int, page_size: int
) -> tuple[int, int]:
    """``(width, table_pages)`` of the prefill chunk at prompt offset ``start`` whose longest
    row has ``tokens`` tokens in it: the width bucket (:func:`_chunk_width`, at most
    ``prefill_chunk``) and the page table's width, covering ``start + width`` tokens (the chunk
    is written first and read from the pool too), in multiples of :data:`_MIN_TABLE_TOKENS`
    tokens, as decode's. ``start`` is a multiple of ``prefill_chunk``, or, for rows that begin
    after a shared prefix (a prompt's, or a preempted sequence's on recompute), the rows'
    largest offset, any multiple of the page size: without the rounding each prefix length
    would compile its own table width.

    The reference attention and the kernels take the same widths: a table entry past a row's
    context is :data:`pages.TRASH_PAGE`, masked by position. On the reference path, whose cost
    grows with the width, the rounding adds fewer than ``_MIN_TABLE_TOKENS`` keys per query,
    small beside a chunk's matmuls."""
    width = min(prefill_chunk, _chunk_width(tokens))
    step = _table_step(page_size)
    return width, _ceil_div(_ceil_div(start + width, page_size), step) * step


def _make_static(
    options: PagedOptions,
    kernel: KernelSpec | None,
    *,
    greedy: bool,
    top_k: int,
    top_p: float,
    pad_token_id: int,
    full_logprobs: bool,
) -> _Static:
    """The programs' static settings for a run with these (resolved) options."""
    return _Static(
        greedy,
        top_k,
        top_p < 1.0,
        pad_token_id,
        options.page_size,
        options.steps_per_dispatch,
        bool(full_logprobs),
        kernel=kernel,
    )


class ProgramArgs(NamedTuple):
    """One paged program's abstract call (:func:`worst_case_programs`): ``fn.lower(graphdef,
    *args, static=static)`` with ``fn`` :func:`_prefill` or :func:`_decode`. ``rows``: its row
    bucket; ``tokens``: the prefill chunk's width or the decode dispatch's steps;
    ``table_pages``: its page table's width."""

    fn: Any
    args: tuple
    static: _Static
    rows: int
    tokens: int
    table_pages: int


class WorstCase(NamedTuple):
    """:func:`worst_case_programs`: the abstract pool and the largest prefill and decode
    calls a run makes."""

    pool: PagePool
    prefill: ProgramArgs
    decode: ProgramArgs


def worst_case_programs(
    cfg: Any,
    params: Params | EngineParams,
    options: PagedOptions,
    kernel: KernelSpec | None,
    *,
    num_prompts: int,
    num_samples: int,
    longest_prompt: int,
    max_new_tokens: int,
    greedy: bool,
    top_k: int,
    top_p: float,
    pad_token_id: int,
    cache_dtype: jnp.dtype,
    num_stop_ids: int,
    full_logprobs: bool = False,
    sharding: jax.sharding.Sharding | None = None,
) -> WorstCase:
    """The largest :func:`_prefill` and :func:`_decode` calls :func:`run` makes for
    ``num_prompts`` prompts of at most ``longest_prompt`` tokens, G = ``num_samples``, T =
    ``max_new_tokens``, as abstract arguments (``jax.ShapeDtypeStruct``; nothing allocated):
    the shapes come from the helpers ``run`` itself uses.

    ``params``: the abstract parameters as the programs get them (compute dtype, on the
    engine's devices; a parameter dict is split as :func:`run` splits it); ``options``
    resolved (:func:`resolve_options`); ``kernel``: :func:`attention_kernel`'s;
    ``num_stop_ids``: the stop ids' padded length (a multiple of 8, ``engine._stop_ids``);
    ``sharding``: where the pool and the other arguments live (run: replicated over the
    engine's mesh).

    - the pool: :func:`pages.init_pool` of ``options.num_pages`` pages;
    - decode: the slot bucket of every slot live (``num_slots`` rows, or the sequences' bucket
      when there are fewer) over the page table of a longest context, the prompt and
      ``max_new_tokens − 1`` tokens (:func:`decode_table_width`);
    - prefill: :func:`max_prefill_group` prompts in :func:`prefill_rows` rows; of the longest
      prompt's chunks (:func:`prefill_chunk_shape`), the one with the largest
      ``width × table pages`` (its attention scores' size; one chunk unless the prompt is
      longer than ``prefill_chunk``; with prefix sharing, from any page on); when the pool
      cannot hold every sequence's longest context at once (so ``run`` may preempt), of the
      longest recomputed context's chunks.
    """
    g, ps = num_samples, options.page_size

    def sds(shape: tuple[int, ...], dtype: Any = jnp.int32) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    pool = jax.eval_shape(
        lambda: pages_lib.init_pool(
            kernel,
            cfg.num_layers,
            options.num_pages,
            ps,
            cfg.num_kv_heads,
            cfg.head_dim,
            cache_dtype,
        )
    )
    on = pool_sharding(kernel, cfg, sharding.mesh) if isinstance(sharding, NamedSharding) else None
    pool = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on), pool)
    static = _make_static(
        options,
        kernel,
        greedy=greedy,
        top_k=top_k,
        top_p=top_p,
        pad_token_id=pad_token_id,
        full_logprobs=full_logprobs,
    )
    key = jax.eval_shape(lambda: jax.random.key(0))
    rng, f32, i32 = sds(key.shape, key.dtype), sds((), jnp.float32), sds(())
    if not isinstance(params, EngineParams):
        params = abstract_engine_params(params)
    params, layers_l = params

    # Every slot live (or every sequence, when there are fewer), each holding its longest
    # context: the prompt and all but the last of its T tokens (the last is never fed).
    n = slot_bucket(min(options.num_slots, num_prompts * g), options.num_slots)
    held = _ceil_div(longest_prompt + max_new_tokens - 1, ps)
    width = decode_table_width(held, ps, max_table_width(longest_prompt, max_new_tokens, ps))
    state = _SlotState(
        *(sds((n,), bool if f == "alive_n" else jnp.int32) for f in _SlotState._fields)
    )
    decode_args = (
        params,
        layers_l,
        pool,
        sds((n, width)),
        state,
        rng,
        f32,
        f32,
        sds((num_stop_ids,)),
        i32,
        i32,
        i32,
    )
    decode = ProgramArgs(_decode, decode_args, static, n, options.steps_per_dispatch, width)

    r = prefill_rows(max_prefill_group(num_prompts, g, options.num_slots))
    chunk = options.prefill_chunk
    # A pool that cannot hold every sequence's longest context may preempt: a recomputed
    # sequence's context (its prompt and up to T - 1 tokens) is prefilled too.
    longest = longest_prompt
    if options.num_pages - 1 < min(options.num_slots, num_prompts * g) * held:
        longest = longest_prompt + max_new_tokens - 1
    # A chunk begins at a multiple of the chunk, or with a shared prefix at any page.
    step = ps if options.prefix_sharing else chunk
    shapes = [
        prefill_chunk_shape(start, min(chunk, longest - start), chunk, ps)
        for start in range(0, longest, step)
    ]
    c, cover = max(shapes, key=lambda wp: wp[0] * wp[1])
    prefill_args = (
        params,
        layers_l,
        pool,
        sds((r, c)),
        sds((r, c), bool),
        sds((r,)),
        sds((r, cover)),
        sds((r, c, g)),
        sds((r, c)),
        sds((r,)),
        sds((r, g)),
        sds((r, g)),
        rng,
        f32,
        f32,
    )
    prefill = ProgramArgs(_prefill, prefill_args, static, r, c, cover)
    return WorstCase(pool, prefill, decode)


class PoolFit(NamedTuple):
    """:func:`fit_pool_to_memory`'s reading of an engine's devices (bytes per device, the
    tightest device's): ``limit`` and ``in_use`` of ``Device.memory_stats``, ``reserve`` the
    largest program's temporaries and new outputs, ``page_bytes`` one page's, ``pages`` the
    pool it gives (the trash page included)."""

    limit: int
    in_use: int
    reserve: int
    page_bytes: int
    pages: int


_FITTED: dict[Any, PoolFit] = {}  # an engine's first call's sizing, kept (one pool shape)


def _memory_stats(device: jax.Device) -> dict[str, int] | None:
    """``device.memory_stats()`` (None on a CPU, which reports none)."""
    return device.memory_stats()


def _program_reserve(graphdef: nnx.GraphDef, worst: WorstCase, mesh: Any) -> int:
    """Bytes a call of the larger of ``worst``'s programs allocates beyond its arguments:
    temporaries plus outputs not aliased to a donated argument (XLA's memory analysis of the
    compiled program, per device)."""
    reserve = 0
    for call in (worst.prefill, worst.decode):
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            m = call.fn.lower(graphdef, *call.args, static=call.static).compile().memory_analysis()
        own = m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
        reserve = max(reserve, int(own))
    return reserve


def largest_pool(
    reserve_at: Callable[[int], int], free: int, page_bytes: int, minimum: int, cap: int
) -> tuple[int, int]:
    """``(pages, reserve)``: the largest pool of at most ``cap`` pages whose bytes and the
    engine's ``reserve_at(pages)`` fit ``free`` bytes, searched with few calls of
    ``reserve_at`` (each compiles the engine's worst-case programs); fewer than ``minimum``
    pages where even that pool does not fit (the caller's error).

    ``cap`` first. Below it the pool may preempt, and the smallest pool's reserve bounds a
    larger one's from below, not above: a backend may hold temporaries that grow with the pool
    (XLA:CPU converts a bf16 pool to f32 to scatter into it). So the pool that bound leaves
    room for is measured too; the pool is where the line through the two reserves meets the
    memory, then measured and shrunk by any excess (the reserve is not exactly linear: buffers
    are laid out in steps) until pool and reserve fit."""
    reserve = reserve_at(cap)
    pages = min(max(free - reserve, 0) // page_bytes, cap)
    if pages == cap:
        return pages, reserve
    low = reserve_at(minimum)
    pages = min(max(free - low, 0) // page_bytes, cap - 1)
    if pages <= minimum:
        return pages, low
    high = reserve_at(pages)
    slope = max(high - low, 0) / (pages - minimum)  # reserve bytes per page
    per_page = page_bytes + slope
    n = max(min(int((free - low + slope * minimum) // per_page), pages), minimum)
    r = high if n == pages else reserve_at(n)
    for _ in range(3):
        excess = n * page_bytes + r - free
        if excess <= 0 or n == minimum:
            break
        n = max(n - math.ceil(excess / per_page), minimum)
        r = reserve_at(n)
    if n * page_bytes + r > free:
        return minimum, low  # fits: the bound above left room for it
    return n, r


def fit_pool_to_memory(
    graphdef: nnx.GraphDef,
    cfg: Any,
    mesh: jax.sharding.Mesh | None,
    params: EngineParams,
    options: PagedOptions,
    kernel: KernelSpec | None,
    *,
    num_prompts: int,
    num_samples: int,
    longest_prompt: int,
    max_new_tokens: int,
    cache_dtype: jnp.dtype,
    continued: bool = False,
    **program: Any,
) -> PagedOptions:
    """``options`` with ``num_pages`` sized by ``options.memory_utilization`` u on the engine's
    devices (``mesh``'s, else the parameters'), vLLM's rule: per device,

        pages = ⌊(u · bytes_limit − bytes_in_use − reserve) / page_bytes⌋,

    at most every live sequence's worst case (``min(num_slots, B·G)`` sequences of the
    longest prompt, at least ``options.max_prompt_length``, plus ``max_new_tokens``: a pool
    that never preempts), the tightest device's. ``reserve`` is what the engine's largest
    prefill or decode call allocates (:func:`worst_case_programs`, compiled, XLA's memory
    analysis): for that largest pool first; if it does not fit, for a pool that may
    preempt (its recompute prefill is larger), where temporaries may grow with the pool: the
    smallest pool's and that of the pool it leaves room for, then the pool where the line
    through the two meets the memory, measured and shrunk until it fits with its own
    reserve; ``page_bytes`` a page's bytes on one device
    (split by KV head over a ``tensor`` axis). ``jaxrl-llm plan`` sizes it the same way
    (``plan.fit_paged``). Computed at an engine's first call and kept for the process
    (``_FITTED``), as vLLM sizes its pool once: later calls share the pool's shape.

    ``options`` unchanged where ``memory_utilization`` is None (``num_pages`` was given) or a
    device reports no memory (CPU). ``cfg``: the model's config (``run``'s). ``program``:
    ``worst_case_programs``' sampling arguments (``greedy``, ``top_k``, ``top_p``,
    ``pad_token_id``, ``num_stop_ids``, ``full_logprobs``). ``continued``: the sizes are a
    whole rollout's that runs in segments (``partial.py``: each segment continues the live
    sequences, their contexts as its prompts); the reserve then also covers every one of the
    ``B·G`` sequences prefilled alone from a context of up to ``P + T − 1`` tokens.

    Raises:
      ValueError: the memory left holds less than one sequence's worst case.
    """
    util = options.memory_utilization
    if util is None:
        return options
    if mesh is not None:
        devices = list(mesh.devices.flat)
    else:
        devices = sorted(jax.tree.leaves(params)[0].devices(), key=lambda d: d.id)
    stats = [_memory_stats(d) for d in devices]
    if any(st is None or "bytes_limit" not in st for st in stats):
        return dataclasses.replace(options, memory_utilization=None)
    ps = options.page_size
    sized_for = max(longest_prompt, options.max_prompt_length or 0)
    minimum = pool_pages(1, sized_for, max_new_tokens, options)  # one sequence and the trash
    key = (
        tuple(d.id for d in devices),
        dataclasses.replace(options, num_pages=None),
        repr(cfg),
        num_prompts,
        num_samples,
        sized_for,
        max_new_tokens,
        str(jnp.dtype(cache_dtype)),
        tuple(sorted(program.items())),
        kernel,
        continued,
    )
    if key not in _FITTED:
        rep = NamedSharding(mesh, PartitionSpec()) if mesh is not None else None
        abstract = EngineParams(
            *jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
            )
        )

        # (prompts, samples each, longest prompt, new tokens) of the calls to cover
        calls = [(num_prompts, num_samples, sized_for, max_new_tokens)]
        if continued:  # a later segment: each sequence alone, its context as the prompt
            calls.append((num_prompts * num_samples, 1, sized_for + max_new_tokens - 1, 1))

        @functools.cache
        def reserve_at(num_pages: int) -> int:
            worst = [
                worst_case_programs(
                    cfg,
                    abstract,
                    dataclasses.replace(options, num_pages=num_pages),
                    kernel,
                    num_prompts=b,
                    num_samples=g,
                    longest_prompt=p,
                    max_new_tokens=t,
                    cache_dtype=cache_dtype,
                    sharding=rep,
                    **program,
                )
                for b, g, p, t in calls
            ]
            return max(_program_reserve(graphdef, w, mesh) for w in worst)

        on = pool_sharding(kernel, cfg, mesh) if mesh is not None else None

        def pool_bytes(n: int) -> int:
            pool = jax.eval_shape(
                lambda: pages_lib.init_pool(
                    kernel, cfg.num_layers, n, ps, cfg.num_kv_heads, cfg.head_dim, cache_dtype
                )
            )
            shapes = (on.shard_shape(x.shape) if on else x.shape for x in jax.tree.leaves(pool))
            dtypes = (x.dtype.itemsize for x in jax.tree.leaves(pool))
            return sum(int(np.prod(sh)) * b for sh, b in zip(shapes, dtypes, strict=True))

        page_bytes = pool_bytes(3) - pool_bytes(2)
        fits = [(int(util * st["bytes_limit"]) - int(st["bytes_in_use"]), st) for st in stats]
        free, st = min(fits, key=lambda f: f[0])
        # Every live sequence's worst case: a pool that never preempts. A smaller one may, and
        # its programs' worst case is then the larger recompute prefill.
        live = min(options.num_slots, num_prompts * num_samples)
        cap = pool_pages(live, sized_for, max_new_tokens, options)
        pages, reserve = largest_pool(reserve_at, free, page_bytes, minimum, cap)
        _FITTED[key] = PoolFit(
            int(st["bytes_limit"]), int(st["bytes_in_use"]), reserve, page_bytes, int(pages)
        )
    fit = _FITTED[key]
    gib = 2.0**30
    if fit.pages < minimum:
        raise ValueError(
            f"generate(engine='paged'): at memory_utilization={util} the pool gets "
            f"{max(fit.pages, 0)} pages of {fit.page_bytes} bytes, fewer than one sequence's "
            f"worst case ({minimum - 1} pages of {ps} tokens: a {sized_for}-token prompt and "
            f"{max_new_tokens} new tokens) and the trash page: a device's limit is "
            f"{fit.limit / gib:.2f} GiB, {fit.in_use / gib:.2f} GiB are in use and the "
            f"engine's largest program needs {fit.reserve / gib:.2f} GiB more. Raise "
            "memory_utilization, free device memory, split the engine over more devices "
            "(tensor_parallel), shorten the prompts or max_new_tokens, or set num_pages"
        )
    return dataclasses.replace(options, num_pages=fit.pages, memory_utilization=None)


def run(
    graphdef: nnx.GraphDef,
    mesh: jax.sharding.Mesh | None,
    params: Params | EngineParams,
    prompts: list[np.ndarray],
    budgets_bg: np.ndarray,
    *,
    rng: jax.Array,
    temperature: float,
    top_p: float,
    greedy: bool,
    top_k: int,
    stop_ids: np.ndarray,
    pad_token_id: int,
    cache_dtype: jnp.dtype,
    max_new_tokens: int,
    options: PagedOptions,
    seq_ids_bg: np.ndarray | None = None,
    token_offsets_bg: np.ndarray | None = None,
    full_logprobs: bool = False,
    whole_rollout: tuple[int, int, int, int] | None = None,
    queue: stealing.EngineQueue | None = None,
) -> tuple[tuple[np.ndarray, ...], PagedStats]:
    """Samples ``budgets_bg[b, g]`` tokens (or up to a stop id) for each prompt and sample.

    ``prompts`` are the unpadded token ids of each prompt; ``params`` already in the compute
    dtype, best as :func:`engine_params` made them (a parameter dict is split here, and its
    stacked layers then stay held beside their slices); ``options`` resolved
    (:func:`resolve_options`). With ``mesh`` (sharded
    parameters) the programs run on it with the pool and the slots' arrays replicated and XLA
    partitioning the weights' matmuls as the parameters say (one scheduler; correct, not yet
    data-parallel: per-shard schedulers with per-shard pools are the plan). Returns numpy
    ``(tokens, mask, logprobs, truncated)`` shaped as
    :class:`~jaxrl_llm.rollout.engine.Generation` (with ``full_logprobs``, a fifth array:
    ``Generation.full_logprobs``) and the run's :class:`PagedStats`.

    Token ``t`` of sample ``(b, g)`` is drawn with ``fold_in(fold_in(rng, id), offset + t)``,
    ``id = seq_ids_bg[b, g]`` (default ``b·G + g``) and ``offset = token_offsets_bg[b, g]``
    (default 0): a partial rollout (``partial.py``) continues a sequence from its token
    ``offset`` with the keys a one-shot run would have used there. It passes
    ``whole_rollout``, the ``(B, G, P, T)`` of the rollout this call is a segment of: a pool
    fitted to device memory (``options.memory_utilization``) is then fitted for that whole
    rollout (:func:`fit_pool_to_memory`, ``continued``), so every segment shares one pool shape.

    ``queue``: this engine's view of the prompt queues it shares with the other data-parallel
    engines of the process (``paged_dp``; :mod:`~jaxrl_llm.rollout.stealing`). Then
    ``prompts`` (and the per-sample arrays) are the whole call's, the engine starts with the
    prompts of its own queue, takes others' when its own are done and it has room, and
    returns the rows of the prompts it ran only, in the order of ``queue.done``'s record.
    When the queues carry their :class:`~jaxrl_llm.rollout.stealing.Rows`, the engine reads
    the prompts and per-sample arrays from them instead of its arguments: prompts another
    process lent are appended there as they are taken (rows past the process's own); their
    outputs go back to that process as each finishes (:meth:`~jaxrl_llm.rollout.stealing.
    EngineQueue.send_back`), so the engine's own outputs hold this process's rows only.
    """
    if queue is not None and queue.rows is not None:
        rows = queue.rows  # shared with the process's other engines
    else:
        rows = stealing.Rows(prompts, budgets_bg, seq_ids_bg, token_offsets_bg)
    # The prefix index keys the prompts' bytes (int32). Per-sample values are read by row.
    prompts, budgets_bg = rows.prompts, rows.budgets
    seq_ids_bg, token_offsets_bg = rows.seq_ids, rows.offsets
    b_count, g = rows.local, rows.num_samples
    longest = max(len(p) for p in prompts[:b_count])
    widest = max(longest, rows.longest)  # the page tables' prompts: any lent one fits them
    ps, slots, k = options.page_size, options.num_slots, options.steps_per_dispatch
    chunk = options.prefill_chunk
    if not isinstance(params, EngineParams):
        params = engine_params(params)  # the layers sliced once per run, for every attention
    params, layers_l = params
    cfg = _model_config(graphdef, params, layers_l)
    kernel = attention_kernel(cfg, options, cache_dtype, mesh=mesh, params=params)
    share = queue.share if queue is not None else b_count  # the prompts this engine expects
    fit_b, fit_g, fit_p, fit_t = whole_rollout or (share, g, longest, max_new_tokens)
    options = fit_pool_to_memory(
        graphdef,
        cfg,
        mesh,
        EngineParams(params, layers_l),
        options,
        kernel,
        num_prompts=fit_b,
        num_samples=fit_g,
        longest_prompt=fit_p,
        max_new_tokens=fit_t,
        continued=whole_rollout is not None,
        cache_dtype=cache_dtype,
        greedy=greedy,
        top_k=top_k,
        top_p=float(top_p),
        pad_token_id=pad_token_id,
        num_stop_ids=len(stop_ids),
        full_logprobs=full_logprobs,
    )
    pool = pages_lib.init_pool(
        kernel, cfg.num_layers, options.num_pages, ps, cfg.num_kv_heads, cfg.head_dim, cache_dtype
    )
    if mesh is not None:  # the KV heads split over the engine's tensor axis, when it has one
        pool = jax.device_put(pool, pool_sharding(kernel, cfg, mesh))
    page_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pool)) // options.num_pages
    alloc = PageAllocator(options.num_pages)
    static = _make_static(
        options,
        kernel,
        greedy=greedy,
        top_k=top_k,
        top_p=top_p,
        pad_token_id=pad_token_id,
        full_logprobs=full_logprobs,
    )
    temp, topp = np.float32(temperature or 1.0), np.float32(top_p)
    stop_ids = np.asarray(stop_ids, np.int32)
    stop_set = {int(s) for s in stop_ids if s >= 0}

    def group_pages(b: int, horizon: int) -> int:
        return prompt_group_pages(len(prompts[b]), budgets_bg[b], ps, horizon)

    def least_pages(b: int) -> int:
        return least_prompt_pages(len(prompts[b]), budgets_bg[b], ps)

    def fits(b: int) -> bool:
        """Whether another process's prompt ``b`` fits this engine: its page tables (sized
        for ``rows.longest``) and its pool (sized for this process's own prompts)."""
        return len(prompts[b]) <= widest and least_pages(b) <= options.num_pages - 1

    for b in range(b_count):
        need = least_pages(b)
        if need > options.num_pages - 1:
            raise ValueError(
                f"generate(engine='paged'): prompt {b} ({len(prompts[b])} tokens, G={g}, "
                f"budgets up to {int(np.max(budgets_bg[b]))}) needs {need} pages of "
                f"{ps} tokens, but the pool has {options.num_pages - 1} (num_pages="
                f"{options.num_pages}, one is the trash page); raise num_pages"
            )

    seqs: dict[int, _Seq] = {}
    slot_seq = [-1] * slots  # sequence id per slot, -1 free
    lens = np.zeros((slots,), np.int32)
    token = np.zeros((slots,), np.int32)
    alive = np.zeros((slots,), bool)
    remaining = np.zeros((slots,), np.int32)
    gen_pos = np.zeros((slots,), np.int32)
    seq_id = np.zeros((slots,), np.int32)
    max_width = max_table_width(widest, max_new_tokens, ps)

    # The prompts waiting, in order: this engine's own, or its queue shared with the other
    # engines of the process (work stealing), read and popped holding its lock.
    pending: Any = deque(range(b_count)) if queue is None else queue
    lock: Any = contextlib.nullcontext() if queue is None else queue.lock
    most = max_prefill_group(share, g, slots)  # entries per prefill call
    resume: list[int] = []  # preempted sequences, oldest admission first: recomputed first
    finished: dict[int, _Seq] = {}
    dispatches = prefills = preemptions = prefill_tokens = shared_tokens = steps_run = 0
    admissions = itertools.count()  # admission order
    # Prefix sharing: a held full prompt page by (the page before it, or -1; its tokens'
    # bytes), so one key names one whole prefix; pages registered in the admission being
    # gathered are not written until its prefill runs. Pages that join the index are pinned
    # with the prefix before them (a reference of the index's own) until their admission has
    # run, or, when prompts were deferred for them, the next one: a prefix outlives sequences
    # that end at their first token.
    index: dict[tuple[int, bytes], int] = {}
    key_of: dict[int, tuple[int, bytes]] = {}
    unwritten: set[int] = set()
    pins: list[int] = []  # this admission's
    pinned: list[int] = []  # the previous admission's, kept for the prompts it deferred

    def take(n: int, refs: int = 1) -> list[int]:
        assert alloc.reserve(n), (n, alloc.available)
        return alloc.take(n, refs=refs)

    def release(pages: list[int]) -> None:
        alloc.release(pages)
        for page in pages:
            if alloc.refcount[page] == 0 and page in key_of:
                del index[key_of.pop(page)]

    def page_key(parent: int, prompt: np.ndarray, i: int) -> tuple[int, bytes]:
        return parent, prompt[i * ps : (i + 1) * ps].tobytes()

    def shared_prefix(b: int, whole: bool = False) -> list[int]:
        """The held pages that hold prompt ``b``'s leading full pages, in order (none without
        prefix sharing): at most all but the page of its last token, which the prefill must
        run to sample the first token (``whole``: every full page, for a context that goes on
        past the prompt)."""
        found: list[int] = []
        if options.prefix_sharing:
            parent = -1
            p = len(prompts[b])
            for i in range(p // ps if whole else (p - 1) // ps):
                page = index.get(page_key(parent, prompts[b], i))
                if page is None:
                    break
                found.append(page)
                parent = page
        return found

    def outputs(bs: Sequence[int]) -> tuple[np.ndarray, ...]:
        """The output rows of prompts ``bs``, every sample finished: tokens, mask, log-probs,
        truncated (and, with ``full_logprobs``, the full-vocabulary log-probs)."""
        n_rows, t = len(bs), max_new_tokens
        tokens = np.full((n_rows, g, t), pad_token_id, np.int32)
        mask = np.zeros((n_rows, g, t), bool)
        logps = np.zeros((n_rows, g, t), np.float32)
        truncated = np.zeros((n_rows, g), bool)
        full = np.zeros((n_rows, g, t), np.float32) if full_logprobs else None
        for r, b in enumerate(bs):
            for i in range(g):
                seq = finished[b * g + i]
                n = len(seq.tokens)
                tokens[r, i, :n] = seq.tokens
                mask[r, i, :n] = True
                logps[r, i, :n] = seq.logps
                truncated[r, i] = not seq.stopped
                if full is not None:
                    full[r, i, :n] = seq.full_logps
        return (tokens, mask, logps, truncated) + (() if full is None else (full,))

    def finish(s: int) -> None:
        seq = seqs.pop(s)
        release(seq.pages)
        finished[s] = seq
        b = seq.prompt
        if b >= b_count and all(b * g + i in finished for i in range(g)):
            # another process's prompt: its output rows go back now
            queue.send_back(b, tuple(x[0] for x in outputs([b])))

    def seat(sid: int) -> None:
        """Puts sequence ``sid`` (its KV cache written up to its last token) in a free slot."""
        seq = seqs[sid]
        slot = slot_seq.index(-1)
        n = len(seq.tokens)
        slot_seq[slot] = sid
        lens[slot], token[slot], alive[slot] = seq.prompt_len + n - 1, seq.tokens[-1], True
        remaining[slot] = seq.budget - n
        gen_pos[slot] = token_offsets_bg[seq.prompt][seq.sample] + n
        seq_id[slot] = seq_ids_bg[seq.prompt][seq.sample]

    def preempt(slot: int) -> None:
        """Takes slot ``slot``'s sequence off the pool (vLLM's recompute preemption): its pages
        go back, its tokens stay, and it waits to be prefilled again and continued."""
        nonlocal preemptions
        sid = slot_seq[slot]
        seq = seqs[sid]
        release(seq.pages)
        seq.pages = []
        slot_seq[slot], alive[slot] = -1, False
        bisect.insort(resume, sid, key=lambda s: seqs[s].admitted)
        preemptions += 1

    def new_group(b: int, found: list[int]) -> tuple[np.ndarray, np.ndarray, int, Any]:
        """Registers prompt ``b``'s G sequences and takes its prompt pages; returns its prefill
        entry: the prompt, the page of each prompt token for each sample ``[P_b, G]`` (the
        full pages, shared by the G samples: first ``found``, another prompt's, then its own;
        then sample ``i``'s own copy of the partial last page), the tokens ``found`` holds
        (not prefilled) and how to seat the samples. Its own full pages join the prefix
        index."""
        nonlocal shared_tokens
        p = len(prompts[b])
        n_full, tail = p // ps, p % ps
        alloc.share(found, refs=g)
        own = take(n_full - len(found), refs=g)
        shared = found + own
        register(b, found, own)
        shared_tokens += len(found) * ps
        tails = [take(1) for _ in range(g)] if tail else [[] for _ in range(g)]
        admitted = next(admissions)
        for i in range(g):
            budget = int(budgets_bg[b][i])
            seqs[b * g + i] = _Seq(b, i, p, budget, shared + tails[i], admitted=admitted)
        page_of_jg = np.empty((p, g), np.int32)
        page_of_jg[: n_full * ps] = np.repeat(np.asarray(shared, np.int32), ps)[:, None]
        if tail:
            page_of_jg[n_full * ps :] = np.asarray([t[0] for t in tails], np.int32)[None]

        def start(first: tuple[np.ndarray, np.ndarray, np.ndarray | None]) -> None:
            tok_g, logp_g, full_g = first
            for i in range(g):
                sid = b * g + i
                seq = seqs[sid]
                seq.tokens.append(int(tok_g[i]))
                seq.logps.append(float(logp_g[i]))
                if full_g is not None:
                    seq.full_logps.append(float(full_g[i]))
                seq.stopped = int(tok_g[i]) in stop_set
                if seq.stopped or seq.budget == 1:
                    finish(sid)
                else:
                    seat(sid)

        return prompts[b], page_of_jg, len(found) * ps, (seq_ids_bg[b], token_offsets_bg[b], start)

    def register(b: int, found: list[int], own: list[int]) -> None:
        """Prompt ``b``'s full pages ``own``, which follow its shared prefix ``found`` (the
        whole match) and are written by this admission's prefill, join the prefix index (up
        to a page a prompt alike holds already), pinned with the prefix before them."""
        if not options.prefix_sharing:
            return
        parent = found[-1] if found else -1
        chain = list(found)
        for i, page in enumerate(own, start=len(found)):
            key = page_key(parent, prompts[b], i)
            if key in index:  # the page of a last token, held by a prompt alike
                break
            index[key], key_of[page], parent = page, key, page
            unwritten.add(page)
            chain.append(page)
        if len(chain) > len(found):
            alloc.share(chain)
            pins.extend(chain)

    def recompute(sid: int, found: list[int]) -> tuple[np.ndarray, np.ndarray, int, Any]:
        """The prefill entry of preempted sequence ``sid``: its prompt and all its tokens but
        the last (the next input), after ``found`` (its held leading prompt pages, not run),
        into pages of its own (every sample column the same); its own full prompt pages join
        the prefix index for its siblings. The prefill's sampled token is not used."""
        nonlocal shared_tokens
        seq = seqs[sid]
        ctx = np.concatenate([prompts[seq.prompt], np.asarray(seq.tokens[:-1], np.int32)])
        alloc.share(found)
        own = take(_ceil_div(len(ctx), ps) - len(found))
        seq.pages = found + own
        register(seq.prompt, found, own[: max(seq.prompt_len // ps - len(found), 0)])
        skip = len(found) * ps
        shared_tokens += skip
        page_of = np.repeat(np.asarray(seq.pages, np.int32), ps)[: len(ctx)]
        ids = np.full((g,), seq_ids_bg[seq.prompt][seq.sample], np.int32)
        pos = np.full((g,), token_offsets_bg[seq.prompt][seq.sample], np.int32)
        return ctx, np.repeat(page_of[:, None], g, axis=1), skip, (ids, pos, lambda _: seat(sid))

    def prefill(entries: list[tuple[np.ndarray, np.ndarray, int, Any]]) -> None:
        """Prefills ``entries`` (context tokens, page of each token per sample ``[n, G]``,
        the leading tokens already in the pool (a shared prefix, not run), (sequence ids
        ``[G]``, token offsets ``[G]``, seat callback)) together, chunk by chunk (the rows of
        a chunk the entries that still have tokens), then seats each entry's sequences (the
        callback gets the entry's sampled tokens, log-probs, full log-probs)."""
        nonlocal pool, prefills, prefill_tokens
        first: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = {}
        start = 0
        while len(first) < len(entries):
            memory_maps.relieve(where="rollout.generate (paged prefill)")
            rows_e = [e for e, (ctx, _, skip, _) in enumerate(entries) if len(ctx) - skip > start]
            rows = prefill_rows(len(rows_e))
            offset_r = [entries[e][2] + start for e in rows_e]
            end_r = [len(entries[e][0]) for e in rows_e]
            length_r = [min(chunk, n - o) for n, o in zip(end_r, offset_r, strict=True)]
            # The chunk is written first and read from the pool too: the table covers
            # offset + width_c, in multiples of 128 tokens. Chunk widths are bucketed and
            # offsets are multiples of the chunk, or past a shared prefix its length: a few
            # table widths.
            width_c, cover = prefill_chunk_shape(max(offset_r), max(length_r), chunk, ps)
            tok = np.zeros((rows, width_c), np.int32)
            valid = np.zeros((rows, width_c), bool)
            wpage = np.full((rows, width_c, g), TRASH_PAGE, np.int32)
            woff = np.zeros((rows, width_c), np.int32)
            table = np.full((rows, cover), TRASH_PAGE, np.int32)
            ctx_len = np.full((rows,), start, np.int32)
            last = np.zeros((rows,), np.int32)
            ids = np.zeros((rows, g), np.int32)
            pos = np.zeros((rows, g), np.int32)
            for r, (e, o, n) in enumerate(zip(rows_e, offset_r, length_r, strict=True)):
                ctx, page_of, _, (ids_g, pos_g, _) = entries[e]
                tok[r, :n] = ctx[o : o + n]
                valid[r, :n] = True
                wpage[r, :n] = page_of[o : o + n]
                woff[r, :n] = np.arange(o, o + n) % ps
                table[r, : _ceil_div(o + n, ps)] = page_of[: o + n : ps, 0]
                ctx_len[r] = o
                last[r] = n - 1
                ids[r] = ids_g
                pos[r] = pos_g
            pool, tok_rg, logp_rg, full_rg = _prefill(
                graphdef,
                params,
                layers_l,
                pool,
                tok,
                valid,
                ctx_len,
                table,
                wpage,
                woff,
                last,
                ids,
                pos,
                rng,
                temp,
                topp,
                static=static,
            )
            prefills += 1
            prefill_tokens += sum(length_r)
            ends = np.flatnonzero(np.subtract(end_r, offset_r) <= chunk).tolist()
            if ends:
                tok_rg, logp_rg = np.asarray(tok_rg), np.asarray(logp_rg)
                full_rg = None if full_rg is None else np.asarray(full_rg)
                for r in ends:
                    full = None if full_rg is None else full_rg[r]
                    first[rows_e[r]] = (tok_rg[r], logp_rg[r], full)
            start += chunk
        for e, (_, _, _, (_, _, seat_entry)) in enumerate(entries):
            seat_entry(first[e])

    def admit() -> bool:
        """Prefills what fits now: preempted sequences first (oldest first; nothing new is
        admitted while one waits), then prompts in order, up to :func:`max_prefill_group`
        entries. An entry fits when its slots are free and the free pages hold its context and
        its sequences' next dispatch (only the next token when nothing is decoding: then it
        always fits), less the shared prefix it finds held. A prompt whose shared prefix an
        entry of this call writes waits for the next call, ahead of the prompts after it, so
        the prefix is computed once (SGLang's in-batch prefix deferral); the pages it waits
        for are pinned until then. Returns whether it prefilled or unpinned anything."""
        nonlocal pinned
        entries, free = [], slot_seq.count(-1)
        available = alloc.available
        while resume and len(entries) < most and free >= 1:
            seq = seqs[resume[0]]
            # its held leading prompt pages: every one once its context goes past the prompt
            found = shared_prefix(seq.prompt, whole=len(seq.tokens) >= 2)
            if unwritten.intersection(found):
                break  # a sibling recomputed in this call writes its prompt: the next call
            horizon = k if any(alive) or entries else 1
            ctx = seq.prompt_len + len(seq.tokens) - 1
            need = _ceil_div(ctx + min(horizon, seq.budget - len(seq.tokens)), ps) - len(found)
            if need > available:
                break
            available -= need
            free -= 1
            entries.append(recompute(resume.pop(0), found))
        blocked = bool(resume)  # a sequence or prompt of this engine waits for slots or pages
        deferred = []

        def room(b: int, found: list[int]) -> int | None:
            """The free pages prompt ``b`` needs now (``found``: its shared prefix), or None
            when its slots or pages are not free."""
            horizon = k if any(alive) or entries else 1
            need = group_pages(b, horizon) - len(found)
            return need if free >= g and need <= available else None

        def claim(b: int) -> tuple[list[int], int] | None:
            """``(shared prefix, pages needed)`` of another engine's prompt ``b`` when it can
            be admitted here now, else None."""
            if b >= b_count and not fits(b):  # another process's
                return None
            found = shared_prefix(b)
            need = None if unwritten.intersection(found) else room(b, found)
            return None if need is None else (found, need)

        with lock:
            while not resume and pending and len(entries) < most:
                if free < g:
                    blocked = True
                    break
                found = shared_prefix(pending[0])
                if unwritten.intersection(found):
                    deferred.append(pending.popleft())
                    continue
                need = room(pending[0], found)
                if need is None:
                    blocked = True
                    break
                available -= need
                free -= g
                entries.append(new_group(pending.popleft(), found))
            pending.extendleft(reversed(deferred))
            if queue is not None and blocked and pending:
                queue.open()  # the other engines may take this engine's last prompts
            # Out of prompts with room left: another engine's last waiting prompt.
            while queue is not None and not (resume or pending) and len(entries) < most:
                if free < g:  # no room for any prompt (nor a look at other processes')
                    break
                taken = queue.steal(claim)
                if taken is None:
                    break
                b, (found, need) = taken
                available -= need
                free -= g
                entries.append(new_group(b, found))
        if entries:
            prefill(entries)
        unwritten.clear()  # every page of the index is written now
        held, pinned = pinned, []
        release(held)  # the previous admission's pins: kept for this one admission only
        if deferred:  # this admission's pins wait for the prompts deferred for them
            pinned = list(pins)
        else:
            release(pins)
        pins.clear()
        return bool(entries or held)

    def plan_pages() -> int:
        """Gives every live slot the pages of its next dispatch's tokens (oldest admission
        first) and returns the dispatch's steps: ``k``, or fewer when the free pages do not
        hold ``k`` more tokens of every live slot; when they do not hold even one, the most
        recently admitted sequences are preempted until they do."""

        def extra(s: int, steps: int) -> int:
            want = _ceil_div(int(lens[s]) + min(steps, int(remaining[s])), ps)
            return max(want - len(seqs[slot_seq[s]].pages), 0)

        live = sorted(np.flatnonzero(alive), key=lambda s: seqs[slot_seq[s]].admitted)
        while True:
            steps = k
            while steps >= 1 and sum(extra(s, steps) for s in live) > alloc.available:
                steps //= 2
            if steps >= 1:
                for s in live:
                    seqs[slot_seq[s]].pages += take(extra(s, steps))
                return steps
            preempt(live.pop())

    with contextlib.ExitStack() as stack:
        if mesh is not None:
            stack.enter_context(jax.set_mesh(mesh))
        while pending or seqs or (queue is not None and queue.others_waiting()):
            # XLA:CPU: each new bucket's programs map hundreds of regions (memory_maps).
            memory_maps.relieve(where="rollout.generate (paged decode)")
            while admit():
                pass
            if not any(alive):
                # Nothing decoding holds no page, and each sequence alone fits the pool.
                assert not (pending or resume), "paged scheduler: nothing admissible"
                if queue is not None:  # until another engine opens its queue, or all are done
                    queue.wait()
                continue
            steps = plan_pages()
            needed = max(len(seqs[slot_seq[s]].pages) for s in np.flatnonzero(alive))
            width = decode_table_width(needed, ps, max_width)
            # The live slots, packed into the smallest slot bucket that holds them (a
            # sequence's tokens do not depend on its row): the long tail of a batch decodes
            # at the width of what is left, not of num_slots.
            live = np.flatnonzero(alive)
            bucket = slot_bucket(len(live), slots)
            rows_j = np.concatenate([live, np.flatnonzero(~alive)[: bucket - len(live)]])
            table = np.full((bucket, width), TRASH_PAGE, np.int32)
            for j, slot in enumerate(rows_j[: len(live)]):
                pages = seqs[slot_seq[slot]].pages[:width]
                table[j, : len(pages)] = pages
            arrays = (lens, token, alive, remaining, gen_pos, seq_id)
            state = _SlotState(*(x[rows_j] for x in arrays))
            # With sequences waiting, return as soon as enough slots free up to admit one (a
            # preempted sequence needs one, a prompt G); the pages they need free up too.
            waiting = bool(pending or resume) or (queue is not None and queue.stealable())
            free_now = slot_seq.count(-1)
            wanted = 1 if resume else g
            refill_at = np.int32(max(wanted - free_now, 1) if waiting else 2**30)
            # Without prompts waiting, also return once the live rows fit half the bucket, so
            # that the tail decodes at its own width whatever steps_per_dispatch is.
            half = bucket // 2
            shrink_at = np.int32(half if not waiting and half >= _MIN_SLOT_BUCKET else -1)
            pool, state, tok_kn, logp_kn, valid_kn, full_kn = _decode(
                graphdef,
                params,
                layers_l,
                pool,
                table,
                state,
                rng,
                temp,
                topp,
                stop_ids,
                refill_at,
                shrink_at,
                np.int32(steps),
                static=static,
            )
            dispatches += 1
            for x, new in zip(arrays, state, strict=True):
                x[rows_j] = np.asarray(new)
            tok_kn, logp_kn, valid_kn = (
                np.asarray(tok_kn),
                np.asarray(logp_kn),
                np.asarray(valid_kn),
            )
            full_kn = None if full_kn is None else np.asarray(full_kn)
            steps_run += int(valid_kn.any(axis=1).sum())
            for j, slot in enumerate(rows_j[: len(live)]):
                sid = slot_seq[slot]
                seq = seqs[sid]
                rows = valid_kn[:, j]
                seq.tokens += tok_kn[rows, j].tolist()
                seq.logps += logp_kn[rows, j].tolist()
                if full_kn is not None:
                    seq.full_logps += full_kn[rows, j].tolist()
                if not alive[slot]:
                    seq.stopped = seq.tokens[-1] in stop_set
                    finish(sid)
                    slot_seq[slot] = -1

    # The output's row of each prompt run: all of them, or with shared queues this process's
    # prompts this engine ran, in prompt order (another process's went back as they finished).
    ran = range(b_count)
    if queue is not None:
        ran = sorted({seq.prompt for seq in finished.values() if seq.prompt < b_count})
        queue.done(ran)
    arrays = outputs(ran)
    assert not index, "paged scheduler: a released page is still in the prefix index"
    stats = PagedStats(
        alloc.peak,
        page_bytes,
        dispatches,
        prefills,
        alloc.in_use,
        preemptions,
        options.num_pages,
        prefill_tokens,
        shared_tokens,
        steps_run,
        0 if queue is None else queue.stolen,
    )
    return arrays, stats


def attention_kernel(
    cfg: Any,
    options: PagedOptions,
    cache_dtype: jnp.dtype,
    *,
    mesh: jax.sharding.Mesh | None = None,
    params: Params | None = None,
    platform: str | None = None,
) -> KernelSpec | None:
    """The kernel ``options.attention`` resolves to for model config ``cfg`` (None: the
    reference attention); :func:`pages.resolve_attention` says when and why (clear errors).

    The platform is the parameters' (else ``jax.default_backend()``). A Pallas call is not
    partitioned by XLA, so the kernels run per device: on one device, or on a tensor-parallel
    engine's mesh (only its ``tensor`` axis > 1, dividing the query and the KV heads) on each
    device's own heads (:func:`_per_kv_head_shard`), the kernel's shape checks made for one
    device's heads. On any other mesh of several devices ``auto`` is the reference and a named
    kernel an error.
    """
    if platform is None:
        leaves = jax.tree.leaves(params) if params is not None else []
        devices = leaves[0].devices() if leaves and hasattr(leaves[0], "devices") else ()
        platform = next(iter(devices)).platform if devices else jax.default_backend()
    windows = tuple(cfg.window(i) for i in range(cfg.num_layers))
    split = None if mesh is None or mesh.devices.size == 1 else _tensor_parallel_refusal(cfg, mesh)
    t = 1 if split is not None or mesh is None else mesh.devices.size  # heads per device: H / t
    name = pages_lib.resolve_attention(
        options.attention,
        platform=platform,
        num_heads=cfg.num_heads // t,
        num_kv_heads=cfg.num_kv_heads // t,
        head_dim=cfg.head_dim,
        windows=windows,
        cache_dtype=jnp.dtype(cache_dtype),
    )
    if name != "reference" and split is not None:
        if options.attention == "auto":
            return None
        raise ValueError(f"generate(engine='paged'): attention={name!r} {split}")
    return pages_lib.kernel_spec(
        name,
        num_pages=options.num_pages,
        page_size=options.page_size,
        head_dim=cfg.head_dim,
        window=windows[0],
        platform=platform,
        tuning=options.kernel_tuning,
    )


def pool_sharding(kernel: KernelSpec | None, cfg: Any, mesh: jax.sharding.Mesh) -> NamedSharding:
    """Where an engine on ``mesh`` keeps its page pool: :func:`pages.pool_spec` (the KV heads
    split over a ``tensor`` axis that divides them, else replicated)."""
    tensor = dict(mesh.shape).get("tensor", 1)
    return NamedSharding(mesh, pages_lib.pool_spec(kernel, cfg.num_kv_heads, tensor))


def _tensor_parallel_refusal(cfg: Any, mesh: jax.sharding.Mesh) -> str | None:
    """Why a kernel cannot run on ``mesh``'s devices (None: it can): the kernels run per
    device, on one device or, on a tensor-parallel engine's mesh (only its ``tensor`` axis
    > 1), on each device's own heads (:func:`_per_kv_head_shard`), so the axis must divide
    the query and the KV heads; a kernel cannot be split over a batch axis."""
    t = dict(mesh.shape).get("tensor", 1)
    if mesh.devices.size != t:
        return (
            f"runs on one device or on a tensor-parallel engine's devices (only the tensor axis "
            f"> 1); the parameters are on a mesh {dict(mesh.shape)} (use attention='reference' "
            "or 'auto', or rollout tensor_parallel)"
        )
    if cfg.num_heads % t or cfg.num_kv_heads % t:
        return (
            f"splits the heads over the engine's tensor axis of {t}, which does not divide the "
            f"model's {cfg.num_heads} query and {cfg.num_kv_heads} KV heads (use "
            "attention='reference' or 'auto', or a tensor_parallel dividing both)"
        )
    return None


def _model_config(
    graphdef: nnx.GraphDef, params: Params, layers_l: LayerParams | None = None
) -> Any:
    """The model's config (its stacked layers, when split off, as shapes only)."""
    return nnx.merge(graphdef, _with_stacked(params, layers_l, _stacked_shape)).config


def _stacked_shape(xs: tuple[Any, ...]) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)


def stacked_shapes(params: EngineParams) -> Params:
    """The parameter dict ``params`` came from, its stacked layers as shapes only (for
    ``nnx.merge``: the model's config and its parameters' metadata, nothing computed)."""
    return _with_stacked(params.rest, params.layers, _stacked_shape)
