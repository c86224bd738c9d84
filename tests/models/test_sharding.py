"""Sharded forward and forward+backward equal one device, on 8 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm import models
from jaxrl_llm.models import sharding

pytestmark = pytest.mark.slow

CONFIG = models.ModelConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
)
B, T = 8, 16


def _loss(params, graphdef, tokens_bt, mask_bt):
    logits_btv = nnx.merge(graphdef, params)(tokens_bt, mask_bt)
    logp_btv = jax.nn.log_softmax(logits_btv[:, :-1], axis=-1)
    logp_bt = jnp.take_along_axis(logp_btv, tokens_bt[:, 1:, None], axis=-1)[..., 0]
    valid_bt = mask_bt[:, 1:] & mask_bt[:, :-1]
    return -jnp.sum(jnp.where(valid_bt, logp_bt, 0.0)) / jnp.sum(valid_bt)


@pytest.fixture(scope="module")
def setup():
    model = models.CausalLM(CONFIG, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    rng = np.random.RandomState(0)
    lengths = rng.randint(4, T + 1, B)
    tokens = np.zeros((B, T), np.int32)
    mask = np.zeros((B, T), bool)
    for i, n in enumerate(lengths):
        tokens[i, T - n :] = rng.randint(1, CONFIG.vocab_size, n)
        mask[i, T - n :] = True
    ref_logits = jax.jit(lambda p, x, m: nnx.merge(graphdef, p)(x, m))(params, tokens, mask)
    ref = jax.jit(jax.value_and_grad(_loss), static_argnums=1)(params, graphdef, tokens, mask)
    return model, graphdef, params, tokens, mask, np.asarray(ref_logits), ref


# Per-device shard shapes (q_proj kernel [D, H, Dh], embedding [V, D], up_proj [D, F]).
EXPECTED = {
    "dp": {"q": (64, 4, 16), "embed": (96, 64), "up": (64, 128)},
    "fsdp": {"q": (8, 4, 16), "embed": (96, 8), "up": (8, 128)},
    "fsdp_tp": {"q": (16, 2, 16), "embed": (48, 16), "up": (16, 64)},
}


@pytest.mark.parametrize("name", ["dp", "fsdp", "fsdp_tp"])
def test_preset_matches_single_device(setup, name):
    _, graphdef, params, tokens, mask, ref_logits, (ref_loss, ref_grads) = setup
    assert len(jax.devices()) == 8
    mesh, rules = sharding.preset(name)
    p_sh = sharding.param_shardings(nnx.state(setup[0], nnx.Param), mesh, rules)
    sharded = jax.device_put(params, p_sh)
    layer = sharded["model"]["layers"]  # stacked: [L, ...], the layer axis replicated
    shards = {
        "q": layer["self_attn"]["q_proj"]["kernel"],
        "embed": sharded["model"]["embed_tokens"]["embedding"],
        "up": layer["mlp"]["up_proj"]["kernel"],
    }
    for key, arr in shards.items():
        lead = (CONFIG.num_layers,) if key != "embed" else ()
        assert arr.addressable_shards[0].data.shape == (*lead, *EXPECTED[name][key]), key
    x_sh = sharding.batch_sharding(mesh, 2, rules)
    tokens_s, mask_s = jax.device_put(tokens, x_sh), jax.device_put(mask, x_sh)
    replicated = NamedSharding(mesh, PartitionSpec())
    with jax.set_mesh(mesh):
        logits = jax.jit(
            lambda p, x, m: nnx.merge(graphdef, p)(x, m),
            in_shardings=(p_sh, x_sh, x_sh),
            out_shardings=NamedSharding(mesh, PartitionSpec(("data", "fsdp"))),
        )(sharded, tokens_s, mask_s)
        loss, grads = jax.jit(
            jax.value_and_grad(_loss),
            static_argnums=1,
            in_shardings=(p_sh, x_sh, x_sh),
            out_shardings=(replicated, p_sh),
        )(sharded, graphdef, tokens_s, mask_s)
    np.testing.assert_allclose(np.asarray(logits)[mask], ref_logits[mask], atol=1e-5, rtol=0)
    np.testing.assert_allclose(float(loss), float(ref_loss), atol=1e-5, rtol=0)
    jax.tree.map(
        lambda g, r: np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=1e-5, rtol=0),
        grads,
        ref_grads,
    )
    g_embed = grads["model"]["embed_tokens"]["embedding"]
    assert g_embed.addressable_shards[0].data.shape == EXPECTED[name]["embed"]


def test_indivisible_axis_is_replicated_not_an_error():
    mesh, rules = sharding.preset("fsdp_tp")  # tensor = 2
    spec = sharding.logical_to_spec(("embed", "q_heads", "head_dim"), (576, 9, 64), mesh, rules)
    assert spec == PartitionSpec("fsdp", None, None)


def test_from_pretrained_streams_into_shardings(tmp_path):
    model = models.CausalLM(CONFIG, rngs=nnx.Rngs(1))
    models.save_pretrained(model, tmp_path)
    mesh, rules = sharding.preset("fsdp_tp")
    loaded = models.from_pretrained(tmp_path, mesh=mesh, rules=rules)
    kernel = loaded.model.layers.self_attn.o_proj.kernel[...]  # [L, H, Dh, D], stacked
    assert kernel.sharding.spec == PartitionSpec(None, "tensor", None, "fsdp")
    assert kernel.addressable_shards[0].data.shape == (CONFIG.num_layers, 2, 16, 16)
    np.testing.assert_array_equal(
        np.asarray(kernel), np.asarray(model.model.layers.self_attn.o_proj.kernel[...])
    )
