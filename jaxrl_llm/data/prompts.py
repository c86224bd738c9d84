"""Prompt datasets for on-policy RL: tokenised once, over-long prompts dropped and counted.

A :class:`PromptDataset` holds each kept prompt's token ids (chat template applied), the prompt
text rewards see, and the extra per-prompt fields rewards need (``answer``, ...). ``batch(indices)``
builds a :class:`PromptBatch` of left-padded ``int32`` ids and a ``bool`` mask whose length is
the longest prompt of the batch rounded up to ``pad_multiple``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from jaxrl_llm.data.files import (
    DataError,
    PathLike,
    describe_paths,
    load_table,
    require_column,
    to_columns,
)
from jaxrl_llm.data.tokens import (
    as_messages,
    bucket_length,
    left_pad,
    pad_token_id,
    render_prompts,
    reward_prompt,
)
from jaxrl_llm.rewards.base import RAW_PROMPT_FIELD


class PromptBatch(NamedTuple):
    """``B`` prompts ready for the sampler.

    Attributes:
      prompt_ids_bt: ``int32[B, T]`` token ids, left-padded with the pad id.
      prompt_mask_bt: ``bool[B, T]`` True on real prompt tokens.
      prompts: ``B`` prompt texts as rewards see them.
      fields: ``{column: list of B values}`` passed to rewards as keyword arguments.
      indices: ``int64[B]`` positions of these prompts in the dataset.
    """

    prompt_ids_bt: np.ndarray
    prompt_mask_bt: np.ndarray
    prompts: list[str]
    fields: dict[str, list[Any]]
    indices: np.ndarray


def _max_length_check(max_prompt_length: int) -> None:
    if isinstance(max_prompt_length, bool) or not isinstance(max_prompt_length, int):
        raise TypeError(f"max_prompt_length must be an int, got {max_prompt_length!r}")
    if max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")


def keep_short(
    lengths: Sequence[int], max_length: int, *, source: str, what: str = "prompts", option: str
) -> np.ndarray:
    """Indices of entries with ``length <= max_length``; a DataError when none is left."""
    lengths_n = np.asarray(lengths, np.int64)
    keep = np.flatnonzero(lengths_n <= max_length)
    if keep.size == 0:
        raise DataError(
            f"{source}: all {lengths_n.size} {what} are longer than the limit of {max_length} "
            f"tokens (the shortest has {int(lengths_n.min())}); raise {option}"
        )
    return keep


@dataclasses.dataclass(frozen=True, eq=False)
class PromptDataset:
    """Tokenised prompts with their reward fields. Build with :meth:`from_file` or
    :meth:`from_records`.

    Attributes:
      prompt_ids: token ids (``int32[L_i]``) of each kept prompt.
      prompts: the text rewards see for each kept prompt.
      fields: ``{column: values}`` of the kept prompts (every column but the prompt's, unless
        ``fields=`` chose some), and ``raw_prompt`` (``rewards.RAW_PROMPT_FIELD``): each prompt as
        the data gives it, text or ``{role, content}`` messages (what TRL passes as ``prompts``).
      source_rows: ``int64`` row of each kept prompt in the source.
      num_dropped: prompts dropped for being longer than ``max_prompt_length`` (log it).
      max_prompt_length: the limit, in tokens (chat template included).
      pad_id: the id used for padding.
      source: where the prompts came from (for messages).
    """

    prompt_ids: list[np.ndarray]
    prompts: list[str]
    fields: dict[str, list[Any]]
    source_rows: np.ndarray
    num_dropped: int
    max_prompt_length: int
    pad_id: int
    source: str

    @classmethod
    def from_file(
        cls,
        path: PathLike | Sequence[PathLike],
        tokenizer: Any,
        *,
        format: str | None = None,
        cache_dir: PathLike | None = None,
        **kwargs: Any,
    ) -> PromptDataset:
        """Reads JSONL/JSON/Parquet/CSV file(s) (see :func:`load_table`), then
        :meth:`from_records` with the same keyword arguments."""
        table = load_table(path, format=format, cache_dir=cache_dir)
        source = describe_paths(path)
        return cls.from_records(table, tokenizer, source=source, **kwargs)

    @classmethod
    def from_records(
        cls,
        records: Any,
        tokenizer: Any,
        *,
        prompt_field: str = "prompt",
        system_prompt: str | None = None,
        fields: Sequence[str] | None = None,
        max_prompt_length: int = 512,
        chat_template: bool = True,
        source: str = "records",
    ) -> PromptDataset:
        """Tokenises prompts from rows.

        Args:
          records: a ``datasets.Dataset``, a mapping of columns or a sequence of row dicts.
          tokenizer: a ``transformers`` tokenizer (with a chat template unless
            ``chat_template=False``).
          prompt_field: the column holding the prompt: text, or a list of chat messages.
          system_prompt: a system message put before every prompt (None: the template's own).
          fields: columns passed to rewards; default every column but the prompt. The prompt
            as read is passed too, as ``raw_prompt`` (unless the data has such a column).
          max_prompt_length: prompts with more tokens (template included) are dropped and
            counted in ``num_dropped``.
          chat_template: apply the tokenizer's chat template (else plain text).
          source: how error messages name the data.

        Raises:
          DataError: no rows, a missing prompt field or extra field (nearest name suggested), a
            row without a prompt or with a non-text/non-UTF-8 prompt, every prompt too long.
        """
        _max_length_check(max_prompt_length)
        columns = to_columns(records, source=source)
        require_column(columns, prompt_field, source=source, option="prompt_field")
        if fields is None:
            fields = [k for k in columns if k != prompt_field]
        for field in fields:
            require_column(columns, field, source=source, option="fields")
        prompts = [
            as_messages(value, source=source, row=i, field=prompt_field)
            for i, value in enumerate(columns[prompt_field])
        ]
        ids = render_prompts(
            prompts,
            tokenizer,
            system_prompt=system_prompt,
            chat_template=chat_template,
            source=source,
        )
        keep = keep_short(
            [len(x) for x in ids], max_prompt_length, source=source, option="max_prompt_length"
        )
        return cls(
            prompt_ids=[ids[i] for i in keep],
            prompts=[reward_prompt(prompts[i]) for i in keep],
            fields={
                RAW_PROMPT_FIELD: [prompts[i] for i in keep],
                **{field: [columns[field][i] for i in keep] for field in fields},
            },
            source_rows=keep.astype(np.int64),
            num_dropped=len(ids) - len(keep),
            max_prompt_length=max_prompt_length,
            pad_id=pad_token_id(tokenizer),
            source=source,
        )

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def batch(
        self, indices: Sequence[int], *, pad_multiple: int = 32, fixed_length: bool = False
    ) -> PromptBatch:
        """The prompts at ``indices``, left-padded to a bucketed length.

        ``T = ceil(longest / pad_multiple) * pad_multiple``, or with ``fixed_length=True``
        ``ceil(max_prompt_length / pad_multiple) * pad_multiple`` for every batch (one shape).
        """
        indices = np.asarray(indices, np.int64)
        seqs = [self.prompt_ids[i] for i in indices]
        longest = self.max_prompt_length if fixed_length else max(len(s) for s in seqs)
        ids_bt, mask_bt = left_pad(seqs, bucket_length(longest, pad_multiple), self.pad_id)
        return PromptBatch(
            prompt_ids_bt=ids_bt,
            prompt_mask_bt=mask_bt,
            prompts=[self.prompts[i] for i in indices],
            fields={k: [v[i] for i in indices] for k, v in self.fields.items()},
            indices=indices,
        )
