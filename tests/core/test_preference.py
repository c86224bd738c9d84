"""Tests for jaxrl_llm.core.preference (DPO family) against a numpy reference and constants."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from jaxrl_llm.core import preference as pref
from tests import reference as ref


def _pairs(seed, num_pairs=None):
    """Random sequence log-probs (policy and reference) and lengths for P pairs."""
    rng = np.random.default_rng(seed)
    num_pairs = num_pairs or int(rng.integers(1, 9))
    len_w, len_l = (rng.integers(1, 40, size=num_pairs) for _ in range(2))
    ref_w, ref_l = (-rng.exponential(1.0, size=num_pairs) * n for n in (len_w, len_l))
    logp_w = ref_w + rng.normal(0.0, 3.0, size=num_pairs)
    logp_l = ref_l + rng.normal(0.0, 3.0, size=num_pairs)
    logps = [np.asarray(x, np.float32) for x in (logp_w, logp_l, ref_w, ref_l)]
    return logps, len_w.astype(np.int32), len_l.astype(np.int32)


def _loss_fns():
    """(name, loss(lw, ll, rw, rl, len_w, len_l), reference) for every pair loss."""
    return [
        (
            "sigmoid",
            lambda lw, ll, rw, rl, nw, nl: pref.dpo_sigmoid_loss(lw, ll, rw, rl, beta=0.1),
            lambda lw, ll, rw, rl, nw, nl: ref.dpo_family("sigmoid", lw, ll, rw, rl, beta=0.1),
        ),
        (
            "cdpo",
            lambda lw, ll, rw, rl, nw, nl: pref.dpo_sigmoid_loss(
                lw, ll, rw, rl, beta=0.5, label_smoothing=0.1
            ),
            lambda lw, ll, rw, rl, nw, nl: ref.dpo_family(
                "sigmoid", lw, ll, rw, rl, beta=0.5, label_smoothing=0.1
            ),
        ),
        (
            "robust",
            lambda lw, ll, rw, rl, nw, nl: pref.robust_dpo_loss(
                lw, ll, rw, rl, beta=0.2, label_smoothing=0.2
            ),
            lambda lw, ll, rw, rl, nw, nl: ref.dpo_family(
                "robust", lw, ll, rw, rl, beta=0.2, label_smoothing=0.2
            ),
        ),
        (
            "hinge",
            lambda lw, ll, rw, rl, nw, nl: pref.hinge_loss(lw, ll, rw, rl, beta=0.3),
            lambda lw, ll, rw, rl, nw, nl: ref.dpo_family("hinge", lw, ll, rw, rl, beta=0.3),
        ),
        (
            "ipo",
            lambda lw, ll, rw, rl, nw, nl: pref.ipo_loss(lw, ll, rw, rl, nw, nl, beta=0.1),
            lambda lw, ll, rw, rl, nw, nl: ref.dpo_family(
                "ipo", lw, ll, rw, rl, beta=0.1, len_w=nw, len_l=nl
            ),
        ),
        (
            "simpo",
            lambda lw, ll, rw, rl, nw, nl: pref.simpo_loss(lw, ll, nw, nl, beta=2.0, gamma=0.5),
            lambda lw, ll, rw, rl, nw, nl: ref.simpo(lw, ll, nw, nl, beta=2.0, gamma=0.5),
        ),
    ]


LOSS_NAMES = [name for name, _, _ in _loss_fns()]


def _get(name):
    return next((fn, want) for n, fn, want in _loss_fns() if n == name)


class PreferenceTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*[(name, seed) for name in LOSS_NAMES for seed in (0, 1)])
    def test_matches_numpy_reference(self, name, seed):
        fn, want_fn = _get(name)
        (lw, ll, rw, rl), nw, nl = _pairs(seed)
        got = self.variant(fn)(lw, ll, rw, rl, nw, nl)
        self.assertEqual(got.dtype, jnp.float32)
        np.testing.assert_allclose(got, want_fn(lw, ll, rw, rl, nw, nl), rtol=1e-5, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_sequence_logprob_ignores_padding(self):
        rng = np.random.default_rng(0)
        logp = -rng.exponential(size=(3, 5)).astype(np.float32)
        mask = np.array([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0]], bool)
        padded = np.where(mask, logp, np.float32(-np.inf))
        got = self.variant(pref.sequence_logprob)(padded, mask)
        np.testing.assert_allclose(got, ref.sequence_logprob(logp, mask), rtol=1e-6)
        self.assertEqual(float(got[2]), 0.0)
        grad = jax.grad(lambda x: pref.sequence_logprob(x, mask).sum())(padded)
        np.testing.assert_array_equal(grad, mask.astype(np.float32))
        lengths = self.variant(pref.sequence_length)(mask)
        np.testing.assert_array_equal(lengths, [3.0, 4.0, 0.0])
        self.assertEqual(lengths.dtype, jnp.float32)


def test_hand_computed_values():
    one = lambda x: np.array([x], np.float32)
    # ρ_w = 1, ρ_l = −1, Δ = 2, β = 0.5: βΔ = 1.
    args = (one(-1.0), one(-4.0), one(-2.0), one(-3.0))
    log_sig = lambda z: -math.log1p(math.exp(-z))
    np.testing.assert_allclose(pref.dpo_sigmoid_loss(*args, beta=0.5), [-log_sig(1.0)], rtol=1e-6)
    np.testing.assert_allclose(pref.hinge_loss(*args, beta=0.5), [0.0], atol=1e-7)
    np.testing.assert_allclose(pref.hinge_loss(*args, beta=0.25), [0.5], rtol=1e-6)
    cdpo = pref.dpo_sigmoid_loss(*args, beta=0.5, label_smoothing=0.25)
    np.testing.assert_allclose(cdpo, [-0.75 * log_sig(1.0) - 0.25 * log_sig(-1.0)], rtol=1e-6)
    robust = pref.robust_dpo_loss(*args, beta=0.5, label_smoothing=0.25)
    np.testing.assert_allclose(
        robust, [(-0.75 * log_sig(1.0) + 0.25 * log_sig(-1.0)) / 0.5], rtol=1e-6
    )
    # Δ = 0 → −log σ(0) = log 2.
    zero = (one(-1.0), one(-1.0), one(-1.0), one(-1.0))
    np.testing.assert_allclose(pref.dpo_sigmoid_loss(*zero), [math.log(2.0)], rtol=1e-6)
    # IPO, lengths 2 and 4: Δ̄ = 1/2 − (−1)/4 = 0.75, β = 1: (0.75 − 0.5)² = 0.0625.
    ipo = pref.ipo_loss(*args, np.array([2]), np.array([4]), beta=1.0)
    np.testing.assert_allclose(ipo, [0.0625], rtol=1e-6)


def test_label_smoothing_zero_is_plain_dpo():
    (lw, ll, rw, rl), _, _ = _pairs(3, num_pairs=16)
    dpo = pref.dpo_sigmoid_loss(lw, ll, rw, rl, beta=0.3)
    np.testing.assert_allclose(
        pref.dpo_sigmoid_loss(lw, ll, rw, rl, beta=0.3, label_smoothing=0.0), dpo, rtol=1e-7
    )
    np.testing.assert_allclose(
        pref.robust_dpo_loss(lw, ll, rw, rl, beta=0.3, label_smoothing=0.0), dpo, rtol=1e-7
    )
    # And with ε > 0 the three differ.
    cdpo = pref.dpo_sigmoid_loss(lw, ll, rw, rl, beta=0.3, label_smoothing=0.1)
    robust = pref.robust_dpo_loss(lw, ll, rw, rl, beta=0.3, label_smoothing=0.1)
    assert np.all(np.abs(np.asarray(cdpo) - dpo) > 1e-4)
    assert np.all(np.abs(np.asarray(robust) - dpo) > 1e-4)


def test_ipo_averages_by_length():
    (lw, ll, rw, rl), nw, nl = _pairs(4, num_pairs=8)
    loss = pref.ipo_loss(lw, ll, rw, rl, nw, nl, beta=0.1)
    # Scaling a completion's log-ratio and its length by the same factor leaves Δ̄ unchanged.
    k = np.float32(3.0)
    scaled = pref.ipo_loss(k * lw, ll, k * rw, rl, 3 * nw, nl, beta=0.1)
    np.testing.assert_allclose(scaled, loss, rtol=1e-5)
    # Unit lengths give OpenRLHF's raw-margin IPO: (Δ − 1/(2β))².
    ones = np.ones_like(nw)
    raw = pref.ipo_loss(lw, ll, rw, rl, ones, ones, beta=0.1)
    np.testing.assert_allclose(raw, ((lw - rw) - (ll - rl) - 5.0) ** 2, rtol=1e-5)
    # A zero length is read as 1 (no division by zero).
    zero = pref.ipo_loss(lw, ll, rw, rl, np.zeros_like(nw), ones, beta=0.1)
    np.testing.assert_allclose(zero, raw, rtol=1e-6)


def test_simpo_margin():
    # Equal length-normalised rewards: the loss is −log σ(−γ) = softplus(γ).
    logp = np.array([-6.0, -3.0], np.float32)
    lengths = np.array([4, 2])
    for gamma in (0.0, 0.5, 2.0):
        got = pref.simpo_loss(logp, logp[::-1].copy(), lengths, lengths[::-1].copy(), gamma=gamma)
        np.testing.assert_allclose(got, [math.log1p(math.exp(gamma))] * 2, rtol=1e-6)
    # A margin: β·(−1) − β·(−2) = 2 with β = 2; minus γ = 0.5: −log σ(1.5).
    got = pref.simpo_loss(
        np.array([-2.0], np.float32), np.array([-6.0], np.float32), np.array([2]), np.array([3])
    )
    np.testing.assert_allclose(got, [math.log1p(math.exp(-1.5))], rtol=1e-6)


def test_dpo_gradient():
    # ∂ℓ/∂logπ(y_w) = −β(σ(−βΔ) − ε) = −∂ℓ/∂logπ(y_l); reference log-probs get none.
    (lw, ll, rw, rl), _, _ = _pairs(5, num_pairs=6)
    beta, eps = 0.4, 0.1
    loss = lambda *a: pref.dpo_sigmoid_loss(*a, beta=beta, label_smoothing=eps).sum()
    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(lw, ll, rw, rl)
    z = beta * ((lw - rw) - (ll - rl))
    want = -beta * (1.0 / (1.0 + np.exp(z)) - eps)
    np.testing.assert_allclose(grads[0], want, rtol=1e-5)
    np.testing.assert_allclose(grads[1], -want, rtol=1e-5)
    np.testing.assert_array_equal(grads[2], 0.0)
    np.testing.assert_array_equal(grads[3], 0.0)


def test_preference_rewards_are_detached():
    (lw, ll, rw, rl), _, _ = _pairs(6, num_pairs=5)
    reward_w, reward_l = pref.preference_rewards(lw, ll, rw, rl, beta=0.1)
    np.testing.assert_allclose(reward_w, 0.1 * (lw - rw), rtol=1e-6)
    np.testing.assert_allclose(reward_l, 0.1 * (ll - rl), rtol=1e-6)
    grad = jax.grad(lambda x: sum(r.sum() for r in pref.preference_rewards(x, ll, rw, rl, beta=1)))
    np.testing.assert_array_equal(grad(lw), 0.0)


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_extreme_margins_stay_finite(name):
    fn, _ = _get(name)
    big = np.array([-1e4, -1e-3, -1e4, -1e-3], np.float32)
    small = np.array([-1e-3, -1e4, -1e-3, -1e4], np.float32)
    lengths = np.array([1, 1, 5, 5])
    args = (big, small, small, big, lengths, lengths)
    assert np.all(np.isfinite(fn(*args))), name
    grads = jax.grad(lambda x: fn(x, *args[1:]).sum())(big)
    assert np.all(np.isfinite(grads)), name


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_bf16_inputs_give_finite_f32(name):
    fn, _ = _get(name)
    (lw, ll, rw, rl), nw, nl = _pairs(7)
    bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (lw, ll, rw, rl)]
    got = fn(*bf16, nw, nl)
    assert got.dtype == jnp.float32 and np.all(np.isfinite(got)), name
    want = fn(*[np.asarray(x, np.float32) for x in bf16], nw, nl)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_bad_inputs_name_the_argument():
    x = np.zeros(3, np.float32)
    n = np.ones(3, np.int32)
    with pytest.raises(AssertionError, match="argument `logp_chosen_p`"):
        pref.dpo_sigmoid_loss(np.zeros((3, 1), np.float32), x, x, x)
    with pytest.raises(TypeError, match="argument `ref_rejected_p`"):
        pref.hinge_loss(x, x, x, n, beta=0.1)
    with pytest.raises(ValueError, match="argument `logp_rejected_p`"):
        pref.robust_dpo_loss(x, x[:2], x, x, beta=0.1, label_smoothing=0.1)
    with pytest.raises(ValueError, match="argument `len_rejected_p`"):
        pref.ipo_loss(x, x, x, x, n, n[:2], beta=0.1)
    with pytest.raises(TypeError, match="argument `len_chosen_p`"):
        pref.simpo_loss(x, x, np.ones(3, bool), n)
    with pytest.raises(ValueError, match="argument `beta`"):
        pref.dpo_sigmoid_loss(x, x, x, x, beta=0.0)
    with pytest.raises(ValueError, match="argument `label_smoothing`"):
        pref.robust_dpo_loss(x, x, x, x, beta=0.1, label_smoothing=0.5)
    with pytest.raises(ValueError, match="argument `label_smoothing`"):
        pref.dpo_sigmoid_loss(x, x, x, x, label_smoothing=-0.1)
    with pytest.raises(ValueError, match="argument `gamma`"):
        pref.simpo_loss(x, x, n, n, gamma=-1.0)
    with pytest.raises(TypeError, match="argument `mask_bt`"):
        pref.sequence_logprob(np.zeros((2, 3), np.float32), np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match="argument `mask_bt`"):
        pref.sequence_logprob(np.zeros((2, 3), np.float32), np.ones((2, 4), bool))
