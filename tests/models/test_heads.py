"""Reward and value heads against transformers' *ForSequenceClassification (fp32)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxrl_llm import models
from tests.models import hf_tiny


@nnx.jit
def forward(model, tokens_bt, mask_bt):
    return model(tokens_bt, mask_bt)


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    hf = hf_tiny.build_hf(
        "llama3", seed=1, cls=transformers.AutoModelForSequenceClassification, num_labels=1
    )
    path = tmp_path_factory.mktemp("rm")
    hf.save_pretrained(path)
    return hf, path


def _batch(pad_id: int):
    rng = np.random.RandomState(0)
    tokens, mask = hf_tiny.left_padded_batch(rng, [9, 4, 6], 9, 96)
    tokens[~mask] = pad_id
    return tokens, mask


def test_reward_model_scores_match_transformers(reward):
    hf, path = reward
    assert hf.score.weight.shape == (1, hf.config.hidden_size)
    rm = models.from_pretrained(path)
    assert isinstance(rm, models.RewardModel)
    tokens, mask = _batch(hf.config.pad_token_id)
    with torch.no_grad():
        ref = hf(
            torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(hf_tiny.positions_from_mask(mask), dtype=torch.long),
        ).logits.numpy()[:, 0]
    ours = np.asarray(forward(rm, jnp.asarray(tokens), jnp.asarray(mask)))
    assert ours.shape == (3,) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_reward_model_reads_last_real_token_with_right_padding(reward):
    hf, path = reward
    rm = models.from_pretrained(path)
    tokens, mask = _batch(hf.config.pad_token_id)
    left = np.asarray(forward(rm, jnp.asarray(tokens), jnp.asarray(mask)))
    right_t = np.stack([np.roll(t, m.sum()) for t, m in zip(tokens, mask, strict=True)])
    right_m = np.stack([np.roll(m, m.sum()) for m in mask])
    right = np.asarray(forward(rm, jnp.asarray(right_t), jnp.asarray(right_m)))
    np.testing.assert_allclose(right, left, atol=1e-5)
    np.testing.assert_array_equal(models.last_token_index(jnp.asarray(right_m)), [8, 3, 5])


def test_reward_and_value_export_round_trip(reward, tmp_path):
    hf, path = reward
    rm = models.from_pretrained(path)
    out = models.save_pretrained(rm, tmp_path / "rm")
    again = transformers.AutoModelForSequenceClassification.from_pretrained(out)
    tokens, mask = _batch(hf.config.pad_token_id)
    with torch.no_grad():
        ref = again(torch.tensor(tokens[:1], dtype=torch.long)).logits.numpy()[:, 0]
    np.testing.assert_allclose(
        np.asarray(forward(rm, jnp.asarray(tokens[:1]), jnp.asarray(mask[:1]))), ref, atol=1e-4
    )
    # A critic is the same parameter layout read at every position.
    critic = models.from_pretrained(out, head="value")
    values = np.asarray(forward(critic, jnp.asarray(tokens), jnp.asarray(mask)))
    assert values.shape == tokens.shape
    last = np.asarray(models.last_token_index(jnp.asarray(mask)))
    scores = np.asarray(forward(rm, jnp.asarray(tokens), jnp.asarray(mask)))
    np.testing.assert_allclose(values[np.arange(3), last], scores, atol=1e-5)
