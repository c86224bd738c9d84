"""The training run's config: typed, frozen dataclasses read from YAML files and overrides.

Three modules, one idea each:

* :mod:`~jaxrl_llm.config.engine` — the generic typed-YAML engine: dataclasses from YAML with
  ``base:``/``defaults:`` includes, ``dotted.key=value`` overrides, unknown keys rejected with
  suggestions, type and bound checks, :class:`ConfigError` naming the key at fault;
* :mod:`~jaxrl_llm.config.schema` — the run's sections (:class:`TrainConfig` and its parts), one
  comment per knob; ``configs/base.yaml`` documents the same knobs for users;
* :mod:`~jaxrl_llm.config.validation` — :func:`load_config` and the checks across sections that
  know the recipes, rewards and device mesh, plus :func:`build_recipe` and friends.

Everything is re-exported here: ``from jaxrl_llm.config import load_config, TrainConfig``.
"""

from jaxrl_llm.config.engine import (
    MISSING,
    ConfigError,
    FrozenDict,
    parse_override,
    to_dict,
)
from jaxrl_llm.config.schema import (
    AlgorithmConfig,
    ArithmeticConfig,
    CriticConfig,
    DataConfig,
    KLConfig,
    LoggingConfig,
    LoopConfig,
    MeshConfig,
    ModelLoadConfig,
    NumericsName,
    OldLogprobsConfig,
    OptimConfig,
    PlacementConfig,
    PreferenceConfig,
    RecipeName,
    RewardsConfig,
    RewardTermConfig,
    RolloutConfig,
    TrackioConfig,
    TrainConfig,
    WandbConfig,
)
from jaxrl_llm.config.validation import (
    GROUP_RECIPES,
    RATIO_FREE_RECIPES,
    REWARD_TYPES,
    apply_overrides,
    build_recipe,
    check_devices,
    check_evaluation,
    check_model_limits,
    check_model_paths,
    data_format,
    describe_configs,
    from_dict,
    load_config,
    merge_overrides,
    mesh_axis_sizes,
    needs_reference_model,
    placement_device_counts,
    recipe_hparams,
    resolve_config,
    save_config,
    shipped_configs,
    to_yaml,
    validate,
)

__all__ = [
    "GROUP_RECIPES",
    "MISSING",
    "RATIO_FREE_RECIPES",
    "REWARD_TYPES",
    "AlgorithmConfig",
    "ArithmeticConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "FrozenDict",
    "KLConfig",
    "LoggingConfig",
    "LoopConfig",
    "MeshConfig",
    "ModelLoadConfig",
    "NumericsName",
    "OldLogprobsConfig",
    "OptimConfig",
    "PlacementConfig",
    "PreferenceConfig",
    "RecipeName",
    "RewardTermConfig",
    "RewardsConfig",
    "RolloutConfig",
    "TrackioConfig",
    "TrainConfig",
    "WandbConfig",
    "apply_overrides",
    "build_recipe",
    "check_devices",
    "check_evaluation",
    "check_model_limits",
    "check_model_paths",
    "data_format",
    "describe_configs",
    "from_dict",
    "load_config",
    "merge_overrides",
    "mesh_axis_sizes",
    "needs_reference_model",
    "parse_override",
    "placement_device_counts",
    "recipe_hparams",
    "resolve_config",
    "save_config",
    "shipped_configs",
    "to_dict",
    "to_yaml",
    "validate",
]
