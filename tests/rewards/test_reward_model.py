"""The ``reward_model`` reward term: a local HF ``*ForSequenceClassification`` folder, scored by
the models layer's scalar reward head, equals transformers' own scores and enters the weighted
sum with its weight."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path

import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.config import load_config
from jaxrl_llm.train.setup import build_reward

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
PROMPTS = ["What is 7 + 5?", "What is 7 + 5?", "Name a colour.", "What is 3 * 4?"]
COMPLETIONS = ["12", "The answer is 13.", "Blue, of course", ""]


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory):
    """A tiny random LlamaForSequenceClassification (one label) with SmolLM2's tokenizer."""
    tokenizer = models.load_tokenizer(models.default_model_path())
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        # an id none of the texts contain: transformers reads the score at the last token
        # that is not pad_token_id, ours at the last masked-in token
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForSequenceClassification(config).eval()
    with torch.no_grad():  # a random head would score everything near 0
        hf.score.weight.normal_(0.0, 1.0)
    folder = tmp_path_factory.mktemp("reward_model")
    hf.save_pretrained(folder)  # safetensors
    tokenizer.save_pretrained(folder)
    assert (folder / "model.safetensors").exists()
    return folder, hf, tokenizer


def _hf_scores(hf, tokenizer) -> np.ndarray:
    """transformers' scores of each (prompt, completion) as the conversation [user, assistant],
    one sequence at a time (no padding)."""
    out = []
    for prompt, completion in zip(PROMPTS, COMPLETIONS, strict=True):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}],
            tokenize=False,
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert 0 not in ids
        with torch.no_grad():
            out.append(float(hf(torch.tensor([ids])).logits[0, 0]))
    return np.asarray(out, np.float32)


def test_reward_model_term_scores_like_transformers_and_is_weighted(reward_folder):
    folder, hf, tokenizer = reward_folder
    config = load_config(
        TINY,
        [
            f"rewards.terms=[{{type: reward_model, weight: 0.5, kwargs: {{path: '{folder}'}}}},"
            " {type: regex, weight: 2.0, kwargs: {pattern: '[0-9]'}}]"
        ],
    )
    reward = build_reward(config)
    assert reward.names == ("reward_model", "regex")
    out = reward(PROMPTS, COMPLETIONS)
    expected = _hf_scores(hf, tokenizer)
    assert np.std(expected) > 1e-2  # the texts really score differently
    np.testing.assert_allclose(out.components["reward_model"], expected, atol=1e-4, rtol=0)
    digits = np.array([1.0, 1.0, 0.0, 0.0], np.float32)
    np.testing.assert_array_equal(out.components["regex"], digits)
    np.testing.assert_allclose(out.total_n, 0.5 * expected + 2.0 * digits, atol=1e-4, rtol=0)
    assert out.num_errors == {"reward_model": 0, "regex": 0}
    metrics = out.metrics()
    assert metrics["reward/reward_model/mean"] == pytest.approx(float(np.mean(expected)), abs=1e-4)
