"""The RL train state as pure pytrees, its shardings, the optimizers and schedules.

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

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import chain as ch
from jaxrl_llm.core import kl as _kl
from jaxrl_llm.recipe import AnyRecipe, PreferenceRecipe

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

    def fn(step: jax.typing.ArrayLike) -> jax.Array:
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
    schedule: Schedule,
    *,
    updates_per_step: int,
    optimizer: str = "adamw",
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float | None = None,
    max_grad_norm: float | None = None,
) -> optax.GradientTransformation:
    """Global-norm clipping (``max_grad_norm``), then AdamW or SGD (with decoupled weight decay
    and momentum) at ``schedule`` of the training step, seen through the optimizer's update
    count divided by ``updates_per_step`` (see the module docstring)."""
    lr = _per_update(schedule, updates_per_step)
    if optimizer == "adamw":
        opt = optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    elif optimizer == "sgd":
        parts = [optax.add_decayed_weights(weight_decay)] if weight_decay else []
        opt = optax.chain(*parts, optax.sgd(lr, momentum=momentum or None))
    else:
        raise ValueError(f"unknown optimizer {optimizer!r}")
    clip = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm else []
    return optax.chain(*clip, opt)


# ---------------------------------------------------------------------------------------------
# The KL controller's state (the advantage chain's state).


def initial_kl_state(recipe: AnyRecipe) -> Any:
    """The chain's initial state (``()`` for offline recipes)."""
    if isinstance(recipe, PreferenceRecipe):
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
    recipe: AnyRecipe,
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

    def init_opt(t: optax.GradientTransformation, p: dict, sharding: Any) -> optax.OptState:
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


__all__ = [
    "TrainState",
    "init_train_state",
    "initial_kl_state",
    "kl_beta",
    "lr_schedule",
    "make_optimizer",
    "opt_state_shardings",
    "replicated",
    "split_params",
    "state_shardings",
]
