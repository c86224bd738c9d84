"""The run's data and reward from its config: datasets, held-out split, the weighted reward.

* ``data.source: arithmetic``: :func:`jaxrl_llm.data.arithmetic_task` with ``data.seed``; its
  ``eval_size`` held-out problems are disjoint from the training ones. For ``dpo`` each problem
  becomes a pair (chosen: the correct answer; rejected: a wrong number), by
  :func:`jaxrl_llm.data.arithmetic_preference_pairs` (seeded with ``data.seed``, ``+ 1`` for the
  held-out pairs).
* ``data.source: file``: JSONL/Parquet/CSV read with ``datasets``; the evaluation split is
  ``data.eval_path``, or ``eval_size`` rows held out of the training file by a permutation seeded
  with ``data.seed``.

Prompts longer than ``data.max_prompt_length`` are dropped and counted (the loop logs it).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import data as D
from jaxrl_llm import rewards as R
from jaxrl_llm.config import TrainConfig, data_format, to_dict

_ANSWER_TYPES = ("integer_answer", "gsm8k", "gsm8k_answer", "boxed", "boxed_answer")


@dataclasses.dataclass
class RunData:
    """Datasets of a run.

    Attributes:
      train: a PromptDataset (online recipes) or PreferenceDataset (dpo).
      eval_prompts: held-out prompts with their answer fields (``None``: no evaluation).
      eval_pairs: held-out preference pairs (dpo), or ``None``.
      notes: human-readable lines for the log (dropped prompts, ...).
    """

    train: Any
    eval_prompts: D.PromptDataset | None = None
    eval_pairs: D.PreferenceDataset | None = None
    notes: list[str] = dataclasses.field(default_factory=list)


def _columns_of_file(config: TrainConfig, path: str) -> dict[str, list[Any]]:
    table = D.load_table(path, format=data_format(config.data, path))
    return D.to_columns(table, source=path)


def _take(columns: dict[str, list[Any]], rows: np.ndarray) -> dict[str, list[Any]]:
    return {k: [v[i] for i in rows] for k, v in columns.items()}


def _split_columns(config: TrainConfig) -> tuple[dict, dict | None, str]:
    """(train columns, eval columns or None, source name)."""
    d = config.data
    if d.source == "arithmetic":
        a = d.arithmetic
        train_rows, eval_rows = D.arithmetic_task(
            num_train=a.train_size,
            num_eval=d.eval_size,
            ops=tuple(a.operations),
            seed=d.seed,
            min_operand=a.min_operand,
            max_operand=a.max_operand,
        )
        return (
            D.to_columns(train_rows, source="arithmetic"),
            (D.to_columns(eval_rows, source="arithmetic") if eval_rows else None),
            "arithmetic",
        )
    train = _columns_of_file(config, d.path)
    if d.eval_path:
        return train, _columns_of_file(config, d.eval_path) if d.eval_size else None, d.path
    n = len(next(iter(train.values())))
    if not d.eval_size:
        return train, None, d.path
    if d.eval_size >= n:
        raise D.DataError(
            f"{d.path}: data.eval_size = {d.eval_size} held-out rows leave none of the {n} rows "
            "for training; lower it or set data.eval_path"
        )
    order = np.random.default_rng([d.seed, 7]).permutation(n)
    return (
        _take(train, np.sort(order[d.eval_size :])),
        _take(train, np.sort(order[: d.eval_size])),
        d.path,
    )


def build_data(config: TrainConfig, tokenizer: Any) -> RunData:
    """The training and held-out datasets of ``config`` (see the module docstring)."""
    d = config.data
    train_cols, eval_cols, source = _split_columns(config)
    prompt_kwargs = dict(
        prompt_field=d.prompt_field if d.source == "file" else "prompt",
        system_prompt=d.system_prompt,
        max_prompt_length=d.max_prompt_length,
        chat_template=d.chat_template,
    )
    notes = []
    if config.is_offline:
        pref_kwargs = dict(
            prompt_field=d.prompt_field,
            chosen_field=d.chosen_field,
            rejected_field=d.rejected_field,
            system_prompt=d.system_prompt,
            max_prompt_length=d.max_prompt_length,
            max_completion_length=config.preference.max_response_length,
            chat_template=d.chat_template,
        )
        if d.source == "arithmetic":
            to_pairs = functools.partial(
                D.arithmetic_preference_pairs,
                prompt_field=d.prompt_field,
                chosen_field=d.chosen_field,
                rejected_field=d.rejected_field,
            )
            train_cols = to_pairs(train_cols, seed=d.seed)
            eval_cols = to_pairs(eval_cols, seed=d.seed + 1) if eval_cols else None
        train = D.PreferenceDataset.from_records(
            train_cols, tokenizer, source=source, **pref_kwargs
        )
        pairs = prompts = None
        if eval_cols:
            pairs = D.PreferenceDataset.from_records(
                eval_cols, tokenizer, source=f"{source} (eval)", **pref_kwargs
            )
            if d.answer_field in eval_cols:
                prompts = D.PromptDataset.from_records(
                    eval_cols,
                    tokenizer,
                    fields=[d.answer_field],
                    source=f"{source} (eval)",
                    **{**prompt_kwargs, "prompt_field": d.prompt_field},
                )
        notes += _notes(train, "training pairs") + (_notes(pairs, "eval pairs") if pairs else [])
        if train.num_truncated:
            notes.append(
                f"{train.num_truncated} training pairs have an answer cut to "
                f"{config.preference.max_response_length} tokens"
            )
        return RunData(train=train, eval_prompts=prompts, eval_pairs=pairs, notes=notes)
    train = D.PromptDataset.from_records(train_cols, tokenizer, source=source, **prompt_kwargs)
    prompts = None
    if eval_cols:
        prompts = D.PromptDataset.from_records(
            eval_cols, tokenizer, source=f"{source} (eval)", **prompt_kwargs
        )
    notes += _notes(train, "training prompts") + (
        _notes(prompts, "eval prompts") if prompts else []
    )
    return RunData(train=train, eval_prompts=prompts, notes=notes)


def _notes(ds: Any, what: str) -> list[str]:
    if not ds.num_dropped:
        return []
    return [
        f"dropped {ds.num_dropped} {what} longer than {ds.max_prompt_length} tokens "
        f"(kept {len(ds)})"
    ]


# ---------------------------------------------------------------------------------------------
# The reward.


def reward_model_scorer(path: str, *, batch_pad: int = 32):
    """``score(prompts, completions) -> f32[N]`` of a reward model folder (its own tokenizer
    and chat template: the conversation [user: prompt, assistant: completion])."""
    from jaxrl_llm import models
    from jaxrl_llm.train.models import resolve_model_path

    folder = resolve_model_path(path)
    model = models.from_pretrained(folder, head="reward")
    tokenizer = models.load_tokenizer(folder)
    from flax import nnx

    graphdef, params = nnx.split(model)

    @jax.jit
    def forward(params, ids, mask):
        return nnx.merge(graphdef, params)(ids, mask)

    def score(prompts: list[str], completions: list[str]) -> np.ndarray:
        seqs = []
        for prompt, completion in zip(prompts, completions, strict=True):
            if getattr(tokenizer, "chat_template", None):
                text = tokenizer.apply_chat_template(
                    [
                        {"role": "user", "content": prompt},
                        {"role": "assistant", "content": completion},
                    ],
                    tokenize=False,
                )
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                ids = tokenizer(prompt + completion)["input_ids"]
            seqs.append(np.asarray(ids, np.int32))
        width = D.bucket_length(max(len(s) for s in seqs), batch_pad)
        ids, mask = D.left_pad(seqs, width, D.tokens.pad_token_id(tokenizer))
        return np.asarray(forward(params, jnp.asarray(ids), jnp.asarray(mask)), np.float32)

    return score


def build_run_reward(config: TrainConfig, *, base_dir: str | Path | None = None) -> R.WeightedSum:
    """The weighted reward of ``config.rewards`` (answer rewards read ``data.answer_field``)."""
    terms = []
    for i, term in enumerate(config.rewards.terms):
        item = to_dict(term)
        kwargs = dict(item.pop("kwargs") or {})
        if item["type"] in _ANSWER_TYPES:
            kwargs.setdefault("field", config.data.answer_field)
        scorer = None
        if item["type"] == "reward_model" and "score" not in kwargs:
            scorer = _cached_scorer(kwargs["path"])
        item = {k: v for k, v in item.items() if v is not None}
        built = R.build_term(
            {**item, "kwargs": kwargs},
            where=f"rewards.terms[{i}]",
            reward_model=scorer,
            base_dir=base_dir,
        )
        terms.append(built)
    return R.WeightedSum(terms, on_error=config.rewards.on_error)


@functools.cache
def _cached_scorer(path: str):
    return reward_model_scorer(path)


__all__ = ["RunData", "build_data", "build_run_reward", "reward_model_scorer"]
