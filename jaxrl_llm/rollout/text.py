"""Strings in, strings out: chat-templated prompt batches for :func:`generate` and decoding.

Prompts are rendered exactly as the trainer's datasets render them (``data.tokens.
render_prompts``: the tokenizer's own chat template with ``add_generation_prompt=True``, no
special tokens added twice), left-padded, and padded to a width that is a multiple of
``pad_multiple`` so batches of similar length share one compiled sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from jaxrl_llm.data.tokens import Messages, bucket_length, left_pad, pad_token_id, render_prompts


def encode_prompts(
    tokenizer: Any,
    prompts: Sequence[str | Messages],
    *,
    chat_template: bool | None = None,
    system_prompt: str | None = None,
    pad_multiple: int = 16,
    max_prompt_length: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(prompt_ids_bt int32[B, P], prompt_mask_bt bool[B, P])``, left-padded, P bucketed.

    Args:
      tokenizer: a ``transformers`` tokenizer.
      prompts: texts (each becomes one user message) or lists of ``{role, content}`` messages.
      chat_template: apply the tokenizer's chat template; default: when it has one.
      system_prompt: a system message put first (None: whatever the template does).
      pad_multiple: P is the longest prompt rounded up to a multiple of this.
      max_prompt_length: raise if a rendered prompt has more tokens than this.
    """
    if isinstance(prompts, str):
        raise TypeError("encode_prompts: prompts must be a list of prompts, got one string")
    if not prompts:
        raise ValueError("encode_prompts: no prompts given")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str) and not prompt.strip():
            raise ValueError(f"encode_prompts: prompt {i} is empty")
    if chat_template is None:
        chat_template = bool(getattr(tokenizer, "chat_template", None))
    seqs = render_prompts(
        list(prompts),
        tokenizer,
        system_prompt=system_prompt,
        chat_template=chat_template,
        source="encode_prompts",
    )
    lengths = [len(s) for s in seqs]
    if max_prompt_length is not None and max(lengths) > max_prompt_length:
        row = int(np.argmax(lengths))
        raise ValueError(
            f"encode_prompts: prompt {row} has {lengths[row]} tokens, more than "
            f"max_prompt_length={max_prompt_length}"
        )
    width = bucket_length(max(lengths), pad_multiple)
    return left_pad(seqs, width, pad_token_id(tokenizer))


def _eos_ids(tokenizer: Any) -> set[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in np.atleast_1d(eos)}


def completion_ids(
    tokens_t: ArrayLike, mask_t: ArrayLike, *, stop_ids: set[int] | frozenset = frozenset()
) -> list[int]:
    """The valid ids of one completion, cut before the first stop id."""
    out = []
    for token in np.asarray(tokens_t)[np.asarray(mask_t, bool)].tolist():
        if token in stop_ids:
            break
        out.append(token)
    return out


def decode_completions(
    tokenizer: Any,
    tokens_bgt: ArrayLike,
    mask_bgt: ArrayLike,
    *,
    skip_special_tokens: bool = True,
) -> list[list[str]]:
    """Text of every completion, ``[B][G]``: padding dropped, cut at the tokenizer's EOS.

    Pass ``rollout.tokens, rollout.mask``. The EOS itself is not part of the text (a run with
    ``stop_token_ids=()`` is cut at the first EOS too).
    """
    tokens = np.asarray(tokens_bgt)
    mask = np.asarray(mask_bgt, bool)
    if tokens.ndim != 3 or tokens.shape != mask.shape:
        raise ValueError(
            f"decode_completions: tokens and mask must both be [B, G, T], got {tokens.shape} "
            f"and {mask.shape}"
        )
    eos = _eos_ids(tokenizer)
    return [
        [
            tokenizer.decode(
                completion_ids(tokens[b, g], mask[b, g], stop_ids=eos),
                skip_special_tokens=skip_special_tokens,
            )
            for g in range(tokens.shape[1])
        ]
        for b in range(tokens.shape[0])
    ]
