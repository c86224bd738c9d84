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
from jaxrl_llm.models import logprobs, sharding
from jaxrl_llm.models.logprobs import completion_logprobs
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


def logprob_sums(graphdef, *, passes=1, entropy=None):
    """Minus the next-token log-probs summed over a micro-batch, through the chunked LM head
    (``completion_logprobs``, 2-step chunks: several per row); ``passes`` as above. ``entropy``:
    None, ``"logged"`` (formed, reported as a metric, not differentiated) or ``"bonus"`` (in
    the loss, as an entropy bonus)."""

    def sums(params, micro):
        tokens, mask = micro
        model = nnx.merge(graphdef, params)
        total, ent = 0.0, 0.0
        for _ in range(passes):
            out = completion_logprobs(model, tokens, mask, chunk_size=2, with_entropy=bool(entropy))
            logp, h = out if entropy else (out, jnp.zeros_like(out))
            ent = ent + jnp.sum(h * mask[:, 1:])
            total = total - jnp.sum(logp * mask[:, 1:])
        if entropy == "bonus":
            total = total - 0.1 * ent
        count = jnp.sum(mask[:, 1:]).astype(jnp.float32)
        return total, {"nll": (total, count), "entropy": (jax.lax.stop_gradient(ent), count)}

    return sums


FUSED = ("scan", "map_chunks")  # the fused loops: the layer stack's, the LM head's


def gradient(model, micro, *, fused=True, laid_out=False, sums=ce_sums, **sums_kw):
    """The accumulated gradient of one update, and how many of each fused loop ran fused;
    ``laid_out``: the accumulators laid out like the parameters (as the trainer's are)."""
    graphdef, params = nnx.split(model, nnx.Param)
    trainee = acc.Trainee(
        "m",
        grad_capture(),
        sums(graphdef, **sums_kw),
        lambda mb: jnp.float32(1.0),
        param_sharding=jax.tree.map(lambda x: x.sharding, params) if laid_out else None,
    )
    counts = dict.fromkeys(FUSED, 0)
    plain = {name: getattr(ga, name) for name in FUSED}

    def spy(name):
        def run(*args, **kw):
            out = plain[name](*args, **kw) if fused else None
            counts[name] += out is not None
            return out

        return run

    for name in FUSED:
        setattr(ga, name, spy(name))
    try:
        fn = jax.jit(
            lambda p, b: acc.optimize(
                (trainee,), (p,), (trainee.tx.init(p),), b, micro_batch_size=micro
            )
        )
        _, (opt,), _ = fn(params, batch(model.config.vocab_size))
    finally:
        for name in FUSED:
            setattr(ga, name, plain[name])
    return opt["g"], counts


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
    assert fused_whole["scan"] == 0 and fused_micro["scan"] >= 1 and fused_plain["scan"] == 0
    assert scale(whole) > 1e-2
    assert max_diff(whole, micro) < 1e-5 * scale(whole)
    assert max_diff(plain, micro) < 1e-5 * scale(whole)


def _tiny(**kw) -> CausalLM:
    cfg = tiny_random_config(**{"vocab_size": 97, "remat": "full", **kw})
    return CausalLM(cfg, rngs=nnx.Rngs(0))


def test_a_second_pass_over_the_layers_is_not_fused_and_stays_exact():
    model = _tiny()
    whole, _ = gradient(model, None, passes=2)
    micro, fused = gradient(model, MICRO, passes=2)
    assert fused["scan"] == 1  # the first pass took the accumulators; the second ran the plain scan
    assert max_diff(whole, micro) < 1e-5 * scale(whole)


def test_layers_that_are_not_the_differentiated_arrays_fall_back():
    model = _tiny()
    whole, _ = gradient(model, None, copy=True)
    micro, fused = gradient(model, MICRO, copy=True)
    assert fused["scan"] == 0
    assert max_diff(whole, micro) < 1e-5 * scale(whole)


def test_remat_other_than_full_is_not_fused():
    _, fused = gradient(_tiny(remat="dots"), MICRO)
    assert fused["scan"] == 0


def update_temp_bytes(
    params, sums, vocab: int, *, turned_off: str | None = None, micro: int | None = MICRO
) -> int:
    """XLA's temporaries of a micro-batched Adam update with the state donated (as the
    trainer's); ``turned_off``: one of :data:`FUSED`, made to fall back to the plain loop;
    ``micro``: rows per micro-batch (None: one micro-batch)."""
    trainee = acc.Trainee("m", optax.adam(1e-3), sums, lambda mb: jnp.float32(1.0))
    plain = getattr(ga, turned_off) if turned_off else None
    if turned_off:
        setattr(ga, turned_off, lambda *a, **k: None)
    try:
        fn = jax.jit(
            lambda p, o, b: acc.optimize((trainee,), (p,), (o,), b, micro_batch_size=micro)[:2],
            donate_argnums=(0, 1),
        )
        compiled = fn.lower(params, trainee.tx.init(params), batch(vocab)).compile()
    finally:
        if turned_off:
            setattr(ga, turned_off, plain)
    return compiled.memory_analysis().temp_size_in_bytes


def test_the_fused_program_holds_one_layer_gradient_fewer():
    """Fused against plain, on a model whose layer stack dominates its parameters: plain holds
    the accumulator and the micro-batch's stacked gradient at once."""
    model = _tiny(hidden_size=128, intermediate_size=512, num_layers=4, num_heads=4, head_dim=32)
    graphdef, params = nnx.split(model, nnx.Param)
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(params["model"]["layers"]))
    plain, fused = (
        update_temp_bytes(params, ce_sums(graphdef), 97, turned_off=off) for off in ("scan", None)
    )
    assert plain - fused >= 0.5 * layer_bytes, (plain, fused, layer_bytes)


@pytest.mark.parametrize(
    "tied,dtype,remat,entropy,block_rows",
    [
        (True, "float32", "full", None, None),
        (False, "float32", "none", "logged", None),
        (True, "bfloat16", "full", "bonus", None),
        (False, "float32", "full", "bonus", None),
        (True, "float32", "full", None, 30),  # 3 blocks of 30 rows and one of 7
        (True, "bfloat16", "full", "bonus", 1),  # 97 blocks of one row
        (False, "float32", "none", "logged", 40),  # 2 blocks of 40 and one of 17
    ],
)
def test_the_head_gradient_goes_into_its_accumulator(
    tied, dtype, remat, entropy, block_rows, monkeypatch
):
    """The chunked log-probs' head gradient is added into the head's accumulator (tied: the
    embedding's, which also takes the lookup's gradient; untied: ``lm_head``'s), with or
    without remat, bf16 states included, with an entropy that is only logged (its backward
    is not recomputed) or in the loss, in one block or in blocks of the head's rows; equal to
    the whole batch's and the plain loop's."""
    model = _tiny(tie_word_embeddings=tied, dtype=dtype, remat=remat)
    rows = model.config.vocab_size if block_rows is None else block_rows
    monkeypatch.setattr(logprobs, "HEAD_GRAD_BLOCK_BYTES", 4 * model.config.hidden_size * rows)
    kw = {"sums": logprob_sums, "entropy": entropy}
    whole, _ = gradient(model, None, fused=False, **kw)  # no loop, no accumulator
    own, fused_own = gradient(model, None, **kw)  # no loop, the head's own accumulator
    micro, fused_micro = gradient(model, MICRO, **kw)
    plain, _ = gradient(model, MICRO, fused=False, **kw)
    assert fused_own == {"scan": 0, "map_chunks": 1}
    assert fused_micro["map_chunks"] == 1
    assert fused_micro["scan"] == (remat == "full")
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert scale(whole) > 1e-2
    assert max_diff(whole, own) < tol * scale(whole)
    assert max_diff(whole, micro) < tol * scale(whole)
    assert max_diff(plain, micro) < tol * scale(whole)


def test_a_second_pass_over_the_head_is_not_fused_and_stays_exact():
    model = _tiny()
    whole, _ = gradient(model, None, sums=logprob_sums, passes=2)
    micro, fused = gradient(model, MICRO, sums=logprob_sums, passes=2)
    assert fused["map_chunks"] == 1  # the second pass ran the plain loop
    assert max_diff(whole, micro) < 1e-5 * scale(whole)


def test_the_fused_program_holds_one_head_gradient_fewer():
    """Through the chunked log-probs, on a model whose (tied) head dominates its parameters:
    the plain chunk loop sums the head's gradient in a carry of its own, beside the
    accumulator."""
    model = _tiny(vocab_size=4096, hidden_size=128, head_dim=32)
    graphdef, params = nnx.split(model, nnx.Param)
    head_bytes = params["model"]["embed_tokens"]["embedding"][...].nbytes
    plain, fused = (
        update_temp_bytes(params, logprob_sums(graphdef), 4096, turned_off=off)
        for off in ("map_chunks", None)
    )
    assert plain - fused >= 0.9 * head_bytes, (plain, fused, head_bytes)


def test_the_head_gradient_in_blocks_holds_less_than_in_one(monkeypatch):
    """XLA:CPU writes one chunk's whole ``[V, D]`` head gradient to a buffer of its own before
    adding it into the accumulator; formed in blocks of rows, only a block is (here an eighth
    of the head; the head dominates this model's parameters)."""
    model = _tiny(vocab_size=4096, hidden_size=128, head_dim=32)
    graphdef, params = nnx.split(model, nnx.Param)
    head_bytes = params["model"]["embed_tokens"]["embedding"][...].nbytes
    temps = {}
    for blocks in (1, 8):
        monkeypatch.setattr(logprobs, "HEAD_GRAD_BLOCK_BYTES", head_bytes // blocks)
        temps[blocks] = update_temp_bytes(params, logprob_sums(graphdef), 4096)
    assert temps[1] - temps[8] >= 0.5 * head_bytes, (temps, head_bytes)


def test_one_micro_batch_forms_the_head_gradient_in_blocks_of_its_own_accumulator(monkeypatch):
    """With one micro-batch there is no running sum, but the plain chunk loop still forms each
    chunk's whole head gradient before adding it to its carry; the head's own accumulator takes
    it in blocks (an eighth of the head here)."""
    model = _tiny(vocab_size=4096, hidden_size=128, head_dim=32)
    graphdef, params = nnx.split(model, nnx.Param)
    head_bytes = params["model"]["embed_tokens"]["embedding"][...].nbytes
    monkeypatch.setattr(logprobs, "HEAD_GRAD_BLOCK_BYTES", head_bytes // 8)
    sums = logprob_sums(graphdef)
    plain, own = (
        update_temp_bytes(params, sums, 4096, turned_off=off, micro=None)
        for off in ("map_chunks", None)
    )
    assert plain - own >= 0.5 * head_bytes, (plain, own, head_bytes)


def test_the_head_gradient_is_blocked_only_where_the_head_is_whole_on_each_device():
    model = _tiny()
    rows = logprobs.HEAD_GRAD_BLOCK_BYTES // (4 * model.config.hidden_size)
    assert logprobs.model_head_grad_rows(model) == rows
    for name, blocked in (("fsdp", True), ("fsdp_tp", False)):  # fsdp_tp splits the vocabulary
        mesh, _ = sharding.preset(name, jax.devices()[:4], tensor=2)
        with jax.set_mesh(mesh):
            assert logprobs.model_head_grad_rows(model) == (rows if blocked else None), name


def test_head_gradient_blocks_of_an_fsdp_sharded_head_equal_one_device(monkeypatch):
    """Blocks along the vocabulary of a head whose embedding axis is split over ``fsdp`` (the
    partial sums over each device's rows are reduce-scattered block by block)."""
    whole, _ = gradient(_tiny(), None, fused=False, sums=logprob_sums)  # one device, plain
    monkeypatch.setattr(logprobs, "HEAD_GRAD_BLOCK_BYTES", 4 * 64 * 30)  # 3 blocks of 30 + 7
    mesh, rules = sharding.preset("fsdp", jax.devices()[:2])
    model = sharding.shard_model(_tiny(), mesh, rules)
    with jax.set_mesh(mesh):
        assert logprobs.model_head_grad_rows(model) == 30
        micro, fused = gradient(model, MICRO, laid_out=True, sums=logprob_sums)
        own, fused_own = gradient(model, None, laid_out=True, sums=logprob_sums)  # its own
    assert fused["map_chunks"] == 1 and fused_own["map_chunks"] == 1
    assert max_diff(whole, micro) < 1e-5 * scale(whole)
    assert max_diff(whole, own) < 1e-5 * scale(whole)


def _one_chunk_loss(weight_block_rows, project):
    """``map_chunks`` inside an accumulation block, over one chunk of a [5, 3] weight."""
    w, acc = jnp.ones((5, 3)), jnp.zeros((5, 3))
    xs, ids = jnp.ones((1, 2, 3)), jnp.zeros((1, 2), jnp.int32)

    def loss(w):
        with ga.accumulating_into([w], [acc]):
            out = ga.map_chunks(
                project, lambda z, i: jnp.sum(z), w, xs, ids, weight_block_rows=weight_block_rows
            )
        return jnp.sum(out)

    return jax.grad(loss)(w)


def test_head_gradient_blocks_are_checked():
    def x_wt(w, c, x):
        return x @ w.T

    # Σ z = Σ x Wᵀ over two rows of ones: 2 for every element, in blocks of 2, 2 and 1 rows.
    np.testing.assert_array_equal(_one_chunk_loss(2, x_wt), np.full((5, 3), 2.0))
    with pytest.raises(ValueError, match="weight_block_rows = 0; expected ≥ 1"):
        _one_chunk_loss(0, x_wt)
    with pytest.raises(ValueError, match="last axis runs over the weight's 5 rows"):
        _one_chunk_loss(2, lambda w, c, x: x @ w.T @ jnp.ones((5, 4)))


def test_accumulators_must_match_the_parameters():
    with (
        pytest.raises(ValueError, match="params has 2 leaves but acc has 1"),
        ga.accumulating_into([jnp.zeros(2), jnp.zeros(3)], [jnp.zeros(2)]),
    ):
        pass


def test_own_accumulators_need_one_sharding_per_parameter():
    with (
        pytest.raises(ValueError, match="params has 2 leaves but shardings has 1"),
        ga.own_accumulators([jnp.zeros(2), jnp.zeros(3)], [None]),
    ):
        pass


def test_own_accumulators_take_heads_of_several_chunks_only():
    """A head of one chunk stays plain (its product is the gradient); over two chunks of two
    rows of ones, in blocks of 2, 2 and 1 rows, ∂/∂W Σ x Wᵀ is 4 everywhere."""
    ran = []

    def loss(w, chunks):
        xs, ids = jnp.ones((chunks, 2, 3)), jnp.zeros((chunks, 2), jnp.int32)
        with ga.own_accumulators([w]):
            out = ga.map_chunks(
                lambda w, c, x: x @ w.T, lambda z, i: jnp.sum(z), w, xs, ids, weight_block_rows=2
            )
        ran.append(out is not None)
        return jnp.sum(out) if out is not None else jnp.sum(w)

    w = jnp.arange(15.0).reshape(5, 3)
    jax.grad(loss)(w, 1)
    np.testing.assert_array_equal(jax.grad(loss)(w, 2), np.full((5, 3), 4.0))
    assert ran == [False, True]
