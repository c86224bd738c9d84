"""generate() on tiny random models: parity with transformers, on-policy log-probs, stopping,
filters, determinism, bad input and compile reuse."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxrl_llm import rollout
from jaxrl_llm.core.logprobs import token_logprobs
from jaxrl_llm.rollout import engine
from tests.models import hf_tiny

VOCAB = 96
LENGTHS = (9, 4, 1, 6)  # ragged, one single-token prompt
# Most tests share these shapes (and so one compiled program per sampling mode).
T, G = 16, 2
SHAPES = dict(max_new_tokens=T, num_samples=G)


def prompts(seed: int = 0, lengths=LENGTHS, width: int | None = None):
    rng = np.random.RandomState(seed)
    return hf_tiny.left_padded_batch(rng, list(lengths), width or max(lengths), VOCAB)


def hf_greedy(hf, ids, mask, max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each row, up to and including its EOS."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=0,
        )
    rows = []
    for row in out[:, ids.shape[1] :].tolist():
        eos = [i for i, tok in enumerate(row) if tok == hf.config.eos_token_id]
        rows.append(row[: eos[0] + 1] if eos else row)
    return rows


def training_logprobs(model, ids, mask, out, *, temperature: float) -> np.ndarray:
    """The trainer's view: one forward over [prompt; completion], then core token_logprobs."""
    g, t = out.tokens.shape[1:]
    p = ids.shape[1]
    full = np.concatenate(
        [np.repeat(ids, g, axis=0), np.asarray(out.tokens).reshape(-1, t)], axis=1
    )
    full_mask = np.concatenate(
        [np.repeat(mask, g, axis=0), np.asarray(out.mask).reshape(-1, t)], axis=1
    )
    logits = nnx.jit(lambda m, x, k: m(x, k))(model, jnp.asarray(full), jnp.asarray(full_mask))
    logp = token_logprobs(logits[:, p - 1 : -1], jnp.asarray(full[:, p:]), temperature=temperature)
    return np.asarray(logp).reshape(out.tokens.shape)


@pytest.mark.parametrize("family", ["llama3", "qwen2", "mistral", "qwen3"])
def test_greedy_matches_transformers_generate(tiny_pair, family):
    hf, ours = tiny_pair(family)
    ids, mask = prompts(seed=1)
    out = rollout.generate(
        ours, ids, mask, rng=jax.random.key(0), max_new_tokens=32, temperature=0.0
    )
    ref = hf_greedy(hf, ids, mask, 32)
    tokens, valid = np.asarray(out.tokens[:, 0]), np.asarray(out.mask[:, 0])
    for i, expected in enumerate(ref):
        assert tokens[i][valid[i]].tolist() == expected, f"row {i}"
        assert bool(out.truncated[i, 0]) == (expected[-1] != hf.config.eos_token_id)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_training_side(tiny_pair, temperature):
    _, ours = tiny_pair("llama3")
    ids, mask = prompts(seed=2)
    out = rollout.generate(
        ours, ids, mask, rng=jax.random.key(3), **SHAPES, temperature=temperature
    )
    assert out.tokens.shape == out.mask.shape == out.logprobs.shape == (4, G, T)
    assert out.tokens.dtype == jnp.int32 and out.mask.dtype == jnp.bool_
    assert out.logprobs.dtype == jnp.float32 and out.truncated.shape == (4, G)
    ref = training_logprobs(ours, ids, mask, out, temperature=temperature)
    m = np.asarray(out.mask)
    np.testing.assert_allclose(np.asarray(out.logprobs)[m], ref[m], atol=1e-4, rtol=0)
    assert np.all(np.asarray(out.logprobs)[~m] == 0.0)


def test_filtered_logprobs_are_of_the_renormalised_distribution(tiny_pair):
    _, ours = tiny_pair("llama3")
    ids, mask = prompts(seed=4)
    tau, k = 0.8, 5
    out = rollout.generate(
        ours,
        ids,
        mask,
        rng=jax.random.key(1),
        **SHAPES,
        temperature=tau,
        top_k=k,
        stop_token_ids=(),
    )
    full = np.concatenate([np.repeat(ids, G, 0), np.asarray(out.tokens).reshape(-1, T)], 1)
    full_mask = np.concatenate([np.repeat(mask, G, 0), np.ones((4 * G, T), bool)], 1)
    forward = nnx.jit(lambda m, x, k: m(x, k))
    logits = np.asarray(forward(ours, jnp.asarray(full), jnp.asarray(full_mask)))
    z = logits[:, ids.shape[1] - 1 : -1] / tau  # [BG, T, V]
    kth = np.sort(z, axis=-1)[..., -k][..., None]
    z = np.where(z >= kth, z, -np.inf)
    top = z.max(-1, keepdims=True)
    logp = z - top - np.log(np.sum(np.exp(z - top), -1, keepdims=True))
    picked = np.take_along_axis(logp, full[:, ids.shape[1] :, None], -1)[..., 0]
    assert np.all(np.isfinite(picked))  # every sampled token is inside the top-k set
    np.testing.assert_allclose(np.asarray(out.logprobs).reshape(-1, T), picked, atol=1e-4, rtol=0)


def test_low_temperature_and_tight_filters_equal_greedy(tiny_pair):
    _, ours = tiny_pair("llama3")
    ids, mask = prompts(seed=5)
    kw = dict(rng=jax.random.key(7), **SHAPES, stop_token_ids=())
    greedy = rollout.generate(ours, ids, mask, temperature=0.0, **kw)
    for extra in ({"temperature": 1e-5}, {"top_k": 1}, {"top_p": 1e-6}):
        sampled = rollout.generate(ours, ids, mask, **{"temperature": 1.0, **kw, **extra})
        np.testing.assert_array_equal(sampled.tokens, greedy.tokens, err_msg=str(extra))
    # Greedy samples of one prompt are identical (they share the prefill).
    np.testing.assert_array_equal(greedy.tokens[:, 0], greedy.tokens[:, 1])
    assert np.all(np.asarray(greedy.truncated))


def test_stop_token_ends_sequence_and_masks_the_rest(tiny_pair):
    _, ours = tiny_pair("llama3")
    ids, mask = prompts(seed=6)
    kw = dict(rng=jax.random.key(2), **SHAPES, temperature=1.0)
    free = rollout.generate(ours, ids, mask, stop_token_ids=(), **kw)
    free_tokens = np.asarray(free.tokens)
    stop = int(free_tokens[0, 0, 3])
    out = rollout.generate(ours, ids, mask, stop_token_ids=(stop,), **kw)
    tokens, valid, logp = (np.asarray(x) for x in (out.tokens, out.mask, out.logprobs))
    for b in range(4):
        for g in range(G):
            hits = np.flatnonzero(free_tokens[b, g] == stop)
            end = hits[0] + 1 if hits.size else T
            assert valid[b, g].tolist() == [True] * end + [False] * (T - end)
            assert tokens[b, g, :end].tolist() == free_tokens[b, g, :end].tolist()
            assert np.all(tokens[b, g, end:] == 0) and np.all(logp[b, g, end:] == 0.0)
            assert bool(out.truncated[b, g]) == (not hits.size)
    assert not out.truncated[0, 0]
    # None stops on the model's EOS id.
    eos = ours.config.eos_token_id
    by_default = rollout.generate(ours, ids, mask, **kw)
    explicit = rollout.generate(ours, ids, mask, stop_token_ids=(eos,), **kw)
    np.testing.assert_array_equal(by_default.mask, explicit.mask)


def test_all_stopped_exits_early_with_padding(tiny_pair):
    _, ours = tiny_pair("llama3")
    ids, mask = prompts(seed=6)
    kw = dict(rng=jax.random.key(0), **SHAPES, temperature=0.0)
    first = np.unique(np.asarray(rollout.generate(ours, ids, mask, **kw).tokens[:, :, 0]))
    out = rollout.generate(ours, ids, mask, stop_token_ids=tuple(first.tolist()), **kw)
    assert np.asarray(out.mask).sum(-1).tolist() == [[1] * G] * 4
    assert np.all(np.asarray(out.tokens)[:, :, 1:] == 0)
    assert not np.asarray(out.truncated).any()


def test_deterministic_per_key(tiny_pair):
    _, ours = tiny_pair("llama3")
    ids, mask = prompts(seed=7)
    kw = dict(**SHAPES, temperature=1.0, top_p=0.9)
    a = rollout.generate(ours, ids, mask, rng=jax.random.key(5), **kw)
    b = rollout.generate(ours, ids, mask, rng=jax.random.key(5), **kw)
    c = rollout.generate(ours, ids, mask, rng=jax.random.key(6), **kw)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a.tokens, c.tokens)
    # The G samples of one prompt differ from each other.
    assert not np.array_equal(a.tokens[:, 0], a.tokens[:, 1])
    # Raw key data works too.
    d = rollout.generate(ours, ids, mask, rng=jax.random.key_data(jax.random.key(5)), **kw)
    np.testing.assert_array_equal(a.tokens, d.tokens)


def test_graphdef_params_pair_and_extra_padding_give_the_same_result(tiny_pair):
    _, ours = tiny_pair("llama3")
    ids, mask = prompts(seed=8)
    kw = dict(rng=jax.random.key(1), **SHAPES)
    ref = rollout.generate(ours, ids, mask, **kw)
    graphdef, state = nnx.split(ours)
    pair = rollout.generate((graphdef, nnx.to_pure_dict(state)), ids, mask, **kw)
    np.testing.assert_array_equal(ref.tokens, pair.tokens)
    wide_ids, wide_mask = prompts(seed=8, width=20)  # a wider bucket, more left padding
    wide = rollout.generate(ours, wide_ids, wide_mask, **kw)
    np.testing.assert_array_equal(ref.tokens, wide.tokens)
    np.testing.assert_allclose(ref.logprobs, wide.logprobs, atol=1e-5, rtol=0)


def test_bf16_cache_logprobs_close_to_fp32_training_side(tiny_pair):
    _, ours = tiny_pair("llama3")
    ids, mask = prompts(seed=9)
    out = rollout.generate(
        ours, ids, mask, rng=jax.random.key(1), **SHAPES, cache_dtype=jnp.bfloat16
    )
    ref = training_logprobs(ours, ids, mask, out, temperature=1.0)
    m = np.asarray(out.mask)
    np.testing.assert_allclose(np.asarray(out.logprobs)[m], ref[m], atol=2e-2, rtol=0)


def test_prompt_buckets_reuse_one_compiled_program(tiny_pair):
    _, ours = tiny_pair("llama3")
    engine._rollout.clear_cache()  # other tests in this worker may have compiled the buckets
    kw = dict(rng=jax.random.key(0), max_new_tokens=6, num_samples=3)
    rollout.generate(ours, *prompts(lengths=(3, 2, 3)), top_p=0.5, **kw)
    start = engine._rollout._cache_size()
    # Widths 5, 12 and 16 share the 16 bucket; temperature, top-p and stop ids are traced.
    for seed, lengths in enumerate([(5, 1, 2), (9, 4, 12), (16, 16, 1)]):
        rollout.generate(
            ours,
            *prompts(seed, lengths),
            temperature=0.5 + seed / 10,
            top_p=0.9 - seed / 10,
            stop_token_ids=(seed, 7),
            **kw,
        )
    assert engine._rollout._cache_size() == start
    rollout.generate(ours, *prompts(0, (17, 2, 3)), top_p=0.5, **kw)
    assert engine._rollout._cache_size() == start + 1  # width 17: the 32 bucket


BAD_INPUTS = [
    ("empty prompt", dict(mask_row=1), ValueError, "prompt 1 is empty"),
    ("zero width", dict(width0=True), ValueError, "empty"),
    ("over context", dict(lengths=(300, 2)), ValueError, "longer than the model's context"),
    (
        "prompt + new tokens over context",
        dict(lengths=(250, 2), max_new_tokens=10),
        ValueError,
        "plus max_new_tokens=10",
    ),
    ("max_new_tokens 0", dict(max_new_tokens=0), ValueError, "max_new_tokens must be >= 1"),
    ("max_new_tokens -3", dict(max_new_tokens=-3), ValueError, "max_new_tokens must be >= 1"),
    ("max_new_tokens float", dict(max_new_tokens=2.5), TypeError, "max_new_tokens must be an int"),
    ("id too large", dict(token=VOCAB), ValueError, f"token id {VOCAB} at prompt 0"),
    ("negative id", dict(token=-1), ValueError, "token id -1 at prompt 0"),
    ("right padded", dict(right_padded=True), ValueError, "not left-padded"),
    ("int mask", dict(int_mask=True), TypeError, "boolean mask"),
    ("negative temperature", dict(temperature=-0.1), ValueError, "temperature must be >= 0"),
    ("top_p zero", dict(top_p=0.0), ValueError, "top_p must be in (0, 1]"),
    ("num_samples 0", dict(num_samples=0), ValueError, "num_samples must be >= 1"),
    ("stop id", dict(stop_token_ids=(VOCAB + 5,)), ValueError, f"stop token id {VOCAB + 5}"),
    ("key batch", dict(rng=jax.random.split(jax.random.key(0), 2)), ValueError, "single PRNG key"),
    ("not a key", dict(rng=0), TypeError, "rng must be a jax PRNG key"),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_gets_a_clear_error(tiny_pair, case):
    _, ours = tiny_pair("llama3")
    _, spec, error, message = case
    spec = dict(spec)
    ids, mask = prompts(lengths=spec.pop("lengths", (3, 2)))
    if spec.pop("mask_row", None) is not None:
        mask[1] = False
    if spec.pop("width0", False):
        ids, mask = ids[:, :0], mask[:, :0]
    if "token" in spec:
        ids[0, -1] = spec.pop("token")
    if spec.pop("right_padded", False):
        mask = mask[:, ::-1].copy()
    if spec.pop("int_mask", False):
        mask = mask.astype(np.int32)
    kw = {"rng": jax.random.key(0), "max_new_tokens": 4, **spec}
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        rollout.generate(ours, ids, mask, **kw)


def test_the_static_program_runs_on_layer_weights_sliced_and_cast_outside_it():
    """The static engine runs on the paged engine's weights (paged.engine_params: the layers
    sliced into per-layer copies and cast to the compute dtype in one small program before
    it): its compiled program takes bf16 per-layer weights, not the stacked float32 ones, so
    it neither casts nor slices them itself (on XLA:GPU that held a cast copy and its slices
    at once). Greedy, its tokens are the paged engine's."""
    import re

    from jaxrl_llm import models
    from jaxrl_llm.models.tiny import tiny_random_config
    from jaxrl_llm.rollout import paged

    cfg = tiny_random_config(
        vocab_size=VOCAB, num_layers=3, hidden_size=40, intermediate_size=88, dtype="bfloat16"
    )
    model = models.CausalLM(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    ids, mask = prompts(5)
    kw = dict(max_new_tokens=6, num_samples=1, temperature=0.0)
    static, paged_out = (
        rollout.generate(model, ids, mask, rng=jax.random.key(0), engine=e, **kw)
        for e in ("static", "paged")
    )
    np.testing.assert_array_equal(static.tokens, paged_out.tokens)
    np.testing.assert_array_equal(static.mask, paged_out.mask)

    weights = paged.engine_params(params, cfg.jnp_dtype)
    call = engine._Static(
        max_new_tokens=6,
        num_samples=1,
        greedy=True,
        top_k=0,
        use_top_p=False,
        pad_token_id=engine._pad_id(cfg),
        cache_dtype="bfloat16",
    )
    args = (ids, mask, jax.random.key(0), np.float32(1), np.float32(1), engine._stop_ids((), cfg))
    hlo = engine._rollout.lower(graphdef, weights, *args, static=call).compile().as_text()
    entry = hlo[hlo.index("\nENTRY") :].split("\n}\n")[0]
    taken = set(re.findall(r"= (\w+\[[\d,]*\])\S* parameter\(", entry))
    assert "bf16[40,88]" in taken and "bf16[88,40]" in taken  # gate / up, down of one layer
    stacked = {f"{dt}[3,{a},{b}]" for dt in ("f32", "bf16") for a, b in ((40, 88), (88, 40))}
    assert not taken & stacked, taken
    assert not any(s.startswith("f32[40,") or s.startswith("f32[88,") for s in taken), taken
