"""The critic's value loss aggregation: token-mean by default; under ``numerics="verl"`` the
actor's ``loss_agg_mode`` (verl's critic follows it), checked against verl's own
``compute_value_loss`` (tests/fixtures/generate_verl_value_loss.py)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import algorithms
from jaxrl_llm.core import policy_losses as pl

FIXTURE = np.load(Path(__file__).resolve().parents[1] / "fixtures" / "verl_value_loss.npz")
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@pytest.mark.parametrize("mode", MODES)
def test_verl_critic_follows_the_actor_aggregation(mode):
    critic = algorithms.ppo(numerics="verl", loss_agg_mode=mode).critic
    assert critic.agg == mode and critic.value_clip == 0.5  # verl's cliprange_value
    f = {k: jnp.asarray(FIXTURE[f"in_{k}"]) for k in ("mask", "values", "vpreds", "returns")}

    def loss(vpreds):
        per_token = pl.value_loss(vpreds, f["values"], f["returns"], f["mask"], clip_eps=0.5)
        total, den = critic.aggregate(jnp.where(f["mask"], per_token, 0.0), f["mask"])
        return total / jnp.maximum(den, 1.0)

    value, grad = jax.value_and_grad(loss)(f["vpreds"].astype(jnp.float32))
    # verl b178a3c (the fixture's) divides seq-mean-token-sum-norm by S alone; verl since
    # #5366/#5417 (0.9.1) and ours by (#non-empty sequences · S): core/aggregation.py.
    scale = float(np.sum(FIXTURE["in_mask"].any(-1))) if mode.endswith("-norm") else 1.0
    np.testing.assert_allclose(float(value) * scale, FIXTURE[f"{mode}/loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(grad) * scale, FIXTURE[f"{mode}/grad"], rtol=1e-4, atol=1e-6
    )


@pytest.mark.parametrize("numerics", ["default", "trl", "openrlhf"])
def test_other_presets_keep_a_token_mean_critic(numerics):
    critic = algorithms.ppo(numerics=numerics, loss_agg_mode="seq-mean-token-mean").critic
    assert critic.agg == "token-mean"
