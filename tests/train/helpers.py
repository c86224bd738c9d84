"""Shared helpers for the trainer tests: configs, a tiny model and synthetic rollout batches."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_llm import algorithms
from jaxrl_llm.config import load_config
from jaxrl_llm.models import CausalLM, ValueModel
from jaxrl_llm.train import models as train_models
from jaxrl_llm.train import state as st

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
VOCAB = 64


def config(name: str = "tiny.yaml", *overrides: str):
    """A shipped config on the tiny random model and one device."""
    base = ["model.path=tiny-random", "mesh.data=1"]
    return load_config(CONFIGS / name, [*base, *overrides])


def tiny_lm(seed: int = 0, **overrides) -> CausalLM:
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1, head_dim=8)
    cfg = train_models.tiny_random_config(**{**fields, **overrides})
    return CausalLM(cfg, rngs=nnx.Rngs(seed))


def tiny_critic(lm: CausalLM, seed: int = 1) -> ValueModel:
    return ValueModel.from_causal_lm(lm, rngs=nnx.Rngs(seed))


def recipe(name: str, **hparams):
    return algorithms.get(name, **hparams)


def synthetic_batch(
    seed: int = 0,
    *,
    n: int = 8,
    prompt_len: int = 6,
    completion_len: int = 5,
    ref: bool = True,
    values: bool = False,
    sampler: bool = False,
):
    """An UpdateBatch with left-padded prompts, ragged completions and random advantages."""
    from jaxrl_llm.train.update import UpdateBatch

    rng = np.random.default_rng(seed)
    p_len = rng.integers(2, prompt_len + 1, n)
    c_len = rng.integers(1, completion_len + 1, n)
    c_len[0] = completion_len
    prompt_mask = np.arange(prompt_len)[None, :] >= (prompt_len - p_len)[:, None]
    mask = np.arange(completion_len)[None, :] < c_len[:, None]
    tokens = rng.integers(3, VOCAB, (n, prompt_len + completion_len)).astype(np.int32)
    input_mask = np.concatenate([prompt_mask, mask], axis=1)
    tokens = np.where(input_mask, tokens, 2).astype(np.int32)
    adv = rng.normal(size=(n, completion_len)).astype(np.float32) * mask
    f = lambda scale=1.0: jnp.asarray(
        np.where(mask, -1.5 + scale * rng.normal(size=mask.shape), 0.0).astype(np.float32)
    )
    return UpdateBatch(
        tokens_nl=jnp.asarray(tokens),
        input_mask_nl=jnp.asarray(input_mask),
        mask_nt=jnp.asarray(mask),
        adv_nt=jnp.asarray(adv),
        logp_old_nt=None,
        logp_sampler_nt=f(0.1) if sampler else None,
        logp_ref_nt=f(0.1) if ref else None,
        value_old_nt=jnp.asarray(rng.normal(size=mask.shape).astype(np.float32) * mask)
        if values
        else None,
        return_nt=jnp.asarray(rng.normal(size=mask.shape).astype(np.float32) * mask)
        if values
        else None,
    )


def fresh_state(lm, tx, rec, *, critic=None, critic_tx=None, seed=0):
    graphdef, params = st.split_params(lm)
    critic_graphdef = critic_params = None
    if critic is not None:
        critic_graphdef, critic_params = st.split_params(critic)
    state = st.init_train_state(
        params, tx, recipe=rec, seed=seed, critic_params=critic_params, critic_tx=critic_tx
    )
    return graphdef, critic_graphdef, state


def tree_max_diff(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32))))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
