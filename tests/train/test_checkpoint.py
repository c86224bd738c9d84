"""jaxrl_llm.train.checkpoint: the full state round-trips, resumes bit-identically, re-shards."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl_llm.models import sharding as shd
from jaxrl_llm.train import state as st
from jaxrl_llm.train import update as up
from jaxrl_llm.train.checkpoint import Checkpointer, CheckpointMismatchError
from tests.train import helpers as H

REC = H.recipe("ppo", beta=0.02)  # the richest state: critic, two optimizers, KL chain state


def _fresh(seed=0, **lm_overrides):
    lm = H.tiny_lm(seed, **lm_overrides)
    return H.fresh_state(
        lm, optax.adam(1e-2), REC, critic=H.tiny_critic(lm), critic_tx=optax.adam(1e-2), seed=seed
    )


@pytest.fixture(scope="module")
def step_fn():
    gd, cgd, _ = _fresh()
    return up.make_update_step(
        REC, gd, optax.adam(1e-2), critic_graphdef=cgd, critic_tx=optax.adam(1e-2)
    )


def _batch_for(state):
    """What the loop does each step: draw from the stream and split the key."""
    key, sub = jax.random.split(jax.random.wrap_key_data(state.rng))
    epoch, index = (int(x) for x in state.data_position)
    seed = int(jax.random.randint(sub, (), 0, 2**30)) + 1000 * index
    state = state._replace(
        rng=jax.random.key_data(key), data_position=jnp.asarray([epoch, index + 1], jnp.int32)
    )
    return state, H.synthetic_batch(seed, values=True)


def _run(step_fn, state, until, ckpt=None):
    while int(state.step) < until:
        state, batch = _batch_for(state)
        state, _ = step_fn(state, batch)
        if ckpt is not None and ckpt.should_save(int(state.step)):
            ckpt.save(int(state.step), state, meta={"note": "x"})
    return state


def test_resume_is_bit_identical(tmp_path, step_fn):
    _, _, s = _fresh()
    uninterrupted = _run(step_fn, s, 5)
    with Checkpointer(tmp_path / "ckpt", max_to_keep=2, save_every=2) as ckpt:
        _, _, s = _fresh()
        _run(step_fn, s, 3, ckpt)  # "killed" after step 3; the last checkpoint is step 2
        assert ckpt.all_steps() == [2]
    with Checkpointer(tmp_path / "ckpt", max_to_keep=2, save_every=2) as ckpt:
        _, _, template = _fresh()
        restored, meta = ckpt.restore(template)
        assert int(restored.step) == 2 and meta["note"] == "x"
        assert [int(x) for x in restored.data_position] == [0, 2]
        resumed = _run(step_fn, restored, 5, ckpt)
        assert ckpt.all_steps() == [2, 4]  # keep-2, every 2 steps
        ckpt.save(5, resumed)  # at the end
        assert ckpt.latest_step() == 5
    for a, b in zip(jax.tree.leaves(uninterrupted), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_async_save_survives_donation_and_restores_onto_another_mesh(tmp_path, step_fn):
    _, _, s = _fresh()
    s, batch = _batch_for(s)
    expected = jax.tree.map(np.asarray, s)
    ckpt = Checkpointer(tmp_path / "c", save_every=1)
    ckpt.save(0, s)
    step_fn(s, batch)  # donates (deletes) the saved arrays while the save may be in flight
    ckpt.wait()
    # Restore onto 8 devices with FSDP-sharded parameters.
    mesh = shd.make_mesh(fsdp=8)
    lm = H.tiny_lm()
    _, _, template = _fresh()
    p_sh = shd.param_shardings(nnx.state(lm, nnx.Param), mesh, shd.FSDP_RULES)
    c_sh = shd.param_shardings(nnx.state(H.tiny_critic(lm), nnx.Param), mesh, shd.FSDP_RULES)
    sharding = st.state_shardings(
        template._replace(opt_state=None, critic_opt_state=None),
        mesh,
        param_sharding=p_sh,
        tx=optax.adam(1e-2),
        critic_param_sharding=c_sh,
        critic_tx=optax.adam(1e-2),
    )
    restored, _ = ckpt.restore(template, sharding)
    emb = restored.params["model"]["embed_tokens"]["embedding"]
    assert (
        len(emb.sharding.device_set) == 8
        and emb.sharding.spec == p_sh["model"]["embed_tokens"]["embedding"].spec
    )
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    ckpt.close()


def test_changed_model_shape_is_a_clear_error(tmp_path):
    _, _, s = _fresh()
    with Checkpointer(tmp_path / "c") as ckpt:
        ckpt.save(1, s)
        _, _, wider = _fresh(hidden_size=48)
        with pytest.raises(CheckpointMismatchError, match=r"changed shape.*\n.*embed_tokens"):
            ckpt.restore(wider)
        _, _, same = _fresh()
        with pytest.raises(CheckpointMismatchError, match="not in this run: critic_params"):
            ckpt.restore(same._replace(critic_params=None, critic_opt_state=None))


def test_a_changed_data_file_fails_its_checksums(tmp_path, step_fn):
    from jaxrl_llm.train.checkpoint import CheckpointCorruptError

    _, _, s = _fresh()
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, s)
    # One bit inside the largest parameter's stored bytes. The data files' layout (which
    # arrays share a file, in what order) depends on the writers' timing: the middle of the
    # largest file was not always array data (the restore then passed, once in a full run).
    leaf = max(jax.tree.leaves(s.params), key=np.size)
    needle = np.asarray(leaf).tobytes()[256:320]
    assert len(needle) == 64
    files = [p for p in (tmp_path / "ckpt" / "1" / "state").rglob("*") if p.is_file()]
    stored = ((p, bytearray(p.read_bytes())) for p in files)
    data, raw = next(((p, raw) for p, raw in stored if needle in raw), (None, None))
    assert data is not None, "the parameter's bytes are not stored verbatim (compressed?)"
    raw[raw.find(needle) + 32] ^= 0x10
    data.write_bytes(bytes(raw))
    with (
        Checkpointer(tmp_path / "ckpt") as ckpt,
        pytest.raises(CheckpointCorruptError, match="saved checksums"),
    ):
        ckpt.restore(s, step=1)
