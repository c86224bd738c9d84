"""jaxrl_llm.train.update: every recipe's step, exact accumulation, sharding, TIS, DPO."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm import algorithms
from jaxrl_llm.models import sharding as shd
from jaxrl_llm.train import state as st
from jaxrl_llm.train import update as up
from tests.train import helpers as H

ONLINE = [n for n in algorithms.ONLINE_RECIPES]


def grad_capture() -> optax.GradientTransformation:
    """An 'optimizer' that stores the gradient it is given in its state (params unchanged)."""
    return optax.GradientTransformation(
        lambda p: {"g": jax.tree.map(jnp.zeros_like, p)},
        lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), {"g": g}),
    )


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _setup(name, tx=None, *, critic_tx=None, seed=0, **hparams):
    rec = H.recipe(name, **hparams)
    lm = H.tiny_lm(seed)
    critic = H.tiny_critic(lm) if rec.critic is not None else None
    tx = tx or optax.adam(1e-2)
    if critic is not None:
        critic_tx = critic_tx or optax.adam(1e-2)
    graphdef, critic_graphdef, state = H.fresh_state(
        lm, tx, rec, critic=critic, critic_tx=critic_tx
    )
    return rec, graphdef, critic_graphdef, state, tx, critic_tx


@pytest.mark.parametrize("name", ONLINE)
def test_one_step_per_recipe(name):
    """One update of a synthetic rollout: finite metrics, the parameters move."""
    hp = {"beta": 0.05} if name in ("grpo", "dapo", "gspo", "dr_grpo") else {}
    rec, gd, cgd, state, tx, ctx = _setup(name, **hp)
    batch = H.synthetic_batch(values=rec.critic is not None)
    step = up.make_update_step(rec, gd, tx, critic_graphdef=cgd, critic_tx=ctx)
    before = _copy(state.params)
    state, metrics = step(state, batch)
    assert int(state.step) == 1
    for key in (
        "actor/loss",
        "actor/pg_loss",
        "actor/entropy",
        "actor/clip_fraction",
        "actor/grad_norm",
        "actor/kl_ref",
    ):
        assert np.isfinite(float(metrics[key])), key
    assert float(metrics["update/nonfinite"]) == 0
    assert H.tree_max_diff(before, state.params) > 0
    if rec.critic is not None:
        assert np.isfinite(float(metrics["critic/loss"]))
        assert "critic/grad_norm" in metrics


def test_loss_decreases_on_a_fixed_batch_and_nonfinite_updates_are_skipped():
    rec, gd, _, state, tx, _ = _setup("grpo", optax.adam(3e-3), beta=0.0)
    batch = H.synthetic_batch(ref=False)
    from jaxrl_llm.train import forward

    logp_old = forward.make_logprob_fn(gd)(
        state.params, batch.tokens_nl, batch.input_mask_nl, completion_len=batch.mask_nt.shape[1]
    )
    batch = batch._replace(logp_old_nt=logp_old)
    step = up.make_update_step(rec, gd, tx)
    losses = []
    for _ in range(5):
        state, m = step(state, batch)
        losses.append(float(m["actor/loss"]))
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert float(m["actor/clip_fraction"]) > 0  # the ratio left the trust region
    # A NaN advantage: the update is skipped, parameters and optimizer state are kept.
    bad = batch._replace(adv_nt=batch.adv_nt.at[0, 0].set(jnp.nan))
    before = _copy(state)
    state, m = step(state, bad)
    assert float(m["update/nonfinite"]) == 1.0 and int(state.step) == 6
    assert H.tree_max_diff(before.params, state.params) == 0.0
    assert H.tree_max_diff(before.opt_state, state.opt_state) == 0.0


def _grads(name, micro, *, num_minibatches=1, mesh=None, n=8, **hp):
    rec, gd, cgd, state, _, _ = _setup(name, grad_capture(), critic_tx=grad_capture(), **hp)
    batch = H.synthetic_batch(n=n, values=rec.critic is not None, sampler=False)
    sharding = None
    if mesh is not None:
        skeleton = state._replace(opt_state=None, critic_opt_state=None)
        sharding = st.state_shardings(
            skeleton,
            mesh,
            param_sharding=jax.tree.map(lambda _: st.replicated(mesh), state.params),
            tx=grad_capture(),
            critic_param_sharding=None
            if cgd is None
            else jax.tree.map(lambda _: st.replicated(mesh), state.critic_params),
            critic_tx=grad_capture(),
        )
        state = jax.device_put(state, sharding)
    step = up.make_update_step(
        rec,
        gd,
        grad_capture(),
        critic_graphdef=cgd,
        critic_tx=grad_capture(),
        micro_batch_size=micro,
        num_minibatches=num_minibatches,
        mesh=mesh,
        state_sharding=sharding,
        rules=shd.DP_RULES,
    )
    state, metrics = step(state, batch)
    critic = None if cgd is None else state.critic_opt_state["g"]
    return state.opt_state["g"], critic, metrics


@pytest.mark.parametrize(
    "name,hp",
    [("grpo", {"beta": 0.04, "entropy_coef": 0.01}), ("ppo", {})],
)
def test_micro_batches_equal_one_batch(name, hp):
    g_full, c_full, m_full = _grads(name, None, **hp)
    g_micro, c_micro, m_micro = _grads(name, 2, **hp)
    assert H.tree_max_diff(g_full, g_micro) < 1e-6
    assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g_full)) > 1e-3
    if c_full is not None:
        assert H.tree_max_diff(c_full, c_micro) < 1e-6
    np.testing.assert_allclose(m_full["actor/loss"], m_micro["actor/loss"], rtol=1e-6, atol=1e-7)


def test_data_parallel_mesh_equals_one_device():
    mesh = shd.make_mesh(data=8)
    g_one, _, m_one = _grads("grpo", 8, n=16, beta=0.04)
    g_dp, _, m_dp = _grads("grpo", 8, n=16, mesh=mesh, beta=0.04)
    assert H.tree_max_diff(g_one, g_dp) < 1e-6
    np.testing.assert_allclose(m_one["actor/loss"], m_dp["actor/loss"], rtol=2e-6, atol=1e-7)


def test_sampler_logprobs_with_truncated_importance_sampling():
    rec, gd, _, state, _, _ = _setup("grpo", grad_capture(), beta=0.0)
    batch = H.synthetic_batch(ref=False)
    from jaxrl_llm.train import forward

    logp = forward.make_logprob_fn(gd)(
        state.params, batch.tokens_nl, batch.input_mask_nl, completion_len=batch.mask_nt.shape[1]
    )
    step = up.make_update_step(rec, gd, grad_capture(), tis_cap=2.0)
    # The sampler agrees with the trainer: w = 1, the on-policy gradient.
    s1, m1 = step(_copy(state), batch._replace(logp_sampler_nt=logp))
    assert float(m1["tis/weight_mean"]) == pytest.approx(1.0, abs=1e-6)
    assert float(m1["tis/capped_fraction"]) == 0.0
    # A sampler that found every token 4x less likely than the trainer: w = min(4, 2) = 2.
    s2, m2 = step(_copy(state), batch._replace(logp_sampler_nt=logp - jnp.log(4.0)))
    assert float(m2["tis/capped_fraction"]) == pytest.approx(1.0)
    assert float(m2["tis/weight_mean"]) == pytest.approx(2.0, rel=1e-5)
    for a, b in zip(
        jax.tree.leaves(s2.opt_state["g"]), jax.tree.leaves(s1.opt_state["g"]), strict=True
    ):
        np.testing.assert_allclose(a, 2.0 * b, rtol=1e-4, atol=1e-8)


def _dpo_batch(seed=0, n=4, ref=True):
    b = H.synthetic_batch(seed, n=n, ref=False)
    r = H.synthetic_batch(seed + 1, n=n, ref=False)
    rng = np.random.default_rng(seed)
    return up.DPOBatch(
        chosen_tokens_nl=b.tokens_nl,
        chosen_input_mask_nl=b.input_mask_nl,
        chosen_mask_nt=b.mask_nt,
        rejected_tokens_nl=r.tokens_nl.at[:, :6].set(b.tokens_nl[:, :6]),
        rejected_input_mask_nl=r.input_mask_nl.at[:, :6].set(b.input_mask_nl[:, :6]),
        rejected_mask_nt=r.mask_nt,
        ref_chosen_n=jnp.asarray(rng.normal(size=n) - 8, jnp.float32) if ref else None,
        ref_rejected_n=jnp.asarray(rng.normal(size=n) - 8, jnp.float32) if ref else None,
    )


def test_dpo_step_learns_and_accumulates_exactly():
    rec = algorithms.dpo(beta=0.1)
    lm = H.tiny_lm()
    gd, _, state = H.fresh_state(lm, optax.adam(1e-2), rec)
    batch = _dpo_batch()
    step = up.make_dpo_step(rec, gd, optax.adam(1e-2))
    losses = []
    for _ in range(4):
        state, m = step(state, batch)
        losses.append(float(m["actor/loss"]))
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert 0 <= float(m["dpo/reward_accuracy"]) <= 1
    # Exact accumulation, on the reference-free SimPO loss (no reference log-probs needed).
    simpo = algorithms.dpo(loss_type="simpo", beta=2.0)
    grads, metrics = [], []
    for micro in (None, 2):
        _, _, s = H.fresh_state(H.tiny_lm(), grad_capture(), simpo)
        step = up.make_dpo_step(simpo, gd, grad_capture(), micro_batch_size=micro)
        s, m = step(s, _dpo_batch(ref=False))
        grads.append(s.opt_state["g"])
        metrics.append(m)
    assert H.tree_max_diff(*grads) < 1e-6
    assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(grads[0])) > 1e-4
    assert np.isfinite(float(metrics[1]["actor/loss"])) and "dpo/reward_accuracy" not in metrics[1]


# ---------------------------------------------------------------------------------------------
# Packed updates: equal to unpacked, for every recipe and every aggregation mode.

from jaxrl_llm import recipe as _rc  # noqa: E402
from jaxrl_llm.train import packing as _pk  # noqa: E402

KL_RECIPES = ("grpo", "dapo", "gspo", "dr_grpo")
# Clip-Cov and KL-Cov choose tokens by the covariance statistics of each micro-batch (as verl
# does): token-budget micro-batches of a packed update group other sequences, so they are not
# packing-invariant by construction (documented in core.policy_losses.clip_cov_loss). With one
# micro-batch per minibatch packed still equals unpacked, which is what they are tested on.
MICRO_BATCH_DEPENDENT = ("clip_cov", "kl_cov")
PACK_CASES = [(name, None, True) for name in ONLINE] + [
    ("grpo", mode, True) for mode in _rc.AGGREGATIONS if mode != "seq-mean-token-mean"
]
PACK_CASES += [("ppo", None, False), ("grpo", "seq-mean-token-sum", False)]  # LM head everywhere


def packed_of(batch, *, num_minibatches=1, budget=None, targets=True):
    """The packed batch as the trainer builds it (``targets``: the LM head on the completion
    columns only, ``PackShape.targets``; False: on every column of the rows)."""
    input_mask = np.asarray(batch.input_mask_nl)
    t = batch.mask_nt.shape[1]
    plan = _pk.make_plan(
        input_mask.sum(1),
        max_len=batch.tokens_nl.shape[1],
        num_minibatches=num_minibatches,
        micro_batch_tokens=budget,
        target_n=input_mask[:, -t:].sum(1) if targets else None,
    )
    assert (plan.shape.targets is not None) == targets
    return plan, up.packed_batch(batch, plan.device_arrays(), plan.shape)


@pytest.mark.parametrize(("name", "mode", "targets"), PACK_CASES)
def test_packed_update_equals_unpacked(name, mode, targets):
    """Loss, metrics and gradients of a packed update (two minibatches, token-budget
    micro-batches, ≥ 2 micro-batches each) equal the unpacked update's, with π_old, π_ref, the
    sampler's log-probs (TIS for the on-policy losses) and PPO's values given."""
    hp = {"beta": 0.05} if name in KL_RECIPES else {}
    if mode is not None:
        hp["loss_agg_mode"] = mode
    rec, gd, cgd, state, tx, ctx = _setup(name, grad_capture(), critic_tx=grad_capture(), **hp)
    batch = H.synthetic_batch(3, n=8, prompt_len=6, completion_len=9, values=rec.critic is not None)
    rng = np.random.default_rng(5)
    noise = jnp.asarray(rng.normal(0, 0.3, batch.mask_nt.shape), jnp.float32)
    if name == "reinforce":  # on-policy: the sampler's log-probs with truncated IS
        batch = batch._replace(logp_sampler_nt=jnp.where(batch.mask_nt, -1.0 + noise, 0.0))
    else:
        batch = batch._replace(logp_old_nt=jnp.where(batch.mask_nt, -1.5 + noise, 0.0))
    # Clip-/KL-Cov choose tokens by each micro-batch's statistics (not additive over
    # micro-batches, core.policy_losses): packed equals unpacked with whole minibatches.
    additive = name not in MICRO_BATCH_DEPENDENT
    plan, packed = packed_of(
        batch, num_minibatches=2, budget=16 if additive else None, targets=targets
    )
    assert int(np.min(plan.count_m)) >= (2 if additive else 1)
    kw = dict(critic_graphdef=cgd, critic_tx=ctx if cgd is not None else None, tis_cap=2.0)
    flat = up.make_update_step(rec, gd, tx, num_minibatches=2, **kw)
    pack = up.make_update_step(rec, gd, tx, packed=True, **kw)
    s_flat, m_flat = flat(_copy(state), batch)
    s_pack, m_pack = pack(_copy(state), packed)
    assert set(m_flat) == set(m_pack)
    for key in m_flat:
        np.testing.assert_allclose(float(m_pack[key]), float(m_flat[key]), rtol=2e-5, atol=2e-6)
    assert abs(float(m_flat["actor/loss"])) > 1e-4
    # The last minibatch's gradient (captured), policy and critic.
    g_flat, g_pack = s_flat.opt_state["g"], s_pack.opt_state["g"]
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g_flat))
    assert scale > 0
    assert H.tree_max_diff(g_flat, g_pack) <= 1e-5 * max(scale, 1.0)
    if cgd is not None:
        assert H.tree_max_diff(s_flat.critic_opt_state["g"], s_pack.critic_opt_state["g"]) < 1e-5


def test_packed_update_trains_like_unpacked_over_epochs():
    """Two epochs × two minibatches of Adam: the packed parameters track the unpacked ones, and
    a different micro-batch count (another budget) of the same shapes reuses the program."""
    rec, gd, _, state, tx, _ = _setup("grpo", optax.adam(1e-2, eps=1e-3), beta=0.05)
    batch = H.synthetic_batch(4, n=8, completion_len=9)
    batch = batch._replace(logp_old_nt=jnp.where(batch.mask_nt, -1.5, 0.0))
    flat = up.make_update_step(rec, gd, tx, ppo_epochs=2, num_minibatches=2)
    pack = up.make_update_step(rec, gd, tx, ppo_epochs=2, packed=True)
    s_flat, _ = flat(_copy(state), batch)
    _, packed = packed_of(batch, num_minibatches=2, budget=48)
    s_pack, _ = pack(_copy(state), packed)
    assert H.tree_max_diff(s_flat.params, s_pack.params) < 2e-5


def test_packed_update_refuses_the_wrong_batch():
    rec, gd, _, state, tx, _ = _setup("grpo")
    step = up.make_update_step(rec, gd, tx, packed=True)
    with pytest.raises(ValueError, match=r"packed=True.*UpdateBatch"):
        step(state, H.synthetic_batch())


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_packed_update_of_a_rematerialised_model_fuses_its_accumulation(name, monkeypatch):
    """``remat="full"``: the layer scans' backward passes add into the micro-batch
    accumulators (``models/grad_accumulation``; the policy's and PPO's critic's), and the
    packed, micro-batched update's gradients equal those of the same model without remat."""
    from jaxrl_llm.models import grad_accumulation as ga

    fused = []
    plain_scan = ga.scan
    monkeypatch.setattr(ga, "scan", lambda *a, **k: fused.append(plain_scan(*a, **k)) or fused[-1])
    hp = {"beta": 0.05} if name == "grpo" else {}
    rec = H.recipe(name, **hp)
    batch = H.synthetic_batch(3, n=8, prompt_len=6, completion_len=9, values=rec.critic is not None)
    batch = batch._replace(logp_old_nt=jnp.where(batch.mask_nt, -1.5, 0.0))
    plan, packed = packed_of(batch, num_minibatches=2, budget=16)
    assert int(np.min(plan.count_m)) >= 2
    grads = {}
    for remat in ("none", "full"):
        lm = H.tiny_lm(0, num_layers=2, remat=remat)
        critic = H.tiny_critic(lm) if rec.critic is not None else None
        gd, cgd, state = H.fresh_state(
            lm, grad_capture(), rec, critic=critic, critic_tx=grad_capture()
        )
        kw = dict(critic_graphdef=cgd, critic_tx=grad_capture() if cgd is not None else None)
        step = up.make_update_step(rec, gd, grad_capture(), packed=True, **kw)
        state, _ = step(state, packed)
        grads[remat] = (state.opt_state["g"], state.critic_opt_state)
    assert sum(f is not None for f in fused) == (2 if rec.critic is not None else 1)
    g_none, g_full = grads["none"][0], grads["full"][0]
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g_none))
    assert scale > 1e-3
    assert H.tree_max_diff(g_none, g_full) <= 1e-5 * scale
    if rec.critic is not None:
        assert H.tree_max_diff(grads["none"][1]["g"], grads["full"][1]["g"]) <= 1e-5
