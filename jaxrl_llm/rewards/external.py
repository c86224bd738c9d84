"""Rewards that come from outside the package: user functions and reward models.

A user reward is named in the config as ``"module:function"`` (an importable module, e.g.
``"my_pkg.rewards:exact_match"``) or ``"path/to/file.py:function"`` (a file, relative paths
resolved against ``base_dir``, by default the working directory). Nothing is imported except what
the user's config names.

:class:`RewardModelReward` adapts any scorer ``score(prompts, completions) -> list[float]`` (the
Flax scalar reward head, a remote judge, ...) to the reward protocol, :class:`VerlScore` a
verl ``compute_score(data_source, solution_str, ground_truth, extra_info)`` function, and
:class:`TrlReward` a TRL ``GRPOTrainer`` reward function.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_llm.rewards._validate import check_field_name, check_int
from jaxrl_llm.rewards.base import (
    COMPLETION_IDS_FIELD,
    NUM_TOKENS_FIELD,
    RAW_PROMPT_FIELD,
    TRAINER_STATE_FIELD,
    RewardConfigError,
    Scores,
    is_async_reward,
    run_awaitable,
)


def _import_file(path: Path, spec: str) -> Any:
    if not path.is_file():
        raise RewardConfigError(f"reward function {spec!r}: file {str(path)!r} does not exist")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"_jaxrl_llm_user_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise RewardConfigError(f"reward function {spec!r}: cannot import {str(path)!r}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # so dataclasses/pickling inside the file work
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _import_module(name: str, spec: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise RewardConfigError(
                f"reward function {spec!r}: no module named {exc.name!r} (install it or add its "
                f"folder to PYTHONPATH; for a file write 'path/to/file.py:function')"
            ) from exc
        raise


def load_callable(spec: str, *, base_dir: str | Path | None = None) -> Callable[..., Any]:
    """Imports ``"module:function"`` or ``"path/to/file.py:function"`` and returns the callable.

    ``function`` may be dotted (``"mod:Class.method"``). Raises :class:`RewardConfigError` naming
    the spec when the module, file or attribute is missing or the attribute is not callable
    (with the nearest existing names as a suggestion).
    """
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise RewardConfigError(
            f"reward function must be 'module:function' or 'path/to/file.py:function', got {spec!r}"
        )
    target, attr_path = spec.rsplit(":", 1)
    if not target or not attr_path:
        raise RewardConfigError(f"reward function {spec!r}: both module and function are needed")
    try:
        if target.endswith(".py") or "/" in target or "\\" in target:
            path = Path(target).expanduser()
            if not path.is_absolute():
                path = Path(base_dir or Path.cwd()) / path
            obj = _import_file(path.resolve(), spec)
        else:
            obj = _import_module(target, spec)
    except RewardConfigError:
        raise
    except Exception as exc:
        raise RewardConfigError(
            f"reward function {spec!r}: importing {target!r} failed with "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise RewardConfigError(f"reward function {spec!r}: {target!r} has no {part!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardConfigError(
            f"reward function {spec!r} is a {type(obj).__name__}, not a callable"
        )
    return obj


@dataclasses.dataclass(frozen=True)
class RewardModelReward:
    """A reward model as a reward: ``score(prompts, completions)`` in chunks of ``batch_size``.

    ``score`` returns one scalar per pair (a list, a NumPy/JAX array of shape ``[n]`` or
    ``[n, 1]``). Dataset fields are ignored. ``batch_size=None`` scores everything in one call.
    """

    score: Callable[[list[str], list[str]], Sequence[float]]
    batch_size: int | None = None

    def __post_init__(self):
        if not callable(self.score):
            raise TypeError(f"`score` must be callable, got {type(self.score).__name__}")
        if self.batch_size is not None:
            check_int("batch_size", self.batch_size, minimum=1)

    def __call__(self, prompts: list[str], completions: list[str], **fields: Any) -> list[float]:
        step = self.batch_size or max(len(completions), 1)
        out: list[float] = []
        for start in range(0, len(completions), step):
            chunk = self.score(prompts[start : start + step], completions[start : start + step])
            out.extend(np.asarray(chunk, dtype=np.float64).reshape(-1).tolist())
        return out


@dataclasses.dataclass(frozen=True)
class VerlScore:
    """A verl reward function as a reward, unchanged: verl's ``custom_reward_function``
    (``verl.workers.reward_manager.NaiveRewardManager``) calls, per sample,
    ``compute_score(data_source=, solution_str=, ground_truth=, extra_info=)`` and takes a number,
    or a dict whose ``"score"`` is the reward. A dict's other keys are verl's
    ``reward_extra_info``: they are reported as columns (:class:`~jaxrl_llm.rewards.Scores`;
    ``None`` for a sample whose dict lacks the key), so they appear beside each logged
    completion, and the mean of a numeric one in the metrics (``reward/<name>/<key>/mean``).

    The arguments come from the columns of a verl data file: ``data_source`` (``None`` when the
    data has no such column), ``reward_model.ground_truth`` (a struct column's key; see
    ``jaxrl_llm.data``) and ``extra_info`` (a copy of the row's mapping, ``{}`` when absent);
    ``solution_str`` is the completion's text. ``reward_kwargs`` are passed too, as verl's
    ``custom_reward_function.reward_kwargs`` are. An ``async def`` function (verl's reward loop
    awaits one) is awaited for every sample of the batch at once, in one event loop.
    """

    compute_score: Callable[..., Any]
    data_source_field: str = "data_source"
    ground_truth_field: str = "reward_model.ground_truth"
    extra_info_field: str = "extra_info"
    reward_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not callable(self.compute_score):
            raise TypeError(f"`function` must be callable, got {type(self.compute_score).__name__}")
        for name in ("data_source_field", "ground_truth_field", "extra_info_field"):
            check_field_name(name, getattr(self, name))
        if not isinstance(self.reward_kwargs, Mapping):
            raise TypeError(
                f"`reward_kwargs` must be a mapping, got {type(self.reward_kwargs).__name__}"
            )

    @property
    def required_fields(self) -> tuple[str, ...]:
        return (self.ground_truth_field,)

    @property
    def is_async(self) -> bool:
        return is_async_reward(self.compute_score)

    def __call__(self, prompts: list[str], completions: list[str], **fields: Any) -> list[float]:
        n = len(completions)
        sources = fields.get(self.data_source_field, [None] * n)
        infos = fields.get(self.extra_info_field, [None] * n)
        results = [
            self.compute_score(
                data_source=source,
                solution_str=completion,
                ground_truth=truth,
                extra_info=dict(info or {}),
                **self.reward_kwargs,
            )
            for completion, source, truth, info in zip(
                completions, sources, fields[self.ground_truth_field], infos, strict=True
            )
        ]
        waiting = [i for i, r in enumerate(results) if inspect.isawaitable(r)]
        if waiting:

            async def every() -> list[Any]:
                return await asyncio.gather(*(results[i] for i in waiting))

            for i, result in zip(waiting, run_awaitable(every()), strict=True):
                results[i] = result
        out = []
        columns: dict[str, list[Any]] = {}
        for i, score in enumerate(results):
            if isinstance(score, dict):
                if "score" not in score:
                    raise TypeError(
                        f"returned a dict without 'score' (keys: {', '.join(map(str, score))}); "
                        "verl reads the reward from its 'score'"
                    )
                for key, value in score.items():
                    if key != "score":
                        columns.setdefault(str(key), [None] * n)[i] = value
                score = score["score"]
            out.append(score)
        return Scores(out, extras=columns)


@dataclasses.dataclass(frozen=True)
class TrlReward:
    """A TRL ``GRPOTrainer`` reward function as a reward, unchanged: called once per batch as
    TRL calls it (``trl.GRPOTrainer._calculate_rewards``), ``fn(prompts=, completions=,
    completion_ids=, trainer_state=, **columns)``:

    - ``prompts``: each prompt as the data gives it (``raw_prompt``): text, or for a
      conversational dataset its list of ``{role, content}`` messages;
    - ``completions``: the completion texts, or for a conversational dataset
      ``[{"role": "assistant", "content": text}]`` each;
    - ``completion_ids``: the generated token ids of each completion;
    - ``trainer_state``: the run's :class:`~jaxrl_llm.rewards.TrainerState` (``global_step``,
      ``max_steps``, as on ``transformers.TrainerState``), ``None`` when the caller gives none;
    - ``log_extra(column, values)``: one value per completion, shown beside each logged
      completion (TRL's completions table; a second call for the same column replaces it);
    - ``log_metric(name, value)``: a scalar, in the metrics as ``reward/<term>/<name>`` (the
      mean of the batch's calls);
    - the dataset's other columns, one value per completion.

    An ``async def`` function is awaited (in a fresh event loop; in a thread of its own when
    the caller's thread already runs one, as in a notebook). A ``None`` score (TRL: "this
    function does not apply to the sample") counts as 0, which is what TRL's ``nansum`` over
    the reward functions makes of it.
    """

    fn: Callable[..., Any]

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"`function` must be callable, got {type(self.fn).__name__}")

    @property
    def is_async(self) -> bool:
        return is_async_reward(self.fn)

    def __call__(self, prompts: list[str], completions: list[Any], **fields: Any) -> list[float]:
        raw = fields.pop(RAW_PROMPT_FIELD, None)
        ids = fields.pop(COMPLETION_IDS_FIELD, None)
        fields.pop(NUM_TOKENS_FIELD, None)  # ours, not TRL's
        states = fields.pop(TRAINER_STATE_FIELD, None)
        n = len(completions)
        if raw is not None and any(isinstance(p, list | tuple) for p in raw):
            completions = [[{"role": "assistant", "content": c}] for c in completions]
        columns: dict[str, list[Any]] = {}
        logged: dict[str, list[Any]] = {}

        def log_extra(column: str, values: Sequence[Any]) -> None:
            values = list(values)
            if len(values) != n:
                raise ValueError(
                    f"log_extra({column!r}, ...) got {len(values)} values for {n} completions; "
                    "it takes one value per completion"
                )
            columns[str(column)] = values

        def log_metric(name: str, value: float) -> None:
            logged.setdefault(str(name), []).append(value)

        out = self.fn(
            prompts=prompts if raw is None else list(raw),
            completions=completions,
            completion_ids=ids,
            trainer_state=states[0] if states else None,
            log_extra=log_extra,
            log_metric=log_metric,
            **fields,
        )
        if inspect.isawaitable(out):
            out = run_awaitable(out)
        if out is None:
            raise TypeError("returned None; a TRL reward function returns one score per sample")
        metrics = {}
        for name, values in logged.items():
            try:
                metrics[name] = float(np.mean(np.asarray(values, np.float64)))
            except (TypeError, ValueError):
                raise TypeError(
                    f"log_metric({name!r}, ...) got {values[0]!r}; it takes a number"
                ) from None
        return Scores([0.0 if v is None else v for v in out], extras=columns, metrics=metrics)
