"""A weighted sum of named rewards, with every component and error count kept for the metrics.

    total_i = Σ_k w_k · r_k(prompt_i, completion_i, fields_i)

Each component ``r_k`` goes through :func:`checked_scores`, so a failing reward either raises a
:class:`RewardError` or (``on_error="zero"``) scores the failing samples 0 and counts them.
:func:`score_groups` is the trainer's entry point: ``B`` prompts × ``G`` completions in, the
``f32[B, G]`` reward of :class:`jaxrl_llm.Rollout` out.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np

from jaxrl_llm.rewards._validate import check_real
from jaxrl_llm.rewards.base import (
    COMPLETION_IDS_FIELD,
    NUM_TOKENS_FIELD,
    ON_ERROR_MODES,
    TRAINER_STATE_FIELD,
    Checked,
    OnError,
    RewardError,
    RewardFn,
    TrainerState,
    _as_float,
    check_inputs,
    checked_scores,
    is_async_reward,
    run_concurrently,
)

_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+")
_RESERVED_NAMES = ("mean", "std", "min", "max")


@dataclasses.dataclass(frozen=True)
class RewardTerm:
    """One named, weighted component of a reward (``name`` is its metrics key)."""

    name: str
    fn: RewardFn
    weight: float = 1.0

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise ValueError(
                f"reward name must be letters, digits, '_', '.' or '-', got {self.name!r}"
            )
        if self.name in _RESERVED_NAMES:
            raise ValueError(
                f"reward name {self.name!r} is reserved for the metrics; pick another `name`"
            )
        if not callable(self.fn):
            raise TypeError(f"reward {self.name!r}: fn must be callable, got {self.fn!r}")
        check_real("weight", self.weight)


class RewardOutput(NamedTuple):
    """What a :class:`WeightedSum` returns for ``N`` samples.

    Attributes:
      total_n: ``f32[N]`` the weighted sum.
      components: ``{name: f32[N]}`` each reward's *unweighted* scores (0 where it failed).
      num_errors: ``{name: int}`` samples each reward scored 0 because of an error.
      correct_n: ``bool[N]`` the accuracy term's verdict (its score equals its ``correct``
        value, 1.0 when it has none), or ``None`` when there is no accuracy term.
      extras: ``{name: {column: N values}}`` the columns each reward reported beside its
        scores (:class:`~jaxrl_llm.rewards.Scores`; verl's extra info, TRL's ``log_extra``).
      reported: ``{name: {metric: float}}`` the scalars each reward reported (TRL's
        ``log_metric``).
    """

    total_n: np.ndarray
    components: dict[str, np.ndarray]
    num_errors: dict[str, int]
    correct_n: np.ndarray | None
    extras: Mapping[str, Mapping[str, list[Any]]] = MappingProxyType({})
    reported: Mapping[str, Mapping[str, float]] = MappingProxyType({})

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        """``{prefix}/mean``, ``{prefix}/std``, ``{prefix}/<name>/mean``,
        ``{prefix}/<name>/num_errors``, ``accuracy`` (when there is an accuracy term), and what
        the rewards reported: ``{prefix}/<name>/<metric>`` for each scalar and
        ``{prefix}/<name>/<column>/mean`` for each column of numbers (``None`` skipped)."""
        out: dict[str, float] = {}
        if self.total_n.size:
            out[f"{prefix}/mean"] = float(np.mean(self.total_n))
            out[f"{prefix}/std"] = float(np.std(self.total_n))
        for name, scores in self.components.items():
            if scores.size:
                out[f"{prefix}/{name}/mean"] = float(np.mean(scores))
            out[f"{prefix}/{name}/num_errors"] = float(self.num_errors[name])
        for name, columns in self.extras.items():
            for column, values in columns.items():
                found = numeric_values(values)
                if found:
                    out[f"{prefix}/{name}/{column}/mean"] = float(np.mean(found))
        for name, scalars in self.reported.items():
            for metric, value in scalars.items():
                out[f"{prefix}/{name}/{metric}"] = float(value)
        if self.correct_n is not None and self.correct_n.size:
            out["accuracy"] = float(np.mean(self.correct_n))
        return out

    def sample_details(self) -> list[dict[str, Any]]:
        """Per sample, ``{"rewards": {name: score}}`` (each term's unweighted score) and, when
        the rewards reported columns, ``"extra": {column: value}`` (a column that several
        terms report is named ``<name>/<column>``): what a logged completion shows beside its
        total reward."""
        n = len(self.total_n)
        counts: dict[str, int] = {}
        for columns in self.extras.values():
            for column in columns:
                counts[column] = counts.get(column, 0) + 1
        out = []
        for i in range(n):
            details: dict[str, Any] = {
                "rewards": {name: float(s[i]) for name, s in self.components.items()}
            }
            extra = {
                (column if counts[column] == 1 else f"{name}/{column}"): values[i]
                for name, columns in self.extras.items()
                for column, values in columns.items()
            }
            if extra:
                details["extra"] = extra
            out.append(details)
        return out


def numeric_values(values: Sequence[Any]) -> list[float] | None:
    """The values as floats when each is a real number, a boolean or ``None`` (skipped)."""
    out = []
    for v in values:
        if v is None:
            continue
        number = _as_float(v)
        if number is None:
            return None
        out.append(number)
    return out


def _is_answer_reward(fn: Any) -> bool:
    return hasattr(fn, "correct") and hasattr(fn, "incorrect")


class WeightedSum:
    """A weighted sum of named rewards.

    Args:
      terms: the components, names unique.
      on_error: ``"raise"`` (default) or ``"zero"``, for every component (see
        :func:`checked_call`).
      accuracy: name of the term whose verdict is the ``accuracy`` metric. Default: the first
        answer reward (integer/gsm8k/boxed); ``None`` when there is none.
      timeout: seconds each term may take to score one batch (see :func:`checked_call`);
        ``None`` waits forever and calls the terms in the calling thread.

    Two or more ``async def`` terms (or ``trl`` / ``verl`` functions / routes that are) score
    each batch at the same time, each in a thread of its own, as TRL gathers its async reward
    functions; the first error, in term order, is raised after all have returned.
    """

    def __init__(
        self,
        terms: Sequence[RewardTerm],
        *,
        on_error: OnError = "raise",
        accuracy: str | None = None,
        timeout: float | None = None,
    ):
        terms = tuple(terms)
        if not terms:
            raise ValueError("a reward needs at least one term")
        names = [t.name for t in terms]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"reward names must be unique, got {duplicates} more than once")
        if on_error not in ON_ERROR_MODES:
            raise ValueError(f"on_error must be one of {ON_ERROR_MODES}, got {on_error!r}")
        if accuracy is None:
            accuracy = next((t.name for t in terms if _is_answer_reward(t.fn)), None)
        elif accuracy not in names:
            raise ValueError(f"accuracy term {accuracy!r} is not one of the rewards {names}")
        if timeout is not None:
            check_real("timeout", timeout)
            if not timeout > 0:
                raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
        self.terms = terms
        self.on_error = on_error
        self.accuracy = accuracy
        self.timeout = timeout

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.terms)

    def __repr__(self) -> str:
        inner = ", ".join(f"{t.weight:g}·{t.name}" for t in self.terms)
        return f"WeightedSum({inner}, on_error={self.on_error!r})"

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], **fields: Sequence[Any]
    ) -> RewardOutput:
        n = check_inputs(prompts, completions, fields)
        total = np.zeros((n,), np.float64)
        components: dict[str, np.ndarray] = {}
        num_errors: dict[str, int] = {}
        correct_n = None
        extras: dict[str, dict[str, list[Any]]] = {}
        reported: dict[str, dict[str, float]] = {}

        def score(term: RewardTerm) -> Checked:
            return checked_scores(
                term.fn,
                prompts,
                completions,
                fields,
                name=term.name,
                on_error=self.on_error,
                timeout=self.timeout,
            )

        # Async terms (e.g. judge models behind a server) score the batch at the same time, as
        # TRL gathers its async reward functions; the others run one after another here.
        waiting = [t for t in self.terms if is_async_reward(t.fn)]
        gathered = {}
        if len(waiting) > 1:
            calls = [functools.partial(score, t) for t in waiting]
            gathered = dict(zip((t.name for t in waiting), run_concurrently(calls), strict=True))
        for term in self.terms:
            checked = gathered[term.name] if term.name in gathered else score(term)
            if isinstance(checked, BaseException):
                raise checked
            scores, errors, columns, scalars = checked
            clash = sorted(set(scalars) & {"mean", "num_errors"})
            if clash:
                raise RewardError(
                    f"reward {term.name!r} reported a metric named {clash[0]!r}, which names "
                    f"the term's own reward/{term.name}/{clash[0]}; pick another name",
                    reward=term.name,
                )
            components[term.name] = scores
            num_errors[term.name] = errors
            if columns:
                extras[term.name] = columns
            if scalars:
                reported[term.name] = scalars
            total += term.weight * scores.astype(np.float64)
            if term.name == self.accuracy:
                correct_value = getattr(term.fn, "correct", 1.0)
                correct_n = np.isclose(scores, np.float32(correct_value))
        return RewardOutput(
            total.astype(np.float32), components, num_errors, correct_n, extras, reported
        )


class CompletionIds(Sequence):
    """The generated token ids of ``N`` completions, one ``list[int]`` per item, read from the
    ``[N, T]`` token and mask arrays when an item is asked for: a batch of long completions
    becomes Python lists only for a reward that reads ``completion_ids``."""

    def __init__(self, tokens_nt: np.ndarray, mask_nt: np.ndarray):
        self._tokens, self._mask = tokens_nt, mask_nt

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, i: int | slice) -> list[int] | CompletionIds:
        if isinstance(i, slice):
            return CompletionIds(self._tokens[i], self._mask[i])
        return self._tokens[i][self._mask[i]].tolist()

    def __repr__(self) -> str:
        return f"CompletionIds({len(self)} completions)"


def score_groups(
    reward: WeightedSum,
    prompts_b: Sequence[str],
    completions_bg: Sequence[Sequence[str]],
    fields_b: Mapping[str, Sequence[Any]] | None = None,
    *,
    num_tokens_bg: Any = None,
    tokens_bgt: np.ndarray | None = None,
    mask_bgt: np.ndarray | None = None,
    trainer_state: TrainerState | None = None,
) -> tuple[np.ndarray, RewardOutput]:
    """Scores ``G`` completions of each of ``B`` prompts.

    Args:
      reward: the trainer's reward.
      prompts_b: ``B`` prompts (as given to rewards: the user prompt text).
      completions_bg: ``B`` lists of ``G`` decoded completions.
      fields_b: per-prompt dataset columns (each of length ``B``), repeated for the ``G``
        completions of a prompt.
      num_tokens_bg: ``int[B, G]`` generated token counts, passed as ``completion_num_tokens``
        (default with ``tokens_bgt``: ``mask_bgt``'s row sums).
      tokens_bgt, mask_bgt: ``int[B, G, T]`` / ``bool[B, G, T]`` generated tokens and their
        mask, passed as ``completion_ids`` (:class:`CompletionIds`: each sample's ids are made
        a list only when a reward reads them).
      trainer_state: the run's progress, passed as the ``trainer_state`` field (the same
        :class:`~jaxrl_llm.rewards.TrainerState` for every sample).

    Returns:
      ``(reward_bg, output)``: ``f32[B, G]`` total rewards and the flat :class:`RewardOutput`
      (sample ``b * G + g``).
    """
    b = len(prompts_b)
    if len(completions_bg) != b:
        raise ValueError(f"score_groups: {len(completions_bg)} completion groups for {b} prompts")
    group_sizes = {len(group) for group in completions_bg}
    if len(group_sizes) > 1:
        raise ValueError(f"score_groups: groups must have one size G, got sizes {group_sizes}")
    g = group_sizes.pop() if group_sizes else 0
    fields: dict[str, list[Any]] = {}
    for key, column in (fields_b or {}).items():
        if len(column) != b:
            raise ValueError(
                f"score_groups: field {key!r} has {len(column)} values for {b} prompts"
            )
        fields[key] = [value for value in column for _ in range(g)]
    if tokens_bgt is not None:
        tokens_bgt, mask_bgt = np.asarray(tokens_bgt), np.asarray(mask_bgt, bool)
        if (
            tokens_bgt.ndim != 3
            or tokens_bgt.shape[:2] != (b, g)
            or mask_bgt.shape != tokens_bgt.shape
        ):
            raise ValueError(
                f"score_groups: tokens_bgt {tokens_bgt.shape} and mask_bgt {mask_bgt.shape} must "
                f"be [B, G, T] with (B, G) = {(b, g)}"
            )
        t = tokens_bgt.shape[-1]
        fields[COMPLETION_IDS_FIELD] = CompletionIds(
            tokens_bgt.reshape(b * g, t), mask_bgt.reshape(b * g, t)
        )
        if num_tokens_bg is None:
            num_tokens_bg = mask_bgt.sum(-1)
    if num_tokens_bg is not None:
        num_tokens_bg = np.asarray(num_tokens_bg)
        if num_tokens_bg.shape != (b, g):
            raise ValueError(
                f"score_groups: num_tokens_bg has shape {num_tokens_bg.shape}, expected {(b, g)}"
            )
        fields[NUM_TOKENS_FIELD] = num_tokens_bg.reshape(-1).tolist()
    if trainer_state is not None:
        if not isinstance(trainer_state, TrainerState):
            raise TypeError(
                f"score_groups: trainer_state must be a TrainerState, got "
                f"{type(trainer_state).__name__}"
            )
        fields[TRAINER_STATE_FIELD] = [trainer_state] * (b * g)
    prompts = [p for p in prompts_b for _ in range(g)]
    completions = [c for group in completions_bg for c in group]
    output = reward(prompts, completions, **fields)
    return output.total_n.reshape(b, g), output
