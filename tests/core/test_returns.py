"""Tests for jaxrl_llm.core.returns against verl-style loops in tests/reference.py."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm.core import returns
from tests.reference import ref_discounted_returns, ref_gae

SHAPES = ((9,), (4, 7), (2, 3, 6))


def random_episode(seed, shape, p_valid=0.7, poison=np.nan):
    """Rewards, values and a mask with interior gaps (observation spans) and right padding."""
    rng = np.random.default_rng(seed)
    reward = rng.normal(size=shape).astype(np.float32)
    value = rng.normal(size=shape).astype(np.float32)
    mask = rng.random(shape) < p_valid
    length = rng.integers(0, shape[-1] + 1, size=shape[:-1])
    mask &= np.arange(shape[-1]) < length[..., None]  # right padding, some rows empty
    reward = np.where(mask, reward, poison).astype(np.float32)
    value = np.where(mask, value, poison).astype(np.float32)
    return reward, value, mask


class AgainstReferenceTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(1.0, 0.9, 0.0)
    def test_discounted_returns(self, gamma):
        fn = self.variant(functools.partial(returns.discounted_returns, gamma=gamma))
        for seed, shape in enumerate(SHAPES):
            reward, _, mask = random_episode(seed, shape)
            got = fn(jnp.asarray(reward), jnp.asarray(mask))
            want = ref_discounted_returns(reward, mask, gamma)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((1.0, 1.0), (1.0, 0.95), (0.9, 0.5), (0.99, 0.0))
    def test_gae(self, gamma, lam):
        fn = self.variant(functools.partial(returns.gae, gamma=gamma, lam=lam))
        for seed, shape in enumerate(SHAPES):
            reward, value, mask = random_episode(seed + 10, shape)
            adv, ret = fn(jnp.asarray(reward), jnp.asarray(value), jnp.asarray(mask))
            want_adv, want_ret = ref_gae(reward, value, mask, gamma, lam)
            np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_single_sequence_primitives(self):
        reward, value, mask = random_episode(3, (11,), p_valid=0.6)
        mask[0] = True
        r, v, m = jnp.asarray(reward), jnp.asarray(value), jnp.asarray(mask)
        got = self.variant(functools.partial(returns.discounted_returns_t, gamma=0.8))(r, m)
        np.testing.assert_allclose(got, ref_discounted_returns(reward, mask, 0.8), 1e-5, 1e-6)
        adv, ret = self.variant(functools.partial(returns.gae_t, gamma=0.8, lam=0.7))(r, v, m)
        want_adv, want_ret = ref_gae(reward, value, mask, 0.8, 0.7)
        np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-6)

    @settings(max_examples=10)  # each example compiles a new scan
    @given(
        seed=st.integers(0, 2**16),
        time=st.integers(1, 12),
        gamma=st.floats(0.0, 1.0),
        lam=st.floats(0.0, 1.0),
    )
    def test_gae_random(self, seed, time, gamma, lam):
        reward, value, mask = random_episode(seed, (3, time), p_valid=0.8)
        adv, ret = returns.gae(
            jnp.asarray(reward), jnp.asarray(value), jnp.asarray(mask), gamma=gamma, lam=lam
        )
        want_adv, want_ret = ref_gae(reward, value, mask, gamma, lam)
        np.testing.assert_allclose(adv, want_adv, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(ret, want_ret, rtol=1e-4, atol=1e-5)


class HandComputedTest(parameterized.TestCase):
    def test_gae(self):
        reward = jnp.asarray([0.0, 0.0, 1.0])
        value = jnp.asarray([0.5, 0.6, 0.7])
        adv, ret = returns.gae(reward, value, jnp.ones(3, bool), gamma=0.9, lam=0.8)
        # δ = (0.9·0.6 − 0.5, 0.9·0.7 − 0.6, 1 − 0.7) = (0.04, 0.03, 0.3); γλ = 0.72.
        np.testing.assert_allclose(adv, [0.04 + 0.72 * 0.246, 0.03 + 0.72 * 0.3, 0.3], rtol=1e-6)
        np.testing.assert_allclose(ret, [0.71712, 0.846, 1.0], rtol=1e-6)

    def test_masked_span_is_carried_through(self):
        # An observation token between two generated tokens: no reward, no discount, output 0.
        mask = jnp.asarray([True, False, True, False])
        reward = jnp.asarray([1.0, 9.0, 2.0, jnp.nan])
        value = jnp.asarray([0.5, jnp.nan, 1.0, jnp.inf])
        got = returns.discounted_returns(reward, mask, gamma=0.5)
        np.testing.assert_allclose(got, [1.0 + 0.5 * 2.0, 0.0, 2.0, 0.0])
        adv, ret = returns.gae(reward, value, mask, gamma=1.0, lam=1.0)
        # t=2: δ = 2 − 1 = 1; t=0: V_next = V_2 = 1, δ = 1 + 1 − 0.5 = 1.5, A = 1.5 + 1.
        np.testing.assert_allclose(adv, [2.5, 0.0, 1.0, 0.0])
        np.testing.assert_allclose(ret, [3.0, 0.0, 2.0, 0.0])

    def test_gae_with_lambda_one_and_zero_values_is_the_discounted_return(self):
        reward, _, mask = random_episode(5, (4, 3, 8))
        r, m = jnp.asarray(reward), jnp.asarray(mask)
        for gamma in (1.0, 0.7):
            adv, ret = returns.gae(r, jnp.zeros_like(r), m, gamma=gamma, lam=1.0)
            want = returns.discounted_returns(r, m, gamma=gamma)
            np.testing.assert_allclose(adv, want, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(ret, want, rtol=1e-6, atol=1e-6)

    def test_gae_with_lambda_zero_is_the_one_step_td_error(self):
        rng = np.random.default_rng(6)
        reward, value = rng.normal(size=(2, 3, 6)).astype(np.float32)
        gamma = 0.9
        next_value = np.concatenate([value[:, 1:], np.zeros((3, 1), np.float32)], axis=1)
        adv, ret = returns.gae(
            jnp.asarray(reward), jnp.asarray(value), jnp.ones((3, 6), bool), gamma=gamma, lam=0.0
        )
        np.testing.assert_allclose(adv, reward + gamma * next_value - value, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ret, reward + gamma * next_value, rtol=1e-5, atol=1e-6)


class PropertiesTest(parameterized.TestCase):
    def test_padding_values_and_extra_padding_do_not_matter(self):
        reward, value, mask = random_episode(7, (3, 2, 6))
        huge_r = np.where(mask, reward, 1e30).astype(np.float32)
        huge_v = np.where(mask, value, -np.inf).astype(np.float32)
        kw = dict(gamma=0.95, lam=0.9)
        base = returns.gae(jnp.asarray(reward), jnp.asarray(value), jnp.asarray(mask), **kw)
        other = returns.gae(jnp.asarray(huge_r), jnp.asarray(huge_v), jnp.asarray(mask), **kw)
        chex.assert_trees_all_equal(base, other)
        for x in base:
            self.assertTrue(np.isfinite(x).all())
        pad = ((0, 0), (0, 0), (0, 4))
        padded = returns.gae(
            jnp.asarray(np.pad(reward, pad, constant_values=np.nan)),
            jnp.asarray(np.pad(value, pad, constant_values=np.nan)),
            jnp.asarray(np.pad(mask, pad)),
            **kw,
        )
        for got, want in zip(padded, base, strict=True):
            np.testing.assert_array_equal(got[..., :6], want)
            np.testing.assert_array_equal(got[..., 6:], 0.0)
        ret = returns.discounted_returns(jnp.asarray(huge_r), jnp.asarray(mask), gamma=0.9)
        np.testing.assert_array_equal(
            ret, returns.discounted_returns(jnp.asarray(reward), jnp.asarray(mask), gamma=0.9)
        )

    def test_bf16_inputs_give_finite_f32(self):
        reward, value, mask = random_episode(8, (4, 10))
        r16, v16 = jnp.asarray(reward, jnp.bfloat16), jnp.asarray(value, jnp.bfloat16)
        m = jnp.asarray(mask)
        adv, ret = returns.gae(r16, v16, m, gamma=1.0, lam=0.95)
        disc = returns.discounted_returns(r16, m, gamma=1.0)
        for x in (adv, ret, disc):
            self.assertEqual(x.dtype, jnp.float32)
            self.assertTrue(np.isfinite(x).all())
        want_adv, _ = ref_gae(
            np.asarray(r16, np.float64), np.asarray(v16, np.float64), mask, 1, 0.95
        )
        np.testing.assert_allclose(adv, want_adv, rtol=1e-5, atol=1e-5)

    def test_gradients_are_finite_with_nan_padding(self):
        reward, value, mask = random_episode(9, (3, 7))
        m = jnp.asarray(mask)

        def loss(reward, value):
            adv, ret = returns.gae(reward, value, m, gamma=0.9, lam=0.9)
            return jnp.sum(adv) + jnp.sum(ret)

        grads = jax.grad(loss, argnums=(0, 1))(jnp.asarray(reward), jnp.asarray(value))
        for g in grads:
            self.assertTrue(np.isfinite(g).all())
            np.testing.assert_array_equal(np.where(mask, 0.0, g), 0.0)

    def test_batched_equals_vmapped_primitive(self):
        reward, value, mask = random_episode(11, (5, 8))
        args = jnp.asarray(reward), jnp.asarray(value), jnp.asarray(mask)
        one = jax.vmap(functools.partial(returns.gae_t, gamma=0.9, lam=0.8))
        chex.assert_trees_all_close(one(*args), returns.gae(*args, gamma=0.9, lam=0.8))


class BadInputTest(parameterized.TestCase):
    def test_errors_name_the_argument(self):
        r, m = jnp.zeros((2, 5)), jnp.ones((2, 5), bool)
        with pytest.raises(ValueError, match="discounted_returns: argument `gamma`"):
            returns.discounted_returns(r, m, gamma=1.5)
        with pytest.raises(ValueError, match="gae: argument `lam`"):
            returns.gae(r, r, m, gamma=1.0, lam=-0.1)
        with pytest.raises(TypeError, match="gae: argument `mask_bgt`"):
            returns.gae(r, r, m.astype(jnp.float32), gamma=1.0, lam=1.0)
        with pytest.raises(TypeError, match="discounted_returns: argument `reward_bgt`"):
            returns.discounted_returns(r.astype(jnp.int32), m, gamma=1.0)
        with pytest.raises(ValueError, match="gae: argument `value_bgt`"):
            returns.gae(r, jnp.zeros((2, 6)), m, gamma=1.0, lam=1.0)
        with pytest.raises(ValueError, match="gae: argument `reward_bgt`"):
            returns.gae(jnp.asarray(0.0), jnp.asarray(0.0), jnp.asarray(True), gamma=1, lam=1)
        with pytest.raises(AssertionError, match="gae_t: argument `reward_t`"):
            returns.gae_t(r, r, m, gamma=1.0, lam=1.0)
        with pytest.raises(AssertionError, match="discounted_returns_t: argument `mask_t`"):
            returns.discounted_returns_t(r[0], m, gamma=1.0)


def test_gamma_one_cumsum_path_equals_the_scan():
    """γ = 1 takes a reverse-cumsum shortcut; it must equal the one-sequence scan exactly."""
    rng = np.random.default_rng(7)
    reward = rng.normal(size=(3, 4, 9)).astype(np.float32)
    mask = rng.random((3, 4, 9)) < 0.7
    fast = returns.discounted_returns(jnp.asarray(reward), jnp.asarray(mask), gamma=1.0)
    scan = jax.vmap(jax.vmap(lambda r, m: returns.discounted_returns_t(r, m, gamma=1.0)))(
        jnp.asarray(reward), jnp.asarray(mask)
    )
    np.testing.assert_allclose(fast, scan, rtol=1e-6, atol=1e-6)


def _openrlhf_gae(reward, value, mask, gamma, lam):
    """OpenRLHF's loop (get_advantages_and_returns): r·m and V·m, every position a step."""
    r, v = np.where(mask, reward, 0.0), np.where(mask, value, 0.0)
    adv = np.zeros_like(r, dtype=np.float64)
    last = np.zeros(r.shape[:-1])
    for t in reversed(range(r.shape[-1])):
        nxt = v[..., t + 1] if t + 1 < r.shape[-1] else 0.0
        last = r[..., t] + gamma * nxt - v[..., t] + gamma * lam * last
        adv[..., t] = last
    return adv, adv + v


def _openrlhf_returns(reward, mask, gamma):
    """OpenRLHF's loop (get_cumulative_returns): discounts at every position."""
    r = np.where(mask, reward, 0.0)
    out, acc = np.zeros_like(r, dtype=np.float64), np.zeros(r.shape[:-1])
    for t in reversed(range(r.shape[-1])):
        acc = r[..., t] + gamma * acc
        out[..., t] = acc
    return out


class HolesAsStepsTest(chex.TestCase):
    """skip_masked=False: interior holes are zero-reward, zero-value steps (OpenRLHF)."""

    @parameterized.parameters((1.0, 1.0), (0.9, 0.8), (0.5, 0.0))
    def test_gae_matches_openrlhf_loop(self, gamma, lam):
        for seed, shape in enumerate(SHAPES):
            reward, value, mask = random_episode(seed + 20, shape)
            adv, ret = returns.gae(
                jnp.asarray(reward),
                jnp.asarray(value),
                jnp.asarray(mask),
                gamma=gamma,
                lam=lam,
                skip_masked=False,
            )
            want_adv, want_ret = _openrlhf_gae(reward, value, mask, gamma, lam)
            np.testing.assert_allclose(adv, np.where(mask, want_adv, 0), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(ret, np.where(mask, want_ret, 0), rtol=1e-5, atol=1e-5)

    @parameterized.parameters(1.0, 0.9, 0.0)
    def test_returns_match_openrlhf_loop(self, gamma):
        for seed, shape in enumerate(SHAPES):
            reward, _, mask = random_episode(seed + 30, shape)
            got = returns.discounted_returns(
                jnp.asarray(reward), jnp.asarray(mask), gamma=gamma, skip_masked=False
            )
            want = np.where(mask, _openrlhf_returns(reward, mask, gamma), 0)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    def test_holes_change_the_numbers_and_right_padding_does_not(self):
        reward = jnp.array([1.0, 5.0, 2.0, 0.0])
        hole = jnp.array([True, False, True, False])
        skip = returns.discounted_returns(reward, hole, gamma=0.5)
        steps = returns.discounted_returns(reward, hole, gamma=0.5, skip_masked=False)
        np.testing.assert_allclose(skip, [2.0, 0.0, 2.0, 0.0])
        np.testing.assert_allclose(steps, [1.5, 0.0, 2.0, 0.0])  # 1 + 0.5·(0 + 0.5·2)
        padded = jnp.array([True, True, True, False])
        np.testing.assert_allclose(
            returns.discounted_returns(reward, padded, gamma=0.5),
            returns.discounted_returns(reward, padded, gamma=0.5, skip_masked=False),
        )
