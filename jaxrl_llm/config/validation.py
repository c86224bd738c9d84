"""Loading a training run's config, and the checks across its sections.

Loading (:func:`load_config`) goes: read the YAML file (a ``base:`` or ``defaults:`` key includes
other YAML files, relative to the including file, merged underneath) → merge the dotted overrides
``a.b.c=value`` (values parsed as YAML) → build the dataclasses of
:mod:`jaxrl_llm.config.schema` (unknown keys, wrong types and out-of-range values are errors; see
:mod:`jaxrl_llm.config.engine`) → cross-check the sections (:func:`validate`: impossible
combinations, recipe hyperparameters against the recipe's signature). Every problem raises
:class:`~jaxrl_llm.config.engine.ConfigError` naming the key path, the value and what was
expected. Checks that need the device count are in :func:`check_devices`; :func:`load_config`
also checks the run's lengths against the model's context (:func:`check_model_limits`, reading
only config.json or the GGUF metadata), so neither a model nor a step is spent on a run that
cannot generate.

Two merge rules keep layered configs honest: when a layer changes ``algorithm.name``, the
``algorithm.hparams`` of the layers below are dropped (they belonged to another recipe); and
``dpo``, which trains offline on preference pairs, takes ``rollout: null`` (an absent rollout
section is fine; a non-null one is an error rather than silently ignored).

Strings are resolved here and in the CLI, never below: :func:`build_recipe` turns the algorithm
section into a :class:`~jaxrl_llm.recipe.Recipe` with plain keyword arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import inspect
import math
import os
import re
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxrl_llm import algorithms
from jaxrl_llm import chain as ch
from jaxrl_llm import recipe as rc
from jaxrl_llm.config import engine
from jaxrl_llm.config.engine import (
    ConfigError,
    FrozenDict,
    _bad,
    _build,
    _check_top_level,
    _convert,
    _given_or_default,
    _suggest,
    _unknown,
    to_dict,
)
from jaxrl_llm.config.schema import (
    AlgorithmConfig,
    DataConfig,
    MeshConfig,
    RewardTermConfig,
    TrainConfig,
)
from jaxrl_llm.core import kl as _kl
from jaxrl_llm.rewards import registry as _reward_registry


@functools.cache
def _default_requires(name: str) -> frozenset[str]:
    """What the named recipe, built with its default hyperparameters, requires of the trainer."""
    return algorithms.RECIPES[name]().requires


# Asked of the recipes themselves (their ``requires``), never listed by name: those whose
# baseline or normalisation compares the G answers of a prompt, and those whose loss has no
# importance ratio (only on-policy updates are unbiased).
GROUP_RECIPES = tuple(n for n in algorithms.RECIPES if rc.GROUPS in _default_requires(n))
RATIO_FREE_RECIPES = tuple(n for n in algorithms.RECIPES if rc.ON_POLICY in _default_requires(n))
# Recipes whose builder takes a KL controller (an adaptive β for a KL folded into the reward).
_CONTROLLED_RECIPES = tuple(
    n for n, fn in algorithms.RECIPES.items() if "kl_controller" in inspect.signature(fn).parameters
)


def is_offline_recipe(name: str) -> bool:
    """Whether the recipe called ``name`` trains on preference pairs (no rollouts)."""
    return name in algorithms.RECIPES and rc.PREFERENCE_PAIRS in _default_requires(name)


# Built-in reward types (host-side, see jaxrl_llm.rewards), spelled as a config names them: the
# registry's types under their short aliases (gsm8k, boxed). The registry's "user" type is not
# one: a config names a user's function as the type itself, "module:function".
_SHORT_NAME = {full: short for short, full in _reward_registry.TYPE_ALIASES.items()}
REWARD_TYPES = tuple(_SHORT_NAME.get(t, t) for t in _reward_registry.REWARD_TYPES if t != "user")
# Recipe keyword arguments that come from other config keys, never from algorithm.hparams.
_MANAGED_HPARAMS = {
    "numerics": "algorithm.numerics",
    "kl_controller": "kl.controller",
    "axis_name": "the mesh (the trainer sets it)",
}

# ---------------------------------------------------------------------------------------------
# Reading, merging, writing.


def _effective_name(section: Any) -> Any:
    """The recipe a raw ``algorithm`` section names (the default when it names none)."""
    return _given_or_default(section, AlgorithmConfig, "name")


def _drop_other_recipes_hparams(path: tuple[str, ...], base: Mapping, child: Mapping) -> Mapping:
    """The merge rule: a layer that changes ``algorithm.name`` drops the ``hparams`` below."""
    renamed = "name" in child and _effective_name(base) != child["name"]
    if path == ("algorithm",) and renamed:
        return {k: v for k, v in base.items() if k != "hparams"}
    return base


def _read_yaml(path: Path) -> dict:
    """A config file with its ``base:`` / ``defaults:`` includes merged underneath. An include
    that is no file relative to the including one may name a shipped config
    (``base: algorithms/grpo``), so that a config of one's own, anywhere, can build on them."""
    return engine._read_yaml(
        path, rule=_drop_other_recipes_hparams, find=_shipped_include, expand=expand_shorthands
    )


_TERM_KEYS = frozenset(f.name for f in dataclasses.fields(RewardTermConfig))
# A bare reward type or 'module:function' / 'path/file.py:function' (not a value that failed
# to parse as YAML, which an override passes on as its text)
_TYPE_NAME = re.compile(r"[\w.:/-]+")


def _is_type_name(value: Any) -> bool:
    return isinstance(value, str) and _TYPE_NAME.fullmatch(value) is not None


def _expand_term(term: Any, key: str, where: str) -> Any:
    """A reward term in the schema's form (``{type, weight, name, kwargs}``) from the spellings
    ``rewards.build_reward`` takes: a bare type string, and a type's options as keys of the
    term rather than in ``kwargs`` (``{type: regex, pattern: ...}``); ``{type: user, function:
    F}`` is ``{type: F}``. Anything else is left for the schema to report."""
    if _is_type_name(term):
        return {"type": term}
    if not isinstance(term, Mapping):
        return term
    term = dict(term)
    if term.get("type") == "user" and isinstance(term.get("function"), str):
        term["type"] = term.pop("function")
    if ":" in str(term.get("type", "")):  # a user function: its kwargs are its arguments
        return term
    options = {k: term.pop(k) for k in list(term) if k not in _TERM_KEYS}
    if options:
        kwargs = term.get("kwargs") or {}
        if not isinstance(kwargs, Mapping):
            return {**term, **options}  # the schema reports the bad kwargs (and the keys)
        both = sorted(set(options) & set(kwargs))
        if both:
            raise ConfigError(
                f"{where}: {key}.{both[0]} is given both as a key of the term and in its "
                "kwargs; give it once",
                f"{key}.{both[0]}",
            )
        term["kwargs"] = {**kwargs, **options}
    return term


def expand_shorthands(raw: dict, where: str = "the config") -> dict:
    """One config document (or override) with the short spellings of ``rewards`` expanded,
    before documents are merged: ``rewards`` may be the list of terms itself (or one term, or
    one type's name) as in ``rewards.build_reward``, for ``rewards.terms``, and each term may
    be written as :func:`_expand_term` describes. The documented form is left as it is."""
    rewards = raw.get("rewards")
    if _is_type_name(rewards) or (isinstance(rewards, Mapping) and "type" in rewards):
        rewards = [rewards]
    if isinstance(rewards, list):
        rewards = {"terms": rewards}
    if isinstance(rewards, Mapping) and isinstance(rewards.get("terms"), list):
        terms = [
            _expand_term(t, f"rewards.terms[{i}]", where) for i, t in enumerate(rewards["terms"])
        ]
        raw = {**raw, "rewards": {**rewards, "terms": terms}}
    return raw


def _shipped_include(include: str) -> Path | str:
    """The shipped config an include names (``algorithms/grpo``, with or without ``.yaml``),
    or why it names none."""
    shipped = shipped_configs()
    name = include.removesuffix(".yaml").removesuffix(".yml").removeprefix("configs/")
    if name in shipped:
        return shipped[name]
    return (
        f"not a shipped config either{_suggest(name, list(shipped))} (`jaxrl-llm configs` "
        "lists them; an include is a path relative to the including file or a shipped name)"
    )


def merge_overrides(raw: Mapping, overrides: Sequence[str]) -> dict:
    """Applies dotted overrides in order (a later one wins) to a raw config mapping."""
    return engine.merge_overrides(raw, overrides, _drop_other_recipes_hparams, expand_shorthands)


_CONFIG_SUFFIXES = (".yaml", ".yml")


def _shipped_root() -> Path | None:
    """The folder of the configs shipped in the package (``jaxrl_llm/configs``, a symlink to the
    top-level ``configs/`` in a checkout, plain files in a wheel); ``None`` when there is none."""
    root = importlib.resources.files("jaxrl_llm") / "configs"
    if isinstance(root, Path) and root.is_dir():
        return root
    checkout = Path(__file__).resolve().parents[2] / "configs"  # a checkout without the symlink
    return checkout if checkout.is_dir() else None


def _description(path: Path) -> str:
    """The first comment line of a YAML file (``""`` when it does not start with a comment)."""
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line.startswith("#"):
            return ""
        if line.lstrip("#").strip():
            return line.lstrip("#").strip()
    return ""


def shipped_configs() -> dict[str, Path]:
    """The shipped configs by name (``quickstart``, ``algorithms/grpo``, ...): top-level first."""
    root = _shipped_root()
    if root is None:
        return {}
    paths = [p for p in root.rglob("*") if p.suffix in _CONFIG_SUFFIXES and p.is_file()]
    named = {p.relative_to(root).with_suffix("").as_posix(): p for p in paths}
    return {n: named[n] for n in sorted(named, key=lambda n: (n.count("/"), n))}


def describe_configs() -> dict[str, str]:
    """Each shipped config's name and one-line description (its first comment line)."""
    return {name: _description(path) for name, path in shipped_configs().items()}


def resolve_config(path: str | os.PathLike) -> Path:
    """The file ``--config`` means: an existing path as given; otherwise a name without ``.yaml``
    (``quickstart``, ``algorithms/grpo``) is the shipped config of that name.

    Raises:
      ConfigError: for a name that is neither a file nor a shipped config (listing the shipped
        ones, with the closest as a suggestion).
    """
    given = Path(path)
    text = os.fspath(path)
    if given.is_file():
        return given
    shipped = shipped_configs()
    if given.suffix in _CONFIG_SUFFIXES:
        stem = given.with_suffix("").as_posix().removeprefix("./").removeprefix("configs/")
        if stem in shipped:
            raise ConfigError(
                f"config file not found: {text}; the shipped config of that name is called "
                f"{stem!r} (--config {stem}, from any directory)"
            )
        return given  # the reader reports the missing file
    if text in shipped:
        return shipped[text]
    names = ", ".join(shipped) or "none (the package has no configs folder)"
    raise ConfigError(
        f"config {text!r}: no such file and no shipped config of that name"
        f"{_suggest(text, list(shipped))} (shipped configs: {names}; `jaxrl-llm configs` "
        "describes them)"
    )


def load_config(
    path: str | os.PathLike,
    overrides: Sequence[str] = (),
    *,
    device_count: int | None = None,
) -> TrainConfig:
    """Reads, merges, overrides and validates a config file.

    Args:
      path: a YAML file, or the name of a shipped config without ``.yaml`` (``quickstart``,
        ``algorithms/grpo``; see :func:`resolve_config`, :func:`describe_configs`); ``base:`` /
        ``defaults:`` include others relative to the file.
      overrides: ``"dotted.key=value"`` strings applied after the file, in order.
      device_count: also check the mesh and batch divisibility for this many devices
        (:func:`check_devices`); ``None`` skips that check (the trainer runs it with
        ``jax.device_count()``).

    Raises:
      ConfigError: naming the key, the value and what was expected.
      jaxrl_llm.models.ModelLoadError: the model's config.json or GGUF metadata is unreadable
        (:func:`check_model_limits` reads it).
    """
    raw = merge_overrides(_read_yaml(resolve_config(path)), overrides)
    config = from_dict(raw)
    check_model_limits(config)
    if device_count is not None:
        check_devices(config, device_count)
    return config


def to_yaml(config: TrainConfig) -> str:
    """The resolved config as YAML; :func:`load_config` reads it back to an equal config."""
    return engine.dump_yaml(config, "# Resolved jaxrl_llm config (all defaults filled in).\n")


def save_config(config: TrainConfig, path: str | os.PathLike) -> Path:
    """Writes :func:`to_yaml` atomically (temporary file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(to_yaml(config), encoding="utf-8")
    os.replace(tmp, path)
    return path


def apply_overrides(config: TrainConfig, overrides: Sequence[str]) -> TrainConfig:
    """A validated copy of ``config`` with dotted overrides applied (e.g. the CLI's flags)."""
    return from_dict(merge_overrides(to_dict(config), overrides))


def from_dict(raw: Mapping) -> TrainConfig:
    """Builds and validates a :class:`TrainConfig` from a raw (YAML-shaped) mapping."""
    _check_top_level(raw)
    raw = expand_shorthands(dict(raw))
    name = _effective_name(raw.get("algorithm", {}))
    if is_offline_recipe(name):
        rollout = raw.get("rollout")
        if rollout is not None:
            keys = [f"rollout.{k}" for k in rollout] if isinstance(rollout, Mapping) else []
            found = f" (found {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
            raise ConfigError(
                "rollout: dpo trains offline on preference pairs and generates nothing, so a "
                "rollout section makes no sense; set `rollout: null` and size the batch with "
                f"preference.pairs_per_step{found if keys else ''}",
                "rollout",
            )
        raw["rollout"] = None
    elif "rollout" in raw and raw["rollout"] is None:
        raise ConfigError(
            f"rollout = None: expected a mapping; the online recipe {name!r} generates its "
            "training batch (only dpo takes `rollout: null`)",
            "rollout",
        )
    config = _build(TrainConfig, raw, "")
    return validate(config)


# ---------------------------------------------------------------------------------------------
# Cross-section validation.


def _recipe_fn(name: str):
    return algorithms.RECIPES[name]


def _hparam_names(name: str) -> list[str]:
    params = inspect.signature(_recipe_fn(name)).parameters
    return [p for p in params if p not in _MANAGED_HPARAMS]


def _checked_hparams(algorithm: AlgorithmConfig) -> FrozenDict:
    """``algorithm.hparams`` validated against the recipe's signature, values converted."""
    fn = _recipe_fn(algorithm.name)
    valid = _hparam_names(algorithm.name)
    hints = typing.get_type_hints(fn)
    out = {}
    for name, value in algorithm.hparams.items():
        key = f"algorithm.hparams.{name}"
        if name in _MANAGED_HPARAMS:
            raise ConfigError(f"{key}: set {_MANAGED_HPARAMS[name]} instead", key)
        if name not in valid:
            why = f" ({name!r} is not a hyperparameter of {algorithm.name})"
            raise _unknown("algorithm.hparams", name, valid, why)
        out[name] = _convert(value, hints.get(name, Any), key)
    return FrozenDict(out)


def recipe_hparams(config: TrainConfig) -> dict[str, Any]:
    """Every hyperparameter of the recipe: its signature's defaults under ``algorithm.hparams``."""
    params = inspect.signature(_recipe_fn(config.algorithm.name)).parameters
    out = {n: p.default for n, p in params.items() if n not in _MANAGED_HPARAMS}
    out.update(config.algorithm.hparams)
    return out


# The rollout correction an async run (train.max_staleness > 0) gets when its recipe takes one
# (every online recipe does) and the config sets none: token-level truncated IS,
# w = min(π / μ, 2) (Yao et al. 2025's TIS cap) with π the recomputed proximal policy for ratio
# losses (the decoupled loss of Hilton et al. 2021 / AReaL) and sg(π_θ) for ratio-free ones
# (verl's bypass; the same value there: nothing updates in between). ``rollout_correction:
# {mode: none}`` opts out (the rollout_corr/* metrics stay).
ASYNC_ROLLOUT_CORRECTION = {"mode": "tis", "level": "token", "high": 2.0}


def async_default_correction(config: TrainConfig) -> bool:
    """Whether :data:`ASYNC_ROLLOUT_CORRECTION` is added to the recipe: an async run
    (``train.max_staleness > 0``) of a recipe with a ``rollout_correction`` option unset."""
    if int(getattr(config.train, "max_staleness", 0) or 0) <= 0:
        return False
    if "rollout_correction" in config.algorithm.hparams:
        return False
    return "rollout_correction" in inspect.signature(_recipe_fn(config.algorithm.name)).parameters


def build_recipe(config: TrainConfig, **extra: Any) -> rc.AnyRecipe:
    """The :class:`~jaxrl_llm.recipe.Recipe` the config names (``extra``: e.g. ``axis_name``)."""
    name = config.algorithm.name
    kwargs = dict(config.algorithm.hparams, numerics=config.algorithm.numerics, **extra)
    if async_default_correction(config):
        kwargs["rollout_correction"] = dict(ASYNC_ROLLOUT_CORRECTION)
    if config.kl.controller == "adaptive":
        kwargs["kl_controller"] = _kl.adaptive_kl_controller(
            float(recipe_hparams(config)["beta"]),
            target=config.kl.target,
            horizon=config.kl.horizon,
        )
    return _recipe_fn(name)(**kwargs)


def needs_reference_model(config: TrainConfig) -> bool:
    """Whether the run loads a frozen reference copy of the policy: whether its recipe requires
    reference log-probs (online recipes when a KL is used, β > 0 or an adaptive controller; dpo
    except for the reference-free SimPO loss)."""
    return rc.REFERENCE_LOGPROBS in build_recipe(config).requires


def _check_algorithm(config: TrainConfig) -> None:
    name, hp = config.algorithm.name, recipe_hparams(config)
    if config.kl.controller == "adaptive":
        if "kl_controller" not in inspect.signature(_recipe_fn(name)).parameters:
            raise _bad(
                "kl.controller",
                "adaptive",
                f"'fixed' for {name}: an adaptive β steers a KL folded into the reward, which "
                f"only {', '.join(_CONTROLLED_RECIPES)} do",
            )
        if not float(hp.get("beta") or 0.0) > 0:
            raise _bad(
                "algorithm.hparams.beta",
                hp.get("beta"),
                "β > 0 with kl.controller=adaptive (the controller scales β multiplicatively)",
            )
    estimator = hp.get("kl_estimator")
    if estimator is not None and estimator not in ch.KL_ESTIMATORS:
        raise ConfigError(
            f"algorithm.hparams.kl_estimator = {estimator!r}: expected one of "
            f"{', '.join(ch.KL_ESTIMATORS)}{_suggest(estimator, list(ch.KL_ESTIMATORS))}",
            "algorithm.hparams.kl_estimator",
        )
    try:
        recipe = build_recipe(config)
    except (ValueError, TypeError) as e:
        raise ConfigError(
            f"algorithm.hparams = {dict(config.algorithm.hparams)!r}: {e}", "algorithm.hparams"
        ) from None
    if config.rollout is None:
        return
    rollout = config.rollout
    g = rollout.num_samples
    if rc.GROUPS in recipe.requires and g < 2:
        raise _bad(
            "rollout.num_samples",
            g,
            f"≥ 2 for {name}: its baseline compares the G answers of each prompt with each "
            "other, and a group of one has nothing to compare with",
        )
    keep = hp.get("pods_num_keep")
    if keep is not None and not 2 <= keep < g:
        raise _bad(
            "algorithm.hparams.pods_num_keep",
            keep,
            f"2 ≤ m < G = rollout.num_samples = {g} (PODS keeps m of the G answers of a prompt; "
            "m = G keeps all of them and m = 1 leaves no group to compare)",
        )
    if hp.get("max_length") is not None:  # overlong shaping (DAPO)
        if hp["max_length"] > rollout.max_new_tokens:
            raise _bad(
                "algorithm.hparams.max_length",
                hp["max_length"],
                f"≤ rollout.max_new_tokens = {rollout.max_new_tokens} ({name}'s overlong "
                "shaping is measured against the generation limit)",
            )
        if not 0 < hp["overlong_buffer"] < hp["max_length"]:
            raise _bad(
                "algorithm.hparams.overlong_buffer",
                hp["overlong_buffer"],
                f"0 < buffer < max_length = {hp['max_length']}",
            )
    if rc.ON_POLICY in recipe.requires:
        for field in ("ppo_epochs", "num_minibatches"):
            if getattr(config.optim, field) != 1:
                raise _bad(
                    f"optim.{field}",
                    getattr(config.optim, field),
                    f"1 for {name}: its loss −A·log π has no importance ratio, so every update "
                    "after the first on a batch would be off-policy and biased",
                )
    correction = getattr(getattr(recipe, "objective", None), "rollout_correction", None)
    if (
        correction is not None
        and correction.bypass == "ppo_clip"
        and config.old_logprobs.source != "sampler"
    ):
        raise _bad(
            "old_logprobs.source",
            config.old_logprobs.source,
            f"'sampler' for {name} with rollout_correction.bypass = ppo_clip (the sampler's "
            "log-probs are π_old there); with π_old recomputed use bypass: reinforce, the "
            "decoupled correction",
        )


def _check_batch(config: TrainConfig) -> None:
    optim, batch = config.optim, config.update_batch_size
    what = "pairs" if config.is_offline else "sequences (B·G)"
    if batch != config.batch_size:
        what = "sequences (B·m = rollout.prompts_per_step × algorithm.hparams.pods_num_keep)"
    if batch % optim.num_minibatches:
        raise _bad(
            "optim.num_minibatches",
            optim.num_minibatches,
            f"a divisor of the batch of {batch} {what}",
        )
    minibatch = batch // optim.num_minibatches
    if optim.micro_batch_size is not None and minibatch % optim.micro_batch_size:
        raise _bad(
            "optim.micro_batch_size",
            optim.micro_batch_size,
            f"a divisor of the minibatch of {minibatch} {what} "
            f"({batch} / optim.num_minibatches={optim.num_minibatches})",
        )
    share = getattr(config.train, "shared_prompts", "auto")
    if share is True and not config.is_offline:
        lora = config.model.lora
        if not config.train.packing:
            raise _bad("train.shared_prompts", share, "auto or false unless train.packing is true")
        if lora is not None and lora.dropout > 0:
            raise _bad(
                "train.shared_prompts",
                share,
                "auto or false with model.lora.dropout > 0 (a shared prompt token would need "
                "one dropout mask per sample)",
            )
        if config.model.attention in ("splash", "cudnn", "pallas_gpu"):
            raise _bad(
                "train.shared_prompts",
                share,
                f"auto or false with model.attention={config.model.attention} (shared prompts "
                "run the reference attention)",
            )
    if optim.micro_batch_tokens is not None and not config.is_offline:
        if not config.train.packing:
            raise _bad(
                "optim.micro_batch_tokens",
                optim.micro_batch_tokens,
                "null unless train.packing is true (token-budget micro-batches are packed rows)",
            )
        longest = config.data.max_prompt_length + config.rollout.max_new_tokens
        if optim.micro_batch_tokens < longest:
            raise _bad(
                "optim.micro_batch_tokens",
                optim.micro_batch_tokens,
                f"at least one longest sequence, data.max_prompt_length + "
                f"rollout.max_new_tokens = {longest} tokens",
            )


_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".csv": "csv"}


def data_format(data: DataConfig, path: str) -> str:
    """The file format of ``path``: ``data.format`` or, for ``auto``, from its extension."""
    if data.format != "auto":
        return data.format
    suffix = Path(path).suffix.lower()
    if suffix not in _FORMATS:
        raise ConfigError(
            f"data.format = 'auto': cannot tell the format of {path!r} from its extension; "
            f"expected one of {', '.join(_FORMATS)} or an explicit data.format",
            "data.format",
        )
    return _FORMATS[suffix]


def _check_data(config: TrainConfig) -> None:
    data = config.data
    if data.source == "file":
        if not data.path:
            raise _bad("data.path", data.path, "a JSONL, Parquet or CSV file with data.source=file")
        data_format(data, data.path)
    if data.eval_path:
        data_format(data, data.eval_path)
    if data.source == "arithmetic":
        # A file named with the built-in source would be silently ignored: say so instead.
        for key in ("path", "eval_path"):
            value = getattr(data, key)
            if value is not None:
                what = "train on" if key == "path" else "evaluate on"
                raise ConfigError(
                    f"data.{key} = {value!r} with data.source = 'arithmetic': the built-in "
                    f"arithmetic task reads no file, so this file would be ignored. To {what} "
                    f"it, add data.source=file (with data.path); to use the arithmetic task, "
                    f"drop data.{key} (data.{key}=null)",
                    f"data.{key}",
                )
        a = data.arithmetic
        if a.min_operand > a.max_operand:
            raise _bad(
                "data.arithmetic.max_operand", a.max_operand, f"≥ min_operand = {a.min_operand}"
            )
        if not a.operations:
            raise _bad("data.arithmetic.operations", [], "at least one of '+', '-', '*'")
        from jaxrl_llm.data import num_arithmetic_problems

        n_problems = num_arithmetic_problems(
            ops=tuple(a.operations), min_operand=a.min_operand, max_operand=a.max_operand
        )
        if a.train_size + data.eval_size > n_problems:
            raise _bad(
                "data.arithmetic.train_size",
                a.train_size,
                f"train_size + data.eval_size ≤ {n_problems}, the number of distinct problems "
                "these operands and operations allow (training and evaluation prompts are "
                "disjoint)",
            )


def _check_rewards(config: TrainConfig) -> None:
    if config.is_offline:
        return
    terms = config.rewards.terms
    if not terms:
        raise _bad("rewards.terms", [], "at least one reward for an online recipe")
    names = set()
    for i, term in enumerate(terms):
        key = f"rewards.terms[{i}]"
        if ":" in term.type:
            if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", term.type):
                raise _bad(f"{key}.type", term.type, "'package.module:function'")
        elif term.type not in REWARD_TYPES:
            raise ConfigError(
                f"{key}.type = {term.type!r}: expected one of {', '.join(REWARD_TYPES)} or "
                f"'module:function'{_suggest(term.type, REWARD_TYPES)}",
                f"{key}.type",
            )
        if term.type == "reward_model" and not isinstance(term.kwargs.get("path"), str):
            raise _bad(f"{key}.kwargs.path", term.kwargs.get("path"), "the reward model's folder")
        if term.metric_name in names:
            raise _bad(
                f"{key}.name",
                term.name,
                "a name not used by another term (give each its own `name`)",
            )
        names.add(term.metric_name)


def _check_mesh(mesh: MeshConfig, where: str = "mesh") -> None:
    """``where``: the mesh's key (``mesh``, or ``placement.rollout_mesh``)."""
    sizes = {"data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor}
    for axis, size in sizes.items():
        if size != -1 and size < 1:
            raise _bad(f"{where}.{axis}", size, "a size ≥ 1, or -1 for all remaining devices")
    if list(sizes.values()).count(-1) > 1:
        raise ConfigError(
            f"{where} = {sizes}: at most one axis may be -1 (all remaining devices)", where
        )
    if mesh.preset == "dp" and (mesh.fsdp != 1 or mesh.tensor != 1):
        raise _bad(
            f"{where}.preset", "dp", "'fsdp' or 'fsdp_tp' for a mesh with fsdp or tensor > 1"
        )
    if mesh.preset == "fsdp" and mesh.tensor != 1:
        raise _bad(f"{where}.tensor", mesh.tensor, f"1 with {where}.preset=fsdp (use fsdp_tp)")
    if mesh.preset == "fsdp_tp" and mesh.tensor == 1:
        raise _bad(f"{where}.tensor", 1, f"≥ 2 (or -1) with {where}.preset=fsdp_tp")


def _check_partial_rollouts(config: TrainConfig) -> None:
    """``train.partial_rollout_tokens``: needs ``max_staleness >= 2`` (segments continue across
    updates) and a recipe that scores each batch once (no DAPO refills, no ReMax greedy
    baseline); with several processes, the paged engine (:func:`check_devices`)."""
    n = config.train.partial_rollout_tokens
    if n == 0 or config.is_offline:
        return
    key = "train.partial_rollout_tokens"
    if config.train.max_staleness < 2:
        raise ConfigError(
            f"{key} = {n} with train.max_staleness = {config.train.max_staleness}: a batch is "
            "sampled over the max_staleness updates before its own, so segments can continue "
            "under newer weights only with train.max_staleness >= 2; expected "
            f"train.max_staleness >= 2, or {key} = 0",
            key,
        )
    if n >= config.rollout.max_new_tokens:
        raise _bad(key, n, f"fewer than rollout.max_new_tokens = {config.rollout.max_new_tokens}")
    recipe = build_recipe(config)
    if recipe.selection.dynamic_sampling or ch.GIVEN_BASELINE in recipe.requires:
        raise ConfigError(
            f"{key} = {n}: {config.algorithm.name} refills groups (dynamic sampling) or samples "
            f"a greedy baseline per prompt, which partial rollouts do not; expected {key} = 0",
            key,
        )


def _check_kernel_tuning(config: TrainConfig) -> None:
    """``rollout.paged_kernel_tuning``: the Pallas GPU decode kernel's launch parameters."""
    if config.rollout is None or not config.rollout.paged_kernel_tuning:
        return
    from jaxrl_llm.rollout import pages

    key = "rollout.paged_kernel_tuning"
    try:
        pages.check_kernel_tuning(config.rollout.paged_kernel_tuning, where=key)
    except ValueError as e:
        raise ConfigError(str(e), key) from None


def _check_max_num_seqs(config: TrainConfig) -> None:
    """``rollout.max_num_seqs``: a prompt's G samples are admitted together, so at least G."""
    r = config.rollout
    if r is None or not r.max_num_seqs or r.max_num_seqs >= r.num_samples:
        return
    key = "rollout.max_num_seqs"
    raise ConfigError(
        f"{key} = {r.max_num_seqs} is smaller than rollout.num_samples = {r.num_samples}: a "
        f"prompt's samples decode together; expected 0 (auto) or >= {r.num_samples}",
        key,
    )


def _check_placement(config: TrainConfig) -> None:
    """``placement``: split needs a rollout (not dpo) and a valid rollout mesh; the device
    counts are checked in :func:`check_devices`."""
    _check_partial_rollouts(config)
    if config.placement.mode != "split":
        return
    if config.is_offline:
        raise ConfigError(
            f"placement.mode = 'split': {config.algorithm.name} trains offline on preference "
            "pairs and generates nothing, so there is no rollout to place; expected "
            "placement.mode = 'colocated'",
            "placement.mode",
        )
    _check_mesh(config.placement.rollout_mesh, "placement.rollout_mesh")


#: Seeds are integers in ``[0, MAX_SEED)``: JAX keys take an int64 and the trainer seeds
#: evaluation and a fresh critic head with ``seed + 1``.
MAX_SEED = 2**63 - 1


def _check_seeds(config: TrainConfig) -> None:
    for key, value in (("train.seed", config.train.seed), ("data.seed", config.data.seed)):
        if not 0 <= value < MAX_SEED:
            raise _bad(key, value, "an integer in [0, 2^63 - 1) (a JAX key is an int64)")


def _check_reward_components(config: TrainConfig) -> None:
    """GDPO (a chain reading Rollout.reward_bgk): one weight per ``rewards.terms`` entry."""
    if config.is_offline:
        return
    weights = config.algorithm.hparams.get("reward_weights")
    if weights is None or ch.REWARD_COMPONENTS not in build_recipe(config).requires:
        return
    if len(weights) != len(config.rewards.terms):
        raise _bad(
            "algorithm.hparams.reward_weights",
            list(weights),
            f"one weight per rewards.terms entry ({len(config.rewards.terms)}: the reward "
            "terms are kept apart, in their config order)",
        )


def _check_lora(config: TrainConfig) -> None:
    """``model.lora`` / ``critic.lora``: targets that exist, no dropout yet, and a critic with
    adapters when the policy has them (a full critic next to a LoRA policy is allowed only
    when asked for: ``critic.lora`` null is then an error, not a silent full fine-tune)."""
    from jaxrl_llm.models import lora as _lora

    for key, section in (("model.lora", config.model.lora), ("critic.lora", config.critic.lora)):
        if section is None:
            continue
        unknown = [t for t in section.targets if t not in _lora.TARGETS]
        if unknown or not section.targets:
            raise _bad(
                f"{key}.targets",
                list(section.targets),
                f"projection names from {list(_lora.TARGETS)}"
                + (f" ({unknown} match none)" if unknown else ""),
            )
        if len(set(section.targets)) != len(section.targets):
            raise _bad(f"{key}.targets", list(section.targets), "each projection once")
        if section.merge_for_sampling and section.quantize != "none":
            raise _bad(
                f"{key}.merge_for_sampling",
                True,
                f"false with quantize = {section.quantize} (merging would dequantise the "
                "whole base into a float copy: sample with the adapters unmerged)",
            )
        if not 0 <= section.dropout < 1:
            raise _bad(f"{key}.dropout", section.dropout, "a rate in [0, 1)")
        if key == "critic.lora" and section.dropout != 0:
            raise _bad(
                f"{key}.dropout",
                section.dropout,
                "0 (dropout is implemented for the policy's adapters, not the critic's)",
            )
    recipe = build_recipe(config) if not config.is_offline else None
    has_critic = recipe is not None and getattr(recipe, "critic", None) is not None
    if config.model.lora is not None and has_critic and config.critic.lora is None:
        raise ConfigError(
            f"model.lora is set and {config.algorithm.name} trains a critic, but critic.lora "
            "is null: the critic would be fully fine-tuned next to a LoRA policy. Set "
            "critic.lora (e.g. {rank: 16, alpha: 32}) or remove model.lora",
            "critic.lora",
        )
    if config.critic.lora is not None and not has_critic:
        raise ConfigError(
            f"critic.lora is set but {config.algorithm.name} has no critic", "critic.lora"
        )


def validate(config: TrainConfig) -> TrainConfig:
    """Cross-checks the sections; returns the config with its hyperparameters converted.

    Checks that need the device count are in :func:`check_devices`.
    """
    hparams = _checked_hparams(config.algorithm)
    config = dataclasses.replace(
        config, algorithm=dataclasses.replace(config.algorithm, hparams=hparams)
    )
    if (config.rollout is None) != config.is_offline:
        raise ConfigError("rollout must be null exactly when algorithm.name is dpo", "rollout")
    _check_algorithm(config)
    _check_batch(config)
    _check_data(config)
    _check_rewards(config)
    _check_mesh(config.mesh)
    _check_placement(config)
    _check_kernel_tuning(config)
    _check_max_num_seqs(config)
    _check_seeds(config)
    _check_lora(config)
    _check_reward_components(config)
    return config


def _model_context(path: str) -> tuple[int, str] | None:
    """The context (max_position_embeddings) of the model a config names and where it was
    read, without loading it; ``None`` when it is not known before loading (the default model
    not converted yet, a path that does not exist: the loader reports that)."""
    from jaxrl_llm import models

    if path == models.TINY_RANDOM:
        return models.tiny_random_config().max_position_embeddings, "the tiny-random model"
    if path == "default":
        from jaxrl_llm.models.default import DEFAULT_MODEL_NAME, cache_dir

        folder = cache_dir() / DEFAULT_MODEL_NAME
        return models.model_context(folder) if (folder / "config.json").is_file() else None
    return models.model_context(path)


def check_model_limits(config: TrainConfig) -> None:
    """Checks the run's lengths against the policy's context, and that a ``model.tokenizer``
    folder holds a tokenizer, before any model is loaded.

    A sequence is a prompt (at most ``data.max_prompt_length`` tokens) plus its completion (at
    most ``rollout.max_new_tokens``, ``train.eval_max_new_tokens`` at evaluation, or
    ``preference.max_response_length`` for dpo), and must fit the model's positions:
    ``max_prompt_length + max_new_tokens ≤ max_position_embeddings``, read from config.json or
    the GGUF metadata (:func:`jaxrl_llm.models.model_context`).

    Raises:
      ConfigError: naming the keys, their sum and the model's context and where it was read.
      jaxrl_llm.models.ModelLoadError: the model's config.json or GGUF file is unreadable.
    """
    from jaxrl_llm.models.hub import check_tokenizer_folder

    tokenizer = config.model.tokenizer
    if tokenizer not in (None, "default") and Path(tokenizer).expanduser().is_dir():
        check_tokenizer_folder(Path(tokenizer).expanduser())
    found = _model_context(config.model.path)
    if found is None:
        return
    context, where = found
    prompt = config.data.max_prompt_length
    if config.rollout is None:
        lengths = [("preference.max_response_length", config.preference.max_response_length)]
    else:
        lengths = [("rollout.max_new_tokens", config.rollout.max_new_tokens)]
        if config.train.eval_max_new_tokens is not None:
            lengths.append(("train.eval_max_new_tokens", config.train.eval_max_new_tokens))
    for key, new in lengths:
        if prompt + new > context:
            raise ConfigError(
                f"data.max_prompt_length + {key} = {prompt} + {new} = {prompt + new} tokens: "
                f"expected at most the model's context of {context} tokens ({where}); lower "
                f"{key if new >= context else 'one of them'}",
                key,
            )


def check_model_paths(config: TrainConfig) -> None:
    """Checks that each local model folder the run reads exists, before any weight is read:
    the policy (``model.path``), its tokenizer, the critic checkpoint of a recipe that learns
    a critic (``critic.path``) and reward-model terms' folders. A typo in ``critic.path`` or
    a reward model's path is reported at once, naming its key, not after the policy has
    loaded. ``default`` (and ``tiny-random`` for the policy) needs no folder; relative paths
    are from the current directory, as the loaders read them.

    Raises:
      ConfigError: naming the key, the path and what it must be.
    """
    from jaxrl_llm.models import TINY_RANDOM

    model = "a local Hugging Face folder (config.json and safetensors) or .gguf file"
    named = [
        ("model.path", config.model.path, f"'default', '{TINY_RANDOM}' or {model}"),
        ("model.tokenizer", config.model.tokenizer, "'default' or a local tokenizer folder"),
    ]
    if not config.is_offline and getattr(build_recipe(config), "critic", None) is not None:
        critic = f"'default' or {model} of a value or reward model"
        named.append(("critic.path", config.critic.path, critic))
    for i, term in enumerate(config.rewards.terms):
        if term.type == "reward_model" and "score" not in term.kwargs and "path" in term.kwargs:
            key = f"rewards.terms[{i}].kwargs.path"
            named.append((key, term.kwargs["path"], f"{model} of a reward model"))
    for key, path, what in named:
        if path in (None, "default") or (key, path) == ("model.path", TINY_RANDOM):
            continue
        local = Path(str(path)).expanduser()
        if not local.exists():
            where = "" if local.is_absolute() else f" (from {Path.cwd()})"
            raise ConfigError(
                f"{key} = {path!r}: no such folder or file{where}; expected {what} (nothing is "
                "downloaded from a model hub)",
                key,
            )


def check_evaluation(config: TrainConfig) -> None:
    """Checks that the run has a held-out set to evaluate on (``jaxrl-llm evaluate``).

    Raises:
      ConfigError: ``data.eval_size`` is 0 (no held-out prompts or pairs).
    """
    if config.data.eval_size == 0:
        source = (
            "data.eval_path=FILE or N rows held out of data.path"
            if config.data.source == "file"
            else "N held-out arithmetic problems"
        )
        raise ConfigError(
            "data.eval_size = 0: this run has no held-out set, so there is nothing to evaluate; "
            f"give data.eval_size=N ({source}) on the command line",
            "data.eval_size",
        )


def mesh_axis_sizes(
    mesh: MeshConfig, device_count: int, *, where: str = "mesh", devices: str = "devices"
) -> dict[str, int]:
    """``{"data", "fsdp", "tensor"}`` sizes on a machine with ``device_count`` devices.

    A -1 axis takes every device the others leave. The product must divide ``device_count``; a
    mesh smaller than the machine runs on its first ``data × fsdp × tensor`` devices.
    ``where`` names the mesh's key and ``devices`` the devices in errors (split placement:
    ``placement.rollout_mesh`` and "rollout devices", or "train devices").
    """
    _check_mesh(mesh, where)
    sizes = {"data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor}
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if device_count % fixed:
        shown = ", ".join(f"{a}={s}" for a, s in sizes.items())
        raise ConfigError(
            f"{where} = ({shown}): the product of the axis sizes, {fixed}, does not divide the "
            f"{device_count} {devices}",
            where,
        )
    if -1 in sizes.values():
        auto = next(a for a, s in sizes.items() if s == -1)
        sizes[auto] = device_count // fixed
    return sizes


def placement_device_counts(
    config: TrainConfig, device_count: int, process_count: int = 1
) -> tuple[int, int]:
    """``(rollout, train)`` device counts of the run: with ``placement.mode = split`` each of
    the ``process_count`` processes gives the first ``k = rollout_fraction × local`` of its
    ``local = device_count / process_count`` devices to the rollout and the rest to training
    (``jaxrl_llm.train.placement.carve_devices``); colocated: ``(device_count,
    device_count)``, one mesh for both.

    Raises:
      ConfigError: too few devices per process (split needs one on each side), or ``k`` not
        a whole number of devices in ``[1, local - 1]``, naming ``placement.rollout_fraction``.
    """
    p = config.placement
    if p.mode != "split":
        return device_count, device_count
    if process_count < 1 or device_count % process_count:
        raise ConfigError(
            f"{device_count} devices over {process_count} processes: expected the same number "
            "of devices on every process",
            "placement",
        )
    local = device_count // process_count
    where = (
        f"{local} devices of each of the {process_count} processes"
        if process_count > 1
        else (f"{local} devices")
    )
    if local < 2:
        raise ConfigError(
            f"placement.mode = 'split' on {where}: expected at least 2 devices per process "
            "(one for the rollout, one for training); use placement.mode = 'colocated'",
            "placement.mode",
        )
    share = p.rollout_fraction * local
    k = round(share)
    if abs(share - k) > 1e-6 or not 1 <= k <= local - 1:
        whole = ", ".join(f"{i}/{local}" for i in range(1, min(local, 5)))
        raise ConfigError(
            f"placement.rollout_fraction = {p.rollout_fraction!r}: {share:g} of the {where}; "
            f"expected a whole number of rollout devices in [1, {local - 1}] per process "
            f"(e.g. {whole}{', ...' if local > 5 else ''})",
            "placement.rollout_fraction",
        )
    return k * process_count, (local - k) * process_count


def _check_rollout_tensor_parallel(
    config: TrainConfig, n_rollout: int, local: int, process_count: int
) -> None:
    """``rollout.tensor_parallel`` t: the paged engine's devices per engine, so t divides the
    rollout's devices and each process's share of them, ``local`` (an engine's devices
    belong to one process)."""
    t = 0 if config.rollout is None else config.rollout.tensor_parallel
    if not t:
        return
    r = config.rollout
    never_stops = r.stop_token_ids is not None and len(r.stop_token_ids) == 0
    # auto is paged for partial rollouts over several processes (train.setup.rollout_engine)
    never_stops = never_stops and not (config.train.partial_rollout_tokens and process_count > 1)
    if r.engine == "static" or (r.engine == "auto" and never_stops):
        why = "static" if r.engine == "static" else "auto with stop_token_ids = [] (static)"
        raise ConfigError(
            f"rollout.tensor_parallel = {t}: it sizes the paged engines, but rollout.engine = "
            f"{why} (set rollout.engine: paged, or rollout.tensor_parallel: 0)"
        )
    if n_rollout % t or local % t:
        raise ConfigError(
            f"rollout.tensor_parallel = {t}: expected a divisor of the rollout's {n_rollout} "
            f"devices and of each process's {local} (each engine runs on t devices of one "
            "process)"
        )


def check_devices(
    config: TrainConfig, device_count: int, *, process_count: int = 1
) -> dict[str, int]:
    """Checks the mesh and the batch split for ``device_count`` devices; returns the axis sizes.

    The batch is split over the data-parallel axes ``data × fsdp``: the batch, the update batch
    (B·m with PODS), each minibatch and each micro-batch must be a multiple of that size. With
    ``placement.mode = split`` the devices are first carved (:func:`placement_device_counts`,
    over ``process_count`` processes): ``mesh`` is then the train mesh over the train devices
    and ``placement.rollout_mesh`` must fit the rollout devices; the sizes returned are the
    train mesh's.
    """
    if device_count < 1:
        raise ConfigError(f"device_count = {device_count}: expected ≥ 1")
    n_rollout, n_train = placement_device_counts(config, device_count, process_count)
    devices = "devices"
    if config.placement.mode == "split":
        devices = f"train devices (of {device_count}; {n_rollout} go to the rollout)"
        mesh_axis_sizes(
            config.placement.rollout_mesh,
            n_rollout,
            where="placement.rollout_mesh",
            devices=f"rollout devices (of {device_count})",
        )
    sizes = mesh_axis_sizes(config.mesh, n_train, devices=devices)
    _check_rollout_tensor_parallel(
        config, n_rollout, n_rollout // max(process_count, 1), process_count
    )
    n = 0 if config.is_offline else config.train.partial_rollout_tokens
    if n and process_count > 1 and config.rollout.engine == "static":
        raise ConfigError(
            f"train.partial_rollout_tokens = {n} with rollout.engine = static in a run of "
            f"{process_count} processes: partial rollouts run the static engine in one process "
            "only; expected rollout.engine = paged (or auto)",
            "rollout.engine",
        )
    dp = sizes["data"] * sizes["fsdp"]
    batch, update = config.batch_size, config.update_batch_size
    minibatch = update // config.optim.num_minibatches
    parts = [("the batch", batch, "rollout.prompts_per_step × rollout.num_samples")]
    if config.rollout is None:
        parts = [("the batch", batch, "preference.pairs_per_step")]
    split = "batch / optim.num_minibatches"
    if update != batch:  # PODS: the update sees m of the G answers of each prompt
        pods = "rollout.prompts_per_step × algorithm.hparams.pods_num_keep"
        parts.append(("the update batch", update, pods))
        split = "update " + split
    parts.append(("each minibatch", minibatch, split))
    if config.optim.micro_batch_size is not None:
        parts.append(("each micro-batch", config.optim.micro_batch_size, "optim.micro_batch_size"))
    for what, size, formula in parts:
        if size % dp:
            raise ConfigError(
                f"{what} of {size} ({formula}) is not a multiple of the data-parallel size "
                f"{dp} (mesh data={sizes['data']} × fsdp={sizes['fsdp']} on {n_train} "
                f"{devices})",
                "mesh",
            )
    return sizes


__all__ = [
    "GROUP_RECIPES",
    "RATIO_FREE_RECIPES",
    "REWARD_TYPES",
    "apply_overrides",
    "build_recipe",
    "check_devices",
    "check_evaluation",
    "check_model_limits",
    "data_format",
    "describe_configs",
    "from_dict",
    "load_config",
    "merge_overrides",
    "mesh_axis_sizes",
    "needs_reference_model",
    "placement_device_counts",
    "recipe_hparams",
    "resolve_config",
    "save_config",
    "shipped_configs",
    "to_yaml",
    "validate",
]
