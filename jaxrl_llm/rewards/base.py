"""The reward protocol and the checked call every reward goes through.

A reward is any callable

    fn(prompts: list[str], completions: list[str], **fields: list) -> Sequence[float]

scoring ``N`` samples at once on the host (an ``async def`` reward is awaited, each call in a
fresh event loop). ``fields`` are per-sample dataset columns (e.g.
``answer=["30", "12", ...]``), each a list of length ``N``; a reward takes the ones it needs and
ignores the rest (hence ``**fields`` in every signature). The trainer also passes
``completion_num_tokens`` (the number of tokens the policy generated for each completion).

:func:`checked_call` is the only way the trainer calls a reward. A reward that raises, returns
NaN/inf or a non-number, or returns the wrong number of scores is either

* ``on_error="raise"`` (default): a :class:`RewardError` naming the reward, the sample index and
  an excerpt of its prompt and completion. When a batched call raises, the samples are re-scored
  one at a time to find the first one that fails;
* ``on_error="zero"``: those samples score 0 and are counted (the count goes to the metrics).
  A batched call that raises or returns the wrong count falls back to one call per sample, so one
  bad sample costs only its own score.

A reward may also return :class:`Scores` (a list of floats) naming samples it scored despite a
*soft* error, e.g. an answer whose verification timed out and was scored ``incorrect``: those
scores are kept and the samples are counted in ``num_errors`` whatever ``on_error`` says (a
timeout is a property of the sampled completion, not a bug to stop training for).

A reward may declare ``required_fields`` (a tuple of field names); a missing one is a wiring
error and raises :class:`RewardError` whatever ``on_error`` says.

:class:`Scores` also carries what a reward reports beside its scores: ``extras``, per-sample
columns (verl's ``reward_extra_info``: the keys of a ``compute_score`` dict other than
``"score"``; TRL's ``log_extra`` columns), and ``metrics``, batch scalars (TRL's
``log_metric``). :func:`checked_scores` returns them with the scores; the trainer writes the
columns beside each logged completion and the means of the numeric ones, and the scalars, to
the metrics. A column with the wrong number of values, or a non-finite scalar, is a wiring
error (:class:`RewardError`, whatever ``on_error`` says). When a batch falls back to one call
per sample, each sample's columns come from its own call (missing values are ``None``) and a
scalar is the mean of the calls that logged it.

Two more failures are errors of the reward, never of the run: a reward that calls ``sys.exit``
(``SystemExit`` is caught and reported as :class:`RewardExited`, not left to end the process
with status 0 mid-run), and, with a ``timeout``, a reward that does not return in time. With a
``timeout`` (seconds for all of one term's calls on one batch together) each call runs in a
daemon worker thread and the caller waits at most what is left of it; a call that overruns
raises :class:`RewardError` (``on_error="raise"``) or scores the samples not yet scored 0 and
counts them (``"zero"``). Python cannot stop a thread, so an overrunning call is abandoned (it
runs on in the background, and ends with the process). A reward that must run in the calling
thread (e.g. one that sets ``signal`` handlers) needs ``timeout=None``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import math
import numbers
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np

OnError = Literal["raise", "zero"]
ON_ERROR_MODES: tuple[str, ...] = ("raise", "zero")

#: Field the trainer fills with each completion's generated token count.
NUM_TOKENS_FIELD = "completion_num_tokens"
#: Field the trainer fills with each completion's generated token ids (TRL's name).
COMPLETION_IDS_FIELD = "completion_ids"
#: Field the trainer fills with the run's progress, a :class:`TrainerState` (TRL's name).
TRAINER_STATE_FIELD = "trainer_state"
#: Field holding each prompt as the data gives it: text, or its ``{role, content}`` messages
#: (``jaxrl_llm.data.PromptDataset`` adds it; the ``prompts`` argument is its user text).
RAW_PROMPT_FIELD = "raw_prompt"

_EXCERPT_CHARS = 60


class RewardFn(Protocol):
    """``fn(prompts, completions, **fields) -> list[float]``, one score per completion."""

    def __call__(
        self, prompts: list[str], completions: list[str], **fields: list[Any]
    ) -> Sequence[float]: ...


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """The run's progress when a batch is scored, passed to every reward as the
    ``trainer_state`` field (the same object for each sample), and to a TRL reward function as
    its ``trainer_state`` argument, in place of ``transformers.TrainerState`` (the attributes a
    reward that shapes itself by training progress reads, e.g.
    ``trainer_state.global_step / trainer_state.max_steps``).

    Attributes:
      global_step: update steps done before the step that trains on this batch (0 for the
        first); in an async run too, so a batch's rewards do not depend on the staleness.
      max_steps: the run's ``train.max_steps``.
    """

    global_step: int
    max_steps: int


class Scores(list):
    """One score per completion, plus the indices of samples scored despite a soft error, and
    what the reward reports beside its scores.

    ``Scores([1.0, 0.0], soft_errors=[1])``: sample 1 was scored (its ``incorrect`` value) but
    could not be checked (e.g. a verification timeout); :func:`checked_call` counts it in
    ``num_errors`` and keeps its score, in both ``on_error`` modes.

    ``extras``: ``{column: one value per sample}`` (e.g. ``{"pred": ["12", None]}``), written
    beside each logged completion; a column of numbers (or booleans) also gives its mean to the
    metrics. ``metrics``: ``{name: float}`` for the whole batch (see the module docstring).
    """

    def __init__(
        self,
        scores: Sequence[float] = (),
        soft_errors: Sequence[int] = (),
        *,
        extras: Mapping[str, Sequence[Any]] | None = None,
        metrics: Mapping[str, float] | None = None,
    ):
        super().__init__(scores)
        self.soft_errors: tuple[int, ...] = tuple(sorted(set(soft_errors)))
        self.extras: dict[str, list[Any]] = {str(k): list(v) for k, v in (extras or {}).items()}
        self.metrics: dict[str, Any] = {str(k): v for k, v in (metrics or {}).items()}


class Checked(NamedTuple):
    """What :func:`checked_scores` returns for ``N`` samples.

    Attributes:
      scores_n: ``f32[N]`` finite scores.
      num_errors: samples scored 0 because of an error, plus the soft errors.
      extras: ``{column: N values}`` the reward reported (:class:`Scores`).
      metrics: ``{name: float}`` the reward reported for the batch.
    """

    scores_n: np.ndarray
    num_errors: int
    extras: dict[str, list[Any]]
    metrics: dict[str, float]


class RewardError(ValueError):
    """A reward failed on a sample (raised, non-finite, non-number, wrong count).

    Attributes:
      reward: the reward's name (as in the config and the metrics).
      index: index of the failing sample in the batch, or ``None`` for a batch-level failure.
    """

    def __init__(self, message: str, *, reward: str, index: int | None = None):
        super().__init__(message)
        self.reward = reward
        self.index = index

    def __reduce__(self):  # picklable across processes despite keyword-only arguments
        return _rebuild_reward_error, (str(self), self.reward, self.index)


def _rebuild_reward_error(message: str, reward: str, index: int | None) -> RewardError:
    return RewardError(message, reward=reward, index=index)


class RewardExited(Exception):
    """A reward called ``sys.exit`` (raised ``SystemExit``): reported as the reward's error
    instead of ending the run with the exit status it gave."""


class RewardTimeout(TimeoutError):
    """A reward did not return within its time limit (``rewards.timeout``)."""


def run_awaitable(awaitable: Any) -> Any:
    """The result of an awaitable (an ``async def`` reward's call), run to completion in a
    fresh event loop: in this thread, or in a new one when this thread already runs a loop
    (a notebook)."""

    async def main() -> Any:
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxrl-llm-reward") as pool:
        return pool.submit(asyncio.run, main()).result()


def is_async_reward(fn: Any) -> bool:
    """Whether calling ``fn`` gives an awaitable: an ``async def`` function (or ``__call__``,
    or a ``functools.partial`` of one), or an adapter whose ``is_async`` says its wrapped
    function is one (the ``trl`` and ``verl`` types, a ``route`` with an async route)."""
    flag = getattr(fn, "is_async", None)
    if isinstance(flag, bool):
        return flag
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(fn.__call__)


def run_concurrently(calls: Sequence[Callable[[], Any]]) -> list[Any]:
    """Each call's value, or the exception it raised, the calls run at once in daemon threads
    of their own (the async rewards of a sum: each waits on its own I/O, e.g. a judge model's
    server, as TRL's ``asyncio.gather`` of its async reward functions does). A daemon thread
    does not keep the process alive after Ctrl-C."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as e:  # relayed to the caller in order, SystemExit included
            results[i] = e

    threads = [
        threading.Thread(target=run, args=(i,), name="jaxrl-llm-reward", daemon=True)
        for i in range(len(calls))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def _called(fn: RewardFn, args: tuple, fields: Mapping[str, Any]) -> Any:
    """``fn(*args, **fields)``, awaited when ``fn`` is ``async``."""
    value = fn(*args, **fields)
    return run_awaitable(value) if inspect.isawaitable(value) else value


def _call(fn: RewardFn, args: tuple, fields: Mapping[str, Any], deadline: float | None) -> Any:
    """``fn(*args, **fields)`` (awaited for an ``async def`` reward): inline without a
    ``deadline`` (a ``time.monotonic()`` value), else in a daemon thread waited on until the
    deadline (:class:`RewardTimeout` past it). ``SystemExit`` becomes :class:`RewardExited`;
    KeyboardInterrupt passes through."""
    if deadline is None:
        try:
            return _called(fn, args, fields)
        except SystemExit as e:  # keeps the traceback: the CLI names the line that exited
            raise RewardExited(_exit_message(e)).with_traceback(e.__traceback__) from None
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = _called(fn, args, fields)
        except BaseException as e:  # relayed to the caller, SystemExit included
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="jaxrl-llm-reward", daemon=True).start()
    if not done.wait(max(0.0, deadline - time.monotonic())):
        raise RewardTimeout("did not return in time")
    if "error" in box:
        error = box["error"]
        if isinstance(error, SystemExit):
            raise RewardExited(_exit_message(error)).with_traceback(error.__traceback__) from None
        raise error
    return box["value"]


def _exit_message(e: SystemExit) -> str:
    return f"sys.exit({e.code!r}) was called; a reward must return its scores, not end the process"


class RewardConfigError(ValueError):
    """A reward could not be built from its config (unknown type or key, bad value, bad import)."""


def excerpt(text: Any, limit: int = _EXCERPT_CHARS) -> str:
    """``repr`` of the first ``limit`` characters of ``text`` (with an ellipsis when cut)."""
    text = str(text)
    if len(text) > limit:
        return repr(text[:limit]) + "…"
    return repr(text)


def _sample_text(prompts: Sequence[str], completions: Sequence[str], i: int) -> str:
    return f"sample {i} (prompt {excerpt(prompts[i])}, completion {excerpt(completions[i])})"


def _as_values(raw: Any) -> list[Any] | None:
    """The returned scores as a list, or ``None`` when they are not a 1-D sequence."""
    if raw is None or isinstance(raw, str | bytes | Mapping):
        return None
    if hasattr(raw, "__array__"):
        arr = np.asarray(raw)
        return arr.tolist() if arr.ndim == 1 else None
    try:
        return list(raw)
    except TypeError:
        return None


def _as_float(value: Any) -> float | None:
    """A real number as float; ``None`` for anything else (strings, None, complex, ...)."""
    if isinstance(value, numbers.Real | np.bool_ | np.integer | np.floating):
        try:
            return float(value)
        except (TypeError, ValueError):
            return None
    return None


def _describe_count(values: list[Any] | None, raw: Any, unit: str = "scores") -> str:
    if values is None:
        return f"a {type(raw).__name__}" + (
            f" of shape {np.shape(raw)}" if hasattr(raw, "__array__") else ""
        )
    return f"{len(values)} {unit}"


def check_inputs(
    prompts: Sequence[str], completions: Sequence[str], fields: Mapping[str, Sequence[Any]]
) -> int:
    """Checks that prompts, completions and every field have one entry per sample; returns N."""
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"rewards: got {len(prompts)} prompts for {n} completions")
    for key, column in fields.items():
        if isinstance(column, str | bytes) or not hasattr(column, "__len__"):
            raise ValueError(
                f"rewards: field {key!r} must be a list with one value per sample, "
                f"got {type(column).__name__}"
            )
        if len(column) != n:
            raise ValueError(f"rewards: field {key!r} has {len(column)} values for {n} samples")
    return n


def checked_call(
    fn: RewardFn,
    prompts: Sequence[str],
    completions: Sequence[str],
    fields: Mapping[str, Sequence[Any]] | None = None,
    *,
    name: str,
    on_error: OnError = "raise",
    timeout: float | None = None,
) -> tuple[np.ndarray, int]:
    """``(scores_n, num_errors)`` of :func:`checked_scores` (the same arguments), without what
    the reward reported beside its scores."""
    checked = checked_scores(
        fn, prompts, completions, fields, name=name, on_error=on_error, timeout=timeout
    )
    return checked.scores_n, checked.num_errors


def checked_scores(
    fn: RewardFn,
    prompts: Sequence[str],
    completions: Sequence[str],
    fields: Mapping[str, Sequence[Any]] | None = None,
    *,
    name: str,
    on_error: OnError = "raise",
    timeout: float | None = None,
) -> Checked:
    """Calls ``fn`` on a batch and validates what it returns.

    Args:
      fn: the reward.
      prompts, completions: ``N`` strings each.
      fields: per-sample columns, each of length ``N``, passed as keyword arguments.
      name: the reward's name, used in error messages.
      on_error: ``"raise"`` or ``"zero"`` (see the module docstring).
      timeout: seconds for all of ``fn``'s calls on this batch (the batched one and any
        one-sample retries); ``None`` waits forever and calls ``fn`` in this thread.

    Returns:
      :class:`Checked`: ``f32[N]`` finite scores; the number of samples scored 0 because of an
      error (none with ``on_error="raise"``), plus the samples the reward flagged as soft
      errors (:class:`Scores`, counted in both modes); the columns and scalars the reward
      reported (:class:`Scores`; none from a batch scored 0 whole).

    Raises:
      RewardError: with ``on_error="raise"``, on the first failing sample; in both modes, for a
        reported column without one value per sample or a non-finite reported scalar.
    """
    if on_error not in ON_ERROR_MODES:
        raise ValueError(f"on_error must be one of {ON_ERROR_MODES}, got {on_error!r}")
    fields = dict(fields or {})
    prompts, completions = list(prompts), list(completions)
    n = check_inputs(prompts, completions, fields)
    missing = [f for f in getattr(fn, "required_fields", ()) if f not in fields]
    if missing:
        # A wiring problem, not a bad sample: raised whatever on_error says.
        raise RewardError(
            f"reward {name!r} needs the field(s) {missing} but got fields {sorted(fields)}",
            reward=name,
        )
    if n == 0:
        return Checked(np.zeros((0,), np.float32), 0, {}, {})
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
    deadline = None if timeout is None else time.monotonic() + timeout
    call = _Caller(fn, deadline, timeout)
    try:
        raw = call(prompts, completions, fields)
    except RewardTimeout:
        if on_error == "raise":
            raise RewardError(
                f"reward {name!r} did not return within rewards.timeout = {timeout:g} s on a "
                f"batch of {n} samples (the first: {_sample_text(prompts, completions, 0)}); "
                "make it faster, raise rewards.timeout, or set rewards.on_error=zero to score "
                "such batches 0",
                reward=name,
            ) from None
        return Checked(np.zeros((n,), np.float32), n, {}, {})
    except Exception as exc:
        return _one_by_one(call, prompts, completions, fields, name, on_error, cause=exc)
    values = _as_values(raw)
    if values is None or len(values) != n:
        if on_error == "raise":
            index, where = _first_wrong_alone(call, prompts, completions, fields)
            raise RewardError(
                f"reward {name!r} returned {_describe_count(values, raw)} for {n} samples; a "
                f"reward must return one float per completion ({where})",
                reward=name,
                index=index,
            )
        return _one_by_one(call, prompts, completions, fields, name, on_error, cause=None)
    scores = np.zeros((n,), np.float64)
    num_errors = 0
    soft = set(getattr(raw, "soft_errors", ()))
    for i, value in enumerate(values):
        score = _as_float(value)
        if score is None or not math.isfinite(score):
            if on_error == "raise":
                raise RewardError(
                    f"reward {name!r} returned {value!r} for "
                    f"{_sample_text(prompts, completions, i)}; rewards must be finite floats "
                    f"(on_error='zero' scores such samples 0)",
                    reward=name,
                    index=i,
                )
            num_errors += 1
            continue
        scores[i] = score
        num_errors += i in soft
    return Checked(scores.astype(np.float32), num_errors, *_reported(raw, n, name))


def _reported(raw: Any, n: int, name: str) -> tuple[dict[str, list[Any]], dict[str, float]]:
    """The columns and scalars ``raw`` (a reward's return value) reports, checked."""
    extras = {}
    for key, column in getattr(raw, "extras", {}).items():
        values = _as_values(column)
        if values is None or len(values) != n:
            raise RewardError(
                f"reward {name!r} reported the column {key!r} with "
                f"{_describe_count(values, column, 'values')} for {n} "
                "samples; a reported column has one value per sample",
                reward=name,
            )
        extras[key] = values
    metrics = {}
    for key, value in getattr(raw, "metrics", {}).items():
        number = _as_float(value)
        if number is None or not math.isfinite(number):
            raise RewardError(
                f"reward {name!r} reported the metric {key!r} = {value!r}; a reported metric "
                "is a finite number",
                reward=name,
            )
        metrics[key] = number
    return extras, metrics


class _Caller:
    """One term's calls on one batch, sharing its deadline (see :func:`_call`)."""

    def __init__(self, fn: RewardFn, deadline: float | None, timeout: float | None):
        self.fn, self.deadline, self.timeout = fn, deadline, timeout

    def __call__(self, prompts: list[str], completions: list[str], fields: Mapping) -> Any:
        return _call(self.fn, (prompts, completions), fields, self.deadline)

    def one(self, prompts: list[str], completions: list[str], fields: Mapping, i: int) -> Any:
        """The call on sample ``i`` alone."""
        return self([prompts[i]], [completions[i]], {k: [v[i]] for k, v in fields.items()})


def _first_wrong_alone(
    fn: _Caller,
    prompts: list[str],
    completions: list[str],
    fields: dict[str, Sequence[Any]],
) -> tuple[int | None, str]:
    """After a batch returned the wrong count: the first sample that fails when scored alone
    (its index and a description), or ``None`` when each alone gets one score."""
    for i in range(len(completions)):
        try:
            raw = fn.one(prompts, completions, fields, i)
        except RewardTimeout:
            return i, f"{_sample_text(prompts, completions, i)} alone runs past the timeout"
        except Exception as e:
            return i, f"{_sample_text(prompts, completions, i)} alone raises {type(e).__name__}"
        values = _as_values(raw)
        if values is None or len(values) != 1:
            return i, f"{_sample_text(prompts, completions, i)} alone gets " + _describe_count(
                values, raw
            )
    return None, "each sample alone gets one score: the batched call is at fault"


def _one_by_one(
    fn: _Caller,
    prompts: list[str],
    completions: list[str],
    fields: dict[str, Sequence[Any]],
    name: str,
    on_error: OnError,
    cause: BaseException | None,
) -> Checked:
    """Scores each sample alone: finds the failing sample, or zeroes just the failing ones."""
    n = len(completions)
    scores = np.zeros((n,), np.float64)
    num_errors = 0
    extras: dict[str, list[Any]] = {}
    reported: dict[str, list[float]] = {}

    def done() -> Checked:
        metrics = {k: float(np.mean(v)) for k, v in reported.items()}
        return Checked(scores.astype(np.float32), num_errors, extras, metrics)

    for i in range(n):
        exc: BaseException | None = None
        problem = None
        try:
            raw = fn.one(prompts, completions, fields, i)
        except RewardTimeout:
            if on_error == "raise":
                raise RewardError(
                    f"reward {name!r} did not return within rewards.timeout = {fn.timeout:g} s "
                    f"(all its calls on a batch of {n} together) on "
                    f"{_sample_text(prompts, completions, i)}",
                    reward=name,
                    index=i,
                ) from cause
            num_errors += n - i  # the rest are unscored
            return done()
        except Exception as e:
            exc = e
            problem = f"raised {type(e).__name__}: {e}"
        else:
            values = _as_values(raw)
            if values is None or len(values) != 1:
                problem = f"returned {_describe_count(values, raw)} for 1 sample"
            else:
                score = _as_float(values[0])
                if score is None or not math.isfinite(score):
                    problem = f"returned {values[0]!r}"
                else:
                    scores[i] = score
                    num_errors += 0 in set(getattr(raw, "soft_errors", ()))
                    columns, metrics = _reported(raw, 1, name)
                    for key, (value,) in columns.items():
                        extras.setdefault(key, [None] * n)[i] = value
                    for key, value in metrics.items():
                        reported.setdefault(key, []).append(value)
        if problem is None:
            continue
        if on_error == "raise":
            raise RewardError(
                f"reward {name!r} {problem} on {_sample_text(prompts, completions, i)}",
                reward=name,
                index=i,
            ) from (exc or cause)
        num_errors += 1
    if on_error == "raise" and cause is not None:
        # Only the batched call fails: nothing to point at but the batch itself.
        raise RewardError(
            f"reward {name!r} raised {type(cause).__name__}: {cause} on a batch of {n} samples "
            f"(each sample alone scores fine)",
            reward=name,
        ) from cause
    return done()
