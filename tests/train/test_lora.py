"""LoRA (models/lora.py) in the model and the trainer: the adapted model starts as the base,
only adapters train, their gradient is the full gradient projected, the frozen base is the
reference, runs resume bit-identically and export the merged model."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl_llm.config import ConfigError
from jaxrl_llm.models import lora
from jaxrl_llm.train import hostmem, loop
from jaxrl_llm.train import setup as setup_lib
from jaxrl_llm.train import state as st
from jaxrl_llm.train import update as up
from tests.train import helpers as H

VARIED = [
    "rewards.terms=[{type: length_penalty, kwargs: {target: 10, unit: chars, coef: 0.1}},"
    " {type: regex, weight: 0.5, kwargs: {pattern: '[aeiou]'}}]"
]
LORA = "model.lora={rank: 4, alpha: 8}"


def _adapted(seed: int = 0, **kw) -> tuple[nnx.Module, nnx.Module]:
    base = H.tiny_lm(seed, num_layers=2)
    model = H.tiny_lm(seed, num_layers=2)
    lora.apply_lora(model, lora.LoRAConfig(**{"rank": 4, "alpha": 8.0, **kw}), rngs=nnx.Rngs(7))
    return base, model


def _randomise_b(model: nnx.Module, seed: int = 3, scale: float = 0.05) -> None:
    """Non-zero B (B = 0 at init would make the adapter tests vacuous)."""
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.LoRAParam) and not np.any(np.asarray(node[...])):
            node[...] = scale * jax.random.normal(next(keys), node[...].shape)


TOKENS = jnp.asarray(np.random.default_rng(0).integers(3, H.VOCAB, (3, 7)), jnp.int32)
MASK = jnp.asarray(np.arange(7)[None, :] >= np.array([[0], [2], [4]]))


@pytest.mark.parametrize("targets", [lora.TARGETS, ("q_proj", "down_proj")])
def test_zero_init_adapted_model_equals_the_base(targets):
    base, model = _adapted(targets=targets)
    np.testing.assert_array_equal(np.asarray(model(TOKENS, MASK)), np.asarray(base(TOKENS, MASK)))
    _, frozen, adapters = lora.split(model)
    assert jax.tree.structure(frozen) == jax.tree.structure(nnx.to_pure_dict(nnx.state(base)))
    adapted = {k for k in adapters["model"]["layers"]["self_attn"]} | {
        k for k in adapters["model"]["layers"].get("mlp", {})
    }
    assert adapted == set(targets)
    a = adapters["model"]["layers"]["self_attn"]["q_proj"]["lora_a"]
    assert a.shape == (2, 32, 4) and a.dtype == jnp.float32  # [L, D, r], f32
    assert float(jnp.max(jnp.abs(a))) <= 1 / math.sqrt(32)  # U(-1/sqrt(K), 1/sqrt(K))


def test_adapter_forward_is_w_plus_scaled_ab():
    """y = x W + (α/r)·x A B, checked against the merged kernel W + (α/r)·A B."""
    _, model = _adapted(use_rslora=True)
    _randomise_b(model)
    proj = model.model.layers.self_attn.o_proj  # two input axes: [L, H, Dh, D]
    w = np.asarray(proj.kernel[...], np.float64)
    a = np.asarray(proj.lora_a[...], np.float64)
    b = np.asarray(proj.lora_b[...], np.float64)
    scale = 8.0 / math.sqrt(4)  # rsLoRA
    expected = w + scale * np.einsum("lhdr,lre->lhde", a, b)
    np.testing.assert_allclose(np.asarray(proj.merged_kernel()), expected, rtol=1e-5, atol=1e-6)
    merged = lora.merge_into_base(nnx.clone(model))
    assert not lora.has_lora(merged)
    np.testing.assert_allclose(
        np.asarray(merged(TOKENS, MASK)), np.asarray(model(TOKENS, MASK)), rtol=1e-4, atol=1e-5
    )


def test_lora_gradients_are_the_full_gradient_projected():
    """For W_eff = W + s·A B: ∂L/∂A = s·G Bᵀ and ∂L/∂B = s·Aᵀ G with G = ∂L/∂W_eff = ∂L/∂W."""
    _, model = _adapted()
    _randomise_b(model)
    graphdef, frozen, adapters = lora.split(model)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(3, 7, H.VOCAB)), jnp.float32)

    def loss(frozen, adapters):
        logits = nnx.merge(graphdef, lora.combine(frozen, adapters))(TOKENS, MASK)
        return jnp.sum(jax.nn.log_softmax(logits) * weights)

    g_frozen, g_adapters = jax.grad(loss, argnums=(0, 1))(frozen, adapters)
    s = 8.0 / 4
    for group, name in (("self_attn", "q_proj"), ("self_attn", "o_proj"), ("mlp", "down_proj")):
        g_w = np.asarray(g_frozen["model"]["layers"][group][name]["kernel"], np.float64)
        ad = adapters["model"]["layers"][group][name]
        a = np.asarray(ad["lora_a"], np.float64)
        b = np.asarray(ad["lora_b"], np.float64)
        n_lead_in = a.ndim - 1  # [L, *in]
        num_l = a.shape[0]
        k = math.prod(a.shape[1:n_lead_in])
        g = g_w.reshape(num_l, k, -1)
        a2, b2 = a.reshape(num_l, k, -1), b.reshape(num_l, b.shape[1], -1)
        exp_a = s * g @ b2.transpose(0, 2, 1)
        exp_b = s * a2.transpose(0, 2, 1) @ g
        got = g_adapters["model"]["layers"][group][name]
        np.testing.assert_allclose(
            np.asarray(got["lora_a"]).reshape(exp_a.shape), exp_a, rtol=1e-4, atol=1e-6
        )
        np.testing.assert_allclose(
            np.asarray(got["lora_b"]).reshape(exp_b.shape), exp_b, rtol=1e-4, atol=1e-6
        )
        assert np.abs(exp_a).max() > 0 and np.abs(exp_b).max() > 0


def test_update_step_trains_only_the_adapters():
    _, model = _adapted()
    graphdef, frozen, adapters = lora.split(model)
    rec = H.recipe("grpo", beta=0.04)
    tx = optax.adam(1e-2)
    copy = lambda: jax.tree.map(jnp.copy, adapters)  # the step donates the state
    state = st.init_train_state(copy(), tx, recipe=rec, seed=0)
    frozen_before = jax.tree.map(np.asarray, frozen)
    batch = H.synthetic_batch(completion_len=5, prompt_len=6)
    step = up.make_update_step(rec, graphdef, tx, frozen=frozen, num_minibatches=2)
    new, metrics = step(state, batch)
    assert jax.tree.structure(new.params) == jax.tree.structure(adapters)
    moments = [x for x in jax.tree.leaves(new.opt_state) if np.ndim(x) > 0]
    assert sum(x.size for x in moments) == 2 * lora.num_adapter_params(model)  # adam: mu, nu
    b = new.params["model"]["layers"]["mlp"]["up_proj"]["lora_b"]
    assert float(jnp.max(jnp.abs(b))) > 0  # B moved off zero
    for x, y in zip(jax.tree.leaves(frozen), jax.tree.leaves(frozen_before), strict=True):
        np.testing.assert_array_equal(np.asarray(x), y)  # the base is not donated nor changed
    assert np.isfinite(float(metrics["actor/loss"]))
    # The traceable form (frozen closed over by the caller's jit) computes the same step,
    # compiled as the jitted form is (on CPU: the memory-optimised schedule, see hostmem).
    state = st.init_train_state(copy(), tx, recipe=rec, seed=0)
    inner = jax.jit(
        lambda state, batch, frozen: up.make_update_step(
            rec, graphdef, tx, frozen=frozen, num_minibatches=2, jit=False
        )(state, batch),
        compiler_options=hostmem.update_compiler_options(None),
    )
    again, _ = inner(state, batch, frozen)
    assert H.tree_max_diff(again.params, new.params) < 1e-6


def test_lora_run_uses_the_base_as_reference_and_no_copy():
    config = H.config("tiny.yaml", LORA)
    s = setup_lib.resolve(config)
    models = s.models
    assert models.ref_params is models.frozen  # the frozen base is π_ref: no reference copy
    leaves = jax.tree_util.tree_leaves_with_path(s.state.params)
    assert leaves and all("lora_" in jax.tree_util.keystr(p) for p, _ in leaves)
    ref = nnx.merge(models.ref_graphdef, models.ref_params)
    assert not lora.has_lora(ref)
    base = setup_lib.resolve(H.config("tiny.yaml")).policy()
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 100, (2, 6)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(ref(tokens)), np.asarray(base(tokens)))
    np.testing.assert_array_equal(np.asarray(s.policy()(tokens)), np.asarray(base(tokens)))


def test_lora_run_resumes_bit_identically_and_exports(tmp_path, monkeypatch):
    from jaxrl_llm.train import metrics as M
    from jaxrl_llm.train.checkpoint import Checkpointer

    config = H.config(
        "tiny.yaml",
        LORA,
        "train.max_steps=3",
        "train.save_every=1",
        "data.eval_size=0",
        "optim.lr=0.01",
        *VARIED,
    )
    full = loop.train(config, run_dir=tmp_path / "full", progress=False, log=lambda *_: None)
    assert full["step"] == 3 and full["actor/grad_norm"] > 0
    original = M.MetricsLogger.progress

    class Killed(Exception):
        pass

    def die_at_2(self, step, metrics):
        original(self, step, metrics)
        if step == 2:
            raise Killed

    monkeypatch.setattr(M.MetricsLogger, "progress", die_at_2)
    with pytest.raises(Killed):
        loop.train(config, run_dir=tmp_path / "killed", progress=False, log=lambda *_: None)
    monkeypatch.setattr(M.MetricsLogger, "progress", original)
    loop.train(config, run_dir=tmp_path / "killed", progress=False, log=lambda *_: None)
    fresh = setup_lib.resolve(config).state
    states = []
    for name in ("full", "killed"):
        with Checkpointer(tmp_path / name / "checkpoints") as ckpt:
            states.append(ckpt.restore(fresh)[0])
    a, b = states
    assert int(a.step) == int(b.step) == 3
    assert H.tree_max_diff(a.params, fresh.params) > 0  # the adapters trained
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    # The export is the merged model; RUN_DIR/adapter the adapter alone.
    from jaxrl_llm import models

    s = setup_lib.resolve(config, tmp_path / "full")
    exported = models.from_pretrained(tmp_path / "full" / "export", dtype=jnp.float32)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 100, (2, 6)), jnp.int32)
    np.testing.assert_allclose(
        np.asarray(exported(tokens)), np.asarray(s.policy(a.params)(tokens)), atol=1e-4
    )
    assert (tmp_path / "full" / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "full" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["model.lora={targets: [q_proj, qkv_proj]}"], r"model\.lora\.targets.*qkv_proj"),
        (["model.lora={rank: 0}"], r"model\.lora\.rank = 0"),
        (["model.lora={alpha: -1}"], r"model\.lora\.alpha"),
        (["model.lora={rank: 4}", "algorithm.name=ppo"], r"critic\.lora is null"),
        (["critic.lora={rank: 4}"], r"critic\.lora is set but grpo has no critic"),
        (["model.lora={dropout: 1.0}"], r"model\.lora\.dropout"),
        (
            ["algorithm.name=ppo", "model.lora={rank: 4}", "critic.lora={dropout: 0.1}"],
            r"critic\.lora\.dropout",
        ),
    ],
)
def test_bad_lora_configs_are_clear_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        H.config("tiny.yaml", *overrides)


def test_lora_config_checks_its_fields():
    with pytest.raises(ValueError, match=r"model\.lora\.rank"):
        lora.LoRAConfig(rank=0)
    with pytest.raises(ValueError, match=r"\['qq'\] match no projection"):
        lora.LoRAConfig(targets=("qq",))
    _, model = _adapted()
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        lora.apply_lora(model, lora.LoRAConfig(rank=2), rngs=nnx.Rngs(0))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_lora_sharded_step_equals_one_device():
    """fsdp × tensor on 8 devices = 1 device; adapters laid out by the base's logical axes."""
    from jaxrl_llm.train.step import make_rl_step
    from tests.train import test_step as T

    base = (LORA, "algorithm.hparams.beta=0.04", "rollout.prompts_per_step=8")
    one = T.resolve(*base)
    many = T.resolve(*base, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "mesh.preset=fsdp_tp")
    q = many.state.params["model"]["layers"]["self_attn"]["q_proj"]
    assert q["lora_a"].sharding.spec == jax.P(None, "fsdp", None)  # [L, D(embed), r]
    assert q["lora_b"].sharding.spec == jax.P(None, None, "tensor", None)  # [L, r, H, Dh]
    kernel = many.models.frozen["model"]["layers"]["self_attn"]["q_proj"]["kernel"]
    assert kernel.sharding.spec == jax.P(None, "fsdp", "tensor", None)
    groups = T.make_groups(one, 6)
    results = [
        make_rl_step(s.recipe, s.models, s.update)(T.moved_state(s), groups) for s in (one, many)
    ]
    (s1, m1), (s8, m8) = results
    T.assert_trees_close(s8.params, s1.params, what="params")
    T.assert_trees_close(s8.opt_state, s1.opt_state, what="opt_state")
    T.assert_metrics_close(m8, m1)
    assert m1["actor/grad_norm"] > 0 and m1["actor/kl_ref"] > 0  # moved adapters: π ≠ π_ref


@pytest.mark.parametrize("mode", ["int8", "nf4"])
def test_qlora_quantised_base_trains_its_adapters(mode):
    from jaxrl_llm.train.step import make_rl_step
    from tests.train import test_step as T

    dropout = 0.1 if mode == "int8" else 0.0  # and the adapters' dropout in the RL step
    s = T.resolve(
        f"model.lora={{rank: 4, alpha: 8, quantize: {mode}, dropout: {dropout}}}",
        "algorithm.hparams.beta=0.04",
    )
    q = s.models.frozen["model"]["layers"]["mlp"]["gate_proj"]
    assert q["kernel"].dtype == (jnp.int8 if mode == "int8" else jnp.uint8)
    assert s.models.ref_params is s.models.frozen
    float_base = T.resolve().policy()
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 100, (2, 6)), jnp.int32)
    rel = float(jnp.linalg.norm(s.policy()(tokens) - float_base(tokens))) / float(
        jnp.linalg.norm(float_base(tokens))
    )
    assert 0 < rel < (0.02 if mode == "int8" else 0.15)  # the quantisation error, and only it
    new, metrics = make_rl_step(s.recipe, s.models, s.update)(T.moved_state(s), T.make_groups(s, 2))
    assert np.isfinite(metrics["actor/loss"]) and metrics["actor/grad_norm"] > 0
    assert jax.tree.structure(new.params) == jax.tree.structure(s.state.params)


def test_merged_and_unmerged_sampling_agree():
    from jaxrl_llm.train.collect import sample_completions

    runs = []
    for merged in ("false", "true"):
        s = setup_lib.resolve(
            H.config("tiny.yaml", f"model.lora={{rank: 4, alpha: 8, merge_for_sampling: {merged}}}")
        )
        model = s.policy()
        _randomise_b(model, scale=0.5)
        _, _, adapters = lora.split(model)
        ids = np.asarray(np.random.default_rng(0).integers(3, 100, (2, 5)), np.int32)
        runs.append(
            sample_completions(
                s.models, adapters, s.sampler, ids, np.ones_like(ids, bool), jax.random.key(0)
            )
        )
    unmerged, merged = runs
    np.testing.assert_array_equal(unmerged.tokens, merged.tokens)
    np.testing.assert_allclose(unmerged.logprobs, merged.logprobs, atol=1e-4)


def test_training_starts_from_a_peft_adapter_folder(tmp_path):
    from jaxrl_llm.models import peft

    s = setup_lib.resolve(H.config("tiny.yaml", LORA))
    model = s.policy()
    _randomise_b(model)
    peft.save_adapter(model, tmp_path / "ad", config=s.models.lora, base_model_name_or_path="x")
    _, _, expected = lora.split(model)
    resumed = setup_lib.resolve(
        H.config("tiny.yaml", f"model.lora={{rank: 4, alpha: 8, adapter: {tmp_path / 'ad'}}}")
    )
    assert H.tree_max_diff(resumed.state.params, expected) == 0
    with pytest.raises(peft.AdapterError, match="rank"):
        setup_lib.resolve(
            H.config("tiny.yaml", f"model.lora={{rank: 8, alpha: 8, adapter: {tmp_path / 'ad'}}}")
        )


def test_a_lora_critic_exports_merged_into_its_trunk(tmp_path):
    """export --critic of a LoRA PPO run: the critic's adapters merged into its trunk, giving
    the values the adapted critic gives."""
    from jaxrl_llm import models

    config = H.config(
        "tiny.yaml",
        LORA,
        "critic.lora={rank: 4, alpha: 8}",
        "algorithm.name=ppo",
        "algorithm.hparams={}",
        "data.eval_size=0",
    )
    s = setup_lib.resolve(config, tmp_path)
    leaves, treedef = jax.tree.flatten(s.state.critic_params)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    moved = [
        x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)
    ]
    critic_params = jax.tree.unflatten(treedef, moved)  # adapters away from their zero start
    loop.export_policy(s, s.state.params, tmp_path / "out", critic_params=critic_params)
    tokens = jnp.asarray(np.random.default_rng(1).integers(3, 100, (2, 6)), jnp.int32)
    adapted = np.asarray(s.models.critic(critic_params)(tokens))
    base = np.asarray(s.models.critic(s.state.critic_params)(tokens))
    assert np.abs(adapted - base).max() > 1e-3  # the adapters change the values
    merged = models.from_pretrained(tmp_path / "out" / "critic", head="value", dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(merged(tokens)), adapted, atol=1e-5)


def test_save_pretrained_refuses_an_unmerged_model(tmp_path):
    from jaxrl_llm.models import save_pretrained

    _, model = _adapted()
    with pytest.raises(ValueError, match="merge_into_base"):
        save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    save_pretrained(lora.merge_into_base(model), tmp_path / "out")


def test_bf16_base_with_f32_adapters():
    s = setup_lib.resolve(H.config("tiny.yaml", LORA, "model.param_dtype=bfloat16"))
    assert {x.dtype for x in jax.tree.leaves(s.models.frozen)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(s.state.params)} == {jnp.dtype(jnp.float32)}
    moments = [x for x in jax.tree.leaves(s.state.opt_state) if np.ndim(x) > 0]
    assert sum(x.size for x in moments) == 2 * sum(x.size for x in jax.tree.leaves(s.state.params))


# ---------------------------------------------------------------------------------------------
# Adapter dropout (model.lora.dropout): per-token masks, independent of batching and packing.


def test_lora_dropout_is_inverted_bernoulli_per_token():
    from jaxrl_llm.models.transformer import lora_dropout

    keys = jax.random.split(jax.random.key(0), (4, 64))
    x = jnp.ones((4, 64, 128))
    y = np.asarray(lora_dropout(x, keys, 0.25, salt=3))
    assert set(np.unique(y).tolist()) <= {0.0, float(np.float32(1 / 0.75))}
    assert abs((y == 0).mean() - 0.25) < 0.01 and abs(y.mean() - 1.0) < 0.02
    # token (1, 5)'s mask depends on its own key only
    alone = lora_dropout(x[1:2, 5:6], keys[1:2, 5:6], 0.25, salt=3)
    np.testing.assert_array_equal(np.asarray(alone)[0, 0], y[1, 5])
    other = np.asarray(lora_dropout(x, keys, 0.25, salt=4))  # another projection: other masks
    assert (other != y).any()


def _dropout_batch():
    batch = H.synthetic_batch(n=8, completion_len=5, prompt_len=6)
    key = jax.random.key_data(jax.random.key(11))
    return batch._replace(
        dropout_key_n=jnp.broadcast_to(key, (8, *key.shape)), row_n=jnp.arange(8, dtype=jnp.int32)
    )


def test_lora_dropout_update_is_micro_batch_and_packing_invariant():
    from tests.train.test_update import packed_of

    _, model = _adapted(dropout=0.5)
    _randomise_b(model)
    graphdef, frozen, adapters = lora.split(model)
    rec = H.recipe("grpo", beta=0.04)
    tx = optax.sgd(0.1)
    batch = _dropout_batch()

    def run(b, **kw):
        state = st.init_train_state(jax.tree.map(jnp.copy, adapters), tx, recipe=rec, seed=0)
        return up.make_update_step(rec, graphdef, tx, frozen=frozen, **kw)(state, b)

    whole, m_whole = run(batch)
    # packed into rows of other sequences, in token-budget micro-batches (>= 2 per minibatch)
    plan, packed_batch = packed_of(batch, budget=16)
    assert int(np.max(plan.device_arrays().count_m)) >= 2
    packed, m_packed = run(packed_batch, packed=True)
    assert H.tree_max_diff(packed.params, whole.params) < 1e-5
    assert abs(m_packed["actor/loss"] - m_whole["actor/loss"]) < 1e-5
    # The masks act: the adapted model's logits move with per-token keys, not without.
    keys = up.token_keys(batch.dropout_key_n[0], batch.tokens_nl * 0, batch.tokens_nl * 0 + 1)
    tokens, mask = batch.tokens_nl, batch.input_mask_nl
    plain = model(tokens, mask)
    assert float(jnp.max(jnp.abs(model(tokens, mask, lora_keys_bt=keys) - plain))) > 1e-3
