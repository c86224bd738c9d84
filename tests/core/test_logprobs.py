"""Tests for jaxrl_llm.core.logprobs against a float64 loop reference in tests/reference.py."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from jaxrl_llm.core import logprobs
from tests.reference import ref_token_logprobs_and_entropy


def random_logits(seed, batch=2, time=7, vocab=11, scale=3.0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(batch, time, vocab)) * scale).astype(dtype)
    tokens = rng.integers(0, vocab, size=(batch, time)).astype(np.int32)
    return logits, tokens


class AgainstReferenceTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(temperature=(1.0, 0.7), chunk_size=(None, 1, 3, 10))
    def test_logprobs_and_entropy(self, temperature, chunk_size):
        logits, tokens = random_logits(0)
        kw = dict(temperature=temperature, chunk_size=chunk_size)
        logp = self.variant(functools.partial(logprobs.token_logprobs, **kw))(logits, tokens)
        entropy = self.variant(functools.partial(logprobs.token_entropy, **kw))(logits)
        both = self.variant(functools.partial(logprobs.token_logprobs_and_entropy, **kw))(
            logits, tokens
        )
        want_logp, want_entropy = ref_token_logprobs_and_entropy(logits, tokens, temperature)
        np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(entropy, want_entropy, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(both[0], want_logp, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(both[1], want_entropy, rtol=1e-5, atol=1e-5)
        for x in (logp, entropy, *both):
            self.assertEqual(x.dtype, jnp.float32)
            self.assertEqual(x.shape, tokens.shape)

    def test_hand_computed(self):
        logits = jnp.log(jnp.asarray([[[0.5, 0.25, 0.25], [1.0, 1.0, 1.0]]]))
        tokens = jnp.asarray([[1, 2]])
        np.testing.assert_allclose(
            logprobs.token_logprobs(logits, tokens), [[np.log(0.25), -np.log(3.0)]], rtol=1e-6
        )
        h = -(0.5 * np.log(0.5) + 2 * 0.25 * np.log(0.25))
        np.testing.assert_allclose(logprobs.token_entropy(logits), [[h, np.log(3.0)]], rtol=1e-6)
        # τ = 2 divides the logits: p ∝ √(0.5, 0.25, 0.25) = (√0.5, 0.5, 0.5); uniform stays.
        hot = logprobs.token_logprobs(logits, tokens, temperature=2.0)
        np.testing.assert_allclose(hot, [[np.log(0.5 / (np.sqrt(0.5) + 1.0)), -np.log(3.0)]], 1e-6)


class ChunkingTest(parameterized.TestCase):
    @parameterized.parameters(jnp.float32, jnp.bfloat16)
    def test_chunked_equals_unchunked_values_and_gradients(self, dtype):
        logits, tokens = random_logits(1, batch=3, time=13, vocab=17)
        logits = jnp.asarray(logits, dtype)

        def loss(logits, chunk_size):
            logp, entropy = logprobs.token_logprobs_and_entropy(
                logits, tokens, chunk_size=chunk_size, temperature=0.9
            )
            weights = jnp.arange(13, dtype=jnp.float32)[None]  # position-dependent cotangents
            return jnp.sum(logp * weights) + jnp.sum(jnp.sin(entropy))

        values = jax.jit(logprobs.token_logprobs_and_entropy, static_argnames="chunk_size")
        grad_fn = jax.jit(jax.grad(loss), static_argnums=1)
        full = values(logits, tokens, chunk_size=None)
        full_grad = grad_fn(logits, None)
        for chunk_size in (1, 5):  # 5 does not divide 13: the last chunk overlaps
            chunked = values(logits, tokens, chunk_size=chunk_size)
            chex.assert_trees_all_close(chunked, full, rtol=1e-6, atol=1e-6)
            grad = grad_fn(logits, chunk_size)
            self.assertEqual(grad.dtype, dtype)
            np.testing.assert_allclose(
                np.asarray(grad, np.float32), np.asarray(full_grad, np.float32), atol=1e-5
            )

    def test_chunking_bounds_the_f32_working_set(self):
        # Compiled scratch memory, measured with f32 logits: the unchunked forward holds a
        # [B, T, V] f32 temporary and its gradient three, the chunked ones a few [B, C, V] blocks.
        # (XLA:CPU emulates bf16 and may upcast bf16 inputs whole, so f32 is the faithful probe.)
        batch, time, vocab, chunk = 2, 64, 2048, 4  # a chunk is 1/16 of the logits
        logits = jax.ShapeDtypeStruct((batch, time, vocab), jnp.float32)
        tokens = jax.ShapeDtypeStruct((batch, time), jnp.int32)
        full_f32 = batch * time * vocab * 4

        def scratch(fn):
            analysis = jax.jit(fn).lower(logits, tokens).compile().memory_analysis()
            if analysis is None:
                pytest.skip("this backend reports no memory analysis")
            return analysis.temp_size_in_bytes

        def forward(chunk_size):
            return lambda x, y: logprobs.token_logprobs_and_entropy(x, y, chunk_size=chunk_size)

        def backward(chunk_size):
            return jax.grad(lambda x, y: sum(jnp.sum(o) for o in forward(chunk_size)(x, y)))

        self.assertGreaterEqual(scratch(forward(None)), full_f32)
        self.assertLess(scratch(forward(chunk)), full_f32 / 2)
        self.assertGreaterEqual(scratch(backward(None)), full_f32)
        self.assertLess(scratch(backward(chunk)), full_f32 / 2)


class NumericsTest(parameterized.TestCase):
    def test_bf16_logits_give_finite_f32(self):
        logits, tokens = random_logits(2, scale=30.0)
        logits16 = jnp.asarray(logits, jnp.bfloat16)
        for chunk_size in (None, 3):
            logp, entropy = logprobs.token_logprobs_and_entropy(
                logits16, tokens, chunk_size=chunk_size
            )
            self.assertEqual(logp.dtype, jnp.float32)
            self.assertTrue(np.isfinite(logp).all() and np.isfinite(entropy).all())
            want_logp, want_entropy = ref_token_logprobs_and_entropy(
                np.asarray(logits16, np.float64), tokens
            )
            np.testing.assert_allclose(logp, want_logp, rtol=1e-5, atol=1e-4)
            np.testing.assert_allclose(entropy, want_entropy, rtol=1e-5, atol=1e-4)

    def test_extreme_and_minus_inf_logits(self):
        logits = jnp.asarray([[[1e4, -1e4, 0.0, -jnp.inf], [0.0, 0.0, -jnp.inf, -jnp.inf]]])
        tokens = jnp.asarray([[0, 1]])
        logp, entropy = logprobs.token_logprobs_and_entropy(logits, tokens)
        np.testing.assert_allclose(logp, [[0.0, -np.log(2.0)]], atol=1e-6)
        np.testing.assert_allclose(entropy, [[0.0, np.log(2.0)]], atol=1e-6)
        grad = jax.grad(lambda x: jnp.sum(logprobs.token_entropy(x)))(logits)
        self.assertTrue(np.isfinite(grad).all())

    def test_entropy_bounds(self):
        logits, _ = random_logits(3, vocab=23)
        entropy = logprobs.token_entropy(logits)
        self.assertTrue((np.asarray(entropy) >= -1e-6).all())
        self.assertTrue((np.asarray(entropy) <= np.log(23) + 1e-5).all())


class BadInputTest(parameterized.TestCase):
    def test_errors_name_the_argument(self):
        logits, tokens = jnp.zeros((2, 3, 5)), jnp.zeros((2, 3), jnp.int32)
        with pytest.raises(AssertionError, match="token_logprobs: argument `logits_btv`"):
            logprobs.token_logprobs(logits[0], tokens)
        with pytest.raises(TypeError, match="token_logprobs: argument `logits_btv`"):
            logprobs.token_logprobs(logits.astype(jnp.int32), tokens)
        with pytest.raises(TypeError, match="token_logprobs: argument `tokens_bt`"):
            logprobs.token_logprobs(logits, tokens.astype(jnp.float32))
        with pytest.raises(ValueError, match="token_logprobs_and_entropy: argument `tokens_bt`"):
            logprobs.token_logprobs_and_entropy(logits, jnp.zeros((2, 4), jnp.int32))
        with pytest.raises(AssertionError, match="token_logprobs: argument `tokens_bt`"):
            logprobs.token_logprobs(logits, tokens[..., None])
        with pytest.raises(ValueError, match="token_entropy: argument `temperature`"):
            logprobs.token_entropy(logits, temperature=0.0)
        with pytest.raises(ValueError, match="token_logprobs: argument `chunk_size`"):
            logprobs.token_logprobs(logits, tokens, chunk_size=0)
        with pytest.raises(TypeError, match="token_entropy: argument `chunk_size`"):
            logprobs.token_entropy(logits, chunk_size=2.5)
