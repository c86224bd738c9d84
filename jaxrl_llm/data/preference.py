"""Preference datasets (prompt, chosen, rejected) for DPO and its relatives.

The prompt is rendered like an RL prompt (chat template, generation prompt) and left-padded; each
answer is tokenised as plain text followed by the EOS token and right-padded, so
``concat(prompt_ids_bt, chosen_ids_bt)`` is the sequence the policy scores, with the answer's
tokens where ``chosen_mask_bt`` is True — the same layout as an RL rollout. Chosen and rejected
share one padded length so they stack as ``[B, 2, T]``.

Pairs whose prompt is longer than ``max_prompt_length`` are dropped (``num_dropped``); answers
longer than ``max_completion_length`` are cut to it (``num_truncated`` pairs), as TRL does.

A file without a prompt column holds its prompts implicitly, as TRL's "preference with implicit
prompt" datasets do (Anthropic HH, ``trl-lib/ultrafeedback_binarized``): each pair's prompt is
the longest common start of its chosen and rejected conversations (whole messages) or texts
(characters, a space at the split going to the answers), TRL's ``extract_prompt`` rule.
"""

from __future__ import annotations

import dataclasses
import difflib
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
from jaxrl_llm.data.prompts import keep_short
from jaxrl_llm.data.tokens import (
    Messages,
    as_messages,
    as_text,
    bucket_length,
    encode_completions,
    left_pad,
    pad_token_id,
    render_prompts,
    right_pad,
)


class PreferenceBatch(NamedTuple):
    """``B`` preference pairs.

    Attributes:
      prompt_ids_bt, prompt_mask_bt: ``int32/bool[B, Tp]`` prompts, left-padded.
      chosen_ids_bt, chosen_mask_bt: ``int32/bool[B, Tc]`` preferred answers (+EOS), right-padded.
      rejected_ids_bt, rejected_mask_bt: ``int32/bool[B, Tc]`` dispreferred answers, same length.
      indices: ``int64[B]`` positions of these pairs in the dataset.
    """

    prompt_ids_bt: np.ndarray
    prompt_mask_bt: np.ndarray
    chosen_ids_bt: np.ndarray
    chosen_mask_bt: np.ndarray
    rejected_ids_bt: np.ndarray
    rejected_mask_bt: np.ndarray
    indices: np.ndarray


def _answer_text(value: Any, *, source: str, row: int, field: str) -> str:
    """An answer cell: text, or chat messages (the last assistant message is the answer)."""
    if value is None:
        raise DataError(f"{source}: row {row} has no value for field {field!r}; expected text")
    if isinstance(value, list | tuple):
        messages = as_messages(value, source=source, row=row, field=field)
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        return replies[-1] if replies else messages[-1]["content"]
    return as_text(value, source=source, row=row, field=field)


def split_implicit_prompt(
    chosen: Any,
    rejected: Any,
    *,
    source: str = "records",
    row: int = 0,
    fields: tuple[str, str] = ("chosen", "rejected"),
) -> tuple[Messages | str, Messages | str, Messages | str]:
    """``(prompt, chosen answer, rejected answer)`` of a pair whose prompt is implicit: the
    longest common start of the two conversations (whole ``{role, content}`` messages) or of
    the two texts (characters; a space right before the split goes to the answers, so
    ``"Q: 2+2? 4"`` / ``"Q: 2+2? 5"`` give the prompt ``"Q: 2+2?"`` and the answers ``" 4"`` /
    ``" 5"``). This is TRL's ``extract_prompt`` (``trl.data_utils``), except that a pair where
    one side is the start of the other splits at the shorter side's end (an empty answer).

    Raises:
      DataError: the two sides are not both text or both messages, or share no start.
    """
    if isinstance(chosen, list | tuple) and isinstance(rejected, list | tuple):
        chosen = as_messages(chosen, source=source, row=row, field=fields[0])
        rejected = as_messages(rejected, source=source, row=row, field=fields[1])
    elif isinstance(chosen, list | tuple) or isinstance(rejected, list | tuple):
        raise DataError(
            f"{source}: row {row}: with no prompt column, {fields[0]!r} and {fields[1]!r} must "
            "both be text or both chat messages, to take the prompt from their common start"
        )
    else:
        chosen = as_text(chosen, source=source, row=row, field=fields[0])
        rejected = as_text(rejected, source=source, row=row, field=fields[1])
    n = min(len(chosen), len(rejected))
    idx = next((i for i in range(n) if chosen[i] != rejected[i]), n)
    if isinstance(chosen, str) and 0 < idx < len(chosen) and chosen[idx - 1] == " ":
        idx -= 1
    if idx == 0:
        raise DataError(
            f"{source}: row {row}: there is no prompt column, and {fields[0]!r} and "
            f"{fields[1]!r} share no start to take the prompt from; add a prompt column (or set "
            "`prompt_field`)"
        )
    return chosen[:idx], chosen[idx:], rejected[idx:]


@dataclasses.dataclass(frozen=True, eq=False)
class PreferenceDataset:
    """Tokenised preference pairs. Build with :meth:`from_file` or :meth:`from_records`.

    Attributes:
      prompt_ids, chosen_ids, rejected_ids: ``int32`` token ids of each kept pair.
      source_rows: ``int64`` row of each kept pair in the source.
      num_dropped: pairs dropped for an over-long prompt.
      num_truncated: kept pairs with an answer cut to ``max_completion_length``.
      max_prompt_length, max_completion_length: the limits, in tokens.
      pad_id: the id used for padding.
      source: where the pairs came from.
      implicit_prompt: the prompts were taken from the common start of chosen and rejected
        (:func:`split_implicit_prompt`; the records have no prompt column).
    """

    prompt_ids: list[np.ndarray]
    chosen_ids: list[np.ndarray]
    rejected_ids: list[np.ndarray]
    source_rows: np.ndarray
    num_dropped: int
    num_truncated: int
    max_prompt_length: int
    max_completion_length: int
    pad_id: int
    source: str
    implicit_prompt: bool = False

    @classmethod
    def from_file(
        cls,
        path: PathLike | Sequence[PathLike],
        tokenizer: Any,
        *,
        format: str | None = None,
        cache_dir: PathLike | None = None,
        **kwargs: Any,
    ) -> PreferenceDataset:
        """Reads JSONL/JSON/Parquet/CSV file(s), then :meth:`from_records`."""
        table = load_table(path, format=format, cache_dir=cache_dir)
        return cls.from_records(table, tokenizer, source=describe_paths(path), **kwargs)

    @classmethod
    def from_records(
        cls,
        records: Any,
        tokenizer: Any,
        *,
        prompt_field: str = "prompt",
        chosen_field: str = "chosen",
        rejected_field: str = "rejected",
        system_prompt: str | None = None,
        max_prompt_length: int = 512,
        max_completion_length: int = 512,
        chat_template: bool = True,
        source: str = "records",
    ) -> PreferenceDataset:
        """Tokenises (prompt, chosen, rejected) rows; arguments as in
        :meth:`PromptDataset.from_records`. Answers are text or chat messages."""
        for name, value in (
            ("max_prompt_length", max_prompt_length),
            ("max_completion_length", max_completion_length),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        columns = to_columns(records, source=source)
        for field, option in ((chosen_field, "chosen_field"), (rejected_field, "rejected_field")):
            require_column(columns, field, source=source, option=option)
        # No prompt column (and none that a misspelt prompt_field could mean): the prompts are
        # the common starts of chosen and rejected.
        implicit = prompt_field not in columns and not difflib.get_close_matches(
            prompt_field, [c for c in columns if c not in (chosen_field, rejected_field)], n=1
        )
        pairs = list(zip(columns[chosen_field], columns[rejected_field], strict=True))
        if not implicit:
            require_column(columns, prompt_field, source=source, option="prompt_field")
            triples = [(p, c, r) for p, (c, r) in zip(columns[prompt_field], pairs, strict=True)]
        else:
            fields = (chosen_field, rejected_field)
            triples = [
                split_implicit_prompt(c, r, source=source, row=i, fields=fields)
                for i, (c, r) in enumerate(pairs)
            ]
        prompt_cells, chosen_cells, rejected_cells = zip(*triples, strict=True)
        prompts = [
            as_messages(v, source=source, row=i, field=prompt_field)
            for i, v in enumerate(prompt_cells)
        ]
        answers = {
            field: [_answer_text(v, source=source, row=i, field=field) for i, v in enumerate(cells)]
            for field, cells in ((chosen_field, chosen_cells), (rejected_field, rejected_cells))
        }
        prompt_ids = render_prompts(
            prompts,
            tokenizer,
            system_prompt=system_prompt,
            chat_template=chat_template,
            source=source,
        )
        keep = keep_short(
            [len(x) for x in prompt_ids],
            max_prompt_length,
            source=source,
            what="preference prompts",
            option="max_prompt_length",
        )
        chosen = encode_completions([answers[chosen_field][i] for i in keep], tokenizer)
        rejected = encode_completions([answers[rejected_field][i] for i in keep], tokenizer)
        num_truncated = sum(
            max(len(c), len(r)) > max_completion_length
            for c, r in zip(chosen, rejected, strict=True)
        )
        return cls(
            prompt_ids=[prompt_ids[i] for i in keep],
            chosen_ids=[c[:max_completion_length] for c in chosen],
            rejected_ids=[r[:max_completion_length] for r in rejected],
            source_rows=keep.astype(np.int64),
            num_dropped=len(prompt_ids) - len(keep),
            num_truncated=int(num_truncated),
            max_prompt_length=max_prompt_length,
            max_completion_length=max_completion_length,
            pad_id=pad_token_id(tokenizer),
            source=source,
            implicit_prompt=implicit,
        )

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def batch(
        self, indices: Sequence[int], *, pad_multiple: int = 32, fixed_length: bool = False
    ) -> PreferenceBatch:
        """The pairs at ``indices``: prompts left-padded, answers right-padded, each to a length
        rounded up to ``pad_multiple`` (or the limits, with ``fixed_length=True``)."""
        indices = np.asarray(indices, np.int64)
        prompts = [self.prompt_ids[i] for i in indices]
        chosen = [self.chosen_ids[i] for i in indices]
        rejected = [self.rejected_ids[i] for i in indices]
        if fixed_length:
            prompt_len, answer_len = self.max_prompt_length, self.max_completion_length
        else:
            prompt_len = max(len(p) for p in prompts)
            answer_len = max(max(len(a) for a in chosen), max(len(a) for a in rejected))
        prompt_t = bucket_length(prompt_len, pad_multiple)
        answer_t = bucket_length(answer_len, pad_multiple)
        prompt_ids_bt, prompt_mask_bt = left_pad(prompts, prompt_t, self.pad_id)
        chosen_ids_bt, chosen_mask_bt = right_pad(chosen, answer_t, self.pad_id)
        rejected_ids_bt, rejected_mask_bt = right_pad(rejected, answer_t, self.pad_id)
        return PreferenceBatch(
            prompt_ids_bt,
            prompt_mask_bt,
            chosen_ids_bt,
            chosen_mask_bt,
            rejected_ids_bt,
            rejected_mask_bt,
            indices,
        )
