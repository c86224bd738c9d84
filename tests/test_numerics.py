"""Presets reproduce the peers' golden numbers (docs/numerics.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_llm as jrl
from jaxrl_llm import algorithms as alg
from jaxrl_llm import numerics as nm
from jaxrl_llm import recipe as rc


def one_token_rollout(rewards):
    rewards = jnp.asarray(rewards, jnp.float32)[None]
    return jrl.Rollout(reward_bg=rewards, mask_bgt=jnp.ones((*rewards.shape, 1), bool))


ATOL = {"trl": 1e-4, "default": 1e-5}  # the quoted values are rounded


@pytest.mark.parametrize(
    ("preset", "rewards", "expected"),
    [
        ("verl", [1, 0, 0, 1], [0.866024, -0.866024, -0.866024, 0.866024]),
        ("trl", [1, 0, 0, 1], [0.865875, -0.865875, -0.865875, 0.865875]),
        ("openrlhf", [1, 0, 0, 1], [0.866025, -0.866025, -0.866025, 0.866025]),
        ("default", [1, 0, 0, 1], [1.0, -1.0, -1.0, 1.0]),
        ("verl", [1, 1, 1, 0], [0.499999, 0.499999, 0.499999, -1.499997]),
        ("trl", [1, 1, 1, 0], [0.4999, 0.4999, 0.4999, -1.4997]),
        ("openrlhf", [1, 1, 1, 0], [0.5, 0.5, 0.5, -1.5]),
        ("default", [1, 1, 1, 0], [0.57735, 0.57735, 0.57735, -1.73205]),
    ],
)
def test_grpo_group_normalisation_golden(preset, rewards, expected):
    adv = jrl.compute_advantages(alg.grpo(beta=0.0, numerics=preset), one_token_rollout(rewards))
    np.testing.assert_allclose(adv[0, :, 0], expected, atol=ATOL.get(preset, 2e-6))


def test_verl_rloo_singleton_keeps_the_reward_and_default_zeroes_it():
    rollout = jrl.Rollout(
        reward_bg=jnp.array([[2.5, 0.0]]),
        mask_bgt=jnp.ones((1, 2, 1), bool),
        mask_bg=jnp.array([[True, False]]),
    )
    verl = jrl.compute_advantages(alg.rloo(beta=0.0, numerics="verl"), rollout)
    default = jrl.compute_advantages(alg.rloo(beta=0.0), rollout)
    np.testing.assert_allclose(verl[0, 0, 0], 2.5)
    np.testing.assert_allclose(default[0, 0, 0], 0.0)


def test_presets_differ_in_whitening_ddof():
    """verl whitens with ddof 1, OpenRLHF with ddof 0 and a variance floor."""
    rollout = one_token_rollout([1.0, 2.0, 4.0])
    verl = jrl.compute_advantages(alg.reinforce_pp(beta=0.0, numerics="verl"), rollout)
    orl = jrl.compute_advantages(alg.reinforce_pp(beta=0.0, numerics="openrlhf"), rollout)
    x = np.array([1.0, 2.0, 4.0])
    np.testing.assert_allclose(verl[0, :, 0], (x - x.mean()) / np.std(x, ddof=1), rtol=1e-5)
    np.testing.assert_allclose(orl[0, :, 0], (x - x.mean()) / np.std(x, ddof=0), rtol=1e-5)


def test_openrlhf_clips_scores_and_kl_values():
    rollout = one_token_rollout([25.0, -30.0])
    adv = jrl.compute_advantages(alg.reinforce(beta=0.0, numerics="openrlhf"), rollout)
    np.testing.assert_allclose(adv[0, :, 0], [10.0, -10.0])
    assert nm.OPENRLHF.kl_kwargs("k1") == {"value_clamp": 10.0}
    assert nm.VERL.kl_kwargs("k1") == {}
    assert nm.VERL.kl_kwargs("k3") == {"log_ratio_clamp": 20.0, "value_clamp": 10.0}


def test_verl_dual_clip_is_on():
    recipe = alg.grpo(numerics="verl", beta=0.0)
    logp = jnp.log(jnp.array([[[10.0]]]))  # ratio 10 against logp_old = 0
    loss = recipe.objective.loss(
        logp, jnp.zeros_like(logp), -jnp.ones_like(logp), jnp.ones_like(logp, bool)
    )
    np.testing.assert_allclose(loss, 3.0)  # capped at -c*A with c = 3
    plain = alg.grpo(beta=0.0).objective.loss(
        logp, jnp.zeros_like(logp), -jnp.ones_like(logp), jnp.ones_like(logp, bool)
    )
    np.testing.assert_allclose(plain, 10.0)


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="verl"):
        nm.resolve("ver1")


# --------------------------------------------------------------------------------------------
# OpenRLHF 0.11.2's own numbers (tests/fixtures/generate_openrlhf.py calls its
# compute_advantages_and_returns, compute_approx_kl and DPOLoss).

OPENRLHF_FIXTURE = np.load(Path(__file__).parent / "fixtures" / "openrlhf.npz")


def _openrlhf_rollout(f):
    g = int(f["groups"])
    shape = (-1, g, f["mask"].shape[-1])
    return jrl.Rollout(
        reward_bg=jnp.asarray(f["reward"]).reshape(-1, g),
        mask_bgt=jnp.asarray(f["mask"]).reshape(shape),
        logp_old_bgt=jnp.asarray(f["logp_old"]).reshape(shape),
        logp_ref_bgt=jnp.asarray(f["logp_ref"]).reshape(shape),
        value_bgt=jnp.asarray(f["value"]).reshape(shape),
    )


OPENRLHF_CASES = {
    # fixture key: our recipe under numerics="openrlhf" (OpenRLHF's estimator of the same name)
    "gae_g1_l1": lambda b: alg.ppo(beta=b, gamma=1.0, lam=1.0, numerics="openrlhf"),
    "gae_g0.9_l0.8": lambda b: alg.ppo(beta=b, gamma=0.9, lam=0.8, numerics="openrlhf"),
    "reinforce_g0.9_l1": lambda b: alg.reinforce_pp(beta=b, gamma=0.9, numerics="openrlhf"),
    "rloo_g1_l1": lambda b: alg.rloo(beta=b, numerics="openrlhf"),
    "group_norm_g1_l1": lambda b: alg.grpo(beta=b, numerics="openrlhf"),
    "dr_grpo_g1_l1": lambda b: alg.dr_grpo(beta=b, numerics="openrlhf"),
    "reinforce_baseline_g1_l1": lambda b: alg.reinforce_pp_baseline(beta=b, numerics="openrlhf"),
}


@pytest.mark.parametrize("key", sorted(OPENRLHF_CASES))
def test_openrlhf_advantages_match_openrlhf(key):
    """Baseline, score clip after it, the KL's reward-to-go, GAE / discounted returns through
    interior mask holes, whitening: OpenRLHF's whole advantage on the valid tokens."""
    f = OPENRLHF_FIXTURE
    recipe = OPENRLHF_CASES[key](float(f["beta"]))
    rollout = _openrlhf_rollout(f)
    mask = f["mask"]
    assert (~mask[:, :-1] & mask[:, 1:]).any(), "the fixture must have interior holes"
    adv = np.asarray(jrl.compute_advantages(recipe, rollout)).reshape(mask.shape)
    np.testing.assert_allclose(adv[mask], f[f"adv_{key}"][mask], rtol=1e-5, atol=1e-5)
    if recipe.critic is not None:
        ret = np.asarray(rc.value_targets(recipe, rollout, recipe.advantage.init(rollout)))
        ret = ret.reshape(mask.shape)
        np.testing.assert_allclose(ret[mask], f[f"ret_{key}"][mask], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key", ["rloo_g1_l1", "group_norm_g1_l1", "gae_g0.9_l0.8"])
def test_default_order_differs_from_openrlhf(key):
    """The fixture exercises each difference: without the preset the numbers change."""
    f = OPENRLHF_FIXTURE
    recipe = OPENRLHF_CASES[key](float(f["beta"]))
    ours = dataclasses.replace(nm.OPENRLHF, skip_masked_tokens=True, shaping_after_baseline=False)
    builder = {"rloo_g1_l1": alg.rloo, "group_norm_g1_l1": alg.grpo, "gae_g0.9_l0.8": alg.ppo}
    kwargs = dict(recipe.hparams)
    other = builder[key](
        beta=kwargs["beta"],
        numerics=ours,
        **({"kl_in_reward": True} if key == "group_norm_g1_l1" else {}),
        **({"gamma": 0.9, "lam": 0.8} if key.startswith("gae") else {}),
    )
    mask = f["mask"]
    adv = np.asarray(jrl.compute_advantages(other, _openrlhf_rollout(f))).reshape(mask.shape)
    assert np.abs(adv[mask] - f[f"adv_{key}"][mask]).max() > 1e-3


def test_openrlhf_ipo_uses_the_raw_margin():
    f = OPENRLHF_FIXTURE
    pairs = {k: jnp.asarray(f[f"ipo_{k}"], jnp.float32) for k in ("chosen", "rejected")}
    ref = {k: jnp.asarray(f[f"ipo_ref_{k}"], jnp.float32) for k in ("chosen", "rejected")}
    lengths = (jnp.asarray(f["ipo_len_chosen"]), jnp.asarray(f["ipo_len_rejected"]))

    def loss(chosen, rejected, numerics):
        recipe = alg.dpo(beta=0.1, loss_type="ipo", numerics=numerics)
        p = rc.PairLogprobs(chosen, rejected, *lengths, ref["chosen"], ref["rejected"])
        return recipe.loss(p).mean()

    value, grads = jax.value_and_grad(loss, argnums=(0, 1))(
        pairs["chosen"], pairs["rejected"], "openrlhf"
    )
    np.testing.assert_allclose(value, f["ipo_loss"], rtol=1e-5)
    np.testing.assert_allclose(grads[0], f["ipo_grad_chosen"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grads[1], f["ipo_grad_rejected"], rtol=1e-5, atol=1e-7)
    trl = loss(pairs["chosen"], pairs["rejected"], "trl")  # TRL length-averages
    assert abs(float(trl) - float(f["ipo_loss"])) > 1e-2


# --------------------------------------------------------------------------------------------
# TRL 1.16.0 (tests/fixtures/generate_trl_presets.py calls RLOOTrainer._compute_loss) and
# numpy transcriptions of TRL's advantage lines (inside _generate_and_score_completions).

TRL_FIXTURE = np.load(Path(__file__).parent / "fixtures" / "trl_presets.npz")


def test_trl_rloo_loss_is_a_mean_over_sequences():
    """TRL's RLOO loss −min(ρA, clip(ρ)A) per sequence, averaged over sequences: on-policy its
    gradient is −A_i/B on every valid token, which ours reproduces under the trl preset (the
    values differ by construction: ours is the REINFORCE surrogate −A·Σ_t log π, TRL's −ρA)."""
    f = TRL_FIXTURE
    mask = jnp.asarray(f["rloo_mask"])[None]
    logp = jnp.asarray(f["rloo_logp"], jnp.float32)[None]
    adv = jnp.where(mask, jnp.asarray(f["rloo_adv"], jnp.float32)[None, :, None], 0.0)
    recipe = alg.rloo(beta=0.0, numerics="trl")
    assert recipe.objective.aggregation_label == "seq-mean-token-sum"

    def loss(lp):
        total = rc.policy_objective(recipe, lp, adv, mask).total
        return total[0] / jnp.maximum(total[1], 1.0)

    value, grad = jax.value_and_grad(loss)(logp)
    np.testing.assert_allclose(grad[0], f["rloo_grad"], rtol=1e-5, atol=1e-7)
    want = -np.mean(f["rloo_adv"] * (f["rloo_logp"] * f["rloo_mask"]).sum(-1))
    np.testing.assert_allclose(value, want, rtol=1e-5)
    np.testing.assert_allclose(f["rloo_loss"], -f["rloo_adv"].mean(), rtol=1e-10)
    token_mean = alg.rloo(beta=0.0, numerics="trl", loss_agg_mode="token-mean")
    other = jax.grad(
        lambda lp: (lambda s: s[0] / s[1])(rc.policy_objective(token_mean, lp, adv, mask).total)
    )(logp)
    assert np.abs(np.asarray(other[0]) - f["rloo_grad"]).max() > 1e-3


def _rollout_bgt(reward_bg, t=3, seed=0):
    rng = np.random.default_rng(seed)
    reward_bg = np.asarray(reward_bg, np.float32)
    mask = np.arange(t)[None, None] < rng.integers(1, t + 1, size=reward_bg.shape)[..., None]
    return jrl.Rollout(reward_bg=jnp.asarray(reward_bg), mask_bgt=jnp.asarray(mask)), mask


def test_trl_scale_rewards_batch_divides_by_the_std_of_raw_rewards():
    # TRL: advantages = rewards − group mean; ÷ (nanstd(rewards) + 1e-4), nanstd over the batch
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [3.0, 2.5, 4.0, 3.5], [0.0, 0.0, 1.0, 0.0]])
    rollout, mask = _rollout_bgt(rewards)
    want = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(ddof=1) + 1e-4)
    recipe = alg.grpo(beta=0.0, scale_rewards="batch", numerics="trl")
    adv = np.asarray(jrl.compute_advantages(recipe, rollout))
    np.testing.assert_allclose(adv, np.where(mask, want[..., None], 0.0), rtol=1e-5, atol=1e-6)
    centred = rewards - rewards.mean(1, keepdims=True)  # the std of the centred signal differs
    assert abs(centred.std(ddof=1) - rewards.std(ddof=1)) > 0.1
    assert "raw rewards" in jrl.explain(recipe).normalization
    with pytest.raises(ValueError, match="scale_rewards"):
        alg.grpo(scale_rewards="global")
    with pytest.raises(ValueError, match="contradicts"):
        alg.grpo(scale_by_std=False, scale_rewards="batch")


def test_trl_rloo_reward_clip_and_normalize_advantages():
    # TRL: rewards.clamp(lo, hi); A = r − (Σ r − r)/(n − 1); (A − nanmean A)/(nanstd A + 1e-4)
    rewards = np.array([[4.0, -3.0, 0.5], [1.0, 2.0, 9.0]])
    rollout, mask = _rollout_bgt(rewards, seed=1)
    r = np.clip(rewards, -2.0, 2.0)
    a = r - (r.sum(1, keepdims=True) - r) / (r.shape[1] - 1)
    want = (a - a.mean()) / (a.std(ddof=1) + 1e-4)
    recipe = alg.rloo(
        beta=0.0, reward_clip_range=(-2.0, 2.0), normalize_advantages=True, numerics="trl"
    )
    adv = np.asarray(jrl.compute_advantages(recipe, rollout))
    np.testing.assert_allclose(adv, np.where(mask, want[..., None], 0.0), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="reward_clip_range"):
        alg.rloo(reward_clip_range=(1.0, -1.0))


@pytest.mark.parametrize(
    ("preset", "mode"),
    [
        ("default", "seq-mean-token-mean"),
        ("verl", "token-mean"),
        ("trl", "token-mean"),
        ("openrlhf", "seq-mean-token-mean"),
    ],
)
def test_gspo_aggregation_follows_the_peer(preset, mode):
    assert alg.gspo(numerics=preset).objective.aggregation_label == mode
    explicit = alg.gspo(numerics=preset, loss_agg_mode="seq-mean-token-sum")
    assert explicit.objective.aggregation_label == "seq-mean-token-sum"
    dr = "token-mean" if preset == "openrlhf" else "seq-mean-token-sum-norm"
    assert alg.dr_grpo(numerics=preset).objective.aggregation_label == dr


@pytest.mark.parametrize(
    ("preset", "clip"), [("default", 0.2), ("trl", 0.2), ("verl", 0.5), ("openrlhf", 0.5)]
)
def test_ppo_value_clip_follows_the_peer(preset, clip):
    assert alg.ppo(numerics=preset).critic.value_clip == clip
    assert alg.ppo(numerics=preset, value_clip=0.3).critic.value_clip == 0.3
    assert alg.ppo(numerics=preset, value_clip=0).critic.value_clip is None
    with pytest.raises(ValueError, match="value_clip"):
        alg.ppo(value_clip=-0.1)


def test_openrlhf_group_recipes_put_the_kl_in_the_reward():
    for build in (alg.grpo, alg.dr_grpo, alg.reinforce_pp_baseline):
        orl = build(beta=0.01, numerics="openrlhf")
        assert orl.objective.kl is None and orl.hparams["kl_in_reward"] is True
        assert "after the baseline" in jrl.explain(orl).kl and "k1" in jrl.explain(orl).kl
        assert {rc.REFERENCE_LOGPROBS, rc.BEHAVIOUR_LOGPROBS} <= orl.requires
        loss = build(beta=0.01, numerics="openrlhf", kl_in_reward=False)
        assert loss.objective.kl is not None and loss.objective.kl.label == "k3"
        verl = build(beta=0.01, numerics="verl", kl_in_reward=True)
        assert verl.objective.kl is None and "after the baseline" not in jrl.explain(verl).kl
        with pytest.raises(ValueError, match="kl_in_reward"):
            build(kl_in_reward="yes")
    assert "clipped to [-10, 10]" in jrl.explain(alg.rloo(numerics="openrlhf")).normalization


TRL_GRPO_OPTIONS = {  # fixture case: our grpo options under numerics="trl" (TRL's loss "dapo")
    "delta": dict(beta=0.0, delta=1.5),
    "bias_kl": dict(beta=0.04, use_bias_correction_kl=True),
    "plain_kl": dict(beta=0.04),
    "opsm": dict(beta=0.0, off_policy_mask_threshold=0.05),
}


@pytest.mark.parametrize("case", sorted(TRL_GRPO_OPTIONS))
def test_trl_grpo_options_match_trl(case):
    """delta, use_bias_correction_kl and off_policy_mask_threshold against TRL 1.16.0's own
    GRPOTrainer._compute_loss, off-policy, value and gradient."""
    f = TRL_FIXTURE
    x = {k: jnp.asarray(f[f"grpo_{k}"])[None] for k in ("mask", "logp_old", "logp", "logp_ref")}
    x = {k: v.astype(jnp.float32) if k != "mask" else v for k, v in x.items()}
    adv = jnp.where(x["mask"], jnp.asarray(f["grpo_adv"], jnp.float32)[None], 0.0)
    recipe = alg.grpo(numerics="trl", **TRL_GRPO_OPTIONS[case])

    def loss(lp):
        terms = rc.policy_objective(
            recipe, lp, adv, x["mask"], logp_old_bgt=x["logp_old"], logp_ref_bgt=x["logp_ref"]
        )
        return terms.total[0] / terms.total[1]

    value, grad = jax.value_and_grad(loss)(x["logp"])
    np.testing.assert_allclose(value, f[f"grpo_{case}_loss"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad[0], f[f"grpo_{case}_grad"], rtol=1e-5, atol=1e-7)
    plain = alg.grpo(numerics="trl", beta=TRL_GRPO_OPTIONS[case]["beta"])
    if case != "plain_kl":  # each option changes the numbers on this fixture
        other = rc.policy_objective(
            plain, x["logp"], adv, x["mask"], logp_old_bgt=x["logp_old"], logp_ref_bgt=x["logp_ref"]
        ).total
        assert abs(float(other[0] / other[1]) - float(f[f"grpo_{case}_loss"])) > 1e-4


def test_trl_grpo_option_errors():
    with pytest.raises(ValueError, match="delta"):
        alg.grpo(delta=1.1)
    with pytest.raises(ValueError, match="not both"):
        alg.grpo(delta=2.0, dual_clip=3.0)
    with pytest.raises(ValueError, match="off_policy_mask_threshold"):
        alg.grpo(off_policy_mask_threshold=-1.0)
    with pytest.raises(ValueError, match="use_bias_correction_kl"):
        alg.grpo(use_bias_correction_kl=True, kl_in_reward=True)


def test_new_options_through_the_config_path():
    from jaxrl_llm import config as C
    from jaxrl_llm.config import ConfigError, load_config

    quickstart = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"
    c = load_config(
        quickstart,
        [
            "algorithm.numerics=openrlhf",
            "algorithm.hparams.beta=0.01",
            "algorithm.hparams.kl_in_reward=false",
            "algorithm.hparams.scale_rewards=batch",
        ],
    )
    recipe = C.build_recipe(c)
    assert recipe.hparams["kl_in_reward"] is False and recipe.objective.kl.label == "k3"
    assert recipe.hparams["scale_rewards"] == "batch"
    with pytest.raises(ConfigError, match="scale_rewards"):
        load_config(quickstart, ["algorithm.hparams.scale_rewards=global"])
    rloo = load_config(
        quickstart,
        ["algorithm.name=rloo", "algorithm.hparams.reward_clip_range=[-2.0, 2.0]"],
    )
    assert C.build_recipe(rloo).hparams["reward_clip_range"] == (-2.0, 2.0)
    with pytest.raises(ConfigError, match="reward_clip_range"):
        load_config(
            quickstart, ["algorithm.name=rloo", "algorithm.hparams.reward_clip_range=[2.0, -2.0]"]
        )


def test_explain_describes_the_presets_form():
    assert "±0.5" in jrl.explain(alg.ppo(numerics="verl")).objective
    assert "±0.2" in jrl.explain(alg.ppo()).objective
    assert "dual clip c = 3" in jrl.explain(alg.grpo(numerics="verl")).objective
    assert "dual clip" not in jrl.explain(alg.grpo()).objective
    assert "π_θ/π_old" in jrl.explain(alg.grpo(beta=0.1, use_bias_correction_kl=True)).kl
    assert "zero-reward" in jrl.explain(alg.ppo(numerics="openrlhf")).baseline
    assert "carry it through" in jrl.explain(alg.ppo()).baseline
    assert (
        "raw token-summed" in jrl.explain(alg.dpo(loss_type="ipo", numerics="openrlhf")).objective
    )
    assert "length-averaged" in jrl.explain(alg.dpo(loss_type="ipo")).objective
    assert "token-mean" in jrl.explain(alg.gspo(numerics="verl")).objective


@pytest.mark.parametrize(("kind", "build"), [("ppo", alg.grpo), ("gspo", alg.gspo)])
def test_openrlhf_policy_losses_match_openrlhf(kind, build):
    """OpenRLHF's PolicyLoss, off-policy: PPO token-mean, GSPO's forced per-sequence mean."""
    f = OPENRLHF_FIXTURE
    mask = jnp.asarray(f["mask"])[None]
    logp_old = jnp.asarray(f["logp_old"], jnp.float32)[None]
    adv = jnp.asarray(f["policy_adv"], jnp.float32)
    adv = jnp.where(mask, (adv[:, :1] if kind == "gspo" else adv)[None], 0.0)
    recipe = build(beta=0.0, numerics="openrlhf")

    def loss(lp):
        total = rc.policy_objective(recipe, lp, adv, mask, logp_old_bgt=logp_old).total
        return total[0] / total[1]

    value, grad = jax.value_and_grad(loss)(jnp.asarray(f["policy_logp"], jnp.float32)[None])
    np.testing.assert_allclose(value, f[f"policy_{kind}_loss"], rtol=1e-5, atol=1e-7)
    grad = np.where(f["mask"], grad[0], 0.0)  # OpenRLHF's gradient is 0 off the mask too
    np.testing.assert_allclose(grad, f[f"policy_{kind}_grad"], rtol=1e-5, atol=1e-7)


def test_trl_off_policy_rloo_matches_trl():
    """rloo(clip_eps=0.2): TRL's clipped sequence ratio, value and gradient against TRL's own
    RLOOTrainer._compute_loss with off-policy old log-probs."""
    f = TRL_FIXTURE
    mask = jnp.asarray(f["rloo_mask"])[None]
    logp = jnp.asarray(f["rloo_logp"], jnp.float32)[None]
    adv = jnp.where(mask, jnp.asarray(f["rloo_adv"], jnp.float32)[None, :, None], 0.0)
    # any split of the sequence's old log-prob over its tokens gives the same Σ_t log π_old
    length = f["rloo_mask"].sum(-1, keepdims=True)
    old = np.where(f["rloo_mask"], f["rloo_old_logps"][:, None] / length, 0.0)
    old = jnp.asarray(old, jnp.float32)[None]
    recipe = alg.rloo(beta=0.0, clip_eps=0.2, numerics="trl")
    assert rc.ON_POLICY not in recipe.requires

    def loss(lp):
        total = rc.policy_objective(recipe, lp, adv, mask, logp_old_bgt=old).total
        return total[0] / jnp.maximum(total[1], 1.0)

    value, grad = jax.value_and_grad(loss)(logp)
    np.testing.assert_allclose(value, f["rloo_off_loss"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad[0], f["rloo_off_grad"], rtol=1e-5, atol=1e-7)
    metrics = recipe.objective.ratio_metrics(logp, old, adv, mask)
    assert all(float(d) == mask.any(-1).sum() for _, d in metrics.values())
    with pytest.raises(ValueError, match="clip_eps"):
        alg.rloo(clip_eps=0.0)
