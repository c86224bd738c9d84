"""Tiny random HF checkpoints of every supported family, for parity tests.

Each builder returns a ``transformers`` config with the family's distinguishing features turned
on (GQA, biases, q/k norm, sliding windows, RoPE schedules, tied/untied heads) at a size that
runs in milliseconds.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
import transformers

torch.set_num_threads(1)

_BASE = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _cfg(cls, **kw):
    return cls(**{**_BASE, **kw})


FAMILIES = {
    # Llama 3.x: GQA, llama3 RoPE scaling, untied head.
    "llama3": lambda: _cfg(
        transformers.LlamaConfig,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    # Llama 2 with biases everywhere, linear RoPE scaling, tied embeddings, MHA.
    "llama_bias": lambda: _cfg(
        transformers.LlamaConfig,
        num_key_value_heads=4,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ),
    # SmolLM2: Llama architecture, tied, rope_theta 1e5, 3:1 GQA.
    "smollm2": lambda: _cfg(
        transformers.LlamaConfig,
        num_attention_heads=6,
        num_key_value_heads=2,
        hidden_size=48,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
    # Mistral: sliding window shorter than the test sequences.
    "mistral": lambda: _cfg(transformers.MistralConfig, sliding_window=5, head_dim=16),
    # Qwen2: q/k/v bias, sliding window on the second layer only, tied.
    "qwen2": lambda: _cfg(
        transformers.Qwen2Config,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        tie_word_embeddings=True,
    ),
    # Qwen3: q/k RMSNorm, head_dim != hidden/heads, yarn RoPE.
    "qwen3": lambda: _cfg(
        transformers.Qwen3Config,
        head_dim=24,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
}


def build_hf(family: str, *, seed: int = 0, cls=None, **overrides):
    """A random fp32 HF model of ``family`` (a CausalLM unless ``cls`` says otherwise)."""
    config = FAMILIES[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    cls = cls or transformers.AutoModelForCausalLM
    model = cls.from_config(config, attn_implementation="eager").eval()
    # Norm weights start at 1 and biases at 0: randomise them so the test sees them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    return model


def hf_logits(model, tokens, mask=None, positions=None) -> np.ndarray:
    kwargs = {}
    if mask is not None:
        kwargs["attention_mask"] = torch.tensor(np.asarray(mask), dtype=torch.long)
    if positions is not None:
        kwargs["position_ids"] = torch.tensor(np.asarray(positions), dtype=torch.long)
    with torch.no_grad():
        out = model(torch.tensor(np.asarray(tokens), dtype=torch.long), **kwargs)
    return out.logits.float().numpy()


def left_padded_batch(rng: np.random.RandomState, lengths, total: int, vocab: int):
    """Tokens (pad id 0) and mask for left-padded sequences of the given lengths."""
    tokens = np.zeros((len(lengths), total), np.int32)
    mask = np.zeros((len(lengths), total), bool)
    for i, n in enumerate(lengths):
        tokens[i, total - n :] = rng.randint(3, vocab, n)
        mask[i, total - n :] = True
    return tokens, mask


def positions_from_mask(mask: np.ndarray) -> np.ndarray:
    return np.maximum(np.cumsum(mask, axis=1) - 1, 0)
