"""Flax NNX decoder LMs (Llama/Mistral/Qwen2/Qwen3/SmolLM2), heads, HF import/export, sharding.

from jaxrl_llm import models
path = models.default_model_path()          # SmolLM2-135M-Instruct, cached HF folder
model = models.from_pretrained(path)        # CausalLM: int32[B, T] -> float32[B, T, V]
tokenizer = models.load_tokenizer(path)
models.save_pretrained(model, "out/", tokenizer=tokenizer)   # transformers loads "out/"
"""

from jaxrl_llm.models import attention
from jaxrl_llm.models.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    UnsafeCheckpointError,
    UnsupportedModelError,
)
from jaxrl_llm.models.default import DEFAULT_MODEL_NAME, default_model_path
from jaxrl_llm.models.greedy import greedy_complete, greedy_generate
from jaxrl_llm.models.heads import RewardModel, ValueModel, last_token_index
from jaxrl_llm.models.hub import (
    default_dtype,
    from_pretrained,
    load_tokenizer,
    model_context,
    read_generation_config,
    save_pretrained,
)
from jaxrl_llm.models.tiny import TINY_RANDOM, tiny_random_config
from jaxrl_llm.models.transformer import CausalLM, Decoder, KVCache
from jaxrl_llm.models.weights import ModelLoadError

__all__ = [
    "DEFAULT_MODEL_NAME",
    "SUPPORTED_ARCHITECTURES",
    "TINY_RANDOM",
    "CausalLM",
    "Decoder",
    "KVCache",
    "ModelConfig",
    "ModelLoadError",
    "RewardModel",
    "UnsafeCheckpointError",
    "UnsupportedModelError",
    "ValueModel",
    "attention",
    "default_dtype",
    "default_model_path",
    "from_pretrained",
    "greedy_complete",
    "greedy_generate",
    "last_token_index",
    "load_tokenizer",
    "model_context",
    "read_generation_config",
    "save_pretrained",
    "tiny_random_config",
]
