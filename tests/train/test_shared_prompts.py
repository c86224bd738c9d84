"""Packing with shared prompts: a group's prompt is placed once and its samples branch off it.

The packed-with-shared-prompts model must give every completion token the numbers it gets
unpacked (hidden states, log-probs, values), and the update its loss and gradients, because a
shared prompt token's gradient is the sum of what each sample sends it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm import algorithms
from jaxrl_llm.models.logprobs import completion_logprobs, hidden_logprobs
from jaxrl_llm.train import packing as pk
from jaxrl_llm.train import update as up
from tests.train import helpers as H


def grouped_batch(seed: int, *, b: int = 3, g: int = 4, p: int = 7, t: int = 9, **kw):
    """``synthetic_batch`` with the G rows of each group given the same (left-padded) prompt."""
    batch = H.synthetic_batch(seed, n=b * g, prompt_len=p, completion_len=t, **kw)
    tokens, input_mask = np.asarray(batch.tokens_nl).copy(), np.asarray(batch.input_mask_nl).copy()
    for i in range(b * g):
        first = (i // g) * g
        tokens[i, :p], input_mask[i, :p] = tokens[first, :p], input_mask[first, :p]
    return batch._replace(tokens_nl=jnp.asarray(tokens), input_mask_nl=jnp.asarray(input_mask))


def shared_plan(batch, g: int, **kw) -> pk.PackPlan:
    input_mask = np.asarray(batch.input_mask_nl)
    n, length = input_mask.shape
    t = batch.mask_nt.shape[1]
    prompt_len = input_mask[:, : length - t].sum(1)
    return pk.make_plan(
        input_mask.sum(1),
        max_len=length,
        group_n=np.arange(n) // g,
        shared_n=np.maximum(prompt_len - 1, 0),
        **kw,
    )


@pytest.mark.parametrize(("minibatches", "budget", "max_width"), [(1, None, None), (2, 32, 32)])
def test_plan_places_each_prompt_once_and_every_branch_after_it(minibatches, budget, max_width):
    b, g, p, t = 3, 4, 7, 9
    batch = grouped_batch(0, b=b, g=g, p=p, t=t)
    tokens, input_mask = np.asarray(batch.tokens_nl), np.asarray(batch.input_mask_nl)
    plan = shared_plan(
        batch, g, num_minibatches=minibatches, micro_batch_tokens=budget, max_width=max_width
    )
    s = plan.shape
    assert s.shared
    packed = pk.pack_rows(tokens, input_mask, plan.device_arrays(), s)
    toks, seg, pos, pre = (np.asarray(x) for x in packed[:4])
    n = b * g
    lengths = input_mask.sum(1)
    shared_any = False
    for i in range(n):
        real = tokens[i][input_mask[i]]
        k = int(plan.prefix_n[i])
        where = np.argwhere(seg == i + 1)  # the branch: tokens k.. of the sequence
        assert len(where) == lengths[i] - k
        a, r = where[0, :2]
        cols = where[:, 2]
        np.testing.assert_array_equal(cols, np.arange(cols[0], cols[0] + len(cols)))
        np.testing.assert_array_equal(toks[a, r, cols], real[k:])
        np.testing.assert_array_equal(pos[a, r, cols], np.arange(k, lengths[i]))
        owner = int(plan.owner_n[i])
        assert (owner // g, owner % minibatches) == (i // g, i % minibatches)
        if k == 0:
            np.testing.assert_array_equal(pre[a, r, cols], i + 1)
            continue
        shared_any = True
        # The prefix: once, before the branch in the same row, the owner's first k tokens.
        pcols = np.flatnonzero(seg[a, r] == n + 1 + owner)
        np.testing.assert_array_equal(pcols, np.arange(pcols[0], pcols[0] + k))
        assert pcols[-1] < cols[0]
        np.testing.assert_array_equal(toks[a, r, pcols], real[:k])
        np.testing.assert_array_equal(pos[a, r, pcols], np.arange(k))
        np.testing.assert_array_equal(pre[a, r, cols], n + 1 + owner)
    assert shared_any
    # Fewer tokens placed than the unshared plan, and the completion tokens unpack exactly.
    owners = plan.owner_n == np.arange(n)
    assert (seg > 0).sum() == plan.placed_tokens() == lengths.sum() - plan.prefix_n[~owners].sum()
    assert plan.placed_tokens() < lengths.sum()
    index = pk.unpack_index(input_mask, plan.device_arrays(), t)
    back = np.asarray(pk.unpack(packed.tokens, index, fill=-1))
    np.testing.assert_array_equal(back, np.where(input_mask[:, p:], tokens[:, p:], -1))
    if budget is not None:
        assert s.rows * s.width <= budget


def test_width_follows_the_cost_estimate():
    """Sharing widens rows only while the estimated FLOPs (slots · W · (1 + α·W)) fall: with a
    very expensive attention the plan keeps the unshared width (and shares inside it)."""
    batch = grouped_batch(1, b=4, g=8, p=12, t=6)
    cheap = shared_plan(batch, 8)
    dear = shared_plan(batch, 8, attn_per_width=10.0)
    unshared = pk.make_plan(np.asarray(batch.input_mask_nl).sum(1), max_len=18)
    assert cheap.shape.width > unshared.shape.width == dear.shape.width
    assert cheap.placed_tokens() < dear.placed_tokens() <= unshared.placed_tokens()


@pytest.mark.parametrize("shared", [False, True])
def test_rows_are_a_multiple_of_128_for_splash(shared):
    """width_multiple (128 under splash attention): W rounds up, past L if need be, and the
    packed tokens still unpack exactly."""
    batch = grouped_batch(3)
    tokens, input_mask = np.asarray(batch.tokens_nl), np.asarray(batch.input_mask_nl)
    t = batch.mask_nt.shape[1]
    if shared:
        plan = shared_plan(batch, 4, width_multiple=128)
    else:
        plan = pk.make_plan(input_mask.sum(1), max_len=tokens.shape[1], width_multiple=128)
    assert plan.shape.width == 128 > tokens.shape[1]
    packed = pk.pack_rows(tokens, input_mask, plan.device_arrays(), plan.shape)
    back = pk.unpack(packed.tokens, pk.unpack_index(input_mask, plan.device_arrays(), t), fill=-1)
    np.testing.assert_array_equal(
        np.asarray(back), np.where(input_mask[:, -t:], tokens[:, -t:], -1)
    )


def test_plan_errors():
    ones = np.ones(4, int)
    with pytest.raises(ValueError, match="group_n and shared_n go together"):
        pk.make_plan(ones * 4, max_len=8, group_n=np.zeros(4, int))
    with pytest.raises(ValueError, match=r"shared_n\[1\] = 4 must be in \[0, length 4\)"):
        pk.make_plan(ones * 4, max_len=8, group_n=np.zeros(4, int), shared_n=np.array([1, 4, 1, 1]))
    with pytest.raises(ValueError, match="group 0 has different shared_n"):
        pk.make_plan(ones * 4, max_len=8, group_n=np.zeros(4, int), shared_n=np.array([1, 2, 1, 1]))


@pytest.mark.parametrize("window", [None, 5])
def test_packed_shared_logprobs_equal_unpacked(window):
    """Completion log-probs of a tiny model (with and without a sliding window, measured in
    positions across the shared prefix) through shared-prompt packed rows = unpacked."""
    over = {} if window is None else dict(model_type="mistral", sliding_windows=(window, window))
    lm = H.tiny_lm(3, num_layers=2, **over)
    if window is not None:
        assert lm.config.window(0) == window
    batch = grouped_batch(2)
    t = batch.mask_nt.shape[1]
    start = batch.tokens_nl.shape[1] - t
    flat = completion_logprobs(lm, batch.tokens_nl, batch.input_mask_nl, start=start)
    plan = shared_plan(batch, 4)
    packed = pk.pack_rows(batch.tokens_nl, batch.input_mask_nl, plan.device_arrays(), plan.shape)
    index = pk.unpack_index(batch.input_mask_nl, plan.device_arrays(), t)
    outs = []
    for slot in range(plan.shape.num_micro):
        micro = up.PackedMicro.of(packed, jnp.int32(slot), lambda x, s=slot: x[s])
        h = up.packed_hidden(lm.model, micro)
        logp = hidden_logprobs(lm, h[:, :-1], micro.tokens_rw[:, 1:])
        outs.append(pk.predictions_to_targets(logp))
    back = pk.unpack(jnp.stack(outs), index)
    mask = np.asarray(batch.mask_nt)
    np.testing.assert_allclose(np.asarray(back)[mask], np.asarray(flat)[mask], atol=2e-5)


def _grad_capture() -> optax.GradientTransformation:
    return optax.GradientTransformation(
        lambda p: {"g": jax.tree.map(jnp.zeros_like, p)},
        lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), {"g": g}),
    )


@pytest.mark.parametrize(("name", "remat"), [("grpo", "none"), ("ppo", "none"), ("ppo", "full")])
def test_shared_prompt_update_equals_unpacked(name, remat):
    """Loss, metrics and gradients (policy and critic) of a shared-prompt packed update in two
    minibatches of token-budget micro-batches equal the unpacked update's (with remat, the
    packed update's micro-batch loop fuses its accumulation into the layer scan and the
    unpacked one, a single micro-batch per minibatch, does not)."""
    rec = H.recipe(name, **({"beta": 0.05} if name == "grpo" else {}))
    lm = H.tiny_lm(0, num_layers=2, remat=remat)
    critic = H.tiny_critic(lm) if rec.critic is not None else None
    tx = _grad_capture()
    gd, cgd, state = H.fresh_state(lm, tx, rec, critic=critic, critic_tx=tx if critic else None)
    batch = grouped_batch(4, values=critic is not None)
    rng = np.random.default_rng(0)
    noise = jnp.asarray(rng.normal(0, 0.3, batch.mask_nt.shape), jnp.float32)
    batch = batch._replace(logp_old_nt=jnp.where(batch.mask_nt, -1.5 + noise, 0.0))
    plan = shared_plan(batch, 4, num_minibatches=2, micro_batch_tokens=32)
    assert plan.shape.shared and int(np.min(plan.count_m)) >= 2
    packed = up.packed_batch(batch, plan.device_arrays(), plan.shape)
    kw = dict(critic_graphdef=cgd, critic_tx=tx if cgd is not None else None)
    flat = up.make_update_step(rec, gd, tx, num_minibatches=2, **kw)
    pack = up.make_update_step(rec, gd, tx, packed=True, **kw)
    copy = lambda tree: jax.tree.map(jnp.copy, tree)
    s_flat, m_flat = flat(copy(state), batch)
    s_pack, m_pack = pack(copy(state), packed)
    for key in m_flat:
        np.testing.assert_allclose(float(m_pack[key]), float(m_flat[key]), rtol=2e-5, atol=2e-6)
    g_flat, g_pack = s_flat.opt_state["g"], s_pack.opt_state["g"]
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g_flat))
    assert scale > 1e-4
    assert H.tree_max_diff(g_flat, g_pack) <= 1e-5 * max(scale, 1.0)
    if cgd is not None:
        assert H.tree_max_diff(s_flat.critic_opt_state["g"], s_pack.critic_opt_state["g"]) < 1e-5


def test_kernels_and_lora_dropout_are_refused():
    lm = H.tiny_lm(0)
    batch = grouped_batch(0)
    plan = shared_plan(batch, 4)
    packed = pk.pack_rows(batch.tokens_nl, batch.input_mask_nl, plan.device_arrays(), plan.shape)
    micro = up.PackedMicro.of(packed, jnp.int32(0), lambda x: x[0])
    with pytest.raises(ValueError, match=r"shared prompts .* reference attention only"):
        lm.model(
            micro.tokens_rw,
            micro.segment_ids_rw != 0,
            positions_bt=micro.positions_rw,
            segment_ids_bt=micro.segment_ids_rw,
            prefix_ids_bt=micro.prefix_ids_rw,
            attention_impl="splash",
        )
    with pytest.raises(ValueError, match="prefix_ids_bt needs segment_ids_bt and positions_bt"):
        lm.model(micro.tokens_rw, prefix_ids_bt=micro.prefix_ids_rw)
    assert algorithms.get("grpo") is not None
