"""The main job, end to end with the real default model: two quickstart steps through the CLI.

``jaxrl-llm train --config configs/quickstart.yaml`` on SmolLM2-135M-Instruct, shortened to two
steps and an 8-prompt held-out split, in-process through :func:`jaxrl_llm.cli.main`; then the
run directory is checked the way a user (and the tooling) reads it.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from jaxrl_llm import cli, models
from jaxrl_llm.train import metrics as M
from jaxrl_llm.train.checkpoint import Checkpointer
from tests.train import helpers as H

# Kept short for CI (2 CPU cores): 8 held-out prompts, 2 prompts × 4 samples per step, one
# device (the suite's 8 fake CPU devices would only split the same 2 cores).
OVERRIDES = [
    "data.eval_size=8",
    "rollout.prompts_per_step=2",
    "train.eval_every=0",  # still evaluated before the first step and after the last
    "mesh.data=1",
]


@pytest.mark.slow
def test_quickstart_two_steps_with_the_default_model(smollm2, smollm2_tokenizer, tmp_path, capsys):
    import torch
    import transformers

    run_dir = tmp_path / "run"
    start = time.perf_counter()
    argv = ["train", "--config", str(H.CONFIGS / "quickstart.yaml"), "--run-dir", str(run_dir)]
    code = cli.main([*argv, "--max-steps", "2", "--no-progress", *OVERRIDES])
    elapsed = time.perf_counter() - start
    out = capsys.readouterr()
    assert code == 0, out.err
    print(f"quickstart, 2 steps: {elapsed:.1f} s")

    # metrics.jsonl: eval at step 0, steps 1 and 2 with their reward, eval at step 2.
    records = M.read_metrics(run_dir)
    train = {r["step"]: r for r in records if "reward/mean" in r}
    assert sorted(train) == [1, 2]
    for record in train.values():
        assert math.isfinite(record["reward/mean"]) and 0.0 <= record["reward/mean"] <= 1.0
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    for record in evals:
        assert math.isfinite(record["eval/accuracy"]) and record["eval/num_prompts"] == 8

    # The resolved config, the curves, the checkpoint at the end.
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["path"] == "default" and saved["train"]["max_steps"] == 2
    assert saved["data"]["eval_size"] == 8 and saved["rollout"]["prompts_per_step"] == 2
    assert (run_dir / "curves.png").stat().st_size > 0
    assert Checkpointer(run_dir / "checkpoints").all_steps() == [2]

    # export/ loads in transformers and computes the logits our model computes from it.
    export = run_dir / "export"
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        export, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 7 + 5? Answer with just the number."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = np.asarray([tokenizer(text, add_special_tokens=False)["input_ids"]], np.int32)
    assert ids.tolist() == [smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]]
    with torch.no_grad():
        ref = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    ours = models.from_pretrained(export)
    logits = np.asarray(nnx.jit(lambda m, x: m(x))(ours, jnp.asarray(ids)))
    np.testing.assert_allclose(logits, ref, atol=3e-4, rtol=0)  # |logits| up to ~30

    # The export is the trained policy, not the initial weights (``smollm2``).
    trained, initial = (jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (ours, smollm2))
    assert any(
        np.any(np.asarray(a) != np.asarray(b)) for a, b in zip(trained, initial, strict=True)
    )
