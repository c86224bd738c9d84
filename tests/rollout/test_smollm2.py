"""The real default model, SmolLM2-135M-Instruct: greedy parity with transformers (fp32)."""

import jax
import numpy as np
import pytest
import torch

from jaxrl_llm import rollout

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is 7 + 5? Answer with just the number, then explain in one sentence.",
    "Name a primary colour.",
    "Write a haiku about the sea.",
]


def test_greedy_matches_transformers_generate(smollm2, smollm2_hf, smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids, mask = rollout.encode_prompts(tok, PROMPTS)  # ragged lengths, left-padded
    assert len(set(mask.sum(1).tolist())) == len(PROMPTS)
    out = rollout.generate(
        smollm2, ids, mask, rng=jax.random.key(0), max_new_tokens=32, temperature=0.0
    )
    tokens, valid = np.asarray(out.tokens[:, 0]), np.asarray(out.mask[:, 0])
    texts = rollout.decode_completions(tok, out.tokens, out.mask)
    for i in range(len(PROMPTS)):
        prompt = ids[i][mask[i]]
        with torch.no_grad():
            ref = smollm2_hf.generate(
                torch.tensor(prompt[None], dtype=torch.long),
                do_sample=False,
                max_new_tokens=32,
                pad_token_id=tok.pad_token_id,
            )[0, len(prompt) :].tolist()
        assert len(ref) >= 8
        assert tokens[i][valid[i]].tolist() == ref, f"prompt {i}"
        assert bool(out.truncated[i, 0]) == (ref[-1] != tok.eos_token_id)
        assert texts[i][0] == tok.decode(ref, skip_special_tokens=True)
    assert "12" in texts[0][0]


def test_sampled_logprobs_equal_training_side(smollm2, smollm2_tokenizer):
    """The on-policy check: sampler log-probs == the trainer's recomputation (fp32, 1e-4)."""
    from flax import nnx

    from jaxrl_llm.models.logprobs import completion_logprobs

    ids, mask = rollout.encode_prompts(smollm2_tokenizer, PROMPTS[:2])
    g, t, tau = 2, 24, 0.8
    out = rollout.generate(
        smollm2,
        ids,
        mask,
        rng=jax.random.key(1),
        max_new_tokens=t,
        num_samples=g,
        temperature=tau,
    )
    full = np.concatenate([np.repeat(ids, g, 0), np.asarray(out.tokens).reshape(-1, t)], 1)
    full_mask = np.concatenate([np.repeat(mask, g, 0), np.asarray(out.mask).reshape(-1, t)], 1)
    logp = nnx.jit(
        lambda m, x, k: completion_logprobs(m, x, k, start=ids.shape[1], temperature=tau)
    )(smollm2, full, full_mask)
    valid = np.asarray(out.mask).reshape(-1, t)
    ours = np.asarray(out.logprobs).reshape(-1, t)
    assert valid.sum() > 20
    np.testing.assert_allclose(ours[valid], np.asarray(logp)[valid], atol=1e-4, rtol=0)
