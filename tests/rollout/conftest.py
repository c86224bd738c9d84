"""Fixtures for the rollout tests: tiny random HF models (fast) and the real default model.

The real-model fixtures are the models suite's session fixtures, imported so both suites use
one definition (they load SmolLM2-135M-Instruct once per session).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

from tests.models.conftest import smollm2, smollm2_hf, smollm2_path, smollm2_tokenizer  # noqa: F401


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """``family -> (HF torch model, our model loaded from its saved folder)``, built lazily."""
    from jaxrl_llm import models
    from tests.models import hf_tiny

    built = {}

    def get(family: str):
        if family not in built:
            hf = hf_tiny.build_hf(family)
            path = tmp_path_factory.mktemp(f"rollout_{family}")
            hf.save_pretrained(path)
            built[family] = (hf, models.from_pretrained(path))
        return built[family]

    return get
