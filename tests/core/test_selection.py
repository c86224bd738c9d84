"""Tests for jaxrl_llm.core.selection: PODS against brute force, DAPO filter, overlong penalty."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given
from hypothesis import strategies as st

from jaxrl_llm.core import selection
from tests.reference import (
    population_variance,
    ref_dapo_group_filter,
    ref_overlong_reward_penalty,
    ref_pods_best_variance,
)

GROUP = 8  # brute force over all subsets stays cheap for G ≤ 8
PROMPTS = 3
# Every PODS test runs at shape [PROMPTS, GROUP], so compilations are shared (chex's jit variant
# wraps the same function with the same static argument and hits the same cache).
PODS_JIT = jax.jit(selection.pods_max_variance, static_argnames="num_keep")


def pods_padded(reward, member, num_keep):
    """PODS on small hand examples padded with NaN non-members to the shared test shape."""
    reward, member = np.asarray(reward, np.float32), np.asarray(member, bool)
    rows, cols = reward.shape
    padded_r = np.full((PROMPTS, GROUP), np.nan, np.float32)
    padded_m = np.zeros((PROMPTS, GROUP), bool)
    padded_r[:rows, :cols], padded_m[:rows, :cols] = reward, member
    padded_r[~padded_m] = np.nan
    keep = np.asarray(PODS_JIT(jnp.asarray(padded_r), jnp.asarray(padded_m), num_keep=num_keep))
    assert not keep[rows:].any() and not keep[:, cols:].any()
    return keep[:rows, :cols]


@st.composite
def pods_cases(draw):
    """Rewards from a small set (many ties), binary, or continuous; any membership; any m."""
    num_prompts = PROMPTS
    kind = draw(st.sampled_from(["binary", "small_ints", "floats", "offset"]))
    size = num_prompts * GROUP
    if kind == "binary":
        values = draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=size, max_size=size))
    elif kind == "small_ints":
        values = draw(
            st.lists(st.sampled_from([-1.0, 0.0, 0.5, 2.0]), min_size=size, max_size=size)
        )
    else:
        values = draw(st.lists(st.floats(-5, 5, width=32), min_size=size, max_size=size))
    reward = np.array(values, np.float32).reshape(num_prompts, GROUP)
    if kind == "offset":  # large common offset: needs the centring inside the objective
        reward = reward + np.float32(1e5)
    mask = np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size))).reshape(
        reward.shape
    )
    num_keep = draw(st.integers(1, GROUP + 1))
    return reward, mask, num_keep


def check_pods_keep(keep, reward, mask, num_keep):
    keep, reward, mask = np.asarray(keep), np.asarray(reward, np.float64), np.asarray(mask)
    assert keep.dtype == bool and keep.shape == mask.shape
    assert not np.any(keep & ~mask), "kept a non-member"
    best = ref_pods_best_variance(reward, mask, num_keep)
    for b in range(reward.shape[0]):
        n = int(mask[b].sum())
        assert keep[b].sum() == min(num_keep, n)
        if keep[b].any():
            got = population_variance(list(reward[b, keep[b]]))
            np.testing.assert_allclose(got, best[b], rtol=1e-5, atol=1e-6 * max(1.0, best[b]))
        # Tie rule 2: among members with equal rewards, the kept ones are the lowest slots.
        for value in set(reward[b, mask[b]]):
            slots = np.flatnonzero(mask[b] & (reward[b] == value))
            kept = keep[b, slots]
            assert np.all(kept[: kept.sum()]), f"equal rewards {value}: kept {kept}"


class PodsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @given(pods_cases())
    def test_matches_brute_force(self, case):
        reward, mask, num_keep = case
        fn = self.variant(selection.pods_max_variance, static_argnames="num_keep")
        garbage = np.where(mask, reward, np.nan).astype(np.float32)  # padding must not matter
        keep = fn(jnp.asarray(garbage), jnp.asarray(mask), num_keep=num_keep)
        check_pods_keep(keep, reward, mask, num_keep)
        again = fn(jnp.asarray(reward), jnp.asarray(mask), num_keep=num_keep)
        np.testing.assert_array_equal(keep, again)

    @chex.variants(with_jit=True, without_jit=True)
    def test_random_larger_groups(self):
        rng = np.random.default_rng(0)
        fn = self.variant(selection.pods_max_variance, static_argnames="num_keep")
        for num_keep in (2, 3, 5, 2, 3, 5):
            reward = rng.integers(0, 4, (PROMPTS, GROUP)).astype(np.float32) * 0.25
            mask = rng.random((PROMPTS, GROUP)) < 0.8
            keep = fn(jnp.asarray(reward), jnp.asarray(mask), num_keep=num_keep)
            check_pods_keep(keep, reward, mask, num_keep)

    @parameterized.parameters(
        # (rewards, members, m, expected keep): hand-checked.
        ([3, 1, 2, 0, 5, 4], [1, 1, 1, 1, 1, 0], 4, [1, 1, 0, 1, 1, 0]),  # k=2: {5,3} + {0,1}
        ([3, 1, 2, 0, 5, 4], [1, 1, 1, 1, 1, 0], 1, [0, 0, 0, 1, 0, 0]),  # m=1: k=0, the lowest
        ([0, 1, 1, 0, 1, 0], [1] * 6, 3, [1, 1, 0, 1, 0, 0]),  # tie k=1 vs k=2: smallest k
        ([0, 1, 1, 0, 1, 0], [1] * 6, 2, [1, 1, 0, 0, 0, 0]),  # lowest slots per value
        ([1, 0, 1, 1, 0, 0], [1] * 6, 4, [1, 1, 1, 0, 1, 0]),
        ([2, 2, 2, 2], [1, 1, 1, 1], 2, [1, 1, 0, 0]),  # all equal: first slots
        ([2, 2, 2, 2], [0, 1, 0, 1], 1, [0, 1, 0, 0]),
        ([7, 9, 8], [0, 0, 0], 2, [0, 0, 0]),  # empty group keeps nothing
    )
    def test_hand_examples(self, reward, member, num_keep, want):
        keep = pods_padded([reward], [member], num_keep)
        np.testing.assert_array_equal(keep[0], np.array(want, bool))

    def test_keep_all_when_m_at_least_n(self):
        rng = np.random.default_rng(1)
        reward = rng.normal(size=(PROMPTS, GROUP)).astype(np.float32)
        mask = rng.random((PROMPTS, GROUP)) < 0.7
        mask[0, :-1] = True  # n = G - 1 or G
        for num_keep in (GROUP, GROUP + 1, 100):
            keep = PODS_JIT(jnp.asarray(reward), jnp.asarray(mask), num_keep=num_keep)
            np.testing.assert_array_equal(keep, mask)
        full = np.ones((PROMPTS, GROUP), bool)
        keep = PODS_JIT(jnp.asarray(reward), jnp.asarray(full), num_keep=GROUP)
        np.testing.assert_array_equal(keep, full)

    def test_binary_rewards_give_balanced_split(self):
        # Row `ones` has that many correct answers out of G, in a shuffled order.
        rng = np.random.default_rng(0)
        reward = np.stack(
            [rng.permutation([1.0] * b + [0.0] * (GROUP - b)) for b in range(GROUP + 1)]
        )
        for num_keep in range(1, GROUP + 1):
            keep = np.concatenate(
                [
                    pods_padded(reward[i : i + PROMPTS], np.ones((PROMPTS, GROUP)), num_keep)
                    for i in range(0, GROUP + 1, PROMPTS)
                ]
            )
            for ones in range(GROUP + 1):
                kept_ones = int(reward[ones, keep[ones]].sum())
                feasible = range(max(0, num_keep - (GROUP - ones)), min(ones, num_keep) + 1)
                best = min(feasible, key=lambda c: (abs(c - num_keep / 2), c))
                self.assertEqual(kept_ones, best, (ones, num_keep))

    def test_deterministic_and_vmappable(self):
        rng = np.random.default_rng(2)
        reward = jnp.asarray(rng.integers(0, 3, (2, PROMPTS, GROUP)), jnp.float32)
        mask = jnp.asarray(rng.random((2, PROMPTS, GROUP)) < 0.8)
        batched = jax.jit(jax.vmap(functools.partial(selection.pods_max_variance, num_keep=3)))
        first = batched(reward, mask)
        for _ in range(3):
            np.testing.assert_array_equal(batched(reward, mask), first)
        for i in range(2):
            np.testing.assert_array_equal(PODS_JIT(reward[i], mask[i], num_keep=3), first[i])

    def test_bf16_rewards(self):
        reward = np.zeros((PROMPTS, GROUP), np.float32)
        reward[0, :4] = [0.5, 1.0, 0.0, 0.25]
        mask = np.zeros((PROMPTS, GROUP), bool)
        mask[0, :4] = True
        keep = PODS_JIT(jnp.asarray(reward, jnp.bfloat16), jnp.asarray(mask), num_keep=2)
        np.testing.assert_array_equal(keep[0, :4], [False, True, True, False])


class DapoFilterTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_reference(self):
        rng = np.random.default_rng(3)
        fn = self.variant(selection.dapo_group_filter)
        for shape in ((7, 4), (5, 8), (1, 1)):
            reward = rng.integers(0, 2, shape).astype(np.float32)
            mask = rng.random(shape) < 0.6
            mask[0] = False  # an empty group
            got = fn(jnp.asarray(np.where(mask, reward, np.nan)), jnp.asarray(mask))
            np.testing.assert_array_equal(got, ref_dapo_group_filter(reward, mask))

    def test_hand_examples(self):
        reward = jnp.array(
            [[1, 1, 1], [1, 0, 1], [0.1, 0.1, 0.1], [4, 9, 9], [5, 5, 0]], jnp.float32
        )
        mask = jnp.array([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 0, 0], [0, 0, 0]], bool)
        # all-equal dropped; mixed kept; 0.1×3 dropped exactly; singleton kept; empty dropped.
        np.testing.assert_array_equal(
            selection.dapo_group_filter(reward, mask), [False, True, False, True, False]
        )
        # Membership decides: the differing reward sits in a non-member slot.
        np.testing.assert_array_equal(
            selection.dapo_group_filter(jnp.array([[1.0, 1.0, 0.0]]), jnp.array([[1, 1, 0]], bool)),
            [False],
        )


class OverlongPenaltyTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters((True, 1.0), (False, 1.0), (True, 0.5), (False, 2.0))
    def test_matches_reference(self, cap, factor):
        fn = self.variant(
            functools.partial(
                selection.overlong_reward_penalty,
                max_length=100,
                buffer_length=30,
                penalty_factor=factor,
                cap=cap,
            )
        )
        length = np.arange(0, 144, 3).reshape(-1, 2).astype(np.int32)
        want = ref_overlong_reward_penalty(length, 100, 30, factor, cap)
        np.testing.assert_allclose(fn(jnp.asarray(length)), want, atol=1e-6)
        np.testing.assert_allclose(fn(jnp.asarray(length, jnp.float32)), want, atol=1e-6)

    def test_hand_values(self):
        length = jnp.array([[10, 16, 17, 18, 20, 24]])
        capped = selection.overlong_reward_penalty(length, max_length=20, buffer_length=4)
        np.testing.assert_allclose(capped, [[0, 0, -0.25, -0.5, -1.0, -1.0]])
        verl = selection.overlong_reward_penalty(length, max_length=20, buffer_length=4, cap=False)
        np.testing.assert_allclose(verl, [[0, 0, -0.25, -0.5, -1.0, -2.0]])
        self.assertEqual(capped.dtype, jnp.float32)


class BadInputTest(parameterized.TestCase):
    def test_errors_name_the_argument(self):
        reward, mask = jnp.zeros((2, 3)), jnp.ones((2, 3), bool)
        with pytest.raises(ValueError, match="argument `num_keep`"):
            selection.pods_max_variance(reward, mask, num_keep=0)
        with pytest.raises(TypeError, match="argument `num_keep`"):
            selection.pods_max_variance(reward, mask, num_keep=2.0)
        with pytest.raises(AssertionError, match="argument `reward_bg`"):
            selection.pods_max_variance(jnp.zeros(3), mask, num_keep=1)
        with pytest.raises(TypeError, match="argument `reward_bg`"):
            selection.pods_max_variance(jnp.zeros((2, 3), jnp.int32), mask, num_keep=1)
        with pytest.raises(TypeError, match="argument `mask_bg`"):
            selection.dapo_group_filter(reward, jnp.ones((2, 3)))
        with pytest.raises(ValueError, match="argument `mask_bg`"):
            selection.dapo_group_filter(reward, jnp.ones((2, 2), bool))
        with pytest.raises(ValueError, match="argument `buffer_length`"):
            selection.overlong_reward_penalty(jnp.ones(3), max_length=10, buffer_length=11)
        with pytest.raises(ValueError, match="argument `max_length`"):
            selection.overlong_reward_penalty(jnp.ones(3), max_length=0, buffer_length=1)
        with pytest.raises(ValueError, match="argument `penalty_factor`"):
            selection.overlong_reward_penalty(
                jnp.ones(3), max_length=10, buffer_length=2, penalty_factor=-1.0
            )
        with pytest.raises(TypeError, match="argument `length_bg`"):
            selection.overlong_reward_penalty(jnp.ones(3, bool), max_length=10, buffer_length=2)
