"""Our models against transformers' PyTorch implementation, family by family (fp32)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

from jaxrl_llm import models
from tests.models import hf_tiny

FAMILIES = sorted(hf_tiny.FAMILIES)
TOL = 1e-4


@nnx.jit
def forward(model, tokens_bt, mask_bt):
    return model(tokens_bt, mask_bt)


@nnx.jit
def forward_cached(model, tokens_bt, mask_bt, cache):
    return model(tokens_bt, mask_bt, cache=cache)


def logits_of(model, tokens, mask=None):
    mask = np.ones(np.shape(tokens), bool) if mask is None else mask
    return np.asarray(forward(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(mask)))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, HF torch model, its saved folder, our model loaded from that folder)."""
    name = request.param
    hf = hf_tiny.build_hf(name)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return name, hf, path, models.from_pretrained(path)


def test_logits_match_transformers(family):
    _, hf, _, ours = family
    tokens = np.random.RandomState(0).randint(0, hf.config.vocab_size, (2, 12))
    np.testing.assert_allclose(
        logits_of(ours, tokens), hf_tiny.hf_logits(hf, tokens), atol=TOL, rtol=0
    )


def test_left_padding_matches_transformers_and_unpadded(family):
    _, hf, _, ours = family
    rng = np.random.RandomState(1)
    tokens, mask = hf_tiny.left_padded_batch(rng, [12, 7, 1], 12, hf.config.vocab_size)
    positions = hf_tiny.positions_from_mask(mask)
    logits = logits_of(ours, tokens, mask)
    ref = hf_tiny.hf_logits(hf, tokens, mask, positions)
    np.testing.assert_allclose(logits[mask], ref[mask], atol=TOL, rtol=0)
    # Each sequence moved to the front (right padding cannot affect a causal prefix) gives the
    # same logits as the left-padded one: padding changes nothing.
    flipped = np.stack([np.roll(t, m.sum()) for t, m in zip(tokens, mask, strict=True)])
    flipped_mask = np.stack([np.roll(m, m.sum()) for m in mask])
    alone = logits_of(ours, flipped, flipped_mask)
    np.testing.assert_allclose(logits[mask], alone[flipped_mask], atol=TOL, rtol=0)


def test_save_pretrained_round_trip(family, tmp_path):
    _, hf, _, ours = family
    out = models.save_pretrained(ours, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert type(reloaded) is type(hf)
    tokens = np.random.RandomState(2).randint(0, hf.config.vocab_size, (2, 9))
    np.testing.assert_allclose(
        hf_tiny.hf_logits(reloaded, tokens),
        logits_of(ours, tokens),
        atol=TOL,
        rtol=0,
    )
    ours_again = models.from_pretrained(out)
    assert ours_again.config == ours.config


# The cache logic is family-independent; these three cover its switches (plain GQA, a sliding
# window shorter than the sequence, q/k norm).
@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen3"], indirect=True)
def test_kv_cache_prefill_then_decode_equals_full_forward(family):
    _, hf, _, ours = family
    rng = np.random.RandomState(3)
    tokens, mask = hf_tiny.left_padded_batch(rng, [10, 6], 10, hf.config.vocab_size)
    full = logits_of(ours, tokens, mask)
    prompt = 6  # prefill 6 slots, then decode 4 one at a time
    cache = ours.init_cache(2, 12)
    logits, cache = forward_cached(
        ours, jnp.asarray(tokens[:, :prompt]), jnp.asarray(mask[:, :prompt]), cache
    )
    steps = [np.asarray(logits)]
    for t in range(prompt, 10):
        logits, cache = forward_cached(
            ours, jnp.asarray(tokens[:, t : t + 1]), jnp.asarray(mask[:, t : t + 1]), cache
        )
        steps.append(np.asarray(logits))
    incremental = np.concatenate(steps, axis=1)
    np.testing.assert_allclose(incremental[mask], full[mask], atol=TOL, rtol=0)
    assert int(cache.index) == 10


@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen3"], indirect=True)
def test_cached_forward_on_per_layer_modules_equals_the_stacked_scan(family):
    """The static sampler's prefill runs the layers unrolled on per-layer copies
    (Decoder(..., layers=)): the same hidden states and cache as the scan over the stacked
    layers (a sliding window and q/k norm among the families)."""
    from jaxrl_llm.rollout.decode import unstack_layers

    _, hf, _, ours = family
    rng = np.random.RandomState(4)
    tokens, mask = hf_tiny.left_padded_batch(rng, [7, 3], 7, hf.config.vocab_size)

    @nnx.jit(static_argnames="per_layer")
    def prefill(model, tokens_bt, mask_bt, per_layer: bool):
        layers = unstack_layers(model.model.layers) if per_layer else None
        return model.model(tokens_bt, mask_bt, cache=model.init_cache(2, 10), layers=layers)

    args = (ours, jnp.asarray(tokens), jnp.asarray(mask))
    (h_scan, cache_scan), (h_unrolled, cache_unrolled) = (
        prefill(*args, per_layer=flag) for flag in (False, True)
    )
    # the same float32 ops, fused differently on other CPUs: a little slack over bit-equal
    np.testing.assert_allclose(h_unrolled, h_scan, atol=1e-5, rtol=0)
    for a, b in zip(cache_unrolled, cache_scan, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama3"], indirect=True)
def test_per_layer_modules_are_for_a_cached_forward_of_every_layer(family):
    from jaxrl_llm.models.transformer import scan_layers
    from jaxrl_llm.rollout.decode import unstack_layers

    _, _, _, ours = family
    tokens = jnp.ones((1, 3), jnp.int32)
    layers = unstack_layers(ours.model.layers)
    n = ours.config.num_layers
    with pytest.raises(ValueError, match=rf"layers: {n} per-layer modules .* without a cache"):
        ours.model(tokens, layers=layers)
    with pytest.raises(ValueError, match=rf"{n} per-layer modules .*, got {n - 1}$"):
        ours.model(tokens, cache=ours.init_cache(1, 4), layers=layers[1:])
    with pytest.raises(ValueError, match="per-layer modules run without remat, got 'full'"):
        scan_layers(layers, lambda layer, c, x: (c, None), 0.0, (), remat="full")


def test_config_export_keeps_family_switches(family, tmp_path):
    _, hf, _, ours = family
    exported = ours.config.to_hf_dict()
    again = models.ModelConfig.from_hf(exported)
    assert again == ours.config
    assert exported["architectures"] == [type(hf).__name__]
    json.dumps(exported)
