"""One reward per kind of sample: each sample scored by the reward its ``data_source`` names.

A data set that mixes tasks (GSM8K and MATH, say) needs a different check per task: a GSM8K
answer is the number after ``####``, a MATH answer a LaTeX expression. verl scores such data
with ``default_compute_score``, which dispatches on each sample's ``data_source``; summing a
``gsm8k`` and a ``math_verify`` term instead would score every sample by both (a MATH answer
that is not a number is even a data error of the ``gsm8k`` term). :class:`Routed` does what
verl does, with the routes the config gives::

    rewards:
      - type: route
        by: data_source                      # the column that names each sample's task
        routes:
          openai/gsm8k: gsm8k
          lighteval/MATH: {type: math_verify}
        default: null                        # a sample of any other source is an error

Each route's reward scores its samples in one call (the samples of a batch are grouped by
value, in order). What the routed rewards report (:class:`~jaxrl_llm.rewards.Scores`) is kept,
a scalar ``m`` of route ``v`` as ``v/m``; each route's mean score is reported as ``v/mean``,
so the metrics show ``reward/<name>/<value>/mean`` per task.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxrl_llm.rewards._validate import check_field_name
from jaxrl_llm.rewards.base import (
    RewardFn,
    Scores,
    _as_values,
    _called,
    is_async_reward,
)
from jaxrl_llm.rewards.combine import numeric_values


def _answer_values(fn: Any) -> tuple[float, float] | None:
    if hasattr(fn, "correct") and hasattr(fn, "incorrect"):
        return (float(fn.correct), float(fn.incorrect))
    return None


@dataclasses.dataclass(frozen=True)
class Routed:
    """Scores each sample with ``routes[str(fields[by][i])]`` (``default`` for a value no route
    names; without one such a sample is an error naming the value and the routes).

    When every route (and ``default``) is an answer reward with the same ``correct`` /
    ``incorrect`` values, the routed reward is one too: it can be the run's accuracy term.
    """

    routes: Mapping[str, RewardFn]
    by: str = "data_source"
    default: RewardFn | None = None

    def __post_init__(self):
        check_field_name("by", self.by)
        if not isinstance(self.routes, Mapping) or not self.routes:
            raise TypeError("`routes` must be a non-empty mapping of field values to rewards")
        for reward in self._rewards:
            if not callable(reward):
                raise TypeError(f"a route's reward must be callable, got {reward!r}")
        answers = {_answer_values(r) for r in self._rewards}
        if len(answers) == 1 and None not in answers:
            correct, incorrect = answers.pop()
            object.__setattr__(self, "correct", correct)
            object.__setattr__(self, "incorrect", incorrect)

    @property
    def _rewards(self) -> tuple[RewardFn, ...]:
        """Every route's reward, then ``default`` when there is one."""
        return (*self.routes.values(), *(() if self.default is None else (self.default,)))

    @property
    def is_async(self) -> bool:
        return any(map(is_async_reward, self._rewards))

    @property
    def required_fields(self) -> tuple[str, ...]:
        needed = [self.by]
        for reward in self._rewards:
            needed += [f for f in getattr(reward, "required_fields", ()) if f not in needed]
        return tuple(needed)

    def __call__(self, prompts: list[str], completions: list[str], **fields: Any) -> Scores:
        n = len(completions)
        groups: dict[str, list[int]] = {}
        for i, value in enumerate(fields[self.by]):
            groups.setdefault(str(value), []).append(i)
        scores: list[Any] = [0.0] * n
        soft: list[int] = []
        columns: dict[str, list[Any]] = {}
        metrics: dict[str, float] = {}
        for value, rows in groups.items():
            reward = self.routes.get(value, self.default)
            if reward is None:
                raise ValueError(
                    f"no reward for {self.by} = {value!r} (sample {rows[0]}); the routes are "
                    f"{', '.join(map(repr, self.routes))}: add one, or set `default`"
                )
            raw = _called(
                reward,
                ([prompts[i] for i in rows], [completions[i] for i in rows]),
                {k: [column[i] for i in rows] for k, column in fields.items()},
            )
            values = _as_values(raw)
            if values is None or len(values) != len(rows):
                got = "no list" if values is None else f"{len(values)} scores"
                raise ValueError(
                    f"the reward for {self.by} = {value!r} returned {got} for {len(rows)} samples"
                )
            for i, score in zip(rows, values, strict=True):
                scores[i] = score
            soft += [rows[j] for j in getattr(raw, "soft_errors", ())]
            for column, got in getattr(raw, "extras", {}).items():
                if len(got) != len(rows):
                    raise ValueError(
                        f"the reward for {self.by} = {value!r} reported the column {column!r} "
                        f"with {len(got)} values for {len(rows)} samples"
                    )
                cells = columns.setdefault(column, [None] * n)
                for i, cell in zip(rows, got, strict=True):
                    cells[i] = cell
            for name, scalar in getattr(raw, "metrics", {}).items():
                metrics[f"{value}/{name}"] = scalar
            found = numeric_values(values)  # None or non-finite: the outer check reports it
            if found is not None and len(found) == len(values) and all(map(math.isfinite, found)):
                metrics[f"{value}/mean"] = float(np.mean(found))
        return Scores(scores, soft_errors=soft, extras=columns, metrics=metrics)
