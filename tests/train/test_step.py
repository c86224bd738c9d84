"""jaxrl_llm.train.step: the fused device step against an unfused reference.

The reference is the obvious program built from the public pieces, one jit per piece: the
``[N, P + T]`` rows concatenated on the host, ``forward.make_logprob_fn`` / ``make_value_fn`` for
π_old, π_ref and V, ``chain.apply`` for the advantages and the chain's new state,
``recipe.value_targets`` for the critic, and the jitted ``update.make_update_step`` (same
shardings) on an :class:`~jaxrl_llm.train.update.UpdateBatch`. The fused step must give the same
parameters, optimizer states, chain state and metrics, to float32 tolerance (XLA may fuse and
sum in another order).

Cases: GRPO with β > 0 (reference model, KL in the loss), REINFORCE++ with the KL in the reward
(the chain reads π_old: a recompute pass; two minibatches of micro-batches), PPO with a critic
and an adaptive KL controller (value targets, the chain's state updated; two epochs), and the
sampler's log-probs with truncated IS. Every run starts from a state whose policy has moved away
from the reference (its parameters perturbed), so the KL terms are not zero. Also: the step is
one compiled program and steady-state calls compile nothing (counted with ``jax.monitoring``'s
backend-compile events); 8 fake CPU devices give the 1-device result; when π_old is recomputed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import chain as ch
from jaxrl_llm import recipe as rc
from jaxrl_llm.train import forward
from jaxrl_llm.train import setup as S
from jaxrl_llm.train import state as st
from jaxrl_llm.train import update as up
from jaxrl_llm.train.hostmem import BACKEND_COMPILE_EVENT
from jaxrl_llm.train.step import Groups, make_rl_step, needs_old_logprob_pass
from tests.train import helpers as H

PAD = 2  # SmolLM2's pad/eos id (tiny-random's vocabulary)
PROMPT_LEN = 8
SMALL = (
    "rollout.prompts_per_step=2",
    "rollout.num_samples=4",
    "rollout.max_new_tokens=6",
    # Adam's first step is lr·g/(|g| + ε): with ε = 1e-8 it is lr·sign(g), and float32 noise on
    # a gradient entry near 0 (another summation order) moves that entry by up to 2·lr. A larger
    # ε makes the update Lipschitz in g, so parameters compare at float32 tolerance.
    "optim.adam_eps=1e-3",
    # The reference checks below build the unpacked step by hand; the packed tests add PACKED.
    "train.packing=false",
)

# ---------------------------------------------------------------------------------------------
# Inputs.


def make_groups(setup: S.Setup, seed: int, *, near: jax.Array | None = None) -> Groups:
    """Synthetic groups of the setup's shape: left-padded random prompts, random completions with
    ragged lengths (one of each length 1 and T), sampler log-probs (``near``: the trainer's
    ``f32[B, G, T]`` log-probs plus noise, else random), random rewards, one non-member."""
    b, g, t = setup.loop.batch_size, setup.sampler.num_samples, setup.sampler.max_new_tokens
    vocab = setup.policy().config.vocab_size
    rng = np.random.default_rng(seed)
    p_len = rng.integers(2, PROMPT_LEN + 1, b)
    p_len[0] = PROMPT_LEN
    prompt_mask = np.arange(PROMPT_LEN)[None, :] >= (PROMPT_LEN - p_len)[:, None]
    prompt_ids = np.where(prompt_mask, rng.integers(3, vocab, (b, PROMPT_LEN)), PAD)
    c_len = rng.integers(1, t + 1, (b, g))
    c_len[0, 0], c_len[-1, -1] = t, 1
    mask = np.arange(t) < c_len[..., None]
    tokens = np.where(mask, rng.integers(3, vocab, (b, g, t)), PAD)
    if near is None:
        logp = -rng.uniform(0.5, 12.0, (b, g, t))
    else:
        logp = np.asarray(near) + rng.normal(0.0, 0.5, (b, g, t))
    member = np.ones((b, g), bool)
    member[-1, 0] = False
    return Groups(
        prompt_ids_bp=prompt_ids.astype(np.int32),
        prompt_mask_bp=prompt_mask,
        tokens_bgt=tokens.astype(np.int32),
        mask_bgt=mask,
        logp_sampler_bgt=np.where(mask, logp, 0.0).astype(np.float32),
        reward_bg=rng.normal(size=(b, g)).astype(np.float32),
        member_bg=member,
    )


def rows(groups: Groups) -> tuple[np.ndarray, np.ndarray]:
    """``[N, P + T]`` token ids and attention mask, row ``b·G + g`` = prompt b ⧺ completion g."""
    b, g, t = groups.tokens_bgt.shape
    prompt = np.repeat(groups.prompt_ids_bp, g, axis=0)
    prompt_mask = np.repeat(groups.prompt_mask_bp, g, axis=0)
    tokens = np.concatenate([prompt, groups.tokens_bgt.reshape(b * g, t)], axis=1)
    mask = np.concatenate([prompt_mask, groups.mask_bgt.reshape(b * g, t)], axis=1)
    return tokens, mask


def moved_state(setup: S.Setup, seed: int = 0) -> st.TrainState:
    """A copy of the fresh state whose policy parameters moved away from the reference."""
    rng = np.random.default_rng(seed)
    copy = jax.tree.map(jnp.copy, setup.state)
    params = jax.tree.map(
        lambda p: p + jnp.asarray(0.02 * rng.normal(size=p.shape), p.dtype), copy.params
    )
    return jax.device_put(copy._replace(params=params), setup.state_sharding)


def copy(tree):
    return jax.tree.map(jnp.copy, tree)


def resolve(*overrides: str) -> S.Setup:
    return S.resolve(H.config("tiny.yaml", *SMALL, *overrides))


def trainer_logprobs(setup: S.Setup, state: st.TrainState, groups: Groups) -> jax.Array:
    fn = forward.make_logprob_fn(setup.models.graphdef, temperature=setup.sampler.temperature)
    tokens, mask = rows(groups)
    t = groups.tokens_bgt.shape[-1]
    logp = fn(state.params, tokens, mask, completion_len=t)
    return logp.reshape(groups.tokens_bgt.shape)


# ---------------------------------------------------------------------------------------------
# The unfused reference.


def reference_step(setup: S.Setup, state: st.TrainState, groups: Groups):
    """``(new_state, metrics, adv_bgt, token_mask_bgt)`` of the step, piece by piece."""
    recipe, models, shape, old = setup.recipe, setup.models, setup.update, setup.old_logprobs
    temperature = setup.sampler.temperature
    b, g, t = groups.tokens_bgt.shape
    n = b * g
    tokens, input_mask = rows(groups)
    tokens_d, input_mask_d = models.to_device(tokens), models.to_device(input_mask)
    reads_old = rc.BEHAVIOUR_LOGPROBS in recipe.requires
    # π_old is recomputed when it changes the numbers: several updates per batch, or a chain
    # that reads the rollout policy's log-probs. The sampler's log-probs are never recomputed.
    recompute = old.source == "recompute" and (
        shape.epochs * shape.num_minibatches > 1 or reads_old
    )
    logprob = forward.make_logprob_fn(
        models.graphdef, temperature=temperature, micro_batch_size=shape.micro_batch_size
    )
    bgt = lambda x_nt: None if x_nt is None else x_nt.reshape(b, g, t)
    logp_old = logp_ref = values = None
    with jax.set_mesh(models.mesh):
        if recompute:
            logp_old = bgt(logprob(state.params, tokens_d, input_mask_d, completion_len=t))
        if models.ref_params is not None:
            logp_ref = bgt(logprob(models.ref_params, tokens_d, input_mask_d, completion_len=t))
        if recipe.critic is not None:
            value_fn = forward.make_value_fn(
                models.critic_graphdef, micro_batch_size=shape.micro_batch_size
            )
            values = bgt(value_fn(state.critic_params, tokens_d, input_mask_d, completion_len=t))
    sampler = jnp.asarray(groups.logp_sampler_bgt)
    chain_old = logp_old if logp_old is not None else (sampler if old.source == "sampler" else None)
    rollout = ch.Rollout(
        reward_bg=jnp.asarray(groups.reward_bg),
        mask_bgt=jnp.asarray(groups.mask_bgt),
        mask_bg=jnp.asarray(groups.member_bg),
        logp_old_bgt=chain_old,
        logp_ref_bgt=logp_ref,
        value_bgt=values,
    )
    adv, kl_state = ch.apply(recipe.advantage, rollout, state.kl_state)
    returns = None
    if recipe.critic is not None:
        returns = rc.value_targets(recipe, rollout, state.kl_state)
    token_mask = ch.token_mask(rollout)
    nt = lambda x: None if x is None else x.reshape(n, t)
    batch = up.UpdateBatch(
        tokens_nl=tokens_d,
        input_mask_nl=input_mask_d,
        mask_nt=nt(token_mask),
        adv_nt=nt(adv),
        logp_old_nt=nt(logp_old),
        logp_sampler_nt=nt(sampler) if old.source == "sampler" else None,
        logp_ref_nt=nt(logp_ref),
        value_old_nt=nt(values),
        return_nt=nt(returns),
    )
    update = up.make_update_step(
        recipe,
        models.graphdef,
        models.tx,
        schedule=models.schedule,
        critic_graphdef=models.critic_graphdef,
        critic_tx=models.critic_tx,
        critic_schedule=models.critic_schedule,
        ppo_epochs=shape.epochs,
        num_minibatches=shape.num_minibatches,
        micro_batch_size=shape.micro_batch_size,
        temperature=temperature,
        tis_cap=old.tis_cap,
        mesh=models.mesh,
        state_sharding=models.state_sharding,
        rules=models.rules,
    )
    beta = st.kl_beta(kl_state)
    beta = None if beta is None else float(beta)  # (read before the state is donated)
    new_state, update_metrics = update(state._replace(kl_state=kl_state), batch)
    metrics = {k: float(v) for k, v in update_metrics.items()}
    # The step's own metrics, in numpy.
    mask_np, adv_np = np.asarray(token_mask), np.asarray(adv)
    valid = adv_np[mask_np]
    metrics["advantages/mean"] = float(valid.mean())
    metrics["advantages/std"] = float(valid.std())
    metrics["advantages/min"] = float(valid.min())
    metrics["advantages/max"] = float(valid.max())
    metrics["perf/tokens"] = float(input_mask.sum())
    if beta is not None:
        metrics["kl/beta"] = beta
    if reads_old and logp_ref is not None:
        kl = np.where(mask_np, np.asarray(chain_old) - np.asarray(logp_ref), 0.0)
        count = mask_np.sum(-1)
        seq = kl.sum(-1)[count > 0] / count[count > 0]
        metrics["kl/rollout"] = float(seq.mean())
    return new_state, metrics, adv_np, mask_np


# ---------------------------------------------------------------------------------------------
# Comparisons.


def assert_trees_close(a, b, *, rtol: float = 1e-5, what: str = "") -> None:
    """Leaf by leaf: ``max |a − b| ≤ rtol · max(|b|)`` (plus a float32 floor)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b), what
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = float(np.max(np.abs(y))) if y.size else 0.0
        err = float(np.max(np.abs(x - y))) if y.size else 0.0
        assert err <= rtol * scale + 1e-9, f"{what} leaf {i}: |Δ| = {err:.3g}, scale {scale:.3g}"


def assert_metrics_close(got: dict, want: dict, *, rtol: float = 1e-5, atol: float = 1e-6):
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=rtol, atol=atol, err_msg=key)


def check_against_reference(setup: S.Setup, groups: Groups):
    """Runs the fused step and the reference from the same moved state; returns both."""
    state = moved_state(setup)
    ref_state, ref_metrics, adv, mask = reference_step(setup, copy(state), groups)
    step = make_rl_step(
        setup.recipe,
        setup.models,
        setup.update,
        temperature=setup.sampler.temperature,
        old_logprobs=setup.old_logprobs,
    )
    with CompileCounter() as compiles:
        new_state, metrics = step(copy(state), groups)
    assert compiles.count == 1  # the whole step is one program
    assert all(isinstance(v, float) for v in metrics.values())
    assert int(new_state.step) == int(ref_state.step) == 1
    assert_metrics_close(metrics, ref_metrics)
    # The update moved the policy, and both programs moved it the same way.
    assert H.tree_max_diff(new_state.params, state.params) > 0
    assert_trees_close(new_state.params, ref_state.params, what="params")
    assert_trees_close(new_state.opt_state, ref_state.opt_state, what="opt_state")
    assert_trees_close(new_state.kl_state, ref_state.kl_state, what="kl_state")
    if setup.recipe.critic is not None:
        assert_trees_close(new_state.critic_params, ref_state.critic_params, what="critic")
        assert_trees_close(new_state.critic_opt_state, ref_state.critic_opt_state, what="c_opt")
    for x, sh in zip(
        jax.tree.leaves(new_state), jax.tree.leaves(setup.state_sharding), strict=True
    ):
        assert x.sharding.is_equivalent_to(sh, x.ndim)
    return step, new_state, metrics, adv, mask


class CompileCounter:
    """Counts XLA backend compiles while active."""

    def __init__(self):
        self.count = 0

    def __call__(self, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


# ---------------------------------------------------------------------------------------------
# The recipes.


def test_grpo_with_the_kl_in_the_loss_matches_the_reference():
    setup = resolve("algorithm.hparams.beta=0.04")
    assert setup.models.ref_params is not None
    assert not needs_old_logprob_pass(setup.recipe, setup.update, setup.old_logprobs)
    _, _, metrics, adv, mask = check_against_reference(setup, make_groups(setup, 0))
    assert metrics["actor/kl_loss"] > 0 and metrics["actor/kl_ref"] > 0
    assert "kl/beta" not in metrics and "kl/rollout" not in metrics
    assert not mask[-1, 0].any() and np.all(adv[~mask] == 0)  # the non-member: no advantage


def test_reinforce_pp_with_the_kl_in_the_reward_recomputes_pi_old():
    setup = resolve(
        "algorithm.name=reinforce_pp",
        "algorithm.hparams.beta=0.05",
        "optim.num_minibatches=2",
        "optim.micro_batch_size=2",
    )
    assert rc.BEHAVIOUR_LOGPROBS in setup.recipe.requires
    assert needs_old_logprob_pass(setup.recipe, setup.update, setup.old_logprobs)
    _, _, metrics, _, _ = check_against_reference(setup, make_groups(setup, 1))
    assert abs(metrics["kl/rollout"]) > 1e-3  # π_old ≠ π_ref (k1 of random tokens: any sign)
    assert metrics["kl/beta"] == pytest.approx(0.05)  # a fixed β
    assert abs(metrics["advantages/mean"]) < 1e-5  # whitened over the batch


@pytest.mark.slow
def test_ppo_with_a_critic_and_an_adaptive_kl_matches_and_compiles_once():
    setup = resolve(
        "algorithm.name=ppo",
        "algorithm.hparams.beta=0.05",
        "kl.controller=adaptive",
        "kl.horizon=10",  # β moves visibly in one step
        "optim.ppo_epochs=2",
        "critic.lr=1e-3",
    )
    assert setup.recipe.critic is not None and setup.update.updates_per_step == 2
    beta0 = float(st.kl_beta(setup.state.kl_state))
    step, state, metrics, _, _ = check_against_reference(setup, make_groups(setup, 2))  # compiles
    assert metrics["kl/beta"] != pytest.approx(beta0)  # the controller moved β
    assert float(st.kl_beta(state.kl_state)) == pytest.approx(metrics["kl/beta"])
    for key in ("critic/loss", "critic/value_mean", "critic/grad_norm", "critic/lr"):
        assert key in metrics, key
    # Steady state: new groups of the same shape, a new β in the state; nothing compiles.
    with CompileCounter() as later:
        for seed in (3, 4):
            state, metrics = step(state, make_groups(setup, seed))
    assert later.count == 0
    assert int(state.step) == 3 and np.isfinite(list(metrics.values())).all()


def test_sampler_logprobs_with_truncated_importance_sampling():
    setup = resolve(
        "algorithm.hparams.beta=0.0",
        "old_logprobs.source=sampler",
        "old_logprobs.tis_cap=1.5",
        "rollout.temperature=0.7",
    )
    assert setup.old_logprobs == S.OldLogprobs("sampler", 1.5)
    assert not needs_old_logprob_pass(setup.recipe, setup.update, setup.old_logprobs)
    probe = make_groups(setup, 5)
    near = trainer_logprobs(setup, moved_state(setup), probe)
    groups = make_groups(setup, 5, near=near)
    _, _, metrics, _, _ = check_against_reference(setup, groups)
    assert 0 < metrics["tis/capped_fraction"] < 1
    assert metrics["tis/weight_mean"] != pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------
# Sharding.


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
@pytest.mark.parametrize(
    "overrides,mesh",
    [
        pytest.param(
            # B = 8 prompts: the groups are split over the 8 data-parallel shards; parameters
            # and optimizer moments over fsdp; two micro-batches of one row per device.
            ("rollout.prompts_per_step=8", "rollout.num_samples=2", "optim.micro_batch_size=8"),
            ("mesh.data=4", "mesh.fsdp=2", "mesh.preset=fsdp"),
            id="grpo-groups-split-fsdp",
        ),
        pytest.param(
            # The same with remat: the layer scan's backward pass adds into the micro-batch
            # gradient accumulators (models/grad_accumulation), sharded over fsdp.
            (
                "rollout.prompts_per_step=8",
                "rollout.num_samples=2",
                "optim.micro_batch_size=8",
                "model.remat=full",
            ),
            ("mesh.data=4", "mesh.fsdp=2", "mesh.preset=fsdp"),
            id="grpo-remat-fused-accumulation-fsdp",
        ),
        pytest.param(
            # B = 2 prompts on 8 shards: the groups are replicated, the N = 8 rows split; the
            # π_old pass, the KL in the reward and the batch whitening see the global batch.
            ("algorithm.name=reinforce_pp", "algorithm.hparams.beta=0.05"),
            ("mesh.data=8",),
            id="reinforce_pp-groups-replicated-dp",
        ),
    ],
)
def test_sharded_step_equals_one_device(overrides, mesh):
    one = resolve(*overrides)
    many = resolve(*overrides, *mesh)
    assert many.models.mesh.size == 8 and one.models.mesh.size == 1
    groups = make_groups(one, 6)
    results = []
    for setup in (one, many):
        step = make_rl_step(setup.recipe, setup.models, setup.update)
        state = moved_state(setup)
        with CompileCounter() as compiles:
            results.append(step(state, groups))
        assert compiles.count == 1
    (s1, m1), (s8, m8) = results
    assert_trees_close(s8.params, s1.params, what="params")
    assert_trees_close(s8.opt_state, s1.opt_state, what="opt_state")
    assert_trees_close(s8.kl_state, s1.kl_state, what="kl_state")
    assert_metrics_close(m8, m1)
    assert m1["actor/grad_norm"] > 0
    for x, sh in zip(jax.tree.leaves(s8), jax.tree.leaves(many.state_sharding), strict=True):
        assert x.sharding.is_equivalent_to(sh, x.ndim)
    if many.models.mesh.shape["fsdp"] > 1:
        assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(s8.params))


# ---------------------------------------------------------------------------------------------
# When π_old is recomputed.


def test_needs_old_logprob_pass_truth_table():
    grpo = H.recipe("grpo", beta=0.04)  # KL in the loss: the chain does not read π_old
    rloo = H.recipe("rloo", beta=0.05)  # KL in the reward: the chain reads π_old
    rloo0 = H.recipe("rloo", beta=0.0)
    assert rc.BEHAVIOUR_LOGPROBS not in grpo.requires | rloo0.requires
    assert rc.BEHAVIOUR_LOGPROBS in rloo.requires
    recompute, sampler = S.OldLogprobs("recompute"), S.OldLogprobs("sampler", 2.0)
    U = S.UpdateShape
    table = [
        (grpo, U(), recompute, False),  # one on-policy update: π_old = sg(π_θ), no pass
        (grpo, U(micro_batch_size=2), recompute, False),  # micro-batches are one update
        (grpo, U(epochs=2), recompute, True),
        (grpo, U(num_minibatches=2), recompute, True),
        (grpo, U(epochs=2, num_minibatches=2), recompute, True),
        (rloo, U(), recompute, True),
        (rloo0, U(), recompute, False),
        (grpo, U(epochs=2, num_minibatches=2), sampler, False),  # the sampler's, never a pass
        (rloo, U(), sampler, False),
        (rloo, U(epochs=2), S.OldLogprobs("sampler", None), False),
    ]
    for recipe, shape, old, want in table:
        assert needs_old_logprob_pass(recipe, shape, old) is want, (recipe.name, shape, old)


# ---------------------------------------------------------------------------------------------
# Packing: the packed step equals the unpacked reference.

PACKED = ("train.packing=true",)
PACK_METRICS = {"perf/pack_rows_tokens", "perf/packed_tokens", "perf/padded_tokens"}


def check_packed_against_reference(
    setup: S.Setup, groups: Groups, reference: S.Setup | None = None
):
    """The packed fused step against the unpacked reference (same numbers, extra perf keys).
    ``reference``: the setup the reference runs with (default ``setup``; e.g. the reference
    attention where ``setup``'s kernel cannot take unpacked rows)."""
    assert setup.update.packing
    state = moved_state(setup)
    reference = reference or setup
    ref_state, ref_metrics, _, _ = reference_step(
        dataclasses.replace(
            reference,
            update=dataclasses.replace(setup.update, packing=False, micro_batch_size=None),
        ),
        copy(state),
        groups,
    )
    step = make_rl_step(
        setup.recipe,
        setup.models,
        setup.update,
        temperature=setup.sampler.temperature,
        old_logprobs=setup.old_logprobs,
    )
    with CompileCounter() as compiles:
        new_state, metrics = step(copy(state), groups)
    assert compiles.count == 1
    assert set(metrics) - set(ref_metrics) == PACK_METRICS
    assert_metrics_close({k: metrics[k] for k in ref_metrics}, ref_metrics, rtol=2e-5, atol=2e-6)
    if setup.update.width_multiple == 1:  # a kernel's block can round tiny rows up past that
        assert metrics["perf/pack_rows_tokens"] <= metrics["perf/padded_tokens"]
    assert metrics["perf/packed_tokens"] <= min(
        metrics["perf/tokens"], metrics["perf/pack_rows_tokens"]
    )
    if setup.update.shared_prompts:  # each group's prompt, less its last token, placed once
        assert metrics["perf/packed_tokens"] < metrics["perf/tokens"]
    else:
        assert metrics["perf/packed_tokens"] == metrics["perf/tokens"]
    assert H.tree_max_diff(new_state.params, state.params) > 0
    assert_trees_close(new_state.params, ref_state.params, rtol=2e-5, what="params")
    assert_trees_close(new_state.opt_state, ref_state.opt_state, rtol=2e-5, what="opt_state")
    assert_trees_close(new_state.kl_state, ref_state.kl_state, what="kl_state")
    if setup.recipe.critic is not None:
        assert_trees_close(new_state.critic_params, ref_state.critic_params, what="critic")
    return step, new_state, metrics


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(("algorithm.hparams.beta=0.04",), id="grpo-kl-loss-one-micro"),
        pytest.param(
            (
                "algorithm.name=reinforce_pp",
                "algorithm.hparams.beta=0.05",
                "optim.num_minibatches=2",
            ),
            id="reinforce_pp-recompute-token-budget",
        ),
        pytest.param(
            (
                "algorithm.hparams.beta=0.0",
                "old_logprobs.source=sampler",
                "old_logprobs.tis_cap=1.5",
                "rollout.temperature=0.7",
            ),
            id="grpo-sampler-tis",
        ),
        pytest.param(
            ("algorithm.hparams.beta=0.04", "train.shared_prompts=false"), id="grpo-unshared"
        ),
        pytest.param(  # the Pallas GPU kernel in interpret mode: O(T) segment ids, not a mask;
            # under remat full with token-budget micro-batches (the fused accumulation's scan)
            (
                "algorithm.hparams.beta=0.04",
                "model.attention=pallas_gpu",
                "model.remat=full",
                "optim.micro_batch_size=2",
            ),
            id="grpo-pallas-gpu-remat-micro",
        ),
    ],
)
def test_packed_step_matches_the_unpacked_reference(overrides):
    setup = resolve(*PACKED, *overrides)
    # On CPU train.shared_prompts=auto shares each group's prompt (the reference attention).
    unshared = (
        "train.shared_prompts=false" in overrides or "model.attention=pallas_gpu" in overrides
    )
    assert setup.update.shared_prompts is not unshared
    if setup.update.num_minibatches > 1 or setup.update.micro_batch_size:
        setup = with_budget(setup, 16)  # one or two rows of ≤ 14 tokens per micro-batch
    # The unpacked reference's 14-token rows are not a multiple of the Pallas kernel's block.
    reference = (
        resolve(*PACKED, "algorithm.hparams.beta=0.04")
        if unshared and ("model.attention=pallas_gpu" in overrides)
        else None
    )
    check_packed_against_reference(setup, make_groups(setup, 7), reference)


def with_budget(setup: S.Setup, tokens: int) -> S.Setup:
    """The setup with a token budget below the config-time bound (data.max_prompt_length +
    rollout.max_new_tokens = 262), to get several micro-batches from the tests' short rows."""
    return dataclasses.replace(
        setup, update=dataclasses.replace(setup.update, micro_batch_tokens=tokens)
    )


@pytest.mark.slow
def test_packed_ppo_matches_and_recompiles_only_for_new_buckets():
    """PPO (critic values packed, two epochs, token budget); later batches of other lengths
    reuse the program whenever their plan lands in the same buckets."""
    setup = resolve(
        *PACKED,
        "algorithm.name=ppo",
        "algorithm.hparams.beta=0.05",
        "kl.controller=adaptive",
        "optim.ppo_epochs=2",
        "critic.lr=1e-3",
    )
    step, state, _ = check_packed_against_reference(with_budget(setup, 16), make_groups(setup, 8))
    with CompileCounter() as later:
        for seed in (9, 10):
            state, metrics = step(state, make_groups(setup, seed))
    assert later.count == 0  # same width bucket (a length-14 row each), other micro counts
    assert np.isfinite(list(metrics.values())).all()


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_packed_step_on_8_devices_equals_one_device_unpacked():
    """Packed on a data=4 × fsdp=2 mesh with token-budget micro-batches = unpacked on one."""
    base = ("rollout.prompts_per_step=8", "rollout.num_samples=4", "algorithm.hparams.beta=0.04")
    one = resolve(*base, "optim.num_minibatches=2")
    many = resolve(
        *base,
        *PACKED,
        "optim.num_minibatches=2",
        "mesh.data=4",
        "mesh.fsdp=2",
        "mesh.preset=fsdp",
    )
    many = with_budget(many, 16)  # one row of 16 tokens per device and micro-batch
    assert many.models.mesh.size == 8 and many.update.packing
    groups = make_groups(one, 11)
    (s1, m1), (s8, m8) = (
        make_rl_step(s.recipe, s.models, s.update)(moved_state(s), groups) for s in (one, many)
    )
    assert set(m8) - set(m1) == PACK_METRICS
    assert_trees_close(s8.params, s1.params, rtol=2e-5, what="params")
    assert_trees_close(s8.opt_state, s1.opt_state, rtol=2e-5, what="opt_state")
    assert_metrics_close({k: m8[k] for k in m1}, m1, rtol=2e-5, atol=2e-6)


def test_packing_config_resolves_and_validates():
    from jaxrl_llm.config import ConfigError

    config = H.config("tiny.yaml", *SMALL, *PACKED, "optim.micro_batch_size=2")
    shape = S.update_shape(config)
    longest = config.data.max_prompt_length + config.rollout.max_new_tokens
    assert shape.packing and shape.micro_batch_tokens == 2 * longest  # the implied budget
    assert S.update_shape(H.config("tiny.yaml")).packing  # on by default
    assert not resolve().update.packing  # SMALL turns it off
    with pytest.raises(ConfigError, match=r"null unless train\.packing is true"):
        H.config("tiny.yaml", *SMALL, "train.packing=false", "optim.micro_batch_tokens=512")
    with pytest.raises(ConfigError, match="at least one longest sequence"):
        H.config("tiny.yaml", *SMALL, *PACKED, "optim.micro_batch_tokens=100")
    assert S.update_shape(config, data_parallel=2).micro_batch_tokens == longest
    assert shape.shared_prompts  # auto, on CPU
    splash = S.update_shape(H.config("tiny.yaml", *SMALL, *PACKED, "model.attention=splash"))
    assert not splash.shared_prompts and splash.width_multiple == 128
    assert shape.width_multiple == 1
    pallas = S.update_shape(H.config("tiny.yaml", *SMALL, *PACKED, "model.attention=pallas_gpu"))
    assert not pallas.shared_prompts and pallas.width_multiple == 16
    assert not S.update_shape(H.config("tiny.yaml", *SMALL, "train.packing=false")).shared_prompts
    with pytest.raises(ConfigError, match=r"train\.shared_prompts.*unless train\.packing is true"):
        H.config("tiny.yaml", *SMALL, "train.packing=false", "train.shared_prompts=true")
    with pytest.raises(ConfigError, match=r"train\.shared_prompts.*model\.attention=cudnn"):
        H.config("tiny.yaml", *SMALL, *PACKED, "train.shared_prompts=true", "model.attention=cudnn")
    with pytest.raises(ConfigError, match=r"shared_prompts.*model\.attention=pallas_gpu"):
        H.config(
            "tiny.yaml", *SMALL, *PACKED, "train.shared_prompts=true", "model.attention=pallas_gpu"
        )
