"""Presets reproduce the peers' golden numbers (docs/numerics.md)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_llm as jrl
from jaxrl_llm import algorithms as alg
from jaxrl_llm import numerics as nm


def one_token_rollout(rewards):
    rewards = jnp.asarray(rewards, jnp.float32)[None]
    return jrl.Rollout(reward_bg=rewards, mask_bgt=jnp.ones((*rewards.shape, 1), bool))


ATOL = {"trl": 1e-4, "default": 1e-5}  # the quoted values are rounded


@pytest.mark.parametrize(
    ("preset", "rewards", "expected"),
    [
        ("verl", [1, 0, 0, 1], [0.866024, -0.866024, -0.866024, 0.866024]),
        ("trl", [1, 0, 0, 1], [0.865875, -0.865875, -0.865875, 0.865875]),
        ("openrlhf", [1, 0, 0, 1], [0.866025, -0.866025, -0.866025, 0.866025]),
        ("default", [1, 0, 0, 1], [1.0, -1.0, -1.0, 1.0]),
        ("verl", [1, 1, 1, 0], [0.499999, 0.499999, 0.499999, -1.499997]),
        ("trl", [1, 1, 1, 0], [0.4999, 0.4999, 0.4999, -1.4997]),
        ("openrlhf", [1, 1, 1, 0], [0.5, 0.5, 0.5, -1.5]),
        ("default", [1, 1, 1, 0], [0.57735, 0.57735, 0.57735, -1.73205]),
    ],
)
def test_grpo_group_normalisation_golden(preset, rewards, expected):
    adv = jrl.compute_advantages(alg.grpo(numerics=preset), one_token_rollout(rewards))
    np.testing.assert_allclose(adv[0, :, 0], expected, atol=ATOL.get(preset, 2e-6))


def test_verl_rloo_singleton_keeps_the_reward_and_default_zeroes_it():
    rollout = jrl.Rollout(
        reward_bg=jnp.array([[2.5, 0.0]]),
        mask_bgt=jnp.ones((1, 2, 1), bool),
        mask_bg=jnp.array([[True, False]]),
    )
    verl = jrl.compute_advantages(alg.rloo(beta=0.0, numerics="verl"), rollout)
    default = jrl.compute_advantages(alg.rloo(beta=0.0), rollout)
    np.testing.assert_allclose(verl[0, 0, 0], 2.5)
    np.testing.assert_allclose(default[0, 0, 0], 0.0)


def test_presets_differ_in_whitening_ddof():
    """verl whitens with ddof 1, OpenRLHF with ddof 0 and a variance floor."""
    rollout = one_token_rollout([1.0, 2.0, 4.0])
    verl = jrl.compute_advantages(alg.reinforce_pp(beta=0.0, numerics="verl"), rollout)
    orl = jrl.compute_advantages(alg.reinforce_pp(beta=0.0, numerics="openrlhf"), rollout)
    x = np.array([1.0, 2.0, 4.0])
    np.testing.assert_allclose(verl[0, :, 0], (x - x.mean()) / np.std(x, ddof=1), rtol=1e-5)
    np.testing.assert_allclose(orl[0, :, 0], (x - x.mean()) / np.std(x, ddof=0), rtol=1e-5)


def test_openrlhf_clips_scores_and_kl_values():
    rollout = one_token_rollout([25.0, -30.0])
    adv = jrl.compute_advantages(alg.reinforce(beta=0.0, numerics="openrlhf"), rollout)
    np.testing.assert_allclose(adv[0, :, 0], [10.0, -10.0])
    assert nm.OPENRLHF.kl_kwargs("k1") == {"value_clamp": 10.0}
    assert nm.VERL.kl_kwargs("k1") == {}
    assert nm.VERL.kl_kwargs("k3") == {"log_ratio_clamp": 20.0, "value_clamp": 10.0}


def test_verl_dual_clip_is_on():
    recipe = alg.grpo(numerics="verl", beta=0.0)
    logp = jnp.log(jnp.array([[[10.0]]]))  # ratio 10 against logp_old = 0
    loss = recipe.objective.loss(
        logp, jnp.zeros_like(logp), -jnp.ones_like(logp), jnp.ones_like(logp, bool)
    )
    np.testing.assert_allclose(loss, 3.0)  # capped at -c*A with c = 3
    plain = alg.grpo(beta=0.0).objective.loss(
        logp, jnp.zeros_like(logp), -jnp.ones_like(logp), jnp.ones_like(logp, bool)
    )
    np.testing.assert_allclose(plain, 10.0)


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="verl"):
        nm.resolve("ver1")
