"""Build rewards from config: the only place where a reward is chosen by a string.

A reward config is a list of terms (or a single term), each a mapping::

    - {type: integer_answer, weight: 1.0, field: answer}
    - {type: math_verify, field: answer, timeout: 5.0}  # math-verify, seconds per answer
    - {type: regex, weight: 0.1, pattern: "^\\d+$", mode: fullmatch}
    - {type: length_penalty, weight: 1.0, target: 128, coef: 0.01}
    - {type: user, function: "my_rewards.py:score", kwargs: {tolerance: 0.01}}
    - {type: "my_pkg.rewards:score"}                  # the same, for a module function
    - {type: reward_model, score: "my_rm:score", batch_size: 32}
    - {type: verl, function: "my_reward.py:compute_score"}  # verl's custom_reward_function
    - {type: trl, function: "my_reward.py:accuracy_reward"}  # a TRL GRPOTrainer reward_func
    - {type: route, by: data_source, routes: {openai/gsm8k: gsm8k, lighteval/MATH: math_verify}}

Keys every term takes: ``type`` (required), ``weight`` (default 1.0), ``name`` (the metrics key;
default the type, or the function's name for a user, verl or trl function; ``null`` means the
default; repeated names get ``_2``, ``_3``...). The type's options (:func:`reward_options`) are
given either as keys of the term or inside a ``kwargs`` mapping (not both for one key); for a
user function ``kwargs`` are its keyword arguments. A type containing ``:`` is a user function, and
``gsm8k`` / ``boxed`` are accepted for ``gsm8k_answer`` / ``boxed_answer``. A bare string is
shorthand for ``{type: <string>}``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxrl_llm.rewards.answers import BoxedAnswer, Gsm8kAnswer, IntegerAnswer, MathVerifyAnswer
from jaxrl_llm.rewards.base import OnError, RewardConfigError, RewardFn
from jaxrl_llm.rewards.combine import RewardTerm, WeightedSum
from jaxrl_llm.rewards.external import (
    RewardModelReward,
    TrlReward,
    VerlScore,
    load_callable,
)
from jaxrl_llm.rewards.route import Routed
from jaxrl_llm.rewards.shaping import LengthPenalty, RegexFormat

COMMON_KEYS: tuple[str, ...] = ("type", "weight", "name")

#: Other spellings of a type, as the config layer may write them.
TYPE_ALIASES: dict[str, str] = {"gsm8k": "gsm8k_answer", "boxed": "boxed_answer"}

_OPTION_CLASSES: dict[str, type] = {
    "integer_answer": IntegerAnswer,
    "gsm8k_answer": Gsm8kAnswer,
    "boxed_answer": BoxedAnswer,
    "math_verify": MathVerifyAnswer,
    "regex": RegexFormat,
    "length_penalty": LengthPenalty,
}
_EXTERNAL_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # type: (required keys, optional keys)
    "user": (("function",), ("kwargs",)),
    # `path` is the reward model's folder: the trainer loads it and passes `reward_model=`.
    "reward_model": ((), ("score", "batch_size", "path")),
    # a verl `compute_score(data_source, solution_str, ground_truth, extra_info)` function
    "verl": (
        ("function",),
        ("data_source_field", "ground_truth_field", "extra_info_field", "reward_kwargs"),
    ),
    # a TRL GRPOTrainer reward function `f(prompts, completions, completion_ids, **kwargs)`
    "trl": (("function",), ()),
    # each sample scored by the reward its `by` field names (verl's default_compute_score)
    "route": (("routes",), ("by", "default")),
}


def _class_keys(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    fields = [f for f in dataclasses.fields(cls) if f.init]
    required = tuple(
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    return required, tuple(f.name for f in fields if f.name not in required)


def reward_options(type_name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(required, optional)`` option keys of a reward type (besides type/weight/name)."""
    if type_name in _OPTION_CLASSES:
        return _class_keys(_OPTION_CLASSES[type_name])
    return _EXTERNAL_KEYS[type_name]


#: Every reward type a config may name.
REWARD_TYPES: tuple[str, ...] = (*_OPTION_CLASSES, *_EXTERNAL_KEYS)

#: Types that call a peer trainer's reward function, named by their ``function`` option, as
#: that trainer calls it.
ADAPTERS: dict[str, type] = {"verl": VerlScore, "trl": TrlReward}


def _suggest(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _normalize(config: Any, where: str) -> dict[str, Any]:
    """The flat form ``{type, weight?, name?, **options}`` of any accepted spelling."""
    if isinstance(config, str):
        config = {"type": config}
    if not isinstance(config, Mapping):
        raise RewardConfigError(
            f"{where}: a reward is a mapping like {{type: integer_answer}}, got "
            f"{type(config).__name__} {config!r}"
        )
    config = {k: v for k, v in config.items() if not (k == "name" and v is None)}
    type_name = config.get("type")
    if isinstance(type_name, str) and ":" in type_name:
        if "function" in config:
            raise RewardConfigError(f"{where}: give the function as `type` or `function`, not both")
        config["type"], config["function"] = "user", type_name
    elif type_name in TYPE_ALIASES:
        config["type"] = TYPE_ALIASES[type_name]
        config.setdefault("name", type_name)  # the metrics keep the spelling the config used
    if config.get("type") != "user" and "kwargs" in config:
        kwargs = config.pop("kwargs") or {}
        if not isinstance(kwargs, Mapping):
            raise RewardConfigError(f"{where}: `kwargs` must be a mapping, got {kwargs!r}")
        both = sorted(set(kwargs) & set(config))
        if both:
            raise RewardConfigError(f"{where}: {both} given both as keys and in `kwargs`")
        config.update(kwargs)
    return config


def build_term(
    config: Mapping[str, Any] | str,
    *,
    where: str = "reward",
    reward_model: Callable[[list[str], list[str]], Sequence[float]] | None = None,
    base_dir: str | Path | None = None,
    answer_field: str | None = None,
) -> RewardTerm:
    """One :class:`RewardTerm` from its config (see the module docstring for the schema).

    Args:
      config: the term's mapping, or the string shorthand.
      where: how error messages name this term (e.g. ``"rewards[1]"``).
      reward_model: the scorer for a ``reward_model`` term without a ``score`` key (the trainer
        passes the reward head it built).
      base_dir: folder that relative ``path/to/file.py:function`` specs are resolved against.
      answer_field: the ``field`` of an answer reward (a type with that option) that names
        none, also inside a ``route`` (the trainer's ``data.answer_field``); ``None``: the
        type's own default.

    Raises:
      RewardConfigError: unknown type or key (with the nearest valid name), a missing required
        key, a bad value, or a user function that cannot be imported.
    """
    config = _normalize(config, where)
    if "type" not in config:
        raise RewardConfigError(f"{where}: missing `type` (one of {', '.join(REWARD_TYPES)})")
    type_name = config["type"]
    if type_name not in REWARD_TYPES:
        known = (*REWARD_TYPES, *TYPE_ALIASES)
        raise RewardConfigError(
            f"{where}: unknown reward type {type_name!r}{_suggest(str(type_name), known)} "
            f"(known: {', '.join(REWARD_TYPES)}, or 'module:function')"
        )
    where = f"{where} (type {type_name!r})"
    required, optional = reward_options(type_name)
    allowed = (*COMMON_KEYS, *required, *optional)
    for key in config:
        if key not in allowed:
            raise RewardConfigError(
                f"{where}: unknown key {key!r}{_suggest(str(key), allowed)} "
                f"(valid keys: {', '.join(allowed)})"
            )
    missing = [key for key in required if key not in config]
    if missing:
        raise RewardConfigError(f"{where}: missing required key(s) {', '.join(missing)}")
    options = {k: v for k, v in config.items() if k not in COMMON_KEYS}
    if answer_field is not None and "field" in optional:
        options.setdefault("field", answer_field)
    default_name = type_name
    try:
        if type_name in _OPTION_CLASSES:
            fn: RewardFn = _OPTION_CLASSES[type_name](**options)
        elif type_name == "user":
            fn, default_name = _build_user(options, base_dir)
        elif type_name == "route":
            fn = _build_route(options, reward_model, base_dir, answer_field)
        elif type_name in ADAPTERS:
            spec = options.pop("function")
            fn = ADAPTERS[type_name](load_callable(spec, base_dir=base_dir), **options)
            default_name = _function_name(spec)
        else:
            fn = _build_reward_model(options, reward_model, base_dir)
        return RewardTerm(
            name=config.get("name", default_name), fn=fn, weight=config.get("weight", 1.0)
        )
    except RewardConfigError as exc:
        raise RewardConfigError(f"{where}: {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise RewardConfigError(f"{where}: {exc}") from exc


def _build_route(
    options: dict[str, Any],
    reward_model: Callable[[list[str], list[str]], Sequence[float]] | None,
    base_dir: str | Path | None,
    answer_field: str | None,
) -> Routed:
    routes = options["routes"]
    if not isinstance(routes, Mapping) or not routes:
        raise RewardConfigError(
            f"`routes` must map values of the `by` field to rewards, e.g. "
            f"{{openai/gsm8k: gsm8k, lighteval/MATH: math_verify}}; got {routes!r}"
        )

    def routed(spec: Any, label: str) -> RewardFn:
        if isinstance(spec, Mapping):
            own = sorted({"weight", "name"} & set(spec))
            if own:
                raise RewardConfigError(
                    f"{label}: a routed reward has no {own[0]} of its own (give it to the route "
                    "term)"
                )
        if _normalize(spec, label).get("type") == "route":
            raise RewardConfigError(f"{label}: routes do not nest; route on one field")
        term = build_term(
            spec,
            where=label,
            reward_model=reward_model,
            base_dir=base_dir,
            answer_field=answer_field,
        )
        return term.fn

    built = {str(k): routed(v, f"routes[{str(k)!r}]") for k, v in routes.items()}
    default = options.get("default")
    return Routed(
        built,
        by=options.get("by", "data_source"),
        default=None if default is None else routed(default, "default"),
    )


def _function_name(spec: str) -> str:
    """A function spec's default metrics name: ``"pkg.mod:Class.score"`` -> ``"score"``."""
    return spec.rsplit(":", 1)[1].rsplit(".", 1)[-1]


def _build_user(options: dict[str, Any], base_dir: str | Path | None) -> tuple[RewardFn, str]:
    spec = options["function"]
    fn = load_callable(spec, base_dir=base_dir)
    kwargs = options.get("kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"`kwargs` must be a mapping of keyword arguments, got {kwargs!r}")
    name = _function_name(spec)
    return (functools.partial(fn, **kwargs) if kwargs else fn), name


def _build_reward_model(
    options: dict[str, Any],
    reward_model: Callable[[list[str], list[str]], Sequence[float]] | None,
    base_dir: str | Path | None,
) -> RewardFn:
    if "score" in options:
        score = load_callable(options["score"], base_dir=base_dir)
    elif reward_model is not None:
        score = reward_model
    else:
        raise RewardConfigError(
            "needs a scorer: set `score: module:function`, or let the trainer pass the reward "
            "model it loaded (build_reward(..., reward_model=...))"
        )
    return RewardModelReward(score, batch_size=options.get("batch_size"))


def build_reward(
    config: Sequence[Mapping[str, Any] | str] | Mapping[str, Any] | str,
    *,
    on_error: OnError = "raise",
    accuracy: str | None = None,
    reward_model: Callable[[list[str], list[str]], Sequence[float]] | None = None,
    base_dir: str | Path | None = None,
) -> WeightedSum:
    """The trainer's reward (a :class:`WeightedSum`) from the config's list of terms.

    Args:
      config: a list of term configs (or one term); see the module docstring.
      on_error: ``"raise"`` or ``"zero"`` for every term (see :func:`checked_call`).
      accuracy: name of the term behind the ``accuracy`` metric (default: first answer reward).
      reward_model, base_dir: as in :func:`build_term`.
    """
    if isinstance(config, str | Mapping):
        config = [config]
    if not isinstance(config, Sequence) or not config:
        raise RewardConfigError(f"rewards: expected a non-empty list of rewards, got {config!r}")
    terms: list[RewardTerm] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(config):
        term = build_term(item, where=f"rewards[{i}]", reward_model=reward_model, base_dir=base_dir)
        seen[term.name] = seen.get(term.name, 0) + 1
        if seen[term.name] > 1:
            term = dataclasses.replace(term, name=f"{term.name}_{seen[term.name]}")
        terms.append(term)
    try:
        return WeightedSum(terms, on_error=on_error, accuracy=accuracy)
    except ValueError as exc:
        raise RewardConfigError(f"rewards: {exc}") from exc
