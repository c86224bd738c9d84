"""Tests of jaxrl_llm.config, one module per module: engine, schema (validation: test_config.py)."""
