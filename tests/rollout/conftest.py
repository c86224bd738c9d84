"""Fixtures for the rollout tests: tiny random HF models (fast). The real default model's
session fixtures (``smollm2``, ``smollm2_hf``, ...) are in tests/conftest.py."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest


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
