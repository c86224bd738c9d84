"""Prompt rendering (chat templates), padding to bucketed lengths, and the tokenizer/model check.

Prompts are rendered with the tokenizer's own chat template
(``apply_chat_template(messages, add_generation_prompt=True)``) and tokenised without adding
special tokens again (the template already holds them). Batches are padded to a length rounded
up to a multiple of ``pad_multiple`` so the jitted sampler and update see few distinct shapes:
prompts on the left (so every prompt ends at the same column, where generation starts),
completions on the right.

A chat template is a Jinja program shipped with the tokenizer; nested loops make one that runs
for hours on a single prompt. Rendering is therefore bounded: each conversation may take at most
:data:`CHAT_TEMPLATE_TIMEOUT` seconds, measured by a trace function on the template's own frames
(Jinja compiles templates to Python code whose file is ``<template>``), which stops it with a
:class:`~jaxrl_llm.data.DataError` naming the source and the limit.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.data.files import DataError

Messages = list[dict[str, str]]


def bucket_length(longest: int, pad_multiple: int) -> int:
    """``longest`` rounded up to a multiple of ``pad_multiple`` (at least one multiple)."""
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    return max(1, -(-longest // pad_multiple)) * pad_multiple


def left_pad(seqs: Sequence[np.ndarray], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``int32[B, length]`` ids right-aligned, and the ``bool[B, length]`` mask of real tokens."""
    ids = np.full((len(seqs), length), pad_id, np.int32)
    mask = np.zeros((len(seqs), length), np.bool_)
    for row, seq in enumerate(seqs):
        if len(seq):
            ids[row, length - len(seq) :] = seq
            mask[row, length - len(seq) :] = True
    return ids, mask


def right_pad(
    seqs: Sequence[np.ndarray], length: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """``int32[B, length]`` ids left-aligned, and the ``bool[B, length]`` mask of real tokens."""
    ids = np.full((len(seqs), length), pad_id, np.int32)
    mask = np.zeros((len(seqs), length), np.bool_)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = True
    return ids, mask


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, else its EOS id, else 0 (padding is masked out anyway)."""
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int):
            return value
    return 0


def as_text(value: Any, *, source: str, row: int, field: str) -> str:
    """A text cell as ``str``: bytes are decoded as UTF-8; anything else is a DataError."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(
                f"{source}: row {row}, field {field!r} is not valid UTF-8 text "
                f"(byte 0x{value[exc.start]:02x} at position {exc.start})"
            ) from exc
    if not isinstance(value, str):
        raise DataError(
            f"{source}: row {row}, field {field!r} is {type(value).__name__} {value!r}; "
            f"expected a string"
        )
    return value


def as_messages(value: Any, *, source: str, row: int, field: str) -> Messages | str:
    """A prompt cell: non-empty text, or a list of ``{role, content}`` chat messages."""
    if isinstance(value, list | tuple):
        messages = []
        for message in value:
            if not (isinstance(message, dict) and "role" in message and "content" in message):
                raise DataError(
                    f"{source}: row {row}, field {field!r} is a list but not of chat messages "
                    f"{{'role': ..., 'content': ...}}: {message!r}"
                )
            messages.append({"role": str(message["role"]), "content": str(message["content"])})
        if not messages:
            raise DataError(f"{source}: row {row}, field {field!r} is an empty list of messages")
        return messages
    if value is None:
        raise DataError(
            f"{source}: row {row} has no value for field {field!r}; expected a non-empty string"
        )
    text = as_text(value, source=source, row=row, field=field)
    if not text.strip():
        raise DataError(f"{source}: row {row}, field {field!r} is empty; expected a prompt")
    return text


def reward_prompt(prompt: Messages | str) -> str:
    """The text rewards see: the prompt itself, or the last user message of a conversation."""
    if isinstance(prompt, str):
        return prompt
    for message in reversed(prompt):
        if message["role"] == "user":
            return message["content"]
    return prompt[-1]["content"]


#: Seconds one conversation's chat template may take to render (a real template takes well
#: under a millisecond); past it the render stops with a DataError.
CHAT_TEMPLATE_TIMEOUT = 10.0


class ChatTemplateTimeout(Exception):
    """Raised inside a chat template that runs past :data:`CHAT_TEMPLATE_TIMEOUT`."""


@contextlib.contextmanager
def bounded_templates(timeout: float | None = None) -> Iterator[None]:
    """Within the block, each call of a Jinja template's root render function in this thread
    (one per conversation) raises :class:`ChatTemplateTimeout` once it has run ``timeout``
    seconds (default :data:`CHAT_TEMPLATE_TIMEOUT`). Other frames are not traced; a tracer
    already set (a debugger, coverage) keeps seeing them."""
    timeout = CHAT_TEMPLATE_TIMEOUT if timeout is None else timeout
    previous = sys.gettrace()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != "<template>":
            return previous(frame, event, arg) if previous is not None else None
        deadline = time.monotonic() + timeout

        def local(frame: Any, event: str, arg: Any) -> Any:
            if time.monotonic() > deadline:
                raise ChatTemplateTimeout
            return local

        return local

    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(previous)


def render_prompts(
    prompts: Sequence[Messages | str],
    tokenizer: Any,
    *,
    system_prompt: str | None,
    chat_template: bool,
    source: str,
) -> list[np.ndarray]:
    """Token ids (``int32``) of each prompt, ready for generation.

    With ``chat_template=True`` a text prompt becomes ``[system?, user]`` messages rendered with
    ``add_generation_prompt=True``; a message list gets the system prompt prepended unless it has
    one. With ``chat_template=False`` the text (after ``system_prompt + "\\n\\n"``) is tokenised
    with the tokenizer's usual special tokens (for base models without a template).
    """
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"{source}: the tokenizer has no chat template; set chat_template=False to feed "
                f"prompts as plain text"
            )
        conversations = []
        for prompt in prompts:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            if system_prompt is not None and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": system_prompt}, *messages]
            conversations.append(messages)
        try:
            with bounded_templates():
                texts = tokenizer.apply_chat_template(
                    conversations, add_generation_prompt=True, tokenize=False
                )
        except ChatTemplateTimeout:
            raise DataError(
                f"{source}: the tokenizer's chat template ran for more than "
                f"{CHAT_TEMPLATE_TIMEOUT:g} s on one conversation (real templates take under a "
                "millisecond; nested loops?); fix the template (tokenizer_config.json / "
                "chat_template.jinja) or set chat_template=False to feed plain text "
                "(jaxrl_llm.data.tokens.CHAT_TEMPLATE_TIMEOUT is the limit)"
            ) from None
        except Exception as exc:
            raise DataError(
                f"{source}: the tokenizer's chat template failed: {type(exc).__name__}: {exc}"
            ) from exc
        encoded = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    else:
        texts = []
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str):
                raise DataError(
                    f"{source}: row {i} is a list of chat messages, which needs chat_template=True"
                )
            texts.append(prompt if system_prompt is None else f"{system_prompt}\n\n{prompt}")
        encoded = tokenizer(texts, add_special_tokens=True)["input_ids"]
    return [np.asarray(ids, np.int32) for ids in encoded]


def encode_completions(texts: Sequence[str], tokenizer: Any) -> list[np.ndarray]:
    """Completion ids: the text without special tokens, then the EOS token (if there is one)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    suffix = [eos] if isinstance(eos, int) else []
    encoded = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return [np.asarray([*ids, *suffix], np.int32) for ids in encoded]


def check_tokenizer_vocab(tokenizer: Any, model_vocab_size: int, *, max_unused: int = 1024) -> None:
    """Raises :class:`DataError` when the tokenizer cannot belong to a model of this vocab size.

    Checks: every token id of the tokenizer (``len(tokenizer)``, added tokens included) and its
    special-token ids are below ``model_vocab_size``; and the model has at most ``max_unused``
    embedding rows beyond the tokenizer (models pad their embedding to a multiple of 64/128,
    e.g. Qwen2.5: 151,665 tokens, 151,936 rows; a far larger gap means another model's
    tokenizer).
    """
    num_tokens = len(tokenizer)
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if num_tokens > model_vocab_size:
        raise DataError(
            f"tokenizer {name!r} has {num_tokens} tokens but the model's vocab_size is "
            f"{model_vocab_size}: ids >= {model_vocab_size} would index past the embedding. "
            f"Use the tokenizer that belongs to the model."
        )
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int) and not 0 <= value < model_vocab_size:
            raise DataError(
                f"tokenizer {name!r}: {attr}={value} is outside the model's vocab "
                f"[0, {model_vocab_size})"
            )
    if model_vocab_size - num_tokens > max_unused:
        raise DataError(
            f"tokenizer {name!r} has {num_tokens} tokens but the model's vocab_size is "
            f"{model_vocab_size} ({model_vocab_size - num_tokens} unused rows > max_unused="
            f"{max_unused}): this looks like another model's tokenizer. Pass a larger "
            f"max_unused if the gap is intended."
        )
