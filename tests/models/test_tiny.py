"""jaxrl_llm.models.tiny: the built-in ``tiny-random`` model of configs/tiny.yaml."""

import jax.numpy as jnp
from flax import nnx

from jaxrl_llm import models
from jaxrl_llm.train import models as train_models


def test_tiny_random_config_builds_a_small_llama():
    config = models.tiny_random_config(vocab_size=64)
    assert (config.model_type, config.num_layers, config.hidden_size) == ("llama", 2, 64)
    assert models.tiny_random_config().vocab_size == 49152  # SmolLM2's tokenizer
    assert models.tiny_random_config(num_layers=1).num_layers == 1
    lm = models.CausalLM(config, rngs=nnx.Rngs(0))
    assert lm(jnp.zeros((2, 5), jnp.int32)).shape == (2, 5, 64)
    # the trainer resolves model.path = "tiny-random" through the same definition
    assert train_models.tiny_random_config is models.tiny_random_config
    assert train_models.TINY_RANDOM == models.TINY_RANDOM == "tiny-random"
