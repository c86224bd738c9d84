"""transformer.low_precision_dot: bf16 matmuls whose backward dots are bf16 too.

The reference is the obvious float32 computation on the bf16-rounded operands: a bf16 x bf16
product is exact in float32, so a float32-accumulated bf16 dot differs from it only in the
order of the additions (and the final rounding to the output dtype).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import models
from jaxrl_llm.models import logprobs as lp
from jaxrl_llm.models import transformer as tr

BF16 = jnp.bfloat16


def _rounded(x):
    """float32 values of ``x`` rounded to bf16 (numpy, float64 arithmetic from here)."""
    return np.asarray(jnp.asarray(x).astype(BF16).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("b_is_nk", [False, True], ids=["[K,N]", "[N,K]"])
@pytest.mark.parametrize("out_dtype", [BF16, jnp.float32])
def test_value_and_gradients_against_the_rounded_float64_reference(b_is_nk, out_dtype):
    ka, kb, kg = jax.random.split(jax.random.key(0), 3)
    m, k, n = 24, 40, 16
    a = jax.random.normal(ka, (m, k)).astype(BF16)
    b = jax.random.normal(kb, (n, k) if b_is_nk else (k, n))  # a float32 master weight
    g = jax.random.normal(kg, (m, n))

    def f(a, b):
        y = tr.low_precision_dot(a, b, out_dtype, b_is_nk)
        return jnp.sum(y.astype(jnp.float32) * g)

    y = tr.low_precision_dot(a, b, out_dtype, b_is_nk)
    da, db = jax.grad(f, argnums=(0, 1))(a, b)
    assert (y.dtype, da.dtype, db.dtype) == (jnp.dtype(out_dtype), BF16, jnp.float32)

    a64, b64 = _rounded(a), _rounded(b)
    b_kn = b64.T if b_is_nk else b64
    g64 = _rounded(g)  # the cotangent goes in as bf16, whatever the output dtype
    tol = 2**-7 if out_dtype == BF16 else 1e-5  # the output's own rounding
    np.testing.assert_allclose(np.asarray(y, np.float64), a64 @ b_kn, rtol=tol, atol=tol * 4)
    # da is rounded to bf16 (a's dtype); db stays float32 (b's), never rounded to bf16.
    np.testing.assert_allclose(np.asarray(da, np.float64), g64 @ b_kn.T, rtol=2**-7, atol=0.05)
    db_ref = a64.T @ g64
    db_ref = db_ref.T if b_is_nk else db_ref
    np.testing.assert_allclose(np.asarray(db), db_ref, rtol=1e-5, atol=1e-4)


def test_the_cotangent_is_rounded_to_bf16_before_the_backward_dots():
    """A float32 cotangent (the LM head's, from a float32 log-softmax) enters the backward
    dots as bf16, as in a bf16 PyTorch model: a cotangent with bits below bf16's gives the
    gradient of its rounded value exactly."""
    a = jnp.ones((1, 1), BF16)
    b = jnp.ones((1, 1), jnp.float32)
    fine = 1.0 + 2.0**-12  # not a bf16 number: rounds to 1.0
    da, db = jax.grad(
        lambda a, b: fine * tr.low_precision_dot(a, b, jnp.float32, False)[0, 0], argnums=(0, 1)
    )(a, b)
    assert float(da[0, 0]) == 1.0 and float(db[0, 0]) == 1.0


def test_float32_matmul_is_the_plain_dot_and_its_autodiff():
    """float32 models (the CPU default) keep the plain dot: same values and gradients, bit for
    bit, as ``jnp.dot`` differentiated by JAX."""
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (3, 5, 8))
    w = jax.random.normal(kw, (8, 4, 6))

    def ours(x, w):
        return jnp.sum(jnp.sin(tr.matmul_2d(x, w, 1)))

    def plain(x, w):
        return jnp.sum(jnp.sin(jnp.dot(x.reshape(-1, 8), w.reshape(8, -1)).reshape(3, 5, 4, 6)))

    for got, want in zip(
        jax.grad(ours, argnums=(0, 1))(x, w), jax.grad(plain, argnums=(0, 1))(x, w), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("remat", ["dots", "dots_no_batch"])
def test_the_dots_remat_policies_save_the_low_precision_dot(remat, capsys):
    """The custom VJP hides the dot from ``dots_saveable``; the name puts it back: under the
    ``dots`` policies a bf16 matmul's output is a saved residual, as a plain dot's is."""
    x = jnp.ones((8, 16), BF16)
    w = jnp.ones((16, 32), jnp.float32)

    def f(x, w):
        return jnp.sum(jnp.tanh(tr.matmul_2d(x, w, 1)).astype(jnp.float32))

    jax.ad_checkpoint.print_saved_residuals(
        jax.checkpoint(f, policy=tr._REMAT_POLICIES[remat]), x, w
    )
    saved = capsys.readouterr().out
    assert f"named '{tr.LOW_PRECISION_DOT}'" in saved and "bf16[8,32] named" in saved, saved
    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(f, policy=None), x, w)
    assert tr.LOW_PRECISION_DOT not in capsys.readouterr().out  # "full" saves none


def test_a_bf16_models_gradient_is_the_float32_models_within_bf16_error():
    """The whole log-prob pass of a tiny model (projections, LM head, tied embedding) in bf16:
    its parameter gradient (float32 masters) against the same weights' float32 model."""
    cfg32 = models.tiny_random_config(vocab_size=512)
    cfg16 = models.tiny_random_config(vocab_size=512, dtype="bfloat16")
    graphdef32, params = nnx.split(models.CausalLM(cfg32, rngs=nnx.Rngs(0)))
    graphdef16, params16 = nnx.split(models.CausalLM(cfg16, rngs=nnx.Rngs(0)))
    assert jax.tree.structure(params) == jax.tree.structure(params16)
    tokens = jax.random.randint(jax.random.key(2), (4, 24), 3, 512)

    def grad(graphdef):
        def loss(p):
            lm = nnx.merge(graphdef, p)
            return jnp.mean(lp.completion_logprobs(lm, tokens, start=8))

        return jax.jit(jax.grad(loss))(params)

    g32, g16 = grad(graphdef32), grad(graphdef16)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(g32), jax.tree.leaves(g16), strict=True
    ):
        name = jax.tree_util.keystr(path)
        assert b.dtype == jnp.float32, name  # master weights get float32 gradients
        rel = float(jnp.linalg.norm(b - a) / jnp.maximum(jnp.linalg.norm(a), 1e-12))
        assert rel < 0.05, (name, rel)


def test_a_float16_head_keeps_the_plain_dot():
    """Only bf16 (float32's exponent range) rounds the LM head's float32 cotangent: a
    token's log-prob gradient ``(onehot - p)·scale`` is easily below float16's smallest
    subnormal (6e-8). A float16 head is differentiated as before, bit for bit."""
    cfg = models.tiny_random_config(vocab_size=64, dtype="float16")
    graphdef, params = nnx.split(models.CausalLM(cfg, rngs=nnx.Rngs(0)))
    h = jax.random.normal(jax.random.key(3), (5, 64)).astype(jnp.float16)
    g = 1e-7 * jax.random.normal(jax.random.key(4), (5, 64))

    def ours(h, p):
        return jnp.sum(g * nnx.merge(graphdef, p).logits(h))

    def plain(h, p):
        w = p["model"]["embed_tokens"]["embedding"][...].astype(jnp.float16)  # tied head
        dims = (((1,), (1,)), ((), ()))
        return jnp.sum(g * jax.lax.dot_general(h, w, dims, preferred_element_type=jnp.float32))

    got_h, got_p = jax.grad(ours, argnums=(0, 1))(h, params)
    want_h, want_p = jax.grad(plain, argnums=(0, 1))(h, params)
    np.testing.assert_array_equal(np.asarray(got_h), np.asarray(want_h))
    for p in (got_p, want_p):
        assert p["model"]["embed_tokens"]["embedding"][...].dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(got_p["model"]["embed_tokens"]["embedding"][...]),
        np.asarray(want_p["model"]["embed_tokens"]["embedding"][...]),
    )
