"""The real default model, SmolLM2-135M-Instruct, against transformers (fp32)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxrl_llm import models

pytestmark = pytest.mark.slow

PROMPT = "What is 7 + 5? Answer with just the number, then explain in one sentence."


def chat_ids(tokenizer, prompt: str = PROMPT) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_default_model_config(smollm2):
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (30, 576, 9, 3)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.vocab_size == 49152


def test_logits_match_transformers_on_chat_prompt(smollm2, smollm2_hf, smollm2_tokenizer):
    ids = np.asarray([chat_ids(smollm2_tokenizer)], np.int32)
    with torch.no_grad():
        ref = smollm2_hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    ours = np.asarray(nnx.jit(lambda m, x: m(x))(smollm2, jnp.asarray(ids)))
    assert np.abs(ref).max() > 10  # real logits, not a degenerate model
    np.testing.assert_allclose(ours, ref, atol=1e-3, rtol=0)


def test_greedy_tokens_match_transformers_generate(smollm2, smollm2_hf, smollm2_tokenizer):
    prompts = [chat_ids(smollm2_tokenizer), chat_ids(smollm2_tokenizer, "Name a primary colour.")]
    width = max(map(len, prompts))
    tokens = np.full((2, width), smollm2_tokenizer.pad_token_id, np.int32)
    mask = np.zeros((2, width), bool)
    for i, p in enumerate(prompts):  # left padded: the batch exercises the mask too
        tokens[i, width - len(p) :] = p
        mask[i, width - len(p) :] = True
    ours, valid = models.greedy_generate(smollm2, tokens, mask, max_new_tokens=32)
    ours, valid = np.asarray(ours), np.asarray(valid)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = smollm2_hf.generate(
                torch.tensor([p]),
                do_sample=False,
                max_new_tokens=32,
                pad_token_id=smollm2_tokenizer.pad_token_id,
            )
        ref = out[0, len(p) :].tolist()
        assert len(ref) >= 8
        assert ours[i][valid[i]].tolist() == ref[: int(valid[i].sum())]
        assert int(valid[i].sum()) == len(ref)


def test_greedy_complete_answers(smollm2, smollm2_tokenizer):
    reply = models.greedy_complete(smollm2, smollm2_tokenizer, "What is 2 + 3?", max_new_tokens=16)
    assert "5" in reply
