"""WPO weighting in the DPO trainer: the weights come from the policy's full logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_llm import algorithms
from jaxrl_llm.train import update as up
from tests.train import helpers as H
from tests.train.test_update import _dpo_batch


def _slow_weights(lm, tokens_nl, input_mask_nl, mask_nt) -> np.ndarray:
    """w(y) = exp(mean over answer tokens of log π(y_t) − log Σ_v π(v)²), from full logits."""
    logits = nnx.jit(lambda m, x, k: m(x, k))(lm, tokens_nl, input_mask_nl)  # [N, L, V]
    logits = np.asarray(logits, np.float64)
    t = mask_nt.shape[1]
    logits = logits[:, -t - 1 : -1]  # the positions that predict the completion tokens
    logp_all = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp_all, np.asarray(tokens_nl)[:, -t:, None], -1)[..., 0]
    log_sum_sq = np.log(np.exp(2 * logp_all).sum(-1))
    mask = np.asarray(mask_nt)
    return np.exp(((picked - log_sum_sq) * mask).sum(-1) / np.maximum(mask.sum(-1), 1))


def test_wpo_weighted_dpo_loss_is_the_weighted_sigmoid_loss():
    lm = H.tiny_lm()
    gd, params = nnx.split(lm)
    batch = _dpo_batch()
    # jitted: the model run op by op took 28 s of the suite's time
    plain = jax.jit(up.dpo_sums_fn(algorithms.dpo(beta=0.1), gd))
    weighted = jax.jit(up.dpo_sums_fn(algorithms.dpo(beta=0.1, use_weighting=True), gd))
    w_c = _slow_weights(
        lm, batch.chosen_tokens_nl, batch.chosen_input_mask_nl, batch.chosen_mask_nt
    )
    w_r = _slow_weights(
        lm, batch.rejected_tokens_nl, batch.rejected_input_mask_nl, batch.rejected_mask_nt
    )
    # the per-pair plain losses: −log σ(βΔ), from the plain sums of single pairs
    per_pair = [
        float(plain(params, jax.tree.map(lambda x, i=i: x[i : i + 1], batch))[0])
        for i in range(w_c.size)
    ]
    total, _ = weighted(params, batch)
    np.testing.assert_allclose(float(total), np.sum(np.array(per_pair) * w_c * w_r), rtol=2e-5)
    assert np.all((w_c > 0) & (w_r > 0)) and not np.allclose(w_c * w_r, 1.0)
    # (that the weights are constants is tested in tests/core/test_preference_trl.py)
    g = jax.jit(jax.grad(lambda p: weighted(p, batch)[0]))(params)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(g))
