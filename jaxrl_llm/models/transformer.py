"""The decoder-only transformer shared by every supported family (Flax NNX).

Pre-norm blocks ``x + Attn(RMSNorm(x))`` then ``x + MLP(RMSNorm(x))`` with grouped-query
attention (Ainslie et al. 2023), RoPE (``rope.py``), RMSNorm (Zhang & Sennrich 2019) and a
SwiGLU MLP ``down(act(gate(x)) * up(x))`` (Shazeer 2020). Family differences are switches on
:class:`ModelConfig`.

Module and parameter names mirror the Hugging Face checkpoints (``model.layers.3.self_attn.
q_proj``), so the weight mapping in ``weights.py`` is a table of layout changes, not renames.
Projection kernels are stored input-first and split per head (``q_proj.kernel: [D, H, Dh]``) so
the head axis can be sharded; every parameter carries its logical axis names as the variable
metadata ``logical_axes`` (see ``sharding.py``).

The layers are stored stacked: ``model.layers`` is one :class:`DecoderLayer` whose parameters
have a leading ``[L]`` axis (logical name ``layers``), built with ``nnx.vmap`` and run with
``lax.scan`` (:func:`scan_layers`), as MaxText and Tunix do. The compiled graph holds one layer
body instead of ``L`` copies, and a rematerialised backward pass reads each layer's slice of the
stacked weights and writes its gradients in place, with no stacked copy of either. ``weights.py``
maps each slice to the HF tensor ``model.layers.{l}.*``.

Padding is on the left. ``mask_bt`` marks real tokens; position ids default to the count of
real tokens before each one, so a left-padded sequence gets the same positions (and logits) as
the unpadded one. Packed rows carry ``segment_ids_bt`` (several sequences per row, 0 =
padding): attention stays within a segment and positions restart in each. Attention itself is
``attention.py`` (reference JAX, splash on TPU, cuDNN or Pallas on GPU;
``ModelConfig.attention_impl``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxrl_llm.models import attention as attention_lib
from jaxrl_llm.models import grad_accumulation, sharding
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.rope import apply_rope, rope_cos_sin, rope_frequencies

_INIT_STD = 0.02  # HF initializer_range default; real weights are loaded over it anyway.

_Carry = TypeVar("_Carry")
_X = TypeVar("_X")
_Y = TypeVar("_Y")

Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
"""``attend(q_bthd, k_bskd, v_bskd) -> out_bthd``: attention with one layer's masks applied."""


def _param(
    rngs: nnx.Rngs | None,
    shape: tuple[int, ...],
    axes: tuple[str, ...],
    dtype: jax.typing.DTypeLike,
    init: str = "normal",
) -> nnx.Param:
    """A parameter with logical axis names; ``rngs=None`` or ``init`` != normal skips the RNG."""
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (_INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=tuple(axes))


def _activation(name: str) -> Callable[[jax.Array], jax.Array]:
    return {
        "silu": jax.nn.silu,
        "gelu": lambda x: jax.nn.gelu(x, approximate=False),
        "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
        "relu": jax.nn.relu,
    }[name]


class KVCache(NamedTuple):
    """Key/value cache for incremental decoding: a plain pytree, safe to pass through ``jit``.

    ``k``/``v`` are ``[L, B, S, K, Dh]`` (layer ``l`` is ``k[l]``); ``mask_bs`` marks slots
    holding real tokens; ``index`` (int32 scalar) is the next slot to write. A call with ``T``
    new tokens writes slots ``[index, index + T)`` for the whole batch and advances ``index``
    by ``T``: prefill is one call with the (left-padded) prompt, each decode step one call with
    ``T = 1``.
    A finished sequence can keep decoding with ``mask_bt = False`` (its slot stays unused). The
    caller keeps ``index + T <= S``: under ``jit`` an overflowing write cannot raise.
    """

    k: jax.Array
    v: jax.Array
    mask_bs: jax.Array
    index: jax.Array

    @classmethod
    def init(
        cls,
        config: ModelConfig,
        batch: int,
        max_len: int,
        dtype: jax.typing.DTypeLike | None = None,
    ) -> KVCache:
        """An empty cache of ``max_len`` slots (``dtype`` defaults to the compute dtype)."""
        dtype = jnp.dtype(dtype or config.dtype)
        shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            mask_bs=jnp.zeros((batch, max_len), bool),
            index=jnp.zeros((), jnp.int32),
        )

    @property
    def max_len(self) -> int:
        return self.mask_bs.shape[1]

    def next_positions(self) -> jax.Array:
        """int32[B]: the position id the next real token of each sequence gets."""
        return jnp.sum(self.mask_bs, axis=1, dtype=jnp.int32)


class RMSNorm(nnx.Module):
    """``y = w * x / sqrt(mean(x^2) + eps)``, statistics in float32 (as HF's LlamaRMSNorm)."""

    def __init__(
        self, dim: int, eps: float, *, param_dtype: jax.typing.DTypeLike, axis_name: str = "norm"
    ) -> None:
        self.eps = eps
        self.weight = _param(None, (dim,), (axis_name,), param_dtype, init="ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        normed = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(x.dtype)
        weight = self.weight[...].astype(x.dtype)
        return weight.reshape((1,) * (x.ndim - 1) + weight.shape) * normed


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, optional q/k/v bias, q/k norm and window."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c, pd = config, config.jnp_param_dtype
        d, h, k, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, k, hd
        self.q_proj = _Proj(rngs, (d, h, hd), ("embed", "q_heads", "head_dim"), c.qkv_bias, pd)
        self.k_proj = _Proj(rngs, (d, k, hd), ("embed", "kv_heads", "head_dim"), c.qkv_bias, pd)
        self.v_proj = _Proj(rngs, (d, k, hd), ("embed", "kv_heads", "head_dim"), c.qkv_bias, pd)
        self.o_proj = _Proj(rngs, (h, hd, d), ("q_heads", "head_dim", "embed"), c.o_bias, pd)
        if c.qk_norm:
            self.q_norm = RMSNorm(hd, c.rms_norm_eps, param_dtype=pd, axis_name="head_dim")
            self.k_norm = RMSNorm(hd, c.rms_norm_eps, param_dtype=pd, axis_name="head_dim")
        else:
            self.q_norm = self.k_norm = None

    def __call__(
        self,
        x_btd: jax.Array,
        cos_btd: jax.Array,
        sin_btd: jax.Array,
        attend: Attend,
        kv: tuple[jax.Array, jax.Array] | None = None,
        index: jax.Array | None = None,
        lora_keys_bt: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """``attend(q_bthd, k_bskd, v_bskd) -> [B, T, H, Dh]`` applies this layer's masks;
        ``lora_keys_bt``: per-token PRNG keys of the adapters' dropout (see ``_Proj``)."""
        q_bthd = self.q_proj(x_btd, lora_keys_bt)
        k_btkd = self.k_proj(x_btd, lora_keys_bt)
        v_btkd = self.v_proj(x_btd, lora_keys_bt)
        if self.q_norm is not None:
            q_bthd, k_btkd = self.q_norm(q_bthd), self.k_norm(k_btkd)
        q_bthd = apply_rope(q_bthd, cos_btd, sin_btd)
        k_btkd = apply_rope(k_btkd, cos_btd, sin_btd)
        new_kv = None
        if kv is not None:
            k_cache, v_cache = kv
            k_btkd = jax.lax.dynamic_update_slice(
                k_cache, k_btkd.astype(k_cache.dtype), (0, index, 0, 0)
            )
            v_btkd = jax.lax.dynamic_update_slice(
                v_cache, v_btkd.astype(v_cache.dtype), (0, index, 0, 0)
            )
            new_kv = (k_btkd, v_btkd)
        out_bthd = attend(q_bthd, k_btkd.astype(q_bthd.dtype), v_btkd.astype(q_bthd.dtype))
        return self.o_proj(out_bthd, lora_keys_bt), new_kv


def dot_product_attention(
    q_bthd: jax.Array, k_bskd: jax.Array, v_bskd: jax.Array, allowed_bts: jax.Array
) -> jax.Array:
    """The reference attention over a precomputed mask (:func:`attention.reference_attention`)."""
    return attention_lib.reference_attention(q_bthd, k_bskd, v_bskd, allowed_bts)


LOW_PRECISION_DOT = "low_precision_dot"
"""The ``checkpoint_name`` of :func:`low_precision_dot`'s output, which the ``dots`` remat
policies save as they save a plain ``dot_general``'s."""


def low_precision_dot(
    a_mk: jax.Array,
    b: jax.Array,
    out_dtype: jax.typing.DTypeLike,
    b_is_nk: bool,
    b_cast: jax.Array | None = None,
) -> jax.Array:
    """``a_mk @ b`` (``b: [K, N]``, or ``[N, K]`` with ``b_is_nk``; cast to ``a``'s dtype)
    accumulated in float32 and returned in ``out_dtype``, whose backward dots also take
    low-precision operands.

    For bf16 ``a`` and ``b`` a plain ``dot(a, b, preferred_element_type=float32)`` is
    differentiated through its float32 output: the cotangent arrives in float32, so both
    backward dots run as float32 x float32 (measured on an H200: TF32 GEMMs, 31% of a 1B GRPO
    update step's GPU time and 40% of a log-prob pass's forward + backward; BENCHMARKS.md,
    "Accelerator runs"). Here the cotangent is cast to ``a``'s dtype first, as a bf16
    PyTorch model's autograd has it, and the backward dots are bf16 x bf16 accumulated in
    float32: ``da = g bᵀ``, ``db = aᵀ g`` (``gᵀ a`` for ``[N, K]``). ``da`` is returned in
    ``a``'s dtype and ``db`` in ``b``'s own, from the float32 accumulator: a float32 master
    weight gets an unrounded gradient (the cast to bf16 happens in here). The backward pass
    keeps ``a`` and the cast ``b``, as a plain dot's would. On a TPU, whose default precision
    already rounds float32 dot operands to bf16, this only halves the operands' bytes.

    ``b_cast``: ``b`` already cast to ``a``'s dtype, for a loop that multiplies by the same
    weight at every trip (the log-prob pass's chunks of the LM head): the loop then casts the
    weight once, before it, instead of at every trip and again in every rematerialised
    backward trip (measured on an H200: 80 casts of a 1B model's float32 head in one update
    step, 30 ms). The gradient still goes to ``b``, unrounded; ``b_cast`` gets none.
    """
    if b_cast is not None:
        if b_cast.shape != b.shape or b_cast.dtype != a_mk.dtype:
            raise ValueError(
                f"low_precision_dot: b_cast must be b {b.shape} in a's dtype {a_mk.dtype}, got "
                f"{b_cast.shape} {b_cast.dtype}"
            )
        b_cast = jax.lax.stop_gradient(b_cast)
    return _low_precision_dot(a_mk, b, b_cast, jnp.dtype(out_dtype), b_is_nk, jnp.dtype(b.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _low_precision_dot(
    a_mk: jax.Array,
    b: jax.Array,
    b_cast: jax.Array | None,
    out_dtype: jnp.dtype,
    b_is_nk: bool,
    b_dtype: jnp.dtype,
) -> jax.Array:
    return _low_precision_dot_fwd(a_mk, b, b_cast, out_dtype, b_is_nk, b_dtype)[0]


def _low_precision_dot_fwd(
    a_mk: jax.Array,
    b: jax.Array,
    b_cast: jax.Array | None,
    out_dtype: jnp.dtype,
    b_is_nk: bool,
    b_dtype: jnp.dtype,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    b = b.astype(a_mk.dtype) if b_cast is None else b_cast  # the product reads the cast
    dims = (((1,), (1 if b_is_nk else 0,)), ((), ()))
    y = jax.lax.dot_general(a_mk, b, dims, preferred_element_type=jnp.float32)
    return y.astype(out_dtype), (a_mk, b)


def _low_precision_dot_bwd(
    out_dtype: jnp.dtype,
    b_is_nk: bool,
    b_dtype: jnp.dtype,
    residuals: tuple[jax.Array, jax.Array],
    g_mn: jax.Array,
) -> tuple[jax.Array, jax.Array, None]:
    a_mk, b = residuals
    g_mn = g_mn.astype(a_mk.dtype)
    f32 = jnp.float32
    # da [M, K]: g [M, N] contracted with b over N.
    da = jax.lax.dot_general(g_mn, b, (((1,), (0 if b_is_nk else 1,)), ((), ())), None, f32)
    if b_is_nk:  # db [N, K] = gᵀ a
        db = jax.lax.dot_general(g_mn, a_mk, (((0,), (0,)), ((), ())), None, f32)
    else:  # db [K, N] = aᵀ g
        db = jax.lax.dot_general(a_mk, g_mn, (((0,), (0,)), ((), ())), None, f32)
    return da.astype(a_mk.dtype), db.astype(b_dtype), None  # the cast gets no gradient


_low_precision_dot.defvjp(_low_precision_dot_fwd, _low_precision_dot_bwd)


def is_low_precision(dtype: jax.typing.DTypeLike) -> bool:
    """bf16 / f16: the dtypes whose matmuls go through :func:`low_precision_dot`."""
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize < 4


def matmul_2d(x: jax.Array, w: jax.Array, n_in: int) -> jax.Array:
    """Contracts the last ``n_in`` axes of ``x`` with the first ``n_in`` axes of ``w``.

    Both sides are flattened to 2-D first (``[M, K] @ [K, N]``, free bitcasts). On XLA:CPU a
    3-D ``einsum('btd,df->btf')`` makes the weight gradient transpose its activations
    element by element (measured: SmolLM2 forward+backward 1.45x slower); the 2-D form keeps
    the backward dots transpose-free. Accumulation is float32 whatever the inputs: for bf16
    inputs XLA:CPU then runs ~2x faster than a bf16-output dot. ``w`` is cast to ``x``'s dtype;
    bf16/f16 ``x`` goes through :func:`low_precision_dot` (which casts ``w`` itself and returns
    its gradient in ``w``'s dtype), so that the backward dots are not float32 x float32.
    """
    k = math.prod(w.shape[:n_in])
    lead, out = x.shape[: x.ndim - n_in], w.shape[n_in:]
    x_mk, w_kn = x.reshape(-1, k), w.reshape(k, -1)
    if is_low_precision(x.dtype):
        y = checkpoint_name(low_precision_dot(x_mk, w_kn, x.dtype, False), LOW_PRECISION_DOT)
    else:
        w_kn = w_kn.astype(x.dtype)
        y = jnp.dot(x_mk, w_kn, preferred_element_type=jnp.float32).astype(x.dtype)
    return y.reshape(*lead, *out)


def lora_dropout(x: jax.Array, keys_bt: jax.Array, rate: float, salt: int) -> jax.Array:
    """Inverted dropout ``x · m / (1 − p)``, ``m ~ Bernoulli(1 − p)`` drawn per token from its
    own key ``fold_in(keys_bt[b, t], salt)`` (``x: [B, T, ...]``, ``keys_bt``: typed keys)."""

    def keep(key: jax.Array) -> jax.Array:
        return jax.random.bernoulli(jax.random.fold_in(key, salt), 1.0 - rate, x.shape[2:])

    keep_bt = jax.vmap(jax.vmap(keep))(keys_bt)
    return jnp.where(keep_bt, x / (1.0 - rate), 0.0).astype(x.dtype)


def fold_keys(keys_bt: jax.Array | None, data: jax.Array | int) -> jax.Array | None:
    """``fold_in(keys_bt[b, t], data)`` for every token (None stays None)."""
    if keys_bt is None:
        return None
    return jax.vmap(jax.vmap(lambda k: jax.random.fold_in(k, data)))(keys_bt)


class _Proj(nnx.Module):
    """A bias-optional linear map ``[..., *in] -> [..., *out]`` with a per-head kernel layout.

    Optionally LoRA-adapted (``lora_a: [*in, r]``, ``lora_b: [r, *out]``, ``y = x W + s·(x A) B``;
    :mod:`jaxrl_llm.models.lora`) and with a quantised frozen kernel (``quant = (mode,
    block_size)``: ``kernel`` holds the codes ``[K or K/2, N]`` and ``kernel_scales`` the block
    scales, dequantised on the fly in the matmul; :mod:`jaxrl_llm.models.quant`).
    """

    def __init__(
        self,
        rngs: nnx.Rngs,
        shape: tuple[int, ...],
        axes: tuple[str, ...],
        use_bias: bool,
        param_dtype: jax.typing.DTypeLike,
    ) -> None:
        self.kernel = _param(rngs, shape, axes, param_dtype)
        self.unstacked_shape = tuple(shape)
        self.n_in = 2 if axes[-1] == "embed" and len(shape) == 3 else 1
        out_shape, out_axes = shape[self.n_in :], axes[self.n_in :]
        self.bias = _param(None, out_shape, out_axes, param_dtype, "zeros") if use_bias else None
        self.lora_a: nnx.LoRAParam | None = nnx.data(None)
        self.lora_b: nnx.LoRAParam | None = nnx.data(None)
        self.lora_scale = 1.0
        self.lora_dropout = 0.0
        self.lora_salt = 0  # distinct dropout masks per projection
        self.quant: tuple[str, int] | None = None
        self.kernel_scales: nnx.Param | None = nnx.data(None)

    @property
    def kernel_shape(self) -> tuple[int, ...]:
        """The float kernel's shape, leading (layer) axes included, quantised or not."""
        shape = tuple(self.kernel.get_value().shape)  # also on an abstract (eval_shape) model
        if self.quant is None:
            return shape
        return (*shape[: len(shape) - 2], *self.unstacked_shape)

    def dense_kernel(self, dtype: jax.typing.DTypeLike) -> jax.Array:
        """The base kernel in ``dtype`` (dequantised when the base is quantised)."""
        if self.quant is None:
            return self.kernel[...].astype(dtype)
        from jaxrl_llm.models import quant as quant_lib

        mode, block_size = self.quant
        codes = quant_lib.QuantizedKernel(self.kernel[...], self.kernel_scales[...])
        w_kn = quant_lib.dequantize_kernel(codes, mode, block_size=block_size, dtype=dtype)
        return w_kn.reshape(self.kernel_shape)

    def merged_kernel(self) -> jax.Array:
        """``W + s·A B`` in the kernel's layout and float dtype (``W`` without adapters)."""
        dtype = self.kernel[...].dtype if self.quant is None else jnp.float32
        w = self.dense_kernel(jnp.float32)
        if self.lora_a is None:
            return w.astype(dtype)
        a, b = self.lora_a[...], self.lora_b[...]
        lead = w.shape[: w.ndim - len(self.unstacked_shape)]
        k = math.prod(self.unstacked_shape[: self.n_in])
        r = a.shape[-1]
        delta = jnp.matmul(a.reshape(*lead, k, r), b.reshape(*lead, r, -1))
        return (w + self.lora_scale * delta.reshape(w.shape)).astype(dtype)

    def __call__(self, x: jax.Array, lora_keys_bt: jax.Array | None = None) -> jax.Array:
        """``x [B, T, *in] -> [B, T, *out]``. With adapters and ``lora_keys_bt`` (PRNG keys
        ``[B, T]``, one per token; training only) the adapter branch sees ``x`` through
        inverted dropout of rate ``lora_dropout`` (PEFT's ``lora_dropout``): token (b, t)'s
        mask is drawn from ``fold_in(lora_keys_bt[b, t], lora_salt)`` alone, so it does not
        depend on the batch, micro-batch or packed row the token sits in."""
        # A float kernel goes in as stored: matmul_2d casts it (for bf16, inside the dot's VJP).
        w = self.kernel[...] if self.quant is None else self.dense_kernel(x.dtype)
        y = matmul_2d(x, w, self.n_in)
        if self.lora_a is not None:
            x_in = x
            if lora_keys_bt is not None and self.lora_dropout > 0:
                x_in = lora_dropout(x, lora_keys_bt, self.lora_dropout, self.lora_salt)
            xa = matmul_2d(x_in, self.lora_a[...], self.n_in)
            y = y + self.lora_scale * matmul_2d(xa, self.lora_b[...], 1)
        if self.bias is not None:
            bias = self.bias[...].astype(x.dtype)
            y = y + bias.reshape((1,) * (y.ndim - bias.ndim) + bias.shape)
        return y


class MLP(nnx.Module):
    """SwiGLU: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c, pd = config, config.jnp_param_dtype
        d, f = c.hidden_size, c.intermediate_size
        self.act = _activation(c.hidden_act)
        self.gate_proj = _Proj(rngs, (d, f), ("embed", "mlp"), c.mlp_bias, pd)
        self.up_proj = _Proj(rngs, (d, f), ("embed", "mlp"), c.mlp_bias, pd)
        self.down_proj = _Proj(rngs, (f, d), ("mlp", "embed"), c.mlp_bias, pd)

    def __call__(self, x_btd: jax.Array, lora_keys_bt: jax.Array | None = None) -> jax.Array:
        gate = self.gate_proj(x_btd, lora_keys_bt)
        up = self.up_proj(x_btd, lora_keys_bt)
        return self.down_proj(self.act(gate) * up, lora_keys_bt)


class DecoderLayer(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        pd, eps = config.jnp_param_dtype, config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, param_dtype=pd)
        self.self_attn = Attention(config, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, param_dtype=pd)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(
        self,
        x_btd: jax.Array,
        cos_btd: jax.Array,
        sin_btd: jax.Array,
        attend: Attend,
        kv: tuple[jax.Array, jax.Array] | None = None,
        index: jax.Array | None = None,
        lora_keys_bt: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        attn, new_kv = self.self_attn(
            self.input_layernorm(x_btd), cos_btd, sin_btd, attend, kv, index, lora_keys_bt
        )
        x_btd = x_btd + attn
        x_btd = x_btd + self.mlp(self.post_attention_layernorm(x_btd), lora_keys_bt)
        return x_btd, new_kv


_CP = jax.checkpoint_policies
_REMAT_POLICIES = {
    "full": None,
    # low_precision_dot's output counts as a dot (a custom_vjp hides the dot from the policy).
    "dots": _CP.save_from_both_policies(
        _CP.dots_saveable, _CP.save_only_these_names(LOW_PRECISION_DOT)
    ),
    "dots_no_batch": _CP.save_from_both_policies(
        _CP.dots_with_no_batch_dims_saveable, _CP.save_only_these_names(LOW_PRECISION_DOT)
    ),
}

NO_WINDOW = 2**30
"""The window value of a layer with full (unwindowed) causal attention in ``layer_windows``."""


def _concrete_int(x: jax.typing.ArrayLike) -> int | None:
    """``int(x)`` outside of tracing, ``None`` for a traced value."""
    try:
        return int(x)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
        return None


def stacked_layers(config: ModelConfig, rngs: nnx.Rngs) -> DecoderLayer:
    """``config.num_layers`` decoder layers as one module with ``[L, ...]`` parameters.

    Each layer is initialised from its own split of ``rngs`` (``nnx.vmap`` over the
    constructor); ``layers`` is prepended to every parameter's logical axes.
    """

    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(config, rngs=rngs)

    layers = make(rngs)
    for _, node in nnx.iter_graph(layers):
        if isinstance(node, nnx.Param):
            node.set_metadata(logical_axes=("layers", *node.get_metadata()["logical_axes"]))
    return layers


def layer_windows(config: ModelConfig) -> jax.Array:
    """int32[L]: each layer's sliding attention window, :data:`NO_WINDOW` for full attention."""
    windows = (config.window(i) for i in range(config.num_layers))
    return jnp.asarray([NO_WINDOW if w is None else w for w in windows], jnp.int32)


def scan_layers(
    layers: DecoderLayer | Sequence[DecoderLayer],
    body: Callable[[DecoderLayer, _Carry, _X], tuple[_Carry, _Y]],
    carry: _Carry,
    xs: _X,
    *,
    remat: str = "none",
) -> tuple[_Carry, _Y]:
    """``lax.scan`` of ``body(layer, carry, x_l) -> (carry, y_l)`` over the stacked layers.

    ``layer`` is layer ``l`` as a :class:`DecoderLayer` (its parameter slices); ``xs`` holds
    per-layer inputs with a leading ``[L]`` axis. With ``remat`` other than ``"none"`` the body
    is a ``jax.checkpoint`` with that policy: the backward pass keeps only each layer's
    ``carry`` and recomputes the rest. (XLA:CPU schedules an unrolled chain of checkpointed
    layers so that every recomputed activation is live at once; a checkpointed scan body does
    not have that problem.)

    ``layers`` may also be ``L`` per-layer modules (a sampler's weights, sliced once outside
    its program): the same loop, unrolled, the ``y_l`` stacked; not with ``remat``.
    """
    if not isinstance(layers, DecoderLayer):
        if remat != "none":
            raise ValueError(f"scan_layers: per-layer modules run without remat, got {remat!r}")
        ys = []
        for i, layer in enumerate(layers):
            carry, y = body(layer, carry, jax.tree.map(lambda x, i=i: x[i], xs))
            ys.append(y)
        return carry, jax.tree.map(lambda *y_l: jnp.stack(y_l), *ys)
    graphdef, state = nnx.split(layers)

    def step(carry: _Carry, per_layer: tuple[nnx.State, _X]) -> tuple[_Carry, _Y]:
        layer_state, x_l = per_layer
        return body(nnx.merge(graphdef, layer_state), carry, x_l)

    if remat == "full":  # inside a micro-batch loop, the gradient may go into its accumulator
        fused = grad_accumulation.scan(step, carry, state, xs)
        if fused is not None:
            return fused
    if remat != "none":
        step = jax.checkpoint(step, policy=_REMAT_POLICIES[remat])
    return jax.lax.scan(step, carry, (state, xs))


class Embed(nnx.Module):
    """Token embedding table ``[V, D]`` (the HF layout)."""

    def __init__(
        self, vocab_size: int, dim: int, *, param_dtype: jax.typing.DTypeLike, rngs: nnx.Rngs
    ) -> None:
        self.embedding = _param(rngs, (vocab_size, dim), ("vocab", "embed"), param_dtype)

    def __call__(self, tokens_bt: jax.Array, dtype: jax.typing.DTypeLike) -> jax.Array:
        return jnp.take(self.embedding[...], tokens_bt, axis=0).astype(dtype)


class Decoder(nnx.Module):
    """Embedding, the layer stack and the final norm: ``tokens -> hidden states [B, T, D]``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = Embed(
            config.vocab_size, config.hidden_size, param_dtype=config.jnp_param_dtype, rngs=rngs
        )
        self.layers = stacked_layers(config, rngs)
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, param_dtype=config.jnp_param_dtype
        )
        inv_freq, self._rope_scaling = rope_frequencies(config)
        self._inv_freq = tuple(float(f) for f in inv_freq)  # static, hashable

    def __call__(
        self,
        tokens_bt: jax.Array,
        mask_bt: jax.Array | None = None,
        *,
        positions_bt: jax.Array | None = None,
        segment_ids_bt: jax.Array | None = None,
        cache: KVCache | None = None,
        attention_impl: str | None = None,
        lora_keys_bt: jax.Array | None = None,
        prefix_ids_bt: jax.Array | None = None,
        layers: Sequence[DecoderLayer] | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Hidden states after the final norm, and the updated cache (``None`` without one).

        ``lora_keys_bt`` (typed PRNG keys ``[B, T]``, one per token): apply the LoRA adapters'
        dropout (training forward passes only; layer ``l`` folds ``l`` into each key). Not with
        ``cache``.

        ``segment_ids_bt`` (int32 ``[B, T]``, 0 = padding) packs several sequences into a row:
        a token attends to earlier tokens of its own segment only (same nonzero id, causal,
        within the layer's window), and ``mask_bt`` is and-ed with ``segment_ids_bt != 0``.
        Position ids then restart at 0 in each segment by default (segments must be
        contiguous for that default; pass ``positions_bt`` otherwise). Not with ``cache``.

        ``prefix_ids_bt`` (int32 ``[B, T]``, with ``segment_ids_bt`` and ``positions_bt``): a
        second segment each token reads, placed before it in the row (a shared prompt, see
        ``train/packing.py``). Sliding windows are then measured in positions, not slots.
        The reference attention only: ``"auto"`` uses it, a requested kernel is an error.

        ``attention_impl`` overrides ``config.attention_impl`` (see ``attention.py``); the
        KV-cache path always uses the reference implementation.

        ``layers`` (with ``cache`` only): ``L`` per-layer modules to run, unrolled, in place of
        the stacked ``self.layers`` (the static sampler's weights, sliced and cast once outside
        its program: ``rollout.paged.engine_params``).
        """
        c = self.config
        b, t = tokens_bt.shape
        if layers is not None and (cache is None or len(layers) != c.num_layers):
            raise ValueError(
                f"layers: {c.num_layers} per-layer modules for a cached forward, got "
                f"{len(layers)}{'' if cache is not None else ' without a cache'}"
            )
        if mask_bt is None:
            mask_bt = jnp.ones((b, t), bool)
        if mask_bt.dtype != jnp.bool_:
            raise TypeError(f"mask_bt must be a boolean mask, got dtype {mask_bt.dtype}")
        if lora_keys_bt is not None and (cache is not None or lora_keys_bt.shape != (b, t)):
            raise ValueError(
                f"lora_keys_bt must be [B, T] = {(b, t)} keys (got {lora_keys_bt.shape}) and is "
                "for cache-free training passes only"
            )
        if segment_ids_bt is not None:
            if cache is not None:
                raise ValueError(
                    "segment_ids_bt (packed rows) is not supported with a KV cache; decode "
                    "one sequence per row"
                )
            if segment_ids_bt.shape != (b, t):
                raise ValueError(
                    f"segment_ids_bt has shape {segment_ids_bt.shape}, expected tokens' {(b, t)}"
                )
            if not jnp.issubdtype(segment_ids_bt.dtype, jnp.integer):
                raise TypeError(
                    f"segment_ids_bt must be int32 (0 = padding), got {segment_ids_bt.dtype}"
                )
            segment_ids_bt = jnp.where(mask_bt, segment_ids_bt.astype(jnp.int32), 0)
            mask_bt = segment_ids_bt != 0
        if prefix_ids_bt is not None:
            if segment_ids_bt is None or positions_bt is None:
                raise ValueError("prefix_ids_bt needs segment_ids_bt and positions_bt")
            if prefix_ids_bt.shape != (b, t):
                raise ValueError(
                    f"prefix_ids_bt has shape {prefix_ids_bt.shape}, expected tokens' {(b, t)}"
                )
        if cache is not None:
            index = _concrete_int(cache.index)
            if index is not None and index + t > cache.max_len:
                raise ValueError(
                    f"KV cache has {cache.max_len} slots; {index} are written, {t} more do not fit"
                )
        start_b = cache.next_positions() if cache is not None else jnp.zeros((b,), jnp.int32)
        if positions_bt is None and segment_ids_bt is not None:
            positions_bt = segment_positions(segment_ids_bt)
        elif positions_bt is None:
            counts_bt = jnp.cumsum(mask_bt.astype(jnp.int32), axis=1)
            positions_bt = jnp.maximum(start_b[:, None] + counts_bt - 1, 0)

        dtype = c.jnp_dtype
        x_btd = self.embed_tokens(tokens_bt, dtype)
        x_btd = sharding.constrain(x_btd, ("batch", "seq", "act_embed"))
        cos, sin = rope_cos_sin(
            positions_bt, np.asarray(self._inv_freq, np.float32), self._rope_scaling, dtype
        )

        def constrain(x_btd: jax.Array) -> jax.Array:
            return sharding.constrain(x_btd, ("batch", "seq", "act_embed"))

        windows_l = layer_windows(c)
        layer_ids_l = jnp.arange(c.num_layers, dtype=jnp.int32)
        if cache is None:
            requested = attention_impl or c.attention_impl
            if prefix_ids_bt is not None and requested not in ("auto", "reference"):
                raise ValueError(
                    f"shared prompts (prefix_ids_bt) run the reference attention only, not "
                    f"{requested!r}; set train.shared_prompts: false or model.attention: reference"
                )
            impl = (
                "reference" if prefix_ids_bt is not None else self._attention_impl(requested, b, t)
            )
            if impl != "reference":
                impl = "auto" if requested == "auto" else impl  # keeps auto's cuDNN fallback
                return self._kernel_forward(
                    x_btd, cos, sin, mask_bt, segment_ids_bt, impl, lora_keys_bt
                )

        q_slot_t = jnp.arange(t, dtype=jnp.int32)
        if cache is None:
            k_slot_s, k_valid_bs, index = q_slot_t, mask_bt, None
        else:
            index = jnp.asarray(cache.index, jnp.int32)
            q_slot_t = q_slot_t + index
            k_slot_s = jnp.arange(cache.max_len, dtype=jnp.int32)
            k_valid_bs = jax.lax.dynamic_update_slice(cache.mask_bs, mask_bt, (0, index))
        base_bts = (k_slot_s[None, :] <= q_slot_t[:, None])[None] & k_valid_bs[:, None, :]
        if segment_ids_bt is not None:
            base_bts = base_bts & attention_lib.segment_mask(
                segment_ids_bt, prefix_ids_bt=prefix_ids_bt
            )

        def reference(window: jax.Array) -> Attend:  # traced int32: this layer's window
            if prefix_ids_bt is None:
                in_window = k_slot_s[None, None, :] > q_slot_t[None, :, None] - window
            else:  # a shared prefix sits further back in the row than in its sequence
                in_window = positions_bt[:, None, :] > positions_bt[:, :, None] - window
            allowed_bts = base_bts & in_window
            return functools.partial(
                attention_lib.reference_attention,
                allowed_bts=allowed_bts,
                # cache-free: self-attention within the rows, causal in row slots
                causal=cache is None,
                query_block=attention_lib.QUERY_BLOCK if cache is None else None,
            )

        if cache is None:

            def body(
                layer: DecoderLayer, x_btd: jax.Array, per_layer: tuple[jax.Array, jax.Array]
            ) -> tuple[jax.Array, None]:
                window, layer_id = per_layer
                keys = fold_keys(lora_keys_bt, layer_id)
                x_btd, _ = layer(x_btd, cos, sin, reference(window), lora_keys_bt=keys)
                return constrain(x_btd), None

            xs = (windows_l, layer_ids_l)
            x_btd, _ = scan_layers(self.layers, body, x_btd, xs, remat=c.remat)
            return self.norm(x_btd), None

        def cached_body(
            layer: DecoderLayer, x_btd: jax.Array, per_layer: tuple[jax.Array, jax.Array, jax.Array]
        ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            window, k_l, v_l = per_layer
            x_btd, (k_l, v_l) = layer(x_btd, cos, sin, reference(window), (k_l, v_l), index)
            return constrain(x_btd), (k_l, v_l)

        x_btd, (new_k, new_v) = scan_layers(
            self.layers if layers is None else layers,
            cached_body,
            x_btd,
            (windows_l, cache.k, cache.v),
        )
        return self.norm(x_btd), KVCache(new_k, new_v, k_valid_bs, index + t)

    def _attention_impl(self, requested: str, b: int, t: int) -> str:
        """The implementation to run: ``"auto"`` falls back to the reference where the kernel
        cannot take these shapes/dtypes; an explicitly requested kernel raises instead."""
        c = self.config
        q = jax.ShapeDtypeStruct((b, t, c.num_heads, c.head_dim), c.jnp_dtype)
        impl = attention_lib.implementation_for(requested, q, q)
        problem = None if requested == "auto" else attention_lib.kernel_problem(impl, q, q)
        if problem is not None:
            raise ValueError(f"{problem}; use attention_impl='reference' (model.attention)")
        return impl

    def _kernel_forward(
        self,
        x_btd: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        mask_bt: jax.Array,
        segment_ids_bt: jax.Array | None,
        impl: str,
        lora_keys_bt: jax.Array | None = None,
    ) -> tuple[jax.Array, None]:
        """The cache-free layer scan with a kernel (``splash``, ``cudnn``, ``pallas_gpu`` or
        ``auto``) as attention.

        Kernels take their window statically: layers are grouped by window and each scan step
        picks its window's kernel with ``lax.switch`` (one branch when all layers agree).
        """
        c = self.config
        windows = sorted({c.window(i) for i in range(c.num_layers)}, key=lambda w: w or 0)
        branch_l = jnp.asarray([windows.index(c.window(i)) for i in range(c.num_layers)])
        name, mask = (
            ("kv_mask_bs", mask_bt)
            if segment_ids_bt is None
            else ("segment_ids_bt", segment_ids_bt)
        )
        heads = (c.num_heads, c.num_kv_heads)

        def kernel(window: int | None) -> Callable[..., jax.Array]:
            def run(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
                return attention_lib.attention(
                    q, k, v, causal=True, window=window, implementation=impl, **{name: mask}
                )

            # A Pallas kernel (TPU or GPU) cannot be partitioned by XLA: run it per shard.
            pallas = attention_lib.resolve_implementation(impl) in ("splash", "pallas_gpu")
            return _per_shard(run, mask.shape[0], *heads) if pallas else run

        def attend(branch: jax.Array) -> Attend:
            if len(windows) == 1:
                only = kernel(windows[0])
                return lambda q, k, v: only(q, k, v, mask)
            branches = [kernel(w) for w in windows]
            return lambda q, k, v: jax.lax.switch(branch, branches, q, k, v, mask)

        def body(
            layer: DecoderLayer, x_btd: jax.Array, per_layer: tuple[jax.Array, jax.Array]
        ) -> tuple[jax.Array, None]:
            branch, layer_id = per_layer
            keys = fold_keys(lora_keys_bt, layer_id)
            x_btd, _ = layer(x_btd, cos, sin, attend(branch), lora_keys_bt=keys)
            return sharding.constrain(x_btd, ("batch", "seq", "act_embed")), None

        xs = (branch_l, jnp.arange(c.num_layers, dtype=jnp.int32))
        x_btd, _ = scan_layers(self.layers, body, x_btd, xs, remat=c.remat)
        return self.norm(x_btd), None


def _per_shard(
    fn: Callable[..., jax.Array], batch: int, heads: int, kv_heads: int
) -> Callable[..., jax.Array]:
    """``fn(q_bthd, k_bskd, v_bskd, mask_b*)`` under ``jax.shard_map`` over the current mesh.

    Batch over the mesh's batch axes, heads over ``tensor`` when both ``H`` and ``K`` divide it
    (each shard then holds whole GQA groups), sequence unsplit: the rules of
    :func:`sharding.constrain`. Without a multi-device mesh ``fn`` is returned as is.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(sharding.MESH_AXES) & set(mesh.axis_names):
        return fn
    if mesh.size == 1:
        return fn
    (batch_axes,) = sharding.logical_to_spec(("batch",), (batch,), mesh, warn=False)
    (q_axes,) = sharding.logical_to_spec(("q_heads",), (heads,), mesh, warn=False)
    (kv_axes,) = sharding.logical_to_spec(("kv_heads",), (kv_heads,), mesh, warn=False)
    if q_axes != kv_axes:
        q_axes = kv_axes = None
    q_spec = jax.P(batch_axes, None, q_axes, None)
    kv_spec = jax.P(batch_axes, None, kv_axes, None)
    return jax.shard_map(
        fn,
        in_specs=(q_spec, kv_spec, kv_spec, jax.P(batch_axes, None)),
        out_specs=q_spec,
        check_vma=False,
    )


def segment_positions(segment_ids_bt: jax.Array) -> jax.Array:
    """int32 ``[B, T]``: each token's index within its (contiguous) segment; 0 for padding.

    ``pos[t] = t - start(t)`` with ``start(t)`` the first slot of the run of equal ids that
    holds ``t`` (a running maximum of run starts), so O(T) memory for any number of segments.
    """
    b, t = segment_ids_bt.shape
    slot_t = jnp.arange(t, dtype=jnp.int32)
    starts_bt = jnp.concatenate(
        [jnp.ones((b, 1), bool), segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1]], axis=1
    )
    start_bt = jax.lax.cummax(jnp.where(starts_bt, slot_t[None], 0), axis=1)
    return jnp.where(segment_ids_bt != 0, slot_t[None] - start_bt, 0).astype(jnp.int32)


class CausalLM(nnx.Module):
    """Decoder plus LM head: ``int32[B, T]`` tokens -> ``float32[B, T, V]`` next-token logits.

    ``model(tokens_bt, mask_bt)`` returns logits; with ``cache=`` it returns
    ``(logits, new_cache)`` (see :class:`KVCache`). With tied embeddings the head reuses
    ``model.embed_tokens``; otherwise ``lm_head.weight`` is ``[V, D]`` as in HF checkpoints.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.model = Decoder(config, rngs=rngs)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = _param(
                rngs,
                (config.vocab_size, config.hidden_size),
                ("vocab", "embed"),
                config.jnp_param_dtype,
            )

    def head_weight(self) -> jax.Array:
        """The ``[V, D]`` output embedding (the input embedding when tied)."""
        w = self.model.embed_tokens.embedding if self.lm_head is None else self.lm_head
        return w[...]

    @staticmethod
    def _low_precision_head(dtype: jax.typing.DTypeLike) -> bool:
        """States of ``dtype`` go through :func:`low_precision_dot` in :meth:`logits` (backward
        dots in bf16 too; the head's are the largest): bf16 only. Not float16: its range would
        flush the float32 logits' small cotangents (p·scale) to zero."""
        return jnp.dtype(dtype) == jnp.bfloat16

    def head_cast(self, w_vd: jax.Array, dtype: jax.typing.DTypeLike) -> jax.Array | None:
        """The head ``w_vd`` (:meth:`head_weight`, or the same array passed on) cast to
        ``dtype`` for :meth:`logits`'s ``head_vd``, where :meth:`logits` would cast it itself
        (bf16 states), else None: a loop over chunks of states casts it once, before the
        loop."""
        return w_vd.astype(dtype) if self._low_precision_head(dtype) else None

    def logits(
        self,
        h_btd: jax.Array,
        *,
        head_vd: jax.Array | None = None,
        weight_vd: jax.Array | None = None,
    ) -> jax.Array:
        """float32 logits from final hidden states (any leading axes). ``head_vd``: the head
        already cast (:meth:`head_cast`); the gradient still goes to the stored weight, or to
        ``weight_vd`` where given (the stored weight passed in as an argument, as
        :func:`~jaxrl_llm.models.grad_accumulation.map_chunks` passes it)."""
        w_vd = self.head_weight() if weight_vd is None else weight_vd
        h_md = h_btd.reshape(-1, h_btd.shape[-1])
        if self._low_precision_head(h_md.dtype):
            logits_mv = low_precision_dot(h_md, w_vd, jnp.float32, True, b_cast=head_vd)
        else:
            w_vd = w_vd.astype(h_md.dtype)
            logits_mv = jax.lax.dot_general(
                h_md, w_vd, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )
        return logits_mv.reshape(*h_btd.shape[:-1], w_vd.shape[0])

    def __call__(
        self,
        tokens_bt: jax.Array,
        mask_bt: jax.Array | None = None,
        *,
        positions_bt: jax.Array | None = None,
        segment_ids_bt: jax.Array | None = None,
        cache: KVCache | None = None,
        attention_impl: str | None = None,
        lora_keys_bt: jax.Array | None = None,
    ) -> jax.Array | tuple[jax.Array, KVCache]:
        """Logits ``[B, T, V]`` (and the new cache with ``cache=``); arguments as ``Decoder``."""
        h_btd, new_cache = self.model(
            tokens_bt,
            mask_bt,
            positions_bt=positions_bt,
            segment_ids_bt=segment_ids_bt,
            cache=cache,
            attention_impl=attention_impl,
            lora_keys_bt=lora_keys_bt,
        )
        logits_btv = self.logits(h_btd)
        return logits_btv if cache is None else (logits_btv, new_cache)

    def init_cache(
        self, batch: int, max_len: int, dtype: jax.typing.DTypeLike | None = None
    ) -> KVCache:
        return KVCache.init(self.config, batch, max_len, dtype)
