"""jaxrl_llm.train.state: schedules, optimizers and the state built from a config."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.config import OptimConfig
from jaxrl_llm.core import kl as _kl
from jaxrl_llm.train import setup as S
from jaxrl_llm.train import state as st
from tests.train import helpers as H


def test_lr_schedule_warmup_and_decay():
    f = st.lr_schedule(lr=1.0, schedule="cosine", warmup_steps=4, max_steps=14, final_lr_ratio=0.1)
    np.testing.assert_allclose([f(s) for s in range(4)], [0.25, 0.5, 0.75, 1.0], rtol=1e-6)
    assert float(f(9)) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-6)  # half-way through decay
    assert float(f(14)) == pytest.approx(0.1) and float(f(100)) == pytest.approx(0.1)
    lin = st.lr_schedule(lr=2.0, schedule="linear", max_steps=10)
    assert float(lin(0)) == 2.0 and float(lin(5)) == pytest.approx(1.0) and float(lin(10)) == 0
    const = st.lr_schedule(lr=3e-6, warmup_steps=0)
    assert float(const(0)) == pytest.approx(3e-6) and float(const(1000)) == pytest.approx(3e-6)


def test_optimizer_counts_training_steps_not_updates():
    optim = OptimConfig(lr=1.0, warmup_steps=2, optimizer="sgd", max_grad_norm=None)
    tx, sched = S.make_optimizer(optim, max_steps=10, updates_per_step=3)
    params = {"w": jnp.zeros(())}
    opt = tx.init(params)
    seen = []
    for _ in range(6):  # two training steps of three updates: lr 0.5, 0.5, 0.5, 1, 1, 1
        upd, opt = tx.update({"w": jnp.ones(())}, opt, params)
        seen.append(-float(upd["w"]))
    np.testing.assert_allclose(seen, [0.5, 0.5, 0.5, 1, 1, 1], rtol=1e-6)
    assert float(sched(1)) == 1.0


def test_optimizer_clips_the_global_norm():
    optim = OptimConfig(lr=1.0, optimizer="sgd", max_grad_norm=1.0)
    tx, _ = S.make_optimizer(optim, max_steps=1, updates_per_step=1)
    g = {"a": jnp.full((4,), 3.0)}
    upd, _ = tx.update(g, tx.init(g), g)
    assert float(jnp.linalg.norm(upd["a"])) == pytest.approx(1.0, rel=1e-5)


def test_build_setup_from_the_tiny_config():
    setup = S.resolve(H.config("tiny.yaml"))
    s = setup.state
    assert int(s.step) == 0 and s.rng.dtype == jnp.uint32 and s.rng.shape == (2,)
    assert s.data_position.shape == (2,) and s.critic_params is None
    assert setup.models.ref_params is not None  # β = 0.04: the reference is loaded
    assert H.tree_max_diff(setup.models.ref_params, s.params) == 0.0
    lm = setup.policy()
    assert lm.config.vocab_size == 49152 and lm.config.num_layers == 2
    # every array lives where the sharding tree says
    for x, sh in zip(jax.tree.leaves(s), jax.tree.leaves(setup.state_sharding), strict=True):
        assert x.sharding.is_equivalent_to(sh, x.ndim)


def test_build_setup_skips_the_reference_at_beta_zero_and_adds_a_critic_for_ppo():
    setup = S.resolve(H.config("tiny.yaml", "algorithm.hparams.beta=0.0"))
    assert setup.models.ref_params is None
    ppo = S.resolve(
        H.config("algorithms/ppo.yaml", "rollout.prompts_per_step=4", "kl.controller=adaptive")
    )
    s = ppo.state
    assert s.critic_params is not None and s.critic_params["score"]["kernel"].shape == (64, 1)
    assert H.tree_max_diff(s.critic_params["model"], s.params["model"]) == 0.0
    assert s.critic_opt_state is not None
    assert float(st.kl_beta(s.kl_state)) == pytest.approx(0.02)
    assert isinstance(
        jax.tree.leaves(s.kl_state, is_leaf=lambda x: isinstance(x, _kl.KLControllerState))[0],
        _kl.KLControllerState,
    )
