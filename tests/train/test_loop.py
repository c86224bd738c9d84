"""jaxrl_llm.train.loop and cli: end to end on configs/tiny.yaml (tiny random Llama)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil

import numpy as np
import pytest

from jaxrl_llm.train import cli, loop, setup
from jaxrl_llm.train import metrics as M
from jaxrl_llm.train.checkpoint import Checkpointer
from tests.train import helpers as H

# A reward the random model's gibberish scores unevenly, so advantages (and updates) are not 0.
VARIED = [
    "rewards.terms=[{type: length_penalty, kwargs: {target: 10, unit: chars, coef: 0.1}},"
    " {type: regex, weight: 0.5, kwargs: {pattern: '[aeiou]'}}]"
]


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    cli.add_train_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_two_steps_end_to_end_with_the_cli(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert (
        _cli(
            "train",
            "--config",
            str(H.CONFIGS / "tiny.yaml"),
            "--run-dir",
            str(run_dir),
            "--max-steps",
            "2",
            "--no-progress",
            "mesh.data=2",  # data-parallel over 2 of the 8 fake devices
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "Where does the KL go?" in out  # explain() is printed at the start
    records = M.read_metrics(run_dir)
    steps = [r["step"] for r in records]
    assert steps == [0, 1, 2, 2]  # eval before the first step, 2 steps, eval after the last
    train = [r for r in records if "reward/mean" in r]
    for key in (
        "reward/mean",
        "reward/std",
        "accuracy",
        "actor/loss",
        "actor/kl_ref",
        "kl",
        "actor/entropy",
        "actor/clip_fraction",
        "advantages/std",
        "response_length/mean",
        "groups/zero_std_fraction",
        "perf/tokens_per_s",
        "time/rollout",
        "time/reward",
        "time/update",
        "perf/peak_rss_gib",
    ):
        assert key in train[0], key
    assert 0 < train[0]["perf/peak_rss_gib"] <= train[1]["perf/peak_rss_gib"]  # a high-water mark
    assert records[0]["eval/accuracy"] is not None and records[-1]["eval/num_prompts"] == 8
    assert (run_dir / "config.yaml").exists() and (run_dir / "curves.png").exists()
    assert list((run_dir / "tensorboard").glob("events.*"))
    assert Checkpointer(run_dir / "checkpoints").all_steps() == [2]
    export = run_dir / "export"
    assert (export / "model.safetensors").exists() and (export / "tokenizer.json").exists()
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 2
    # evaluate reads RUN_DIR/config.yaml and the latest checkpoint
    assert _cli("evaluate", "--run-dir", str(run_dir)) == 0
    assert json.loads(capsys.readouterr().out.split("\n", 1)[1])["eval/num_prompts"] == 8.0
    # a config error is a message and exit status 2
    assert (
        _cli(
            "train",
            "--config",
            str(H.CONFIGS / "tiny.yaml"),
            "--run-dir",
            str(run_dir),
            "optim.lrr=1",
        )
        == 2
    )
    assert "did you mean 'optim.lr'" in capsys.readouterr().err


class _Killed(Exception):
    pass


def test_killed_run_resumes_to_the_same_parameters(tmp_path, monkeypatch):
    # on a 2-device data-parallel mesh, so restoring also places shards
    config = H.config("tiny.yaml", "train.max_steps=4", "data.eval_size=0", *VARIED)
    full = loop.train(config, run_dir=tmp_path / "full", progress=False, log=lambda *_: None)
    assert full["step"] == 4 and full["actor/grad_norm"] > 0

    original = M.MetricsLogger.progress

    def die_at_3(self, step, metrics):
        original(self, step, metrics)
        if step == 3:
            raise _Killed  # after step 3's update; its last checkpoint is step 2

    monkeypatch.setattr(M.MetricsLogger, "progress", die_at_3)
    with pytest.raises(_Killed):
        loop.train(config, run_dir=tmp_path / "killed", progress=False, log=lambda *_: None)
    monkeypatch.setattr(M.MetricsLogger, "progress", original)
    assert Checkpointer(tmp_path / "killed" / "checkpoints").all_steps() == [2]
    assert [r["step"] for r in M.read_metrics(tmp_path / "killed")] == [1, 2, 3]
    lines = []
    resumed = loop.train(config, run_dir=tmp_path / "killed", progress=False, log=lines.append)
    assert "resuming" in lines[0] and resumed["step"] == 4
    assert [r["step"] for r in M.read_metrics(tmp_path / "killed")] == [1, 2, 3, 4]
    states = []
    for name in ("full", "killed"):
        with Checkpointer(tmp_path / name / "checkpoints") as ckpt:
            states.append(ckpt.restore(setup.resolve(config).state)[0])
    a, b = states
    assert int(a.step) == int(b.step) == 4
    for x, y in zip(np.asarray(a.data_position), np.asarray(b.data_position), strict=True):
        assert x == y
    import jax

    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    shutil.rmtree(tmp_path)


SMALL = [
    "data.eval_size=0",
    "data.arithmetic.train_size=32",
    "train.max_steps=1",
    "data.max_prompt_length=128",
]


@pytest.mark.parametrize(
    "name,overrides,expect",
    [
        # critic + GAE + adaptive KL in the reward (π_old recomputed: 2 epochs x 2 minibatches)
        (
            "ppo",
            [
                "rollout.prompts_per_step=4",
                "rollout.max_new_tokens=8",
                "kl.controller=adaptive",
                *VARIED,
            ],
            ["critic/loss", "critic/grad_norm", "kl/beta", "kl/rollout", "actor/clip_fraction"],
        ),
        # dynamic sampling with refills, PODS (4 -> 2 per prompt), sampler log-probs with TIS
        (
            "dapo",
            [
                "rollout.prompts_per_step=2",
                "rollout.num_samples=4",
                "rollout.max_new_tokens=8",
                "algorithm.hparams.pods_num_keep=2",
                "old_logprobs.source=sampler",
                "algorithm.hparams.max_length=8",
                "algorithm.hparams.overlong_buffer=4",
                *VARIED,
            ],
            ["selection/kept_groups_fraction", "selection/refill_batches", "tis/weight_mean"],
        ),
        (
            "dpo",
            [
                "preference.pairs_per_step=4",
                "preference.max_response_length=8",
                "data.eval_size=4",
                "algorithm.hparams.use_weighting=true",  # WPO: log Σπ² from the policy's logits
            ],
            [
                "dpo/reward_accuracy",
                "dpo/reward_margin",
                "eval/preference_accuracy",
                "eval/accuracy",
            ],
        ),
    ],
)
def test_one_loop_step_per_kind_of_recipe(tmp_path, monkeypatch, name, overrides, expect):
    from jaxrl_llm import memory_maps

    guarded = []  # the mapping guard (memory_maps.relieve) before each step and each rollout
    real = memory_maps.relieve
    monkeypatch.setattr(memory_maps, "relieve", lambda **kw: guarded.append(kw) or real(**kw))
    config = H.config(f"algorithms/{name}.yaml", *SMALL, *overrides)
    final = loop.train(config, run_dir=tmp_path, progress=False, log=lambda *_: None)
    for key in expect:
        assert key in final and np.isfinite(final[key]), key
    assert final["step"] == 1 and final["update/nonfinite"] == 0
    # the CLI's closing "final:" line shows a training metric of every kind of recipe
    from jaxrl_llm.train.cli import FINAL_METRICS

    assert [k for k in final if k.startswith(FINAL_METRICS) and not k.startswith(("eval/", "step"))]
    assert {"where": "jaxrl-llm train"} in guarded
    assert {"where": "rollout.generate"} in guarded  # dpo: its evaluation samples
    if name == "ppo":
        _check_the_critic_export(tmp_path, config)
    elif name == "dapo":  # no critic to export: refused before anything is loaded
        assert _cli("export", "--run-dir", str(tmp_path), "--critic") == 2


def _check_the_critic_export(run_dir, config):
    """``export --critic``: the critic beside the policy, as a value model transformers loads
    (its score at the last token is ours), which ``critic.path`` starts a new run from."""
    import jax.numpy as jnp
    import torch
    import transformers

    from jaxrl_llm import models

    assert _cli("export", "--run-dir", str(run_dir), "--critic") == 0
    folder = run_dir / "export" / "critic"
    assert (run_dir / "export" / "config.json").is_file()  # the policy, as before
    s = setup.resolve(config, run_dir)
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        state = ckpt.restore(s.state)[0]
    tokens = np.random.default_rng(0).integers(3, 100, (2, 7)).astype(np.int32)
    values = np.asarray(s.models.critic(state.critic_params)(jnp.asarray(tokens)))
    loaded = models.from_pretrained(folder, head="value", dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(loaded(jnp.asarray(tokens))), values, atol=1e-5)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    with torch.no_grad():
        logits = hf(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(logits[:, 0], values[:, -1], atol=1e-4)
    again = setup.resolve(
        dataclasses.replace(config, critic=dataclasses.replace(config.critic, path=str(folder)))
    )
    assert H.tree_max_diff(again.state.critic_params, state.critic_params) < 1e-6


@pytest.mark.slow  # ~30 s: 4 two-device engines compile their programs
def test_a_lora_run_samples_on_tensor_parallel_engines(tmp_path, monkeypatch):
    """``rollout.tensor_parallel=2`` on an FSDP mesh of 8: the trainer's rollouts (training and
    evaluation, on the LoRA-merged weights) run on 4 engines of 2 devices, and the step ends
    with finite metrics."""
    from jaxrl_llm.rollout import paged_dp

    regrouped = []
    real = paged_dp.regroup
    monkeypatch.setattr(paged_dp, "regroup", lambda *a: regrouped.append(a[3]) or real(*a))
    config = H.config(
        "algorithms/grpo.yaml", *SMALL, *VARIED, "data.eval_size=4", "rollout.prompts_per_step=4",
        "rollout.num_samples=2", "rollout.max_new_tokens=6", "rollout.engine=auto",
        "mesh.preset=fsdp", "mesh.data=1", "mesh.fsdp=8", "rollout.tensor_parallel=2",
        "model.lora.rank=4",
    )  # fmt: skip
    final = loop.train(config, run_dir=tmp_path, progress=False, log=lambda *_: None)
    assert final["step"] == 1 and final["update/nonfinite"] == 0
    assert np.isfinite(final["eval/reward_mean"]) and np.isfinite(final["actor/grad_norm"])
    assert final["response_length/mean"] > 0
    assert len(regrouped) >= 3 and set(regrouped) == {2}  # eval, rollout, eval
