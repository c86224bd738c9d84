"""Attention as a pure function, with causal, sliding-window, padding and segment masks.

``attention(q_bthd, k_bskd, v_bskd, ...)`` computes, for query ``t`` and query head ``h``,

    out[b, t, h] = sum_s p[b, h, t, s] v[b, s, h // G],
    p[b, h, t, s] = softmax_s(q[b, t, h] . k[b, s, h // G] / sqrt(Dh)  over allowed s),

with ``G = H / K`` query heads per key/value head (grouped-query attention, Ainslie et al.
2023). Key ``s`` is allowed for query ``t`` when all of these hold:

- causal: ``s <= t + q_offset`` (``q_offset`` is the query's first slot in the key axis, e.g.
  the KV-cache write index; 0 for a plain forward pass);
- window: ``t + q_offset - s < window`` (a sliding window of ``window`` keys including the
  query's own; ``None`` for full attention, as Mistral/Qwen2's ``sliding_window``);
- key validity: ``kv_mask_bs[b, s]`` (padding keys are never read);
- segments: ``segment_ids_bt[b, t] == kv_segment_ids_bs[b, s] != 0``. Packed rows hold several
  sequences side by side; a token attends only within its own segment; id 0 is padding.

Implementations (``implementation=``):

- ``"reference"``: plain JAX, float32 scores and softmax; runs everywhere (CPU tests).
- ``"splash"`` (TPU): the Pallas splash-attention kernel
  (``jax.experimental.pallas.ops.tpu.splash_attention``, as MaxText uses it) with
  ``SegmentIds`` and a static causal / local mask. Runs on CPU with ``interpret=True`` (tests).
- ``"cudnn"`` (GPU): ``jax.nn.dot_product_attention(..., implementation="cudnn")`` (cuDNN
  flash attention). Runs on GPU only; the same call with ``implementation="xla"`` (the
  ``cudnn_xla`` testing form here) runs on CPU and checks the argument wiring. Padding and
  segments go in as a dense ``[B, 1, T, S]`` mask: O(T²) bytes per row and layer.
- ``"pallas_gpu"`` (GPU): the Pallas/Triton flash attention jax ships
  (``jax.experimental.pallas.ops.gpu.attention.mha``), whose mask is one int32 segment id per
  token: O(T) bytes, for the long packed rows where cuDNN's dense mask is the cost. Runs on CPU
  in interpret mode (the tests). Opt-in: ``"auto"`` keeps cuDNN.
- ``"auto"``: by the platform traced for (:func:`trace_platform`: ``jax.default_backend()``,
  or the one :func:`for_platform` sets): tpu -> splash, gpu -> cudnn, else reference; the
  reference also where the kernel's requirements are not met or cuDNN is unusable (logged).

Kernel requirements are checked up front and raise :class:`ValueError` naming the failed
requirement and the fallback (``implementation="reference"``, config ``model.attention``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from typing import Literal

import jax
import jax.numpy as jnp

_log = logging.getLogger(__name__)

Implementation = Literal["auto", "reference", "splash", "cudnn", "pallas_gpu"]
IMPLEMENTATIONS: tuple[str, ...] = ("auto", "reference", "splash", "cudnn", "pallas_gpu")

_TRACE_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jaxrl_llm_trace_platform", default=None
)
_EMULATED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "jaxrl_llm_emulated_platform", default=False
)


def trace_platform() -> str:
    """The platform that trace-time ``auto`` choices are made for: ``jax.default_backend()``,
    or the one set by :func:`for_platform`. The choices: ``"auto"`` attention, splash's
    interpret mode, the log-prob pass's logits block size (``models/logprobs.py``)."""
    return _TRACE_PLATFORM.get() or jax.default_backend()


def emulated() -> bool:
    """Whether the platform traced for (:func:`for_platform`) is emulated on this machine's
    CPU: its kernels then run in CPU stand-ins (cuDNN's by the reference, Pallas interpreted)."""
    return _EMULATED.get()


@contextlib.contextmanager
def for_platform(platform: str | None, *, emulated: bool = False) -> Iterator[None]:
    """Within the block, trace for ``platform`` (``"cpu"``, ``"gpu"`` or ``"tpu"``) rather than
    this process's backend: ``jaxrl-llm plan`` lowers a step for a TPU it does not have, and
    that step must run the TPU's attention kernel (splash, compiled by Mosaic, not interpreted)
    as the trainer on the TPU would. None changes nothing.

    ``emulated``: the program is compiled for this machine's CPU, standing in for
    ``platform`` (a GPU plan, which has no deviceless compiler): the choices stay the
    platform's (``auto`` is cuDNN, the logits blocks are an accelerator's), but the kernels run
    in CPU stand-ins: the Pallas kernels interpreted, and cuDNN by the reference attention
    (whose query blocks hold what flash attention's tiles do, roughly; the XLA form of cuDNN's
    call would hold the whole ``[B, H, T, S]`` scores, which flash attention never forms).

    Only what is traced inside the block is affected; a function traced there must not be
    called outside it (jit's caches do not know the platform): lower fresh closures only.
    """
    if platform is None:
        yield
        return
    if platform not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"for_platform: platform must be cpu, gpu or tpu, got {platform!r}")
    token, emulation = _TRACE_PLATFORM.set(platform), _EMULATED.set(emulated)
    try:
        yield
    finally:
        _EMULATED.reset(emulation)
        _TRACE_PLATFORM.reset(token)


def resolve_implementation(implementation: str = "auto", backend: str | None = None) -> str:
    """The concrete implementation: ``"auto"`` maps tpu -> splash, gpu -> cudnn, else reference."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    if implementation != "auto":
        return implementation
    backend = backend or trace_platform()
    return {"tpu": "splash", "gpu": "cudnn"}.get(backend, "reference")


def implementation_for(
    requested: str,
    q_bthd: jax.Array | jax.ShapeDtypeStruct,
    k_bskd: jax.Array | jax.ShapeDtypeStruct,
    causal: bool = True,
    q_offset: int | jax.Array = 0,
    window: int | jax.Array | None = None,
    backend: str | None = None,
) -> str:
    """The implementation ``requested`` runs for these inputs: :func:`resolve_implementation`,
    and for ``"auto"`` the reference where the chosen kernel cannot take them
    (:func:`kernel_problem`). An explicitly named kernel is returned as is (its call raises)."""
    impl = resolve_implementation(requested, backend)
    if requested == "auto" and kernel_problem(impl, q_bthd, k_bskd, causal, q_offset, window):
        return "reference"
    return impl


def attention_mask(
    t: int,
    s: int,
    *,
    q_offset: int | jax.Array = 0,
    causal: bool = True,
    window: int | jax.Array | None = None,
    kv_mask_bs: jax.Array | None = None,
    segment_ids_bt: jax.Array | None = None,
    kv_segment_ids_bs: jax.Array | None = None,
) -> jax.Array:
    """bool ``[B or 1, T, S]``: which keys each query may read (the rules in the module doc)."""
    q_slot_t = jnp.arange(t, dtype=jnp.int32) + jnp.asarray(q_offset, jnp.int32)
    k_slot_s = jnp.arange(s, dtype=jnp.int32)
    allowed_ts = jnp.ones((t, s), bool)
    if causal:
        allowed_ts = k_slot_s[None, :] <= q_slot_t[:, None]
    if window is not None:
        allowed_ts = allowed_ts & (k_slot_s[None, :] > q_slot_t[:, None] - window)
    allowed_bts = allowed_ts[None]
    if kv_mask_bs is not None:
        allowed_bts = allowed_bts & kv_mask_bs[:, None, :]
    if segment_ids_bt is not None:
        allowed_bts = allowed_bts & segment_mask(segment_ids_bt, kv_segment_ids_bs)
    return allowed_bts


def segment_mask(
    segment_ids_bt: jax.Array,
    kv_segment_ids_bs: jax.Array | None = None,
    prefix_ids_bt: jax.Array | None = None,
) -> jax.Array:
    """bool ``[B, T, S]``: ``q_seg[b, t] == kv_seg[b, s] != 0`` (kv ids default to the q ids).

    ``prefix_ids_bt``: a second segment each query may read, ``kv_seg[b, s] == prefix[b, t]``
    (a shared prompt: a sample's tokens read its own segment and the prompt's; packing's
    shared prompts, ``train/packing.py``)."""
    kv_segment_ids_bs = segment_ids_bt if kv_segment_ids_bs is None else kv_segment_ids_bs
    same_bts = segment_ids_bt[:, :, None] == kv_segment_ids_bs[:, None, :]
    if prefix_ids_bt is not None:
        same_bts = same_bts | (prefix_ids_bt[:, :, None] == kv_segment_ids_bs[:, None, :])
    return same_bts & (segment_ids_bt != 0)[:, :, None]


QUERY_BLOCK = 128
"""The query block of the models' cache-free forward passes (:func:`reference_attention` with
``causal=True``): rows of at least twice this many tokens are computed block by block. Measured
(``scripts/bench_attention_blocks.py``, two SmolLM2-shaped layers, 2 rows, forward+backward,
float32, no remat): rows of 512 tokens 309 -> 212 MiB of XLA temporaries and 1.18x faster,
rows of 2,048 tokens 2,739 -> 1,172 MiB and 1.64x faster on a 2-core AMD EPYC Zen 4 (AVX-512);
1.13x and 1.88x faster, the same memory, on a Zen 3 (AVX2 only) (BENCHMARKS.md, "Packed,
token-budget updates")."""


def reference_attention(
    q_bthd: jax.Array,
    k_bskd: jax.Array,
    v_bskd: jax.Array,
    allowed_bts: jax.Array,
    *,
    causal: bool = False,
    query_block: int | None = None,
) -> jax.Array:
    """``softmax(q k^T / sqrt(Dh)) v`` over allowed keys; query head ``h`` reads kv head ``h // G``.

    ``allowed_bts`` is bool ``[B or 1, T, S]`` (:func:`attention_mask`). Scores and softmax are
    float32. A query with no allowed key (a padding position) gets a uniform average instead of
    NaN; its output is never used.

    ``query_block``: with ``T >= 2 * query_block``, the queries are computed in blocks of that
    many, each block under ``jax.checkpoint``: only one block's ``[T_block, S]`` scores are live
    at a time, forward and backward (the backward recomputes a block's softmax instead of
    keeping the whole ``[T, S]`` one). ``causal``: the caller promises that key ``s`` is never
    allowed for query ``t < s`` (self-attention, ``S == T``, as every cache-free forward pass);
    block ``[t0, t1)`` then reads only keys ``< t1``, which skips the masked upper triangle's
    scores (about ``(n - 1) / 2n`` of them for ``n`` blocks). Each query's softmax is over the
    same allowed keys, so the result equals the unblocked one to float rounding.
    """
    t, s = q_bthd.shape[1], k_bskd.shape[1]
    if query_block is None or t < 2 * query_block:
        return _attend(q_bthd, k_bskd, v_bskd, allowed_bts)
    if causal and s != t:
        raise ValueError(f"causal query blocks need as many keys as queries (S={s}, T={t})")
    block = jax.checkpoint(_attend)
    outs = []
    for t0 in range(0, t, query_block):
        t1 = min(t0 + query_block, t)
        s1 = t1 if causal else s
        allowed = allowed_bts[:, t0:t1, :s1]
        outs.append(block(q_bthd[:, t0:t1], k_bskd[:, :s1], v_bskd[:, :s1], allowed))
    return jnp.concatenate(outs, axis=1)


def _attend(
    q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array, allowed_bts: jax.Array
) -> jax.Array:
    b, t, h, hd = q_bthd.shape
    kv_heads = k_bskd.shape[2]
    q_btkgd = q_bthd.reshape(b, t, kv_heads, h // kv_heads, hd) * jnp.asarray(
        hd**-0.5, q_bthd.dtype
    )
    # Axis orders follow dot_general's natural output (batch dims, lhs free, rhs free), so
    # the [.., T, S] scores need no extra transposes in either pass.
    scores = jnp.einsum("btkgd,bskd->bktgs", q_btkgd, k_bskd, preferred_element_type=jnp.float32)
    neg = jnp.finfo(jnp.float32).min
    scores = jnp.where(allowed_bts[:, None, :, None, :], scores, neg)
    probs = jax.nn.softmax(scores, axis=-1).astype(q_bthd.dtype)
    out_btkgd = jnp.einsum("bktgs,bskd->btkgd", probs, v_bskd, preferred_element_type=jnp.float32)
    return out_btkgd.astype(q_bthd.dtype).reshape(b, t, h, hd)


def _check_shapes(
    q_bthd: jax.Array,
    k_bskd: jax.Array,
    v_bskd: jax.Array,
    kv_mask_bs: jax.Array | None,
    segment_ids_bt: jax.Array | None,
    kv_segment_ids_bs: jax.Array | None,
) -> None:
    if q_bthd.ndim != 4 or k_bskd.ndim != 4 or v_bskd.ndim != 4:
        raise ValueError(
            "attention expects q [B, T, H, Dh], k and v [B, S, K, Dh]; got ranks "
            f"{q_bthd.ndim}, {k_bskd.ndim}, {v_bskd.ndim}"
        )
    b, t, h, hd = q_bthd.shape
    if k_bskd.shape != v_bskd.shape:
        raise ValueError(f"k {k_bskd.shape} and v {v_bskd.shape} must have the same shape")
    bk, s, kv_heads, hdk = k_bskd.shape
    if bk != b or hdk != hd:
        raise ValueError(
            f"q {q_bthd.shape} and k {k_bskd.shape} must share batch and head_dim "
            "(q [B, T, H, Dh], k [B, S, K, Dh])"
        )
    if h % kv_heads:
        raise ValueError(f"query heads H={h} must be a multiple of kv heads K={kv_heads}")
    for name, x, shape in (
        ("kv_mask_bs", kv_mask_bs, (b, s)),
        ("segment_ids_bt", segment_ids_bt, (b, t)),
        ("kv_segment_ids_bs", kv_segment_ids_bs, (b, s)),
    ):
        if x is not None and x.shape != shape:
            raise ValueError(f"{name} has shape {x.shape}, expected {shape}")
    if kv_mask_bs is not None and kv_mask_bs.dtype != jnp.bool_:
        raise TypeError(f"kv_mask_bs must be boolean, got dtype {kv_mask_bs.dtype}")
    for name, x in (("segment_ids_bt", segment_ids_bt), ("kv_segment_ids_bs", kv_segment_ids_bs)):
        if x is not None and not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name} must be an integer array (0 = padding), got {x.dtype}")
    if kv_segment_ids_bs is not None and segment_ids_bt is None:
        raise ValueError("kv_segment_ids_bs needs segment_ids_bt (the queries' segment ids)")


def attention(
    q_bthd: jax.Array,
    k_bskd: jax.Array,
    v_bskd: jax.Array,
    *,
    causal: bool = True,
    window: int | jax.Array | None = None,
    q_offset: int | jax.Array = 0,
    kv_mask_bs: jax.Array | None = None,
    segment_ids_bt: jax.Array | None = None,
    kv_segment_ids_bs: jax.Array | None = None,
    implementation: str = "auto",
) -> jax.Array:
    """Masked grouped-query attention ``[B, T, H, Dh]`` (formula and masks in the module doc).

    Args:
      q_bthd: queries ``[B, T, H, Dh]``.
      k_bskd, v_bskd: keys and values ``[B, S, K, Dh]``, ``H % K == 0``.
      causal: mask keys after the query (slot ``t + q_offset``).
      window: sliding window (keys ``t + q_offset - s < window``), ``None`` for none.
      q_offset: the first query's slot in the key axis (KV-cache index); 0 for a forward pass.
      kv_mask_bs: bool ``[B, S]``, ``False`` for padding keys.
      segment_ids_bt: int32 ``[B, T]`` segment of each query, 0 = padding.
      kv_segment_ids_bs: int32 ``[B, S]`` segment of each key; defaults to ``segment_ids_bt``
        (needs ``S == T``).
      implementation: ``"auto"``, ``"reference"``, ``"splash"``, ``"cudnn"`` or ``"pallas_gpu"``.

    Returns:
      ``[B, T, H, Dh]`` in ``q``'s dtype. Rows of padding queries (no allowed key) hold
      implementation-dependent values and must not be used.
    """
    _check_shapes(q_bthd, k_bskd, v_bskd, kv_mask_bs, segment_ids_bt, kv_segment_ids_bs)
    if segment_ids_bt is not None and kv_segment_ids_bs is None:
        if k_bskd.shape[1] != q_bthd.shape[1]:
            raise ValueError(
                f"segment_ids_bt alone needs as many keys as queries (S={k_bskd.shape[1]}, "
                f"T={q_bthd.shape[1]}); pass kv_segment_ids_bs"
            )
        kv_segment_ids_bs = segment_ids_bt
    impl = implementation_for(implementation, q_bthd, k_bskd, causal, q_offset, window)
    masks = dict(
        causal=causal,
        window=window,
        q_offset=q_offset,
        kv_mask_bs=kv_mask_bs,
        segment_ids_bt=segment_ids_bt,
        kv_segment_ids_bs=kv_segment_ids_bs,
    )
    if impl == "reference":
        allowed_bts = attention_mask(q_bthd.shape[1], k_bskd.shape[1], **masks)
        return reference_attention(q_bthd, k_bskd, v_bskd, allowed_bts)
    if impl == "splash":
        return splash_attention(q_bthd, k_bskd, v_bskd, **masks)
    if impl == "pallas_gpu":
        return pallas_gpu_attention(q_bthd, k_bskd, v_bskd, **masks)
    if emulated():  # a GPU plan on CPU: cuDNN's flash attention stood in for by the models'
        t, s = q_bthd.shape[1], k_bskd.shape[1]  # reference, causal query blocks included
        allowed_bts = attention_mask(t, s, **masks)
        blocks = causal and t == s
        return reference_attention(
            q_bthd,
            k_bskd,
            v_bskd,
            allowed_bts,
            causal=blocks,
            query_block=QUERY_BLOCK if blocks else None,
        )
    try:  # jax checks cuDNN's presence, version and shape support while tracing
        return cudnn_attention(q_bthd, k_bskd, v_bskd, **masks)
    except (NotImplementedError, RuntimeError) as e:
        if implementation != "auto":
            raise ValueError(f"cudnn attention is not available here ({e}); {_FALLBACK}") from e
        _log.warning("cudnn attention is not available (%s); using the reference", e)
        allowed_bts = attention_mask(q_bthd.shape[1], k_bskd.shape[1], **masks)
        return reference_attention(q_bthd, k_bskd, v_bskd, allowed_bts)


_FALLBACK = 'use implementation="reference" (config: model.attention: reference)'


def _static_int(x: int | jax.Array | None) -> int | None:
    """``int(x)`` for a Python/concrete value, ``None`` for a traced one."""
    try:
        return None if x is None else int(x)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
        return None


def kernel_problem(
    impl: str,
    q_bthd: jax.Array,
    k_bskd: jax.Array,
    causal: bool = True,
    q_offset: int | jax.Array = 0,
    window: int | jax.Array | None = None,
    cudnn_implementation: str = "cudnn",
) -> str | None:
    """Why kernel ``impl`` cannot run these inputs (``None`` if it can); the reference always can.

    - both kernels: static ``q_offset == 0`` and ``S == T`` (self-attention without a cache),
      a static (Python int) ``window``;
    - splash: ``T`` a multiple of 128 (its blocks are multiples of 128 lanes), float32 or
      bfloat16;
    - cudnn: float16/bfloat16 (cuDNN flash attention has no float32 path), ``Dh`` a multiple
      of 8 and at most 256 (128 before Hopper), even ``T``, causal;
    - pallas_gpu: ``T`` a multiple of 16 (its blocks), ``Dh >= 16``, no sliding window.
    """
    if impl == "reference":
        return None
    t, s, hd = q_bthd.shape[1], k_bskd.shape[1], q_bthd.shape[3]
    if _static_int(q_offset) != 0 or s != t:
        return f"{impl} attention needs self-attention with no cache offset (T == S, q_offset 0)"
    if window is not None and _static_int(window) is None:
        return f"{impl} attention needs a static (Python int) window, got a traced value"
    if impl == "splash":
        if t % 128:
            return f"splash attention needs T a multiple of 128, got T={t} (pad the rows)"
        if q_bthd.dtype not in (jnp.float32, jnp.bfloat16):
            return f"splash attention needs float32 or bfloat16, got {q_bthd.dtype}"
        return None
    if impl == "pallas_gpu":
        if t % 16:
            return f"pallas_gpu attention needs T a multiple of 16, got T={t} (pad the rows)"
        if hd < 16:
            return f"pallas_gpu attention needs head_dim >= 16, got {hd}"
        if window is not None:
            return "pallas_gpu attention has no sliding window (the model's layers have one)"
        return None
    if cudnn_implementation == "cudnn":
        if q_bthd.dtype not in (jnp.float16, jnp.bfloat16):
            return f"cudnn attention needs float16/bfloat16 inputs, got {q_bthd.dtype}"
        if hd % 8 or hd > 256:
            return f"cudnn attention needs head_dim a multiple of 8 and <= 256, got {hd}"
        if t % 2:
            return f"cudnn attention with a mask needs an even sequence length, got T={t}"
    if not causal:
        return "the cudnn path here is causal only"
    return None


def _require(impl: str, problem: str | None) -> None:
    if problem is not None:
        raise ValueError(f"{problem}; {_FALLBACK}")


def _interpret(platform: str) -> bool:
    """A Pallas kernel for ``platform`` runs interpreted unless traced for that platform and
    compiled for it (not :func:`emulated`)."""
    return trace_platform() != platform or emulated()


def _block(length: int, sizes: tuple[int, ...] = (512, 256, 128)) -> int:
    """The largest block of ``sizes`` (splash's: 512, 256 or 128) that divides ``length``."""
    return next(b for b in sizes if length % b == 0)


def splash_attention(
    q_bthd: jax.Array,
    k_bskd: jax.Array,
    v_bskd: jax.Array,
    *,
    causal: bool = True,
    window: int | None = None,
    q_offset: int = 0,
    kv_mask_bs: jax.Array | None = None,
    segment_ids_bt: jax.Array | None = None,
    kv_segment_ids_bs: jax.Array | None = None,
    block_size: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Splash attention (TPU Pallas; ``jax.experimental.pallas.ops.tpu.splash_attention``).

    The static part of the mask is a ``CausalMask`` (``LocalMask`` with window
    ``(window - 1, 0)`` for sliding windows, i.e. ``t - window < s <= t``), one per query head;
    the dynamic part is ``SegmentIds(q, kv)``: a key is read when its id equals the query's.
    Padding keys without segment ids become id 0 (real tokens 1), so they are never read by a
    real token. Grouped-query attention is the kernel's own (``make_splash_mha`` with
    ``K | H`` kv heads); the batch is a ``vmap``. ``q`` is scaled by ``1/sqrt(Dh)`` first (the
    kernel does not scale). Block sizes default to the largest of 512/256/128 dividing ``T``
    (``block_size`` overrides; with segment ids it must be a multiple of 128).
    ``interpret`` defaults to ``trace_platform() != "tpu"`` (Pallas interpret mode on CPU,
    slow but exact: what the tests run). Requirements: :func:`kernel_problem`. XLA cannot
    partition it: under a multi-device mesh call it inside ``shard_map`` (the model does).
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    _require("splash", kernel_problem("splash", q_bthd, k_bskd, causal, q_offset, window))
    b, t, h, hd = q_bthd.shape
    s = k_bskd.shape[1]
    if segment_ids_bt is None and kv_mask_bs is not None:
        kv_segment_ids_bs = kv_mask_bs.astype(jnp.int32)
        # Padding queries read padding keys: no query row is empty (the kernel needs that).
        segment_ids_bt = kv_segment_ids_bs if s == t else jnp.ones((b, t), jnp.int32)
    elif segment_ids_bt is not None:
        if kv_segment_ids_bs is None:
            kv_segment_ids_bs = segment_ids_bt
        if kv_mask_bs is not None:
            kv_segment_ids_bs = jnp.where(kv_mask_bs, kv_segment_ids_bs, -1)
    window = _static_int(window)
    if window is not None:
        head_mask = splash.LocalMask((t, s), (window - 1, 0 if causal else None), offset=0)
    elif causal:
        head_mask = splash.CausalMask((t, s))
    else:
        head_mask = splash.FullMask((t, s))
    bq = block_size or _block(t)
    bkv = block_size or _block(s)
    blocks = splash.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bkv,
        block_q_dkv=bq,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv,
        block_q_dq=bq,
        block_kv_dq=bkv,
    )
    kernel = splash.make_splash_mha(
        splash.MultiHeadMask([head_mask] * h),
        block_sizes=blocks,
        head_shards=1,
        q_seq_shards=1,
        interpret=_interpret("tpu") if interpret is None else interpret,
    )
    q_bhtd = jnp.swapaxes(q_bthd * jnp.asarray(hd**-0.5, q_bthd.dtype), 1, 2)
    k_bksd = jnp.swapaxes(k_bskd, 1, 2).astype(q_bthd.dtype)
    v_bksd = jnp.swapaxes(v_bskd, 1, 2).astype(q_bthd.dtype)
    if segment_ids_bt is None:
        out_bhtd = jax.vmap(kernel)(q_bhtd, k_bksd, v_bksd)
    else:
        segments = splash.SegmentIds(
            q=segment_ids_bt.astype(jnp.int32), kv=kv_segment_ids_bs.astype(jnp.int32)
        )
        out_bhtd = jax.vmap(lambda q, k, v, seg: kernel(q, k, v, segment_ids=seg))(
            q_bhtd, k_bksd, v_bksd, segments
        )
    return jnp.swapaxes(out_bhtd, 1, 2).astype(q_bthd.dtype)


def pallas_gpu_attention(
    q_bthd: jax.Array,
    k_bskd: jax.Array,
    v_bskd: jax.Array,
    *,
    causal: bool = True,
    window: int | None = None,
    q_offset: int = 0,
    kv_mask_bs: jax.Array | None = None,
    segment_ids_bt: jax.Array | None = None,
    kv_segment_ids_bs: jax.Array | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """FlashAttention-2 in Pallas/Triton (``jax.experimental.pallas.ops.gpu.attention.mha``,
    Dao 2023), forward and backward kernels both, with an O(T) mask.

    The kernel reads key ``s`` for query ``t`` where ``seg[b, t] == seg[b, s]`` (and
    ``s <= t`` when causal), from one int32 id per token. So padding is id 0: a padding key is
    never read by a real token (ids >= 1), and a padding query reads padding keys (itself at
    least), a finite output that the callers mask out, as they do the reference's. With key
    validity alone the ids are ``kv_mask_bs`` (1 valid, 0 padding); with segments, the segment
    ids with masked keys set to 0. Queries and keys share the one id array, so
    ``kv_segment_ids_bs`` must be the queries' own (``S == T`` self-attention, as in the
    trainer). Grouped-query attention: the kernel has no GQA, so the ``K`` key/value heads are
    repeated to ``H`` (O(T·H·Dh) bytes per row and layer; autodiff sums their gradients back).
    Blocks: the largest of 128/64/32/16 dividing ``T``, forward; at most 32 in the backward
    kernels (jax's defaults). ``interpret`` defaults to ``trace_platform() != "gpu"`` (CPU:
    the tests), or :func:`emulated`. XLA cannot partition it: under a multi-device mesh the
    model runs it per shard.
    """
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    _require("pallas_gpu", kernel_problem("pallas_gpu", q_bthd, k_bskd, causal, q_offset, window))
    b, t, h, hd = q_bthd.shape
    kv_heads = k_bskd.shape[2]
    if kv_segment_ids_bs is not None and kv_segment_ids_bs is not segment_ids_bt:
        raise ValueError(
            "pallas_gpu attention takes one segment id per token for queries and keys alike; "
            f"got separate kv_segment_ids_bs (shared prompts); {_FALLBACK}"
        )
    ids_bt = None  # no mask: every key readable
    if segment_ids_bt is not None or kv_mask_bs is not None:
        ids_bt = jnp.ones((b, t), jnp.int32) if segment_ids_bt is None else segment_ids_bt
        if kv_mask_bs is not None:
            ids_bt = jnp.where(kv_mask_bs, ids_bt, 0)
        ids_bt = ids_bt.astype(jnp.int32)
    blk = _block(t, (128, 64, 32, 16))
    back = min(blk, 32)
    blocks = pallas_attention.BlockSizes(
        block_q=blk,
        block_k=blk,
        block_q_dkv=back,
        block_kv_dkv=back,
        block_q_dq=back,
        block_kv_dq=back,
    )
    repeat = h // kv_heads
    k_bshd = jnp.repeat(k_bskd.astype(q_bthd.dtype), repeat, axis=2)
    v_bshd = jnp.repeat(v_bskd.astype(q_bthd.dtype), repeat, axis=2)
    return pallas_attention.mha(
        q_bthd,
        k_bshd,
        v_bshd,
        ids_bt,
        sm_scale=hd**-0.5,
        causal=causal,
        block_sizes=blocks,
        interpret=_interpret("gpu") if interpret is None else interpret,
    )


def cudnn_attention(
    q_bthd: jax.Array,
    k_bskd: jax.Array,
    v_bskd: jax.Array,
    *,
    causal: bool = True,
    window: int | None = None,
    q_offset: int = 0,
    kv_mask_bs: jax.Array | None = None,
    segment_ids_bt: jax.Array | None = None,
    kv_segment_ids_bs: jax.Array | None = None,
    implementation: str = "cudnn",
) -> jax.Array:
    """cuDNN flash attention through ``jax.nn.dot_product_attention(implementation="cudnn")``.

    Causality is ``is_causal=True`` (cuDNN skips the masked blocks) and a sliding window is
    ``local_window_size=(window - 1, 0)`` (cuDNN's ``sliding_window_length = window``: keys
    ``t - window < s <= t``). jax 0.10.2's public API has no packed-sequence (segment) form:
    ``query_seq_lengths`` / ``key_value_seq_lengths`` describe one right-padded sequence per row
    (our rows are left-padded), and the packed ``q_offsets`` layout exists only in the private
    ``jax._src.cudnn.fused_attention_stablehlo``. So padding and segments go in as the boolean
    ``mask [B, 1, T, S]`` (``q_seg == kv_seg != 0``, and key validity), which cuDNN applies as
    an additive bias: exact, but the bias is materialised (``B*T*S`` elements per layer).

    The cuDNN kernel runs on NVIDIA GPUs only (float16/bfloat16, see :func:`kernel_problem`);
    there is no GPU in this project's CI. ``implementation="xla"`` runs the very same call
    (same arguments) through XLA on any backend: the tests use it to check the wiring.
    """
    _require(
        "cudnn",
        kernel_problem("cudnn", q_bthd, k_bskd, causal, q_offset, window, implementation),
    )
    b, t, _, _ = q_bthd.shape
    s = k_bskd.shape[1]
    allowed_bts = None
    if segment_ids_bt is not None:
        allowed_bts = segment_mask(segment_ids_bt, kv_segment_ids_bs)
    if kv_mask_bs is not None:
        valid_bts = jnp.broadcast_to(kv_mask_bs[:, None, :], (b, t, s))
        allowed_bts = valid_bts if allowed_bts is None else allowed_bts & valid_bts
    window = _static_int(window)
    return jax.nn.dot_product_attention(
        q_bthd,
        k_bskd.astype(q_bthd.dtype),
        v_bskd.astype(q_bthd.dtype),
        mask=None if allowed_bts is None else allowed_bts[:, None],
        is_causal=causal,
        local_window_size=None if window is None else (window - 1, 0),
        implementation=implementation,
    )
