"""The one-token decode step, on a KV cache laid out for it.

The model's :class:`~jaxrl_llm.models.KVCache` stores ``[B, S, K, Dh]`` per layer, the layout
prefill and training want. For a single query per sequence, XLA:CPU then transposes the whole
cache to ``[B, K, Dh, S]`` in every layer of every step to form ``q·kᵀ`` (SmolLM2-135M at 32
sequences: 60 copies of 3 MB per step; avoiding them took the fp32 step from ~56 to ~52 ms on
2 CPU cores, and more as the cache grows). The decode loop therefore keeps its own cache,
converted once after prefill:

    keys    [L, N, K, Dh, S]   (scores = q · keys is a plain batched matmul)
    values  [L, N, K, S, Dh]   (out = probs · values likewise)

and this module's :func:`decode_step` runs the model's own submodules (norms, projections,
q/k norms, RoPE, MLP, LM head) around an attention written for that layout, scanning over the
stacked layers with the cache in the scan's carry so each step writes its one new slot per
layer in place. It is checked
token for token against transformers and against the model's cached forward in the tests.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.models import sharding
from jaxrl_llm.models.rope import apply_rope, rope_cos_sin, rope_frequencies
from jaxrl_llm.models.transformer import CausalLM, KVCache, layer_windows, scan_layers

_X_AXES = ("batch", "seq", "act_embed")
_K_AXES = ("layers", "batch", "kv_heads", "head_dim", "seq")
_V_AXES = ("layers", "batch", "kv_heads", "seq", "head_dim")


class DecodeCache(NamedTuple):
    """Keys ``[L, N, K, Dh, S]`` and values ``[L, N, K, S, Dh]``; slot bookkeeping.

    ``valid_ns`` marks slots holding real tokens, ``positions_n`` is the position id the next
    token of each row gets, ``index`` the next slot to write (shared by all rows).
    """

    k: jax.Array
    v: jax.Array
    valid_ns: jax.Array
    positions_n: jax.Array
    index: jax.Array


def from_prefill(cache: KVCache, max_len: int) -> DecodeCache:
    """Re-lays a (prefilled) model cache out for decoding, with ``max_len`` slots in all."""
    extra = max_len - cache.max_len

    keys = jnp.pad(cache.k.transpose(0, 1, 3, 4, 2), ((0, 0),) * 4 + ((0, extra),))
    values = jnp.pad(cache.v.transpose(0, 1, 3, 2, 4), ((0, 0),) * 3 + ((0, extra), (0, 0)))
    return DecodeCache(
        k=keys,
        v=values,
        valid_ns=jnp.pad(cache.mask_bs, ((0, 0), (0, extra))),
        positions_n=cache.next_positions(),
        index=jnp.asarray(cache.index, jnp.int32),
    )


def constrain(cache: DecodeCache) -> DecodeCache:
    """Batch-shards the cache (and heads where the rules say) when a mesh is set."""
    return cache._replace(
        k=sharding.constrain(cache.k, _K_AXES),
        v=sharding.constrain(cache.v, _V_AXES),
        valid_ns=sharding.constrain(cache.valid_ns, ("batch", "seq")),
    )


def _attention(q_nhd, k_nkds, v_nksd, allowed_ns):
    """``softmax(q kᵀ / sqrt(Dh)) v`` for one query per row (as ``dot_product_attention``).

    Computed in the wider of the query and cache dtypes: with bf16 compute and an f32 cache
    (the CPU default, see ``generate``) the few attention FLOPs run in f32 on the cache as
    stored, and no step converts the whole cache.
    """
    n, h, hd = q_nhd.shape
    kv_heads = k_nkds.shape[1]
    dtype = jnp.promote_types(q_nhd.dtype, k_nkds.dtype)
    q_nkgd = q_nhd.astype(dtype).reshape(n, kv_heads, h // kv_heads, hd)
    q_nkgd = q_nkgd * jnp.asarray(hd**-0.5, dtype)
    scores = jnp.einsum(
        "nkgd,nkds->nkgs", q_nkgd, k_nkds.astype(dtype), preferred_element_type=jnp.float32
    )
    scores = jnp.where(allowed_ns[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out = jnp.einsum(
        "nkgs,nksd->nkgd", probs, v_nksd.astype(dtype), preferred_element_type=jnp.float32
    )
    return out.astype(q_nhd.dtype).reshape(n, h, hd)


def decode_step(
    lm: CausalLM, token_n: jax.Array, alive_n: jax.Array, cache: DecodeCache
) -> tuple[jax.Array, DecodeCache]:
    """Feeds one token per row; returns f32 next-token logits ``[N, V]`` and the new cache.

    Rows with ``alive_n`` False are computed but not written as valid (their slot stays
    unused and their position does not advance), as with ``mask_bt = False`` in the model.
    """
    c = lm.config
    decoder = lm.model
    dtype = c.jnp_dtype
    index = cache.index
    x_n1d = sharding.constrain(decoder.embed_tokens(token_n[:, None], dtype), _X_AXES)
    inv_freq, rope_scaling = rope_frequencies(c)  # static, at trace time
    cos, sin = rope_cos_sin(cache.positions_n[:, None], inv_freq, rope_scaling, dtype)
    valid_ns = jax.lax.dynamic_update_slice(cache.valid_ns, alive_n[:, None], (0, index))
    slot_s = jnp.arange(valid_ns.shape[1], dtype=jnp.int32)

    def body(layer, carry, per_layer):
        x_n1d, k_all, v_all = carry
        window, i = per_layer
        attn = layer.self_attn
        h_n1d = layer.input_layernorm(x_n1d)
        q_n1hd, k_n1kd, v_n1kd = attn.q_proj(h_n1d), attn.k_proj(h_n1d), attn.v_proj(h_n1d)
        if attn.q_norm is not None:
            q_n1hd, k_n1kd = attn.q_norm(q_n1hd), attn.k_norm(k_n1kd)
        q_n1hd = apply_rope(q_n1hd, cos, sin)
        k_n1kd = apply_rope(k_n1kd, cos, sin)
        # One new slot per layer, written in place into the carried [L, ...] cache.
        k_1nkd1 = k_n1kd[None, :, 0, :, :, None].astype(k_all.dtype)
        v_1nk1d = v_n1kd[None, :, 0, :, None, :].astype(v_all.dtype)
        k_all = jax.lax.dynamic_update_slice(k_all, k_1nkd1, (i, 0, 0, 0, index))
        v_all = jax.lax.dynamic_update_slice(v_all, v_1nk1d, (i, 0, 0, index, 0))
        allowed_ns = valid_ns & (slot_s > index - window)[None, :]
        k_nkds = jax.lax.dynamic_index_in_dim(k_all, i, keepdims=False)
        v_nksd = jax.lax.dynamic_index_in_dim(v_all, i, keepdims=False)
        out_nhd = _attention(q_n1hd[:, 0], k_nkds, v_nksd, allowed_ns)
        x_n1d = x_n1d + attn.o_proj(out_nhd[:, None])
        x_n1d = x_n1d + layer.mlp(layer.post_attention_layernorm(x_n1d))
        return (sharding.constrain(x_n1d, _X_AXES), k_all, v_all), None

    per_layer = (layer_windows(c), jnp.arange(c.num_layers, dtype=jnp.int32))
    (x_n1d, new_k, new_v), _ = scan_layers(
        decoder.layers, body, (x_n1d, cache.k, cache.v), per_layer
    )
    logits_nv = lm.logits(decoder.norm(x_n1d)[:, 0])
    new_cache = DecodeCache(
        k=new_k,
        v=new_v,
        valid_ns=valid_ns,
        positions_n=cache.positions_n + alive_n.astype(jnp.int32),
        index=index + 1,
    )
    return logits_nv, new_cache
