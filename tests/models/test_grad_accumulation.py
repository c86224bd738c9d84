"""Gradient accumulation fused into the layer scan's backward pass (models/grad_accumulation.py).

Through the accumulation engine (``train/accumulate.optimize``): a micro-batched update of a
rematerialised model takes the fused path, and its gradient equals the whole batch's (no loop,
no accumulator) and the plain accumulation's; what cannot be fused falls back and stays exact;
and the fused program holds one gradient-sized buffer fewer.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl_llm import models
from jaxrl_llm.models import grad_accumulation as ga
from jaxrl_llm.models.tiny import tiny_random_config
from jaxrl_llm.models.transformer import CausalLM
from jaxrl_llm.train import accumulate as acc
from tests.models import hf_tiny

FAMILIES = sorted(hf_tiny.FAMILIES)
ROWS, MICRO, SEQ = 6, 2, 10


def grad_capture() -> optax.GradientTransformation:
    """An 'optimizer' that keeps the gradient it is given (parameters unchanged)."""
    return optax.GradientTransformation(
        lambda p: {"g": jax.tree.map(jnp.zeros_like, p)},
        lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), {"g": g}),
    )


def ce_sums(graphdef, *, passes=1, copy=False):
    """Next-token cross-entropy summed over a micro-batch of ``(tokens, mask)``; ``passes``
    forward passes over the same rows; ``copy`` runs the model on a copy of the parameters
    (new arrays: nothing for the fused scan to match)."""

    def sums(params, micro):
        tokens, mask = micro
        if copy:
            params = jax.tree.map(lambda p: p * 1.0, params)
        model = nnx.merge(graphdef, params)
        total = 0.0
        for _ in range(passes):
            logp = jax.nn.log_softmax(model(tokens, mask)[:, :-1])
            nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
            total = total + jnp.sum(nll * mask[:, 1:])
        return total, {"nll": (total, jnp.sum(mask[:, 1:]).astype(jnp.float32))}

    return sums


def batch(vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (ROWS, SEQ)).astype(np.int32)
    mask = np.arange(SEQ)[None] >= rng.integers(0, 4, (ROWS, 1))  # left padding
    return jnp.asarray(tokens), jnp.asarray(mask)


def gradient(model, micro, *, fused=True, **sums_kw):
    """The accumulated gradient of one update, and how many layer scans were fused."""
    graphdef, params = nnx.split(model, nnx.Param)
    trainee = acc.Trainee(
        "m", grad_capture(), ce_sums(graphdef, **sums_kw), lambda mb: jnp.float32(1.0)
    )
    count = []
    plain = ga.scan

    def spy(*args, **kw):
        out = plain(*args, **kw) if fused else None
        count.append(out is not None)
        return out

    ga.scan = spy
    try:
        fn = jax.jit(
            lambda p, b: acc.optimize(
                (trainee,), (p,), (trainee.tx.init(p),), b, micro_batch_size=micro
            )
        )
        _, (opt,), _ = fn(params, batch(model.config.vocab_size))
    finally:
        ga.scan = plain
    return opt["g"], sum(count)


def max_diff(a, b) -> float:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in pairs)


def scale(tree) -> float:
    return max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(tree))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, our model of that tiny HF family, rematerialised)."""
    path = tmp_path_factory.mktemp(request.param)
    hf_tiny.build_hf(request.param).save_pretrained(path)
    return request.param, models.from_pretrained(path, remat="full")


def test_fused_micro_batches_equal_the_whole_batch_for_every_family(family):
    _, model = family
    whole, fused_whole = gradient(model, None)  # one micro-batch: no loop, no accumulator
    micro, fused_micro = gradient(model, MICRO)
    plain, fused_plain = gradient(model, MICRO, fused=False)
    assert fused_whole == 0 and fused_micro >= 1 and fused_plain == 0
    assert scale(whole) > 1e-2
    assert max_diff(whole, micro) < 1e-5 * scale(whole)
    assert max_diff(plain, micro) < 1e-5 * scale(whole)


def _tiny(**kw) -> CausalLM:
    cfg = tiny_random_config(vocab_size=97, **{"remat": "full", **kw})
    return CausalLM(cfg, rngs=nnx.Rngs(0))


def test_a_second_pass_over_the_layers_is_not_fused_and_stays_exact():
    model = _tiny()
    whole, _ = gradient(model, None, passes=2)
    micro, fused = gradient(model, MICRO, passes=2)
    assert fused == 1  # the first pass took the accumulators; the second ran the plain scan
    assert max_diff(whole, micro) < 1e-5 * scale(whole)


def test_layers_that_are_not_the_differentiated_arrays_fall_back():
    model = _tiny()
    whole, _ = gradient(model, None, copy=True)
    micro, fused = gradient(model, MICRO, copy=True)
    assert fused == 0
    assert max_diff(whole, micro) < 1e-5 * scale(whole)


def test_remat_other_than_full_is_not_fused():
    _, fused = gradient(_tiny(remat="dots"), MICRO)
    assert fused == 0


def test_the_fused_program_holds_one_layer_gradient_fewer():
    """XLA's temporaries of a micro-batched Adam update with the state donated (as the
    trainer's), fused against plain, on a model whose layer stack dominates its parameters:
    plain holds the accumulator and the micro-batch's stacked gradient at once."""
    model = _tiny(hidden_size=128, intermediate_size=512, num_layers=4, num_heads=4, head_dim=32)
    graphdef, params = nnx.split(model, nnx.Param)
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(params["model"]["layers"]))
    trainee = acc.Trainee("m", optax.adam(1e-3), ce_sums(graphdef), lambda mb: jnp.float32(1.0))

    def temp_bytes(fused: bool) -> int:
        plain = ga.scan
        ga.scan = plain if fused else (lambda *a, **k: None)
        try:
            fn = jax.jit(
                lambda p, o, b: acc.optimize((trainee,), (p,), (o,), b, micro_batch_size=MICRO)[:2],
                donate_argnums=(0, 1),
            )
            compiled = fn.lower(params, trainee.tx.init(params), batch(97)).compile()
        finally:
            ga.scan = plain
        return compiled.memory_analysis().temp_size_in_bytes

    plain, fused = temp_bytes(False), temp_bytes(True)
    assert plain - fused >= 0.5 * layer_bytes, (plain, fused, layer_bytes)


def test_accumulators_must_match_the_parameters():
    with (
        pytest.raises(ValueError, match="params has 2 leaves but acc has 1"),
        ga.accumulating_into([jnp.zeros(2), jnp.zeros(3)], [jnp.zeros(2)]),
    ):
        pass
