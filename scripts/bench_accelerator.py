"""What needs a lent GPU/TPU, as one prepared script: plan's predicted peak against the measured
one, and the GRPO step and rollout times, written as one JSON.

    python scripts/bench_accelerator.py --out /tmp/bench.json                      # tiny, seconds
    python scripts/bench_accelerator.py --config configs/quickstart.yaml --out b.json  # SmolLM2

For the run of ``--config`` (a config whose model has weights: ``tiny-random``, ``default`` or a
folder) on this process's devices it

1. plans the run for these devices (:func:`jaxrl_llm.train.plan.local_target`: the same
   programs compiled for the same devices, shapes only) and records the predicted peak;
2. builds the real state (:func:`jaxrl_llm.train.setup.build_models`), runs the sampler on
   ``rollout.prompts_per_step`` random prompts of the planned width (no stop token, so every
   completion is ``rollout.max_new_tokens`` long: the plan's worst case) and the fused RL step
   on its completions, timing each;
3. reads ``device.memory_stats()["peak_bytes_in_use"]`` and reports it next to the plan's peak
   (the issue's check: within 10%). CPU devices report no memory statistics: there the
   measured figures are ``null`` and the script only shows that it runs.

Not covered yet (issue 15): model fwd/bwd MFU of a 1B-class config, decode tokens/s against the
HBM roofline at batch 256.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
from _bench_common import machine_info  # scripts/ is on sys.path when run as a script


def _peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return None if not stats else int(stats.get("peak_bytes_in_use", 0))


def run(config_path: str, overrides: list[str], num_devices: int | None) -> dict:
    from jaxrl_llm import rollout
    from jaxrl_llm.config import build_recipe, load_config
    from jaxrl_llm.train import plan as P
    from jaxrl_llm.train import setup as su
    from jaxrl_llm.train.step import Groups, make_rl_step

    config = load_config(config_path, overrides)
    target = P.local_target(num_devices)
    t0 = time.perf_counter()
    plan = P.plan_run(config, target)
    plan_s = time.perf_counter() - t0

    recipe = build_recipe(config)
    mesh, _ = su.make_mesh(config)
    models, state = su.build_models(config, recipe, mesh=mesh)
    r = config.rollout
    b, g, t = r.prompts_per_step, r.num_samples, r.max_new_tokens
    p = -(-config.data.max_prompt_length // su.PAD_MULTIPLE) * su.PAD_MULTIPLE
    vocab = models.policy(state.params).config.vocab_size
    rng = np.random.default_rng(0)
    ids = rng.integers(3, vocab, (b, p), dtype=np.int32)
    mask = np.ones((b, p), bool)
    sampler = su._sampler(config, ())

    def sample():
        out = rollout.generate(
            (models.graphdef, state.params),
            ids,
            mask,
            rng=jax.random.key(0),
            max_new_tokens=t,
            num_samples=g,
            temperature=sampler.temperature,
            top_k=sampler.top_k,
            top_p=sampler.top_p,
            stop_token_ids=(),
            cache_dtype=sampler.cache_dtype,
        )
        return jax.block_until_ready(out)

    t0 = time.perf_counter()
    gen = sample()
    rollout_first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    gen = sample()
    rollout_s = time.perf_counter() - t0
    groups = Groups(
        prompt_ids_bp=ids,
        prompt_mask_bp=mask,
        tokens_bgt=np.asarray(gen.tokens),
        mask_bgt=np.asarray(gen.mask),
        logp_sampler_bgt=np.asarray(gen.logprobs),
        reward_bg=rng.standard_normal((b, g)).astype(np.float32),
        member_bg=np.ones((b, g), bool),
    )
    step = make_rl_step(
        recipe,
        models,
        su.update_shape(config),
        temperature=sampler.temperature or 1.0,
        old_logprobs=su.OldLogprobs(config.old_logprobs.source, config.old_logprobs.tis_cap),
    )
    t0 = time.perf_counter()
    state, _ = step(state, groups)
    step_first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    state, metrics = step(state, groups)
    step_s = time.perf_counter() - t0
    measured = _peak_bytes()
    predicted = plan.peak
    return {
        "machine": machine_info(),
        "config": config_path,
        "overrides": overrides,
        "plan": plan.to_dict(),
        "plan_s": plan_s,
        "predicted_peak_bytes": predicted,
        "measured_peak_bytes": measured,
        "measured_over_predicted": None if measured is None else measured / predicted,
        "within_10_percent": None if measured is None else abs(measured / predicted - 1) <= 0.1,
        "rollout_s": {"first (compile)": rollout_first_s, "steady": rollout_s},
        "rollout_tokens_per_s": b * g * t / rollout_s,
        "step_s": {"first (compile)": step_first_s, "steady": step_s},
        "step_finite": bool(np.isfinite(metrics["actor/loss"]))
        if "actor/loss" in metrics
        else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--devices", type=int, default=None, help="first N devices (default 1)")
    parser.add_argument("--out", default=None, help="write the JSON here (also printed)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    result = run(args.config, list(args.overrides), args.devices or 1)
    text = json.dumps(result, indent=2, default=str)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
