"""``tiny-random``: a tiny random Llama that runs the whole pipeline in seconds per step.

:func:`tiny_random_config` is a 2-layer Llama of width 64 with SmolLM2's vocabulary and eos/pad
ids, so it works with SmolLM2's tokenizer and chat template (the trainer's ``model.path:
tiny-random``, configs/tiny.yaml). It learns nothing useful; it is for tests and smoke runs.
"""

from __future__ import annotations

from typing import Any

from jaxrl_llm.models.config import ModelConfig

TINY_RANDOM = "tiny-random"


def tiny_random_config(vocab_size: int = 49152, **overrides: Any) -> ModelConfig:
    """A tiny Llama (2 layers, width 64, 4 query / 2 KV heads, tied embeddings).

    The vocabulary defaults to SmolLM2's (49152) so the model works with that tokenizer; the
    eos/pad ids are SmolLM2's ``<|im_end|>`` (2). Any field can be overridden (e.g. a small
    ``vocab_size`` for unit tests that need no tokenizer).
    """
    fields: dict[str, Any] = dict(
        model_type="llama",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=2,
        bos_token_id=1,
        eos_token_id=2,
    )
    fields.update(overrides)
    return ModelConfig(**fields)
