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
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm import distributed as dist
from jaxrl_llm import models
from jaxrl_llm.models import lora
from jaxrl_llm.models import sharding as shd
from jaxrl_llm.models.lora import LoRAConfig, combine
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


class Adapted(NamedTuple):
    """A model with LoRA adapters, split for training (see :func:`adapt`).

    Attributes:
      graphdef: the adapted model's graph definition.
      base_graphdef: the base's (no adapters): ``nnx.merge(base_graphdef, frozen)`` is the
        base model, i.e. the reference policy.
      params, params_sharding: the trainable parameters (adapters, plus a critic's head).
      frozen, frozen_sharding: everything else, frozen.
    """

    graphdef: Any
    base_graphdef: Any
    params: dict
    params_sharding: Any
    frozen: dict
    frozen_sharding: Any


def lora_config(section: Any) -> LoRAConfig | None:
    """A ``model.lora`` / ``critic.lora`` config section (anything with the fields) as a
    :class:`~jaxrl_llm.models.lora.LoRAConfig`; None stays None."""
    if section is None:
        return None
    return LoRAConfig(
        rank=section.rank,
        alpha=float(section.alpha),
        dropout=float(section.dropout),
        targets=tuple(section.targets),
        use_rslora=section.use_rslora,
    )


def adapt(
    model: Any,
    config: LoRAConfig,
    *,
    quantize: str = "none",
    adapter: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    rules: shd.Rules = shd.DEFAULT_RULES,
    seed: int = 0,
    trainable_extra: str | None = None,
) -> Adapted:
    """Freezes ``model``'s weights (quantised with ``quantize``: none, int8, nf4, int4), adds
    adapters (fresh with ``B = 0`` from ``seed``, or the PEFT folder ``adapter``) and splits
    it into trainable adapters and the frozen base, laid out over ``mesh``. The model is
    changed in place. ``trainable_extra``: a module name trained in full as well (a critic's
    ``score`` head)."""
    if quantize != "none":
        from jaxrl_llm.models import quant

        quant.quantize_model(model, quantize)
    base_graphdef = nnx.graphdef(model)
    if adapter is not None:
        from jaxrl_llm.models import peft

        peft.apply_adapter(model, adapter, expected=config)
    else:
        lora.apply_lora(model, config, rngs=nnx.Rngs(seed + 2))
    trainable = lora.trainable_filter(trainable_extra)
    graphdef, frozen, params = lora.split(model, trainable)
    params_sh = frozen_sh = None
    if mesh is not None:
        frozen_state, trainable_state = lora.split_states(model, trainable)
        params_sh = shd.param_shardings(trainable_state, mesh, rules)
        frozen_sh = shd.param_shardings(frozen_state, mesh, rules)
        params = dist.put(params, params_sh)
        frozen = dist.put(frozen, frozen_sh)
    return Adapted(graphdef, base_graphdef, params, params_sh, frozen, frozen_sh)


__all__ = [
    "DEFAULT",
    "TINY_RANDOM",
    "Adapted",
    "LoRAConfig",
    "adapt",
    "combine",
    "load_critic",
    "load_policy",
    "load_tokenizer",
    "lora_config",
    "make_mesh",
    "reference_params",
    "resolve_model_path",
    "tiny_random_config",
]
