"""The DPO family against TRL 1.16.0's own ``DPOTrainer._compute_loss`` (fixtures).

``tests/fixtures/trl_dpo.npz`` is written by ``tests/fixtures/generate_trl_dpo.py`` (run it with
TRL installed in a throwaway environment); it holds per-token log-probs of 6 pairs, TRL's mean
loss for 19 settings and its gradient with respect to each answer's sequence log-prob. Here each
setting is rebuilt as ``algorithms.dpo(...)`` and must match value and gradient to 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import algorithms, recipe
from jaxrl_llm.core import preference as pref

FIXTURE = np.load(Path(__file__).parents[1] / "fixtures" / "trl_dpo.npz")
CASES = sorted({k.split("/")[0] for k in FIXTURE.files if "/" in k})
# TRL 1.16's sigmoid loss ignores label_smoothing; ours applies cDPO (docs/numerics.md).
DIFFERENT = {"sigmoid_ls"}


def _pairs(chosen_p, rejected_p) -> recipe.PairLogprobs:
    mask = FIXTURE["input_mask"].astype(bool)
    ref = FIXTURE["input_ref"]
    p = mask.shape[0] // 2
    length = mask.sum(1)
    weights = pref.wpo_weights(
        jnp.asarray(FIXTURE["input_logp"], jnp.float32),
        jnp.asarray(FIXTURE["input_log_sum_sq"], jnp.float32),
        jnp.asarray(mask),
    )
    return recipe.PairLogprobs(
        logp_chosen_p=chosen_p,
        logp_rejected_p=rejected_p,
        len_chosen_p=jnp.asarray(length[:p]),
        len_rejected_p=jnp.asarray(length[p:]),
        ref_chosen_p=jnp.asarray(ref[:p], jnp.float32),
        ref_rejected_p=jnp.asarray(ref[p:], jnp.float32),
        weight_chosen_p=weights[:p],
        weight_rejected_p=weights[p:],
    )


def _ours(case: str, numerics: str | None = None):
    beta, eps, tau = (float(v) for v in FIXTURE[f"{case}/setting"])
    r = algorithms.dpo(
        beta=beta,
        loss_type=str(FIXTURE[f"{case}/loss_type"]),
        label_smoothing=eps,
        discopop_tau=tau,
        use_weighting=bool(FIXTURE[f"{case}/wpo"]),
        numerics=numerics,
    )
    seq = jnp.asarray(FIXTURE["input_logp"].sum(1), jnp.float32)
    p = seq.shape[0] // 2

    def mean_loss(chosen_p, rejected_p):
        return jnp.mean(r.loss(_pairs(chosen_p, rejected_p)))

    loss, (g_w, g_l) = jax.value_and_grad(mean_loss, argnums=(0, 1))(seq[:p], seq[p:])
    return r, float(loss), np.asarray(g_w), np.asarray(g_l)


@pytest.mark.parametrize("case", [c for c in CASES if c not in DIFFERENT])
def test_loss_and_gradient_match_trl(case):
    _, loss, g_w, g_l = _ours(case)
    np.testing.assert_allclose(loss, FIXTURE[f"{case}/loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g_w, FIXTURE[f"{case}/grad_chosen"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g_l, FIXTURE[f"{case}/grad_rejected"], rtol=1e-5, atol=1e-6)


def test_trl_sigmoid_ignores_label_smoothing_and_ours_is_cdpo():
    assert FIXTURE["sigmoid_ls/loss"] == FIXTURE["sigmoid/loss"]  # TRL 1.16
    _, ours, _, _ = _ours("sigmoid_ls")
    beta, eps, _ = FIXTURE["sigmoid_ls/setting"]
    seq, ref = FIXTURE["input_logp"].sum(1), FIXTURE["input_ref"]
    p = seq.size // 2
    z = beta * ((seq[:p] - ref[:p]) - (seq[p:] - ref[p:]))
    cdpo = np.mean((1 - eps) * np.log1p(np.exp(-z)) + eps * np.log1p(np.exp(z)))
    np.testing.assert_allclose(ours, cdpo, rtol=1e-5)
    # the trl preset reproduces TRL's sigmoid, label_smoothing ignored
    _, trl, g_w, g_l = _ours("sigmoid_ls", numerics="trl")
    np.testing.assert_allclose(trl, FIXTURE["sigmoid_ls/loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g_w, FIXTURE["sigmoid_ls/grad_chosen"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g_l, FIXTURE["sigmoid_ls/grad_rejected"], rtol=1e-5, atol=1e-6)


def test_every_trl_pair_loss_type_is_a_recipe_option_and_explained():
    from jaxrl_llm.explain import explain

    types = {str(FIXTURE[f"{c}/loss_type"]) for c in CASES}
    for loss_type in types | {"simpo", "aot_pair"}:
        r = algorithms.dpo(loss_type=loss_type)
        assert r.label.startswith("DPO ") and explain(r).objective
    assert algorithms.dpo(loss_type="aot_pair").hparams["loss_type"] == "aot_unpaired"
    assert recipe.SEQUENCE_WEIGHTS in algorithms.dpo(use_weighting=True).requires
    assert recipe.SEQUENCE_WEIGHTS not in algorithms.dpo().requires


def _np_sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _slow(loss_type: str, w, r, rw, rr, *, beta, eps=0.0, tau=0.05):
    """The formulas written out in numpy, pair by pair (AOT: over the sorted batch)."""
    rho_w, rho_l = w - rw, r - rr
    z = beta * (rho_w - rho_l)
    ls = lambda x: -np.log1p(np.exp(-x))  # log σ(x)
    if loss_type == "exo_pair":
        q = _np_sigmoid(z)
        return q * (np.log(q) - np.log(1 - eps)) + (1 - q) * (np.log(1 - q) - np.log(eps))
    if loss_type == "nca_pair":
        return -ls(beta * rho_w) - 0.5 * ls(-beta * rho_w) - 0.5 * ls(-beta * rho_l)
    if loss_type == "bco_pair":
        return -ls(beta * rho_w) - ls(-beta * rho_l)
    if loss_type == "sppo_hard":
        return (rho_w - 0.5 / beta) ** 2 + (rho_l + 0.5 / beta) ** 2
    if loss_type in ("aot", "aot_unpaired"):
        if loss_type == "aot":
            d = np.sort(w - r) - np.sort(rw - rr)
        else:
            d = np.sort(rho_w) - np.sort(rho_l)
        return -(1 - eps) * ls(beta * d) - eps * ls(-beta * d)
    if loss_type == "apo_zero":
        return 1 - _np_sigmoid(beta * rho_w) + _np_sigmoid(beta * rho_l)
    if loss_type == "apo_down":
        return _np_sigmoid(beta * rho_w) + 1 - _np_sigmoid(z)
    if loss_type == "discopop":
        m = _np_sigmoid(z / tau)
        return (1 - m) * -ls(z) + m * np.exp(-z)
    raise AssertionError(loss_type)


@pytest.mark.parametrize(
    "loss_type",
    [
        "exo_pair",
        "nca_pair",
        "bco_pair",
        "sppo_hard",
        "aot",
        "aot_unpaired",
        "apo_zero",
        "apo_down",
        "discopop",
    ],
)
def test_per_pair_values_match_the_formulas(loss_type):
    rng = np.random.default_rng(3)
    w, r, rw, rr = (rng.normal(-20, 6, size=9) for _ in range(4))
    beta, eps, tau = 0.3, 0.05, 0.2
    rec = algorithms.dpo(beta=beta, loss_type=loss_type, label_smoothing=eps, discopop_tau=tau)
    f = lambda x: jnp.asarray(x, jnp.float32)
    pairs = recipe.PairLogprobs(f(w), f(r), jnp.ones(9), jnp.ones(9), f(rw), f(rr))
    expect = _slow(loss_type, w, r, rw, rr, beta=beta, eps=eps, tau=tau)
    np.testing.assert_allclose(np.asarray(rec.loss(pairs)), expect, rtol=2e-5, atol=2e-5)


def test_wpo_weights_match_the_definition_and_carry_no_gradient():
    rng = np.random.default_rng(0)
    logp = -rng.uniform(0.1, 2.0, size=(3, 5))
    lss = np.log(rng.uniform(0.1, 0.9, size=(3, 5)))
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]], bool)
    got = pref.wpo_weights(
        jnp.asarray(logp, jnp.float32), jnp.asarray(lss, jnp.float32), jnp.asarray(mask)
    )
    expect = [np.exp(np.mean((logp - lss)[i][mask[i]])) if mask[i].any() else 1.0 for i in range(3)]
    np.testing.assert_allclose(np.asarray(got), expect, rtol=1e-5)
    grad = jax.grad(
        lambda x: pref.wpo_weights(x, jnp.asarray(lss, jnp.float32), jnp.asarray(mask)).sum()
    )
    assert not np.any(np.asarray(grad(jnp.asarray(logp, jnp.float32))))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(loss_type="exo_pairs"), r"loss_type='exo_pairs'; expected one of"),
        (dict(loss_type="discopop", discopop_tau=0.0), r"`discopop_tau` must be > 0"),
        (dict(loss_type="aot", label_smoothing=0.7), r"`label_smoothing` must be in \[0, 0.5\)"),
    ],
)
def test_bad_hyperparameters_name_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        algorithms.dpo(**kwargs)


def test_core_functions_check_their_own_arguments():
    x = jnp.zeros(3)
    with pytest.raises(
        ValueError, match=r"exo_pair_loss: argument `label_smoothing` must be in \(0, 1\)"
    ):
        pref.exo_pair_loss(x, x, x, x, beta=0.1, label_smoothing=0.0)
    with pytest.raises(ValueError, match=r"apo_loss: argument `anchor` must be 'zero' or 'down'"):
        pref.apo_loss(x, x, x, x, anchor="up")
