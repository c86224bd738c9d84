"""The trainer's models: the policy, its frozen reference copy and the PPO critic.

The functions take plain values (paths, dtype names, flags, mesh sizes);
:mod:`jaxrl_llm.train.setup` reads them from the config. A model path is resolved here (the
CLI layer's strings stop at this module):

* ``"default"``: SmolLM2-135M-Instruct, converted once from the offline GGUF
  (:func:`jaxrl_llm.models.default_model_path`);
* ``"tiny-random"``: :func:`jaxrl_llm.models.tiny_random_config`, a 2-layer Llama of width 64
  with random weights (seeded by ``seed``) and SmolLM2's tokenizer and vocabulary, so the
  whole pipeline (chat template, rewards, export) runs in seconds per step;
* anything else: a local Hugging Face folder or ``.gguf`` file (:func:`jaxrl_llm.models.
  from_pretrained`).

The reference model is a copy of the *initial* policy weights (cast to the reference dtype),
made before a checkpoint is restored over the policy, so a resumed run keeps the same
reference. The critic (``ppo``) is a separate :class:`~jaxrl_llm.models.ValueModel`: the
policy's trunk plus a fresh scalar head, or a value checkpoint's folder.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm import models
from jaxrl_llm.models import sharding as shd
from jaxrl_llm.models.tiny import TINY_RANDOM, tiny_random_config

if TYPE_CHECKING:
    import transformers

DEFAULT = "default"


def _dtype(name: str) -> Any:
    return None if name == "auto" else jnp.dtype(name)


def make_mesh(sizes: Mapping[str, int], preset: str) -> tuple[jax.sharding.Mesh, shd.Rules]:
    """The ``(data, fsdp, tensor)`` mesh of axis ``sizes`` over the first devices, and the
    sharding rules of ``preset`` (a key of :data:`jaxrl_llm.models.sharding.PRESETS`)."""
    n = math.prod(sizes.values())
    mesh = shd.make_mesh(**sizes, devices=jax.devices()[:n])
    return mesh, shd.PRESETS[preset]


def resolve_model_path(path: str) -> str:
    """``"default"`` → the cached SmolLM2 folder; other paths unchanged."""
    return str(models.default_model_path()) if path == DEFAULT else path


def load_tokenizer(
    path: str,
    *,
    tokenizer: str | None = None,
    trust_remote_code: bool = False,
    vocab_size: int | None = None,
) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer of the model at ``path``: the folder ``tokenizer`` or the model's own
    (SmolLM2's for tiny-random).

    ``trust_remote_code`` is passed to transformers. With ``vocab_size`` (the policy's), a
    tokenizer that cannot belong to the model is a :class:`~jaxrl_llm.data.DataError` naming
    ``model.path`` and ``model.tokenizer``.
    """
    if tokenizer is not None:
        folder = resolve_model_path(tokenizer)
    elif path == TINY_RANDOM:
        folder = models.default_model_path()
    else:
        folder = resolve_model_path(path)
    tok = models.load_tokenizer(folder, trust_remote_code=trust_remote_code)
    if vocab_size is not None:
        from jaxrl_llm.data import DataError, check_tokenizer_vocab

        try:
            check_tokenizer_vocab(tok, vocab_size)
        except DataError as e:
            raise DataError(
                f"model.path = {path!r} with model.tokenizer = {tokenizer!r}: {e}"
            ) from None
    return tok


def load_policy(
    path: str,
    *,
    dtype: str = "auto",
    param_dtype: str = "float32",
    remat: str = "none",
    attention: str = "auto",
    allow_pickle: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    rules: shd.Rules = shd.DEFAULT_RULES,
    seed: int = 0,
) -> models.CausalLM:
    """The policy at ``path`` as a :class:`~jaxrl_llm.models.CausalLM`, sharded over ``mesh``
    if given.

    Args:
      path: ``"default"``, ``"tiny-random"`` (random weights from ``seed``), or a folder/GGUF.
      dtype: compute dtype name, ``"auto"``: bfloat16 on accelerators, float32 on CPU.
      param_dtype: the stored parameters' dtype name.
      remat: activation checkpointing (``"none"``, ``"full"``, ``"dots"``, ``"dots_no_batch"``).
      attention: the attention implementation (``ModelConfig.attention_impl``, attention.py).
      allow_pickle: permit PyTorch ``.bin`` weights (trusted checkpoints only).
      mesh, rules: where the parameters go.
      seed: initialisation of random weights (tiny-random, fresh heads).
    """
    if path == TINY_RANDOM:
        compute = _dtype(dtype) or models.default_dtype()
        config = tiny_random_config(
            param_dtype=param_dtype,
            dtype=jnp.dtype(compute).name,
            remat=remat,
            attention_impl=attention,
        )
        lm = models.CausalLM(config, rngs=nnx.Rngs(seed))
        return shd.shard_model(lm, mesh, rules) if mesh is not None else lm
    return models.from_pretrained(
        resolve_model_path(path),
        dtype=_dtype(dtype),
        param_dtype=jnp.dtype(param_dtype),
        mesh=mesh,
        rules=rules,
        remat=remat,
        attention_impl=attention,
        allow_pickle=allow_pickle,
        seed=seed,
    )


def load_critic(
    policy: models.CausalLM,
    *,
    path: str | None = None,
    dtype: str = "auto",
    param_dtype: str = "float32",
    remat: str = "none",
    attention: str = "auto",
    allow_pickle: bool = False,
    mesh: jax.sharding.Mesh | None = None,
    rules: shd.Rules = shd.DEFAULT_RULES,
    seed: int = 0,
) -> models.ValueModel:
    """The PPO critic: the value checkpoint at ``path`` (loaded with the policy's ``dtype``,
    ``param_dtype``, ``remat``, ``attention`` and ``allow_pickle``), or, without one,
    ``policy``'s trunk + a new head seeded by ``seed + 1``."""
    if path is not None:
        return models.from_pretrained(
            resolve_model_path(path),
            dtype=_dtype(dtype),
            param_dtype=jnp.dtype(param_dtype),
            mesh=mesh,
            rules=rules,
            head="value",
            remat=remat,
            attention_impl=attention,
            allow_pickle=allow_pickle,
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
