"""Rotary position embeddings (RoPE) with the frequency schedules HF checkpoints use.

Su et al. 2021, "RoFormer" (arXiv:2104.09864). Pairs of channels ``(x_i, x_{i + d/2})`` of each
query/key head are rotated by the angle ``position * inv_freq_i`` — the "rotate half" layout of
HF checkpoints (not the interleaved layout of the paper), so weights load without permutation.

Schedules, for head dim ``d`` and ``inv_freq_i = theta^(-2i/d)``:
  * ``default``: as above.
  * ``linear``: ``inv_freq_i / factor`` (position interpolation, Chen et al. 2023).
  * ``llama3``: long wavelengths divided by ``factor``, short ones kept, a smooth ramp between
    (Llama 3.1 report, section 3.3).
  * ``yarn``: NTK-by-parts interpolation and an attention temperature ``mscale`` applied to
    cos/sin (Peng et al. 2023, arXiv:2309.00071).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models.config import ModelConfig


def rope_frequencies(config: ModelConfig) -> tuple[np.ndarray, float]:
    """Returns ``(inv_freq f32[head_dim // 2], attention_scaling)`` for ``config``'s schedule.

    Computed in float32 numpy with the same operation order as transformers, so the angles match
    the PyTorch reference bit for bit on typical inputs.
    """
    dim = config.head_dim
    params = dict(config.rope_scaling)
    rope_type = params.get("rope_type", "default")
    base = np.float32(config.rope_theta)
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos_freqs = np.power(base, exponents, dtype=np.float32)
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    scaling = 1.0
    if rope_type == "default":
        pass
    elif rope_type == "linear":
        inv_freq = inv_freq / np.float32(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, params)
    elif rope_type == "yarn":
        inv_freq, scaling = _yarn(pos_freqs, params, config)
    else:  # ModelConfig validates; this guards direct construction.
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    return inv_freq.astype(np.float32), float(scaling)


def _llama3(inv_freq: np.ndarray, params: dict) -> np.ndarray:
    factor = np.float32(params["factor"])
    low = np.float32(params["low_freq_factor"])
    high = np.float32(params["high_freq_factor"])
    old_len = np.float32(params["original_max_position_embeddings"])
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def _yarn(pos_freqs: np.ndarray, params: dict, config: ModelConfig) -> tuple[np.ndarray, float]:
    dim = config.head_dim
    base = config.rope_theta
    old_len = params["original_max_position_embeddings"]
    factor = params.get("factor") or config.max_position_embeddings / old_len

    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = mscale_of(factor, mscale) / mscale_of(factor, mscale_all)
        else:
            attention = mscale_of(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    inv_extra = np.float32(1.0) / pos_freqs
    inv_inter = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation) + inv_extra * extrapolation
    return inv_freq.astype(np.float32), float(attention)


def rope_cos_sin(
    positions_bt: jnp.ndarray, inv_freq: np.ndarray, scaling: float, dtype: jnp.dtype
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos/sin tables ``[B, T, head_dim]`` for integer ``positions_bt`` (angles in float32)."""
    angles_btf = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    angles_btd = jnp.concatenate([angles_btf, angles_btf], axis=-1)
    cos = jnp.cos(angles_btd)
    sin = jnp.sin(angles_btd)
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return cos.astype(dtype), sin.astype(dtype)


def apply_rope(x_bthd: jnp.ndarray, cos_btd: jnp.ndarray, sin_btd: jnp.ndarray) -> jnp.ndarray:
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``; heads on axis 2."""
    half = x_bthd.shape[-1] // 2
    x1, x2 = x_bthd[..., :half], x_bthd[..., half:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos_btd[:, :, None, :], sin_btd[:, :, None, :]
    return x_bthd * cos + rotated * sin
