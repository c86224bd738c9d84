"""The trainer collects what ReMax and GDPO read: a greedy baseline per prompt and the reward
terms apart."""

from __future__ import annotations

import jax
import numpy as np

from jaxrl_llm import chain as ch
from jaxrl_llm.data import BatchIterator
from jaxrl_llm.train import loop
from jaxrl_llm.train import setup as setup_lib
from jaxrl_llm.train.collect import collect, sample_completions, score_completions
from tests.train import helpers as H

TERMS = (
    "rewards.terms=[{type: length_penalty, kwargs: {target: 10, unit: chars, coef: 0.1}},"
    " {type: regex, weight: 0.5, kwargs: {pattern: '[aeiou]'}}]"
)


def _collect(*overrides: str):
    s = setup_lib.resolve(H.config("tiny.yaml", TERMS, *overrides))
    it = BatchIterator(s.data.train, s.loop.batch_size, seed=0, shuffle=False, pad_multiple=8)
    batch = BatchIterator(s.data.train, s.loop.batch_size, seed=0, shuffle=False, pad_multiple=8)
    groups, metrics = collect(s, s.state.params, it, jax.random.key(0))
    return s, batch.next_batch(), groups, metrics


def test_remax_gets_the_greedy_completions_reward_as_baseline():
    s, batch, groups, metrics = _collect("algorithm.name=remax")
    assert ch.GIVEN_BASELINE in s.recipe.requires
    greedy = sample_completions(
        s.models,
        s.state.params,
        s.sampler.greedy(),
        batch.prompt_ids_bt,
        batch.prompt_mask_bt,
        jax.random.key(1),
    )
    expected, _, _ = score_completions(
        s.tokenizer, s.reward, batch.prompts, batch.fields, greedy.tokens, greedy.mask
    )
    np.testing.assert_allclose(groups.baseline_b, expected[:, 0])
    assert metrics["reward/greedy_baseline_mean"] == np.mean(expected)
    assert groups.reward_bgk is None


def test_gdpo_gets_the_reward_terms_apart():
    s, _, groups, _ = _collect("algorithm.hparams.reward_aggregation=normalize_then_sum")
    b, g = groups.reward_bg.shape
    assert groups.reward_bgk.shape == (b, g, 2) and groups.baseline_b is None
    weights = np.asarray([t.weight for t in s.reward.terms])
    np.testing.assert_allclose(groups.reward_bgk @ weights, groups.reward_bg, rtol=1e-6)
    assert np.std(groups.reward_bgk[..., 0]) > 0  # the length term varies: not all zeros


def test_remax_and_gdpo_train(tmp_path):
    for name, extra in (
        ("remax", ["algorithm.name=remax"]),
        ("gdpo", ["algorithm.hparams.reward_aggregation=normalize_then_sum"]),
    ):
        config = H.config("tiny.yaml", TERMS, "train.max_steps=1", "data.eval_size=0", *extra)
        out = loop.train(config, run_dir=tmp_path / name, progress=False, log=lambda *_: None)
        assert out["step"] == 1 and np.isfinite(out["actor/loss"])
        assert out["actor/grad_norm"] > 0


def test_gdpo_weights_must_match_the_reward_terms():
    import pytest

    from jaxrl_llm.config import ConfigError

    gdpo = "algorithm.hparams.reward_aggregation=normalize_then_sum"
    with pytest.raises(ConfigError, match=r"reward_weights.*one weight per rewards\.terms"):
        H.config("tiny.yaml", TERMS, gdpo, "algorithm.hparams.reward_weights=[1.0, 2.0, 3.0]")
    H.config("tiny.yaml", TERMS, gdpo, "algorithm.hparams.reward_weights=[1.0, 2.0]")


def test_mask_truncated_completions_drops_their_loss_tokens_only():
    cut = ("rollout.max_new_tokens=4", "rollout.stop_token_ids=[]")  # every completion is cut
    _, _, kept, m_kept = _collect(*cut)
    _, _, masked, m_masked = _collect(*cut, "rollout.mask_truncated_completions=true")
    assert kept.mask_bgt.all() and not masked.mask_bgt.any()
    np.testing.assert_array_equal(masked.reward_bg, kept.reward_bg)  # rewards still count
    np.testing.assert_array_equal(masked.tokens_bgt, kept.tokens_bgt)
    assert m_masked["response_length/mean"] == m_kept["response_length/mean"] == 4
    assert m_masked["response_length/truncated_fraction"] == 1.0
