"""The training run as frozen dataclasses: YAML files, dotted overrides and validation.

One :class:`TrainConfig` describes a whole run; each section is a frozen, slotted dataclass
(flax gemma's ``transformer_cfg.py`` style), so a resolved config is an immutable value that can be
compared, hashed and saved. ``configs/base.yaml`` documents every knob once.

Loading (:func:`load_config`) goes: read the YAML file (a ``base:`` or ``defaults:`` key includes
other YAML files, relative to the including file, merged underneath) → merge the dotted overrides
``a.b.c=value`` (values parsed as YAML) → build the dataclasses (unknown keys, wrong types and
out-of-range values are errors) → cross-check the sections (impossible combinations). Every
problem raises :class:`ConfigError` naming the key path, the value and what was expected.

Two merge rules keep layered configs honest: when a layer changes ``algorithm.name``, the
``algorithm.hparams`` of the layers below are dropped (they belonged to another recipe); and
``dpo``, which trains offline on preference pairs, takes ``rollout: null`` (an absent rollout
section is fine; a non-null one is an error rather than silently ignored).

Strings are resolved here and in the CLI, never below: :func:`build_recipe` turns the algorithm
section into a :class:`~jaxrl_llm.recipe.Recipe` with plain keyword arguments.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import os
import re
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from jaxrl_llm import algorithms
from jaxrl_llm.core import kl as _kl

# ---------------------------------------------------------------------------------------------
# Errors and an immutable mapping.


class ConfigError(ValueError):
    """A config that cannot run; the message names the key path, the value and what was expected.

    Attributes:
      key: the dotted key path at fault (``""`` for the file as a whole).
    """

    def __init__(self, message: str, key: str = ""):
        super().__init__(message)
        self.key = key


def _bad(key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"{key} = {value!r}: expected {expected}", key)


class FrozenDict(Mapping):
    """A hashable, read-only dict for ``algorithm.hparams`` and reward ``kwargs``."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping | None = None):
        object.__setattr__(self, "_data", dict(data or {}))

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self) -> Iterator:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._data.items(), key=lambda kv: str(kv[0]))))

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"

    def __setattr__(self, name, value):
        raise AttributeError("FrozenDict is immutable")

    def __reduce__(self):
        return (FrozenDict, (self._data,))


def _freeze(value: Any) -> Any:
    """Lists become tuples and mappings FrozenDicts, recursively, so configs stay hashable."""
    if isinstance(value, Mapping):
        return FrozenDict({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


def _field(default: Any = dataclasses.MISSING, **bounds: float) -> Any:
    """A dataclass field with numeric bounds (``ge``, ``gt``, ``le``, ``lt``) checked on load."""
    if isinstance(default, FrozenDict | tuple) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: default, metadata=bounds)
    return dataclasses.field(default=default, metadata=bounds)


_CONFIG = dict(frozen=True, slots=True, kw_only=True)

# ---------------------------------------------------------------------------------------------
# The schema. Defaults are those of configs/base.yaml, which documents each field.

RecipeName = Literal[
    "reinforce",
    "ppo",
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "dapo",
    "gspo",
    "dpo",
]
# Recipes whose baseline or normalisation compares the G answers of a prompt.
GROUP_RECIPES = ("grpo", "dr_grpo", "rloo", "dapo", "gspo", "reinforce_pp_baseline")
# Recipes whose loss is −A·log π without an importance ratio: only on-policy updates are unbiased.
RATIO_FREE_RECIPES = ("reinforce", "rloo")
# Built-in reward types (host-side, see jaxrl_llm.rewards); "module:function" names a user's.
REWARD_TYPES = ("integer_answer", "gsm8k", "boxed", "regex", "length_penalty", "reward_model")
# Recipe keyword arguments that come from other config keys, never from algorithm.hparams.
_MANAGED_HPARAMS = {
    "numerics": "algorithm.numerics",
    "kl_controller": "kl.controller",
    "axis_name": "the mesh (the trainer sets it)",
}
MISSING = "???"  # a required value a config leaves to the command line (e.g. model.path=???)


@dataclasses.dataclass(**_CONFIG)
class ModelLoadConfig:
    """The policy: where its weights come from and how it runs."""

    path: str = "default"
    tokenizer: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: Literal["none", "full", "dots", "dots_no_batch"] = "none"
    trust_remote_code: bool = False
    allow_pickle: bool = False


@dataclasses.dataclass(**_CONFIG)
class AlgorithmConfig:
    """The recipe: ``jaxrl_llm.algorithms.RECIPES[name](**hparams, numerics=numerics)``."""

    name: RecipeName = "grpo"
    numerics: Literal["default", "verl", "trl", "openrlhf"] = "default"
    hparams: Mapping[str, Any] = _field(FrozenDict())


@dataclasses.dataclass(**_CONFIG)
class RolloutConfig:
    """Generation of the training batch: B prompts × G samples each."""

    prompts_per_step: int = _field(16, ge=1)
    num_samples: int = _field(8, ge=1)
    max_new_tokens: int = _field(256, ge=1)
    temperature: float = _field(1.0, gt=0)
    top_k: int = _field(0, ge=0)
    top_p: float = _field(1.0, gt=0, le=1)
    stop_token_ids: tuple[int, ...] | None = None
    cache_dtype: Literal["auto", "float32", "bfloat16"] = "auto"


@dataclasses.dataclass(**_CONFIG)
class PreferenceConfig:
    """Offline preference training (dpo): the batch of (prompt, chosen, rejected) pairs."""

    pairs_per_step: int = _field(16, ge=1)
    max_response_length: int = _field(512, ge=1)


@dataclasses.dataclass(**_CONFIG)
class ArithmeticConfig:
    """The built-in task: integer arithmetic prompts generated from ``data.seed``."""

    train_size: int = _field(4000, ge=1)
    min_operand: int = 0
    max_operand: int = 99
    num_operands: int = _field(2, ge=2, le=2)  # the built-in generator makes a ∘ b problems
    operations: tuple[Literal["+", "-", "*"], ...] = ("+", "-")


@dataclasses.dataclass(**_CONFIG)
class DataConfig:
    """Prompts (and answers) for training and evaluation."""

    source: Literal["arithmetic", "file"] = "arithmetic"
    path: str | None = None
    format: Literal["auto", "jsonl", "parquet", "csv"] = "auto"
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    system_prompt: str | None = None
    chat_template: bool = True
    max_prompt_length: int = _field(256, ge=1)
    eval_path: str | None = None
    eval_size: int = _field(200, ge=0)
    shuffle: bool = True
    seed: int = 0
    arithmetic: ArithmeticConfig = dataclasses.field(default_factory=ArithmeticConfig)


@dataclasses.dataclass(**_CONFIG)
class RewardTermConfig:
    """One reward: a built-in type or ``module:function``, its weight and keyword arguments."""

    type: str
    weight: float = 1.0
    name: str | None = None
    kwargs: Mapping[str, Any] = _field(FrozenDict())

    @property
    def metric_name(self) -> str:
        return self.name or self.type


@dataclasses.dataclass(**_CONFIG)
class RewardsConfig:
    """The training reward: the weighted sum of ``terms``."""

    terms: tuple[RewardTermConfig, ...] = _field((RewardTermConfig(type="integer_answer"),))
    on_error: Literal["raise", "zero"] = "raise"


@dataclasses.dataclass(**_CONFIG)
class OptimConfig:
    """The policy's optimizer, schedule and the shape of each update."""

    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = _field(1e-6, gt=0)
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = _field(0, ge=0)
    final_lr_ratio: float = _field(0.0, ge=0, le=1)
    weight_decay: float = _field(0.0, ge=0)
    adam_b1: float = _field(0.9, ge=0, lt=1)
    adam_b2: float = _field(0.999, ge=0, lt=1)
    adam_eps: float = _field(1e-8, gt=0)
    momentum: float = _field(0.0, ge=0, lt=1)
    max_grad_norm: float | None = _field(1.0, gt=0)
    ppo_epochs: int = _field(1, ge=1)
    num_minibatches: int = _field(1, ge=1)
    micro_batch_size: int | None = _field(None, ge=1)


@dataclasses.dataclass(**_CONFIG)
class CriticConfig:
    """The value model of recipes that learn one (ppo); its own AdamW optimizer."""

    path: str | None = None
    lr: float = _field(1e-5, gt=0)
    warmup_steps: int = _field(0, ge=0)


@dataclasses.dataclass(**_CONFIG)
class KLConfig:
    """How β evolves, and the frozen reference model (loaded only when a KL is used)."""

    controller: Literal["fixed", "adaptive"] = "fixed"
    target: float = _field(0.1, gt=0)
    horizon: float = _field(10000.0, gt=0)
    reference_param_dtype: Literal["float32", "bfloat16"] = "float32"


@dataclasses.dataclass(**_CONFIG)
class OldLogprobsConfig:
    """Where π_old of the importance ratio comes from."""

    source: Literal["recompute", "sampler"] = "recompute"
    tis_cap: float | None = _field(2.0, ge=1)


@dataclasses.dataclass(**_CONFIG)
class LoopConfig:
    """The ``train:`` section: steps, seeds, evaluation, checkpoints, logging."""

    max_steps: int = _field(100, ge=1)
    seed: int = 0
    log_every: int = _field(1, ge=1)
    eval_every: int = _field(25, ge=0)
    eval_mode: Literal["greedy", "sampled"] = "greedy"
    eval_max_new_tokens: int | None = _field(None, ge=1)
    save_every: int = _field(50, ge=0)
    keep_checkpoints: int = _field(3, ge=1)
    max_refill_batches: int = _field(3, ge=0)
    on_nonfinite: Literal["raise", "skip"] = "raise"


@dataclasses.dataclass(**_CONFIG)
class MeshConfig:
    """Device mesh ``(data, fsdp, tensor)``; one size may be -1 (all remaining devices)."""

    preset: Literal["dp", "fsdp", "fsdp_tp"] = "dp"
    data: int = -1
    fsdp: int = 1
    tensor: int = 1


@dataclasses.dataclass(**_CONFIG)
class TrainConfig:
    """A whole training run. ``rollout`` is ``None`` exactly when the recipe is ``dpo``."""

    model: ModelLoadConfig = dataclasses.field(default_factory=ModelLoadConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig | None = dataclasses.field(default_factory=RolloutConfig)
    preference: PreferenceConfig = dataclasses.field(default_factory=PreferenceConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rewards: RewardsConfig = dataclasses.field(default_factory=RewardsConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
    kl: KLConfig = dataclasses.field(default_factory=KLConfig)
    old_logprobs: OldLogprobsConfig = dataclasses.field(default_factory=OldLogprobsConfig)
    train: LoopConfig = dataclasses.field(default_factory=LoopConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    run_dir: str | None = None

    @property
    def is_offline(self) -> bool:
        """True for preference training (dpo): no generation, no rewards."""
        return self.algorithm.name == "dpo"

    @property
    def batch_size(self) -> int:
        """Sequences per step: B·G for online recipes, pairs for dpo."""
        if self.rollout is None:
            return self.preference.pairs_per_step
        return self.rollout.prompts_per_step * self.rollout.num_samples

    @property
    def update_batch_size(self) -> int:
        """Sequences per update: B·m when PODS keeps m = ``pods_num_keep`` of the G answers,
        else :attr:`batch_size`."""
        keep = None if self.rollout is None else self.algorithm.hparams.get("pods_num_keep")
        return self.batch_size if keep is None else self.rollout.prompts_per_step * keep


# ---------------------------------------------------------------------------------------------
# YAML: reading with includes, merging, overrides, writing.

_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-6`` as a float (YAML 1.1 wants ``1.0e-6``) and rejects
    duplicate keys instead of keeping the last one silently."""


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes strings _Loader would read as floats."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict:
    loader.flatten_mapping(node)
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, typing.Hashable) and key in seen:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping",
                node.start_mark,
                f"duplicate key {key!r}",
                key_node.start_mark,
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark else where
        detail = " ".join(str(s) for s in (e.context, e.problem) if s)
        raise ConfigError(f"{at}: malformed YAML: {detail}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: malformed YAML: {e}") from None


def _effective_name(section: Any) -> Any:
    if not isinstance(section, Mapping):
        return None
    return section.get("name", AlgorithmConfig().name)


def _merge(base: Mapping, child: Mapping, path: tuple[str, ...] = ()) -> dict:
    """``child`` over ``base``: mappings merge key by key, anything else replaces.

    When ``child`` changes ``algorithm.name``, ``base``'s ``algorithm.hparams`` are dropped.
    """
    out = dict(base)
    for key, value in child.items():
        old = out.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            renamed = "name" in value and _effective_name(old) != value["name"]
            if (*path, key) == ("algorithm",) and renamed:
                old = {k: v for k, v in old.items() if k != "hparams"}
            out[key] = _merge(old, value, (*path, key))
        else:
            out[key] = value
    return out


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    """A YAML file with its ``base:`` / ``defaults:`` includes merged underneath."""
    where = str(path)
    if not path.is_file():
        via = f" (included from {chain[-1]})" if chain else ""
        raise ConfigError(f"config file not found: {where}{via}")
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(str(p) for p in (*chain, resolved))
        raise ConfigError(f"{where}: include cycle: {cycle}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    raw = _parse_yaml(text, where)
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping of sections at the top level, got {raw!r}")
    raw = dict(raw)
    if "base" in raw and "defaults" in raw:
        raise ConfigError(f"{where}: give `base:` or `defaults:`, not both", "base")
    key = "base" if "base" in raw else "defaults"
    includes = raw.pop(key, None)
    if includes is None:
        includes = []
    elif isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise _bad(key, includes, "a relative path to a YAML file, or a list of them")
    merged: dict = {}
    for include in includes:
        merged = _merge(merged, _read_yaml(path.parent / include, (*chain, resolved)))
    return _merge(merged, raw)


_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_override(item: str) -> dict:
    """``"a.b.c=value"`` → ``{"a": {"b": {"c": value}}}``, the value parsed as YAML.

    A value that is not valid YAML is taken as a plain string.
    """
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected `dotted.key=value`, e.g. optim.lr=1e-6")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(_KEY_RE.match(p) for p in parts):
        raise ConfigError(f"override {item!r}: {key.strip()!r} is not a dotted key like a.b.c")
    try:
        value = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        value = text
    for part in reversed(parts):
        value = {part: value}
    return value


def merge_overrides(raw: Mapping, overrides: Sequence[str]) -> dict:
    """Applies dotted overrides in order (a later one wins) to a raw config mapping."""
    if isinstance(overrides, str):
        raise TypeError("overrides must be a list of 'key=value' strings, not one string")
    out = dict(raw)
    for item in overrides:
        out = _merge(out, parse_override(item))
    return out


def load_config(
    path: str | os.PathLike,
    overrides: Sequence[str] = (),
    *,
    device_count: int | None = None,
) -> TrainConfig:
    """Reads, merges, overrides and validates a config file.

    Args:
      path: a YAML file; ``base:`` / ``defaults:`` include others relative to it.
      overrides: ``"dotted.key=value"`` strings applied after the file, in order.
      device_count: also check the mesh and batch divisibility for this many devices
        (:func:`check_devices`); ``None`` skips that check (the trainer runs it with
        ``jax.device_count()``).

    Raises:
      ConfigError: naming the key, the value and what was expected.
    """
    raw = merge_overrides(_read_yaml(Path(path)), overrides)
    config = from_dict(raw)
    if device_count is not None:
        check_devices(config, device_count)
    return config


def to_dict(config: Any) -> Any:
    """Plain dicts, lists and scalars (YAML-ready) from a config or any of its sections."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, Mapping):
        return {k: to_dict(v) for k, v in config.items()}
    if isinstance(config, list | tuple):
        return [to_dict(v) for v in config]
    return config


def to_yaml(config: TrainConfig) -> str:
    """The resolved config as YAML; :func:`load_config` reads it back to an equal config."""
    body = yaml.dump(
        to_dict(config), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100
    )
    return "# Resolved jaxrl_llm config (all defaults filled in).\n" + body


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


# ---------------------------------------------------------------------------------------------
# Building the dataclasses from raw mappings, with type and range checks.


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _suggest(name: Any, valid: Sequence[Any], prefix: str = "") -> str:
    options = {str(v): v for v in valid}
    close = difflib.get_close_matches(str(name), list(options), n=1, cutoff=0.6)
    if not close:
        return ""
    best = options[close[0]]
    return f"; did you mean {_join(prefix, best) if prefix else best!r}?"


def _unknown(key: str, name: Any, valid: Sequence[str], why: str = "") -> ConfigError:
    full = _join(key, str(name))
    return ConfigError(
        f"unknown key {full!r}{why}{_suggest(name, valid, key)} (valid keys of "
        f"{key or 'the top level'}: {', '.join(valid)})",
        full,
    )


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        return f"a list (each {_describe(args[0])})"
    if dataclasses.is_dataclass(hint):
        return f"a mapping ({hint.__name__})"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(hint, "a mapping" if origin is Mapping else str(hint))


def _convert(value: Any, hint: Any, key: str) -> Any:
    """``value`` checked against the type ``hint`` (and converted: int → float, list → tuple)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options:
            try:
                return _convert(value, option, key)
            except ConfigError:
                if len(options) == 1:
                    raise
        raise _bad(key, value, _describe(hint))
    if hint is Any:
        return _freeze(value)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key)
    if origin is Literal:
        if isinstance(value, str | int | float) and not isinstance(value, bool) and value in args:
            return value
        raise ConfigError(
            f"{key} = {value!r}: expected {_describe(hint)}{_suggest(value, args)}", key
        )
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if math.isfinite(value):
                return float(value)
            raise _bad(key, value, "a finite number")
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin is tuple:
        if isinstance(value, list | tuple):
            return tuple(_convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    elif origin is Mapping:
        if isinstance(value, Mapping):
            if not all(isinstance(k, str) for k in value):
                raise _bad(key, value, "a mapping with string keys")
            return _freeze(value)
    else:
        return value
    raise ConfigError(
        f"{key} = {value!r}: expected {_describe(hint)}, got {type(value).__name__}", key
    )


_BOUNDS = {
    "ge": (lambda v, b: v >= b, "≥"),
    "gt": (lambda v, b: v > b, ">"),
    "le": (lambda v, b: v <= b, "≤"),
    "lt": (lambda v, b: v < b, "<"),
}


def _check_bounds(value: Any, field: dataclasses.Field, hint: Any, key: str) -> None:
    if value is None or not field.metadata:
        return
    for name, bound in field.metadata.items():
        if not _BOUNDS[name][0](value, bound):
            limits = " and ".join(f"{_BOUNDS[n][1]} {b:g}" for n, b in field.metadata.items())
            kind = "an integer" if isinstance(value, int) else "a number"
            null = " (or null)" if type(None) in typing.get_args(hint) else ""
            raise _bad(key, value, f"{kind} {limits}{null}")


def _build(cls: type, raw: Any, key: str) -> Any:
    if not isinstance(raw, Mapping):
        where = key or "the config"
        raise ConfigError(
            f"{where} = {raw!r}: expected a mapping with keys "
            f"{', '.join(f.name for f in dataclasses.fields(cls))}",
            key,
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for name in raw:
        if name not in fields:
            raise _unknown(key, name, list(fields))
    kwargs = {}
    for name, value in raw.items():
        sub = _join(key, name)
        kwargs[name] = _convert(value, hints[name], sub)
        _check_bounds(kwargs[name], fields[name], hints[name], sub)
    missing = [n for n, f in fields.items() if _is_required(f) and n not in kwargs]
    if missing:
        raise ConfigError(f"{_join(key, missing[0])} is required", _join(key, missing[0]))
    return cls(**kwargs)


def _is_required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _find_missing(raw: Any, key: str = "") -> str | None:
    if isinstance(raw, Mapping):
        for name, value in raw.items():
            found = _find_missing(value, _join(key, str(name)))
            if found:
                return found
    elif isinstance(raw, list):
        for i, value in enumerate(raw):
            found = _find_missing(value, f"{key}[{i}]")
            if found:
                return found
    elif raw == MISSING:
        return key
    return None


def from_dict(raw: Mapping) -> TrainConfig:
    """Builds and validates a :class:`TrainConfig` from a raw (YAML-shaped) mapping."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"the config = {raw!r}: expected a mapping of sections")
    missing = _find_missing(raw)
    if missing:
        raise ConfigError(
            f"{missing} is required (the config leaves it as {MISSING}); set it on the command "
            f"line, e.g. `{missing}=...`",
            missing,
        )
    raw = dict(raw)
    name = _effective_name(raw.get("algorithm", {}))
    if name == "dpo":
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


def build_recipe(config: TrainConfig, **extra: Any):
    """The :class:`~jaxrl_llm.recipe.Recipe` the config names (``extra``: e.g. ``axis_name``)."""
    name = config.algorithm.name
    kwargs = dict(config.algorithm.hparams, numerics=config.algorithm.numerics, **extra)
    if config.kl.controller == "adaptive":
        kwargs["kl_controller"] = _kl.adaptive_kl_controller(
            float(recipe_hparams(config)["beta"]),
            target=config.kl.target,
            horizon=config.kl.horizon,
        )
    return _recipe_fn(name)(**kwargs)


def needs_reference_model(config: TrainConfig) -> bool:
    """Whether the run loads a frozen reference copy of the policy.

    Online recipes need it only when a KL is used (β > 0 or an adaptive controller); dpo needs it
    except for the reference-free SimPO loss.
    """
    hp = recipe_hparams(config)
    if config.is_offline:
        return hp["loss_type"] != "simpo"
    return float(hp.get("beta") or 0.0) > 0 or config.kl.controller == "adaptive"


def _check_algorithm(config: TrainConfig) -> None:
    name, hp = config.algorithm.name, recipe_hparams(config)
    if config.kl.controller == "adaptive":
        if "kl_controller" not in inspect.signature(_recipe_fn(name)).parameters:
            raise _bad(
                "kl.controller",
                "adaptive",
                f"'fixed' for {name}: an adaptive β steers a KL folded into the reward, which "
                "only reinforce, ppo, rloo and reinforce_pp do",
            )
        if not float(hp.get("beta") or 0.0) > 0:
            raise _bad(
                "algorithm.hparams.beta",
                hp.get("beta"),
                "β > 0 with kl.controller=adaptive (the controller scales β multiplicatively)",
            )
    estimator = hp.get("kl_estimator")
    if estimator is not None and estimator not in _kl.KL_ESTIMATORS:
        raise ConfigError(
            f"algorithm.hparams.kl_estimator = {estimator!r}: expected one of "
            f"{', '.join(_kl.KL_ESTIMATORS)}{_suggest(estimator, list(_kl.KL_ESTIMATORS))}",
            "algorithm.hparams.kl_estimator",
        )
    try:
        build_recipe(config)
    except (ValueError, TypeError) as e:
        raise ConfigError(
            f"algorithm.hparams = {dict(config.algorithm.hparams)!r}: {e}", "algorithm.hparams"
        ) from None
    if config.rollout is None:
        return
    rollout = config.rollout
    g = rollout.num_samples
    if name in GROUP_RECIPES and g < 2:
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
    if name == "dapo" and hp.get("max_length") is not None:
        if hp["max_length"] > rollout.max_new_tokens:
            raise _bad(
                "algorithm.hparams.max_length",
                hp["max_length"],
                f"≤ rollout.max_new_tokens = {rollout.max_new_tokens} (DAPO's overlong "
                "shaping is measured against the generation limit)",
            )
        if not 0 < hp["overlong_buffer"] < hp["max_length"]:
            raise _bad(
                "algorithm.hparams.overlong_buffer",
                hp["overlong_buffer"],
                f"0 < buffer < max_length = {hp['max_length']}",
            )
    if name in RATIO_FREE_RECIPES:
        for field in ("ppo_epochs", "num_minibatches"):
            if getattr(config.optim, field) != 1:
                raise _bad(
                    f"optim.{field}",
                    getattr(config.optim, field),
                    f"1 for {name}: its loss −A·log π has no importance ratio, so every update "
                    "after the first on a batch would be off-policy and biased",
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


def _check_mesh(mesh: MeshConfig) -> None:
    sizes = {"data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor}
    for axis, size in sizes.items():
        if size != -1 and size < 1:
            raise _bad(f"mesh.{axis}", size, "a size ≥ 1, or -1 for all remaining devices")
    if list(sizes.values()).count(-1) > 1:
        raise ConfigError(
            f"mesh = {sizes}: at most one axis may be -1 (all remaining devices)", "mesh"
        )
    if mesh.preset == "dp" and (mesh.fsdp != 1 or mesh.tensor != 1):
        raise _bad("mesh.preset", "dp", "'fsdp' or 'fsdp_tp' for a mesh with fsdp or tensor > 1")
    if mesh.preset == "fsdp" and mesh.tensor != 1:
        raise _bad("mesh.tensor", mesh.tensor, "1 with mesh.preset=fsdp (use fsdp_tp)")
    if mesh.preset == "fsdp_tp" and mesh.tensor == 1:
        raise _bad("mesh.tensor", 1, "≥ 2 (or -1) with mesh.preset=fsdp_tp")


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
    return config


def mesh_axis_sizes(mesh: MeshConfig, device_count: int) -> dict[str, int]:
    """``{"data", "fsdp", "tensor"}`` sizes on a machine with ``device_count`` devices.

    A -1 axis takes every device the others leave. The product must divide ``device_count``; a
    mesh smaller than the machine runs on its first ``data × fsdp × tensor`` devices.
    """
    _check_mesh(mesh)
    sizes = {"data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor}
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if device_count % fixed:
        shown = ", ".join(f"{a}={s}" for a, s in sizes.items())
        raise ConfigError(
            f"mesh = ({shown}): the product of the axis sizes, {fixed}, does not divide the "
            f"{device_count} devices",
            "mesh",
        )
    if -1 in sizes.values():
        auto = next(a for a, s in sizes.items() if s == -1)
        sizes[auto] = device_count // fixed
    return sizes


def check_devices(config: TrainConfig, device_count: int) -> dict[str, int]:
    """Checks the mesh and the batch split for ``device_count`` devices; returns the axis sizes.

    The batch is split over the data-parallel axes ``data × fsdp``: the batch, the update batch
    (B·m with PODS), each minibatch and each micro-batch must be a multiple of that size.
    """
    if device_count < 1:
        raise ConfigError(f"device_count = {device_count}: expected ≥ 1")
    sizes = mesh_axis_sizes(config.mesh, device_count)
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
                f"{dp} (mesh data={sizes['data']} × fsdp={sizes['fsdp']} on {device_count} "
                "devices)",
                "mesh",
            )
    return sizes


__all__ = [
    "GROUP_RECIPES",
    "MISSING",
    "REWARD_TYPES",
    "AlgorithmConfig",
    "ArithmeticConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "FrozenDict",
    "KLConfig",
    "LoopConfig",
    "MeshConfig",
    "ModelLoadConfig",
    "OldLogprobsConfig",
    "OptimConfig",
    "PreferenceConfig",
    "RewardTermConfig",
    "RewardsConfig",
    "RolloutConfig",
    "TrainConfig",
    "apply_overrides",
    "build_recipe",
    "check_devices",
    "data_format",
    "from_dict",
    "load_config",
    "merge_overrides",
    "mesh_axis_sizes",
    "needs_reference_model",
    "parse_override",
    "recipe_hparams",
    "save_config",
    "to_dict",
    "to_yaml",
    "validate",
]
