"""The sampling primitives against transformers' logits warpers and exact frequencies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from jaxrl_llm.rollout import sampling


def hf_keep(logits: np.ndarray, *, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """transformers' kept set: temperature already applied, then top-k, then top-p."""
    scores = torch.tensor(logits, dtype=torch.float32)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return np.isfinite(scores.numpy())


def random_logits(seed: int, n: int = 16, v: int = 64, scale: float = 2.0) -> np.ndarray:
    return (scale * np.random.RandomState(seed).randn(n, v)).astype(np.float32)


@pytest.mark.parametrize("k", [1, 3, 17, 64])
def test_top_k_mask_matches_transformers(k):
    z = random_logits(0)
    ours = np.asarray(sampling.top_k_mask(jnp.asarray(z), k))
    np.testing.assert_array_equal(ours, hf_keep(z, top_k=k))


@pytest.mark.parametrize("p", [1e-6, 0.1, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("scale", [0.5, 4.0])
def test_top_p_mask_matches_transformers(p, scale):
    z = random_logits(1, scale=scale)
    ours = np.asarray(sampling.top_p_mask(jnp.asarray(z), p))
    np.testing.assert_array_equal(ours, hf_keep(z, top_p=p))
    assert ours.sum(-1).min() >= 1


def test_top_p_ignores_minus_inf_and_handles_ties():
    z = np.array([[0.0, 0.0, 0.0, 0.0, -np.inf, -np.inf]], np.float32)
    np.testing.assert_array_equal(
        np.asarray(sampling.top_p_mask(jnp.asarray(z), 0.3)), [[1, 1, 1, 1, 0, 0]]
    )  # four equal tokens: ties at the boundary are all kept
    z = np.log(np.array([[0.5, 0.3, 0.2]], np.float32))
    np.testing.assert_array_equal(np.asarray(sampling.top_p_mask(jnp.asarray(z), 0.5)), [[1, 0, 0]])
    np.testing.assert_array_equal(
        np.asarray(sampling.top_p_mask(jnp.asarray(z), 0.51)), [[1, 1, 0]]
    )


def test_argmax_first_takes_the_first_maximum():
    x = np.array([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -3.0, -0.5]], np.float32)
    np.testing.assert_array_equal(np.asarray(sampling.argmax_first(jnp.asarray(x))), [1, 0, 3])


def test_inverse_cdf_never_picks_a_zero_probability_token():
    p = np.array([[0.0, 0.2, 0.0, 0.3, 0.5, 0.0]] * 5, np.float32)
    u = np.array([0.0, 0.2, 0.4, 0.5, np.nextafter(np.float32(1), np.float32(0))], np.float32)
    got, total = sampling.inverse_cdf(jnp.asarray(p), jnp.asarray(u))
    np.testing.assert_array_equal(np.asarray(got), [1, 3, 3, 4, 4])
    np.testing.assert_allclose(np.asarray(total), 1.0, rtol=1e-6)


def test_two_level_inverse_cdf_matches_searchsorted():
    rng = np.random.RandomState(0)
    p = rng.exponential(size=(64, 1000)).astype(np.float32)  # 1000: not a multiple of 128
    p[:, rng.rand(1000) < 0.3] = 0.0
    u = rng.rand(64).astype(np.float32)
    cdf = np.cumsum(p.astype(np.float64), axis=1)
    ref = [np.searchsorted(c, ui * c[-1], side="right") for c, ui in zip(cdf, u, strict=True)]
    got, total = sampling.inverse_cdf(jnp.asarray(p), jnp.asarray(u))
    np.testing.assert_array_equal(np.asarray(got), ref)
    np.testing.assert_allclose(np.asarray(total), cdf[:, -1], rtol=1e-5)


@pytest.mark.parametrize(
    "kw", [dict(top_k=3), dict(top_p=0.6), dict(top_k=5, top_p=0.7), dict(temperature=0.3)]
)
def test_samples_stay_inside_the_allowed_set(kw):
    z = random_logits(2, n=8, v=40)
    temperature = kw.get("temperature", 1.0)
    allowed = hf_keep(z / temperature, top_k=kw.get("top_k", 0), top_p=kw.get("top_p", 1.0))
    draw = jax.jit(
        jax.vmap(
            lambda key: sampling.sample(
                jnp.asarray(z),
                key,
                temperature=temperature,
                top_k=kw.get("top_k", 0),
                top_p=kw.get("top_p"),
            )
        )
    )
    tokens, logp = draw(jax.random.split(jax.random.key(0), 300))
    tokens = np.asarray(tokens)  # [300, 8]
    rows = np.broadcast_to(np.arange(8), tokens.shape)
    assert allowed[rows, tokens].all()
    # Log-probs are of the renormalised filtered distribution.
    zf = np.where(allowed, z / temperature, -np.inf)
    ref = zf - np.log(np.sum(np.exp(zf - zf.max(-1, keepdims=True)), -1, keepdims=True))
    ref -= zf.max(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(logp), ref[rows, tokens], atol=1e-5, rtol=0)
    if "top_k" in kw or "top_p" in kw:  # and every allowed token is reachable
        seen = np.zeros_like(allowed)
        seen[rows, tokens] = True
        assert (seen == allowed).mean() > 0.97


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.5, top_k=4)])
def test_sample_frequencies_match_the_distribution(kw):
    z = np.array([2.0, 1.5, 1.0, 0.0, -1.0, -3.0], np.float32)
    n = 40_000
    tokens, _ = jax.jit(
        lambda key: sampling.sample(jnp.broadcast_to(jnp.asarray(z), (n, 6)), key, **kw)
    )(jax.random.key(1))
    freq = np.bincount(np.asarray(tokens), minlength=6) / n
    zt = z / kw["temperature"]
    if "top_k" in kw:
        zt = np.where(np.argsort(np.argsort(-zt)) < kw["top_k"], zt, -np.inf)
    expected = np.exp(zt - zt.max()) / np.exp(zt - zt.max()).sum()
    np.testing.assert_allclose(freq, expected, atol=0.01)  # ~4 sigma at n = 40k


def test_greedy_logprob_is_the_untempered_log_softmax():
    z = random_logits(3, n=4, v=10)
    tokens, logp = sampling.sample(jnp.asarray(z), jax.random.key(0), temperature=0.0, greedy=True)
    np.testing.assert_array_equal(np.asarray(tokens), z.argmax(-1))
    ref = jax.nn.log_softmax(jnp.asarray(z), axis=-1)[np.arange(4), z.argmax(-1)]
    np.testing.assert_allclose(np.asarray(logp), np.asarray(ref), atol=1e-6, rtol=0)
