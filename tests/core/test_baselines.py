"""Tests for jaxrl_llm.core.baselines against the loop references in tests/reference.py."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from jaxrl_llm.core import baselines
from tests.reference import (
    ref_group_count,
    ref_group_mean_baseline,
    ref_leave_one_out_baseline,
    ref_length_weighted_baseline,
)

ATOL = 1e-5


def random_groups(seed, num_prompts=5, group_size=6, garbage=np.nan):
    """Scores and a membership mask with groups of every size 0..G; garbage under the mask."""
    rng = np.random.default_rng(seed)
    score = rng.normal(2.0, 3.0, (num_prompts, group_size)).astype(np.float32)
    mask = np.zeros((num_prompts, group_size), bool)
    for b in range(num_prompts):
        n = b % (group_size + 1) if b < group_size + 1 else rng.integers(0, group_size + 1)
        mask[b, rng.choice(group_size, size=n, replace=False)] = True
    score[~mask] = garbage
    return score, mask


SHAPES = ((5, 6), (9, 4), (3, 8), (1, 1))
SINGLETONS = (None, 0.0, -2.5)


class GroupBaselinesTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*SINGLETONS)
    def test_group_mean_matches_reference(self, singleton_baseline):
        fn = self.variant(
            functools.partial(baselines.group_mean_baseline, singleton_baseline=singleton_baseline)
        )
        for seed, shape in enumerate(SHAPES):
            score, mask = random_groups(seed, *shape)
            got = fn(jnp.asarray(score), jnp.asarray(mask))
            want = ref_group_mean_baseline(score, mask, singleton_baseline)
            np.testing.assert_allclose(got, want, atol=ATOL, rtol=1e-5)
            self.assertEqual(got.dtype, jnp.float32)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*SINGLETONS)
    def test_leave_one_out_matches_reference(self, singleton_baseline):
        fn = self.variant(
            functools.partial(
                baselines.leave_one_out_baseline, singleton_baseline=singleton_baseline
            )
        )
        for seed, shape in enumerate(SHAPES):
            score, mask = random_groups(seed + 10, *shape)
            got = fn(jnp.asarray(score), jnp.asarray(mask))
            want = ref_leave_one_out_baseline(score, mask, singleton_baseline)
            np.testing.assert_allclose(got, want, atol=ATOL, rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((None, np.int32), (0.0, np.int32), (None, np.float32))
    def test_length_weighted_matches_reference(self, singleton_baseline, length_dtype):
        fn = self.variant(
            functools.partial(
                baselines.length_weighted_baseline, singleton_baseline=singleton_baseline
            )
        )
        for seed, shape in enumerate(SHAPES):
            score, mask = random_groups(seed + 20, *shape)
            rng = np.random.default_rng(seed)
            length = rng.integers(0, 50, shape).astype(length_dtype)
            length[0] = 0  # a group whose lengths are all 0 falls back to the plain mean
            got = fn(jnp.asarray(score), jnp.asarray(length), jnp.asarray(mask))
            want = ref_length_weighted_baseline(score, length, mask, singleton_baseline)
            np.testing.assert_allclose(got, want, atol=ATOL, rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_given_and_critic_baselines(self):
        score, mask = random_groups(3)
        baseline_b = np.arange(5, dtype=np.float32) - 2.0
        got = self.variant(baselines.given_baseline)(score, baseline_b, mask)
        np.testing.assert_array_equal(got, np.where(mask, baseline_b[:, None], 0.0))

        value = np.random.default_rng(0).normal(size=(2, 3, 7)).astype(np.float32)
        token_mask = np.random.default_rng(1).random((2, 3, 7)) < 0.6
        value[~token_mask] = -np.inf
        got = self.variant(baselines.critic_baseline)(value, token_mask)
        np.testing.assert_array_equal(got, np.where(token_mask, value, 0.0))

    @chex.variants(with_jit=True, without_jit=True)
    def test_group_count(self):
        _, mask = random_groups(4, 9, 5)
        np.testing.assert_array_equal(
            self.variant(baselines.group_count)(mask), ref_group_count(mask)
        )


class HandComputedTest(parameterized.TestCase):
    def test_seed_example(self):
        # One prompt, scores 8.2 / 6.5 / 9.1 (the seed document's example).
        score = jnp.array([[8.2, 6.5, 9.1]])
        mask = jnp.ones((1, 3), bool)
        loo = baselines.leave_one_out_baseline(score, mask)
        np.testing.assert_allclose(loo, [[7.8, 8.65, 7.35]], atol=1e-5)
        np.testing.assert_allclose(score - loo, [[0.4, -2.15, 1.75]], atol=1e-5)
        mean = baselines.group_mean_baseline(score, mask)
        np.testing.assert_allclose(mean, np.full((1, 3), 23.8 / 3), atol=1e-5)
        np.testing.assert_allclose(mean[0, 0], 7.9333, atol=1e-4)

    def test_leave_one_out_is_rescaled_group_mean_advantage(self):
        score, mask = random_groups(5, 8, 6, garbage=0.0)
        n = mask.sum(-1, keepdims=True)
        a_loo = score - baselines.leave_one_out_baseline(score, mask)
        a_mean = score - baselines.group_mean_baseline(score, mask)
        many = (n >= 2) & mask
        want = np.where(many, n / np.maximum(n - 1, 1) * a_mean, 0.0)
        np.testing.assert_allclose(np.where(many, a_loo, 0.0), want, atol=1e-4)

    def test_opo_weights_by_length(self):
        score = jnp.array([[1.0, 0.0, 0.0, 5.0]])
        length = jnp.array([[3, 1, 0, 100]])
        mask = jnp.array([[True, True, True, False]])
        got = baselines.length_weighted_baseline(score, length, mask)
        np.testing.assert_allclose(got, [[0.75, 0.75, 0.75, 0.0]], atol=1e-6)

    @parameterized.parameters(
        baselines.group_mean_baseline,
        baselines.leave_one_out_baseline,
        functools.partial(baselines.length_weighted_baseline, length_bg=jnp.full((3, 4), 7)),
    )
    def test_singleton_and_empty_rules(self, fn):
        score = jnp.array([[3.0, 1.0, 2.0, 4.0], [3.0, 1.0, 2.0, 4.0], [3.0, 1.0, 2.0, 4.0]])
        mask = jnp.array([[False, True, False, False], [False] * 4, [True] * 4])
        own = fn(score, mask_bg=mask)
        self.assertEqual(own[0, 1], 1.0)  # advantage 0
        np.testing.assert_array_equal(own[1], 0.0)  # empty group: zeros
        np.testing.assert_array_equal(own[0, [0, 2, 3]], 0.0)
        const = fn(score, mask_bg=mask, singleton_baseline=0.5)
        self.assertEqual(const[0, 1], 0.5)
        np.testing.assert_array_equal(const[2], own[2])  # bigger groups unaffected
        self.assertTrue(np.all(np.isfinite(own)) and np.all(np.isfinite(const)))


class PropertiesTest(parameterized.TestCase):
    @parameterized.parameters(
        baselines.group_mean_baseline,
        baselines.leave_one_out_baseline,
        functools.partial(
            baselines.length_weighted_baseline, length_bg=jnp.arange(30).reshape(5, 6)
        ),
    )
    def test_padding_values_do_not_matter(self, fn):
        score, mask = random_groups(7, garbage=0.0)
        want = fn(jnp.asarray(score), mask_bg=jnp.asarray(mask))
        for garbage in (np.nan, np.inf, -np.inf, 1e30):
            bad = np.where(mask, score, garbage).astype(np.float32)
            np.testing.assert_array_equal(fn(jnp.asarray(bad), mask_bg=jnp.asarray(mask)), want)

    @parameterized.parameters(baselines.group_mean_baseline, baselines.leave_one_out_baseline)
    def test_extra_padding_changes_nothing(self, fn):
        score, mask = random_groups(8)
        want = fn(jnp.asarray(score), jnp.asarray(mask))
        padded_score = np.pad(score, ((0, 2), (0, 3)), constant_values=np.nan)
        padded_mask = np.pad(mask, ((0, 2), (0, 3)))
        got = fn(jnp.asarray(padded_score), jnp.asarray(padded_mask))
        np.testing.assert_allclose(got[:5, :6], want, atol=1e-6)
        np.testing.assert_array_equal(got[5:], 0.0)
        np.testing.assert_array_equal(got[:, 6:], 0.0)

    def test_bf16_scores_give_finite_f32(self):
        score, mask = random_groups(9, garbage=0.0)
        score_bf16 = jnp.asarray(score, jnp.bfloat16)
        for fn in (baselines.group_mean_baseline, baselines.leave_one_out_baseline):
            got = fn(score_bf16, jnp.asarray(mask))
            self.assertEqual(got.dtype, jnp.float32)
            self.assertTrue(np.all(np.isfinite(got)))
            want = fn(jnp.asarray(score_bf16, jnp.float32), jnp.asarray(mask))
            np.testing.assert_allclose(got, want, atol=1e-6)

    def test_vmap_over_extra_axis(self):
        score, mask = random_groups(10, 5, 6, garbage=0.0)
        stacked_s, stacked_m = np.stack([score, score[::-1]]), np.stack([mask, mask[::-1]])
        got = jax.vmap(baselines.leave_one_out_baseline)(stacked_s, stacked_m)
        np.testing.assert_allclose(
            got[1], baselines.leave_one_out_baseline(score[::-1], mask[::-1])
        )


class BadInputTest(parameterized.TestCase):
    def test_errors_name_the_argument(self):
        score, mask = jnp.zeros((2, 3)), jnp.ones((2, 3), bool)
        with pytest.raises(AssertionError, match="argument `score_bg`"):
            baselines.group_mean_baseline(jnp.zeros((2, 3, 4)), mask)
        with pytest.raises(TypeError, match="argument `score_bg`"):
            baselines.leave_one_out_baseline(jnp.zeros((2, 3), jnp.int32), mask)
        with pytest.raises(TypeError, match="argument `mask_bg`"):
            baselines.group_mean_baseline(score, jnp.ones((2, 3)))
        with pytest.raises(ValueError, match="argument `mask_bg`"):
            baselines.group_mean_baseline(score, jnp.ones((2, 4), bool))
        with pytest.raises(TypeError, match="argument `singleton_baseline`"):
            baselines.group_mean_baseline(score, mask, singleton_baseline="zero")
        with pytest.raises(ValueError, match="argument `length_bg`"):
            baselines.length_weighted_baseline(score, jnp.ones((2, 4)), mask)
        with pytest.raises(TypeError, match="argument `length_bg`"):
            baselines.length_weighted_baseline(score, jnp.ones((2, 3), bool), mask)
        with pytest.raises(ValueError, match="argument `baseline_b`"):
            baselines.given_baseline(score, jnp.zeros(3), mask)
        with pytest.raises(AssertionError, match="argument `baseline_b`"):
            baselines.given_baseline(score, jnp.zeros((2, 1)), mask)
        with pytest.raises(ValueError, match="argument `mask_bgt`"):
            baselines.critic_baseline(jnp.zeros((2, 3, 4)), jnp.ones((2, 3, 5), bool))
        with pytest.raises(TypeError, match="argument `value_bgt`"):
            baselines.critic_baseline(jnp.zeros((2, 3, 4), jnp.int32), jnp.ones((2, 3, 4), bool))
        with pytest.raises(AssertionError, match="argument `mask_bg`"):
            baselines.group_count(jnp.ones((2, 3, 1), bool))
