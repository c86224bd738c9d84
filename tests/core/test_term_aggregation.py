"""Token-mean KL and entropy terms under another loss aggregation (OpenRLHF: both; TRL: the
entropy), exact under micro-batching and packing."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm import algorithms
from jaxrl_llm import recipe as rc
from jaxrl_llm.train import update as up
from tests.train import helpers as H

BETA, COEF = 0.1, 0.01


def _openrlhf(**kw):
    return algorithms.grpo(
        numerics="openrlhf",
        kl_in_reward=False,
        beta=BETA,
        entropy_coef=COEF,
        loss_agg_mode="seq-mean-token-mean",
        **kw,
    )


def test_presets_choose_the_terms_aggregation():
    o = _openrlhf().objective
    assert o.token_mean_kl and o.token_mean_entropy and o.mixed_aggregation
    # TRL's loss_type="grpo" (seq-mean-token-mean): the entropy stays a token mean
    trl_grpo = dict(numerics="trl", beta=BETA, entropy_coef=COEF)
    t = algorithms.grpo(**trl_grpo, loss_agg_mode="seq-mean-token-mean").objective
    assert not t.token_mean_kl and t.token_mean_entropy and t.mixed_aggregation
    assert not algorithms.grpo(**trl_grpo).objective.mixed_aggregation  # default: token-mean
    v = algorithms.grpo(numerics="verl", beta=BETA, entropy_coef=COEF).objective
    assert not (v.token_mean_kl or v.token_mean_entropy or v.mixed_aggregation)


def test_policy_objective_matches_openrlhfs_actor_loss():
    """OpenRLHF ``PPOActor.training_step``: ``actor_loss = policy_loss (its loss_agg_mode)
    + kl_coef · masked_mean(kl, action_mask) − entropy_coef · masked_mean(entropy)``."""
    rng = np.random.default_rng(0)
    b, g, t = 2, 3, 6
    lengths = rng.integers(1, t + 1, (b, g))
    mask = np.arange(t) < lengths[..., None]
    logp = np.where(mask, -rng.uniform(0.1, 3.0, (b, g, t)), 0.0)
    ref = np.where(mask, logp + rng.normal(0, 0.3, (b, g, t)), 0.0)
    ent = np.where(mask, rng.uniform(0.5, 2.0, (b, g, t)), 0.0)
    adv = np.where(mask, rng.normal(size=(b, g, 1)), 0.0)
    obj = _openrlhf().objective
    terms = rc.policy_objective(
        obj,
        jnp.asarray(logp, jnp.float32),
        jnp.asarray(adv, jnp.float32),
        jnp.asarray(mask),
        logp_ref_bgt=jnp.asarray(ref, jnp.float32),
        entropy_bgt=jnp.asarray(ent, jnp.float32),
    )
    loss = float(terms.total[0] / terms.total[1])
    # slow reference: on-policy ratio 1, so the PPO surrogate is −A per token
    pg = np.mean([np.mean(-adv[i, j, : lengths[i, j]]) for i in range(b) for j in range(g)])
    d = ref - logp
    k3 = np.exp(d) - 1 - d  # k3(π ‖ π_ref), OpenRLHF's compute_approx_kl("k3")
    want = pg + BETA * k3[mask].mean() - COEF * ent[mask].mean()
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    # following the loss's aggregation instead gives a different number here
    follow = obj._replace(token_mean_kl=False, token_mean_entropy=False)
    other = rc.policy_objective(
        follow,
        jnp.asarray(logp, jnp.float32),
        jnp.asarray(adv, jnp.float32),
        jnp.asarray(mask),
        logp_ref_bgt=jnp.asarray(ref, jnp.float32),
        entropy_bgt=jnp.asarray(ent, jnp.float32),
    )
    assert abs(float(other.total[0] / other.total[1]) - want) > 1e-4


def test_token_mean_terms_are_exact_under_micro_batching_and_packing():
    from tests.train.test_update import packed_of

    rec = _openrlhf()
    lm = H.tiny_lm(0)
    tx = optax.sgd(0.1)
    graphdef, _, state = H.fresh_state(lm, tx, rec)
    batch = H.synthetic_batch(n=8, completion_len=5, prompt_len=6)

    def run(b, **kw):
        s = jax.tree.map(jnp.copy, state)
        return up.make_update_step(rec, graphdef, tx, **kw)(s, b)

    whole, m_whole = run(batch)
    micro, m_micro = run(batch, micro_batch_size=2)
    _, packed = packed_of(batch, budget=16)
    pack, m_pack = run(packed, packed=True)
    for m in (m_micro, m_pack):
        assert abs(m["actor/loss"] - m_whole["actor/loss"]) < 1e-5
    assert H.tree_max_diff(micro.params, whole.params) < 1e-5
    assert H.tree_max_diff(pack.params, whole.params) < 1e-5


@pytest.mark.parametrize("numerics", ["openrlhf", "trl"])
def test_term_scales_are_loss_over_token_denominators(numerics):
    obj = algorithms.grpo(
        numerics=numerics,
        beta=BETA,
        entropy_coef=COEF,
        loss_agg_mode="seq-mean-token-mean",
        **({"kl_in_reward": False} if numerics == "openrlhf" else {}),
    ).objective
    mask = jnp.asarray(np.arange(5) < np.array([[5], [2], [0], [3]]))
    s = rc.term_scales(obj, mask)
    assert float(s.entropy) == pytest.approx(3 / 10)  # 3 non-empty sequences / 10 tokens
    assert (s.kl is None) == (numerics == "trl")


def test_explain_says_the_terms_are_token_means():
    from jaxrl_llm.explain import explain

    e = explain(_openrlhf())
    assert "a token mean, not seq-mean-token-mean" in e.kl
    assert "entropy bonus 0.01 (a token mean)" in e.objective
    plain = explain(algorithms.grpo(beta=BETA, entropy_coef=COEF))
    assert "token mean" not in plain.kl and "(a token mean)" not in plain.objective


# ---------------------------------------------------------------------------------------------
# TRL's top_entropy_quantile (grpo(top_entropy_quantile=ρ)).

ENT = np.load(Path(__file__).resolve().parents[1] / "fixtures" / "trl_entropy_mask.npz")


@pytest.mark.parametrize(
    ("loss_type", "rho", "beta"), [("grpo", 0.2, 0.0), ("grpo", 0.5, 0.04), ("dapo", 0.2, 0.04)]
)
def test_top_entropy_quantile_matches_trl(loss_type, rho, beta):
    agg = "seq-mean-token-mean" if loss_type == "grpo" else "token-mean"
    rec = algorithms.grpo(numerics="trl", beta=beta, top_entropy_quantile=rho, loss_agg_mode=agg)
    f = {k[3:]: ENT[k] for k in ENT.files if k.startswith("in_")}
    mask = jnp.asarray(f["mask"])
    adv = jnp.where(mask, jnp.asarray(f["adv_n"])[:, None], 0.0).astype(jnp.float32)

    def loss(logp):
        terms = rc.policy_objective(
            rec,
            logp,
            adv,
            mask,
            logp_old_bgt=jnp.asarray(f["logp_old"], jnp.float32),
            logp_ref_bgt=jnp.asarray(f["logp_ref"], jnp.float32) if beta else None,
            entropy_bgt=jnp.asarray(f["entropy"], jnp.float32),
        )
        return terms.total[0] / terms.total[1]

    value, grad = jax.value_and_grad(loss)(jnp.asarray(f["logp"], jnp.float32))
    key = f"{loss_type}/{rho:g}/{beta:g}"
    np.testing.assert_allclose(float(value), ENT[f"{key}/loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), ENT[f"{key}/grad"], rtol=1e-4, atol=1e-6)


def test_high_entropy_mask_keeps_the_top_quantile_of_valid_tokens():
    h = jnp.asarray([[0.1, 0.5, 0.9, 5.0], [0.3, 0.7, 9.0, 9.0]])
    mask = jnp.asarray([[True, True, True, False], [True, True, False, False]])
    keep = np.asarray(rc.high_entropy_mask(h, mask, 0.4))  # 5 valid: threshold = q(0.6)
    valid = np.asarray(h)[np.asarray(mask)]
    thr = np.quantile(valid, 0.6)
    np.testing.assert_array_equal(keep, np.asarray(mask) & (np.asarray(h) >= thr))
    assert not keep[0, 3] and not keep[1, 2]  # padding never kept, however high
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        algorithms.grpo(top_entropy_quantile=0.0)
