"""Tests for jaxrl_llm.core.policy_losses.truncated_importance_weight (TIS, Yao et al. 2025)."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from jaxrl_llm.core import policy_losses as pl


def _batch(seed, shape=(2, 3, 4), *, spread=0.7):
    """Random [B, G, T] trainer and sampler log-probs and a random (non-prefix) mask."""
    rng = np.random.default_rng(seed)
    logp = -rng.exponential(1.0, size=shape)
    logp_sampler = logp + rng.normal(0.0, spread, size=shape)
    mask = rng.random(shape) < 0.7
    mask[0, 0] = False  # one empty completion
    return logp.astype(np.float32), logp_sampler.astype(np.float32), mask


def ref_truncated_importance_weight(logp, logp_sampler, mask, cap=None):
    """``min(exp(logp − logp_sampler), C)`` on valid tokens, 1 on padding, one token at a time."""
    out = np.ones(np.shape(logp))
    for idx in np.ndindex(*np.shape(logp)):
        if not mask[idx]:
            continue
        w = math.exp(float(logp[idx]) - float(logp_sampler[idx]))
        out[idx] = w if cap is None else min(w, cap)
    return out


class TruncatedImportanceWeightTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((0, None), (1, None), (0, 1.2), (1, 2.0))
    def test_matches_reference(self, seed, cap):
        logp, logp_sampler, mask = _batch(seed)
        fn = self.variant(functools.partial(pl.truncated_importance_weight, cap=cap))
        got = fn(logp, logp_sampler, mask)
        want = ref_truncated_importance_weight(logp, logp_sampler, mask, cap)
        self.assertEqual(got.dtype, jnp.float32)
        self.assertEqual(got.shape, logp.shape)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(np.asarray(got)[~mask], 1.0)
        if cap is not None:
            # The cap is reached somewhere, so the truncation is exercised.
            self.assertTrue(np.any(want[mask] >= cap) and np.any(want[mask] < cap))
            self.assertTrue(np.all(np.asarray(got) <= max(cap, 1.0)))

    def test_cap_below_one_keeps_padding_at_one(self):
        logp, logp_sampler, mask = _batch(2)
        got = pl.truncated_importance_weight(logp, logp_sampler, mask, cap=0.5)
        want = ref_truncated_importance_weight(logp, logp_sampler, mask, 0.5)
        np.testing.assert_allclose(np.asarray(got)[mask], want[mask], rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(np.asarray(got)[~mask], 1.0)  # fails: got 0.5

    def test_cap_below_one_truncates_valid_tokens(self):
        logp, logp_sampler, mask = _batch(2)
        got = pl.truncated_importance_weight(logp, logp_sampler, mask, cap=0.5)
        want = ref_truncated_importance_weight(logp, logp_sampler, mask, 0.5)
        np.testing.assert_allclose(np.asarray(got)[mask], want[mask], rtol=1e-6, atol=1e-7)

    def test_hand_computed(self):
        logp = np.log(np.array([2.0, 0.5, 1.0, 3.0], np.float32))
        logp_sampler = np.zeros(4, np.float32)
        mask = np.array([True, True, True, False])
        np.testing.assert_allclose(
            pl.truncated_importance_weight(logp, logp_sampler, mask), [2.0, 0.5, 1.0, 1.0]
        )
        np.testing.assert_allclose(
            pl.truncated_importance_weight(logp, logp_sampler, mask, cap=1.5), [1.5, 0.5, 1.0, 1.0]
        )

    def test_huge_ratio_is_truncated_to_the_cap(self):
        logp, logp_sampler = np.array([0.0], np.float32), np.array([-200.0], np.float32)
        mask = np.array([True])
        np.testing.assert_allclose(
            pl.truncated_importance_weight(logp, logp_sampler, mask, cap=2.0), [2.0]
        )

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(None, 1.5)
    def test_infinite_and_nan_padding_gives_no_nan(self, cap):
        logp, logp_sampler, mask = _batch(3)
        clean = pl.truncated_importance_weight(logp, logp_sampler, mask, cap=cap)
        logp_pad = np.where(mask, logp, -np.inf).astype(np.float32)
        sampler_pad = np.where(mask, logp_sampler, -np.inf).astype(np.float32)
        fn = self.variant(functools.partial(pl.truncated_importance_weight, cap=cap))
        got = fn(logp_pad, sampler_pad, mask)
        self.assertTrue(np.all(np.isfinite(got)))
        np.testing.assert_array_equal(got, clean)
        np.testing.assert_array_equal(np.asarray(got)[~mask], 1.0)
        nan_pad = np.where(mask, logp_sampler, np.nan).astype(np.float32)
        np.testing.assert_array_equal(fn(logp, nan_pad, mask), clean)
        # Nor do the gradients (zero everywhere: the weight is a constant).
        grads = jax.grad(
            lambda a, b: jnp.sum(pl.truncated_importance_weight(a, b, mask, cap=cap)),
            argnums=(0, 1),
        )(logp_pad, sampler_pad)
        for g in grads:
            self.assertTrue(np.all(np.isfinite(g)))
            np.testing.assert_array_equal(g, 0.0)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(None, 1.2)
    def test_no_gradient_flows_through_the_weight(self, cap):
        logp, logp_sampler, mask = _batch(4)
        w = ref_truncated_importance_weight(logp, logp_sampler, mask, cap)

        def surrogate(lp, lps):
            return jnp.sum(pl.truncated_importance_weight(lp, lps, mask, cap=cap) * lp)

        grad_logp, grad_sampler = self.variant(jax.grad(surrogate, argnums=(0, 1)))(
            logp, logp_sampler
        )
        # d/dlogp Σ w·logp = w exactly when w is a constant of the loss.
        np.testing.assert_allclose(grad_logp, w, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(grad_sampler, 0.0)

    def test_bf16_inputs_give_f32(self):
        logp, logp_sampler, mask = _batch(5)
        bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (logp, logp_sampler)]
        for cap in (None, 1.5):
            got = pl.truncated_importance_weight(*bf16, mask, cap=cap)
            self.assertEqual(got.dtype, jnp.float32)
            # The math runs in f32 on the upcast inputs.
            upcast = [np.asarray(x, np.float32) for x in bf16]
            want = ref_truncated_importance_weight(*upcast, mask, cap)
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)

    def test_vmap_equals_batched_call(self):
        logp, logp_sampler, mask = _batch(6)
        fn = functools.partial(pl.truncated_importance_weight, cap=1.5)
        np.testing.assert_allclose(
            jax.vmap(fn)(logp, logp_sampler, mask), fn(logp, logp_sampler, mask), rtol=1e-7
        )


@pytest.mark.parametrize("cap", [0.0, -1.0])
def test_non_positive_cap_raises(cap):
    logp, logp_sampler, mask = _batch(7)
    with pytest.raises(ValueError, match="`cap`"):
        pl.truncated_importance_weight(logp, logp_sampler, mask, cap=cap)


def test_bad_inputs_name_the_argument():
    logp, logp_sampler, mask = _batch(8)
    with pytest.raises(TypeError, match="`mask_bgt`"):
        pl.truncated_importance_weight(logp, logp_sampler, mask.astype(np.float32))
    with pytest.raises(TypeError, match="`logp_sampler_bgt`"):
        pl.truncated_importance_weight(logp, logp_sampler.astype(np.int32), mask)
    with pytest.raises(ValueError, match="`logp_sampler_bgt`"):
        pl.truncated_importance_weight(logp, logp_sampler[..., :2], mask)
