"""jaxrl_llm.train.accumulate on a toy masked regression, the way optax tests ``MultiSteps``.

The objective is a masked linear regression ``r = x·w + b − y`` over ``[N, T]`` tokens whose
``(sum, denominator)`` loss has a known gradient; the engine must equal the whole-minibatch
gradient, a hand-written loop of optax updates on the strided minibatches, and one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.models import attention
from jaxrl_llm.train import accumulate as acc

D = 4  # features
NONFINITE = acc.NONFINITE


def make_batch(seed: int = 0, n: int = 8, t: int = 5) -> dict[str, jax.Array]:
    """x ``[N, T, D]``, targets y and z ``[N, T]``, a ragged mask (row 1 full, some rows empty)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, t + 1, n)
    lengths[:2] = t
    return {
        "x": jnp.asarray(rng.normal(size=(n, t, D)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(n, t)), jnp.float32),
        "z": jnp.asarray(rng.normal(size=(n, t)), jnp.float32),
        "mask": jnp.asarray(np.arange(t)[None, :] < lengths[:, None]),
    }


def init_params(seed: int = 1) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {
        "w": jnp.asarray(rng.normal(size=D), jnp.float32),
        "b": jnp.asarray(0.3, jnp.float32),
    }


def residual(params, mb, target="y"):
    return jnp.einsum("...td,d->...t", mb["x"], params["w"]) + params["b"] - mb[target]


def token_sums(params, mb):
    """Token mean of r²: Σ_mask r², with metrics."""
    r = residual(params, mb)
    mask = mb["mask"]
    loss = jnp.sum(jnp.where(mask, r * r, 0.0))
    return loss, {
        "fit/loss": (loss, jnp.sum(mask, dtype=jnp.float32)),
        "fit/residual": acc.token_pair(r, mask),
    }


def token_den(mb):
    return jnp.sum(mb["mask"], dtype=jnp.float32)


def seq_sums(params, mb, target="y"):
    """Sequence mean of the token means of r² (empty rows add 0)."""
    r = residual(params, mb, target)
    mask = mb["mask"]
    length = jnp.sum(mask, axis=-1, dtype=jnp.float32)
    per_row = jnp.sum(jnp.where(mask, r * r, 0.0), axis=-1) / jnp.maximum(length, 1.0)
    loss = jnp.sum(per_row)
    return loss, {"seq/loss": (loss, seq_den(mb))}


def seq_den(mb):
    """The number of non-empty sequences: from the mask only."""
    return jnp.sum(jnp.any(mb["mask"], axis=-1), dtype=jnp.float32)


def whole_loss(sums, den):
    """The loss of a whole (flat) minibatch, Σ / max(D, 1)."""
    return lambda params, mb: sums(params, mb)[0] / jnp.maximum(den(mb), 1.0)


def grad_capture() -> optax.GradientTransformation:
    """An 'optimizer' that stores the gradient it is given in its state (params unchanged)."""
    return optax.GradientTransformation(
        lambda p: {"g": jax.tree.map(jnp.zeros_like, p)},
        lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), {"g": g}),
    )


def run(trainees, params, batch, **kw):
    """``optimize`` under one jit, from fresh optimizer states."""
    opts = tuple(t.tx.init(p) for t, p in zip(trainees, params, strict=True))
    fn = jax.jit(lambda p, o, b: acc.optimize(trainees, p, o, b, **kw))
    return fn(tuple(params), opts, batch)


def rows_of(j: int, *, num_minibatches: int, num_micro: int, micro: int) -> np.ndarray:
    """Minibatch j's rows under the strided split: micro-step s = j·K + k takes {i·S + s}."""
    steps = num_minibatches * num_micro
    return np.array([i * steps + j * num_micro + k for k in range(num_micro) for i in range(micro)])


def take(batch, rows):
    return jax.tree.map(lambda x: x[np.asarray(rows, np.int32)], batch)


def max_diff(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def bit_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb, strict=True)
    )


# ---------------------------------------------------------------------------------------------


def test_strided_split_takes_rows_i_times_steps_plus_s():
    x = jnp.arange(24 * 2).reshape(24, 2)
    out = acc.strided_split(x, 2, 3)  # M=2, K=3, m=4, S=6
    assert out.shape == (2, 3, 4, 2)
    for j in range(2):
        for k in range(3):
            s = j * 3 + k
            np.testing.assert_array_equal(out[j, k, :, 0], x[s::6, 0])
    assert acc.split_sizes({"a": x}, num_minibatches=2, micro_batch_size=4) == (2, 3, 4)
    assert acc.split_sizes({"a": x}, num_minibatches=3) == (3, 1, 8)


def test_token_pair_and_finalize():
    x = jnp.asarray([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = jnp.asarray([[True, True, False], [True, False, False]])
    total, count = acc.token_pair(x, mask)
    assert float(total) == 6.0 and float(count) == 3.0
    assert float(acc.finalize((total, count))) == 2.0
    assert float(acc.finalize((jnp.float32(0), jnp.float32(0)))) == 0.0  # empty: 0, not NaN


@pytest.mark.parametrize(
    "sums,den", [(token_sums, token_den), (seq_sums, seq_den)], ids=["token", "seq"]
)
@pytest.mark.parametrize("micro", [None, 4, 2, 1])
def test_micro_batches_equal_the_whole_minibatch(sums, den, micro):
    batch, params = make_batch(), init_params()
    trainee = acc.Trainee("fit", grad_capture(), sums, den)
    (p,), (o,), metrics = run((trainee,), (params,), batch, micro_batch_size=micro)
    expected = jax.grad(whole_loss(sums, den))(params, batch)
    assert max_diff(o["g"], expected) < 1e-6
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(expected)) > 1e-2
    assert bit_equal(p, params)  # grad_capture does not move them
    np.testing.assert_allclose(
        metrics["fit/grad_norm"], optax.tree.norm(expected), rtol=1e-6, atol=1e-7
    )
    loss_key = "fit/loss" if sums is token_sums else "seq/loss"
    np.testing.assert_allclose(metrics[loss_key], whole_loss(sums, den)(params, batch), rtol=1e-6)
    assert float(metrics["update/nonfinite"]) == 0.0


def test_token_mean_gradient_is_the_known_one():
    """∂/∂w mean_mask r² = 2 Σ_mask r·x / Σ mask, ∂/∂b = 2 Σ_mask r / Σ mask (4 micro-batches)."""
    batch, params = make_batch(3), init_params()
    trainee = acc.Trainee("fit", grad_capture(), token_sums, token_den)
    _, (o,), metrics = run((trainee,), (params,), batch, micro_batch_size=2)
    x, y, mask = (np.asarray(batch[k], np.float64) for k in ("x", "y", "mask"))
    r = x @ np.asarray(params["w"], np.float64) + float(params["b"]) - y
    count = mask.sum()
    np.testing.assert_allclose(o["g"]["w"], 2 * np.einsum("nt,ntd->d", mask * r, x) / count, 1e-5)
    np.testing.assert_allclose(o["g"]["b"], 2 * (mask * r).sum() / count, rtol=1e-5)
    np.testing.assert_allclose(metrics["fit/residual"], (mask * r).sum() / count, rtol=1e-5)


@pytest.mark.parametrize(
    "epochs,num_minibatches,micro", [(1, 2, None), (2, 2, 2), (3, 4, 1), (2, 1, 4)]
)
def test_epochs_and_minibatches_equal_a_hand_written_loop(epochs, num_minibatches, micro):
    batch, params = make_batch(1, n=8), init_params()
    tx = optax.adam(0.05)
    trainee = acc.Trainee("fit", tx, token_sums, token_den)
    (p,), (o,), metrics = run(
        (trainee,),
        (params,),
        batch,
        epochs=epochs,
        num_minibatches=num_minibatches,
        micro_batch_size=micro,
    )

    minibatch = 8 // num_minibatches
    m = micro or minibatch
    loss_fn = jax.value_and_grad(whole_loss(token_sums, token_den))
    hand, state, losses, norms = params, tx.init(params), [], []
    for _ in range(epochs):
        for j in range(num_minibatches):
            rows = rows_of(j, num_minibatches=num_minibatches, num_micro=minibatch // m, micro=m)
            if m == minibatch:  # K = 1: minibatch j is rows j, j + M, j + 2M, ...
                assert list(rows) == list(range(j, 8, num_minibatches))
            loss, g = loss_fn(hand, take(batch, rows))
            updates, state = tx.update(g, state, hand)
            hand = optax.apply_updates(hand, updates)
            losses.append(float(loss))
            norms.append(float(optax.tree.norm(g)))
    assert max_diff(p, hand) < 1e-5
    assert max_diff(o, state) < 1e-5
    np.testing.assert_allclose(metrics["fit/loss"], np.mean(losses), rtol=1e-5)
    np.testing.assert_allclose(metrics["fit/grad_norm"], np.mean(norms), rtol=1e-5)
    assert max_diff(p, params) > 1e-3


def test_minibatches_are_strided_not_contiguous():
    """With M=2 and K=2, minibatch 0 is rows {0, 4, 1, 5}: not rows 0..3."""
    batch, params = make_batch(2, n=8), init_params()
    trainee = acc.Trainee("fit", grad_capture(), token_sums, token_den)
    _, (o,), _ = run((trainee,), (params,), batch, num_minibatches=2, micro_batch_size=2)
    assert list(rows_of(1, num_minibatches=2, num_micro=2, micro=2)) == [2, 6, 3, 7]
    last = jax.grad(whole_loss(token_sums, token_den))(params, take(batch, [2, 6, 3, 7]))
    contiguous = jax.grad(whole_loss(token_sums, token_den))(params, take(batch, [4, 5, 6, 7]))
    assert max_diff(o["g"], last) < 1e-6  # the state holds the last minibatch's gradient
    assert max_diff(o["g"], contiguous) > 1e-3


def poisoned_sums(params, mb):
    """token_sums plus a constant: an inf there makes the loss non-finite, the gradient not."""
    loss, aux = token_sums(params, mb)
    return loss + jax.lax.stop_gradient(jnp.sum(mb["poison"])), aux


# The skip's two forms: a lax.cond (traced for CPU, TPU) and a per-leaf select (traced for a
# GPU, whose XLA copies the whole state into a cond's result: accumulate._apply).
SKIP_FORMS = {"cond": None, "select": "gpu"}


@pytest.mark.parametrize("form", SKIP_FORMS)
@pytest.mark.parametrize("where", ["gradient", "loss"])
def test_a_nonfinite_update_is_skipped_bit_for_bit_and_counted(where, form):
    with attention.for_platform(SKIP_FORMS[form]):
        check_the_nonfinite_skip(where, form)


def check_the_nonfinite_skip(where: str, form: str) -> None:
    batch, params = make_batch(4, n=8), init_params()
    batch["poison"] = jnp.zeros((8,), jnp.float32)
    if where == "gradient":  # row 1 (fully masked in) is in minibatch 1 of 2
        bad = dict(batch, x=batch["x"].at[1, 2, 0].set(jnp.nan))
    else:
        bad = dict(batch, poison=batch["poison"].at[1].set(jnp.inf))
    tx = optax.adam(0.05)
    trainee = acc.Trainee("fit", tx, poisoned_sums, token_den)
    opt0 = tx.init(params)

    # One minibatch: nothing moves, not even adam's count.
    fn = jax.jit(lambda p, o, b, **kw: acc.optimize((trainee,), p, o, b, **kw))
    assert acc.skip_by_select() == (form == "select")
    conds = str(jax.make_jaxpr(fn)((params,), (opt0,), bad)).count(" cond[")
    assert conds == (form == "cond")  # the one skip: a cond, or selects
    (p,), (o,), metrics = fn((params,), (opt0,), bad)
    assert bit_equal(p, params) and bit_equal(o, opt0)
    assert float(metrics["update/nonfinite"]) == 1.0
    if where == "loss":
        assert np.isfinite(float(metrics["fit/grad_norm"]))

    # Two minibatches × three epochs: minibatch 1 is skipped every epoch, minibatch 0 is not.
    (p, o, m2) = run((trainee,), (params,), bad, epochs=3, num_minibatches=2)
    (p_good,), (o_good,), _ = run((trainee,), (params,), take(batch, np.arange(0, 8, 2)), epochs=3)
    assert float(m2["update/nonfinite"]) == 3.0
    assert max_diff(p[0], p_good) < 1e-6 and max_diff(o[0], o_good) < 1e-6
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves((p, o)))


def critic_trainee(tx=None):
    """A second model: its own weights, the seq-mean loss of a regression on z."""
    return acc.Trainee(
        "critic",
        tx or optax.sgd(0.1, momentum=0.9),
        lambda params, mb: seq_sums(params, mb, target="z"),
        seq_den,
    )


def test_two_trainees_are_updated_independently():
    batch = make_batch(5, n=8)
    actor = acc.Trainee("actor", optax.adam(0.05), token_sums, token_den)
    critic = critic_trainee()
    params = (init_params(1), init_params(2))
    kw = dict(epochs=2, num_minibatches=2, micro_batch_size=2)
    p, o, metrics = run((actor, critic), params, batch, **kw)
    (p_a,), (o_a,), m_a = run((actor,), params[:1], batch, **kw)
    (p_c,), (o_c,), m_c = run((critic,), params[1:], batch, **kw)
    assert max_diff(p[0], p_a) < 1e-6 and max_diff(o[0], o_a) < 1e-6
    assert max_diff(p[1], p_c) < 1e-6 and max_diff(o[1], o_c) < 1e-6
    for key in ("actor/grad_norm", "critic/grad_norm"):
        assert key in metrics
    np.testing.assert_allclose(metrics["actor/grad_norm"], m_a["actor/grad_norm"], rtol=1e-6)
    np.testing.assert_allclose(metrics["seq/loss"], m_c["seq/loss"], rtol=1e-6)

    # A NaN only the critic reads, in row 0 (minibatch 0): the critic skips minibatch 0 every
    # epoch, so it equals a critic trained on minibatch 1 alone; the actor is not affected.
    bad = dict(batch, z=batch["z"].at[0, 0].set(jnp.nan))
    p, o, metrics = run((actor, critic), params, bad, **kw)
    rows = rows_of(1, num_minibatches=2, num_micro=2, micro=2)
    (p_c1,), (o_c1,), _ = run((critic,), params[1:], take(bad, rows), epochs=2)
    assert max_diff(p[0], p_a) < 1e-6 and max_diff(o[0], o_a) < 1e-6
    assert max_diff(p[1], p_c1) < 1e-6 and max_diff(o[1], o_c1) < 1e-6
    assert float(metrics["update/nonfinite"]) == 2.0  # minibatch 0 of each of 2 epochs


# The toy train state of make_step: (step, params, opt_state).


def read(state):
    return state[0], (state[1],), (state[2],)


def write(state, step, params, opt_states):
    return (step, params[0], opt_states[0])


def test_make_step_bumps_the_step_reports_the_lr_and_checks_the_batch():
    batch, params = make_batch(6), init_params()
    tx = optax.adam(0.05)
    schedule = lambda step: 0.05 * (step + 1.0)
    trainee = acc.Trainee("fit", tx, token_sums, token_den, schedule=schedule)

    def check(batch):
        if "mask" not in batch:
            raise ValueError("the batch needs a mask")

    step = acc.make_step(
        (trainee,), read=read, write=write, num_minibatches=2, micro_batch_size=2, check=check
    )
    state = (jnp.asarray(0, jnp.int32), params, tx.init(params))
    (p_ref,), (o_ref,), _ = run((trainee,), (params,), batch, num_minibatches=2, micro_batch_size=2)
    state, metrics = step(state, batch)
    assert int(state[0]) == 1
    assert max_diff(state[1], p_ref) < 1e-6 and max_diff(state[2], o_ref) < 1e-6
    np.testing.assert_allclose(metrics["fit/lr"], 0.05)
    state, metrics = step(state, batch)
    assert int(state[0]) == 2
    np.testing.assert_allclose(metrics["fit/lr"], 0.1)
    assert set(metrics) == {"fit/loss", "fit/residual", "fit/grad_norm", "fit/lr", NONFINITE}
    with pytest.raises(ValueError, match="needs a mask"):
        step(state, {k: v for k, v in batch.items() if k != "mask"})


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
def test_sharded_over_8_devices_equals_one_device():
    """Batch over (data, fsdp) = (4, 2), w split over fsdp, accumulators laid out like w."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "fsdp"))
    batch, params = make_batch(7, n=32), init_params()
    shard = lambda tree: jax.tree.map(
        lambda x: NamedSharding(mesh, P("fsdp") if jnp.shape(x) == (D,) else P()), tree
    )
    tx = optax.adam(0.05)
    kw = dict(epochs=2, num_minibatches=2, micro_batch_size=8)  # K = 2 micro-batches of 8 rows
    state = (jnp.asarray(0, jnp.int32), params, tx.init(params))
    sharding = shard(state)

    def make(mesh):
        trainees = (
            acc.Trainee(
                "actor",
                tx,
                token_sums,
                token_den,
                param_sharding=None if mesh is None else sharding[1],
            ),
        )
        return acc.make_step(
            trainees,
            read=read,
            write=write,
            mesh=mesh,
            state_sharding=None if mesh is None else sharding,
            batch_axes=("data", "fsdp"),
            **kw,
        )

    one, m_one = make(None)(jax.tree.map(jnp.copy, state), batch)
    sharded, m_sharded = make(mesh)(jax.tree.map(jnp.copy, state), batch)
    assert max_diff(one, sharded) < 1e-6
    for key, value in m_one.items():
        np.testing.assert_allclose(m_sharded[key], value, rtol=1e-6, atol=1e-7, err_msg=key)
    assert sharded[1]["w"].sharding.spec == P("fsdp")
    assert len(sharded[1]["w"].sharding.device_set) == 8
    with pytest.raises(ValueError, match="state_sharding"):
        acc.jit_step(lambda s, b: (s, {}), mesh=mesh)


def test_the_batch_constrainer_splits_the_leading_axis():
    assert acc.batch_constrainer(None, "data") is acc.identity
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (fake) devices")
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    constrain = acc.batch_constrainer(mesh, "data")
    out = jax.jit(constrain)({"a": jnp.zeros((8, 3)), "b": jnp.zeros((16,))})
    for x in out.values():
        assert x.sharding.spec[0] == "data" and len(x.sharding.device_set) == 8


@pytest.mark.parametrize(
    "n,kw,match",
    [
        (10, dict(num_minibatches=3), "batch of 10 rows does not split into 3 minibatches"),
        (8, dict(num_minibatches=2, micro_batch_size=3), "minibatch of 4 rows .* of 3"),
        (6, dict(micro_batch_size=4), "minibatch of 6 rows .* of 4"),
        (8, dict(num_minibatches=0), "num_minibatches must be a positive integer, got 0"),
        (8, dict(micro_batch_size=0), "micro_batch_size must be a positive integer, got 0"),
        (8, dict(epochs=0), "epochs must be a positive integer, got 0"),
    ],
)
def test_bad_sizes_raise_a_clear_value_error(n, kw, match):
    batch, params = make_batch(n=n), init_params()
    trainee = acc.Trainee("fit", optax.sgd(0.1), token_sums, token_den)
    with pytest.raises(ValueError, match=match):
        acc.optimize((trainee,), (params,), (trainee.tx.init(params),), batch, **kw)
    if "positive" in match:  # make_step refuses them when it is built
        with pytest.raises(ValueError, match=match):
            acc.make_step((trainee,), read=read, write=write, **kw)
    else:  # and at the first call otherwise
        step = acc.make_step((trainee,), read=read, write=write, **kw)
        with pytest.raises(ValueError, match=match):
            step((jnp.asarray(0), params, trainee.tx.init(params)), batch)


def test_bad_batches_and_trainees_raise_a_clear_value_error():
    batch, params = make_batch(), init_params()
    trainee = acc.Trainee("fit", optax.sgd(0.1), token_sums, token_den)
    opt = trainee.tx.init(params)
    with pytest.raises(ValueError, match=r"disagree on the number of rows: \[7, 8\]"):
        acc.optimize((trainee,), (params,), (opt,), dict(batch, y=batch["y"][:7]))
    with pytest.raises(ValueError, match="0 rows"):
        acc.optimize((trainee,), (params,), (opt,), take(batch, np.arange(0)))
    with pytest.raises(ValueError, match="unique"):
        acc.optimize((trainee, trainee), (params, params), (opt, opt), batch)
    with pytest.raises(ValueError, match="2 trainees need as many"):
        acc.optimize((trainee, critic_trainee()), (params,), (opt,), batch)


# ---------------------------------------------------------------------------------------------
# Ragged micro-batches (packing, token budgets).


def ragged_batch(batch, num_minibatches, groups_per_mb, slots):
    """A :class:`~jaxrl_llm.train.accumulate.Ragged` view of ``batch``: minibatch j's rows
    (strided, as the flat split) as ``shared``; each micro slot k selects the rows listed in
    ``groups_per_mb[j][k]`` by a 0/1 membership vector, unused slots select nothing."""
    n = batch["mask"].shape[0]
    mb_rows = [np.arange(j, n, num_minibatches) for j in range(num_minibatches)]
    shared = jax.tree.map(lambda x: jnp.stack([x[r] for r in mb_rows]), batch)
    member = np.zeros((num_minibatches, slots, n // num_minibatches), bool)
    for j, groups in enumerate(groups_per_mb):
        for k, rows in enumerate(groups):
            member[j, k, rows] = True
    count = np.asarray([len(g) for g in groups_per_mb], np.int32)
    return acc.Ragged(shared, {"member": jnp.asarray(member)}, jnp.asarray(count))


def ragged_sums(sums):
    def fn(params, mb):
        shared, micro = mb
        mask = shared["mask"] & micro["member"][:, None]
        return sums(params, {**shared, "mask": mask})

    return fn


@pytest.mark.parametrize(("sums", "den"), [(token_sums, token_den), (seq_sums, seq_den)])
def test_ragged_equals_flat_minibatches(sums, den):
    """A ragged split (2 and 3 micro-batches of uneven sizes in 4 slots) equals the flat
    update with whole minibatches (strided), over two epochs, and unused slots are not run."""
    batch = make_batch(3, n=12)
    m = 2
    flat = acc.Trainee("fit", optax.sgd(0.1), sums, den)
    ragged = acc.Trainee("fit", optax.sgd(0.1), ragged_sums(sums), lambda mb: den(mb[0]))
    groups = [[[0, 4], [1, 2, 3], [5]], [[5, 0], [1, 2, 3, 4]]]
    rb = ragged_batch(batch, m, groups, slots=4)
    p_flat, _, m_flat = run([flat], [init_params()], batch, num_minibatches=m, epochs=2)
    p_rag, _, m_rag = run([ragged], [init_params()], rb, epochs=2)
    assert max_diff(p_flat, p_rag) < 1e-6
    assert set(m_flat) == set(m_rag)
    assert max_diff(m_flat, {k: m_rag[k] for k in m_flat}) < 1e-5


def test_ragged_unused_slots_are_not_computed():
    """A NaN in an unused slot's data never reaches the update (the loop stops at count)."""
    batch = make_batch(4, n=8)
    rb = ragged_batch(batch, 1, [[[0, 1, 2, 3], [4, 5, 6, 7]]], slots=3)
    poison = rb.micro["member"].astype(jnp.float32).at[0, 2].set(jnp.nan)
    rb = rb._replace(micro={"member": rb.micro["member"], "poison": poison})

    def sums(params, mb):
        loss, aux = ragged_sums(token_sums)(params, mb)
        return loss + jnp.sum(mb[1]["poison"]) * 0.0, aux

    t = acc.Trainee("fit", optax.sgd(0.1), sums, lambda mb: token_den(mb[0]))
    flat = acc.Trainee("fit", optax.sgd(0.1), token_sums, token_den)
    p_rag, _, metrics = run([t], [init_params()], rb)
    p_flat, _, _ = run([flat], [init_params()], batch)
    assert float(metrics[NONFINITE]) == 0.0
    assert max_diff(p_flat, p_rag) < 1e-6


def test_ragged_count_changes_without_recompiling():
    batch = make_batch(5, n=8)
    t = acc.Trainee("fit", optax.sgd(0.1), ragged_sums(token_sums), lambda mb: token_den(mb[0]))
    fn = jax.jit(lambda p, o, b: acc.optimize([t], p, o, b))
    params = (init_params(),)
    opts = (t.tx.init(params[0]),)
    for groups in ([[[0, 1, 2, 3, 4, 5, 6, 7]]], [[[0, 1], [2, 3], [4, 5, 6, 7]]]):
        rb = ragged_batch(batch, 1, groups, slots=4)
        p, _, _ = fn(params, opts, rb)
        flat = acc.Trainee("fit", optax.sgd(0.1), token_sums, token_den)
        p_flat, _, _ = run([flat], [init_params()], batch)
        assert max_diff(p_flat, p) < 1e-6
    assert fn._cache_size() == 1


@pytest.mark.parametrize(("sums", "den"), [(token_sums, token_den), (seq_sums, seq_den)])
def test_ragged_one_slot_equals_flat(sums, den):
    """One slot per minibatch (a whole-batch packed update) takes the loop-free path: same
    update as the flat split, over two minibatches and two epochs."""
    batch = make_batch(6, n=8)
    flat = acc.Trainee("fit", optax.sgd(0.1), sums, den)
    ragged = acc.Trainee("fit", optax.sgd(0.1), ragged_sums(sums), lambda mb: den(mb[0]))
    rb = ragged_batch(batch, 2, [[[0, 1, 2, 3]], [[0, 1, 2, 3]]], slots=1)
    p_flat, _, m_flat = run([flat], [init_params()], batch, num_minibatches=2, epochs=2)
    p_rag, _, m_rag = run([ragged], [init_params()], rb, epochs=2)
    assert max_diff(p_flat, p_rag) < 1e-6
    assert max_diff(m_flat, {k: m_rag[k] for k in m_flat}) < 1e-5


@pytest.mark.parametrize("tx", [optax.sgd(0.1), optax.adamw(1e-3)], ids=["sgd", "adamw"])
def test_one_slot_update_holds_one_gradient_of_temporaries(tx):
    """With params and optimizer state donated, a one-slot update's XLA temporaries are one
    gradient (a zero-initialised accumulator beside it would make two)."""
    width = 512
    params = {"w": jnp.ones((width, width), jnp.float32)}
    shared = {"x": jnp.ones((1, 4, 3, width)), "mask": jnp.ones((1, 4, 3), bool)}
    rb = acc.Ragged(shared, {"member": jnp.ones((1, 1, 4), bool)}, jnp.ones((1,), jnp.int32))

    def sums(p, mb):
        shared, micro = mb
        mask = shared["mask"] & micro["member"][:, None]
        y = shared["x"] @ p["w"]
        return jnp.sum(jnp.where(mask[..., None], y * y, 0.0)), {}

    t = acc.Trainee("fit", tx, sums, lambda mb: jnp.sum(mb[0]["mask"], dtype=jnp.float32))
    step = jax.jit(lambda p, o, b: acc.optimize([t], p, o, b), donate_argnums=(0, 1))
    compiled = step.lower((params,), (tx.init(params),), rb).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 1.5 * width * width * 4, temp
