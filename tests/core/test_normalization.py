"""Tests for jaxrl_llm.core.normalization against the loop references in tests/reference.py."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from jax.sharding import PartitionSpec as P

from jaxrl_llm.core import baselines, normalization
from tests.core.test_baselines import random_groups
from tests.reference import (
    ref_group_std,
    ref_scale_by_batch_std,
    ref_scale_by_group_std,
    ref_whiten,
)

SHAPES = ((5, 6), (9, 4), (3, 8), (1, 1))


def grpo_advantage(score_bg, mask_bg, **kw):
    """GRPO's advantage as the two chain steps: centre by the group mean, scale by the std."""
    adv_bg = score_bg - baselines.group_mean_baseline(score_bg, mask_bg)
    return normalization.scale_by_group_std(adv_bg, score_bg, mask_bg, **kw)


class AgainstReferenceTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(0, 1, 2)
    def test_group_std(self, ddof):
        fn = self.variant(functools.partial(normalization.group_std, ddof=ddof))
        for seed, shape in enumerate(SHAPES):
            score, mask = random_groups(seed, *shape)
            got = fn(jnp.asarray(score), jnp.asarray(mask))
            np.testing.assert_allclose(got, ref_group_std(score, mask, ddof), atol=1e-5, rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((0, 1e-6, 1.0, 0), (1, 1e-4, 1.0, 3), (1, 0.0, 2.0, 3))
    def test_scale_by_group_std(self, ddof, eps, singleton_std, num_tokens):
        fn = self.variant(
            functools.partial(
                normalization.scale_by_group_std, ddof=ddof, eps=eps, singleton_std=singleton_std
            )
        )
        for seed, shape in enumerate(SHAPES):
            score, mask = random_groups(seed + 30, *shape)
            x_shape = shape + ((num_tokens,) if num_tokens else ())
            x = np.random.default_rng(seed).normal(size=x_shape).astype(np.float32)
            got = fn(jnp.asarray(x), jnp.asarray(score), jnp.asarray(mask))
            want = ref_scale_by_group_std(x, score, mask, ddof, eps, singleton_std)
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((0, 1e-6, 0), (1, 1e-4, 4))
    def test_scale_by_batch_std(self, ddof, eps, num_tokens):
        fn = self.variant(functools.partial(normalization.scale_by_batch_std, ddof=ddof, eps=eps))
        for seed, shape in enumerate(SHAPES):
            score, mask = random_groups(seed + 40, *shape)
            x_shape = shape + ((num_tokens,) if num_tokens else ())
            x = np.random.default_rng(seed).normal(size=x_shape).astype(np.float32)
            got = fn(jnp.asarray(x), jnp.asarray(score), jnp.asarray(mask))
            want = ref_scale_by_batch_std(x, score, mask, ddof, eps)
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(
        dict(ddof=1, eps=1e-8, eps_as_floor=False, shift_mean=True),  # verl
        dict(ddof=0, eps=1e-8, eps_as_floor=True, shift_mean=True),  # OpenRLHF
        dict(ddof=0, eps=1e-3, eps_as_floor=False, shift_mean=False),
    )
    def test_batch_whiten(self, **kw):
        fn = self.variant(functools.partial(normalization.batch_whiten, **kw))
        rng = np.random.default_rng(0)
        for shape in ((2, 3, 5), (4, 1, 7), (1, 1, 1)):
            adv = rng.normal(1.0, 2.0, shape).astype(np.float32)
            mask = rng.random(shape) < 0.7
            adv[~mask] = np.nan
            got = fn(jnp.asarray(adv), jnp.asarray(mask))
            np.testing.assert_allclose(got, ref_whiten(adv, mask, **kw), atol=1e-4, rtol=1e-4)


class GoldenValuesTest(parameterized.TestCase):
    def test_seed_example_std(self):
        score = jnp.array([[8.2, 6.5, 9.1]])
        mask = jnp.ones((1, 3), bool)
        np.testing.assert_allclose(normalization.group_std(score, mask), [1.0780641], rtol=1e-5)
        np.testing.assert_allclose(
            normalization.group_std(score, mask, ddof=1), [1.3203535], rtol=1e-5
        )

    @parameterized.parameters(
        # docs/numerics.md, group normalisation: OpenRLHF eps 1e-9, verl 1e-6, ddof 0 to compare.
        ([1.0, 0.0, 0.0, 1.0], 1, 1e-9, [0.866025, -0.866025, -0.866025, 0.866025]),
        ([1.0, 0.0, 0.0, 1.0], 1, 1e-6, [0.866024, -0.866024, -0.866024, 0.866024]),
        ([1.0, 0.0, 0.0, 1.0], 0, 1e-9, [1.0, -1.0, -1.0, 1.0]),
        ([1.0, 1.0, 1.0, 0.0], 1, 1e-9, [0.5, 0.5, 0.5, -1.5]),
        ([1.0, 1.0, 1.0, 0.0], 0, 1e-9, [0.57735, 0.57735, 0.57735, -1.732051]),
    )
    def test_grpo_golden(self, rewards, ddof, eps, want):
        score = jnp.array([rewards])
        got = grpo_advantage(score, jnp.ones((1, 4), bool), ddof=ddof, eps=eps)
        np.testing.assert_allclose(got[0], want, atol=2e-6)

    def test_verl_singleton_rule(self):
        # verl: singleton mean 0, std 1 → A = s / (1 + 1e-6).
        score, mask = jnp.array([[3.0, 7.0]]), jnp.array([[True, False]])
        adv = score - baselines.group_mean_baseline(score, mask, singleton_baseline=0.0)
        got = normalization.scale_by_group_std(adv, score, mask, ddof=1, eps=1e-6)
        np.testing.assert_allclose(got, [[3.0 / (1 + 1e-6), 0.0]], rtol=1e-7)


class PropertiesTest(parameterized.TestCase):
    @parameterized.parameters((0, 1e-9), (1, 1e-9), (1, 0.0))
    def test_shift_and_positive_scale_invariance(self, ddof, eps):
        score, mask = random_groups(11, 7, 6, garbage=0.0)
        score, mask = jnp.asarray(score), jnp.asarray(mask)
        want = grpo_advantage(score, mask, ddof=ddof, eps=eps)
        rng = np.random.default_rng(0)
        shift = jnp.asarray(rng.normal(0, 10, (7, 1)), jnp.float32)
        scale = jnp.asarray(rng.uniform(0.1, 20, (7, 1)), jnp.float32)
        many = jnp.sum(mask, -1, keepdims=True) >= 2  # singletons are not scale-invariant
        np.testing.assert_allclose(
            grpo_advantage(score + shift, mask, ddof=ddof, eps=eps), want, atol=1e-4
        )
        scaled = grpo_advantage(score * scale, mask, ddof=ddof, eps=eps)
        np.testing.assert_allclose(jnp.where(many, scaled, 0), jnp.where(many, want, 0), atol=1e-4)

    @parameterized.parameters(0.0, 1e-6)
    def test_all_equal_group_gives_finite_zero(self, eps):
        score = jnp.array([[0.1, 0.1, 0.1, 5.0], [2.0, 2.0, 2.0, 2.0]])
        mask = jnp.array([[True, True, True, False], [True] * 4])
        for ddof in (0, 1):
            got = grpo_advantage(score, mask, ddof=ddof, eps=eps)
            np.testing.assert_array_equal(got, 0.0)
            std = functools.partial(normalization.group_std, mask_bg=mask, ddof=ddof)
            grad = jax.grad(lambda s, std=std: jnp.sum(std(s)))(score)
            self.assertTrue(np.all(np.isfinite(grad)))

    def test_padding_values_do_not_matter(self):
        score, mask = random_groups(12, garbage=0.0)
        x = np.random.default_rng(1).normal(size=score.shape).astype(np.float32)
        fns = (
            functools.partial(normalization.scale_by_group_std, ddof=1),
            functools.partial(normalization.scale_by_batch_std, ddof=1),
        )
        for fn in fns:
            want = fn(jnp.asarray(x), jnp.asarray(score), jnp.asarray(mask))
            for garbage in (np.nan, np.inf, 1e30):
                bad_s = np.where(mask, score, garbage).astype(np.float32)
                bad_x = np.where(mask, x, garbage).astype(np.float32)
                got = fn(jnp.asarray(bad_x), jnp.asarray(bad_s), jnp.asarray(mask))
                np.testing.assert_array_equal(got, want)
        want = normalization.group_std(jnp.asarray(score), jnp.asarray(mask))
        bad = jnp.asarray(np.where(mask, score, np.nan).astype(np.float32))
        np.testing.assert_array_equal(normalization.group_std(bad, jnp.asarray(mask)), want)

    def test_extra_padding_changes_nothing(self):
        score, mask = random_groups(13)
        want = grpo_advantage(jnp.asarray(score), jnp.asarray(mask), ddof=1)
        got = grpo_advantage(
            jnp.asarray(np.pad(score, ((0, 2), (0, 3)), constant_values=np.nan)),
            jnp.asarray(np.pad(mask, ((0, 2), (0, 3)))),
            ddof=1,
        )
        np.testing.assert_allclose(got[:5, :6], want, atol=1e-6)
        self.assertEqual(
            float(jnp.sum(jnp.abs(got[5:]))) + float(jnp.sum(jnp.abs(got[:, 6:]))), 0.0
        )

    def test_bf16_inputs_give_finite_f32(self):
        score, mask = random_groups(14, garbage=0.0)
        s16 = jnp.asarray(score, jnp.bfloat16)
        x16 = jnp.asarray(np.ones((5, 6, 3)), jnp.bfloat16)
        for got in (
            normalization.scale_by_group_std(x16, s16, jnp.asarray(mask)),
            normalization.scale_by_batch_std(x16, s16, jnp.asarray(mask)),
            normalization.batch_whiten(
                x16 * s16[..., None], jnp.asarray(mask)[..., None] & (x16 > 0)
            ),
        ):
            self.assertEqual(got.dtype, jnp.float32)
            self.assertTrue(np.all(np.isfinite(got)))

    def test_bgt_broadcast_matches_bg(self):
        score, mask = random_groups(15, garbage=0.0)
        x_bg = jnp.asarray(score)
        x_bgt = jnp.repeat(x_bg[..., None], 4, axis=-1)
        for fn in (normalization.scale_by_group_std, normalization.scale_by_batch_std):
            got_bgt = fn(x_bgt, x_bg, jnp.asarray(mask), ddof=1)
            got_bg = fn(x_bg, x_bg, jnp.asarray(mask), ddof=1)
            np.testing.assert_array_equal(got_bgt, jnp.repeat(got_bg[..., None], 4, axis=-1))

    def test_empty_batch_gives_zeros(self):
        x, mask = jnp.ones((2, 3, 4)), jnp.zeros((2, 3, 4), bool)
        np.testing.assert_array_equal(normalization.batch_whiten(x, mask, ddof=1), 0.0)
        got = normalization.scale_by_batch_std(x[..., 0], x[..., 0], mask[..., 0], ddof=1, eps=0.0)
        np.testing.assert_array_equal(got, 0.0)


class ShardedTest(parameterized.TestCase):
    def test_axis_name_gives_global_statistics(self):
        mesh = jax.make_mesh((8,), ("data",))
        rng = np.random.default_rng(0)
        adv = jnp.asarray(rng.normal(size=(16, 2, 5)), jnp.float32)
        mask = jnp.asarray(rng.random((16, 2, 5)) < 0.6)
        put = lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
        adv, mask = put(adv), put(mask)
        score, mask_bg = put(adv[..., 0]), put(mask[..., 0])

        def sharded(fn, n_in):
            return jax.jit(
                jax.shard_map(fn, mesh=mesh, in_specs=(P("data"),) * n_in, out_specs=P("data"))
            )

        whiten = functools.partial(normalization.batch_whiten, ddof=1)
        got = sharded(functools.partial(whiten, axis_name="data"), 2)(adv, mask)
        np.testing.assert_allclose(got, whiten(adv, mask), atol=1e-5)
        scale = functools.partial(normalization.scale_by_batch_std, ddof=1)
        got = sharded(functools.partial(scale, axis_name="data"), 3)(adv, score, mask_bg)
        np.testing.assert_allclose(got, scale(adv, score, mask_bg), atol=1e-5)
        # Without axis_name each shard would use its own statistics: the test can fail.
        local = sharded(whiten, 2)(adv, mask)
        self.assertGreater(float(jnp.max(jnp.abs(local - whiten(adv, mask)))), 1e-3)


class BadInputTest(parameterized.TestCase):
    def test_errors_name_the_argument(self):
        score, mask = jnp.zeros((2, 3)), jnp.ones((2, 3), bool)
        with pytest.raises(AssertionError, match="argument `score_bg`"):
            normalization.group_std(jnp.zeros(3), mask)
        with pytest.raises(TypeError, match="argument `mask_bg`"):
            normalization.group_std(score, jnp.ones((2, 3), jnp.int32))
        with pytest.raises(ValueError, match="argument `ddof`"):
            normalization.group_std(score, mask, ddof=-1)
        with pytest.raises(TypeError, match="argument `ddof`"):
            normalization.group_std(score, mask, ddof=1.0)
        with pytest.raises(ValueError, match="argument `x`"):
            normalization.scale_by_group_std(jnp.zeros((2, 4)), score, mask)
        with pytest.raises(ValueError, match="argument `x`"):
            normalization.scale_by_group_std(jnp.zeros(2), score, mask)
        with pytest.raises(TypeError, match="argument `x`"):
            normalization.scale_by_batch_std(jnp.zeros((2, 3), jnp.int32), score, mask)
        with pytest.raises(ValueError, match="argument `eps`"):
            normalization.scale_by_group_std(score, score, mask, eps=-1e-6)
        with pytest.raises(ValueError, match="argument `singleton_std`"):
            normalization.scale_by_group_std(score, score, mask, singleton_std=0.0)
        with pytest.raises(ValueError, match="argument `mask_bgt`"):
            normalization.batch_whiten(jnp.zeros((2, 3, 4)), jnp.ones((2, 3, 5), bool))
        with pytest.raises(TypeError, match="argument `adv_bgt`"):
            normalization.batch_whiten(jnp.zeros((2, 3), jnp.int32), mask)
        with pytest.raises(ValueError, match="argument `eps`"):
            normalization.batch_whiten(score, mask, eps=0.0)
