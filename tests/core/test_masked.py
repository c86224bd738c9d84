"""Tests for jaxrl_llm.core.masked against the loop references in tests/reference.py."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from jaxrl_llm.core import masked
from tests.reference import (
    ref_first_valid_index,
    ref_last_valid_index,
    ref_masked_mean,
    ref_masked_stat_last_axis,
    ref_masked_sum,
    ref_masked_var,
    ref_masked_whiten,
    ref_place_on_last_token,
    ref_value_at_first_token,
)

SHAPES = ((7,), (3, 5), (2, 3, 6))


def random_masked(seed, shape, p_valid=0.6, poison=np.nan):
    """Normal data with ``poison`` (NaN by default) wherever the mask is False."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape).astype(np.float32) * 3.0 + 1.0
    mask = rng.random(shape) < p_valid
    return np.where(mask, x, poison).astype(np.float32), mask


class ReductionsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_whole_array_against_reference(self):
        for seed, shape in enumerate(SHAPES):
            x, mask = random_masked(seed, shape)
            args = jnp.asarray(x), jnp.asarray(mask)
            np.testing.assert_allclose(
                self.variant(masked.masked_sum)(*args), ref_masked_sum(x, mask), rtol=1e-5
            )
            np.testing.assert_allclose(
                self.variant(masked.masked_count)(args[1]), mask.sum(), rtol=0
            )
            np.testing.assert_allclose(
                self.variant(masked.masked_mean)(*args), ref_masked_mean(x, mask), rtol=1e-5
            )
            for ddof in (0, 1, 2):
                var = self.variant(functools.partial(masked.masked_var, ddof=ddof))(*args)
                np.testing.assert_allclose(var, ref_masked_var(x, mask, ddof), rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(0, 1)
    def test_last_axis_against_reference(self, ddof):
        x, mask = random_masked(3, (4, 3, 5), p_valid=0.4)
        mask[0, 0] = False  # an empty row
        mask[1, 2] = [True, False, False, False, False]  # N = 1
        x = np.where(mask, x, np.nan).astype(np.float32)
        args = jnp.asarray(x), jnp.asarray(mask)
        got_sum = self.variant(functools.partial(masked.masked_sum, axis=-1))(*args)
        got_mean = self.variant(functools.partial(masked.masked_mean, axis=-1))(*args)
        got_var = self.variant(functools.partial(masked.masked_var, axis=-1, ddof=ddof))(*args)
        got_count = self.variant(functools.partial(masked.masked_count, axis=-1))(args[1])
        np.testing.assert_allclose(
            got_sum, ref_masked_stat_last_axis(ref_masked_sum, x, mask), 1e-5
        )
        np.testing.assert_allclose(
            got_mean, ref_masked_stat_last_axis(ref_masked_mean, x, mask), rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            got_var,
            ref_masked_stat_last_axis(ref_masked_var, x, mask, ddof=ddof),
            rtol=1e-5,
            atol=1e-6,
        )
        np.testing.assert_array_equal(got_count, mask.sum(-1))
        self.assertEqual(got_var.shape, (4, 3))
        self.assertEqual(got_mean[0, 0], 0.0)
        self.assertEqual(got_var[1, 2], 0.0)

    def test_tuple_axis(self):
        x, mask = random_masked(4, (2, 3, 4))
        got = masked.masked_var(jnp.asarray(x), jnp.asarray(mask), axis=(0, 2), ddof=1)
        want = [ref_masked_var(x[:, g], mask[:, g], 1) for g in range(3)]
        np.testing.assert_allclose(got, want, rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_empty_mask_gives_zero_not_nan(self):
        x = jnp.full((3, 4), jnp.nan)
        mask = jnp.zeros((3, 4), bool)
        for fn in (masked.masked_sum, masked.masked_mean, masked.masked_var):
            np.testing.assert_array_equal(self.variant(fn)(x, mask), 0.0)
        np.testing.assert_array_equal(self.variant(masked.masked_whiten)(x, mask), 0.0)

    def test_variance_is_zero_when_count_at_most_ddof(self):
        x = jnp.asarray([5.0, 7.0, 9.0])
        for n, ddof in ((1, 1), (2, 2), (2, 3), (0, 0)):
            mask = jnp.arange(3) < n
            self.assertEqual(float(masked.masked_var(x, mask, ddof=ddof)), 0.0)
        # N = 3 > ddof = 2: Σ(x − 7)² / (3 − 2) = 8.
        self.assertAlmostEqual(float(masked.masked_var(x, jnp.ones(3, bool), ddof=2)), 8.0)

    def test_int_data_is_upcast(self):
        x = jnp.asarray([1, 2, 3, 100], jnp.int32)
        mask = jnp.asarray([True, True, True, False])
        self.assertEqual(masked.masked_sum(x, mask).dtype, jnp.float32)
        self.assertAlmostEqual(float(masked.masked_mean(x, mask)), 2.0)

    def test_gradient_is_finite_and_zero_under_the_mask(self):
        x, mask = random_masked(5, (3, 4), poison=np.inf)
        for fn in (masked.masked_mean, masked.masked_var):
            grad = jax.grad(lambda x, fn=fn: fn(x, jnp.asarray(mask)))(jnp.asarray(x))
            self.assertTrue(np.isfinite(grad).all())
            np.testing.assert_array_equal(np.where(mask, 0.0, grad), 0.0)


class WhitenTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(
        (0, True, False, 1e-8),  # default
        (1, True, False, 1e-8),  # verl
        (0, True, True, 1e-8),  # OpenRLHF
        (1, False, False, 0.5),  # rescale only, eps large enough to matter
        (0, False, True, 2.0),  # floor above the variance
    )
    def test_against_reference(self, ddof, shift_mean, eps_as_floor, eps):
        kw = dict(ddof=ddof, shift_mean=shift_mean, eps_as_floor=eps_as_floor, eps=eps)
        fn = self.variant(functools.partial(masked.masked_whiten, **kw))
        for seed, shape in enumerate(SHAPES):
            x, mask = random_masked(seed + 10, shape)
            got = fn(jnp.asarray(x), jnp.asarray(mask))
            np.testing.assert_allclose(got, ref_masked_whiten(x, mask, **kw), rtol=1e-4, atol=1e-5)

    def test_hand_computed(self):
        x = jnp.asarray([1.0, 2.0, 3.0, 4.0, jnp.nan])
        mask = jnp.asarray([True, True, True, True, False])
        # μ = 2.5; σ² = 1.25 (ddof 0) or 5/3 (ddof 1).
        got0 = masked.masked_whiten(x, mask, ddof=0)
        got1 = masked.masked_whiten(x, mask, ddof=1)
        np.testing.assert_allclose(got0, [-1.3416408, -0.4472136, 0.4472136, 1.3416408, 0], 1e-6)
        np.testing.assert_allclose(got1, [-1.1618950, -0.3872983, 0.3872983, 1.1618950, 0], 1e-6)
        # eps inside the rsqrt vs as a floor differ once eps is comparable to σ².
        inside = masked.masked_whiten(x, mask, eps=1.0)
        floor = masked.masked_whiten(x, mask, eps=1.0, eps_as_floor=True)
        np.testing.assert_allclose(inside[0], -1.5 / np.sqrt(2.25), rtol=1e-6)
        np.testing.assert_allclose(floor[0], -1.5 / np.sqrt(1.25), rtol=1e-6)
        # shift_mean=False rescales and keeps the mean.
        rescaled = masked.masked_whiten(x, mask, shift_mean=False)
        np.testing.assert_allclose(rescaled[:4], np.asarray(got0[:4]) + 2.5, rtol=1e-6)

    def test_constant_input_gives_zero(self):
        x = jnp.full((4, 6), 3.25)
        mask = jnp.ones((4, 6), bool)
        np.testing.assert_array_equal(masked.masked_whiten(x, mask, ddof=1), 0.0)

    @given(
        seed=st.integers(0, 2**16),
        shape=st.sampled_from(((8,), (3, 7), (2, 2, 5))),
        ddof=st.sampled_from((0, 1)),
    )
    def test_whitened_has_zero_mean_and_unit_variance(self, seed, shape, ddof):
        x, mask = random_masked(seed, shape, p_valid=0.8)
        mask.flat[:3] = True  # at least three valid entries, so σ² > 0
        x = np.where(mask, np.random.default_rng(seed).normal(size=shape), np.nan)
        out = masked.masked_whiten(jnp.asarray(x, jnp.float32), jnp.asarray(mask), ddof=ddof)
        self.assertAlmostEqual(float(masked.masked_mean(out, jnp.asarray(mask))), 0.0, places=5)
        var = float(masked.masked_var(out, jnp.asarray(mask), ddof=ddof))
        self.assertAlmostEqual(var, 1.0, delta=1e-4)

    def test_padding_values_and_extra_padding_do_not_matter(self):
        x, mask = random_masked(7, (3, 5))
        base = masked.masked_whiten(jnp.asarray(x), jnp.asarray(mask), ddof=1)
        huge = np.where(mask, x, 1e30).astype(np.float32)
        np.testing.assert_array_equal(
            masked.masked_whiten(jnp.asarray(huge), jnp.asarray(mask), ddof=1), base
        )
        padded_x = np.pad(x, ((0, 1), (0, 3)), constant_values=-np.inf)
        padded_mask = np.pad(mask, ((0, 1), (0, 3)))
        got = masked.masked_whiten(jnp.asarray(padded_x), jnp.asarray(padded_mask), ddof=1)
        np.testing.assert_allclose(got[:3, :5], base, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(got[3:], 0.0)
        np.testing.assert_array_equal(got[:, 5:], 0.0)

    def test_bf16_input_gives_finite_f32(self):
        x, mask = random_masked(8, (4, 9))
        out = masked.masked_whiten(jnp.asarray(x, jnp.bfloat16), jnp.asarray(mask))
        self.assertEqual(out.dtype, jnp.float32)
        self.assertTrue(np.isfinite(out).all())
        want = ref_masked_whiten(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64), mask)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)

    def test_axis_name_gives_global_statistics_under_shard_map(self):
        mesh = jax.make_mesh((8,), ("data",))
        x, mask = random_masked(9, (16, 6))
        mask[:4] = False  # some shards see far fewer valid entries than others
        put = lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, P("data")))
        x, mask = put(jnp.asarray(x)), put(jnp.asarray(mask))

        def sharded(fn):
            return jax.jit(
                jax.shard_map(fn, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P())
            )

        for fn in (masked.masked_sum, masked.masked_mean, masked.masked_var):
            got = sharded(functools.partial(fn, axis_name="data"))(x, mask)
            np.testing.assert_allclose(got, fn(x, mask), rtol=1e-5)
        whiten = functools.partial(masked.masked_whiten, ddof=1)
        got = jax.jit(
            jax.shard_map(
                functools.partial(whiten, axis_name="data"),
                mesh=mesh,
                in_specs=(P("data"), P("data")),
                out_specs=P("data"),
            )
        )(x, mask)
        np.testing.assert_allclose(got, whiten(x, mask), rtol=1e-5, atol=1e-6)
        # Without axis_name each shard whitens with its own statistics: the test can fail.
        local = jax.jit(
            jax.shard_map(whiten, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"))
        )(x, mask)
        self.assertGreater(float(jnp.max(jnp.abs(local - whiten(x, mask)))), 1e-2)


class TokenPlacementTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_against_reference(self):
        for seed, shape in enumerate(((6,), (3, 5), (2, 3, 7))):
            x, mask = random_masked(seed + 20, shape, p_valid=0.4)
            mask.reshape(-1, shape[-1])[0] = False  # an empty row
            x = np.where(mask, x, np.nan).astype(np.float32)
            value = np.random.default_rng(seed).normal(size=shape[:-1]).astype(np.float32)
            m = jnp.asarray(mask)
            np.testing.assert_array_equal(
                self.variant(masked.last_valid_index)(m), ref_last_valid_index(mask)
            )
            np.testing.assert_array_equal(
                self.variant(masked.first_valid_index)(m), ref_first_valid_index(mask)
            )
            placed = self.variant(masked.place_on_last_token)(jnp.asarray(value), m)
            np.testing.assert_array_equal(placed, ref_place_on_last_token(value, mask))
            first = self.variant(masked.value_at_first_token)(jnp.asarray(x), m)
            np.testing.assert_array_equal(first, ref_value_at_first_token(x, mask))

    def test_hand_computed(self):
        mask = jnp.asarray([[False, True, True, False], [False, False, False, False]])
        x = jnp.asarray([[jnp.nan, 2.0, 3.0, jnp.inf], [jnp.nan] * 4])
        np.testing.assert_array_equal(masked.last_valid_index(mask), [2, 0])
        np.testing.assert_array_equal(masked.first_valid_index(mask), [1, 0])
        self.assertEqual(masked.last_valid_index(mask).dtype, jnp.int32)
        self.assertEqual(masked.first_valid_index(mask).dtype, jnp.int32)
        placed = masked.place_on_last_token(jnp.asarray([5.0, jnp.nan]), mask)
        np.testing.assert_array_equal(placed, [[0, 0, 5, 0], [0, 0, 0, 0]])
        np.testing.assert_array_equal(masked.value_at_first_token(x, mask), [2.0, 0.0])

    def test_gradients_ignore_padding(self):
        mask = jnp.asarray([[False, True, True], [False, False, False]])
        x = jnp.asarray([[jnp.nan, 2.0, 3.0], [jnp.nan] * 3])
        grad = jax.grad(lambda x: masked.value_at_first_token(x, mask).sum())(x)
        np.testing.assert_array_equal(grad, [[0, 1, 0], [0, 0, 0]])
        grad_v = jax.grad(lambda v: masked.place_on_last_token(v, mask).sum())(jnp.ones(2))
        np.testing.assert_array_equal(grad_v, [1, 0])


class BadInputTest(parameterized.TestCase):
    def test_reductions(self):
        x, mask = jnp.zeros((2, 3)), jnp.ones((2, 3), bool)
        with pytest.raises(TypeError, match="masked_sum: argument `mask`"):
            masked.masked_sum(x, mask.astype(jnp.float32))
        with pytest.raises(ValueError, match="masked_mean: argument `mask`"):
            masked.masked_mean(x, jnp.ones((2, 4), bool))
        with pytest.raises(TypeError, match="masked_var: argument `x`"):
            masked.masked_var(mask, mask)
        with pytest.raises(TypeError, match="masked_count: argument `mask`"):
            masked.masked_count(x)
        with pytest.raises(ValueError, match="argument `ddof`"):
            masked.masked_var(x, mask, ddof=-1)
        with pytest.raises(ValueError, match="masked_whiten: argument `eps`"):
            masked.masked_whiten(x, mask, eps=0.0)
        with pytest.raises(TypeError, match="masked_whiten: argument `mask`"):
            masked.masked_whiten(x, jnp.ones((2, 3), jnp.int32))

    def test_token_placement(self):
        mask = jnp.ones((2, 3, 4), bool)
        with pytest.raises(AssertionError, match="place_on_last_token: argument `mask_bgt`"):
            masked.place_on_last_token(jnp.zeros((2, 3, 4)), mask)
        with pytest.raises(ValueError, match="place_on_last_token: argument `mask_bgt`"):
            masked.place_on_last_token(jnp.zeros((2, 5)), mask)
        with pytest.raises(TypeError, match="place_on_last_token: argument `mask_bgt`"):
            masked.place_on_last_token(jnp.zeros((2, 3)), jnp.ones((2, 3, 4)))
        with pytest.raises(ValueError, match="value_at_first_token: argument `mask_bgt`"):
            masked.value_at_first_token(jnp.zeros((2, 3, 4)), jnp.ones((2, 3, 5), bool))
        with pytest.raises(ValueError, match="last_valid_index: argument `mask`"):
            masked.last_valid_index(jnp.asarray(True))
        with pytest.raises(TypeError, match="first_valid_index: argument `mask`"):
            masked.first_valid_index(jnp.ones(3))
