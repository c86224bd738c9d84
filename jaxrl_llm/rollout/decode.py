"""The one-token decode step, on a KV cache laid out for it.

The model's :class:`~jaxrl_llm.models.KVCache` stores ``[B, S, K, Dh]`` per layer, the layout
prefill and training want. For a single query per sequence, XLA:CPU then transposes the whole
cache to ``[B, K, Dh, S]`` in every layer of every step to form ``q·kᵀ`` (SmolLM2-135M at 32
sequences: 60 copies of 3 MB per step; avoiding them took the fp32 step from ~56 to ~52 ms on
2 CPU cores, and more as the cache grows). The decode loop therefore keeps its own cache,
converted once after prefill:

    keys    [N, K, Dh, S]   (scores = q · keys is a plain batched matmul)
    values  [N, K, S, Dh]   (out = probs · values likewise)

one array per layer, and this module's :func:`decode_step` runs the model's own submodules
(norms, projections, q/k norms, RoPE, MLP, LM head) around an attention written for that
layout, layer by layer (unrolled) on per-layer weights. The model stores its layers stacked
(``[L, ...]``, see ``transformer.py``); the engines slice them once per rollout, outside their
programs (``paged.engine_params``; :func:`unstack_layers` inside a program). A scan over the
stacked layers with the cache in its carry measured 13% slower per token here: XLA:CPU copies
each layer's cache slice (``dynamic-slice``) before the attention matmuls read it, ~165 MB per
token at 32 x 112 slots, while separate per-layer buffers are read and updated in place. The
cost is one copy of the layer weights while sampling (0.43 GB for SmolLM2-135M in f32), below
the update's peak. It is checked token for token against transformers and against the model's
cached forward in the tests.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm.models import sharding
from jaxrl_llm.models.rope import apply_rope, rope_cos_sin, rope_frequencies
from jaxrl_llm.models.transformer import CausalLM, DecoderLayer, KVCache

_X_AXES = ("batch", "seq", "act_embed")
_K_AXES = ("batch", "kv_heads", "head_dim", "seq")
_V_AXES = ("batch", "kv_heads", "seq", "head_dim")


class DecodeCache(NamedTuple):
    """Per-layer keys ``[N, K, Dh, S]`` and values ``[N, K, S, Dh]``; slot bookkeeping.

    ``valid_ns`` marks slots holding real tokens, ``positions_n`` is the position id the next
    token of each row gets, ``index`` the next slot to write (shared by all rows).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    valid_ns: jax.Array
    positions_n: jax.Array
    index: jax.Array


def unstack_layers(layers: DecoderLayer) -> tuple[DecoderLayer, ...]:
    """The model's stacked ``[L, ...]`` layer as ``L`` per-layer modules (sliced copies)."""
    graphdef, state = nnx.split(layers)
    num_layers = jax.tree.leaves(state)[0].shape[0]
    return tuple(
        nnx.merge(graphdef, jax.tree.map(lambda x, i=i: x[i], state)) for i in range(num_layers)
    )


def from_prefill(cache: KVCache, max_len: int) -> DecodeCache:
    """Re-lays a (prefilled) model cache out for decoding, with ``max_len`` slots in all."""
    extra = max_len - cache.max_len

    def keys(k_bskd: jax.Array) -> jax.Array:
        return jnp.pad(k_bskd.transpose(0, 2, 3, 1), ((0, 0), (0, 0), (0, 0), (0, extra)))

    def values(v_bskd: jax.Array) -> jax.Array:
        return jnp.pad(v_bskd.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, extra), (0, 0)))

    num_layers = cache.k.shape[0]  # the model's cache is stacked: [L, B, S, K, Dh]
    return DecodeCache(
        k=tuple(keys(cache.k[i]) for i in range(num_layers)),
        v=tuple(values(cache.v[i]) for i in range(num_layers)),
        valid_ns=jnp.pad(cache.mask_bs, ((0, 0), (0, extra))),
        positions_n=cache.next_positions(),
        index=jnp.asarray(cache.index, jnp.int32),
    )


def constrain(cache: DecodeCache) -> DecodeCache:
    """Batch-shards the cache (and heads where the rules say) when a mesh is set."""
    return cache._replace(
        k=tuple(sharding.constrain(k, _K_AXES) for k in cache.k),
        v=tuple(sharding.constrain(v, _V_AXES) for v in cache.v),
        valid_ns=sharding.constrain(cache.valid_ns, ("batch", "seq")),
    )


def _attention(
    q_nhd: jax.Array, k_nkds: jax.Array, v_nksd: jax.Array, allowed_ns: jax.Array
) -> jax.Array:
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
    lm: CausalLM,
    token_n: jax.Array,
    alive_n: jax.Array,
    cache: DecodeCache,
    layers: tuple[DecoderLayer, ...] | None = None,
) -> tuple[jax.Array, DecodeCache]:
    """Feeds one token per row; returns f32 next-token logits ``[N, V]`` and the new cache.

    Rows with ``alive_n`` False are computed but not written as valid (their slot stays
    unused and their position does not advance), as with ``mask_bt = False`` in the model.
    ``layers`` is :func:`unstack_layers` of the model's layers, computed once outside a decode
    loop (by default it is sliced here, at every call).
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
    allowed = {}
    for window in {c.window(i) for i in range(c.num_layers)}:
        allowed[window] = (
            valid_ns if window is None else valid_ns & (slot_s > index - window)[None, :]
        )

    new_k, new_v = [], []
    if layers is None:
        layers = unstack_layers(decoder.layers)
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        h_n1d = layer.input_layernorm(x_n1d)
        q_n1hd, k_n1kd, v_n1kd = attn.q_proj(h_n1d), attn.k_proj(h_n1d), attn.v_proj(h_n1d)
        if attn.q_norm is not None:
            q_n1hd, k_n1kd = attn.q_norm(q_n1hd), attn.k_norm(k_n1kd)
        q_n1hd = apply_rope(q_n1hd, cos, sin)
        k_n1kd = apply_rope(k_n1kd, cos, sin)
        k_cache, v_cache = cache.k[i], cache.v[i]
        k_nkd1 = k_n1kd[:, 0, :, :, None].astype(k_cache.dtype)
        v_nk1d = v_n1kd[:, 0, :, None, :].astype(v_cache.dtype)
        k_cache = jax.lax.dynamic_update_slice(k_cache, k_nkd1, (0, 0, 0, index))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v_nk1d, (0, 0, index, 0))
        new_k.append(k_cache)
        new_v.append(v_cache)
        out_nhd = _attention(q_n1hd[:, 0], k_cache, v_cache, allowed[c.window(i)])
        x_n1d = x_n1d + attn.o_proj(out_nhd[:, None])
        x_n1d = x_n1d + layer.mlp(layer.post_attention_layernorm(x_n1d))
        x_n1d = sharding.constrain(x_n1d, _X_AXES)
    logits_nv = lm.logits(decoder.norm(x_n1d)[:, 0])
    new_cache = DecodeCache(
        k=tuple(new_k),
        v=tuple(new_v),
        valid_ns=valid_ns,
        positions_n=cache.positions_n + alive_n.astype(jnp.int32),
        index=index + 1,
    )
    return logits_nv, new_cache
