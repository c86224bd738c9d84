"""`scripts/bench_advantages.py` on a tiny shape, so the benchmark cannot rot."""

import json

from jaxrl_llm import algorithms
from tests import reference as ref
from tests.scripts import load_script


def test_bench_advantages_tiny(tmp_path):
    bench = load_script("bench_advantages")
    out, md = tmp_path / "advantages.json", tmp_path / "advantages.md"
    argv = ["--batch", "4", "--group", "2", "--tokens", "8", "--repeats", "2"]
    assert bench.main([*argv, "--out", str(out), "--markdown", str(md)]) == 0

    result = json.loads(out.read_text())
    assert result["shape"] == {**result["shape"], "batch": 4, "group": 2, "tokens": 8}
    assert result["machine"]["cpu_model"] and result["machine"]["jax"]
    assert set(result["recipes"]) == {n for n in algorithms.ONLINE_RECIPES if n in ref.ESTIMATOR}
    for name, r in result["recipes"].items():
        assert r["allclose"], name
        assert r["recompilations_warm"] == 0, name
        assert r["compilations_first_call"] >= 1, name
        assert r["ms"]["p10"] <= r["ms"]["median"] <= r["ms"]["p90"], name
        assert r["loop_ms"]["median"] > 0 and r["ratio"] > 0, name
        assert r["target_met"] is None, name  # targets are for the full shape only
    text = md.read_text()
    assert "| `grpo` | GRPO |" in text and "not evaluated" in text


def test_fields_follow_the_recipe():
    bench = load_script("bench_advantages")
    assert bench.fields_for(algorithms.ppo()) == (
        "reward_bg",
        "mask_bgt",
        "logp_old_bgt",
        "logp_ref_bgt",
        "value_bgt",
    )
    assert bench.fields_for(algorithms.grpo()) == ("reward_bg", "mask_bgt")
    assert bench.fields_for(algorithms.rloo(beta=0.0)) == ("reward_bg", "mask_bgt")


def test_recompilation_is_detected():
    import jax
    import jax.numpy as jnp

    bench = load_script("bench_advantages")
    counter = bench.CompileCounter()
    x = jnp.ones(3)

    def fresh_jit():  # a new function object every call: compiles every time
        return jax.jit(lambda y: y + 1.0)(x).block_until_ready()

    case = bench.Case("recompiles", None, fast=fresh_jit, loop=lambda: None, again=fresh_jit)
    timed = bench.run_timed([case], repeats=3, counter=counter)
    assert timed["recompiles"]["recompilations_warm"] == 4
