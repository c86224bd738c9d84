"""The run's data and reward: datasets, held-out split, the weighted reward.

The functions take plain values (a :class:`DataSpec`, reward terms as mappings);
:mod:`jaxrl_llm.train.setup` builds them from the config's ``data``, ``preference`` and
``rewards`` sections.

* ``source = "arithmetic"``: :func:`jaxrl_llm.data.arithmetic_task` with ``seed``; its
  ``eval_size`` held-out problems are disjoint from the training ones. Offline (``dpo``) each
  problem becomes a pair (chosen: the correct answer; rejected: a wrong number), by
  :func:`jaxrl_llm.data.arithmetic_preference_pairs` (seeded with ``seed``, ``+ 1`` for the
  held-out pairs).
* ``source = "file"``: JSONL/Parquet/CSV read with ``datasets``; the evaluation split is
  ``eval_path``, or ``eval_size`` rows held out of the training file by a permutation seeded
  with ``seed``.

Prompts longer than ``max_prompt_length`` are dropped and counted (the loop logs it).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import data as D
from jaxrl_llm import rewards as R

if TYPE_CHECKING:
    from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class ArithmeticSpec:
    """The built-in arithmetic task: ``train_size`` distinct problems ``a ∘ b`` with operands in
    ``[min_operand, max_operand]`` and ``∘`` drawn from ``operations``."""

    train_size: int = 4000
    operations: tuple[str, ...] = ("+", "-")
    min_operand: int = 0
    max_operand: int = 99


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """Where a run's prompts (and answers, or preference pairs) come from and how they are read.

    Attributes:
      source: ``"arithmetic"`` (generated from ``seed`` with ``arithmetic``) or ``"file"``.
      path, format: the training file and its format (``"jsonl"``, ``"parquet"``, ``"csv"``;
        None: from the extension).
      eval_path, eval_format: the evaluation file and its format; no ``eval_path`` holds out
        ``eval_size`` rows of the training file instead.
      eval_size: evaluation prompts (0: no evaluation).
      seed: the split's and the arithmetic task's seed.
      arithmetic: the built-in task's settings (``source = "arithmetic"``).
      prompt_field, answer_field, chosen_field, rejected_field: the columns read.
      system_prompt: a system message before each prompt (None: the template's default).
      chat_template: format prompts with the tokenizer's chat template.
      max_prompt_length: longer prompts (in tokens, after templating) are dropped and counted.
    """

    source: str = "arithmetic"
    path: str | None = None
    format: str | None = None
    eval_path: str | None = None
    eval_format: str | None = None
    eval_size: int = 200
    seed: int = 0
    arithmetic: ArithmeticSpec = dataclasses.field(default_factory=ArithmeticSpec)
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    system_prompt: str | None = None
    chat_template: bool = True
    max_prompt_length: int = 256


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


def _columns_of_file(path: str, format: str | None) -> dict[str, list[Any]]:
    table = D.load_table(path, format=format)
    return D.to_columns(table, source=path)


def _take(columns: dict[str, list[Any]], rows: np.ndarray) -> dict[str, list[Any]]:
    return {k: [v[i] for i in rows] for k, v in columns.items()}


def _split_columns(d: DataSpec) -> tuple[dict, dict | None, str]:
    """(train columns, eval columns or None, source name)."""
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
    train = _columns_of_file(d.path, d.format)
    if d.eval_path:
        return (
            train,
            _columns_of_file(d.eval_path, d.eval_format) if d.eval_size else None,
            d.path,
        )
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


def build_data(
    spec: DataSpec,
    tokenizer: Any,
    *,
    offline: bool = False,
    max_response_length: int = 512,
) -> RunData:
    """The training and held-out datasets of ``spec`` (see the module docstring).

    Args:
      spec: the data settings.
      tokenizer: the policy's tokenizer.
      offline: preference pairs (dpo) rather than prompts.
      max_response_length: offline: the longest chosen/rejected answer, in tokens.
    """
    d = spec
    train_cols, eval_cols, source = _split_columns(d)
    prompt_kwargs = dict(
        prompt_field=d.prompt_field if d.source == "file" else "prompt",
        system_prompt=d.system_prompt,
        max_prompt_length=d.max_prompt_length,
        chat_template=d.chat_template,
    )
    notes = []
    if offline:
        pref_kwargs = dict(
            prompt_field=d.prompt_field,
            chosen_field=d.chosen_field,
            rejected_field=d.rejected_field,
            system_prompt=d.system_prompt,
            max_prompt_length=d.max_prompt_length,
            max_completion_length=max_response_length,
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
            if d.answer_field in eval_cols and not pairs.implicit_prompt:
                prompts = D.PromptDataset.from_records(
                    eval_cols,
                    tokenizer,
                    fields=[d.answer_field],
                    source=f"{source} (eval)",
                    **{**prompt_kwargs, "prompt_field": d.prompt_field},
                )
        if train.implicit_prompt:
            notes.append(
                f"no {d.prompt_field!r} column: each pair's prompt is the common start of its "
                f"{d.chosen_field!r} and {d.rejected_field!r} (TRL's implicit prompt)"
            )
        notes += _notes(train, "training pairs") + (_notes(pairs, "eval pairs") if pairs else [])
        if train.num_truncated:
            notes.append(
                f"{train.num_truncated} training pairs have an answer cut to "
                f"{max_response_length} tokens"
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


def reward_model_scorer(
    path: str, *, batch_pad: int = 32
) -> Callable[[list[str], list[str]], np.ndarray]:
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
    def forward(params: nnx.State, ids: jax.Array, mask: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, params)(ids, mask)

    def score(prompts: list[str], completions: list[str]) -> np.ndarray:
        seqs = []
        for prompt, completion in zip(prompts, completions, strict=True):
            if getattr(tokenizer, "chat_template", None):
                try:
                    with D.tokens.bounded_templates():
                        text = tokenizer.apply_chat_template(
                            [
                                {"role": "user", "content": prompt},
                                {"role": "assistant", "content": completion},
                            ],
                            tokenize=False,
                        )
                except D.tokens.ChatTemplateTimeout:
                    raise D.DataError(
                        f"reward model {path!r}: its tokenizer's chat template ran for more "
                        f"than {D.tokens.CHAT_TEMPLATE_TIMEOUT:g} s on one conversation"
                    ) from None
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                ids = tokenizer(prompt + completion)["input_ids"]
            seqs.append(np.asarray(ids, np.int32))
        width = D.bucket_length(max(len(s) for s in seqs), batch_pad)
        ids, mask = D.left_pad(seqs, width, D.tokens.pad_token_id(tokenizer))
        return np.asarray(forward(params, jnp.asarray(ids), jnp.asarray(mask)), np.float32)

    return score


def build_run_reward(
    terms: Sequence[Mapping[str, Any]],
    *,
    on_error: str = "raise",
    answer_field: str = "answer",
    base_dir: str | Path | None = None,
    timeout: float | None = None,
) -> R.WeightedSum:
    """The weighted sum of reward ``terms``.

    Args:
      terms: one plain mapping per term: ``type`` (a built-in reward type or
        ``"module:function"``), ``weight``, ``name`` (None: the type) and ``kwargs``; errors
        name the term ``rewards.terms[i]``.
      on_error: ``"raise"``, or ``"zero"`` (a failing term scores 0 and is counted).
      answer_field: the field answer rewards read (unless their kwargs name one).
      base_dir: where relative paths of the terms are resolved.
      timeout: seconds each term may take per batch (``rewards.timeout``); ``None``: forever.
    """
    built = []
    for i, term in enumerate(terms):
        item = dict(term)
        kwargs = dict(item.pop("kwargs", None) or {})
        scorer = None
        if item["type"] == "reward_model" and "score" not in kwargs:
            scorer = _cached_scorer(kwargs["path"])
        item = {k: v for k, v in item.items() if v is not None}
        built.append(
            R.build_term(
                {**item, "kwargs": kwargs},
                where=f"rewards.terms[{i}]",
                reward_model=scorer,
                base_dir=base_dir,
                answer_field=answer_field,
            )
        )
    return R.WeightedSum(built, on_error=on_error, timeout=timeout)


def check_reward_fields(reward: R.WeightedSum, data: RunData) -> None:
    """Every field a reward term reads (``required_fields``: an answer reward's ``field``, which
    defaults to ``data.answer_field``) is a column of the prompts it scores, checked before any
    step runs rather than at the first reward call.

    Raises:
      DataError: naming the term, the field, the data and its fields.
    """
    scored = [data.train, data.eval_prompts]
    for ds in [d for d in scored if isinstance(d, D.PromptDataset)]:
        for term in reward.terms:
            needed = getattr(term.fn, "required_fields", ())
            missing = [f for f in needed if f != R.NUM_TOKENS_FIELD and f not in ds.fields]
            if missing:
                raise D.DataError(
                    f"{ds.source}: the reward {term.name!r} reads the field {missing[0]!r}, which "
                    f"these prompts do not have (fields: {', '.join(ds.fields) or 'none'}); set "
                    "data.answer_field to the column holding the reference answers (a key of a "
                    "struct column with a dot, e.g. reward_model.ground_truth), or the term's own "
                    "option (`field`; for verl, `ground_truth_field`; for route, `by`)"
                )


@functools.cache
def _cached_scorer(path: str):
    return reward_model_scorer(path)


__all__ = [
    "ArithmeticSpec",
    "DataSpec",
    "RunData",
    "build_data",
    "build_run_reward",
    "reward_model_scorer",
]
