"""Full-vocabulary log-probs at temperature 1 (``generate(return_full_logprobs=True)``): the
trainer's own ``token_logprobs`` at τ = 1 of the sampled tokens, whatever the sampling filter,
for both engines, sharded, and across the segments of a partial rollout; off by default, and
then nothing else changes."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import rollout
from jaxrl_llm.models import sharding
from jaxrl_llm.rollout import paged, partial, sampling
from tests.rollout.test_generate import prompts, training_logprobs

LENGTHS = (9, 4, 1, 6, 23)  # ragged, left-padded; 23 > prefill_chunk: a chunked prefill
T, G = 10, 2
SMALL = paged.PagedOptions(page_size=4, num_slots=4, steps_per_dispatch=4, prefill_chunk=16)
TRUNCATING = dict(temperature=0.7, top_k=20, top_p=0.8)  # vocabulary 96: both filters bite


def run(model, ids, mask, engine, **kw):
    kw = dict(rng=jax.random.key(3), max_new_tokens=T, num_samples=G, engine=engine, **kw)
    if engine == "paged":
        kw["paged_options"] = SMALL
    return rollout.generate(model, ids, mask, **kw)


def assert_trainer_full(model, ids, mask, out, atol=1e-4):
    """``full_logprobs`` = the trainer's τ = 1 log-probs on valid tokens, exactly 0 elsewhere."""
    valid = np.asarray(out.mask)
    full = np.asarray(out.full_logprobs)
    assert full.shape == valid.shape and full.dtype == np.float32
    ref = training_logprobs(model, ids, mask, out, temperature=1.0)
    np.testing.assert_allclose(full[valid], ref[valid], atol=atol, rtol=0)
    assert (full[~valid] == 0).all()


def test_full_logprobs_formula():
    logits = jax.random.normal(jax.random.key(0), (5, 33)) * 3
    token = jax.random.randint(jax.random.key(1), (5,), 0, 33)
    got = np.asarray(sampling.full_logprobs(logits, token))
    x = np.asarray(logits, np.float64)
    ref = x[np.arange(5), np.asarray(token)] - np.log(np.exp(x).sum(-1))
    np.testing.assert_allclose(got, ref, atol=1e-6)


@pytest.mark.parametrize("engine", ["static", "paged"])
def test_equal_the_trainers_logprobs_at_temperature_1_under_top_k_top_p(tiny_pair, engine):
    _, model = tiny_pair("llama3")
    ids, mask = prompts(seed=4, lengths=LENGTHS)
    base = run(model, ids, mask, engine, **TRUNCATING)
    out = run(model, ids, mask, engine, return_full_logprobs=True, **TRUNCATING)
    assert base.full_logprobs is None  # off by default
    # The flag adds an output and changes no token; the sampled log-probs agree to float
    # rounding (another program: XLA may fuse the reductions differently).
    for name in ("tokens", "mask", "truncated"):
        np.testing.assert_array_equal(
            np.asarray(getattr(out, name)), np.asarray(getattr(base, name))
        )
    np.testing.assert_allclose(
        np.asarray(out.logprobs), np.asarray(base.logprobs), atol=1e-6, rtol=0
    )
    assert np.asarray(out.mask).sum() > 40
    assert_trainer_full(model, ids, mask, out)
    # Not the sampled-from distribution's: τ = 0.7 and the filters move every token's log-prob.
    valid = np.asarray(out.mask)
    gap = np.abs(np.asarray(out.logprobs) - np.asarray(out.full_logprobs))[valid]
    assert gap.min() > 1e-3


@pytest.mark.parametrize("engine", ["static", "paged"])
def test_greedy_full_logprobs_are_the_sampled_logprobs(tiny_pair, engine):
    """Greedy decoding's ``logprobs`` are ``log softmax(logits)`` (τ = 1, no filter; the
    Generation docstring): the full-vocabulary log-probs, bit for bit (the same function)."""
    _, model = tiny_pair("llama3")
    ids, mask = prompts(seed=5, lengths=LENGTHS)
    out = run(model, ids, mask, engine, temperature=0.0, return_full_logprobs=True)
    np.testing.assert_array_equal(np.asarray(out.full_logprobs), np.asarray(out.logprobs))
    assert_trainer_full(model, ids, mask, out)


def test_static_engine_sharded_on_8_devices(tiny_pair):
    _, model = tiny_pair("llama3")
    assert len(jax.devices()) == 8
    ids, mask = prompts(seed=6, lengths=(11, 3, 1, 8))  # B·G = 8 rows over 8 devices
    one = run(model, ids, mask, "static", return_full_logprobs=True, **TRUNCATING)
    graphdef, state = nnx.split(model)
    mesh, rules = sharding.preset("fsdp_tp")
    params = jax.device_put(nnx.to_pure_dict(state), sharding.param_shardings(state, mesh, rules))
    out = run((graphdef, params), ids, mask, "static", return_full_logprobs=True, **TRUNCATING)
    assert len(out.full_logprobs.sharding.device_set) == 8
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(one.tokens))
    np.testing.assert_allclose(
        np.asarray(out.full_logprobs), np.asarray(one.full_logprobs), atol=1e-5, rtol=0
    )
    assert_trainer_full(model, ids, mask, out)


@pytest.mark.slow  # two engines compiling their own programs
def test_paged_engine_data_parallel_on_8_devices(tiny_pair):
    """data=2 × tensor=4: two paged engines (paged_dp) pass the flag through and give the
    one-device engine's tokens and full log-probs."""
    _, model = tiny_pair("llama3")
    ids, mask = prompts(seed=6, lengths=LENGTHS)
    one = run(model, ids, mask, "paged", return_full_logprobs=True, **TRUNCATING)
    graphdef, state = nnx.split(model)
    mesh = sharding.make_mesh(data=2, tensor=4)
    params = jax.device_put(nnx.to_pure_dict(state), sharding.param_shardings(state, mesh))
    out = run((graphdef, params), ids, mask, "paged", return_full_logprobs=True, **TRUNCATING)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(one.tokens))
    np.testing.assert_allclose(
        np.asarray(out.full_logprobs), np.asarray(one.full_logprobs), atol=1e-5, rtol=0
    )
    assert_trainer_full(model, ids, mask, out)


@pytest.mark.parametrize("engine", ["paged", "static"])
def test_partial_rollout_in_two_segments_equals_one_run(tiny_pair, engine):
    _, model = tiny_pair("llama3")
    ids, mask = prompts(seed=7, lengths=LENGTHS)
    kw = dict(max_new_tokens=T, num_samples=G, paged_options=SMALL, stop_token_ids=(), **TRUNCATING)
    rng = jax.random.key(8)
    ref = rollout.generate(
        model, ids, mask, rng=rng, engine="paged", return_full_logprobs=True, **kw
    )
    out = partial.generate_partial(
        [model, model], ids, mask, rng=rng, segment_tokens=T // 2 + 1, engine=engine,
        return_full_logprobs=True, **kw,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out.version).max(), 1)  # two segments ran
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.mask), np.asarray(ref.mask))
    np.testing.assert_allclose(
        np.asarray(out.full_logprobs), np.asarray(ref.full_logprobs), atol=1e-5, rtol=0
    )
    assert_trainer_full(model, ids, mask, out)
    # Off by default: the in-flight state carries none, finish returns none.
    state = partial.start(len(LENGTHS), G, T)
    assert state.full_logp_bgt is None
    state = partial.advance(
        model, ids, mask, state, rng=rng, version=0, segment_tokens=T, engine=engine,
        **{k: v for k, v in kw.items() if k not in ("max_new_tokens", "num_samples")},
    )  # fmt: skip
    assert state.full_logp_bgt is None and partial.finish(state).full_logprobs is None


def test_bad_flag_is_a_clear_error(tiny_pair):
    _, model = tiny_pair("llama3")
    ids, mask = prompts(seed=4, lengths=(3, 2))
    with pytest.raises(TypeError, match="return_full_logprobs must be a bool"):
        rollout.generate(
            model, ids, mask, rng=jax.random.key(0), max_new_tokens=2, return_full_logprobs="yes"
        )


# ---------------------------------------------------------------------------------------------
# The trainer: rollout.full_logprobs carries them with the collected batch.


def _collect(*overrides: str):
    from jaxrl_llm.data import BatchIterator
    from jaxrl_llm.train import setup as setup_lib
    from jaxrl_llm.train.collect import collect
    from tests.train import helpers as H

    s = setup_lib.resolve(H.config("tiny.yaml", *overrides))
    it = BatchIterator(s.data.train, s.loop.batch_size, seed=0, shuffle=False, pad_multiple=8)
    groups, _ = collect(s, s.state.params, it, jax.random.key(0))
    return s, groups


@pytest.mark.slow  # two collects of the tiny config (~15 s of CPU alone, more when shared)
def test_trainer_collects_full_logprobs_when_configured():
    from jaxrl_llm.train import forward
    from jaxrl_llm.train.step import _sequences

    filters = ("rollout.top_k=5", "rollout.temperature=0.8", "rollout.stop_token_ids=[]")
    _, off = _collect(*filters)
    assert off.logp_full_bgt is None
    s, groups = _collect(*filters, "rollout.full_logprobs=true")
    assert s.sampler.full_logprobs and not s.sampler.greedy().full_logprobs
    np.testing.assert_array_equal(groups.tokens_bgt, off.tokens_bgt)
    b, g, t = groups.tokens_bgt.shape
    tokens_nl, mask_nl = _sequences(groups)
    graphdef, params = s.models.sampling_policy(s.state.params)
    ref = forward.completion_logprobs_nt(
        graphdef, params, tokens_nl, mask_nl, completion_len=t, temperature=1.0
    )
    valid = groups.mask_bgt
    assert valid.all()  # no stop ids: every token is sampled
    full = groups.logp_full_bgt
    np.testing.assert_allclose(full, np.asarray(ref).reshape(b, g, t), atol=1e-4, rtol=0)
    assert np.abs(full - groups.logp_sampler_bgt).min() > 1e-3  # μ's log-probs are another thing


def test_inflight_batches_checkpoint_with_and_without_full_logprobs():
    from jaxrl_llm.train import asynchronous as A

    for full in (False, True):
        state = partial.start(2, 3, 4, full_logprobs=full)
        if full:
            state = state._replace(full_logp_bgt=np.full((2, 3, 4), -1.5, np.float32))
        entry = A.InFlightBatch(5, np.arange(2), np.zeros((2,), np.uint32), state)
        (back,) = A.buffer_from_host(*A.buffer_to_host([entry]))
        if full:
            np.testing.assert_array_equal(back.state.full_logp_bgt, state.full_logp_bgt)
        else:
            assert back.state.full_logp_bgt is None
        np.testing.assert_array_equal(back.state.budget_bg, state.budget_bg)


@pytest.mark.slow  # the tiny config's setup and three segments
def test_trainer_partial_rollouts_collect_full_logprobs():
    """The async loop's partial rollouts (train.partial_rollout_tokens) carry them across the
    segments into the scored batch."""
    from jaxrl_llm.data import BatchIterator
    from jaxrl_llm.train import asynchronous as A
    from jaxrl_llm.train import forward
    from jaxrl_llm.train import setup as setup_lib
    from jaxrl_llm.train.step import _sequences
    from tests.train import helpers as H

    overrides = (
        "train.max_staleness=2",
        "train.partial_rollout_tokens=3",
        "rollout.max_new_tokens=8",
        "rollout.top_k=5",
        "rollout.full_logprobs=true",
    )
    s = setup_lib.resolve(H.config("tiny.yaml", *overrides))
    it = BatchIterator(s.data.train, s.loop.batch_size, seed=0, shuffle=False, pad_multiple=8)
    rollouts = A.PartialRollouts(s, 3)
    entry = rollouts.begin(1, it, jax.random.key(0))
    assert entry.state.full_logp_bgt is not None
    policy = s.models.sampling_policy(s.state.params)
    while not entry.state.done_bg.all():
        entry = rollouts.advance(entry, it, policy, 0, to_end=False)
    assert entry.state.segments >= 2
    groups = rollouts.finish(entry, it, policy).groups
    b, g, t = groups.tokens_bgt.shape
    tokens_nl, mask_nl = _sequences(groups)
    ref = forward.completion_logprobs_nt(*policy, tokens_nl, mask_nl, completion_len=t)
    valid = groups.mask_bgt
    ref = np.where(valid, np.asarray(ref).reshape(b, g, t), 0.0)
    np.testing.assert_allclose(groups.logp_full_bgt, ref, atol=1e-4, rtol=0)
