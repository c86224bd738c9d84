"""The training run's schema: one frozen dataclass per section of a config file.

One :class:`TrainConfig` describes a whole run. Each section is a frozen, slotted, kw-only
dataclass (flax gemma's ``transformer_cfg.py`` style) with one comment per knob: what it is, its
unit and what it does. A resolved config is therefore an immutable value that can be compared,
hashed and saved. Defaults and comments are those of ``configs/base.yaml``, which documents every
knob for users; loading it gives exactly ``TrainConfig()``.

The numeric bounds of a field (``_field(default, ge=..)``) are checked when a config is built
(:mod:`jaxrl_llm.config.engine`); checks across fields and sections, which need the recipe, are
in :mod:`jaxrl_llm.config.validation`. Recipe and numerics preset names come from
:data:`jaxrl_llm.algorithms.RECIPES` and :data:`jaxrl_llm.numerics.PRESETS`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Literal

from jaxrl_llm import algorithms
from jaxrl_llm import numerics as _numerics
from jaxrl_llm.config.engine import FrozenDict, _field
from jaxrl_llm.recipe import PREFERENCE_PAIRS
from jaxrl_llm.rewards.registry import ADAPTERS


def _first_names(table: Mapping[str, Any]) -> tuple[str, ...]:
    """The first name of each distinct value of ``table``; later names of a value are synonyms."""
    names: list[str] = []
    values: list[Any] = []
    for name, value in table.items():
        if not any(value is v for v in values):
            names.append(name)
            values.append(value)
    return tuple(names)


# The recipes a config may name: the keys of jaxrl_llm.algorithms.RECIPES.
RecipeName = Literal[tuple(algorithms.RECIPES)]
# The numerics presets of jaxrl_llm.numerics.PRESETS, one name each (default, verl, trl,
# openrlhf; the synonym "jaxrl_llm" of default is left out).
NumericsName = Literal[_first_names(_numerics.PRESETS)]

_CONFIG = dict(frozen=True, slots=True, kw_only=True)


@dataclasses.dataclass(**_CONFIG)
class LoRASection:
    """``model.lora`` (or ``critic.lora``): low-rank adapters on the frozen base (LoRA/QLoRA)."""

    # r: the adapters' rank.
    rank: int = _field(16, ge=1)
    # α: the adapter update is scaled by α / r (α / √r with use_rslora).
    alpha: float = _field(32.0, gt=0)
    # Dropout on the adapter branch's input in the update (PEFT's lora_dropout); policy only.
    dropout: float = _field(0.0, ge=0)
    # The projections adapted in every layer (HF names).
    targets: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    # Rank-stabilised scaling α / √r (Kalajdzievski 2023).
    use_rslora: bool = False
    # QLoRA: the frozen base stored quantised (int8, nf4, int4), dequantised in each matmul.
    quantize: Literal["none", "int8", "nf4", "int4"] = "none"
    # A PEFT adapter folder to start from; its rank, alpha and targets must match these.
    adapter: str | None = None
    # Rollouts sample from W + (α/r)·AB merged once per step, not from the adapters unmerged.
    merge_for_sampling: bool = False


@dataclasses.dataclass(**_CONFIG)
class ModelLoadConfig:
    """The policy: where its weights come from and how it runs."""

    # "default" (SmolLM2-135M-Instruct, shipped), "tiny-random", or an HF folder or .gguf file.
    path: str = "default"
    # Tokenizer folder; None uses the model's own.
    tokenizer: str | None = None
    # Compute dtype; auto is bfloat16 on accelerators and float32 on CPU.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Dtype the trained parameters are stored in (float32 master weights recommended).
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    # Activation checkpointing per layer (the layers then run as a scan): less memory, more FLOPs.
    remat: Literal["none", "full", "dots", "dots_no_batch"] = "none"
    # Attention kernel: auto (splash on TPU, cudnn on GPU, else reference) or one by name.
    attention: Literal["auto", "reference", "splash", "cudnn", "pallas_gpu"] = "auto"
    # Let transformers run Python code shipped with the tokenizer; off unless you trust it.
    trust_remote_code: bool = False
    # Read PyTorch .bin (pickle) weights, whose unpickling can run code; off unless trusted.
    allow_pickle: bool = False
    # LoRA / QLoRA: train adapters only, the base frozen (and the reference for free); None = off.
    lora: LoRASection | None = None


@dataclasses.dataclass(**_CONFIG)
class AlgorithmConfig:
    """The recipe: ``jaxrl_llm.algorithms.RECIPES[name](**hparams, numerics=numerics)``."""

    # The recipe, a key of jaxrl_llm.algorithms.RECIPES.
    name: RecipeName = "grpo"
    # Numerical conventions (std ddof, eps, clamps, loss denominators), a jaxrl_llm.numerics preset.
    numerics: NumericsName = "default"
    # The recipe's keyword arguments (β is `beta`); unset ones keep the paper's defaults.
    hparams: Mapping[str, Any] = _field(FrozenDict())


@dataclasses.dataclass(**_CONFIG)
class RolloutConfig:
    """Generation of the training batch: B prompts × G samples each."""

    # B: prompts drawn per training step.
    prompts_per_step: int = _field(16, ge=1)
    # G: completions sampled per prompt (≥ 2 for group recipes); the batch is B·G sequences.
    num_samples: int = _field(8, ge=1)
    # Maximum completion length, in tokens.
    max_new_tokens: int = _field(256, ge=1)
    # Sampling temperature; the sampler's log-probs are those of the tempered distribution.
    temperature: float = _field(1.0, gt=0)
    # Keep only the k most likely tokens; 0 turns top-k off.
    top_k: int = _field(0, ge=0)
    # Nucleus sampling: keep the smallest token set with this total probability; 1.0 = off.
    top_p: float = _field(1.0, gt=0, le=1)
    # Token ids that end a completion; None = the tokenizer's EOS, () = never stop early.
    stop_token_ids: tuple[int, ...] | None = None
    # KV-cache dtype; auto is the compute dtype.
    cache_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Sampler: auto (paged unless stop_token_ids = []), paged, static; docs/rollout.md.
    engine: Literal["auto", "paged", "static"] = "auto"
    # Paged engine's attention: auto (the TPU/GPU kernel, else reference); docs/rollout.md.
    paged_attention: Literal["auto", "reference", "pallas_gpu", "ragged_tpu"] = "auto"
    # Launch parameters of the paged engine's Pallas GPU decode kernel; {} = defaults; rollout.md.
    paged_kernel_tuning: Mapping[str, int] = _field(FrozenDict())
    # Devices per paged engine (vLLM's tensor_parallel_size); 0 = one per data shard; rollout.md.
    tensor_parallel: int = _field(0, ge=0)
    # Paged engine's decode slots (vLLM's max_num_seqs); 0 = min(next_pow2(B·G), 256).
    max_num_seqs: int = _field(0, ge=0)
    # Paged engine's KV pool in tokens (SGLang's max_total_tokens); 0 = sized as rollout.md says.
    max_total_tokens: int = _field(0, ge=0)
    # GPU/TPU memory in use while sampling, with no max_total_tokens (gpu_memory_utilization).
    memory_utilization: float = _field(0.9, gt=0, le=1)
    # Paged engine: prompts of a call that begin alike share those KV pages (prefix caching).
    prefix_sharing: bool = True
    # Data-parallel paged engines (of all processes) take each other's prompts waiting for room.
    work_stealing: bool = True
    # Completions cut at max_new_tokens carry no loss (TRL's mask_truncated_completions).
    mask_truncated_completions: bool = False
    # Also collect each token's full-vocabulary log-prob at τ = 1, no top-k/top-p (Groups).
    full_logprobs: bool = False


@dataclasses.dataclass(**_CONFIG)
class PreferenceConfig:
    """Offline preference training (dpo): the batch of (prompt, chosen, rejected) pairs."""

    # Preference pairs per training step.
    pairs_per_step: int = _field(16, ge=1)
    # Longest chosen/rejected answer, in tokens; longer pairs are dropped and counted.
    max_response_length: int = _field(512, ge=1)


@dataclasses.dataclass(**_CONFIG)
class ArithmeticConfig:
    """The built-in task: integer arithmetic prompts generated from ``data.seed``."""

    # Number of distinct training problems (evaluation problems are disjoint from them).
    train_size: int = _field(4000, ge=1)
    # Smallest operand.
    min_operand: int = 0
    # Largest operand.
    max_operand: int = 99
    # Operands per problem; the built-in generator makes a ∘ b problems, so exactly 2.
    num_operands: int = _field(2, ge=2, le=2)
    # Operators drawn from (quoted in YAML: "+", "-", "*").
    operations: tuple[Literal["+", "-", "*"], ...] = ("+", "-")


@dataclasses.dataclass(**_CONFIG)
class DataConfig:
    """Prompts (and answers) for training and evaluation."""

    # arithmetic (built in, generated from data.seed, no download) or file (data.path).
    source: Literal["arithmetic", "file"] = "arithmetic"
    # Training file (JSONL, Parquet or CSV) with source=file, relative to the working directory.
    path: str | None = None
    # File format; auto reads it from the extension (.jsonl/.json, .parquet, .csv).
    format: Literal["auto", "jsonl", "parquet", "csv"] = "auto"
    # Column holding the prompt text (or a list of chat messages).
    prompt_field: str = "prompt"
    # Column of the reference answer, passed to rewards (a struct's key: reward_model.ground_truth).
    answer_field: str = "answer"
    # dpo: column of the preferred answer.
    chosen_field: str = "chosen"
    # dpo: column of the rejected answer.
    rejected_field: str = "rejected"
    # System message put before each prompt; None keeps the chat template's default.
    system_prompt: str | None = None
    # Format prompts with the tokenizer's chat template (False: the raw prompt text).
    chat_template: bool = True
    # Longest prompt, in tokens after templating; longer prompts are dropped and counted.
    max_prompt_length: int = _field(256, ge=1)
    # Evaluation file; None holds out data.eval_size examples of the training data instead.
    eval_path: str | None = None
    # Number of evaluation prompts; 0 turns evaluation off.
    eval_size: int = _field(200, ge=0)
    # Shuffle the training prompts each epoch, seeded by data.seed.
    shuffle: bool = True
    # Seed of the data split and order; separate from train.seed so the eval set stays fixed.
    seed: int = 0
    # The built-in arithmetic task (source=arithmetic).
    arithmetic: ArithmeticConfig = dataclasses.field(default_factory=ArithmeticConfig)


@dataclasses.dataclass(**_CONFIG)
class RewardTermConfig:
    """One reward: a built-in type or ``module:function``, its weight and keyword arguments."""

    # A built-in reward type (validation.REWARD_TYPES) or a user's 'package.module:function'.
    type: str
    # Weight of this term in the sum.
    weight: float = 1.0
    # Metric name of the term; None uses the type.
    name: str | None = None
    # Keyword arguments passed to the reward.
    kwargs: Mapping[str, Any] = _field(FrozenDict())

    @property
    def metric_name(self) -> str:
        """The name the term is told apart by: its ``name``, else its function (verl and trl
        terms, ``rewards.registry.ADAPTERS``, name theirs in ``kwargs.function``), else its
        type."""
        function = self.kwargs.get("function") if self.type in ADAPTERS else None
        return self.name or (function if isinstance(function, str) else self.type)


@dataclasses.dataclass(**_CONFIG)
class RewardsConfig:
    """The training reward: the weighted sum of ``terms``."""

    # The reward terms, summed with their weights.
    terms: tuple[RewardTermConfig, ...] = _field((RewardTermConfig(type="integer_answer"),))
    # A reward that raises or returns NaN/inf or the wrong count: raise, or score 0 and count it.
    on_error: Literal["raise", "zero"] = "raise"
    # Seconds each term may take per batch; past it, a reward error (on_error). None = forever.
    timeout: float | None = _field(300.0, gt=0)


@dataclasses.dataclass(**_CONFIG)
class OptimConfig:
    """The policy's optimizer, schedule and the shape of each update."""

    # The policy's optimizer.
    optimizer: Literal["adamw", "sgd"] = "adamw"
    # Peak learning rate.
    lr: float = _field(1e-6, gt=0)
    # Learning-rate schedule after warmup (cosine/linear decay over train.max_steps).
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    # Linear warmup from 0, in training steps.
    warmup_steps: int = _field(0, ge=0)
    # Final learning rate of cosine/linear decay, as a fraction of lr.
    final_lr_ratio: float = _field(0.0, ge=0, le=1)
    # Decoupled weight decay (AdamW), or L2 for sgd.
    weight_decay: float = _field(0.0, ge=0)
    # Adam β1.
    adam_b1: float = _field(0.9, ge=0, lt=1)
    # Adam β2.
    adam_b2: float = _field(0.999, ge=0, lt=1)
    # Adam ε.
    adam_eps: float = _field(1e-8, gt=0)
    # SGD momentum (0 = plain SGD).
    momentum: float = _field(0.0, ge=0, lt=1)
    # Clip gradients to this global norm; None turns clipping off.
    max_grad_norm: float | None = _field(1.0, gt=0)
    # Passes over each rollout batch (PPO epochs).
    ppo_epochs: int = _field(1, ge=1)
    # Optimizer updates per epoch: the batch is split into this many minibatches.
    num_minibatches: int = _field(1, ge=1)
    # Sequences per forward/backward pass (global), accumulated exactly; None = whole minibatch.
    micro_batch_size: int | None = _field(None, ge=1)
    # With train.packing: tokens per micro-batch per device, accumulated exactly; None = whole.
    micro_batch_tokens: int | None = _field(None, ge=1)


@dataclasses.dataclass(**_CONFIG)
class CriticConfig:
    """The value model of recipes that learn one (ppo); its own AdamW optimizer."""

    # Folder of a value/reward checkpoint; None starts from the policy's weights with a new head.
    path: str | None = None
    # Critic learning rate.
    lr: float = _field(1e-5, gt=0)
    # Critic warmup, in training steps.
    warmup_steps: int = _field(0, ge=0)
    # LoRA on the critic's trunk (its value head trains in full); required with model.lora.
    lora: LoRASection | None = None


@dataclasses.dataclass(**_CONFIG)
class KLConfig:
    """How β evolves, and the frozen reference model (loaded only when a KL is used)."""

    # fixed (β constant) or adaptive (Ziegler et al. 2019; recipes with the KL in the reward).
    controller: Literal["fixed", "adaptive"] = "fixed"
    # Adaptive controller: the KL (nats per sequence) β is steered towards.
    target: float = _field(0.1, gt=0)
    # Adaptive controller: sequences over which a maximal error changes β by 20%.
    horizon: float = _field(10000.0, gt=0)
    # Dtype of the frozen reference model's parameters (bfloat16 halves its memory).
    reference_param_dtype: Literal["float32", "bfloat16"] = "float32"


@dataclasses.dataclass(**_CONFIG)
class OldLogprobsConfig:
    """Where π_old of the importance ratio comes from."""

    # recompute (a forward pass of the training model after generation) or the sampler's own.
    source: Literal["recompute", "sampler"] = "recompute"
    # With source=sampler: cap C of the truncated importance weight min(π/π_sampler, C).
    tis_cap: float | None = _field(2.0, ge=1)


@dataclasses.dataclass(**_CONFIG)
class LoopConfig:
    """The ``train:`` section: steps, seeds, evaluation, checkpoints, logging."""

    # Training steps (one step = one rollout batch or one batch of pairs).
    max_steps: int = _field(100, ge=1)
    # Seed of sampling, initialisation and everything else not seeded by data.seed.
    seed: int = 0
    # Write metrics every this many steps.
    log_every: int = _field(1, ge=1)
    # Evaluate every this many steps, plus before the first and after the last; 0 = only those.
    eval_every: int = _field(25, ge=0)
    # Evaluation decoding: greedy, or sampled with the rollout's temperature/top-k/top-p.
    eval_mode: Literal["greedy", "sampled"] = "greedy"
    # Completion length at evaluation, in tokens; None = rollout.max_new_tokens.
    eval_max_new_tokens: int | None = _field(None, ge=1)
    # Completions sampled per eval prompt (K > 1: sampled, pass@k, maj@K, best@K); 1 = as above.
    eval_num_samples: int = _field(1, ge=1)
    # Eval prompt column whose values split the eval metrics (eval/<value>/...); None = off.
    eval_group_by: str | None = "data_source"
    # Save a checkpoint every this many steps, and at the end; 0 = only at the end.
    save_every: int = _field(50, ge=0)
    # Checkpoints kept on disk (the oldest are deleted).
    keep_checkpoints: int = _field(3, ge=1)
    # DAPO dynamic sampling: extra prompt batches per step to refill groups of equal rewards.
    max_refill_batches: int = _field(3, ge=0)
    # A NaN/inf loss or gradient: raise, or skip the update (counted in train/skipped_steps).
    on_nonfinite: Literal["raise", "skip"] = "raise"
    # Pack sequences (real tokens only) into rows for the forward passes and the update.
    packing: bool = True
    # With packing: a prompt's G samples share one copy of it in the rows (auto: where possible).
    shared_prompts: Literal["auto"] | bool = "auto"
    # Plan the run for its devices before loading weights (jaxrl-llm plan); refuse a misfit.
    preflight: bool = False
    # Async RL: policy versions a sample may lag the update it trains (0 = synchronous).
    max_staleness: int = _field(0, ge=0)
    # Async RL: with max_staleness >= 2, new tokens per sample per update window (0 = off).
    partial_rollout_tokens: int = _field(0, ge=0)


@dataclasses.dataclass(**_CONFIG)
class MeshConfig:
    """Device mesh ``(data, fsdp, tensor)``; one size may be -1 (all remaining devices)."""

    # Parameter layout: dp (replicated), fsdp (sharded over fsdp), fsdp_tp (plus tensor parallel).
    preset: Literal["dp", "fsdp", "fsdp_tp"] = "dp"
    # Data-parallel axis size; -1 = all devices the other axes leave.
    data: int = -1
    # FSDP axis size (≥ 1 or -1); the batch is split over data × fsdp.
    fsdp: int = 1
    # Tensor-parallel axis size (≥ 2 with fsdp_tp).
    tensor: int = 1


@dataclasses.dataclass(**_CONFIG)
class PlacementConfig:
    """Where the rollout and the update run: one mesh, or two carved from the devices."""

    # colocated (rollout and update on the one mesh) or split (a rollout and a train mesh).
    mode: Literal["colocated", "split"] = "colocated"
    # split: the share of each process's devices given to the rollout (its first ones).
    rollout_fraction: float = _field(0.25, gt=0, lt=1)
    # split: the rollout mesh over the rollout devices (mesh: the train mesh over the rest).
    rollout_mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)


@dataclasses.dataclass(**_CONFIG)
class WandbConfig:
    """``logging.wandb``: a Weights & Biases run in RUN_DIR/wandb (``pip install wandb``)."""

    # W&B project.
    project: str = "jaxrl_llm"
    # W&B entity (user or team); None = your default entity.
    entity: str | None = None
    # online (needs an API key and network), offline (no network; `wandb sync` later), disabled.
    mode: Literal["online", "offline", "disabled"] = "online"
    # Run name shown in W&B; None = the run directory's name.
    name: str | None = None
    # W&B group (e.g. a sweep); None = none.
    group: str | None = None
    # W&B tags.
    tags: tuple[str, ...] = ()


@dataclasses.dataclass(**_CONFIG)
class TrackioConfig:
    """``logging.trackio``: a trackio run (``pip install trackio``), local unless space_id."""

    # trackio project.
    project: str = "jaxrl_llm"
    # Run name; None = the run directory's name plus a random suffix.
    name: str | None = None
    # A Hugging Face Space to sync the dashboard to; None = local database only (TRACKIO_DIR).
    space_id: str | None = None


@dataclasses.dataclass(**_CONFIG)
class LoggingConfig:
    """Trackers besides RUN_DIR/metrics.jsonl (always written); a resumed run continues them."""

    # TensorBoard event files in RUN_DIR/tensorboard.
    tensorboard: bool = True
    # Weights & Biases; None = off. E.g. {project: my-rl, mode: offline}.
    wandb: WandbConfig | None = None
    # trackio; None = off. E.g. {project: my-rl}.
    trackio: TrackioConfig | None = None
    # Prompts per logged step and per evaluation written to RUN_DIR/completions.jsonl; 0 = off.
    completions: int = _field(1, ge=0)


@functools.cache
def _trains_on_pairs(name: str) -> bool:
    """Asked of the recipe: does it train offline on preference pairs?"""
    return PREFERENCE_PAIRS in algorithms.RECIPES[name]().requires


@dataclasses.dataclass(**_CONFIG)
class TrainConfig:
    """A whole training run. ``rollout`` is ``None`` exactly when the recipe is ``dpo``."""

    # The policy model.
    model: ModelLoadConfig = dataclasses.field(default_factory=ModelLoadConfig)
    # The RL recipe and its hyperparameters.
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    # Generation of the training batch (online recipes); None for dpo.
    rollout: RolloutConfig | None = dataclasses.field(default_factory=RolloutConfig)
    # Offline preference training (dpo only).
    preference: PreferenceConfig = dataclasses.field(default_factory=PreferenceConfig)
    # Training and evaluation prompts.
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    # The training reward (online recipes).
    rewards: RewardsConfig = dataclasses.field(default_factory=RewardsConfig)
    # The policy's optimizer and the shape of each update.
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    # The value model (ppo only).
    critic: CriticConfig = dataclasses.field(default_factory=CriticConfig)
    # The KL controller and the reference model.
    kl: KLConfig = dataclasses.field(default_factory=KLConfig)
    # π_old of the importance ratio.
    old_logprobs: OldLogprobsConfig = dataclasses.field(default_factory=OldLogprobsConfig)
    # The training loop (the `train:` section).
    train: LoopConfig = dataclasses.field(default_factory=LoopConfig)
    # Device mesh.
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    # Rollout and update placement: colocated, or split onto two meshes.
    placement: PlacementConfig = dataclasses.field(default_factory=PlacementConfig)
    # Experiment trackers: TensorBoard, W&B, trackio.
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    # Run directory (metrics, checkpoints, resolved config); None = set by --run-dir.
    run_dir: str | None = None

    @property
    def is_offline(self) -> bool:
        """True for preference training (dpo): no generation, no rewards."""
        return _trains_on_pairs(self.algorithm.name)

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


__all__ = [
    "AlgorithmConfig",
    "ArithmeticConfig",
    "CriticConfig",
    "DataConfig",
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
]
