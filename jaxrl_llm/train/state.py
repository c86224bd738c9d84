"""The RL train state as pure pytrees, the optimizers, and building both from a config.

:class:`TrainState` is everything that changes during a run and must survive a restart, as
plain pytrees (``nnx.split`` + ``nnx.to_pure_dict`` for the models, optax states, arrays):

    step            int32[]      training steps completed
    params          dict         the policy's parameters
    opt_state       optax state  of the policy's optimizer
    rng             uint32[2]    PRNG key data (``jax.random.key_data``; ``wrap_key_data`` it)
    kl_state        pytree       the advantage chain's state (an adaptive KL controller's β)
    data_position   int32[2]     (epoch, index) of the prompt stream (see jaxrl_llm.data)
    critic_params   dict | None  the PPO critic's parameters
    critic_opt_state             its optimizer's state

The frozen reference parameters are not part of it: they never change and are rebuilt from the
initial weights (see :mod:`jaxrl_llm.train.models`), so checkpoints do not store them.

Learning-rate schedules are functions of the *training step* (one rollout batch), as the config
documents them; the optimizer sees them through its update count divided by the number of
updates per step (``ppo_epochs × num_minibatches``). Warmup is linear and reaches ``lr`` at the
end of step ``warmup_steps − 1``: step s (from 0) uses ``lr·(s + 1)/warmup_steps``, so no step is
wasted at lr 0. After warmup: constant, or cosine / linear decay to ``final_lr_ratio·lr`` at
``train.max_steps``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import chain as ch
from jaxrl_llm.config import (
    CriticConfig,
    OptimConfig,
    TrainConfig,
    build_recipe,
    needs_reference_model,
)
from jaxrl_llm.core import kl as _kl
from jaxrl_llm.models import sharding as shd
from jaxrl_llm.recipe import Recipe
from jaxrl_llm.train import models as train_models

Schedule = Callable[[jax.Array], jax.Array]


class TrainState(NamedTuple):
    """The full RL state (see the module docstring); a pytree of arrays."""

    step: jax.Array
    params: dict
    opt_state: Any
    rng: jax.Array
    kl_state: Any
    data_position: jax.Array
    critic_params: dict | None = None
    critic_opt_state: Any = None


# ---------------------------------------------------------------------------------------------
# Optimizers and schedules.


def lr_schedule(
    *,
    lr: float,
    schedule: str = "constant",
    warmup_steps: int = 0,
    max_steps: int = 1,
    final_lr_ratio: float = 0.0,
) -> Schedule:
    """``step -> learning rate`` (see the module docstring); traceable, f32."""
    final = lr * final_lr_ratio

    def fn(step):
        step = jnp.asarray(step, jnp.float32)
        warm = jnp.minimum((step + 1.0) / max(warmup_steps, 1), 1.0)
        span = max(max_steps - warmup_steps, 1)
        t = jnp.clip((step - warmup_steps) / span, 0.0, 1.0)
        if schedule == "cosine":
            after = final + (lr - final) * 0.5 * (1.0 + jnp.cos(jnp.pi * t))
        elif schedule == "linear":
            after = lr + (final - lr) * t
        elif schedule == "constant":
            after = jnp.asarray(lr, jnp.float32)
        else:
            raise ValueError(f"unknown schedule {schedule!r}")
        return jnp.where(step < warmup_steps, lr * warm, after).astype(jnp.float32)

    return fn


def _per_update(schedule: Schedule, updates_per_step: int) -> Schedule:
    return lambda count: schedule(jnp.asarray(count, jnp.int32) // updates_per_step)


def make_optimizer(
    optim: OptimConfig, *, max_steps: int, updates_per_step: int
) -> tuple[optax.GradientTransformation, Schedule]:
    """The policy's optimizer (global-norm clipping, then AdamW or SGD) and its step schedule."""
    schedule = lr_schedule(
        lr=optim.lr,
        schedule=optim.schedule,
        warmup_steps=optim.warmup_steps,
        max_steps=max_steps,
        final_lr_ratio=optim.final_lr_ratio,
    )
    lr = _per_update(schedule, updates_per_step)
    if optim.optimizer == "adamw":
        opt = optax.adamw(
            lr,
            b1=optim.adam_b1,
            b2=optim.adam_b2,
            eps=optim.adam_eps,
            weight_decay=optim.weight_decay,
        )
    elif optim.optimizer == "sgd":
        parts = [optax.add_decayed_weights(optim.weight_decay)] if optim.weight_decay else []
        opt = optax.chain(*parts, optax.sgd(lr, momentum=optim.momentum or None))
    else:
        raise ValueError(f"unknown optimizer {optim.optimizer!r}")
    clip = [optax.clip_by_global_norm(optim.max_grad_norm)] if optim.max_grad_norm else []
    return optax.chain(*clip, opt), schedule


def make_critic_optimizer(
    critic: CriticConfig, optim: OptimConfig, *, max_steps: int, updates_per_step: int
) -> tuple[optax.GradientTransformation, Schedule]:
    """The critic's AdamW: its own lr and warmup, the policy's schedule shape, betas and clip."""
    return make_optimizer(
        dataclasses.replace(
            optim, optimizer="adamw", lr=critic.lr, warmup_steps=critic.warmup_steps
        ),
        max_steps=max_steps,
        updates_per_step=updates_per_step,
    )


def updates_per_step(config: TrainConfig) -> int:
    return config.optim.ppo_epochs * config.optim.num_minibatches


# ---------------------------------------------------------------------------------------------
# The KL controller's state (the advantage chain's state).


def initial_kl_state(recipe: Recipe) -> Any:
    """The chain's initial state (``()`` for offline recipes)."""
    if recipe.advantage is None:
        return ()
    dummy = ch.Rollout(reward_bg=jnp.zeros((1, 1)), mask_bgt=jnp.zeros((1, 1, 1), bool))
    return recipe.advantage.init(dummy)


def _is_kl(x: Any) -> bool:
    return isinstance(x, _kl.KLControllerState)


def kl_beta(kl_state: Any) -> jax.Array | None:
    """The current β of the chain's KL controller, or ``None`` when the KL is not in the chain."""
    found = [s.beta for s in jax.tree.leaves(kl_state, is_leaf=_is_kl) if _is_kl(s)]
    return found[0] if found else None


# ---------------------------------------------------------------------------------------------
# Building the state.


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def opt_state_shardings(
    tx: optax.GradientTransformation, params: Any, param_sharding: Any, mesh: jax.sharding.Mesh
) -> Any:
    """Shardings of ``tx``'s state: moments like their parameters, counters replicated."""
    abstract = jax.eval_shape(tx.init, params)
    return optax.tree_utils.tree_map_params(
        tx,
        lambda _, s: s,
        abstract,
        param_sharding,
        transform_non_params=lambda _: replicated(mesh),
    )


def state_shardings(
    state: TrainState,
    mesh: jax.sharding.Mesh,
    *,
    param_sharding: Any,
    tx: optax.GradientTransformation,
    critic_param_sharding: Any = None,
    critic_tx: optax.GradientTransformation | None = None,
) -> TrainState:
    """A :class:`TrainState` of ``NamedSharding``s matching ``state``."""
    rep = replicated(mesh)
    critic = critic_opt = None
    if state.critic_params is not None:
        critic = critic_param_sharding
        critic_opt = opt_state_shardings(critic_tx, state.critic_params, critic, mesh)
    return TrainState(
        step=rep,
        params=param_sharding,
        opt_state=opt_state_shardings(tx, state.params, param_sharding, mesh),
        rng=rep,
        kl_state=jax.tree.map(lambda _: rep, state.kl_state),
        data_position=rep,
        critic_params=critic,
        critic_opt_state=critic_opt,
    )


def init_train_state(
    params: dict,
    tx: optax.GradientTransformation,
    *,
    recipe: Recipe,
    seed: int,
    critic_params: dict | None = None,
    critic_tx: optax.GradientTransformation | None = None,
    opt_sharding: Any = None,
    critic_opt_sharding: Any = None,
) -> TrainState:
    """A fresh state: step 0, optimizer states from ``tx.init``, key from ``seed``.

    With ``opt_sharding`` the optimizer state is built by a jit with those out shardings (each
    device builds its shard; counters are replicated rather than left on device 0).
    """

    def init_opt(t, p, sharding):
        if sharding is None:
            return t.init(p)
        return jax.jit(t.init, out_shardings=sharding)(p)

    critic_opt = None
    if critic_params is not None:
        critic_opt = init_opt(critic_tx, critic_params, critic_opt_sharding)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=init_opt(tx, params, opt_sharding),
        rng=jax.random.key_data(jax.random.key(seed)),
        kl_state=initial_kl_state(recipe),
        data_position=jnp.zeros((2,), jnp.int32),
        critic_params=critic_params,
        critic_opt_state=critic_opt,
    )


def split_params(module: nnx.Module) -> tuple[nnx.GraphDef, dict]:
    """``(graphdef, pure dict of parameters)``; the module must hold only ``nnx.Param``s."""
    graphdef, state = nnx.split(module)
    params = nnx.to_pure_dict(state)
    only = nnx.to_pure_dict(nnx.state(module, nnx.Param))
    if jax.tree.structure(params) != jax.tree.structure(only):
        raise ValueError(f"{type(module).__name__} holds variables other than nnx.Param")
    return graphdef, params


@dataclasses.dataclass
class TrainSetup:
    """What a run is made of: the static pieces (graphdefs, optimizers, mesh) and the state.

    ``state`` is the only part that changes; everything else is rebuilt from the config.
    """

    config: TrainConfig
    recipe: Recipe
    mesh: jax.sharding.Mesh
    rules: shd.Rules
    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    schedule: Schedule
    state: TrainState
    state_sharding: TrainState
    ref_params: dict | None = None
    critic_graphdef: nnx.GraphDef | None = None
    critic_tx: optax.GradientTransformation | None = None
    critic_schedule: Schedule | None = None

    @property
    def model_config(self):
        return self.policy().config

    def policy(self, params: dict | None = None) -> nnx.Module:
        """The policy module with ``params`` (default: the state's)."""
        return nnx.merge(self.graphdef, self.state.params if params is None else params)


def build_setup(config: TrainConfig, *, mesh: jax.sharding.Mesh | None = None) -> TrainSetup:
    """Loads the models, builds the recipe, optimizers and a fresh state on the mesh.

    Args:
      config: the run.
      mesh: a ``(data, fsdp, tensor)`` mesh; default from ``config.mesh`` and the devices.
    """
    if mesh is None:
        mesh, rules = train_models.make_mesh(config)
    else:
        rules = shd.PRESETS[config.mesh.preset]
    recipe = build_recipe(config)
    seed = config.train.seed
    with jax.set_mesh(mesh):
        policy = train_models.load_policy(config.model, mesh=mesh, rules=rules, seed=seed)
        graphdef, params = split_params(policy)
        param_sh = shd.param_shardings(nnx.state(policy, nnx.Param), mesh, rules)
        ref = None
        if needs_reference_model(config):
            ref = train_models.reference_params(params, config.kl.reference_param_dtype)
        n_updates = updates_per_step(config)
        tx, schedule = make_optimizer(
            config.optim, max_steps=config.train.max_steps, updates_per_step=n_updates
        )
        critic_graphdef = critic_params = critic_sh = critic_tx = critic_schedule = None
        if recipe.needs_critic:
            critic = train_models.load_critic(config, policy, mesh=mesh, rules=rules, seed=seed)
            critic_graphdef, critic_params = split_params(critic)
            critic_sh = shd.param_shardings(nnx.state(critic, nnx.Param), mesh, rules)
            critic_tx, critic_schedule = make_critic_optimizer(
                config.critic,
                config.optim,
                max_steps=config.train.max_steps,
                updates_per_step=n_updates,
            )
        skeleton = TrainState(
            step=np.zeros((), np.int32),
            params=params,
            opt_state=None,
            rng=np.zeros((2,), np.uint32),
            kl_state=initial_kl_state(recipe),
            data_position=np.zeros((2,), np.int32),
            critic_params=critic_params,
        )
        sharding = state_shardings(
            skeleton,
            mesh,
            param_sharding=param_sh,
            tx=tx,
            critic_param_sharding=critic_sh,
            critic_tx=critic_tx,
        )
        state = init_train_state(
            params,
            tx,
            recipe=recipe,
            seed=seed,
            critic_params=critic_params,
            critic_tx=critic_tx,
            opt_sharding=sharding.opt_state,
            critic_opt_sharding=sharding.critic_opt_state,
        )
        state = jax.device_put(state, sharding)
    return TrainSetup(
        config=config,
        recipe=recipe,
        mesh=mesh,
        rules=rules,
        graphdef=graphdef,
        tx=tx,
        schedule=schedule,
        state=state,
        state_sharding=sharding,
        ref_params=ref,
        critic_graphdef=critic_graphdef,
        critic_tx=critic_tx,
        critic_schedule=critic_schedule,
    )


__all__ = [
    "TrainSetup",
    "TrainState",
    "build_setup",
    "init_train_state",
    "initial_kl_state",
    "kl_beta",
    "lr_schedule",
    "make_critic_optimizer",
    "make_optimizer",
    "opt_state_shardings",
    "replicated",
    "split_params",
    "state_shardings",
    "updates_per_step",
]
