"""Tests for jaxrl_llm.recipe: derived requirements, name tables, critic targets, the objective.

Expected requirement sets are written out by hand; numbers are checked against the slow loops of
``tests/reference.py`` (float64), never against the code under test.
"""

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_llm  # noqa: F401  (loads jaxrl_llm.explain the module)
from jaxrl_llm import algorithms as alg
from jaxrl_llm import chain as ch
from jaxrl_llm import numerics as nm
from jaxrl_llm import recipe as rc
from jaxrl_llm.core import aggregation as agg
from jaxrl_llm.core import kl as kl_mod
from tests import reference as ref

explain_mod = sys.modules["jaxrl_llm.explain"]

BEHAVIOUR = "behaviour_logprobs"
REFERENCE = "reference_logprobs"
VALUES = "values"
GROUPS = "groups"
ON_POLICY = "on_policy"
GIVEN = "given_baseline"
PAIRS = "preference_pairs"


def _adaptive():
    return kl_mod.adaptive_kl_controller(0.05, target=0.1, horizon=100.0)


# ---------------------------------------------------------------------------------------------
# requires


DEFAULT_REQUIRES = {
    "reinforce": {BEHAVIOUR, REFERENCE, ON_POLICY},
    "ppo": {BEHAVIOUR, REFERENCE, VALUES},
    "grpo": {REFERENCE, GROUPS},
    "dr_grpo": {GROUPS},
    "rloo": {BEHAVIOUR, REFERENCE, GROUPS, ON_POLICY},
    "reinforce_pp": {BEHAVIOUR, REFERENCE},
    "reinforce_pp_baseline": {REFERENCE, GROUPS},
    "dapo": {GROUPS},
    "gspo": {GROUPS},
    "cispo": {GROUPS},
    "gpg": {GROUPS, ON_POLICY},
    "sapo": {GROUPS},
    "gmpo": {GROUPS},
    "clip_cov": {GROUPS},
    "kl_cov": {GROUPS},
    "dppo": {GROUPS},
    "dro": {GROUPS},
    "luspo": {GROUPS},
    "vespo": {GROUPS},
    "opo": {GROUPS, ON_POLICY},
    "remax": {GIVEN, ON_POLICY},
    "dpo": {PAIRS, REFERENCE},
}

VARIANT_REQUIRES = [
    # β = 0 removes the reference (and, for KL-in-reward, the behaviour log-probs).
    ("reinforce", dict(beta=0.0), {ON_POLICY}),
    ("ppo", dict(beta=0.0), {VALUES}),
    ("grpo", dict(beta=0.0), {GROUPS}),
    ("rloo", dict(beta=0.0), {GROUPS, ON_POLICY}),
    ("reinforce_pp", dict(beta=0.0), set()),
    ("reinforce_pp_baseline", dict(beta=0.0), {GROUPS}),
    # β > 0 adds a KL loss term to the recipes that default to none.
    ("dr_grpo", dict(beta=0.1), {GROUPS, REFERENCE}),
    ("dapo", dict(beta=0.1), {GROUPS, REFERENCE}),
    ("gspo", dict(beta=0.1), {GROUPS, REFERENCE}),
    # An adaptive controller keeps the KL in the reward, whatever β says.
    ("ppo", dict(kl_controller="adaptive"), {BEHAVIOUR, REFERENCE, VALUES}),
    ("ppo", dict(beta=0.0, kl_controller="adaptive"), {BEHAVIOUR, REFERENCE, VALUES}),
    ("reinforce", dict(kl_controller="adaptive"), {BEHAVIOUR, REFERENCE, ON_POLICY}),
    ("reinforce", dict(beta=0.0, kl_controller="adaptive"), {BEHAVIOUR, REFERENCE, ON_POLICY}),
    ("rloo", dict(kl_controller="adaptive"), {BEHAVIOUR, REFERENCE, GROUPS, ON_POLICY}),
    ("rloo", dict(beta=0.0, kl_controller="adaptive"), {BEHAVIOUR, REFERENCE, GROUPS, ON_POLICY}),
    ("reinforce_pp", dict(kl_controller="adaptive"), {BEHAVIOUR, REFERENCE}),
    ("reinforce_pp", dict(beta=0.0, kl_controller="adaptive"), {BEHAVIOUR, REFERENCE}),
    # Selection and other knobs.
    ("grpo", dict(beta=0.0, pods_num_keep=2), {GROUPS}),
    ("grpo", dict(scale_by_std=False), {GROUPS, REFERENCE}),
    ("dapo", dict(dynamic_sampling=False), {GROUPS}),
    ("ppo", dict(entropy_coef=0.01, value_clip=None), {BEHAVIOUR, REFERENCE, VALUES}),
    ("grpo", dict(beta=0.0, passk=True), {GROUPS}),
    (
        "grpo",
        dict(beta=0.0, reward_aggregation="normalize_then_sum"),
        {GROUPS, "reward_components"},
    ),
    ("remax", dict(beta=0.05), {GIVEN, ON_POLICY, BEHAVIOUR, REFERENCE}),
    ("cispo", dict(beta=0.1), {GROUPS, REFERENCE}),
    ("dpo", dict(loss_type="simpo"), {PAIRS}),
    ("dpo", dict(loss_type="ipo"), {PAIRS, REFERENCE}),
    ("dpo", dict(loss_type="hinge"), {PAIRS, REFERENCE}),
    ("dpo", dict(loss_type="robust", label_smoothing=0.1), {PAIRS, REFERENCE}),
]


def test_every_named_recipe_is_listed():
    assert set(alg.RECIPES) == set(DEFAULT_REQUIRES)


@pytest.mark.parametrize("name", sorted(DEFAULT_REQUIRES))
def test_requires_of_named_recipes_with_defaults(name):
    recipe = alg.RECIPES[name]()
    assert isinstance(recipe.requires, frozenset)
    assert recipe.requires == frozenset(DEFAULT_REQUIRES[name])


@pytest.mark.parametrize(("name", "hparams", "want"), VARIANT_REQUIRES)
def test_requires_of_variants(name, hparams, want):
    hparams = dict(hparams)
    if hparams.get("kl_controller") == "adaptive":
        hparams["kl_controller"] = _adaptive()
    assert alg.RECIPES[name](**hparams).requires == frozenset(want)


def test_requirement_constants_are_the_documented_strings():
    assert rc.BEHAVIOUR_LOGPROBS == BEHAVIOUR
    assert rc.REFERENCE_LOGPROBS == REFERENCE
    assert rc.VALUES == VALUES
    assert rc.GROUPS == GROUPS
    assert rc.ON_POLICY == ON_POLICY
    assert rc.PREFERENCE_PAIRS == PAIRS
    assert ch.GIVEN_BASELINE == GIVEN


def _ratio_objective(**kwargs):
    """A plain PPO-clip objective (no KL term, no ON_POLICY)."""
    return rc.ppo_objective(
        clip_low=0.2,
        clip_high=0.2,
        dual_clip=None,
        numerics=nm.resolve(None),
        agg="token-mean",
        **kwargs,
    )


CUSTOM_CHAINS = [
    ("given", lambda: ch.chain(ch.outcome_return(), ch.given_baseline()), {GIVEN}),
    (
        "critic",
        lambda: ch.chain(ch.discounted_return(0.9), ch.critic_baseline()),
        {VALUES},
    ),
    ("outcome", lambda: ch.chain(ch.outcome_return()), set()),
    (
        "shaping",
        lambda: ch.chain(
            ch.clip_reward(-1.0, 1.0),
            ch.overlong_penalty(max_length=8, buffer_length=2),
            ch.outcome_return(),
            ch.batch_std_scale(),
            ch.batch_whiten(),
        ),
        set(),
    ),
    (
        "opo",
        lambda: ch.chain(ch.outcome_return(), ch.length_weighted_baseline(), ch.group_std_scale()),
        {GROUPS},
    ),
    (
        "kl_loo",
        lambda: ch.chain(ch.kl_penalty(0.1), ch.outcome_return(), ch.leave_one_out_baseline()),
        {BEHAVIOUR, REFERENCE, GROUPS},
    ),
    ("gae", lambda: ch.chain(ch.gae(1.0, 0.9)), {VALUES}),
]


@pytest.mark.parametrize(("name", "make_chain", "want"), CUSTOM_CHAINS)
def test_custom_composition_gets_requirements_from_its_stages(name, make_chain, want):
    recipe = rc.make_recipe(name, advantage=make_chain(), objective=_ratio_objective())
    assert recipe.requires == frozenset(want)
    assert ch.requirements(recipe.advantage) == frozenset(want)


def test_custom_composition_adds_objective_critic_and_selection_requirements():
    advantage = ch.chain(ch.outcome_return(), ch.given_baseline())
    numerics = nm.resolve(None)
    with_kl = _ratio_objective(kl=rc.kl_term(0.1, "k3", numerics))
    assert rc.make_recipe("a", advantage=advantage, objective=with_kl).requires == {
        GIVEN,
        REFERENCE,
    }
    no_kl = _ratio_objective(kl=rc.kl_term(0.0, "k3", numerics))
    assert rc.make_recipe("b", advantage=advantage, objective=no_kl).requires == {GIVEN}
    reinforce = rc.reinforce_objective(agg="seq-mean-token-sum", text="x")
    assert rc.make_recipe("c", advantage=advantage, objective=reinforce).requires == {
        GIVEN,
        ON_POLICY,
    }
    critic = rc.Critic(targets=lambda rollout, state: rollout.value_bgt, value_clip=None)
    assert rc.make_recipe(
        "d", advantage=advantage, objective=_ratio_objective(), critic=critic
    ).requires == {GIVEN, VALUES}
    for selection in (rc.Selection(pods_num_keep=2), rc.Selection(dynamic_sampling=True)):
        assert rc.make_recipe(
            "e", advantage=advantage, objective=_ratio_objective(), selection=selection
        ).requires == {GIVEN, GROUPS}
    assert rc.make_recipe(
        "f", advantage=advantage, objective=_ratio_objective(), selection=rc.Selection()
    ).requires == {GIVEN}


# ---------------------------------------------------------------------------------------------
# Name tables: aggregations and KL estimators.


def _loss_batch(seed, shape=(2, 3, 5)):
    rng = np.random.default_rng(seed)
    loss = rng.normal(size=shape).astype(np.float32)
    mask = rng.random(shape) < 0.6
    mask[0, 1] = False  # an empty completion
    return loss, mask


def test_aggregation_names_map_to_core_functions():
    want = {
        "token-mean": agg.token_mean,
        "token-sum": agg.token_sum,
        "seq-mean-token-mean": agg.seq_mean_token_mean,
        "seq-mean-token-sum": agg.seq_mean_token_sum,
        "seq-mean-token-sum-norm": agg.seq_mean_token_sum_norm,
    }
    assert set(rc.AGGREGATIONS) == set(want)
    for name, fn in want.items():
        assert rc.AGGREGATIONS[name] is fn, name
        if name != "seq-mean-token-sum-norm":
            assert rc.aggregation(name) is fn, name


@pytest.mark.parametrize("name", sorted(rc.AGGREGATIONS))
def test_aggregation_matches_loop_reference(name):
    loss, mask = _loss_batch(0)
    total, denominator = rc.aggregation(name)(loss, mask)
    want_total, want_den = ref.aggregate(loss, mask, name)
    np.testing.assert_allclose(total, want_total, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(denominator, want_den)


@pytest.mark.parametrize("norm", [None, 7, 16])
def test_seq_mean_token_sum_norm_with_and_without_norm(norm):
    loss, mask = _loss_batch(1)
    num_tokens = loss.shape[-1]
    fn = rc.aggregation("seq-mean-token-sum-norm", norm=norm)
    got = fn(loss, mask)
    core = agg.seq_mean_token_sum_norm(loss, mask, norm=num_tokens if norm is None else norm)
    np.testing.assert_allclose(got, core)
    want_total, want_den = ref.aggregate(loss, mask, "seq-mean-token-sum-norm", norm=norm)
    np.testing.assert_allclose(got[0], want_total, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], want_den)
    # 4 non-empty sequences of the 2×3 (one emptied above, one maybe empty by chance).
    num_sequences = int(mask.any(-1).sum())
    want_norm = num_tokens if norm is None else norm
    np.testing.assert_allclose(got[1], num_sequences * want_norm)
    # The default follows the batch's padded T, not a length frozen at build time.
    if norm is None:
        padded = np.pad(loss, [(0, 0), (0, 0), (0, 3)]), np.pad(mask, [(0, 0), (0, 0), (0, 3)])
        np.testing.assert_allclose(fn(*padded)[1], num_sequences * (num_tokens + 3))


@pytest.mark.parametrize("bad", ["token_mean", "mean", "seq-mean-token-sum-normalized", ""])
def test_unknown_aggregation_raises_naming_it(bad):
    with pytest.raises(ValueError, match=re.escape(repr(bad))) as info:
        rc.aggregation(bad)
    assert "token-mean" in str(info.value)  # lists valid names


@pytest.mark.parametrize("name", ["token-mean", "token-sum", "seq-mean-token-mean"])
def test_norm_given_to_another_mode_raises(name):
    with pytest.raises(ValueError, match="norm") as info:
        rc.aggregation(name, norm=37)
    assert repr(name) in str(info.value) and "37" in str(info.value)


@pytest.mark.parametrize("norm", [0, -3, 0.5])
def test_bad_norm_raises(norm):
    with pytest.raises(ValueError, match=re.escape(repr(norm))):
        rc.aggregation("seq-mean-token-sum-norm", norm=norm)


KL_NAMES = {
    "k1": kl_mod.kl_k1,
    "abs": kl_mod.kl_abs,
    "k2": kl_mod.kl_k2,
    "k3": kl_mod.kl_k3,
    "k1+": kl_mod.kl_k1_st,
    "k3+": kl_mod.kl_k3_st,
    "kl": kl_mod.kl_k1,
    "mse": kl_mod.kl_k2,
    "low_var_kl": kl_mod.kl_k3,
    "low_var_kl+": kl_mod.kl_k3_st,
}

# name -> (the estimator whose value it has, whether its gradient is straight-through Δ)
KL_SEMANTICS = {
    "k1": ("k1", False),
    "abs": ("abs", False),
    "k2": ("k2", False),
    "k3": ("k3", False),
    "k1+": ("k1", True),
    "k3+": ("k3", True),
    "kl": ("k1", False),
    "mse": ("k2", False),
    "low_var_kl": ("k3", False),
    "low_var_kl+": ("k3", True),
}


def test_kl_estimator_names_map_to_core_functions():
    assert set(ch.KL_ESTIMATORS) == set(KL_NAMES)
    for name, fn in KL_NAMES.items():
        assert ch.kl_estimator(name) is fn, name


@pytest.mark.parametrize("name", sorted(KL_SEMANTICS))
def test_kl_estimator_values_and_gradients_match_reference(name):
    rng = np.random.default_rng(2)
    logp = -rng.exponential(1.0, size=(7,)).astype(np.float32)
    logp_ref = (logp + rng.normal(0.0, 0.5, size=(7,))).astype(np.float32)
    base, straight_through = KL_SEMANTICS[name]
    fn = ch.kl_estimator(name)
    np.testing.assert_allclose(fn(logp, logp_ref), ref.ref_kl(base, logp, logp_ref), rtol=1e-5)
    grad = jax.grad(lambda lp: jnp.sum(fn(lp, logp_ref)))(logp)
    d = logp.astype(np.float64) - logp_ref
    want_grad = {
        "k1": np.ones_like(d),
        "abs": np.sign(d),
        "k2": d,
        "k3": 1.0 - np.exp(-d),
    }[base]
    np.testing.assert_allclose(grad, d if straight_through else want_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", ["k4", "K1", "low-var-kl", "full"])
def test_unknown_kl_estimator_lists_valid_names(bad):
    with pytest.raises(ValueError, match=re.escape(repr(bad))) as info:
        ch.kl_estimator(bad)
    for name in KL_NAMES:
        assert repr(name) in str(info.value), name


def test_recipe_with_unknown_kl_estimator_raises_at_build_time():
    with pytest.raises(ValueError, match="'k9'"):
        alg.grpo(kl_estimator="k9")
    with pytest.raises(ValueError, match="'k9'"):
        alg.ppo(kl_estimator="k9")


# ---------------------------------------------------------------------------------------------
# value_targets


def _ppo_rollout(seed, shape=(2, 3, 5)):
    """A random PPO rollout with holes in the masks, an empty completion and a non-member."""
    rng = np.random.default_rng(seed)
    b, g = shape[:2]
    mask = rng.random(shape) < 0.75
    mask[0, 1] = False  # empty completion
    mask[1, 0, :2] = True
    mask_bg = np.ones((b, g), bool)
    mask_bg[1, 2] = False  # non-member
    logp_old = -rng.exponential(1.0, size=shape)
    data = dict(
        reward_bg=rng.normal(size=(b, g)),
        mask_bgt=mask,
        mask_bg=mask_bg,
        logp_old_bgt=logp_old,
        logp_ref_bgt=logp_old + rng.normal(0.0, 0.5, size=shape),
        value_bgt=rng.normal(size=shape),
    )
    rollout = ch.Rollout(
        **{
            k: (jnp.asarray(v) if v.dtype == bool else jnp.asarray(v, jnp.float32))
            for k, v in data.items()
        }
    )
    # The reference sees the same f32-rounded numbers, in float64.
    data = {
        k: (v if v.dtype == bool else np.asarray(v, np.float32).astype(np.float64))
        for k, v in data.items()
    }
    return rollout, data


def _ref_value_targets(data, *, beta, gamma, lam):
    """Token rewards − β·k1 on valid tokens, verl's GAE loop, returns = A + V, 0 on padding."""
    mask = data["mask_bgt"] & data["mask_bg"][..., None]
    r = ref.token_rewards(data["reward_bg"], mask)
    r = ref.kl_k1_in_reward(r, data["logp_old_bgt"], data["logp_ref_bgt"], mask, beta)
    adv = ref.gae_loop(r, data["value_bgt"], mask, gamma, lam)
    _, returns = ref.ref_gae(r, data["value_bgt"], mask, gamma, lam)  # second loop, same thing
    np.testing.assert_allclose(np.where(mask, adv + data["value_bgt"], 0.0), returns, atol=1e-12)
    return returns


@pytest.mark.parametrize(
    "hparams",
    [dict(), dict(beta=0.2, gamma=0.9, lam=0.8), dict(beta=0.0, lam=1.0), dict(gamma=0.5)],
)
def test_ppo_value_targets_match_reference(hparams):
    recipe = alg.ppo(**hparams)
    rollout, data = _ppo_rollout(3)
    beta = hparams.get("beta", 0.05)
    want = _ref_value_targets(
        data, beta=beta, gamma=hparams.get("gamma", 1.0), lam=hparams.get("lam", 0.95)
    )
    state = recipe.advantage.init(rollout)
    got = rc.value_targets(recipe, rollout, state)
    assert got.dtype == jnp.float32 and got.shape == data["mask_bgt"].shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    jitted = jax.jit(rc.value_targets, static_argnums=0)(recipe, rollout, state)
    np.testing.assert_allclose(jitted, want, rtol=1e-5, atol=1e-5)
    # Unwhitened: not the advantages the recipe trains the policy with.
    adv = rc.compute_advantages(recipe, rollout)
    assert not np.allclose(adv, got - data["value_bgt"], atol=1e-3)


def test_ppo_value_targets_use_the_adaptive_beta_of_the_given_state():
    init_beta, target, horizon = 0.05, 0.01, 10.0
    controller = kl_mod.adaptive_kl_controller(init_beta, target=target, horizon=horizon)
    recipe = alg.ppo(kl_controller=controller, gamma=0.95, lam=0.9)
    rollout, data = _ppo_rollout(4)
    state0 = recipe.advantage.init(rollout)
    _, state1 = ch.apply(recipe.advantage, rollout, state0)

    # The controller's step, computed independently: observed KL = mean over non-empty member
    # sequences of their mean k1; n_steps = B·G.
    mask = data["mask_bgt"] & data["mask_bg"][..., None]
    k1 = np.where(mask, data["logp_old_bgt"] - data["logp_ref_bgt"], 0.0)
    observed = ref.ref_mean_sequence_kl(k1, mask)
    n_steps = mask.shape[0] * mask.shape[1]
    beta1 = ref.ref_adaptive_kl_beta(init_beta, observed, n_steps, target=target, horizon=horizon)
    assert abs(beta1 - init_beta) > 1e-3  # the state really moved

    # The trainer's state layout: advantage = chain(returns, whiten), returns = chain(kl, gae).
    np.testing.assert_allclose(float(state1[0][0].beta), beta1, rtol=1e-5)

    got0 = rc.value_targets(recipe, rollout, state0)
    got1 = rc.value_targets(recipe, rollout, state1)
    np.testing.assert_allclose(
        got0, _ref_value_targets(data, beta=init_beta, gamma=0.95, lam=0.9), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        got1, _ref_value_targets(data, beta=beta1, gamma=0.95, lam=0.9), rtol=1e-5, atol=1e-5
    )
    assert not np.allclose(got0, got1, atol=1e-4)
    # On another rollout the state's β is used, not one re-derived from that rollout.
    other, other_data = _ppo_rollout(5)
    np.testing.assert_allclose(
        rc.value_targets(recipe, other, state1),
        _ref_value_targets(other_data, beta=beta1, gamma=0.95, lam=0.9),
        rtol=1e-5,
        atol=1e-5,
    )


def test_value_targets_without_critic_raises_naming_the_recipe():
    rollout, _ = _ppo_rollout(6)
    recipe = alg.grpo()
    with pytest.raises(ValueError, match="'grpo'"):
        rc.value_targets(recipe, rollout, recipe.advantage.init(rollout))


def test_value_targets_without_values_raises_naming_the_field():
    rollout, _ = _ppo_rollout(6)
    rollout = rollout._replace(value_bgt=None)
    recipe = alg.ppo(beta=0.0)
    with pytest.raises(ValueError, match="value_bgt"):
        rc.value_targets(recipe, rollout, recipe.advantage.init(rollout))


# ---------------------------------------------------------------------------------------------
# policy_objective


def _policy_batch(seed, shape=(2, 2, 4)):
    rng = np.random.default_rng(seed)
    logp = -rng.exponential(1.0, size=shape)
    arrays = dict(
        logp_bgt=logp,
        adv_bgt=rng.normal(size=shape),
        logp_old_bgt=logp + rng.normal(0.0, 0.3, size=shape),
        logp_ref_bgt=logp + rng.normal(0.0, 0.3, size=shape),
        entropy_bgt=rng.exponential(1.0, size=shape),
    )
    arrays = {k: np.asarray(v, np.float32) for k, v in arrays.items()}
    mask = rng.random(shape) < 0.7
    mask[0, 0] = False
    return arrays, mask


def _terms(recipe_or_objective, arrays, mask, **drop):
    kwargs = {k: v for k, v in arrays.items() if k not in ("logp_bgt", "adv_bgt")}
    for key in drop:
        kwargs.pop(key)
    return rc.policy_objective(
        recipe_or_objective, arrays["logp_bgt"], arrays["adv_bgt"], mask, **kwargs
    )


def test_policy_objective_accepts_recipe_or_objective():
    arrays, mask = _policy_batch(0)
    for recipe in (alg.grpo(entropy_coef=0.01), alg.ppo(entropy_coef=0.02), alg.rloo()):
        by_recipe = _terms(recipe, arrays, mask)
        by_objective = _terms(recipe.objective, arrays, mask)
        for field in rc.LossTerms._fields:
            for a, b in zip(getattr(by_recipe, field), getattr(by_objective, field), strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"{recipe.name}.{field}")


def test_policy_objective_matches_loop_reference():
    # GRPO defaults: PPO clip ε = 0.2 (log-ratio clamp 20), + β·k3, − c_H·H, seq-mean-token-mean.
    beta, coef = 0.04, 0.01
    arrays, mask = _policy_batch(1)
    terms = _terms(alg.grpo(beta=beta, entropy_coef=coef), arrays, mask)
    lp, old, a = arrays["logp_bgt"], arrays["logp_old_bgt"], arrays["adv_bgt"]
    policy, _ = ref.ppo(lp, old, a, mask, clip_low=0.2, clip_high=0.2, log_ratio_clamp=20.0)
    kl = np.where(mask, ref.ref_kl("k3", lp, arrays["logp_ref_bgt"], log_ratio_clamp=20.0), 0.0)
    entropy = np.where(mask, arrays["entropy_bgt"], 0.0)
    total = policy + beta * kl - coef * entropy
    for field, x in (("policy", policy), ("kl", kl), ("entropy", entropy), ("total", total)):
        want = ref.aggregate(x, mask, "seq-mean-token-mean")
        np.testing.assert_allclose(getattr(terms, field), want, rtol=1e-5, atol=1e-6, err_msg=field)


def test_policy_objective_missing_reference_names_the_recipe():
    arrays, mask = _policy_batch(2)
    recipe = alg.grpo(beta=0.04)
    with pytest.raises(ValueError, match=r"policy_objective\(grpo\).*logp_ref_bgt"):
        _terms(recipe, arrays, mask, logp_ref_bgt=None)
    custom = rc.make_recipe(
        "my_algo",
        advantage=ch.chain(ch.outcome_return()),
        objective=recipe.objective,
    )
    with pytest.raises(ValueError, match=r"policy_objective\(my_algo\).*logp_ref_bgt"):
        _terms(custom, arrays, mask, logp_ref_bgt=None)
    # β = 0: no KL term, so no reference needed, and its pair is zero.
    terms = _terms(alg.grpo(beta=0.0), arrays, mask, logp_ref_bgt=None)
    np.testing.assert_array_equal(terms.kl, (0.0, 0.0))


def test_policy_objective_missing_entropy_names_the_recipe():
    arrays, mask = _policy_batch(3)
    with pytest.raises(ValueError, match=r"policy_objective\(ppo\).*entropy_bgt"):
        _terms(alg.ppo(entropy_coef=0.01), arrays, mask, entropy_bgt=None)
    with pytest.raises(ValueError, match=r"policy_objective\(dapo\).*entropy_bgt"):
        _terms(alg.dapo(entropy_coef=0.01), arrays, mask, entropy_bgt=None)
    terms = _terms(alg.ppo(), arrays, mask, entropy_bgt=None)
    np.testing.assert_array_equal(terms.entropy, (0.0, 0.0))


# ---------------------------------------------------------------------------------------------
# compute_advantages on a preference recipe


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_compute_advantages_on_preference_recipe_points_at_pair_logprobs(loss_type):
    rollout, _ = _ppo_rollout(7)
    with pytest.raises(ValueError, match="PairLogprobs") as info:
        rc.compute_advantages(alg.dpo(loss_type=loss_type), rollout)
    assert "'dpo'" in str(info.value)


# ---------------------------------------------------------------------------------------------
# explain reads the stages' labels


def _table_column(table, column):
    lines = table.splitlines()
    header = [cell.strip() for cell in lines[0].split(" | ")]
    rows = [[cell.strip() for cell in line.split(" | ")] for line in lines[2:]]
    index = header.index(column)
    return {row[0]: row[index] for row in rows}


def test_comparison_table_baseline_column_of_named_recipes():
    baselines = _table_column(explain_mod.comparison_table(), "baseline")
    assert baselines["ppo"] == "critic V(s)"
    assert baselines["grpo"] == "group mean"
    assert baselines["rloo"] == "leave-one-out"
    assert baselines["reinforce"] == "none"
    assert baselines["reinforce_pp"] == "none"


def test_comparison_table_uses_the_stage_labels_of_a_custom_recipe(monkeypatch):
    def opo():
        return rc.make_recipe(
            "opo",
            advantage=ch.chain(
                ch.outcome_return(), ch.length_weighted_baseline(), ch.batch_std_scale()
            ),
            objective=_ratio_objective(),
        )

    def labelled():
        stage = ch.stateless(
            lambda signal_bgt, rollout: signal_bgt,
            ch.StageInfo("baseline", "a made-up baseline", "my made-up label"),
        )
        return rc.make_recipe(
            "labelled",
            advantage=ch.chain(ch.outcome_return(), stage),
            objective=_ratio_objective(),
        )

    monkeypatch.setitem(alg.RECIPES, "opo", opo)
    monkeypatch.setitem(alg.RECIPES, "labelled", labelled)
    table = explain_mod.comparison_table(("opo", "labelled", "grpo"))
    baselines = _table_column(table, "baseline")
    assert baselines == {
        "opo": "length-weighted mean",
        "labelled": "my made-up label",
        "grpo": "group mean",
    }
    normalisation = _table_column(table, "normalisation")
    assert normalisation["opo"] == "batch std"
    assert normalisation["labelled"] == "none"


# ---------------------------------------------------------------------------------------------
# The name lookups that used to live in core (moved with their tables, assertions unchanged).


def test_aggregation_lookup_moved_from_core():
    from jaxrl_llm.core import aggregation as agg

    assert set(rc.AGGREGATIONS) == {
        "token-mean",
        "token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
    }
    assert rc.aggregation("token-mean") is agg.token_mean
    rng = np.random.default_rng(8)
    loss = rng.normal(size=(2, 3, 5)).astype(np.float32)
    mask = rng.random((2, 3, 5)) < 0.6
    bound = rc.aggregation("seq-mean-token-sum-norm", norm=16)
    np.testing.assert_allclose(
        bound(loss, mask), agg.seq_mean_token_sum_norm(loss, mask, norm=16), rtol=1e-7
    )
    with pytest.raises(ValueError, match="valid names"):
        rc.aggregation("token_mean")
    with pytest.raises(ValueError, match="does not take"):
        rc.aggregation("token-mean", norm=16)
    with pytest.raises(ValueError, match="argument `norm`"):
        rc.aggregation("seq-mean-token-sum-norm", norm=0.5)


@pytest.mark.parametrize(
    ("name", "estimator"),
    [
        ("k1", "kl_k1"),
        ("kl", "kl_k1"),
        ("abs", "kl_abs"),
        ("k2", "kl_k2"),
        ("mse", "kl_k2"),
        ("k3", "kl_k3"),
        ("low_var_kl", "kl_k3"),
        ("k1+", "kl_k1_st"),
        ("k3+", "kl_k3_st"),
        ("low_var_kl+", "kl_k3_st"),
    ],
)
def test_kl_estimator_lookup_moved_from_core(name, estimator):
    from jaxrl_llm.core import kl

    assert ch.kl_estimator(name) is getattr(kl, estimator)


def test_unknown_kl_estimator_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown KL estimator 'full'.*'low_var_kl\+'"):
        ch.kl_estimator("full")
