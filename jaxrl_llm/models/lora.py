"""LoRA adapters on the stacked projections (Hu et al. 2021, "LoRA: Low-Rank Adaptation").

A target projection ``y = x W`` (``W`` input-first, ``[*in, *out]``) becomes

    y = x W + s · (x A) B,      A: [*in, r],  B: [r, *out],  s = α / r   (rsLoRA: α / √r)

with ``A ~ U(−1/√K, 1/√K)`` (``K = prod(in)``: PyTorch's ``kaiming_uniform_(a=√5)``, PEFT's
default) and ``B = 0``, so the adapted model starts exactly equal to the base. The adapters
live with the stacked layers: ``q_proj.lora_a`` is ``[L, D, r]`` and ``q_proj.lora_b`` is
``[L, r, H, Dh]``, and they carry the base kernel's logical axes (``("layers", "embed",
"lora_rank")`` / ``("layers", "lora_rank", "q_heads", "head_dim")``), so they shard like the
matrix they adapt; ``lora_rank`` is replicated by every rules table.

Adapters are :class:`flax.nnx.LoRAParam` (a ``Param`` subclass), so ``nnx.split(model,
nnx.LoRAParam, nnx.Param)`` separates the trainable adapters from the frozen base
(:func:`split`). The base may be bf16 (or quantised, :mod:`jaxrl_llm.models.quant`) while the
adapters stay f32. With the adapters removed the model *is* the base, which is why a LoRA run
needs no reference copy: π_ref is the frozen base itself.

PEFT's names: our ``model.layers.self_attn.q_proj.lora_a[l]`` is PEFT's
``base_model.model.model.layers.{l}.self_attn.q_proj.lora_A.weight`` transposed to
``[r, K]`` (see :mod:`jaxrl_llm.models.peft`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm import distributed as dist

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
"""Every projection LoRA can adapt (the HF module names)."""

RANK_AXIS = "lora_rank"


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Adapter settings (PEFT's ``LoraConfig`` names: ``r``, ``lora_alpha``, ``lora_dropout``,
    ``target_modules``, ``use_rslora``).

    Attributes:
      rank: r ≥ 1.
      alpha: α > 0; the update is scaled by ``α / r`` (``α / √r`` with ``use_rslora``).
      dropout: inverted dropout on the adapter branch's input ``x`` in the update's forward
        pass (PEFT's ``lora_dropout``, applied before ``A``); the π_old / π_ref passes and the
        sampler run without it. Each token's mask comes from its own key (see
        ``transformer.lora_dropout``), so micro-batching and packing do not change it.
      targets: the projections adapted in every layer (a subset of :data:`TARGETS`).
      use_rslora: rank-stabilised scaling (Kalajdzievski 2023, "A Rank Stabilization Scaling
        Factor for Fine-Tuning with LoRA").
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS
    use_rslora: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        check_config(self)

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def check_config(config: LoRAConfig) -> None:
    """Raises ``ValueError`` naming the bad field (``model.lora.<field>``) and what is valid."""
    if isinstance(config.rank, bool) or not isinstance(config.rank, int) or config.rank < 1:
        raise ValueError(f"model.lora.rank must be an integer >= 1, got {config.rank!r}")
    if not (isinstance(config.alpha, (int, float)) and math.isfinite(config.alpha)) or (
        config.alpha <= 0
    ):
        raise ValueError(f"model.lora.alpha must be a finite number > 0, got {config.alpha!r}")
    if not 0.0 <= config.dropout < 1.0:
        raise ValueError(f"model.lora.dropout must be in [0, 1), got {config.dropout!r}")
    if not config.targets:
        raise ValueError(f"model.lora.targets is empty; choose from {list(TARGETS)}")
    unknown = [t for t in config.targets if t not in TARGETS]
    if unknown:
        raise ValueError(
            f"model.lora.targets: {unknown} match no projection of the model; the projections "
            f"are {list(TARGETS)}"
        )
    if len(set(config.targets)) != len(config.targets):
        raise ValueError(f"model.lora.targets lists a projection twice: {list(config.targets)}")


def _projections(model: nnx.Module, targets: Sequence[str]) -> Iterator[tuple[str, Any]]:
    """``(name, _Proj)`` of each target projection in the stacked layers of ``model`` (a
    CausalLM or a ValueModel: anything with ``.model.layers``)."""
    layers = model.model.layers
    for name in targets:
        parent = layers.self_attn if name in ATTENTION_TARGETS else layers.mlp
        yield name, getattr(parent, name)


def apply_lora(model: nnx.Module, config: LoRAConfig, *, rngs: nnx.Rngs) -> nnx.Module:
    """Adds ``lora_a`` / ``lora_b`` adapters (``B = 0``) to ``config.targets`` of every layer of
    ``model``, in place; returns ``model``. The adapters are f32 and placed like their base
    kernel (same sharding when the kernel is sharded)."""
    check_config(config)
    for name, proj in _projections(model, config.targets):
        if proj.lora_a is not None:
            raise ValueError(f"{name} already has LoRA adapters")
        kernel = proj.kernel
        meta = kernel.get_metadata()  # a quantised kernel keeps its float axes apart
        axes = tuple(meta.get("float_logical_axes", meta["logical_axes"]))
        shape = proj.kernel_shape
        n_lead = len(shape) - len(proj.unstacked_shape)
        n_in = n_lead + proj.n_in
        lead, ins, outs = shape[:n_lead], shape[n_lead:n_in], shape[n_in:]
        fan_in = math.prod(ins)
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(
            rngs.params(), (*lead, *ins, config.rank), jnp.float32, -bound, bound
        )
        b = jnp.zeros((*lead, config.rank, *outs), jnp.float32)
        sharding = getattr(kernel[...], "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            from jaxrl_llm.models import sharding as shd

            mesh = sharding.mesh
            spec_a = shd.logical_to_spec((*axes[:n_in], RANK_AXIS), a.shape, mesh, warn=False)
            spec_b = shd.logical_to_spec(
                (*axes[:n_lead], RANK_AXIS, *axes[n_in:]), b.shape, mesh, warn=False
            )
            a = dist.put(a, jax.sharding.NamedSharding(mesh, spec_a))
            b = dist.put(b, jax.sharding.NamedSharding(mesh, spec_b))
        proj.lora_a = nnx.LoRAParam(a, logical_axes=(*axes[:n_in], RANK_AXIS))
        proj.lora_b = nnx.LoRAParam(b, logical_axes=(*axes[:n_lead], RANK_AXIS, *axes[n_in:]))
        proj.lora_scale = float(config.scale)
        proj.lora_dropout = float(config.dropout)
        proj.lora_salt = TARGETS.index(name)
    return model


def has_lora(model: nnx.Module) -> bool:
    """Whether any projection of ``model`` carries adapters."""
    return any(isinstance(v, nnx.LoRAParam) for _, v in nnx.iter_graph(model))


def trainable_filter(extra: str | None = None) -> Any:
    """The ``nnx`` filter of the trainable parameters: the adapters, plus every parameter
    whose path holds the module name ``extra`` (a critic's fresh ``score`` head)."""
    if extra is None:
        return nnx.LoRAParam
    return nnx.Any(nnx.LoRAParam, nnx.All(nnx.Param, nnx.PathContains(extra)))


def split(model: nnx.Module, trainable: Any = nnx.LoRAParam) -> tuple[nnx.GraphDef, dict, dict]:
    """``(graphdef, frozen, adapters)``: pure dicts of the base parameters and of the trainable
    ones (``trainable``, an ``nnx`` filter; default the adapters);
    ``nnx.merge(graphdef, combine(frozen, adapters))`` rebuilds the model."""
    graphdef, adapters, frozen = nnx.split(model, trainable, nnx.Param)
    return graphdef, nnx.to_pure_dict(frozen), nnx.to_pure_dict(adapters)


def split_states(model: nnx.Module, trainable: Any = nnx.LoRAParam) -> tuple[nnx.State, nnx.State]:
    """``(frozen, trainable)`` as ``nnx.State``s with their variables' metadata (for
    :func:`jaxrl_llm.models.sharding.param_shardings`)."""
    adapters, frozen = nnx.state(model, trainable, nnx.Param)
    return frozen, adapters


def combine(frozen: dict, adapters: dict) -> dict:
    """The full parameter dict: ``frozen`` with ``adapters`` merged in (pytree-only, no copy;
    traceable). The two must not share a leaf path."""
    out = dict(frozen)
    for key, value in adapters.items():
        if key in out and isinstance(out[key], dict) and isinstance(value, dict):
            out[key] = combine(out[key], value)
        elif key in out:
            raise ValueError(f"adapter leaf {key!r} is also a frozen parameter")
        else:
            out[key] = value
    return out


def merge_into_base(model: nnx.Module) -> nnx.Module:
    """Folds every adapter into its base kernel and removes the adapters, in place: the result
    is a plain float model with the adapted model's function (for export and for sampling
    merged). A quantised base (QLoRA) is dequantised: its merged kernels are float32."""
    for _, proj in _projections(model, TARGETS):
        if proj.lora_a is None and proj.quant is None:
            continue
        merged = proj.merged_kernel()
        if proj.quant is not None:
            axes = proj.kernel.get_metadata()["float_logical_axes"]
            proj.kernel = nnx.Param(merged, logical_axes=tuple(axes))
            proj.kernel_scales = nnx.data(None)
            proj.quant = None
        else:
            proj.kernel[...] = merged
        proj.lora_a = nnx.data(None)
        proj.lora_b = nnx.data(None)
        proj.lora_scale = 1.0
        proj.lora_dropout = 0.0
    return model


@functools.cache
def _merged_params_fn(graphdef: nnx.GraphDef) -> Any:
    def merged(frozen: dict, adapters: dict) -> dict:
        module = merge_into_base(nnx.merge(graphdef, combine(frozen, adapters)))
        return nnx.to_pure_dict(nnx.state(module, nnx.Param))

    return jax.jit(merged)


def merged_params(graphdef: nnx.GraphDef, frozen: dict, adapters: dict) -> dict:
    """The parameters of the merged model (``W + s·A B`` for every adapted kernel; a quantised
    base comes back dequantised), jitted once per ``graphdef``: the parameter dict of the
    base's structure, for sampling merged. Costs one float copy of the adapted kernels."""
    return _merged_params_fn(graphdef)(frozen, adapters)


def num_adapter_params(model: nnx.Module) -> int:
    return sum(int(v[...].size) for _, v in nnx.iter_graph(model) if isinstance(v, nnx.LoRAParam))


__all__ = [
    "ATTENTION_TARGETS",
    "MLP_TARGETS",
    "RANK_AXIS",
    "TARGETS",
    "LoRAConfig",
    "apply_lora",
    "check_config",
    "combine",
    "has_lora",
    "merge_into_base",
    "merged_params",
    "num_adapter_params",
    "split",
    "split_states",
    "trainable_filter",
]
