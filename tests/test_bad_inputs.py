"""The bad-input catalogue: what users get wrong, driven through ``jaxrl-llm`` in-process.

Each case runs one command (mostly ``jaxrl-llm train --config ... --run-dir EXISTING``, where
EXISTING is a run directory with a checkpoint and metrics, as a user re-running a command on
their run would have) and checks three things: exit status 2 with no traceback; a message whose
key fragments say what was wrong, where (file:line, key, row, sample) and what was expected;
and no data loss (EXISTING's files are untouched; a command that fails after resuming, e.g. on
a broken reward, leaves the checkpoints and metrics.jsonl untouched).

Most cases fail at validation, before a model is built; the model, data and reward cases build
the tiny random model (no compile); only the three reward-at-runtime cases generate (one small
compile, shared).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from jaxrl_llm.cli import main
from jaxrl_llm.config import load_config, save_config, to_yaml

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = str(CONFIGS / "tiny.yaml")
REWARD_MODULE = "jaxrl_bad_inputs_rewards"

_REWARDS = '''
"""Rewards that break the protocol, for the bad-input catalogue."""


def raises(prompts, completions, **fields):
    return [float(x) for x in fields["answer_typo"]]


def nan(prompts, completions, **fields):
    return [float("nan")] * len(completions)


def short(prompts, completions, **fields):
    return [1.0] * (len(completions) - 1)


def exits(prompts, completions, **fields):
    import sys

    sys.exit(0)


def hangs(prompts, completions, **fields):
    import threading

    threading.Event().wait(600)
    return [0.0] * len(completions)


NOT_A_FUNCTION = 3
'''


@dataclasses.dataclass(frozen=True)
class Paths:
    root: Path
    existing: Path  # a run directory with a checkpoint (step 1), metrics.jsonl and config.yaml


def _llama_folder(folder: Path, vocab_size: int, *, pickle: bool = False) -> Path:
    """A 1-layer random Llama of width 32 as an HF folder (safetensors, or a ``.bin`` pickle)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        pad_token_id=2,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if pickle:
        folder.mkdir(parents=True)
        config.save_pretrained(folder)
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    else:
        model.save_pretrained(folder)
    return folder


def _make_existing_run(run_dir: Path) -> None:
    """What ``train`` leaves after step 1: config.yaml, metrics.jsonl, checkpoints/1."""
    from jaxrl_llm.data import BatchIterator
    from jaxrl_llm.train import setup
    from jaxrl_llm.train.checkpoint import Checkpointer

    config = load_config(TINY, ["data.eval_size=0"])
    run = setup.resolve(config, run_dir)
    state = run.state
    it = BatchIterator(run.data.train, config.rollout.prompts_per_step, seed=0, pad_multiple=32)
    it.next_batch()
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        meta = {"data": it.state_dict(), "config": to_yaml(config)}
        ckpt.save(1, state._replace(step=state.step + 1), meta=meta)
    save_config(config, run_dir / "config.yaml")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.25}) + "\n")


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> Paths:
    import transformers

    root = tmp_path_factory.mktemp("bad_inputs")
    w = lambda name, text: (root / name).write_text(textwrap.dedent(text), encoding="utf-8")
    w(
        "malformed.yaml",
        f"""\
        base: {TINY}
        rollout:
          num_samples: 2
           max_new_tokens: 4
        """,
    )
    w("duplicate.yaml", f"base: {TINY}\noptim:\n  lr: 1.0e-4\noptim:\n  lr: 2.0e-4\n")
    w("list.yaml", "- model\n- optim\n")
    w("mistyped.yaml", f"base: {TINY}\nrollout:\n  num_sample: 4\n")
    w("required.yaml", f"base: {TINY}\nmodel:\n  path: ???\n")
    w("data.jsonl", '{"prompt": "What is 1 + 1?", "answer": "2"}\n' * 2)
    w("no_prompt.jsonl", '{"prompt": "What is 1 + 1?", "answer": "2"}\n{"answer": "3"}\n')
    w("bad_json.jsonl", '{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "x", \n')
    (root / "empty.jsonl").write_bytes(b"")
    latin1 = '{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": "Café 1 + 2?", "answer": 3}\n'
    (root / "latin1.jsonl").write_bytes(latin1.encode("latin-1"))
    w("data.txt", "What is 1 + 1?\n")
    _llama_folder(root / "narrow", 49152)  # the tiny-random vocab, another width
    _llama_folder(root / "vocab256", 256)
    _llama_folder(root / "pickled", 49152, pickle=True)
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(root / "gpt2")
    (root / "modules").mkdir()
    (root / "modules" / f"{REWARD_MODULE}.py").write_text(_REWARDS, encoding="utf-8")
    (root / "empty_run").mkdir()
    _make_existing_run(root / "existing")
    return Paths(root=root, existing=root / "existing")


@pytest.fixture(scope="module", autouse=True)
def _reward_module_importable(paths):
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(paths.root / "modules"))
        yield


# ---------------------------------------------------------------------------------------------
# The catalogue.


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad input: the command (from the fixture paths) and what its message must contain.

    ``after_resume``: the command fails after restoring EXISTING (its logger has opened new
    TensorBoard files by then), so config.yaml, checkpoints/ and metrics.jsonl must be untouched.
    """

    id: str
    argv: Callable[[Paths], list[str]]
    expect: tuple[str, ...]
    after_resume: bool = False


def train(*overrides: str, config: str | None = None) -> Callable[[Paths], list[str]]:
    """``jaxrl-llm train`` on EXISTING; ``{root}`` in ``config``/overrides is the fixture dir."""

    def argv(p: Paths) -> list[str]:
        cfg = TINY if config is None else str(p.root / config)
        items = [o.replace("{root}", str(p.root)) for o in overrides]
        return ["train", "--config", cfg, "--run-dir", str(p.existing), "--no-progress", *items]

    return argv


def file_data(name: str, *overrides: str) -> Callable[[Paths], list[str]]:
    return train("data.source=file", "data.path={root}/" + name, "data.eval_size=0", *overrides)


def user_reward(function: str, *overrides: str) -> Callable[[Paths], list[str]]:
    return train(
        f"rewards.terms=[{{type: '{REWARD_MODULE}:{function}', name: my_{function}}}]", *overrides
    )


CASES = [
    # --- the config file and the command line
    Case(
        "malformed_yaml",
        train(config="malformed.yaml"),
        ("malformed.yaml:4:", "malformed YAML", "mapping values are not allowed"),
    ),
    Case("duplicate_yaml_key", train(config="duplicate.yaml"), ("duplicate.yaml:4:", "'optim'")),
    Case(
        "yaml_not_a_mapping",
        train(config="list.yaml"),
        ("list.yaml", "expected a mapping of sections", "['model', 'optim']"),
    ),
    Case("missing_config_file", train(config="nope.yaml"), ("config file not found", "nope.yaml")),
    Case(
        "mistyped_override_key",
        train("optim.lrr=1e-5"),
        ("unknown key 'optim.lrr'", "did you mean 'optim.lr'?", "valid keys of optim"),
    ),
    Case(
        "mistyped_key_in_file",
        train(config="mistyped.yaml"),
        ("unknown key 'rollout.num_sample'", "did you mean 'rollout.num_samples'?"),
    ),
    Case(
        "mistyped_section",
        train("optimm.lr=1e-5"),
        ("unknown key 'optimm'", "did you mean 'optim'?"),
    ),
    Case(
        "wrong_type_int",
        train("rollout.num_samples=two"),
        ("rollout.num_samples = 'two'", "expected an integer, got str"),
    ),
    Case(
        "wrong_type_bool",
        train("data.shuffle=maybe"),
        ("data.shuffle = 'maybe'", "expected true or false"),
    ),
    Case(
        "zero_batch",
        train("rollout.prompts_per_step=0"),
        ("rollout.prompts_per_step = 0", "expected an integer ≥ 1"),
    ),
    Case(
        "negative_length",
        train("rollout.max_new_tokens=-3"),
        ("rollout.max_new_tokens = -3", "≥ 1"),
    ),
    Case("negative_lr", train("optim.lr=-1e-5"), ("optim.lr = -1e-05", "a number > 0")),
    Case("zero_max_steps_flag", train("--max-steps", "0"), ("--max-steps 0", "≥ 1")),
    Case(
        "group_recipe_with_G_1",
        train("rollout.num_samples=1"),
        ("rollout.num_samples = 1", "≥ 2 for grpo", "group of one"),
    ),
    Case(
        "unknown_recipe",
        train("algorithm.name=grop"),
        ("algorithm.name = 'grop'", "did you mean 'grpo'?", "'reinforce'"),
    ),
    Case(
        "mistyped_hparam",
        train("algorithm.hparams.betta=0.1"),
        ("algorithm.hparams.betta", "did you mean 'algorithm.hparams.beta'?"),
    ),
    Case(
        "override_without_equals",
        train("optim.lr"),
        ("override 'optim.lr'", "expected `dotted.key=value`"),
    ),
    Case(
        "required_value_left_open",
        train(config="required.yaml"),
        ("model.path is required", "`model.path=...`"),
    ),
    Case(
        "dpo_with_rollout_section",
        train("algorithm.name=dpo"),
        ("rollout: dpo trains offline", "`rollout: null`", "preference.pairs_per_step"),
    ),
    Case(
        "minibatches_do_not_divide_batch",
        train("optim.num_minibatches=3"),
        ("optim.num_minibatches = 3", "a divisor of the batch of 4 sequences"),
    ),
    Case(
        "mesh_does_not_divide_devices",
        train("mesh.data=3"),
        ("mesh = (data=3, fsdp=1, tensor=1)", "3, does not divide the 8 devices"),
    ),
    Case(
        "batch_does_not_divide_mesh",
        train("mesh.data=8"),
        ("the batch of 4", "rollout.prompts_per_step × rollout.num_samples", "size 8"),
    ),
    # --- data files
    Case(
        "missing_dataset_file",
        file_data("nope.jsonl"),
        ("data file", "nope.jsonl", "does not exist"),
    ),
    Case("empty_dataset", file_data("empty.jsonl"), ("empty.jsonl", "empty", "at least one row")),
    Case(
        "row_without_prompt",
        file_data("no_prompt.jsonl"),
        ("no_prompt.jsonl", "row 1 has no value for field 'prompt'", "a non-empty string"),
    ),
    Case(
        "non_utf8_text",
        file_data("latin1.jsonl"),
        ("latin1.jsonl", "line 2 is not valid UTF-8", "0xe9", "as UTF-8"),
    ),
    Case(
        "invalid_json_line",
        file_data("bad_json.jsonl"),
        ("bad_json.jsonl", "line 2 is not valid JSON"),
    ),
    Case(
        "mistyped_prompt_field",
        file_data("data.jsonl", "data.prompt_field=promt"),
        ("data.jsonl", "no field 'promt'", "Did you mean 'prompt'?", "prompt_field"),
    ),
    Case(
        "eval_split_takes_every_row",
        file_data("data.jsonl", "data.eval_size=2"),
        ("data.jsonl", "data.eval_size = 2", "none of the 2 rows", "data.eval_path"),
    ),
    Case(
        "unknown_file_extension",
        file_data("data.txt"),
        ("data.txt", "cannot tell the format", ".jsonl", "data.format"),
    ),
    Case(
        "all_prompts_over_the_limit",
        train("data.max_prompt_length=5"),
        ("all 64 prompts are longer than the limit of 5 tokens", "max_prompt_length"),
    ),
    # --- models
    Case(
        "missing_model_folder",
        train("model.path={root}/no_model"),
        ("model.path = ", "no_model", "no such folder or file", "'default'", "model hub"),
    ),
    Case(
        "missing_tokenizer_folder",
        train("model.tokenizer={root}/no_tokenizer"),
        ("model.tokenizer = ", "no_tokenizer", "no such folder or file"),
    ),
    Case(  # reported before the policy is loaded
        "missing_critic_folder",
        train("algorithm.name=ppo", "algorithm.hparams={}", "critic.path={root}/no_critic"),
        ("critic.path = ", "no_critic", "no such folder or file", "value or reward model"),
    ),
    Case(
        "missing_reward_model_folder",
        train("rewards.terms=[{type: reward_model, kwargs: {path: '{root}/no_rm'}}]"),
        ("rewards.terms[0].kwargs.path = ", "no_rm", "no such folder or file", "reward model"),
    ),
    Case(
        "unsupported_architecture",
        train("model.path={root}/gpt2", "model.tokenizer=default"),
        ("gpt2", "model_type 'gpt2'", "not supported", "LlamaForCausalLM"),
    ),
    Case(
        "pickle_weights_without_flag",
        train("model.path={root}/pickled", "model.tokenizer=default"),
        ("pytorch_model.bin", "unpickling can run arbitrary code", "model.allow_pickle=true"),
    ),
    Case(
        "tokenizer_does_not_match_model",
        train("model.path={root}/vocab256", "model.tokenizer=default"),
        ("model.tokenizer = 'default'", "49152 tokens", "vocab_size is 256"),
    ),
    Case(
        "resume_with_changed_model_shape",
        train("model.path={root}/narrow", "model.tokenizer=default"),
        (
            "checkpoints/1 does not fit this run",
            "params/model/embed_tokens/embedding: checkpoint (49152, 64) float32, "
            "this run (49152, 32)",
            "Use a new --run-dir",
        ),
    ),
    # --- rewards
    Case(
        "unknown_reward_type",
        train("rewards.terms=[{type: integer_answr}]"),
        ("rewards.terms[0].type = 'integer_answr'", "did you mean 'integer_answer'?"),
    ),
    Case(
        "reward_model_without_path",
        train("rewards.terms=[{type: reward_model}]"),
        ("rewards.terms[0].kwargs.path = None", "the reward model's folder"),
    ),
    Case(
        "reward_module_missing",
        train("rewards.terms=[{type: 'no_such_rewards:score'}]"),
        ("rewards.terms[0]", "no module named 'no_such_rewards'", "PYTHONPATH"),
    ),
    Case(
        "reward_function_missing",
        user_reward("nann"),
        ("rewards.terms[0]", f"'{REWARD_MODULE}' has no 'nann'", "did you mean 'nan'?"),
    ),
    Case(
        "reward_not_callable",
        user_reward("NOT_A_FUNCTION"),
        ("rewards.terms[0]", "is a int, not a callable"),
    ),
    Case(
        "reward_raises",
        user_reward("raises"),
        (
            "reward 'my_raises' raised KeyError: 'answer_typo' on sample 0",
            "(prompt 'What is",
            "completion '",
            f"{REWARD_MODULE}.py:6, in raises",
        ),
        after_resume=True,
    ),
    Case(
        "reward_returns_nan",
        user_reward("nan"),
        ("reward 'my_nan' returned nan for sample 0", "(prompt 'What is", "finite floats"),
        after_resume=True,
    ),
    Case(
        "reward_returns_wrong_length",
        user_reward("short"),
        (
            "reward 'my_short' returned 3 scores for 4 samples",
            "one float per completion",
            "(sample 0 (prompt 'What is",
            "alone gets 0 scores",
        ),
        after_resume=True,
    ),
    Case(
        "reward_calls_sys_exit",
        user_reward("exits"),
        (
            "reward 'my_exits' raised RewardExited: sys.exit(0) was called",
            "not end the process",
            f"{REWARD_MODULE}.py:",
            "in exits",
        ),
        after_resume=True,
    ),
    Case(
        "reward_never_returns",
        user_reward("hangs", "rewards.timeout=1"),
        (
            "reward 'my_hangs' did not return within rewards.timeout = 1 s on a batch of 4",
            "raise rewards.timeout",
            "rewards.on_error=zero",
        ),
        after_resume=True,
    ),
    # --- the other subcommands
    Case(
        "evaluate_empty_run_dir",
        lambda p: ["evaluate", "--run-dir", str(p.root / "empty_run")],
        ("jaxrl-llm evaluate: give --config FILE", "empty_run/config.yaml"),
    ),
    Case(
        "evaluate_missing_run_dir",
        lambda p: ["evaluate", "--run-dir", str(p.root / "no_such_run")],
        ("jaxrl-llm evaluate: --run-dir", "no_such_run: no such folder", "--config FILE"),
    ),
    Case(
        "export_without_checkpoint",
        lambda p: ["export", "--config", TINY, "--run-dir", str(p.root / "empty_run")],
        ("jaxrl-llm export: no checkpoint in", "empty_run/checkpoints", "train the run first"),
    ),
    Case(
        "explain_unknown_recipe",
        lambda p: ["explain", "grop"],
        ("unknown algorithm 'grop'", "grpo"),
    ),
]


def _snapshot(run_dir: Path, *, only: tuple[str, ...] | None = None) -> dict[str, str]:
    """Every file under ``run_dir`` (or the ``only`` top-level entries): contents for small
    files, size and mtime for the checkpoint's array files."""
    out = {}
    for path in sorted(run_dir.rglob("*")):
        rel = path.relative_to(run_dir).as_posix()
        if not path.is_file() or (only is not None and rel.split("/")[0] not in only):
            continue
        stat = path.stat()
        if stat.st_size > 1 << 16:
            out[rel] = f"{stat.st_size}:{stat.st_mtime_ns}"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def test_the_catalogue_is_large_enough(paths):
    assert len(CASES) >= 25
    assert len({c.id for c in CASES}) == len(CASES)
    existing = _snapshot(paths.existing)
    assert "metrics.jsonl" in existing and any(k.startswith("checkpoints/1/") for k in existing)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, paths, capsys):
    only = ("checkpoints", "metrics.jsonl", "config.yaml") if case.after_resume else None
    before = _snapshot(paths.existing, only=only)
    empty_before = sorted(p.name for p in (paths.root / "empty_run").iterdir())
    assert main(case.argv(paths)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    for fragment in case.expect:
        assert fragment in err, f"{fragment!r} not in:\n{err}"
    assert _snapshot(paths.existing, only=only) == before, "the existing run changed"
    assert sorted(p.name for p in (paths.root / "empty_run").iterdir()) == empty_before
