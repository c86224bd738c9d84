"""Greedy decoding with the KV cache: a reference loop and the README one-liner.

Not the RL sampler (that lives in ``jaxrl_llm/rollout``): this is the simplest correct use of
:class:`KVCache` — one jitted prefill of the left-padded prompt, then one cached step per token
under ``lax.scan`` — used to check the model against ``transformers``' greedy ``generate``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_llm.models.transformer import CausalLM, KVCache

if TYPE_CHECKING:
    import transformers


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "eos_ids"))
def _generate(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    tokens_bt: jax.Array,
    mask_bt: jax.Array,
    *,
    max_new_tokens: int,
    eos_ids: tuple[int, ...],
) -> tuple[jax.Array, jax.Array]:
    model = nnx.merge(graphdef, state)
    b, t = tokens_bt.shape
    cache = model.init_cache(b, t + max_new_tokens)
    logits, cache = model(tokens_bt, mask_bt, cache=cache)
    first_b = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    eos = jnp.asarray(eos_ids or (-1,), jnp.int32)

    def step(
        carry: tuple[jax.Array, jax.Array, KVCache], _: None
    ) -> tuple[tuple[jax.Array, jax.Array, KVCache], tuple[jax.Array, jax.Array]]:
        token_b, alive_b, cache = carry
        logits, cache = model(token_b[:, None], alive_b[:, None], cache=cache)
        alive_b = alive_b & ~jnp.isin(token_b, eos)
        next_b = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        return (next_b, alive_b, cache), (token_b, alive_b)

    alive = jnp.ones((b,), bool)
    _, (tokens_nb, _) = jax.lax.scan(step, (first_b, alive, cache), length=max_new_tokens)
    tokens_bn = tokens_nb.T
    # Everything after the first EOS is padding.
    is_eos = jnp.isin(tokens_bn, eos)
    after = jnp.cumsum(is_eos, axis=1) - is_eos.astype(jnp.int32) > 0
    return tokens_bn, ~after


def greedy_generate(
    model: CausalLM,
    tokens_bt: jax.typing.ArrayLike,
    mask_bt: jax.typing.ArrayLike | None = None,
    *,
    max_new_tokens: int = 32,
    eos_token_id: int | tuple[int, ...] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Greedy continuation of left-padded prompts.

    Returns ``(tokens int32[B, N], valid bool[B, N])``: ``valid`` is False after each
    sequence's first EOS (the EOS itself is valid).
    """
    tokens_bt = jnp.asarray(tokens_bt, jnp.int32)
    mask_bt = jnp.ones(tokens_bt.shape, bool) if mask_bt is None else jnp.asarray(mask_bt, bool)
    eos = eos_token_id if eos_token_id is not None else model.config.eos_token_id
    eos_ids = tuple(np.atleast_1d(eos).tolist()) if eos is not None else ()
    graphdef, state = nnx.split(model)
    return _generate(
        graphdef, state, tokens_bt, mask_bt, max_new_tokens=max_new_tokens, eos_ids=eos_ids
    )


def greedy_complete(
    model: CausalLM,
    tokenizer: transformers.PreTrainedTokenizerBase,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    chat: bool = True,
) -> str:
    """The greedy reply to ``prompt`` (through the chat template when the tokenizer has one)."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    tokens, valid = greedy_generate(model, np.asarray([ids]), max_new_tokens=max_new_tokens)
    out = np.asarray(tokens[0])[np.asarray(valid[0])]
    return tokenizer.decode(out.tolist(), skip_special_tokens=True)
