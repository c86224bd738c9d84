"""The rollout correction on every online recipe beyond the PPO objective (issue 16).

For each recipe the update's policy terms (``train.update._policy_terms``, where the weights
meet the loss) with ``rollout_correction={mode: tis, high: 2}`` must equal a slow reference:
the weights w of ``tests/core/test_rollout_correction.ref_correction`` (one token at a time)
times the *uncorrected* recipe's own per-token loss — ``w_t·ℓ_t`` for the per-token losses,
``W_i·ℓ_t`` with W_i the geometric mean of the sequence's weights for GMPO (verl's
``geo_mean``), and for VESPO TRL's rule (the weights inside φ's sequence ratio) — in value and
gradient, bypass (π = sg(π_θ)) and decoupled (π = the recomputed π_old), to 1e-6. With μ = π
(staleness 0) the corrected loss is the uncorrected one, bit for bit.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import algorithms as alg
from jaxrl_llm import recipe as rc
from jaxrl_llm.train import update as up
from tests.core.test_rollout_correction import _loss_inputs, ref_correction

TIS = {"mode": "tis", "high": 2.0}

# name -> (the recipe's keyword arguments, how the reference applies the weights)
RECIPES = {
    "reinforce": ({}, "times"),
    "rloo": ({}, "times"),
    "rloo_clip": ({"clip_eps": 0.2}, "times"),
    "gpg": ({}, "times"),
    "opo": ({}, "times"),
    "remax": ({}, "times"),
    "cispo": ({}, "times"),
    "sapo": ({}, "times"),
    "dppo": ({}, "times"),
    "gspo": ({"clip_low": 0.05, "clip_high": 0.05}, "times"),
    "luspo": ({"clip_low": 0.05, "clip_high": 0.05}, "times"),
    "clip_cov": ({"clip_cov_ratio": 1.0, "clip_cov_lb": 0.05}, "times"),
    "kl_cov": ({"kl_cov_ratio": 0.1}, "times"),
    "dro": ({}, "times"),
    "gmpo": ({}, "geometric"),
    "vespo": ({}, "vespo"),
}


def _build(case, correction=None):
    kwargs, _ = RECIPES[case]
    return alg.get(case.removesuffix("_clip"), **kwargs, rollout_correction=correction)


def _inputs(seed):
    """``[N, T]`` log-probs of π_θ, π_old (= π_prox), μ, advantages and the mask."""
    logp, old, mu, adv, mask = (x.reshape(6, -1) for x in _loss_inputs(seed))
    return logp, old, mu, adv, mask


def _batch(adv, mask, old=None, mu=None):
    f = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
    z = jnp.zeros((mask.shape[0], 1), jnp.int32)
    return up.UpdateBatch(z, z.astype(bool), jnp.asarray(mask), f(adv), f(old), f(mu))


def _loss_and_grad(objective, batch, logp):
    def loss(lp):
        _, aux = up._policy_terms(objective, batch, lp, None, batch.mask_nt, None)
        s, d = aux["actor/loss"]
        return s / d

    value, grad = jax.value_and_grad(loss)(jnp.asarray(logp, jnp.float32))
    return float(value), np.asarray(grad)


def ref_geometric(w, mask):
    """W_i = (Π_t w_t)^(1/|y_i|) over the valid tokens, one sequence at a time, on its tokens."""
    out = np.zeros(w.shape)
    for i in range(w.shape[0]):
        ts = [t for t in range(w.shape[1]) if mask[i, t]]
        if ts:
            out[i, ts] = math.prod(float(w[i, t]) for t in ts) ** (1.0 / len(ts))
    return out


def ref_vespo_phi(target, old_for_ratio, w, adv, mask, kp=2.0, lp=3.0, kn=3.0, ln=2.0):
    """TRL 1.16 ``get_gamma_weights`` with ``importance_sampling_ratio = w``, per token:
    log w_i = clamp(Σ_t [clamp(log π_θ − log π_old, ±20) + clamp(log w_t, log 1e-8, 20)])."""
    lo = math.log(1e-8)
    phi = np.zeros(w.shape)
    for i in range(w.shape[0]):
        ts = [t for t in range(w.shape[1]) if mask[i, t]]
        total = 0.0
        for t in ts:
            total += min(max(float(target[i, t]) - float(old_for_ratio[i, t]), -20.0), 20.0)
            total += min(max(math.log(w[i, t]) if w[i, t] > 0 else lo, lo), 20.0)
        log_w = min(max(total, lo), 20.0)
        for t in ts:
            k, lam = (kp, lp) if adv[i, t] >= 0 else (kn, ln)
            phi[i, t] = math.exp(lam + k * log_w - lam * math.exp(log_w))
    return phi


def _reference(case, logp, old, mu, adv, mask, decoupled):
    """The slow reference's loss function of log π_θ, and the weights it used."""
    plain = _build(case).objective
    target = old if decoupled else logp  # π of the weights: π_prox, or sg(π_θ)
    w, _, _ = ref_correction(target, mu, mask, **TIS)
    kind = RECIPES[case][1]
    if kind == "vespo":
        phi = jnp.asarray(ref_vespo_phi(logp, target, w, adv, mask), jnp.float32)

        def loss(lp):
            per_token = jnp.where(mask, -phi * adv * lp, 0.0)
            return per_token.sum() / mask.sum()  # VESPO's token-mean

        return loss, w
    scale = ref_geometric(w, mask) if kind == "geometric" else w
    scale = jnp.asarray(scale, jnp.float32)

    def loss(lp):
        prox = jnp.asarray(old) if decoupled else jax.lax.stop_gradient(lp)
        per_token = scale * plain.loss(lp, prox, jnp.asarray(adv), mask)
        s, d = plain.aggregate(per_token, mask)
        return s / d

    return loss, w


@pytest.mark.parametrize("decoupled", [False, True], ids=["bypass", "decoupled"])
@pytest.mark.parametrize("case", list(RECIPES))
def test_corrected_loss_is_the_weights_times_the_recipes_loss(case, decoupled):
    logp, old, mu, adv, mask = _inputs(11)
    corrected = _build(case, TIS).objective
    batch = _batch(adv, mask, old if decoupled else None, mu)
    value, grad = _loss_and_grad(corrected, batch, logp)
    ref_loss, w = _reference(case, logp, old, mu, adv, mask, decoupled)
    want, want_grad = jax.value_and_grad(ref_loss)(jnp.asarray(logp, jnp.float32))
    assert np.any(w[mask] == 2.0) and np.any(w[mask] < 0.9)  # the cap and real weights
    np.testing.assert_allclose(value, float(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-6)
    # ... and the correction changed something: the uncorrected loss is another number.
    plain = _build(case).objective
    plain_batch = _batch(adv, mask, old if decoupled else None)
    assert not np.allclose(_loss_and_grad(plain, plain_batch, logp)[1], grad, atol=1e-4)


@pytest.mark.parametrize("decoupled", [False, True], ids=["bypass", "decoupled"])
@pytest.mark.parametrize("case", list(RECIPES))
def test_staleness_zero_changes_nothing(case, decoupled):
    """μ = π: every weight is exp(0) = 1, so the loss and gradient are the uncorrected
    recipe's exactly (bypass: μ = π_θ, no π_old; decoupled: μ = π_old)."""
    logp, old, _, adv, mask = _inputs(12)
    corrected = _build(case, TIS).objective
    prox = old if decoupled else None
    mu = np.where(mask, old if decoupled else logp, 0.0)
    got = _loss_and_grad(corrected, _batch(adv, mask, prox, mu), logp)
    want = _loss_and_grad(_build(case).objective, _batch(adv, mask, prox), logp)
    assert got[0] == want[0]
    np.testing.assert_array_equal(got[1], want[1])


def test_the_weights_and_metrics_reach_the_update_for_a_weighted_loss():
    """An objective that applies the weights itself (GMPO) still reports rollout_corr/*, and
    a masking mode's dropped token zeroes its whole sequence there (one surrogate each)."""
    logp, _, mu, adv, mask = _inputs(13)
    corr = {"mode": "icepop", "low": 0.5, "high": 2.0}
    obj = _build("gmpo", corr).objective
    batch = _batch(adv, mask, None, mu)
    _, aux = up._policy_terms(obj, batch, jnp.asarray(logp), None, batch.mask_nt, None)
    _, keep, rho = ref_correction(logp, mu, mask, **corr)
    np.testing.assert_allclose(
        aux["rollout_corr/masked_fraction"][0] / aux["rollout_corr/masked_fraction"][1],
        (mask & ~keep).sum() / mask.sum(),
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        aux["rollout_corr/ratio_mean"][0] / aux["rollout_corr/ratio_mean"][1],
        rho[mask].mean(),
        rtol=1e-6,
    )
    dropped = (mask & ~keep).any(-1)
    assert dropped.any() and (~dropped & mask.any(-1)).any()
    grad = jax.grad(lambda lp: up._policy_terms(obj, batch, lp, None, batch.mask_nt, None)[0])(
        jnp.asarray(logp)
    )
    assert np.all(np.asarray(grad)[dropped] == 0.0)
    assert np.any(np.asarray(grad)[~dropped] != 0.0)


def test_every_online_recipe_takes_the_option():
    import inspect

    takers = {
        n
        for n, fn in alg.RECIPES.items()
        if "rollout_correction" in inspect.signature(fn).parameters
    }
    assert set(alg.ONLINE_RECIPES) == takers  # dpo (offline, no sampler) alone does not
    assert {c.removesuffix("_clip") for c in RECIPES} == takers - {
        "grpo",
        "ppo",
        "dapo",
        "dr_grpo",
        "reinforce_pp",
        "reinforce_pp_baseline",
    }


@pytest.mark.parametrize("name", ["rloo", "gspo", "vespo"])
def test_an_async_config_gets_the_default_correction(name):
    """train.max_staleness = 1 gives the recipe async's default token TIS (cap 2); 0 none."""
    from jaxrl_llm.config import build_recipe
    from jaxrl_llm.config.validation import ASYNC_ROLLOUT_CORRECTION
    from tests.train import helpers as H

    for staleness, want in ((1, rc.RolloutCorrection(**ASYNC_ROLLOUT_CORRECTION)), (0, None)):
        config = H.config("tiny.yaml", f"algorithm.name={name}", f"train.max_staleness={staleness}")
        recipe = build_recipe(config)
        assert recipe.objective.rollout_correction == want, (name, staleness)
        assert (rc.SAMPLER_LOGPROBS in recipe.requires) == (want is not None)


def test_refusals_name_the_recipe_and_why():
    from jaxrl_llm.config.engine import ConfigError
    from tests.train import helpers as H

    with pytest.raises(ValueError, match=r"vespo: rollout_correction.level must be 'token'.*φ"):
        alg.vespo(rollout_correction={"mode": "tis", "level": "sequence"})
    with pytest.raises(ValueError, match=r"gmpo: rollout_correction has no key 'cap'"):
        alg.gmpo(rollout_correction={"cap": 2.0})
    with pytest.raises(ConfigError, match=r"rollout_correction.*not a hyperparameter of dpo"):
        H.config(
            "tiny.yaml",
            "algorithm.name=dpo",
            "rollout=null",
            "algorithm.hparams.rollout_correction={mode: tis}",
        )
    with pytest.raises(ConfigError, match="vespo"):
        H.config(
            "tiny.yaml",
            "algorithm.name=vespo",
            "algorithm.hparams.rollout_correction={mode: tis, level: sequence}",
        )


def test_update_step_of_a_weighted_loss_recipe_equals_the_reference():
    """The jitted update step on the tiny model, GMPO decoupled (π_old and μ given): its loss
    and gradient are those of W_i·L_i through the model's log-probs."""
    from tests.core.test_rollout_correction import _update_setup

    rec = alg.gmpo(rollout_correction=TIS)
    rec, gd, state, batch, model_logp, noise, capture = _update_setup(None, 5, recipe=rec)
    mask = np.asarray(batch.mask_nt)
    logp0 = model_logp(state.params)
    prox = jnp.where(mask, logp0 + noise(0.1), 0.0)
    mu = jnp.where(mask, prox + noise(0.5), 0.0)
    batch = batch._replace(logp_old_nt=prox, logp_sampler_nt=mu)
    new, metrics = up.make_update_step(rec, gd, capture)(jax.tree.map(jnp.copy, state), batch)
    w, _, _ = ref_correction(np.asarray(prox), np.asarray(mu), mask, **TIS)
    scale = jnp.asarray(ref_geometric(w, mask), jnp.float32)
    plain = alg.gmpo().objective

    def reference(params):
        per_token = scale * plain.loss(model_logp(params), prox, batch.adv_nt, batch.mask_nt)
        s, d = plain.aggregate(per_token, batch.mask_nt)
        return s / d

    value, grad = jax.value_and_grad(reference)(state.params)
    np.testing.assert_allclose(float(metrics["actor/pg_loss"]), float(value), rtol=1e-5)
    top = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(grad))
    assert top > 0
    for a, b in zip(jax.tree.leaves(new.opt_state["g"]), jax.tree.leaves(grad), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5 * top)
    assert 0 < float(metrics["rollout_corr/is_weight_mean"]) < 2.0
