"""Loading and exporting checkpoints: formats, safety, errors, dtype and remat policy."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxrl_llm import models
from jaxrl_llm.models import weights
from tests.models import hf_tiny


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    hf = hf_tiny.build_hf("llama3")
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path)
    return hf, path


@nnx.jit
def forward(model, tokens_bt):
    return model(tokens_bt)


TOKENS = np.random.RandomState(0).randint(3, 96, (2, 8)).astype(np.int32)


def test_sharded_safetensors_load_and_export(llama, tmp_path):
    hf, _ = llama
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    ours = models.from_pretrained(sharded)
    ref = hf_tiny.hf_logits(hf, TOKENS)
    np.testing.assert_allclose(np.asarray(forward(ours, TOKENS)), ref, atol=1e-4, rtol=0)
    out = models.save_pretrained(ours, tmp_path / "out", max_shard_size=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    again = transformers.AutoModelForCausalLM.from_pretrained(out)
    np.testing.assert_allclose(hf_tiny.hf_logits(again, TOKENS), ref, atol=1e-4, rtol=0)


def test_pickle_weights_need_explicit_flag(llama, tmp_path):
    hf, _ = llama
    folder = tmp_path / "bin"
    folder.mkdir()
    hf.config.save_pretrained(folder)
    torch.save(hf.state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="allow_pickle=True"):
        models.from_pretrained(folder)
    ours = models.from_pretrained(folder, allow_pickle=True)
    ref = hf_tiny.hf_logits(hf, TOKENS)
    np.testing.assert_allclose(np.asarray(forward(ours, TOKENS)), ref, atol=1e-4, rtol=0)


def test_unsupported_architecture_lists_supported(tmp_path):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(models.UnsupportedModelError, match=r"LlamaForCausalLM.*Qwen3ForCausalLM"):
        models.from_pretrained(tmp_path)


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        models.from_pretrained(tmp_path / "nope")


def test_bf16_params_and_compute_give_finite_f32_logits_close_to_f32(llama, tmp_path):
    _, path = llama
    ref = np.asarray(forward(models.from_pretrained(path), TOKENS))
    bf16 = models.from_pretrained(path, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    assert bf16.model.layers.mlp.up_proj.kernel[...].dtype == jnp.bfloat16
    logits = np.asarray(forward(bf16, TOKENS))
    assert logits.dtype == np.float32 and np.isfinite(logits).all()
    np.testing.assert_allclose(logits, ref, atol=0.05 * np.abs(ref).max())
    out = models.save_pretrained(bf16, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    reader = weights.SafetensorsReader([out / "model.safetensors"])
    assert reader.get("lm_head.weight").dtype == jnp.bfloat16


def _loss_fn(model, tokens_bt, mask_bt=None):
    graphdef, params = nnx.split(model)

    def loss(params):
        logits = nnx.merge(graphdef, params)(tokens_bt, mask_bt)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    return loss, params


@pytest.mark.parametrize("remat", ["full", "dots"])
@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen2"])  # no / all / some windows
def test_remat_gives_same_loss_and_gradients(family, remat, tmp_path):
    """Remat runs the layers as a checkpointed scan (per-layer sliding-window masks included)."""
    hf_tiny.build_hf(family).save_pretrained(tmp_path)
    tokens, mask = hf_tiny.left_padded_batch(np.random.RandomState(0), [8, 5], 8, 96)

    def value_and_grad(remat):
        loss, params = _loss_fn(models.from_pretrained(tmp_path, remat=remat), tokens, mask)
        return jax.jit(jax.value_and_grad(loss))(params)

    plain, remat = value_and_grad("none"), value_and_grad(remat)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), plain, remat)


def test_remat_keeps_only_layer_inputs_for_the_backward_pass(llama):
    """XLA's buffer assignment (not a timing): with remat the backward pass's scratch memory
    no longer grows with the number of saved activations per layer."""
    _, path = llama
    tokens = np.random.RandomState(1).randint(3, 96, (16, 64)).astype(np.int32)

    def temp_bytes(remat):
        loss, params = _loss_fn(models.from_pretrained(path, remat=remat), tokens)
        compiled = jax.jit(jax.grad(loss)).lower(params).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp_bytes("full") < 0.6 * temp_bytes("none")


def test_value_model_from_policy_checkpoint(llama):
    _, path = llama
    critic = models.from_pretrained(path, head="value")
    assert isinstance(critic, models.ValueModel)
    values = forward(critic, jnp.asarray(TOKENS))
    assert values.shape == TOKENS.shape and values.dtype == jnp.float32
    policy = models.from_pretrained(path)
    from_lm = models.ValueModel.from_causal_lm(policy, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(
        from_lm.model.layers.mlp.down_proj.kernel[...],
        policy.model.layers.mlp.down_proj.kernel[...],
    )


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_model_built_from_scratch_exports_to_transformers(model_type, tmp_path):
    config = models.ModelConfig(
        model_type=model_type,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qk_norm=model_type == "qwen3",
    )
    ours = models.CausalLM(config, rngs=nnx.Rngs(3))
    out = models.save_pretrained(ours, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokens = TOKENS % 64
    np.testing.assert_allclose(
        hf_tiny.hf_logits(hf, tokens), np.asarray(forward(ours, tokens)), atol=1e-4, rtol=0
    )
