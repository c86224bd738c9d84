"""A run's static parts: models, tokenizer, data, reward and its jitted functions.

:func:`prepare` builds a :class:`Run` from a config (the state is built fresh; the loop restores
a checkpoint over it). Jitted functions (the update step, the log-prob and value passes) are
cached per config and mesh, so a resumed run, or ``evaluate`` after ``train`` in one process,
compiles nothing twice.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrl_llm import distributed as dist
from jaxrl_llm import rewards as R
from jaxrl_llm.config import ConfigError, TrainConfig, to_yaml
from jaxrl_llm.models import sharding as shd
from jaxrl_llm.recipe import Recipe
from jaxrl_llm.train import data as run_data
from jaxrl_llm.train import forward
from jaxrl_llm.train import models as train_models
from jaxrl_llm.train import state as st
from jaxrl_llm.train import update as up
from jaxrl_llm.train.checkpoint import Checkpointer

PAD_MULTIPLE = 32
CONFIG_FILE = "config.yaml"
EXPORT_DIR = "export"
CHECKPOINT_DIR = "checkpoints"


# ---------------------------------------------------------------------------------------------
# Setup shared by train / evaluate / export.


@dataclasses.dataclass
class Run:
    """Everything a run needs besides its state (built once by :func:`prepare`)."""

    config: TrainConfig
    run_dir: Path
    setup: st.TrainSetup
    tokenizer: Any
    data: run_data.RunData
    reward: R.WeightedSum | None
    logprob: Any
    values: Any
    stop_ids: tuple[int, ...]

    @property
    def recipe(self) -> Recipe:
        return self.setup.recipe

    @property
    def mesh(self):
        return self.setup.mesh

    def to_batch_device(self, x: np.ndarray) -> jax.Array:
        """Puts a ``[N, ...]`` host array on the mesh, split over the batch axes if it divides.

        With several processes every process holds the same global ``x`` and contributes only
        its own rows (``jax.make_array_from_process_local_data``).
        """
        mesh = self.mesh
        if dist.is_multiprocess():
            return dist.to_global(x, shd.batch_sharding(mesh, np.ndim(x), self.setup.rules))
        if x.shape[0] % shd.data_parallel_size(mesh):
            return jax.device_put(x, st.replicated(mesh))
        return jax.device_put(x, shd.batch_sharding(mesh, x.ndim, self.setup.rules))

    def process_prompt_rows(self, num_prompts: int) -> slice:
        """This process's rows of a batch of prompts (every row in a single-process run)."""
        return dist.process_rows(
            shd.batch_sharding(self.mesh, 1, self.setup.rules), (int(num_prompts),)
        )


_COMPILED: dict = {}


def _cache_key(run: Run, what: str):
    """Jitted functions are reused by later runs of an equal config in the same process (a
    resumed run, ``evaluate`` after ``train``): everything they close over is rebuilt equal."""
    return what, dataclasses.replace(run.config, run_dir=None), run.mesh


def _stop_ids(config: TrainConfig, tokenizer: Any, model_config: Any) -> tuple[int, ...]:
    if config.rollout is not None and config.rollout.stop_token_ids is not None:
        return tuple(config.rollout.stop_token_ids)
    ids = set()
    for eos in (getattr(tokenizer, "eos_token_id", None), model_config.eos_token_id):
        if eos is not None:
            ids.update(int(e) for e in np.atleast_1d(eos))
    return tuple(sorted(i for i in ids if 0 <= i < model_config.vocab_size))


def check_processes(config: TrainConfig, mesh: jax.sharding.Mesh) -> None:
    """With several processes: the mesh spans every process's devices, each process owns whole
    data-parallel shards, and the prompts of a step split evenly over those shards.

    Raises:
      ConfigError: naming the mesh or batch key and the sizes that do not fit.
    """
    procs = jax.process_count()
    if procs == 1:
        return
    sizes = dict(mesh.shape)
    where = f"mesh (data={sizes['data']}, fsdp={sizes['fsdp']}, tensor={sizes['tensor']})"
    if mesh.size != jax.device_count():
        raise ConfigError(
            f"{where} uses {mesh.size} of the {jax.device_count()} devices of this {procs}-process "
            "run: a multi-process mesh must hold every process's devices (e.g. mesh.data=-1)",
            "mesh",
        )
    dp = shd.data_parallel_size(mesh)
    if dp % procs:
        raise ConfigError(
            f"{where}: the data-parallel size data × fsdp = {dp} is not a multiple of the "
            f"{procs} processes; keep mesh.tensor within one process's "
            f"{jax.local_device_count()} devices and split data/fsdp across processes",
            "mesh",
        )
    if config.rollout is not None and config.rollout.prompts_per_step % dp:
        raise ConfigError(
            f"rollout.prompts_per_step = {config.rollout.prompts_per_step}: expected a multiple "
            f"of the data-parallel size {dp} ({where} over {procs} processes), so that each "
            "process samples whole groups for its own prompts",
            "rollout.prompts_per_step",
        )


def prepare(config: TrainConfig, run_dir: str | Path | None = None) -> Run:
    """Loads models, tokenizer, data and reward for ``config`` (fresh state, not restored)."""
    setup = st.build_setup(config)
    check_processes(config, setup.mesh)
    model_config = setup.policy().config
    tokenizer = train_models.load_tokenizer(config.model, vocab_size=model_config.vocab_size)
    data = run_data.build_data(config, tokenizer)
    reward = None if config.is_offline else run_data.build_run_reward(config)
    run = Run(
        config=config,
        run_dir=Path(run_dir or config.run_dir or ".").expanduser().absolute(),
        setup=setup,
        tokenizer=tokenizer,
        data=data,
        reward=reward,
        logprob=None,
        values=None,
        stop_ids=_stop_ids(config, tokenizer, model_config),
    )
    key = _cache_key(run, "forward")
    if key not in _COMPILED:
        temperature = config.rollout.temperature if config.rollout is not None else 1.0
        micro = config.optim.micro_batch_size
        logprob = forward.make_logprob_fn(
            setup.graphdef, temperature=temperature, micro_batch_size=micro
        )
        values = None
        if setup.critic_graphdef is not None:
            values = forward.make_value_fn(setup.critic_graphdef, micro_batch_size=micro)
        _COMPILED[key] = (logprob, values)
    run.logprob, run.values = _COMPILED[key]
    return run


def checkpointer(run: Run) -> Checkpointer:
    t = run.config.train
    return Checkpointer(
        run.run_dir / CHECKPOINT_DIR, max_to_keep=t.keep_checkpoints, save_every=t.save_every
    )


def config_changes(saved_yaml: str | None, config: TrainConfig) -> list[str]:
    if not saved_yaml:
        return []
    import yaml

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                out.update(flat(v, key + "."))
            else:
                out[key] = v
        return out

    old = flat(yaml.safe_load(saved_yaml) or {})
    new = flat(yaml.safe_load(to_yaml(config)) or {})
    return [
        f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k) and k != "run_dir"
    ]


def make_step_fn(run: Run):
    """The run's jitted update step (on its mesh, state donated)."""
    key = _cache_key(run, "step")
    if key not in _COMPILED:
        _COMPILED[key] = _make_step_fn(run)
    return _COMPILED[key]


def _make_step_fn(run: Run):
    c, s = run.config, run.setup
    kwargs = dict(
        schedule=s.schedule,
        ppo_epochs=c.optim.ppo_epochs,
        num_minibatches=c.optim.num_minibatches,
        micro_batch_size=c.optim.micro_batch_size,
        mesh=s.mesh,
        state_sharding=s.state_sharding,
        rules=s.rules,
    )
    if c.is_offline:
        return up.make_dpo_step(s.recipe, s.graphdef, s.tx, **kwargs)
    return up.make_update_step(
        s.recipe,
        s.graphdef,
        s.tx,
        critic_graphdef=s.critic_graphdef,
        critic_tx=s.critic_tx,
        critic_schedule=s.critic_schedule,
        temperature=c.rollout.temperature,
        tis_cap=c.old_logprobs.tis_cap,
        **kwargs,
    )


__all__ = [
    "CHECKPOINT_DIR",
    "CONFIG_FILE",
    "EXPORT_DIR",
    "PAD_MULTIPLE",
    "Run",
    "check_processes",
    "checkpointer",
    "config_changes",
    "make_step_fn",
    "prepare",
]
