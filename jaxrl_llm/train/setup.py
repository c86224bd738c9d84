"""A run's config, resolved once into frozen, typed values.

:func:`resolve` is the only place below the loop and the CLI that reads a
:class:`~jaxrl_llm.config.TrainConfig`. It loads the models, tokenizer, data and reward, builds
the recipe, the optimizers, the mesh and a fresh :class:`~jaxrl_llm.train.state.TrainState`,
and turns every knob the rest of the trainer needs into one of the small frozen values below:

    Sampler        how completions are drawn (G, T, temperature, top-k/p, stop ids, cache dtype)
    UpdateShape    epochs × minibatches × micro-batches of one update
    OldLogprobs    where π_old comes from (a recompute pass, or the sampler with truncated IS)
    LoopPlan       steps, batch size, logging, refills, what to do with a non-finite update
    CheckpointPlan where, how often, how many
    EvalPlan       how often and how the held-out split is evaluated
    Models         the mesh, graph definitions, optimizers, schedules, reference parameters,
                   the state's shardings, and where batches go on the mesh

Everything else (the device step, collection, evaluation, the loop) takes these values, never
the config: a run is described once, and each layer sees only what it uses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrl_llm import distributed as dist
from jaxrl_llm import rewards as R
from jaxrl_llm.config import (
    ConfigError,
    CriticConfig,
    ModelLoadConfig,
    OptimConfig,
    TrainConfig,
    build_recipe,
    check_devices,
    check_model_paths,
    data_format,
    mesh_axis_sizes,
    to_dict,
)
from jaxrl_llm.models import sharding as shd
from jaxrl_llm.models.hub import eos_token_ids, read_generation_config
from jaxrl_llm.recipe import REFERENCE_LOGPROBS, AnyRecipe, PreferenceRecipe, Recipe
from jaxrl_llm.rollout.engine import choose_engine
from jaxrl_llm.rollout.paged import PagedOptions
from jaxrl_llm.train import data as run_data
from jaxrl_llm.train import models as train_models
from jaxrl_llm.train import packing as packing_lib
from jaxrl_llm.train import placement as pl
from jaxrl_llm.train import state as st
from jaxrl_llm.train.tracking import TrackingPlan, TrackioSettings, WandbSettings

CONFIG_FILE = "config.yaml"
EXPORT_DIR = "export"
ADAPTER_DIR = "adapter"  # LoRA runs: the adapter alone, in PEFT's format
CHECKPOINT_DIR = "checkpoints"
PAD_MULTIPLE = 32  # prompt widths are padded to a multiple of this (fewer distinct shapes)


# ---------------------------------------------------------------------------------------------
# The resolved values.


def paged_options(
    attention: str,
    kernel_tuning: Any,
    tensor_parallel: int,
    max_num_seqs: int,
    max_total_tokens: int,
    max_prompt_length: int = 0,
    memory_utilization: float | None = 0.9,
    prefix_sharing: bool = True,
    work_stealing: bool = True,
) -> PagedOptions:
    """The paged engine's options from the ``rollout`` config's knobs (``paged_attention``,
    ``paged_kernel_tuning``, ``tensor_parallel``, ``max_num_seqs``, ``max_total_tokens``;
    0: the engine's default): the pool is ``max_total_tokens`` rounded up to whole pages, plus
    the trash page; by default it is sized for prompts of ``max_prompt_length`` tokens
    (``data.max_prompt_length``; 0: each call's longest), one pool shape for the whole run;
    on a GPU or TPU, what ``memory_utilization`` of the devices' memory leaves
    (``PagedOptions.memory_utilization``; None: the CPU's rule there too); prompts that begin
    alike share their pages unless ``prefix_sharing`` is off (``PagedOptions.prefix_sharing``);
    a process's data-parallel engines take each other's waiting prompts unless
    ``work_stealing`` is off (``PagedOptions.work_stealing``)."""
    page_size = PagedOptions.page_size
    return PagedOptions(
        attention=attention,
        kernel_tuning=kernel_tuning,
        tensor_parallel=tensor_parallel,
        num_slots=max_num_seqs or None,
        num_pages=1 + -(-max_total_tokens // page_size) if max_total_tokens else None,
        max_prompt_length=max_prompt_length or None,
        memory_utilization=memory_utilization,
        prefix_sharing=prefix_sharing,
        work_stealing=work_stealing,
    )


@dataclasses.dataclass(frozen=True)
class Sampler:
    """How completions are drawn.

    Attributes:
      num_samples: G, completions per prompt.
      max_new_tokens: T, the completion budget.
      temperature: sampling temperature (0: greedy); log-probs are of the tempered policy.
      top_k: keep the k most likely tokens (0: all).
      top_p: nucleus mass (1: all).
      stop_ids: token ids that end a completion.
      cache_dtype: the KV cache's dtype (None: the model's).
      engine: the rollout engine, ``"static"`` or ``"paged"`` (``rollout.generate``;
        ``rollout.engine: auto`` resolved by ``rollout.engine.choose_engine``).
      paged_attention: the paged engine's attention backend (``PagedOptions.attention``).
      paged_kernel_tuning: its GPU decode kernel's launch parameters
        (``PagedOptions.kernel_tuning``), as sorted pairs.
      tensor_parallel: devices per paged engine (``PagedOptions.tensor_parallel``).
      max_num_seqs: the paged engine's decode slots (``PagedOptions.num_slots``; 0: default).
      max_total_tokens: its pool in tokens (``PagedOptions.num_pages`` pages; 0: default).
      max_prompt_length: the longest prompt its default pool is sized for
        (``PagedOptions.max_prompt_length``; the run's ``data.max_prompt_length``; 0: each
        call's longest prompt).
      memory_utilization: on a GPU or TPU, the fraction of device memory in use while sampling
        that sizes its default pool (``PagedOptions.memory_utilization``; None: not used).
      prefix_sharing: prompts of a call that begin alike share those pages in the paged
        engine (``PagedOptions.prefix_sharing``).
      work_stealing: the data-parallel paged engines (of every process) take each other's prompts
        waiting for room (``PagedOptions.work_stealing``).
      mask_truncated: completions that hit ``max_new_tokens`` without a stop id get no loss
        tokens (their rewards still enter the group statistics).
      full_logprobs: also sample the full-vocabulary τ = 1 log-probs
        (``generate(return_full_logprobs=True)``; ``Groups.logp_full_bgt``).
    """

    num_samples: int
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()
    cache_dtype: Any = None
    engine: str = "static"
    paged_attention: str = "auto"
    paged_kernel_tuning: tuple[tuple[str, int], ...] = ()
    tensor_parallel: int = 0
    max_num_seqs: int = 0
    max_total_tokens: int = 0
    max_prompt_length: int = 0
    memory_utilization: float | None = 0.9
    prefix_sharing: bool = True
    work_stealing: bool = True
    mask_truncated: bool = False
    full_logprobs: bool = False

    def paged_options(self) -> PagedOptions:
        """The paged engine's options this sampler sets (the rest: the engine's defaults)."""
        return paged_options(
            self.paged_attention,
            self.paged_kernel_tuning,
            self.tensor_parallel,
            self.max_num_seqs,
            self.max_total_tokens,
            self.max_prompt_length,
            self.memory_utilization,
            self.prefix_sharing,
            self.work_stealing,
        )

    def greedy(self, max_new_tokens: int | None = None) -> Sampler:
        """One greedy completion per prompt (evaluation)."""
        return dataclasses.replace(
            self,
            num_samples=1,
            temperature=0.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens or self.max_new_tokens,
            full_logprobs=False,
        )


@dataclasses.dataclass(frozen=True)
class UpdateShape:
    """One update: ``epochs`` passes over ``num_minibatches`` minibatches of the batch, each an
    optimizer step accumulated exactly over micro-batches of ``micro_batch_size`` rows.

    With ``packing`` the forward passes and the update run on packed rows
    (:mod:`jaxrl_llm.train.packing`) and a micro-batch is a token budget of
    ``micro_batch_tokens`` per device (None: one micro-batch per minibatch); the RL step then
    ignores ``micro_batch_size`` (:func:`update_shape` turns it into the budget it implies;
    evaluation's log-prob pass still uses it). ``shared_prompts``: packed rows hold one copy of
    each prompt for its G samples; ``attn_per_width`` weighs the row width in the packing plan
    and packed rows are a multiple of ``width_multiple`` wide (128 under splash attention)
    (:func:`~jaxrl_llm.train.packing.make_plan`)."""

    epochs: int = 1
    num_minibatches: int = 1
    micro_batch_size: int | None = None
    packing: bool = False
    micro_batch_tokens: int | None = None
    shared_prompts: bool = False
    attn_per_width: float = 0.0
    width_multiple: int = 1

    @property
    def updates_per_step(self) -> int:
        return self.epochs * self.num_minibatches


@dataclasses.dataclass(frozen=True)
class OldLogprobs:
    """π_old of the importance ratio: ``"recompute"`` (a forward pass before the update when it
    is needed) or ``"sampler"`` (the sampler's log-probs, corrected by truncated IS capped at
    ``tis_cap``)."""

    source: str = "recompute"
    tis_cap: float | None = None


@dataclasses.dataclass(frozen=True)
class LoopPlan:
    """The loop's schedule.

    Attributes:
      max_steps: training steps.
      batch_size: prompts (online) or pairs (DPO) per step.
      log_every: steps between metric lines.
      on_nonfinite: ``"skip"`` or ``"raise"`` on a non-finite update.
      max_refill_batches: DAPO: extra batches of prompts drawn to refill dropped groups.
      data_seed, shuffle: the prompt stream's order.
      max_staleness: async RL: policy versions a batch may lag its update (0: synchronous;
        :mod:`~jaxrl_llm.train.asynchronous`).
      partial_rollout_tokens: async RL: a rollout continues under newer weights every this
        many new tokens (0: off).
      log_completions: prompt groups per logged step written to ``completions.jsonl``
        (:mod:`~jaxrl_llm.train.completions`; 0: off).
    """

    max_steps: int
    batch_size: int
    log_every: int = 1
    on_nonfinite: str = "skip"
    max_refill_batches: int = 0
    data_seed: int = 0
    shuffle: bool = True
    max_staleness: int = 0
    partial_rollout_tokens: int = 0
    log_completions: int = 0


@dataclasses.dataclass(frozen=True)
class CheckpointPlan:
    """Checkpoints in ``directory`` every ``save_every`` steps (and at the end), ``keep`` kept."""

    directory: Path
    save_every: int
    keep: int


@dataclasses.dataclass(frozen=True)
class EvalPlan:
    """Held-out evaluation every ``every`` steps (0: only before the first and after the last),
    ``mode`` greedy or sampled with ``sampler``, keyed from ``seed``; ``num_samples`` K
    completions per prompt (K > 1: sampled, with pass@k / maj@K / best@K / mean@K);
    ``group_by``: the prompt column whose values split the metrics (None: not split)."""

    every: int
    mode: str
    sampler: Sampler
    seed: int
    num_samples: int = 1
    group_by: str | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class Models:
    """The run's models on its mesh (static parts; parameters travel in the TrainState).

    Attributes:
      mesh, rules: the ``(data, fsdp, tensor)`` mesh and the logical-axis rules.
      graphdef: the policy's ``nnx`` graph definition.
      tx, schedule: the policy's optimizer and its ``step -> lr``.
      state_sharding: a TrainState of shardings.
      ref_params: the frozen reference's parameters, or None when the recipe needs none
        (with LoRA: the frozen base itself, not a copy).
      critic_graphdef, critic_tx, critic_schedule: the critic's, or None.
      ref_graphdef: the reference's graph definition (the base without adapters under LoRA;
        else ``graphdef``).
      frozen, frozen_sharding: with LoRA, the frozen base parameters (the TrainState's
        ``params`` are then the adapters only) and their shardings; else None.
      critic_frozen, critic_frozen_sharding: the same for a LoRA critic (its trunk).
      lora: the adapters' settings, or None (full fine-tuning).
      merge_for_sampling: LoRA: rollouts sample from the merged weights (else unmerged).
      base_path: the base model's folder (``model.path`` resolved; PEFT's
        ``base_model_name_or_path`` of an exported adapter).
    """

    mesh: jax.sharding.Mesh
    rules: shd.Rules
    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    schedule: st.Schedule
    state_sharding: st.TrainState
    ref_params: dict | None = None
    critic_graphdef: nnx.GraphDef | None = None
    critic_tx: optax.GradientTransformation | None = None
    critic_schedule: st.Schedule | None = None
    ref_graphdef: nnx.GraphDef | None = None
    frozen: dict | None = None
    frozen_sharding: Any = None
    critic_frozen: dict | None = None
    critic_frozen_sharding: Any = None
    lora: train_models.LoRAConfig | None = None
    base_path: str | None = None
    merge_for_sampling: bool = False

    def __post_init__(self) -> None:
        if self.ref_graphdef is None:
            object.__setattr__(self, "ref_graphdef", self.graphdef)

    def full_params(self, params: dict) -> dict:
        """The policy's whole parameter dict: ``params`` (the adapters, with LoRA) joined with
        the frozen base; ``params`` itself without LoRA."""
        return params if self.frozen is None else train_models.combine(self.frozen, params)

    def sampling_policy(self, params: dict) -> tuple[nnx.GraphDef, dict]:
        """``(graphdef, parameters)`` the sampler runs: the policy's, or under LoRA with
        ``merge_for_sampling`` the base's graph with ``W + s·A B`` merged in (jitted)."""
        if self.frozen is not None and self.merge_for_sampling:
            from jaxrl_llm.models import lora

            return self.ref_graphdef, lora.merged_params(self.graphdef, self.frozen, params)
        return self.graphdef, self.full_params(params)

    def policy(self, params: dict) -> nnx.Module:
        """The policy module with ``params`` (joined with the frozen base under LoRA)."""
        return nnx.merge(self.graphdef, self.full_params(params))

    def critic(self, critic_params: dict) -> nnx.Module:
        """The critic module with ``critic_params`` (joined with its frozen trunk under
        LoRA); a run without a critic raises ``ValueError``."""
        if self.critic_graphdef is None:
            raise ValueError("this run has no critic (only recipes with a value model have one)")
        if self.critic_frozen is not None:
            critic_params = train_models.combine(self.critic_frozen, critic_params)
        return nnx.merge(self.critic_graphdef, critic_params)

    @property
    def batch_axes(self) -> Any:
        """The mesh axes a batch's leading axis is split over."""
        return dict(self.rules).get("batch")

    def batch_sharding(self, ndim: int) -> jax.sharding.NamedSharding:
        return shd.batch_sharding(self.mesh, ndim, self.rules)

    def to_device(self, x: np.ndarray) -> jax.Array:
        """Puts a ``[N, ...]`` host array on the mesh, split over the batch axes if it divides.

        With several processes every process holds the same global ``x`` and contributes only
        its own rows (``jax.make_array_from_process_local_data``).
        """
        if dist.is_multiprocess():
            return dist.to_global(x, self.batch_sharding(np.ndim(x)))
        if x.shape[0] % shd.data_parallel_size(self.mesh):
            return jax.device_put(x, st.replicated(self.mesh))
        return jax.device_put(x, self.batch_sharding(x.ndim))

    def process_rows(self, num_rows: int) -> slice:
        """This process's rows of a batch (every row in a single-process run)."""
        return dist.process_rows(self.batch_sharding(1), (int(num_rows),))


def tracking_plan(config: TrainConfig) -> TrackingPlan:
    """The ``logging:`` section as the trackers' settings (no config types past this point)."""
    log = config.logging
    wandb = trackio = None
    if log.wandb is not None:
        w = log.wandb
        wandb = WandbSettings(w.project, w.entity, w.mode, w.name, w.group, tuple(w.tags))
    if log.trackio is not None:
        trackio = TrackioSettings(log.trackio.project, log.trackio.name, log.trackio.space_id)
    return TrackingPlan(tensorboard=log.tensorboard, wandb=wandb, trackio=trackio)


@dataclasses.dataclass(frozen=True, eq=False)
class Setup:
    """Everything a run is made of, resolved from its config (see the module docstring).

    ``state`` is the fresh initial state; the loop restores a checkpoint over it.
    ``sampler`` is None for offline (DPO) runs; ``reward`` scores completions (for DPO only
    its held-out prompts, None without them). ``placement`` says where the rollout runs
    (:mod:`jaxrl_llm.train.placement`; colocated on ``models.mesh`` unless ``placement.mode``
    is split); build the rollout's weights with ``RolloutWeights.build(models, placement)``.
    """

    run_dir: Path
    recipe: AnyRecipe
    models: Models
    state: st.TrainState
    loop: LoopPlan
    update: UpdateShape
    old_logprobs: OldLogprobs
    checkpoint: CheckpointPlan
    evaluation: EvalPlan
    sampler: Sampler | None
    tokenizer: Any
    data: run_data.RunData
    reward: R.WeightedSum | None
    tracking: TrackingPlan = dataclasses.field(default_factory=TrackingPlan)
    placement: pl.Placement | None = None  # None: colocated on models.mesh

    def __post_init__(self) -> None:
        if self.placement is None:
            colocated = pl.Placement.colocated(self.models.mesh, self.models.rules)
            object.__setattr__(self, "placement", colocated)

    @property
    def offline(self) -> bool:
        return isinstance(self.recipe, PreferenceRecipe)

    def policy(self, params: dict | None = None) -> nnx.Module:
        """The policy module with ``params`` (default: the initial state's)."""
        return self.models.policy(self.state.params if params is None else params)

    @property
    def state_sharding(self) -> st.TrainState:
        return self.models.state_sharding


# ---------------------------------------------------------------------------------------------
# From the config.


def make_optimizer(
    optim: OptimConfig, *, max_steps: int, updates_per_step: int
) -> tuple[optax.GradientTransformation, st.Schedule]:
    """The policy's optimizer (global-norm clipping, then AdamW or SGD) and its step schedule
    (see :func:`~jaxrl_llm.train.state.lr_schedule`)."""
    schedule = st.lr_schedule(
        lr=optim.lr,
        schedule=optim.schedule,
        warmup_steps=optim.warmup_steps,
        max_steps=max_steps,
        final_lr_ratio=optim.final_lr_ratio,
    )
    return st.make_optimizer(
        schedule,
        updates_per_step=updates_per_step,
        optimizer=optim.optimizer,
        b1=optim.adam_b1,
        b2=optim.adam_b2,
        eps=optim.adam_eps,
        weight_decay=optim.weight_decay,
        momentum=optim.momentum,
        max_grad_norm=optim.max_grad_norm,
    ), schedule


def make_critic_optimizer(
    critic: CriticConfig, optim: OptimConfig, *, max_steps: int, updates_per_step: int
) -> tuple[optax.GradientTransformation, st.Schedule]:
    """The critic's AdamW: its own lr and warmup, the policy's schedule shape, betas and clip."""
    return make_optimizer(
        dataclasses.replace(
            optim, optimizer="adamw", lr=critic.lr, warmup_steps=critic.warmup_steps
        ),
        max_steps=max_steps,
        updates_per_step=updates_per_step,
    )


def update_shape(
    config: TrainConfig, data_parallel: int = 1, model_config: Any = None
) -> UpdateShape:
    """The update's shape. With ``train.packing`` and ``optim.micro_batch_size`` but no
    ``optim.micro_batch_tokens``, the per-device budget is what the micro-batch size bounds
    unpacked: ``⌈micro_batch_size / D⌉ · (data.max_prompt_length + rollout.max_new_tokens)``
    tokens, D = ``data_parallel`` devices. ``model_config`` (the policy's): the attention's
    weight in the packing plan (:func:`~jaxrl_llm.train.packing.attention_per_width`)."""
    o = config.optim
    packing = bool(config.train.packing) and not config.is_offline
    tokens = o.micro_batch_tokens
    if packing and tokens is None and o.micro_batch_size is not None:
        rows = -(-o.micro_batch_size // data_parallel)
        tokens = rows * (config.data.max_prompt_length + config.rollout.max_new_tokens)
    return UpdateShape(
        o.ppo_epochs,
        o.num_minibatches,
        o.micro_batch_size,
        packing=packing,
        micro_batch_tokens=tokens if packing else None,
        shared_prompts=packing and shares_prompts(config),
        attn_per_width=0.0
        if model_config is None or not packing
        else packing_lib.attention_per_width(model_config),
        width_multiple=packed_width_multiple(config) if packing else 1,
    )


def packed_width_multiple(config: TrainConfig, backend: str | None = None) -> int:
    """128 where the policy's attention is splash (its blocks are multiples of 128 lanes, so a
    packed row of another width would fall back to the reference attention), 16 under
    ``pallas_gpu`` (its smallest block), else 1."""
    from jaxrl_llm.models import attention

    impl = attention.resolve_implementation(config.model.attention, backend)
    return {"splash": 128, "pallas_gpu": 16}.get(impl, 1)


def shares_prompts(config: TrainConfig) -> bool:
    """``train.shared_prompts`` resolved: ``"auto"`` is on where the policy's attention is the
    reference implementation (``model.attention`` by backend) and its LoRA has no dropout."""
    from jaxrl_llm.models import attention

    share = getattr(config.train, "shared_prompts", "auto")
    if share != "auto":
        return bool(share)
    lora = config.model.lora
    dropout = lora is not None and lora.dropout > 0
    return attention.resolve_implementation(config.model.attention) == "reference" and not dropout


def _carve(config: TrainConfig) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Split placement: ``(rollout, train)`` devices (:func:`~jaxrl_llm.train.placement.
    carve_devices` of ``jax.devices()`` by ``placement.rollout_fraction``)."""
    return pl.carve_devices(jax.devices(), config.placement.rollout_fraction)


def make_mesh(config: TrainConfig) -> tuple[jax.sharding.Mesh, shd.Rules]:
    """The run's ``(data, fsdp, tensor)`` mesh over the first devices (sizes from
    ``config.mesh``, checked against the devices and the batch split), and its rules. With
    ``placement.mode = split`` it is the train mesh, over the first of the train devices."""
    sizes = check_devices(config, jax.device_count(), process_count=jax.process_count())
    if config.placement.mode != "split":
        return train_models.make_mesh(sizes, config.mesh.preset)
    _, train = _carve(config)
    n = int(np.prod(list(sizes.values())))
    return shd.make_mesh(**sizes, devices=train[:n]), shd.PRESETS[config.mesh.preset]


def make_placement(config: TrainConfig, mesh: jax.sharding.Mesh, rules: shd.Rules) -> pl.Placement:
    """Where the rollout runs: colocated on ``mesh`` (the train mesh), or split: the rollout
    mesh of ``placement.rollout_mesh`` over the rollout devices.

    Raises:
      ConfigError: split, and ``mesh`` holds a rollout device.
    """
    if config.placement.mode != "split":
        return pl.Placement.colocated(mesh, rules)
    check_devices(config, jax.device_count(), process_count=jax.process_count())
    rollout, train = _carve(config)
    clash = sorted(d.id for d in set(mesh.devices.flat) - set(train))
    if clash:
        raise ConfigError(
            f"placement.mode = 'split': the train mesh holds devices {clash}, which are the "
            "rollout's (each process's first devices); build it over the train devices",
            "placement.mode",
        )
    r = config.placement.rollout_mesh
    sizes = mesh_axis_sizes(r, len(rollout), where="placement.rollout_mesh")
    return pl.split_placement(
        jax.devices(),
        fraction=config.placement.rollout_fraction,
        rollout_sizes=sizes,
        rollout_rules=shd.PRESETS[r.preset],
    )


def _load_options(model: ModelLoadConfig) -> dict[str, Any]:
    """How ``model``'s weights are read (the policy's, and a critic checkpoint's)."""
    return dict(
        dtype=model.dtype,
        param_dtype=model.param_dtype,
        remat=model.remat,
        attention=model.attention,
        allow_pickle=model.allow_pickle,
    )


def load_tokenizer(model: ModelLoadConfig, *, vocab_size: int | None = None) -> Any:
    """The tokenizer of ``model`` (``model.tokenizer`` or the model's own), checked against
    ``vocab_size`` when given (see :func:`jaxrl_llm.train.models.load_tokenizer`)."""
    return train_models.load_tokenizer(
        model.path,
        tokenizer=model.tokenizer,
        trust_remote_code=model.trust_remote_code,
        vocab_size=vocab_size,
    )


def _data_spec(config: TrainConfig) -> run_data.DataSpec:
    """``config.data`` as a :class:`~jaxrl_llm.train.data.DataSpec`, file formats resolved
    (only those of the files that are read)."""
    d, a = config.data, config.data.arithmetic
    file = d.source == "file"
    return run_data.DataSpec(
        source=d.source,
        path=d.path,
        format=data_format(d, d.path) if file else None,
        eval_path=d.eval_path,
        eval_format=data_format(d, d.eval_path) if file and d.eval_path and d.eval_size else None,
        eval_size=d.eval_size,
        seed=d.seed,
        arithmetic=run_data.ArithmeticSpec(
            train_size=a.train_size,
            operations=tuple(a.operations),
            min_operand=a.min_operand,
            max_operand=a.max_operand,
        ),
        prompt_field=d.prompt_field,
        answer_field=d.answer_field,
        chosen_field=d.chosen_field,
        rejected_field=d.rejected_field,
        system_prompt=d.system_prompt,
        chat_template=d.chat_template,
        max_prompt_length=d.max_prompt_length,
    )


def build_data(config: TrainConfig, tokenizer: Any) -> run_data.RunData:
    """The training and held-out datasets of ``config.data`` (pairs for ``dpo``)."""
    return run_data.build_data(
        _data_spec(config),
        tokenizer,
        offline=config.is_offline,
        max_response_length=config.preference.max_response_length,
    )


def build_reward(config: TrainConfig, *, base_dir: str | Path | None = None) -> R.WeightedSum:
    """The weighted reward of ``config.rewards`` (answer rewards read ``data.answer_field``)."""
    return run_data.build_run_reward(
        [to_dict(term) for term in config.rewards.terms],
        on_error=config.rewards.on_error,
        timeout=config.rewards.timeout,
        answer_field=config.data.answer_field,
        base_dir=base_dir,
    )


def build_models(
    config: TrainConfig, recipe: AnyRecipe, *, mesh: jax.sharding.Mesh | None = None
) -> tuple[Models, st.TrainState]:
    """Loads the models and builds the optimizers and a fresh state on the mesh.

    Args:
      config: the run.
      recipe: its recipe (a critic is loaded when it has one).
      mesh: a ``(data, fsdp, tensor)`` mesh; default from ``config.mesh`` and the devices.
    """
    if mesh is None:
        mesh, rules = make_mesh(config)
    else:
        rules = shd.PRESETS[config.mesh.preset]
    seed = config.train.seed
    n_updates = update_shape(config).updates_per_step
    lora_cfg = train_models.lora_config(config.model.lora)
    critic_lora = train_models.lora_config(config.critic.lora)
    quantize = "none" if config.model.lora is None else config.model.lora.quantize
    with_critic = isinstance(recipe, Recipe) and recipe.critic is not None
    with jax.set_mesh(mesh):
        policy = train_models.load_policy(
            config.model.path, **_load_options(config.model), mesh=mesh, rules=rules, seed=seed
        )
        critic = None
        if with_critic:
            critic = train_models.load_critic(
                policy,
                path=config.critic.path,
                **_load_options(config.model),
                mesh=mesh,
                rules=rules,
                seed=seed,
            )
        frozen = frozen_sh = critic_frozen = critic_frozen_sh = None
        ref_graphdef = None
        if lora_cfg is None:
            graphdef, params = st.split_params(policy)
            param_sh = shd.param_shardings(nnx.state(policy, nnx.Param), mesh, rules)
        else:
            adapted = train_models.adapt(
                policy,
                lora_cfg,
                quantize=quantize,
                adapter=config.model.lora.adapter,
                mesh=mesh,
                rules=rules,
                seed=seed,
            )
            graphdef, ref_graphdef = adapted.graphdef, adapted.base_graphdef
            params, param_sh = adapted.params, adapted.params_sharding
            frozen, frozen_sh = adapted.frozen, adapted.frozen_sharding
        ref = None
        if REFERENCE_LOGPROBS in recipe.requires:
            if frozen is not None:  # the frozen base is the reference: no copy
                ref = frozen
            else:
                ref = train_models.reference_params(params, config.kl.reference_param_dtype)
        tx, schedule = make_optimizer(
            config.optim, max_steps=config.train.max_steps, updates_per_step=n_updates
        )
        critic_graphdef = critic_params = critic_sh = critic_tx = critic_schedule = None
        if critic is not None:
            if critic_lora is None:
                critic_graphdef, critic_params = st.split_params(critic)
                critic_sh = shd.param_shardings(nnx.state(critic, nnx.Param), mesh, rules)
            else:
                adapted = train_models.adapt(
                    critic,
                    critic_lora,
                    quantize=config.critic.lora.quantize,
                    adapter=config.critic.lora.adapter,
                    mesh=mesh,
                    rules=rules,
                    seed=seed + 3,
                    trainable_extra="score",
                )
                critic_graphdef = adapted.graphdef
                critic_params, critic_sh = adapted.params, adapted.params_sharding
                critic_frozen, critic_frozen_sh = adapted.frozen, adapted.frozen_sharding
            critic_tx, critic_schedule = make_critic_optimizer(
                config.critic,
                config.optim,
                max_steps=config.train.max_steps,
                updates_per_step=n_updates,
            )
        skeleton = st.TrainState(
            step=np.zeros((), np.int32),
            params=params,
            opt_state=None,
            rng=np.zeros((2,), np.uint32),
            kl_state=st.initial_kl_state(recipe),
            data_position=np.zeros((2,), np.int32),
            critic_params=critic_params,
        )
        sharding = st.state_shardings(
            skeleton,
            mesh,
            param_sharding=param_sh,
            tx=tx,
            critic_param_sharding=critic_sh,
            critic_tx=critic_tx,
        )
        state = st.init_train_state(
            params,
            tx,
            recipe=recipe,
            seed=seed,
            critic_params=critic_params,
            critic_tx=critic_tx,
            opt_sharding=sharding.opt_state,
            critic_opt_sharding=sharding.critic_opt_state,
        )
        state = dist.put(state, sharding)
    models = Models(
        mesh=mesh,
        rules=rules,
        graphdef=graphdef,
        tx=tx,
        schedule=schedule,
        state_sharding=sharding,
        ref_params=ref,
        critic_graphdef=critic_graphdef,
        critic_tx=critic_tx,
        critic_schedule=critic_schedule,
        ref_graphdef=ref_graphdef,
        frozen=frozen,
        frozen_sharding=frozen_sh,
        critic_frozen=critic_frozen,
        critic_frozen_sharding=critic_frozen_sh,
        lora=lora_cfg,
        base_path=train_models.resolve_model_path(config.model.path),
        merge_for_sampling=config.model.lora is not None and config.model.lora.merge_for_sampling,
    )
    return models, state


def _stop_ids(
    config: TrainConfig, tokenizer: Any, model_config: Any, generation: dict[str, Any]
) -> tuple[int, ...]:
    if config.rollout is not None and config.rollout.stop_token_ids is not None:
        return tuple(config.rollout.stop_token_ids)
    # generation_config.json's end-of-turn ids too, as transformers' generate and vLLM stop there
    return eos_token_ids(
        getattr(tokenizer, "eos_token_id", None),
        model_config.eos_token_id,
        generation.get("eos_token_id"),
        vocab_size=model_config.vocab_size,
    )


def check_processes(
    config: TrainConfig, mesh: jax.sharding.Mesh, placement: pl.Placement | None = None
) -> None:
    """With several processes: the mesh spans every process's devices, each process owns whole
    data-parallel shards, and the prompts of a step split evenly over those shards. With a
    split ``placement`` the same holds of the train mesh over the train devices and of the
    rollout mesh over the rollout devices (each process generates for its rows of the latter).

    Raises:
      ConfigError: naming the mesh or batch key and the sizes that do not fit.
    """
    procs = jax.process_count()
    if procs == 1:
        return
    meshes = [("mesh", mesh, jax.device_count(), "")]
    if placement is not None and placement.split:
        meshes = [
            ("mesh", mesh, len(placement.train_devices), " train"),
            (
                "placement.rollout_mesh",
                placement.rollout_mesh,
                len(placement.rollout_devices),
                " rollout",
            ),
        ]
    for key, m, count, side in meshes:
        sizes = dict(m.shape)
        where = f"{key} (data={sizes['data']}, fsdp={sizes['fsdp']}, tensor={sizes['tensor']})"
        if m.size != count:
            raise ConfigError(
                f"{where} uses {m.size} of the {count}{side} devices of this {procs}-process "
                f"run: a multi-process mesh must hold every process's{side} devices (e.g. "
                f"{key}.data=-1)",
                key,
            )
        dp = shd.data_parallel_size(m)
        if dp % procs:
            raise ConfigError(
                f"{where}: the data-parallel size data × fsdp = {dp} is not a multiple of the "
                f"{procs} processes; keep {key}.tensor within one process's "
                f"{count // procs}{side} devices and split data/fsdp across processes",
                key,
            )
        if config.rollout is not None and config.rollout.prompts_per_step % dp:
            raise ConfigError(
                f"rollout.prompts_per_step = {config.rollout.prompts_per_step}: expected a "
                f"multiple of the data-parallel size {dp} ({where} over {procs} processes), "
                "so that each process samples whole groups for its own prompts",
                "rollout.prompts_per_step",
            )


def rollout_engine(config: TrainConfig, *, can_stop_early: bool, processes: int) -> str:
    """``rollout.engine`` resolved (:func:`~jaxrl_llm.rollout.engine.choose_engine`; also what
    ``jaxrl-llm plan`` plans): partial rollouts across ``processes > 1`` run the paged engine
    (the static one runs them in one process)."""
    partial_across = getattr(config.train, "partial_rollout_tokens", 0) and processes > 1
    if config.rollout.engine == "auto" and partial_across:
        return "paged"
    return choose_engine(config.rollout.engine, can_stop_early=can_stop_early)


def _sampler(config: TrainConfig, stop_ids: Sequence[int]) -> Sampler | None:
    r = config.rollout
    if r is None:
        return None
    return Sampler(
        num_samples=r.num_samples,
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        stop_ids=tuple(stop_ids),
        cache_dtype=None if r.cache_dtype == "auto" else jnp.dtype(r.cache_dtype),
        engine=rollout_engine(config, can_stop_early=bool(stop_ids), processes=jax.process_count()),
        paged_attention=r.paged_attention,
        paged_kernel_tuning=tuple(sorted(r.paged_kernel_tuning.items())),
        tensor_parallel=r.tensor_parallel,
        max_num_seqs=r.max_num_seqs,
        max_total_tokens=r.max_total_tokens,
        max_prompt_length=config.data.max_prompt_length,
        memory_utilization=r.memory_utilization,
        prefix_sharing=r.prefix_sharing,
        work_stealing=r.work_stealing,
        mask_truncated=r.mask_truncated_completions,
        full_logprobs=r.full_logprobs,
    )


def _eval_plan(config: TrainConfig, sampler: Sampler | None, stop_ids: Sequence[int]) -> EvalPlan:
    t = config.train
    if sampler is None:  # dpo: greedy answers of the pairs' length
        max_new = t.eval_max_new_tokens or config.preference.max_response_length
        base = Sampler(num_samples=1, max_new_tokens=max_new, stop_ids=tuple(stop_ids))
        return EvalPlan(every=t.eval_every, mode="greedy", sampler=base, seed=t.seed + 1)
    max_new = t.eval_max_new_tokens or sampler.max_new_tokens
    eval_sampler = dataclasses.replace(
        sampler, num_samples=1, max_new_tokens=max_new, full_logprobs=False
    )
    k = t.eval_num_samples
    return EvalPlan(
        every=t.eval_every,
        mode="sampled" if k > 1 else t.eval_mode,
        sampler=eval_sampler,
        seed=t.seed + 1,
        num_samples=k,
        group_by=t.eval_group_by,
    )


def resolve(
    config: TrainConfig,
    run_dir: str | Path | None = None,
    *,
    mesh: jax.sharding.Mesh | None = None,
) -> Setup:
    """The run of ``config`` in ``run_dir`` (default ``config.run_dir``), resolved: models,
    tokenizer, data, reward, recipe, optimizers, a fresh state, and the plans (not restored).
    Every model folder it names is checked first (:func:`~jaxrl_llm.config.check_model_paths`)."""
    check_model_paths(config)
    # read before any weight is, so that a broken file costs no model load
    generation, _ = read_generation_config(train_models.resolve_model_path(config.model.path))
    recipe = build_recipe(config)
    models, state = build_models(config, recipe, mesh=mesh)
    placement = make_placement(config, models.mesh, models.rules)
    check_processes(config, models.mesh, placement)
    model_config = models.policy(state.params).config
    tokenizer = load_tokenizer(config.model, vocab_size=model_config.vocab_size)
    data = build_data(config, tokenizer)
    # DPO scores only its held-out prompts (when it has any) with the configured reward.
    scored = not config.is_offline or data.eval_prompts is not None
    reward = build_reward(config) if scored else None
    if reward is not None:
        run_data.check_reward_fields(reward, data)
    stop_ids = _stop_ids(config, tokenizer, model_config, generation)
    sampler = _sampler(config, stop_ids)
    run_dir = Path(run_dir or config.run_dir or ".").expanduser().absolute()
    t = config.train
    batch_size = (
        config.preference.pairs_per_step if config.is_offline else config.rollout.prompts_per_step
    )
    return Setup(
        run_dir=run_dir,
        recipe=recipe,
        models=models,
        state=state,
        loop=LoopPlan(
            max_steps=t.max_steps,
            batch_size=batch_size,
            log_every=t.log_every,
            on_nonfinite=t.on_nonfinite,
            max_refill_batches=t.max_refill_batches,
            data_seed=config.data.seed,
            shuffle=config.data.shuffle,
            max_staleness=getattr(t, "max_staleness", 0),
            partial_rollout_tokens=getattr(t, "partial_rollout_tokens", 0),
            log_completions=0 if config.is_offline else config.logging.completions,
        ),
        update=update_shape(config, shd.data_parallel_size(models.mesh), model_config),
        old_logprobs=OldLogprobs(config.old_logprobs.source, config.old_logprobs.tis_cap),
        checkpoint=CheckpointPlan(run_dir / CHECKPOINT_DIR, t.save_every, t.keep_checkpoints),
        evaluation=_eval_plan(config, sampler, stop_ids),
        sampler=sampler,
        tokenizer=tokenizer,
        data=data,
        reward=reward,
        tracking=tracking_plan(config),
        placement=placement,
    )


__all__ = [
    "ADAPTER_DIR",
    "CHECKPOINT_DIR",
    "CONFIG_FILE",
    "EXPORT_DIR",
    "PAD_MULTIPLE",
    "CheckpointPlan",
    "EvalPlan",
    "LoopPlan",
    "Models",
    "OldLogprobs",
    "Sampler",
    "Setup",
    "UpdateShape",
    "build_data",
    "build_models",
    "build_reward",
    "check_processes",
    "load_tokenizer",
    "make_critic_optimizer",
    "make_mesh",
    "make_optimizer",
    "make_placement",
    "resolve",
    "tracking_plan",
    "update_shape",
]
