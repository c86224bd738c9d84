"""The trainer's models: the policy, its frozen reference copy and the PPO critic, from a config.

``model.path`` is resolved here (the CLI layer's strings stop at this module):

* ``"default"``: SmolLM2-135M-Instruct, converted once from the offline GGUF
  (:func:`jaxrl_llm.models.default_model_path`);
* ``"tiny-random"``: :func:`jaxrl_llm.models.tiny_random_config`, a 2-layer Llama of width 64
  with random weights (seeded by ``train.seed``) and SmolLM2's tokenizer and vocabulary, so the
  whole pipeline (chat template, rewards, export) runs in seconds per step;
* anything else: a local Hugging Face folder or ``.gguf`` file (:func:`jaxrl_llm.models.
  from_pretrained`).

The reference model is a copy of the *initial* policy weights (cast to
``kl.reference_param_dtype``), made before a checkpoint is restored over the policy, so a
resumed run keeps the same reference. The critic (``ppo``) is a separate
:class:`~jaxrl_llm.models.ValueModel`: the policy's trunk plus a fresh scalar head, or
``critic.path``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm import models
from jaxrl_llm.config import ModelLoadConfig, TrainConfig, check_devices
from jaxrl_llm.models import sharding as shd
from jaxrl_llm.models.tiny import TINY_RANDOM, tiny_random_config

DEFAULT = "default"


def _dtype(name: str) -> Any:
    return None if name == "auto" else jnp.dtype(name)


def make_mesh(config: TrainConfig) -> tuple[jax.sharding.Mesh, shd.Rules]:
    """The run's ``(data, fsdp, tensor)`` mesh over the first devices, and its sharding rules."""
    sizes = check_devices(config, jax.device_count())
    n = math.prod(sizes.values())
    mesh = shd.make_mesh(**sizes, devices=jax.devices()[:n])
    return mesh, shd.PRESETS[config.mesh.preset]


def resolve_model_path(path: str) -> str:
    """``"default"`` → the cached SmolLM2 folder; other paths unchanged."""
    return str(models.default_model_path()) if path == DEFAULT else path


def load_tokenizer(model: ModelLoadConfig, *, vocab_size: int | None = None):
    """The run's tokenizer: ``model.tokenizer`` or the model's own (SmolLM2's for tiny-random).

    ``model.trust_remote_code`` is passed to transformers. With ``vocab_size`` (the policy's),
    a tokenizer that cannot belong to the model is a :class:`~jaxrl_llm.data.DataError` naming
    ``model.path`` and ``model.tokenizer``.
    """
    if model.tokenizer is not None:
        path = resolve_model_path(model.tokenizer)
    elif model.path == TINY_RANDOM:
        path = models.default_model_path()
    else:
        path = resolve_model_path(model.path)
    tokenizer = models.load_tokenizer(path, trust_remote_code=model.trust_remote_code)
    if vocab_size is not None:
        from jaxrl_llm.data import DataError, check_tokenizer_vocab

        try:
            check_tokenizer_vocab(tokenizer, vocab_size)
        except DataError as e:
            raise DataError(
                f"model.path = {model.path!r} with model.tokenizer = {model.tokenizer!r}: {e}"
            ) from None
    return tokenizer


def load_policy(
    model: ModelLoadConfig,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: shd.Rules = shd.DEFAULT_RULES,
    seed: int = 0,
) -> models.CausalLM:
    """The policy as a :class:`~jaxrl_llm.models.CausalLM`, sharded over ``mesh`` if given."""
    if model.path == TINY_RANDOM:
        dtype = _dtype(model.dtype) or models.default_dtype()
        config = tiny_random_config(
            param_dtype=model.param_dtype, dtype=jnp.dtype(dtype).name, remat=model.remat
        )
        lm = models.CausalLM(config, rngs=nnx.Rngs(seed))
        return shd.shard_model(lm, mesh, rules) if mesh is not None else lm
    return models.from_pretrained(
        resolve_model_path(model.path),
        dtype=_dtype(model.dtype),
        param_dtype=jnp.dtype(model.param_dtype),
        mesh=mesh,
        rules=rules,
        remat=model.remat,
        allow_pickle=model.allow_pickle,
        seed=seed,
    )


def load_critic(
    config: TrainConfig,
    policy: models.CausalLM,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: shd.Rules = shd.DEFAULT_RULES,
    seed: int = 0,
) -> models.ValueModel:
    """The PPO critic: ``critic.path`` as a value model, or the policy's trunk + a new head."""
    if config.critic.path is not None:
        return models.from_pretrained(
            resolve_model_path(config.critic.path),
            dtype=_dtype(config.model.dtype),
            param_dtype=jnp.dtype(config.model.param_dtype),
            mesh=mesh,
            rules=rules,
            head="value",
            remat=config.model.remat,
            allow_pickle=config.model.allow_pickle,
            seed=seed,
        )
    critic = models.ValueModel.from_causal_lm(policy, rngs=nnx.Rngs(seed + 1))
    return shd.shard_model(critic, mesh, rules) if mesh is not None else critic


def reference_params(params: dict, dtype: str = "float32") -> dict:
    """A frozen copy of ``params`` in ``dtype`` (same sharding), for reference log-probs."""
    dtype = jnp.dtype(dtype)
    return jax.tree.map(lambda x: jnp.array(x, dtype=dtype, copy=True), params)


__all__ = [
    "DEFAULT",
    "TINY_RANDOM",
    "load_critic",
    "load_policy",
    "load_tokenizer",
    "make_mesh",
    "reference_params",
    "resolve_model_path",
    "tiny_random_config",
]
