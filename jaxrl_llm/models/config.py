"""One frozen config for every supported decoder-only family, read from and written to HF configs.

Llama 1/2/3, Mistral, Qwen2/2.5, Qwen3 and SmolLM2 are the same network up to a handful of
switches: biases on the q/k/v projections (Qwen2), RMSNorm on q and k per head (Qwen3), a
sliding attention window (Mistral, some Qwen layers), the RoPE frequency schedule (llama3, yarn,
linear) and tied embeddings. :class:`ModelConfig` names those switches, so one module covers all
of them, and it carries the runtime policy (parameter dtype, compute dtype, remat) next to them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax.numpy as jnp

from jaxrl_llm.models.attention import IMPLEMENTATIONS as ATTENTION_IMPLS

# model_type -> the HF class names we load and export for it.
SUPPORTED_MODEL_TYPES: dict[str, dict[str, str]] = {
    "llama": {"causal_lm": "LlamaForCausalLM", "sequence_cls": "LlamaForSequenceClassification"},
    "mistral": {
        "causal_lm": "MistralForCausalLM",
        "sequence_cls": "MistralForSequenceClassification",
    },
    "qwen2": {"causal_lm": "Qwen2ForCausalLM", "sequence_cls": "Qwen2ForSequenceClassification"},
    "qwen3": {"causal_lm": "Qwen3ForCausalLM", "sequence_cls": "Qwen3ForSequenceClassification"},
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(
    name for kinds in SUPPORTED_MODEL_TYPES.values() for name in kinds.values()
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")


class UnsupportedModelError(ValueError):
    """A checkpoint names an architecture or feature this package does not implement."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint that loads only by unpickling (PyTorch ``.bin``), without ``allow_pickle``."""


def _supported_list() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of a decoder-only LM plus the dtype/remat policy it runs with.

    Hashable (all fields are scalars, strings or tuples), so it can be a static jit argument.
    ``rope_scaling`` is the HF ``rope_parameters`` dict minus ``rope_theta``, as sorted
    ``(key, value)`` pairs; ``sliding_windows`` holds one window (or ``None``) per layer.
    """

    model_type: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = (("rope_type", "default"),)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_windows: tuple[int | None, ...] | None = None
    hidden_act: str = "silu"
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # Runtime policy.
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat: str = "none"
    # Attention kernel of cache-free forward passes: auto, reference, splash, cudnn, pallas_gpu.
    attention_impl: str = "auto"
    # Most rows of logits one block of the chunked log-prob pass holds (models/logprobs.py);
    # None: the platform's default (256 on CPU, ~512 MiB of float32 logits on accelerators).
    logits_block_rows: int | None = None
    # The HF config this was read from (JSON), so export keeps fields we do not model.
    hf_config_json: str = dataclasses.field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported; supported: "
                f"{sorted(SUPPORTED_MODEL_TYPES)} (architectures {_supported_list()})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {self.rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
            )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(
                f"hidden_act {self.hidden_act!r} is not supported; supported: "
                f"{SUPPORTED_ACTIVATIONS}"
            )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}"
            )
        rows = self.logits_block_rows
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise ValueError(f"logits_block_rows must be a positive int or None, got {rows!r}")
        if self.sliding_windows is not None and len(self.sliding_windows) != self.num_layers:
            raise ValueError(
                f"sliding_windows has {len(self.sliding_windows)} entries, expected one per "
                f"layer ({self.num_layers})"
            )
        for name in ("param_dtype", "dtype"):
            object.__setattr__(self, name, jnp.dtype(getattr(self, name)).name)
        self._check_family()

    def _check_family(self) -> None:
        """Each switch must be expressible in the family's HF config, or export would lie."""
        t = self.model_type
        expected = {
            "qwen2": {"qkv_bias": True, "o_bias": False, "mlp_bias": False, "qk_norm": False},
            "mistral": {"qkv_bias": False, "o_bias": False, "mlp_bias": False, "qk_norm": False},
            "qwen3": {"o_bias": self.qkv_bias, "mlp_bias": False, "qk_norm": True},
            "llama": {"o_bias": self.qkv_bias, "qk_norm": False},
        }[t]
        for field, value in expected.items():
            if getattr(self, field) != value:
                raise ValueError(
                    f"model_type {t!r} requires {field}={value} (HF {t} checkpoints cannot "
                    f"express {field}={getattr(self, field)})"
                )
        windows = set(self.sliding_windows or ())
        if t == "llama" and windows - {None}:
            raise ValueError("llama checkpoints have no sliding window")
        if t == "mistral" and len(windows) > 1:
            raise ValueError(f"mistral uses one window for every layer, got {windows}")
        if len(windows - {None}) > 1:
            raise ValueError(f"{t} checkpoints have a single sliding_window size, got {windows}")

    @property
    def rope_type(self) -> str:
        return dict(self.rope_scaling).get("rope_type", "default")

    @property
    def num_groups(self) -> int:
        """Query heads per key/value head (GQA group size)."""
        return self.num_heads // self.num_kv_heads

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def jnp_param_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    def window(self, layer: int) -> int | None:
        return None if self.sliding_windows is None else self.sliding_windows[layer]

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ HF interop

    @classmethod
    def from_hf(cls, hf_config: Any, **policy: Any) -> ModelConfig:
        """Reads a ``transformers`` config object (or its dict); ``policy`` sets dtypes/remat."""
        d = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = d.get("architectures") or [model_type]
            raise UnsupportedModelError(
                f"architecture {archs} (model_type {model_type!r}) is not supported; supported "
                f"architectures: {_supported_list()}"
            )
        for arch in d.get("architectures") or []:
            if arch not in SUPPORTED_ARCHITECTURES:
                raise UnsupportedModelError(
                    f"architecture {arch!r} is not supported; supported architectures: "
                    f"{_supported_list()}"
                )
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        rope = dict(d.get("rope_parameters") or {})
        if not rope:  # transformers 4.x style keys
            rope = dict(d.get("rope_scaling") or {})
            rope["rope_theta"] = d.get("rope_theta", 10000.0)
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
        rope_scaling = (("rope_type", rope_type), *sorted(rope.items()))
        n_layers = d["num_hidden_layers"]
        windows = _sliding_windows(d, model_type, n_layers)
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = tuple(eos)
        if model_type == "qwen2":
            qkv_bias, o_bias, mlp_bias = True, False, False
        elif model_type == "mistral":
            qkv_bias = o_bias = mlp_bias = False
        else:  # llama, qwen3: one flag for all four projections
            qkv_bias = o_bias = bool(d.get("attention_bias", False))
            mlp_bias = bool(d.get("mlp_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=model_type == "qwen3",
            sliding_windows=windows,
            hidden_act=d.get("hidden_act", "silu"),
            pad_token_id=d.get("pad_token_id"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            hf_config_json=json.dumps(d, default=str),
            **policy,
        )

    def to_hf_dict(self, architecture: str = "causal_lm", num_labels: int = 1) -> dict[str, Any]:
        """The ``config.json`` content for export; ``architecture`` is causal_lm/sequence_cls."""
        d: dict[str, Any] = json.loads(self.hf_config_json) if self.hf_config_json else {}
        for key in ("quantization_config", "_name_or_path", "torch_dtype", "rope_scaling"):
            d.pop(key, None)
        rope = dict(self.rope_scaling)
        rope["rope_theta"] = self.rope_theta
        d.update(
            model_type=self.model_type,
            architectures=[SUPPORTED_MODEL_TYPES[self.model_type][architecture]],
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            hidden_act=self.hidden_act,
            pad_token_id=self.pad_token_id,
            bos_token_id=self.bos_token_id,
            eos_token_id=list(self.eos_token_id)
            if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
            dtype=self.param_dtype,
        )
        if self.model_type in ("llama", "qwen3"):
            d["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            d["mlp_bias"] = self.mlp_bias
        windows = [w for w in self.sliding_windows or () if w is not None]
        if self.model_type == "mistral":
            d["sliding_window"] = windows[0] if windows else None
        elif self.model_type in ("qwen2", "qwen3"):
            d["use_sliding_window"] = bool(windows)
            d["sliding_window"] = windows[0] if windows else None
            d["layer_types"] = [
                "full_attention" if w is None else "sliding_attention"
                for w in (self.sliding_windows or (None,) * self.num_layers)
            ]
            d.pop("max_window_layers", None)
        if architecture == "sequence_cls":
            d["num_labels"] = num_labels
            d["id2label"] = {str(i): f"LABEL_{i}" for i in range(num_labels)}
            d["label2id"] = {f"LABEL_{i}": i for i in range(num_labels)}
        return d


def _sliding_windows(
    d: dict[str, Any], model_type: str, n_layers: int
) -> tuple[int | None, ...] | None:
    window = d.get("sliding_window")
    if model_type == "mistral":
        return None if window is None else (int(window),) * n_layers
    if model_type in ("qwen2", "qwen3"):
        if not d.get("use_sliding_window", False) or window is None:
            return None
        types = d.get("layer_types")
        if types is None:
            start = d.get("max_window_layers", n_layers)
            types = [
                "sliding_attention" if i >= start else "full_attention" for i in range(n_layers)
            ]
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    if window is not None and d.get("use_sliding_window", True):
        raise UnsupportedModelError(f"sliding_window is not supported for {model_type!r}")
    return None
