"""Recipes against loop references, the seed's worked example, failure cases and identities."""

from __future__ import annotations

import dataclasses
import functools
import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jaxrl_llm as jrl
from jaxrl_llm import algorithms as alg
from jaxrl_llm import chain as ch
from jaxrl_llm import numerics as nm
from jaxrl_llm import recipe as rc
from tests.reference import reference_advantages

PRESETS = ("default", "verl", "trl", "openrlhf")
KL_IN_REWARD = ("reinforce", "ppo", "rloo", "reinforce_pp")
# The loss family (issue 17) changes the loss, not GRPO's advantage: the loop reference of
# GRPO checks their chains. GPG, OPO and ReMax have their own estimators, checked against verl's
# own functions in tests/core/test_loss_family.py.
REFERENCE_AS = {
    n: "grpo"
    for n in ("cispo", "sapo", "gmpo", "clip_cov", "kl_cov", "dppo", "dro", "luspo", "vespo")
}
OWN_ESTIMATOR = ("gpg", "opo", "remax")
LOOP_RECIPES = tuple(n for n in alg.ONLINE_RECIPES if n not in (*OWN_ESTIMATOR, *REFERENCE_AS))
GROUP_CENTRED = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "dapo", "gspo", "gpg", "opo")


def get(name: str, **hp):
    """``alg.get`` with the hyperparameters the recipe takes (GPG and OPO have no β)."""
    params = rc.hparam_defaults(alg.RECIPES[name])
    return alg.get(name, **{k: v for k, v in hp.items() if k in params})


def random_rollout(seed: int, b: int, g: int, t: int, *, ragged_groups: bool = True):
    """Random rewards, ragged completion lengths (some empty), variable group membership, and
    every optional field, with garbage under the masks."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, t + 1, size=(b, g))
    mask_bgt = np.arange(t)[None, None, :] < lengths[..., None]
    # a multi-turn observation span inside some completions
    span = rng.random((b, g)) < 0.3
    mask_bgt[span, t // 3 : t // 3 + 1] = False
    mask_bg = rng.random((b, g)) < 0.8 if ragged_groups else np.ones((b, g), bool)
    mask_bg[:, 0] = True
    reward_bg = rng.normal(size=(b, g)).astype(np.float32) * 2.0
    reward_bg[rng.random((b, g)) < 0.2] = 1.0  # ties
    noise = lambda: rng.normal(size=(b, g, t)).astype(np.float32)
    logp_old = -np.abs(noise())
    logp_ref = logp_old + 0.3 * noise()
    return jrl.Rollout(
        reward_bg=jnp.asarray(reward_bg),
        mask_bgt=jnp.asarray(mask_bgt),
        mask_bg=jnp.asarray(mask_bg),
        logp_old_bgt=jnp.asarray(logp_old),
        logp_ref_bgt=jnp.asarray(logp_ref),
        value_bgt=jnp.asarray(noise()),
        baseline_b=jnp.asarray(rng.normal(size=b).astype(np.float32)),
    )


def loop_numerics(preset: str) -> nm.Numerics:
    """The preset with the seeds' chain order, which the loop reference implements: OpenRLHF's
    own order (holes as steps, shaping after the baseline, KL in the reward of the group
    recipes) is checked against OpenRLHF's code itself in tests/test_numerics.py."""
    return dataclasses.replace(
        nm.resolve(preset),
        skip_masked_tokens=True,
        shaping_after_baseline=False,
        group_kl_in_reward=False,
    )


def recipe_and_hparams(name: str, preset: str):
    hp = {"numerics": loop_numerics(preset)}
    if name in KL_IN_REWARD:
        hp["beta"] = 0.1
    recipe = alg.get(name, **hp)
    ref_hp = dict(recipe.hparams)
    return recipe, ref_hp


class RecipesMatchLoopReferences(parameterized.TestCase):
    @parameterized.product(name=LOOP_RECIPES, preset=PRESETS)
    def test_matches_reference(self, name, preset):
        self._check(name, preset, (3, 6, 7), jax.jit)

    @parameterized.product(name=tuple(REFERENCE_AS), preset=("default", "verl"))
    def test_loss_family_chains_match_grpo_reference(self, name, preset):
        self._check(name, preset, (3, 6, 7), jax.jit)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(name=LOOP_RECIPES, shape=((1, 1, 5), (2, 3, 1)))
    def test_matches_reference_on_tiny_shapes(self, name, shape):
        self._check(name, "default", shape, self.variant)

    def _check(self, name, preset, shape, variant):
        recipe, ref_hp = recipe_and_hparams(name, preset)
        rollout = random_rollout(zlib.crc32(repr((name, preset, shape)).encode()), *shape)

        @variant
        def run(rollout):
            return ch.apply(recipe.advantage, rollout)[0]

        got = run(rollout)
        want = reference_advantages(
            REFERENCE_AS.get(name, name), rollout, loop_numerics(preset), **ref_hp
        )
        chex.assert_type(got, jnp.float32)
        # atol: whitening a near-constant signal multiplies f32 rounding by rsqrt(eps) = 1e4
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=1e-3)


class SeedWorkedExample(parameterized.TestCase):
    """Seed 000: one prompt, three answers scored 8.2 / 6.5 / 9.1."""

    rollout = jrl.Rollout(
        reward_bg=jnp.array([[8.2, 6.5, 9.1]]), mask_bgt=jnp.ones((1, 3, 5), bool)
    )

    def test_rloo(self):
        from jaxrl_llm.core import baselines

        base = baselines.leave_one_out_baseline(self.rollout.reward_bg, jnp.ones((1, 3), bool))
        np.testing.assert_allclose(base[0, 0], 7.8, atol=1e-5)  # (6.5 + 9.1) / 2
        adv = jrl.compute_advantages(alg.rloo(beta=0.0), self.rollout)[0, :, 0]
        np.testing.assert_allclose(adv[0], 0.4, atol=1e-5)
        np.testing.assert_allclose(adv[1], -2.15, atol=1e-5)
        assert int(jnp.argmax(adv)) == 2  # C gets the largest
        # every token of an answer carries the same advantage
        full = jrl.compute_advantages(alg.rloo(beta=0.0), self.rollout)
        np.testing.assert_allclose(full, jnp.broadcast_to(full[..., :1], full.shape))

    def test_grpo_population_std_gives_the_seeds_numbers(self):
        scores = np.array([8.2, 6.5, 9.1])
        assert scores.mean() == pytest.approx(7.9333, abs=1e-4)
        # the seed's 1.07 is the population std (ddof = 0): 1.078; ddof = 1 would give 1.320
        assert np.std(scores, ddof=0) == pytest.approx(1.078, abs=1e-3)
        assert np.std(scores, ddof=1) == pytest.approx(1.320, abs=1e-3)
        adv = jrl.compute_advantages(alg.grpo(), self.rollout)[0, :, 0]
        np.testing.assert_allclose(adv, (scores - 7.93333) / (1.07806 + 1e-6), atol=1e-4)
        adv_verl = jrl.compute_advantages(alg.grpo(numerics="verl"), self.rollout)[0, :, 0]
        np.testing.assert_allclose(adv_verl, (scores - 7.93333) / (1.32035 + 1e-6), atol=1e-4)


class FailureCases(parameterized.TestCase):
    @parameterized.product(name=alg.ONLINE_RECIPES, preset=PRESETS)
    def test_easy_prompt_all_answers_right(self, name, preset):
        """Every answer right: std = 0. Advantages must be zero and finite, never NaN/inf."""
        recipe = get(name, numerics=preset, beta=0.0)
        rollout = jrl.Rollout(
            reward_bg=jnp.ones((2, 4)),
            mask_bgt=jnp.ones((2, 4, 6), bool),
            value_bgt=jnp.ones((2, 4, 6)),
            baseline_b=jnp.ones((2,)),  # ReMax: the greedy answer is right too
        )
        adv = jrl.compute_advantages(recipe, rollout)
        assert bool(jnp.all(jnp.isfinite(adv)))
        if name in (*GROUP_CENTRED, *REFERENCE_AS, "remax"):
            np.testing.assert_allclose(adv, 0.0, atol=1e-6)

    @parameterized.product(name=("grpo", "rloo", "dr_grpo", "dapo", "gspo"), preset=PRESETS)
    def test_singleton_group_follows_the_documented_rule(self, name, preset):
        n = nm.resolve(preset)
        recipe = alg.get(name, numerics=preset, beta=0.0)
        rollout = jrl.Rollout(
            reward_bg=jnp.array([[3.0, 0.0, 0.0], [1.0, 2.0, 4.0]]),
            mask_bgt=jnp.ones((2, 3, 4), bool),
            mask_bg=jnp.array([[True, False, False], [True, True, True]]),
        )
        adv = jrl.compute_advantages(recipe, rollout)
        assert bool(jnp.all(jnp.isfinite(adv)))
        singleton = n.loo_singleton_baseline if name == "rloo" else n.group_singleton_baseline
        if singleton is None:
            expected = 0.0
        else:
            expected = 3.0 - singleton
            if name in ("grpo", "dapo", "gspo"):
                expected /= n.singleton_std + n.group_std_eps
        np.testing.assert_allclose(adv[0, 0], expected, rtol=1e-5)
        np.testing.assert_array_equal(adv[0, 1:], 0.0)  # non-members get nothing

    def test_dpo_has_no_advantage(self):
        with pytest.raises(ValueError, match="preference"):
            jrl.compute_advantages(alg.dpo(), SeedWorkedExample.rollout)


class ReducesTo(parameterized.TestCase):
    def test_rloo_is_scaled_centering(self):
        rollout = random_rollout(0, 3, 5, 4, ragged_groups=False)
        rollout = rollout._replace(mask_bgt=jnp.ones_like(rollout.mask_bgt))
        adv = jrl.compute_advantages(alg.rloo(beta=0.0), rollout)[..., 0]
        r = rollout.reward_bg
        np.testing.assert_allclose(adv, 5 / 4 * (r - r.mean(-1, keepdims=True)), atol=1e-5)

    def test_dr_grpo_equals_grpo_when_group_std_is_one(self):
        # population std of (x - 1, x + 1) is exactly 1 in each group
        centre = jnp.array([[0.3], [-2.0], [5.0]])
        rollout = jrl.Rollout(
            reward_bg=centre + jnp.array([[-1.0, 1.0]]), mask_bgt=jnp.ones((3, 2, 4), bool)
        )
        grpo = jrl.compute_advantages(alg.grpo(), rollout)
        dr = jrl.compute_advantages(alg.dr_grpo(), rollout)
        np.testing.assert_allclose(grpo, dr, atol=1e-5)

    def test_gae_lambda_one_zero_values_is_discounted_return(self):
        rollout = random_rollout(1, 2, 3, 6)
        rollout = rollout._replace(value_bgt=jnp.zeros_like(rollout.value_bgt))
        gae_adv, _ = ch.apply(ch.gae(gamma=0.9, lam=1.0), rollout)
        ret, _ = ch.apply(ch.discounted_return(0.9), rollout)
        np.testing.assert_allclose(gae_adv, ret, atol=1e-5)

    def test_pods_keeping_all_changes_nothing(self):
        rollout = random_rollout(2, 3, 4, 5, ragged_groups=False)
        kept = jrl.select(alg.grpo(pods_num_keep=4), rollout)
        np.testing.assert_array_equal(kept.mask_bg, rollout.mask_bg)
        np.testing.assert_allclose(
            jrl.compute_advantages(alg.grpo(pods_num_keep=4), kept),
            jrl.compute_advantages(alg.grpo(), rollout),
        )

    def test_pods_then_grpo_uses_only_the_kept_answers(self):
        rollout = jrl.Rollout(
            reward_bg=jnp.array([[0.0, 1.0, 0.2, 0.9, 0.5, 0.6]]),
            mask_bgt=jnp.ones((1, 6, 2), bool),
        )
        kept = jrl.select(alg.grpo(pods_num_keep=2), rollout)
        np.testing.assert_array_equal(kept.mask_bg, [[True, True, False, False, False, False]])
        adv = jrl.compute_advantages(alg.grpo(), kept)[0, :, 0]
        np.testing.assert_allclose(adv[:2], [-1.0, 1.0], atol=1e-5)
        np.testing.assert_array_equal(adv[2:], 0.0)

    def test_dapo_dynamic_sampling_drops_all_equal_groups(self):
        rollout = jrl.Rollout(
            reward_bg=jnp.array([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]]),
            mask_bgt=jnp.ones((2, 3, 2), bool),
        )
        kept = jrl.select(alg.dapo(), rollout)
        np.testing.assert_array_equal(kept.mask_bg, [[False] * 3, [True] * 3])


class StatefulKL(parameterized.TestCase):
    def test_adaptive_controller_state_moves_through_the_chain(self):
        from jaxrl_llm.core import kl

        controller = kl.adaptive_kl_controller(0.001, target=0.1, horizon=10000)
        stage = ch.kl_penalty(controller, estimator="k1")
        rollout = random_rollout(3, 2, 2, 4, ragged_groups=False)
        # a constant log-ratio of 0.3 on every token: observed KL = 0.3, n_steps = 4
        rollout = rollout._replace(
            mask_bgt=jnp.ones((2, 2, 4), bool),
            logp_ref_bgt=rollout.logp_old_bgt - 0.3,
        )
        state = stage.init(rollout)
        shaped, state = stage.update(ch.token_rewards(rollout), state, rollout)
        np.testing.assert_allclose(state.beta, 0.001 * (1 + 0.2 * 4 / 10000), rtol=1e-6)
        np.testing.assert_allclose(
            shaped[..., 0], -0.001 * 0.3 * jnp.ones((2, 2)), rtol=1e-5
        )  # the old β shaped this batch


class BadInput(parameterized.TestCase):
    def test_wrong_rank_names_the_argument(self):
        rollout = jrl.Rollout(reward_bg=jnp.ones((4,)), mask_bgt=jnp.ones((4, 3), bool))
        with pytest.raises(AssertionError, match="reward_bg"):
            jrl.compute_advantages(alg.grpo(), rollout)

    def test_float_mask_is_rejected(self):
        rollout = jrl.Rollout(reward_bg=jnp.ones((2, 3)), mask_bgt=jnp.ones((2, 3, 4)))
        with pytest.raises(TypeError, match=r"mask_bgt.*boolean"):
            jrl.compute_advantages(alg.grpo(), rollout)

    def test_mismatched_shapes(self):
        rollout = jrl.Rollout(reward_bg=jnp.ones((2, 3)), mask_bgt=jnp.ones((2, 4, 4), bool))
        with pytest.raises(ValueError, match="mask_bgt"):
            jrl.compute_advantages(alg.grpo(), rollout)
        rollout = jrl.Rollout(
            reward_bg=jnp.ones((2, 3)),
            mask_bgt=jnp.ones((2, 3, 4), bool),
            logp_old_bgt=jnp.ones((2, 3, 5)),
            logp_ref_bgt=jnp.ones((2, 3, 4)),
        )
        with pytest.raises(ValueError, match="logp_old_bgt"):
            jrl.compute_advantages(alg.rloo(beta=0.1), rollout)

    def test_missing_field_names_it(self):
        rollout = jrl.Rollout(reward_bg=jnp.ones((2, 3)), mask_bgt=jnp.ones((2, 3, 4), bool))
        with pytest.raises(ValueError, match="value_bgt"):
            jrl.compute_advantages(alg.ppo(beta=0.0), rollout)
        with pytest.raises(ValueError, match="logp_old_bgt"):
            jrl.compute_advantages(alg.ppo(beta=0.1), rollout)

    @parameterized.parameters(
        ("grpo", {"beta": -1.0}, "beta"),
        ("ppo", {"lam": 1.5}, "lam"),
        ("dapo", {"max_length": 10}, "overlong_buffer"),
        ("grpo", {"pods_num_keep": 0}, "pods_num_keep"),
        ("dpo", {"loss_type": "nope"}, "loss_type"),
        ("grpo", {"numerics": "nope"}, "numerics"),
    )
    def test_bad_hyperparameters(self, name, hp, match):
        with pytest.raises(ValueError, match=match):
            alg.get(name, **hp)

    def test_unknown_algorithm_lists_the_known_ones(self):
        with pytest.raises(ValueError, match="grpo"):
            alg.get("grpoo")


class Compilation(parameterized.TestCase):
    def test_no_recompilation_for_the_same_shape(self):
        recipe = alg.grpo()
        r1 = random_rollout(4, 2, 3, 5)
        r2 = random_rollout(5, 2, 3, 5)
        rc._compute_advantages_jit.clear_cache()
        jrl.compute_advantages(recipe, r1)
        jrl.compute_advantages(recipe, r2)
        assert rc._compute_advantages_jit._cache_size() == 1


def test_recipes_are_jittable_end_to_end():
    """Advantages and the policy objective under one jit, differentiable in log π."""
    rollout = random_rollout(6, 2, 3, 4)
    for name in alg.ONLINE_RECIPES:
        recipe = get(name, beta=0.1 if name in KL_IN_REWARD else 0.05)

        @functools.partial(jax.jit)
        def loss(logp_bgt, rollout, recipe=recipe):
            adv, _ = ch.apply(recipe.advantage, rollout)
            terms = jrl.policy_objective(
                recipe,
                logp_bgt,
                adv,
                ch.token_mask(rollout),
                logp_old_bgt=rollout.logp_old_bgt,
                logp_ref_bgt=rollout.logp_ref_bgt,
            )
            return terms.total[0] / jnp.maximum(terms.total[1], 1.0)

        value, grad = jax.value_and_grad(loss)(rollout.logp_old_bgt, rollout)
        assert np.isfinite(float(value)), name
        assert bool(jnp.all(jnp.isfinite(grad))), name
        assert bool(jnp.all(jnp.where(ch.token_mask(rollout), True, grad == 0))), name


class Preference(parameterized.TestCase):
    batch = rc.PairLogprobs(
        logp_chosen_p=jnp.array([-4.0, -9.0]),
        logp_rejected_p=jnp.array([-6.0, -7.0]),
        len_chosen_p=jnp.array([4.0, 9.0]),
        len_rejected_p=jnp.array([3.0, 7.0]),
        ref_chosen_p=jnp.array([-5.0, -8.0]),
        ref_rejected_p=jnp.array([-5.0, -8.0]),
    )

    def test_dpo_sigmoid_by_hand(self):
        loss = alg.dpo(beta=0.1).loss(self.batch)
        margin = np.array([(1.0) - (-1.0), (-1.0) - (1.0)])  # ρ_w − ρ_l
        np.testing.assert_allclose(loss, np.log1p(np.exp(-0.1 * margin)), rtol=1e-6)

    @parameterized.parameters("sigmoid", "ipo", "hinge", "robust", "simpo")
    def test_every_loss_type_is_finite_and_differentiable(self, loss_type):
        recipe = alg.dpo(loss_type=loss_type, label_smoothing=0.1 if loss_type == "robust" else 0)
        assert (rc.REFERENCE_LOGPROBS in recipe.requires) == (loss_type != "simpo")
        grad = jax.grad(lambda lc: recipe.loss(self.batch._replace(logp_chosen_p=lc)).mean())(
            self.batch.logp_chosen_p
        )
        assert bool(jnp.all(jnp.isfinite(grad)))
        assert bool(jnp.all(grad <= 0))  # raising log π(chosen) never increases the loss

    def test_reference_required_unless_reference_free(self):
        with pytest.raises(ValueError, match="reference"):
            alg.dpo().loss(self.batch._replace(ref_chosen_p=None))


def test_a_baseline_before_the_return_is_refused():
    with pytest.raises(ValueError, match="baseline stage comes before a return"):
        ch.chain(ch.group_mean_baseline(), ch.outcome_return())
    ch.chain(ch.outcome_return(), ch.group_mean_baseline())  # the seed's order is fine
    ch.chain(ch.gae(), ch.batch_whiten())  # GAE is a return with the critic inside
