"""Tests for jaxrl_llm.core.rollout_correction: slow references, properties, the peers' fixtures.

``tests/fixtures/rollout_corr.npz`` holds what verl's, TRL's and OpenRLHF's own code computes
on one batch (``tests/fixtures/generate_rollout_corr.py``); ours must match it to 1e-6 in value
(and gradient where the peer has a loss).
"""

import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.core import aggregation as agg
from jaxrl_llm.core import policy_losses as pl
from jaxrl_llm.core import rollout_correction as rc

FIXTURE = Path(__file__).parents[1] / "fixtures" / "rollout_corr.npz"
TOL = dict(rtol=1e-6, atol=1e-6)


def _batch(seed, shape=(2, 3, 6), spread=0.5):
    rng = np.random.default_rng(seed)
    logp_target = -rng.uniform(0.05, 2.5, size=shape)
    logp_sampler = logp_target + rng.normal(0.0, spread, size=shape)
    mask = rng.random(shape) < 0.75
    mask[0, 0] = False  # an empty completion
    mask[1, 2, :] = True  # a full one
    f = lambda x: np.asarray(x, np.float32)
    return f(logp_target), f(logp_sampler), mask


# --------------------------------------------------------------------------------------------
# Slow references, one token / one sequence at a time.


def ref_token_ratio(lt, ls, mask):
    out = np.zeros(lt.shape)
    for idx in np.ndindex(*lt.shape):
        if mask[idx]:
            out[idx] = math.exp(min(max(float(lt[idx]) - float(ls[idx]), -20.0), 20.0))
    return out


def ref_sequence_ratio(lt, ls, mask, reduction):
    out = np.zeros(lt.shape)
    for row in np.ndindex(*lt.shape[:-1]):
        terms = [float(lt[row][t]) - float(ls[row][t]) for t in range(lt.shape[-1]) if mask[row][t]]
        if not terms:
            continue
        s = sum(terms) / len(terms) if reduction == "mean" else sum(terms)
        w = math.exp(min(max(s, -20.0), 20.0))
        for t in range(lt.shape[-1]):
            if mask[row][t]:
                out[row][t] = w
    return out


def ref_correction(lt, ls, mask, *, mode, level="token", reduction="mean", low=None, high=None):
    rho_t = ref_token_ratio(lt, ls, mask)
    rho = rho_t if level == "token" else ref_sequence_ratio(lt, ls, mask, reduction)
    lo = -math.inf if low is None else low
    hi = math.inf if high is None else high
    w, keep = np.zeros(lt.shape), np.zeros(lt.shape, bool)
    for idx in np.ndindex(*lt.shape):
        if not mask[idx]:
            continue
        inside = lo <= rho[idx] <= hi
        if mode == "tis":
            w[idx], keep[idx] = min(max(rho[idx], lo), hi), True
        elif mode in ("mis", "icepop"):
            w[idx], keep[idx] = (rho[idx] if inside else 0.0), inside
        elif mode == "reject":
            w[idx], keep[idx] = float(inside), inside
        else:
            w[idx], keep[idx] = 1.0, True
    return w, keep, rho_t


CASES = [
    dict(mode="tis", high=2.0),
    dict(mode="tis", low=0.5, high=2.0),
    dict(mode="tis", level="sequence", reduction="sum", high=2.0),
    dict(mode="tis", level="sequence", reduction="mean", low=0.75, high=1.05),
    dict(mode="mis", low=0.5, high=2.0),
    dict(mode="mis", level="sequence", reduction="sum", low=0.37, high=2.5),
    dict(mode="mis", level="sequence", reduction="mean", low=0.75, high=1.25),
    dict(mode="icepop", low=0.5, high=5.0),
    dict(mode="reject", low=0.6),
    dict(mode="reject", level="sequence", reduction="mean", high=0.8),
    dict(mode="none"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_correction_weights_match_reference(case):
    lt, ls, mask = _batch(0)
    got = rc.correction_weights(lt, ls, mask, **case)
    w, keep, ratio = ref_correction(lt, ls, mask, **case)
    np.testing.assert_allclose(got.weight_bgt, w, **TOL)
    np.testing.assert_array_equal(got.keep_bgt, keep)
    np.testing.assert_allclose(got.ratio_bgt, ratio, **TOL)
    assert got.weight_bgt.dtype == jnp.float32
    # Padding is exactly 0 / False; bounds bite somewhere (the case tests something).
    np.testing.assert_array_equal(np.asarray(got.weight_bgt)[~mask], 0.0)
    assert not np.asarray(got.keep_bgt)[~mask].any()
    if case["mode"] in ("mis", "icepop", "reject"):
        assert 0 < (mask & ~keep).sum() < mask.sum()
    if case["mode"] == "tis":
        assert not np.allclose(
            w[mask], ratio[mask] if case.get("level") != "sequence" else w[mask] + 1
        )


def test_sequence_weights_geometric_mean_vs_product():
    lt, ls, mask = _batch(1)
    for reduction in ("mean", "sum"):
        got = rc.sequence_importance_weights(lt, ls, mask, reduction=reduction)
        np.testing.assert_allclose(got, ref_sequence_ratio(lt, ls, mask, reduction), **TOL)
    # The product is the product of the token weights; the geometric mean its |y|-th root.
    tok = ref_token_ratio(lt, ls, mask)
    prod = rc.sequence_importance_weights(lt, ls, mask, reduction="sum")
    geo = rc.sequence_importance_weights(lt, ls, mask, reduction="mean")
    row = (1, 2)
    np.testing.assert_allclose(prod[row][0], np.prod(tok[row]), rtol=1e-5)
    np.testing.assert_allclose(geo[row][0], np.prod(tok[row]) ** (1 / lt.shape[-1]), rtol=1e-5)


def test_sequence_statistic_reductions():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(3, 5)).astype(np.float32)
    mask = np.array([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], bool)
    for reduction, op in (("sum", np.sum), ("mean", np.mean), ("max", np.max)):
        got = np.asarray(rc.sequence_statistic(x, mask, reduction=reduction))
        for i in range(3):
            want = op(x[i][mask[i]]) if mask[i].any() else 0.0
            np.testing.assert_allclose(got[i][mask[i]], want, rtol=1e-6)
            np.testing.assert_array_equal(got[i][~mask[i]], 0.0)


def test_divergence_estimators():
    lt, ls, mask = _batch(3)
    lr = np.clip(lt.astype(np.float64) - ls, -20, 20)
    want = {"k1": -lr, "k2": 0.5 * lr**2, "k3": np.exp(lr) - 1 - lr}
    for name, value in want.items():
        got = rc.rejection_divergence(lt, ls, mask, estimator=name)
        np.testing.assert_allclose(got, np.where(mask, value, 0.0), **TOL)


def test_staleness_zero_is_the_identity():
    """π = μ: every ratio is 1, nothing is truncated or masked, the ratio mean is exactly 1."""
    lt, _, mask = _batch(4)
    for case in CASES:
        if not (case.get("low") or 0.0) <= 1.0 <= (case.get("high") or math.inf):
            continue  # a band without 1 drops even on-policy tokens (by design)
        c = rc.correction_weights(lt, lt, mask, **case)
        m = rc.correction_metrics(c, mask)
        assert float(agg.finalize(*m["ratio_mean"])) == 1.0
        assert float(agg.finalize(*m["masked_fraction"])) == 0.0
        np.testing.assert_allclose(agg.finalize(*m["is_weight_mean"]), 1.0, atol=1e-7)
        np.testing.assert_array_equal(np.asarray(c.weight_bgt)[mask], 1.0)


def test_correction_metrics_reference():
    lt, ls, mask = _batch(5)
    c = rc.correction_weights(lt, ls, mask, mode="mis", low=0.5, high=2.0)
    m = {k: float(agg.finalize(*v)) for k, v in rc.correction_metrics(c, mask).items()}
    w, keep, ratio = ref_correction(lt, ls, mask, mode="mis", low=0.5, high=2.0)
    np.testing.assert_allclose(m["is_weight_mean"], w[mask].mean(), rtol=1e-6)
    np.testing.assert_allclose(m["is_weight_max"], w[mask].max(), rtol=1e-6)
    np.testing.assert_allclose(m["masked_fraction"], (~keep[mask]).mean(), rtol=1e-6)
    np.testing.assert_allclose(m["ratio_mean"], ratio[mask].mean(), rtol=1e-6)


def test_poisoned_padding_gives_the_same_numbers():
    lt, ls, mask = _batch(6)
    clean = rc.correction_weights(lt, ls, mask, mode="mis", level="sequence", low=0.8, high=1.25)
    bad_t = np.where(mask, lt, -np.inf).astype(np.float32)
    bad_s = np.where(mask, ls, np.nan).astype(np.float32)
    got = rc.correction_weights(
        bad_t, bad_s, mask, mode="mis", level="sequence", low=0.8, high=1.25
    )
    for a, b in zip(got, clean, strict=True):
        np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------------------------
# Losses.


def _loss_inputs(seed):
    rng = np.random.default_rng(seed)
    lt, ls, mask = _batch(seed)
    logp = (lt + rng.normal(0, 0.15, lt.shape)).astype(np.float32)
    adv = rng.normal(0, 1.0, lt.shape).astype(np.float32)
    return logp, lt, ls, adv, mask


def ref_decoupled(logp, prox, behav, adv, mask, *, eps, c=None, cap=None, cap_mode="mask"):
    out = np.zeros(logp.shape)
    for idx in np.ndindex(*logp.shape):
        if not mask[idx]:
            continue
        r = math.exp(float(logp[idx]) - float(prox[idx]))
        a = float(adv[idx])
        loss = max(-a * r, -a * min(max(r, 1 - eps), 1 + eps))
        if c is not None and a < 0:
            loss = min(loss, -c * a)
        w = math.exp(float(prox[idx]) - float(behav[idx]))
        if cap is not None:
            w = (w if w <= cap else 0.0) if cap_mode == "mask" else min(w, cap)
        out[idx] = w * loss
    return out


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(c=3.0), dict(cap=1.5), dict(cap=1.5, cap_mode="truncate"), dict(c=3.0, cap=2.0)],
)
def test_decoupled_ppo_loss_matches_reference(kw):
    logp, prox, behav, adv, mask = _loss_inputs(7)
    got = rc.decoupled_ppo_loss(
        logp,
        prox,
        behav,
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.2,
        dual_clip=kw.get("c"),
        behaviour_weight_cap=kw.get("cap"),
        cap_mode=kw.get("cap_mode", "mask"),
    )
    want = ref_decoupled(logp, prox, behav, adv, mask, eps=0.2, **kw)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_decoupled_is_ppo_when_proximal_is_behaviour_and_weights_the_gradient():
    logp, prox, behav, adv, mask = _loss_inputs(8)
    np.testing.assert_allclose(
        rc.decoupled_ppo_loss(logp, prox, prox, adv, mask),
        pl.ppo_clip_loss(logp, prox, adv, mask),
        rtol=1e-6,
    )
    # At π_θ = π_prox: ∂ℓ/∂logπ_θ = −w·A with w = π_prox/μ, and 0 on padding.
    grad = jax.grad(lambda lp: jnp.sum(rc.decoupled_ppo_loss(lp, prox, behav, adv, mask)))(prox)
    w = ref_token_ratio(prox, behav, mask)
    np.testing.assert_allclose(grad, np.where(mask, -w * adv, 0.0), rtol=1e-5, atol=1e-6)
    # The trainer's form: the recipe's PPO loss on the weighted advantages is the same loss.
    w32 = rc.token_importance_weights(prox, behav, mask)
    np.testing.assert_allclose(
        pl.ppo_clip_loss(logp, prox, w32 * adv, mask),
        rc.decoupled_ppo_loss(logp, prox, behav, adv, mask),
        rtol=1e-5,
        atol=1e-7,
    )


def test_dropped_tokens_contribute_nothing():
    """Masked (MIS) and padded tokens get exactly zero loss and zero gradient, even NaN."""
    logp, prox, behav, adv, mask = _loss_inputs(9)
    c = rc.correction_weights(prox, behav, mask, mode="icepop", low=0.7, high=1.4)
    dropped = mask & ~np.asarray(c.keep_bgt)
    assert dropped.any()
    poisoned = np.where(dropped | ~mask, np.nan, adv).astype(np.float32)
    mask_kept = np.asarray(c.keep_bgt)

    def total(lp):
        return jnp.sum(rc.weighted_reinforce_loss(lp, c.weight_bgt, poisoned, mask_kept))

    loss_grad = jax.grad(total)(logp)
    assert np.all(np.isfinite(loss_grad))
    np.testing.assert_array_equal(np.asarray(loss_grad)[~mask_kept], 0.0)
    np.testing.assert_allclose(
        np.asarray(loss_grad)[mask_kept], (-np.asarray(c.weight_bgt) * adv)[mask_kept], rtol=1e-6
    )


# --------------------------------------------------------------------------------------------
# The peers' own code (fixture).


@pytest.fixture(scope="module")
def fx():
    data = np.load(FIXTURE)
    return {k: data[k] for k in data.files}


def _in(fx):
    f = lambda k: np.asarray(fx[f"in_{k}"], np.float32)
    return f("logp"), f("logp_prox"), f("logp_sampler"), f("adv"), fx["in_mask"].astype(bool)


def _value_and_grad(loss_fn, logp):
    return jax.jit(jax.value_and_grad(loss_fn))(logp)


def _token_mean(loss, mask):
    return agg.finalize(*agg.token_mean(loss, mask))


def test_verl_is_weights(fx):
    _, prox, mu, _, mask = _in(fx)
    tok = rc.correction_weights(prox, mu, mask, mode="tis", high=2.0)
    np.testing.assert_allclose(tok.weight_bgt, fx["verl/is_token"], **TOL)
    seq = rc.correction_weights(
        prox, mu, mask, mode="tis", level="sequence", reduction="sum", high=2.0
    )
    np.testing.assert_allclose(seq.weight_bgt, fx["verl/is_sequence"], **TOL)
    assert (fx["verl/is_sequence"][mask] == 2.0).any() and (fx["verl/is_sequence"][mask] < 2).any()


VERL_RS = {  # option: (estimator, reduction or None, low, high) in verl's units
    "token_k1": ("k1", None, math.log(0.6), math.log(1.5)),
    "token_k2": ("k2", None, None, 0.08),
    "token_k3": ("k3", None, None, 0.1),
    "seq_sum_k1": ("k1", "sum", math.log(0.4), math.log(2.5)),
    "seq_mean_k1": ("k1", "mean", math.log(0.8), math.log(1.25)),
    "seq_mean_k3": ("k3", "mean", None, 0.06),
    "seq_max_k2": ("k2", "max", None, 0.2),
}


@pytest.mark.parametrize("option", sorted(VERL_RS))
def test_verl_rejection_masks(fx, option):
    _, prox, mu, _, mask = _in(fx)
    estimator, reduction, low, high = VERL_RS[option]
    stat = rc.rejection_divergence(prox, mu, mask, estimator=estimator)
    if reduction is not None:
        stat = rc.sequence_statistic(stat, mask, reduction=reduction)
    keep = rc.within_bounds(stat, mask, low=low, high=high)
    want = fx[f"verl/rs_{option}"]
    np.testing.assert_array_equal(keep, want)
    assert 0 < want.sum() < mask.sum()


def test_verl_bypass_reinforce(fx):
    """verl bypass mode, loss_type reinforce: w = min(sg(π_θ)/μ, 2) on the tokens kept by
    token_k1 ∈ [log 0.6, log 1.5], −w·A·log π_θ, token mean over the kept tokens."""
    logp, _, mu, adv, mask = _in(fx)
    keep = rc.within_bounds(
        rc.rejection_divergence(logp, mu, mask, estimator="k1"),
        mask,
        low=math.log(0.6),
        high=math.log(1.5),
    )

    def loss(lp):
        w = rc.correction_weights(lp, mu, mask, mode="tis", high=2.0).weight_bgt
        return _token_mean(rc.weighted_reinforce_loss(lp, w, adv, keep), keep)

    value, grad = _value_and_grad(loss, logp)
    np.testing.assert_allclose(value, fx["verl/bypass_reinforce/loss"], **TOL)
    np.testing.assert_allclose(grad, fx["verl/bypass_reinforce/grad"], **TOL)


def test_verl_bypass_ppo_clip(fx):
    """verl bypass mode, loss_type ppo_clip: PPO with π_old = μ (dual clip 3, clamp 20) on the
    kept tokens, no IS weight."""
    logp, _, mu, adv, mask = _in(fx)
    keep = rc.within_bounds(
        rc.rejection_divergence(logp, mu, mask, estimator="k1"),
        mask,
        low=math.log(0.6),
        high=math.log(1.5),
    )
    ppo = functools.partial(pl.ppo_clip_loss, dual_clip=3.0, log_ratio_clamp=20.0)
    value, grad = _value_and_grad(lambda lp: _token_mean(ppo(lp, mu, adv, keep), keep), logp)
    np.testing.assert_allclose(value, fx["verl/bypass_ppo_clip/loss"], **TOL)
    np.testing.assert_allclose(grad, fx["verl/bypass_ppo_clip/grad"], **TOL)


def test_verl_decoupled(fx):
    """verl decoupled mode: PPO relative to π_old = π_prox times trunc(π_prox/μ, 2)."""
    logp, prox, mu, adv, mask = _in(fx)
    loss = functools.partial(
        rc.decoupled_ppo_loss,
        dual_clip=3.0,
        log_ratio_clamp=20.0,
        behaviour_weight_cap=2.0,
        cap_mode="truncate",
    )
    value, grad = _value_and_grad(lambda lp: _token_mean(loss(lp, prox, mu, adv, mask), mask), logp)
    np.testing.assert_allclose(value, fx["verl/decoupled/loss"], **TOL)
    np.testing.assert_allclose(grad, fx["verl/decoupled/grad"], **TOL)


TRL_MODES = {
    "token_truncate": dict(mode="tis", low=0.5, high=2.0),
    "token_mask": dict(mode="mis", low=0.5, high=2.0),
    "sequence_truncate": dict(mode="tis", level="sequence", reduction="sum", low=0.4, high=2.5),
    "sequence_mask": dict(mode="mis", level="sequence", reduction="sum", low=0.4, high=2.5),
}


@pytest.mark.parametrize("mode", sorted(TRL_MODES))
def test_trl_vllm_importance_sampling_modes(fx, mode):
    _, prox, mu, _, mask = _in(fx)
    got = rc.correction_weights(prox, mu, mask, **TRL_MODES[mode]).weight_bgt
    # TRL leaves 1 (token modes) or the sequence's weight on padding; the loss masks them.
    np.testing.assert_allclose(np.asarray(got)[mask], fx[f"trl/{mode}"][mask], **TOL)


def test_trl_grpo_loss_with_token_mask(fx):
    """TRL GRPO (loss_type grpo): per-token PPO loss × the token_mask IS ratio, mean over
    sequences of token means — the trainer's form, the recipe's loss on w·A."""
    logp, prox, mu, adv, mask = _in(fx)
    w = rc.correction_weights(prox, mu, mask, mode="mis", low=0.5, high=2.0).weight_bgt

    def loss(lp):
        per_token = pl.ppo_clip_loss(lp, prox, w * adv, mask)
        return agg.finalize(*agg.seq_mean_token_mean(per_token, mask))

    value, grad = _value_and_grad(loss, logp)
    np.testing.assert_allclose(value, fx["trl/grpo_token_mask/loss"], **TOL)
    np.testing.assert_allclose(grad, fx["trl/grpo_token_mask/grad"], **TOL)


OPENRLHF = {
    "token_clip": dict(mode="tis", low=0.5, high=2.0),
    "token_mask": dict(mode="icepop", low=0.5, high=2.0),
    "seq_mask": dict(mode="mis", level="sequence", low=0.8, high=1.25, token_weights=True),
}


@pytest.mark.parametrize("name", sorted(OPENRLHF))
def test_openrlhf_is_correction(fx, name):
    """OpenRLHF PolicyLoss (ppo): coef·PPO(π_θ/π_old), coef from π_old/μ, token mean."""
    logp, prox, mu, adv, mask = _in(fx)
    c = rc.correction_weights(prox, mu, mask, **OPENRLHF[name])

    def loss(lp):
        per_token = pl.ppo_clip_loss(lp, prox, adv, mask, log_ratio_clamp=20.0)
        return _token_mean(c.weight_bgt * per_token, mask)

    value, grad = _value_and_grad(loss, logp)
    np.testing.assert_allclose(value, fx[f"openrlhf/{name}/loss"], **TOL)
    np.testing.assert_allclose(grad, fx[f"openrlhf/{name}/grad"], **TOL)
    if name == "seq_mask":  # OpenRLHF counts filtered sequences
        kept_seq = np.asarray(c.keep_bgt).any(-1)
        np.testing.assert_allclose(1 - kept_seq.mean(), fx[f"openrlhf/{name}/filtered"])
    elif name == "token_mask":
        m = rc.correction_metrics(c, mask)["masked_fraction"]
        np.testing.assert_allclose(agg.finalize(*m), fx[f"openrlhf/{name}/filtered"], **TOL)


# --------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(mode="tis"), "give a bound"),
        (dict(mode="tis", high=0.0), "`high` must be > 0"),
        (dict(mode="mis", low=-0.1, high=2.0), "`low` must be >= 0"),
        (dict(mode="mis", low=2.0, high=2.0), "`low` < `high`"),
        (dict(mode="mis", low=float("nan"), high=2.0), "`low` must be a finite number"),
        (dict(mode="icepop", level="sequence", high=2.0), "token-level"),
        (dict(mode="none", high=2.0), "takes no bounds"),
        (dict(mode="tis", high=2.0, token_weights=True), "token_weights"),
        (dict(mode="TIS", high=2.0), "`mode` must be one of"),
        (dict(mode="tis", level="seq", high=2.0), "`level` must be one of"),
        (dict(mode="tis", level="sequence", reduction="prod", high=2.0), "`reduction`"),
    ],
)
def test_bad_options_raise(kw, match):
    lt, ls, mask = _batch(10)
    with pytest.raises(ValueError, match=match):
        rc.correction_weights(lt, ls, mask, **kw)


def test_bad_arrays_name_the_argument():
    lt, ls, mask = _batch(11)
    with pytest.raises(TypeError, match="`mask_bgt`"):
        rc.token_importance_weights(lt, ls, mask.astype(np.float32))
    with pytest.raises(TypeError, match="`logp_behaviour_bgt`"):
        rc.token_importance_weights(lt, ls.astype(np.int32), mask)
    with pytest.raises(ValueError, match="`logp_behaviour_bgt`"):
        rc.token_importance_weights(lt, ls[..., :2], mask)
    with pytest.raises(ValueError, match="`behaviour_weight_cap`"):
        rc.decoupled_ppo_loss(lt, lt, ls, lt, mask, behaviour_weight_cap=0.0)
    with pytest.raises(ValueError, match="`cap_mode`"):
        rc.decoupled_ppo_loss(lt, lt, ls, lt, mask, cap_mode="clip")
    with pytest.raises(ValueError, match="`estimator`"):
        rc.rejection_divergence(lt, ls, mask, estimator="k4")


# --------------------------------------------------------------------------------------------
# Through the trainer: the recipe option in the update step, the config, and `train`'s loop.


def _update_setup(correction, seed=0, recipe=None):
    import optax

    from jaxrl_llm import algorithms
    from jaxrl_llm.train import forward
    from tests.train import helpers as H

    capture = optax.GradientTransformation(
        lambda p: {"g": jax.tree.map(jnp.zeros_like, p)},
        lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), {"g": g}),
    )
    rec = recipe or algorithms.grpo(beta=0.0, rollout_correction=correction)
    graphdef, _, state = H.fresh_state(H.tiny_lm(seed), capture, rec)
    batch = H.synthetic_batch(seed, ref=False, completion_len=7)
    logp_fn = forward.make_logprob_fn(graphdef)
    t = batch.mask_nt.shape[1]

    def model_logp(params):
        return logp_fn(params, batch.tokens_nl, batch.input_mask_nl, completion_len=t)

    rng = np.random.default_rng(seed + 1)
    noise = lambda s: jnp.asarray(rng.normal(0.0, s, batch.mask_nt.shape), jnp.float32)
    return rec, graphdef, state, batch, model_logp, noise, capture


def _grpo_loss(per_token, mask):
    return agg.finalize(*agg.seq_mean_token_mean(per_token, mask))


def test_update_step_decoupled_equals_the_three_policy_loss():
    """logp_old_nt (π_prox) and logp_sampler_nt (μ) given: the step's loss and gradient are
    those of decoupled_ppo_loss(π_θ, π_prox, μ) under grpo's aggregation."""
    from jaxrl_llm.train import update as up

    correction = {"mode": "tis", "high": 1.3}
    rec, gd, state, batch, model_logp, noise, capture = _update_setup(correction)
    mask = batch.mask_nt
    logp0 = model_logp(state.params)
    prox = jnp.where(mask, logp0 + noise(0.1), 0.0)
    mu = jnp.where(mask, prox + noise(0.4), 0.0)
    batch = batch._replace(logp_old_nt=prox, logp_sampler_nt=mu)
    new, metrics = up.make_update_step(rec, gd, capture)(jax.tree.map(jnp.copy, state), batch)

    def reference(params):
        per_token = rc.decoupled_ppo_loss(
            model_logp(params),
            prox,
            mu,
            batch.adv_nt,
            mask,
            log_ratio_clamp=20.0,  # the default numerics' PPO clamp
            behaviour_weight_cap=1.3,
            cap_mode="truncate",
        )
        return _grpo_loss(per_token, mask)

    value, grad = jax.value_and_grad(reference)(state.params)
    np.testing.assert_allclose(float(metrics["actor/pg_loss"]), float(value), rtol=1e-5)
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(grad))
    for a, b in zip(jax.tree.leaves(new.opt_state["g"]), jax.tree.leaves(grad), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5 * scale)
    w = np.asarray(rc.token_importance_weights(prox, mu, mask))
    m = np.asarray(mask)
    np.testing.assert_allclose(metrics["rollout_corr/ratio_mean"], w[m].mean(), rtol=1e-5)
    np.testing.assert_allclose(
        metrics["rollout_corr/is_weight_mean"], np.minimum(w, 1.3)[m].mean(), rtol=1e-5
    )
    np.testing.assert_allclose(metrics["rollout_corr/is_weight_max"], 1.3, rtol=1e-6)
    assert float(metrics["rollout_corr/masked_fraction"]) == 0.0


@pytest.mark.parametrize("bypass", ["reinforce", "ppo_clip"])
def test_update_step_bypass_modes(bypass):
    """Only the sampler's log-probs: reinforce weighs sg(π_θ)/μ (icepop), ppo_clip puts μ in
    PPO's ratio and keeps the rejection mask only; staleness 0 gives ratio mean 1."""
    from jaxrl_llm.train import update as up

    mode = "icepop" if bypass == "reinforce" else "reject"
    correction = {"mode": mode, "low": 0.7, "high": 1.4, "bypass": bypass}
    rec, gd, state, batch, model_logp, noise, capture = _update_setup(correction, seed=2)
    mask = batch.mask_nt
    logp0 = model_logp(state.params)
    step = up.make_update_step(rec, gd, capture)
    # Staleness 0: the sampler is the trainer.
    _, m0 = step(jax.tree.map(jnp.copy, state), batch._replace(logp_sampler_nt=logp0))
    np.testing.assert_allclose(m0["rollout_corr/ratio_mean"], 1.0, atol=1e-6)
    np.testing.assert_allclose(m0["rollout_corr/is_weight_mean"], 1.0, atol=1e-6)
    assert float(m0["rollout_corr/masked_fraction"]) == 0.0
    # A sampler that disagrees.
    mu = jnp.where(mask, logp0 + noise(0.4), 0.0)
    new, metrics = step(jax.tree.map(jnp.copy, state), batch._replace(logp_sampler_nt=mu))
    keep = rc.within_bounds(jnp.exp(logp0 - mu), mask, low=0.7, high=1.4)
    assert 0 < float(metrics["rollout_corr/masked_fraction"]) < 1

    def reference(params):
        logp = model_logp(params)
        if bypass == "reinforce":
            w = jnp.where(keep, jnp.exp(jax.lax.stop_gradient(logp) - mu), 0.0)
            per_token = rc.weighted_reinforce_loss(logp, w, batch.adv_nt, mask)
        else:
            per_token = pl.ppo_clip_loss(logp, mu, batch.adv_nt, keep, log_ratio_clamp=20.0)
        return _grpo_loss(per_token, mask)  # dropped tokens stay in the denominator

    value, grad = jax.value_and_grad(reference)(state.params)
    if bypass == "ppo_clip":  # at the start of the update π_θ = sg(π_θ): the loss values agree
        np.testing.assert_allclose(float(metrics["actor/pg_loss"]), float(value), rtol=1e-5)
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(grad))
    for a, b in zip(jax.tree.leaves(new.opt_state["g"]), jax.tree.leaves(grad), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5 * scale)


def test_update_step_refuses_a_batch_without_sampler_logprobs():
    from jaxrl_llm.train import update as up

    rec, gd, state, batch, *_, capture = _update_setup({"mode": "tis"})
    with pytest.raises(ValueError, match="sampler's log-probs"):
        up.make_update_step(rec, gd, capture)(state, batch)


def test_config_checks_the_option():
    from jaxrl_llm.config.engine import ConfigError
    from tests.train import helpers as H

    opt = "algorithm.hparams.rollout_correction={mode: mis, low: 0.5, high: 2.0}"
    cfg = H.config("tiny.yaml", opt, "old_logprobs.source=sampler")
    assert cfg.algorithm.hparams["rollout_correction"].mode == "mis"
    H.config("tiny.yaml", opt)  # recompute: the decoupled correction (π_prox = π_old)
    ppo_clip = (
        "algorithm.hparams.rollout_correction={mode: reject, low: 0.5, high: 2.0, bypass: ppo_clip}"
    )
    with pytest.raises(ConfigError, match=r"old_logprobs\.source.*bypass = ppo_clip"):
        H.config("tiny.yaml", ppo_clip)  # μ is π_old there: source sampler only
    with pytest.raises(ConfigError, match=r"rollout_correction\.lvl"):
        H.config("tiny.yaml", "algorithm.hparams.rollout_correction={lvl: token}")
    with pytest.raises(ConfigError, match="`low` < `high`"):
        H.config(
            "tiny.yaml",
            "algorithm.hparams.rollout_correction={mode: mis, low: 3.0, high: 2.0}",
            "old_logprobs.source=sampler",
        )


@pytest.mark.slow
def test_train_loop_runs_the_option_and_ratio_mean_is_one_at_staleness_0(tmp_path):
    """`jaxrl-llm train`'s loop on the tiny config: one step with icepop on the sampler's
    log-probs; the rollout engine and the trainer compute the same policy (staleness 0), so
    the ratio mean is 1 and nothing is masked."""
    from jaxrl_llm.train import loop
    from tests.train import helpers as H

    config = H.config(
        "tiny.yaml",
        "data.eval_size=0",
        "data.arithmetic.train_size=32",
        "train.max_steps=1",
        "old_logprobs.source=sampler",
        "algorithm.hparams.rollout_correction={mode: icepop, low: 0.5, high: 2.0}",
    )
    final = loop.train(config, run_dir=tmp_path, progress=False, log=lambda *_: None)
    for key in ("is_weight_mean", "is_weight_max", "masked_fraction", "ratio_mean"):
        assert np.isfinite(final[f"rollout_corr/{key}"]), key
    assert final["rollout_corr/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert final["rollout_corr/masked_fraction"] == 0.0
    assert "tis/weight_mean" not in final  # the option replaces old_logprobs.tis_cap
    assert final["step"] == 1 and final["update/nonfinite"] == 0


@pytest.mark.parametrize(
    "correction, decoupled",
    [
        ({"mode": "mis", "level": "sequence", "low": 0.7, "high": 1.4}, False),
        ({"mode": "tis", "high": 1.2}, True),
    ],
)
def test_packed_update_equals_unpacked_with_the_correction(correction, decoupled):
    """Token-budget micro-batches of a packed update see each sequence whole, so the weights,
    the loss, the gradient and the additive metrics equal the unpacked update's (the max
    averages per-micro-batch maxima, so it is only bounded by the unpacked one)."""
    from jaxrl_llm.train import packing as pk
    from jaxrl_llm.train import update as up

    rec, gd, state, batch, model_logp, noise, capture = _update_setup(correction, seed=4)
    mask = batch.mask_nt
    logp0 = model_logp(state.params)
    prox = jnp.where(mask, logp0 + noise(0.1), 0.0)
    batch = batch._replace(
        logp_old_nt=prox if decoupled else None,
        logp_sampler_nt=jnp.where(mask, prox + noise(0.4), 0.0),
    )
    lengths = np.asarray(batch.input_mask_nl).sum(1)
    plan = pk.make_plan(
        lengths, max_len=batch.tokens_nl.shape[1], num_minibatches=2, micro_batch_tokens=16
    )
    assert int(np.min(plan.count_m)) >= 2
    packed = up.packed_batch(batch, plan.device_arrays(), plan.shape)
    s_flat, m_flat = up.make_update_step(rec, gd, capture, num_minibatches=2)(
        jax.tree.map(jnp.copy, state), batch
    )
    s_pack, m_pack = up.make_update_step(rec, gd, capture, packed=True)(
        jax.tree.map(jnp.copy, state), packed
    )
    assert set(m_flat) == set(m_pack)
    for key in m_flat:
        if key == "rollout_corr/is_weight_max":
            assert float(m_pack[key]) <= float(m_flat[key]) + 1e-6
            continue
        np.testing.assert_allclose(float(m_pack[key]), float(m_flat[key]), rtol=2e-5, atol=2e-6)
    assert 0 < float(m_flat["rollout_corr/masked_fraction"]) < 1 or decoupled
    g_flat, g_pack = s_flat.opt_state["g"], s_pack.opt_state["g"]
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g_flat))
    for a, b in zip(jax.tree.leaves(g_pack), jax.tree.leaves(g_flat), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5 * max(scale, 1.0))


def test_every_recipe_that_takes_the_option_puts_it_on_its_objective():
    import inspect

    from jaxrl_llm import algorithms
    from jaxrl_llm import recipe as recipe_lib

    takers = [
        name
        for name, fn in algorithms.RECIPES.items()
        if "rollout_correction" in inspect.signature(fn).parameters
    ]
    assert {"grpo", "ppo", "dapo", "dr_grpo", "reinforce_pp", "reinforce_pp_baseline"} <= set(
        takers
    )
    for name in takers:
        rec = algorithms.get(name, rollout_correction={"mode": "mis", "low": 0.5, "high": 2.0})
        assert rec.objective.rollout_correction == recipe_lib.RolloutCorrection(
            mode="mis", low=0.5, high=2.0
        ), name
        assert recipe_lib.SAMPLER_LOGPROBS in rec.requires, name
        assert recipe_lib.SAMPLER_LOGPROBS not in algorithms.get(name).requires, name


def test_rl_step_runs_the_decoupled_correction_with_a_recomputed_pi_old():
    """source: recompute with two updates per batch: π_old is recomputed (π_prox) and the
    sampler's μ reaches the update: the decoupled correction, its metrics in the step's."""
    from jaxrl_llm.train.step import make_rl_step, needs_old_logprob_pass
    from tests.train import test_step as T

    s = T.resolve(
        "algorithm.hparams.rollout_correction={mode: tis, high: 2.0}", "optim.ppo_epochs=2"
    )
    assert needs_old_logprob_pass(s.recipe, s.update, s.old_logprobs)
    groups = T.make_groups(s, 4, near=-2.0)
    _, metrics = make_rl_step(s.recipe, s.models, s.update)(T.moved_state(s), groups)
    assert 0 < metrics["rollout_corr/is_weight_mean"] < 2.0 + 1e-6
    assert metrics["actor/grad_norm"] > 0
