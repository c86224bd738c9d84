"""More of the bad-input catalogue (issue 19): hangs, silent wrong results, broken model folders.

Each case runs ``jaxrl-llm`` in-process and checks the exit status 2, that no traceback is
printed, the key fragments of the message (what was wrong, where, what was expected) and, for
``train``, that nothing was written to the (new) run directory. The hangs are bounded: each case
finishes in seconds. Most cases fail before a model is built (config, context, config.json and
GGUF checks all read only small files); the broken-weights cases build one 2-layer model of
width 48 abstractly and stop at its first bad tensor.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from jaxrl_llm import rewards as R
from jaxrl_llm.cli import main
from jaxrl_llm.config import ConfigError, load_config
from jaxrl_llm.data import DataError, tokens
from jaxrl_llm.models import ModelLoadError
from jaxrl_llm.models.weights import GGUF_LOADER_PACKAGES

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = str(CONFIGS / "tiny.yaml")

# 600 bytes standing for 10⁹ values once the aliases are expanded (the bomb).
_BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 10)}]\n"
    for a, b in zip("abcdefgh", "bcdefghi", strict=True)
)
_SLOW_TEMPLATE = (
    "{% for m in messages %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}{{ m['content'] }}{% endfor %}"
)


def _model_folder(folder: Path, **overrides) -> Path:
    """A random 2-layer SmolLM2-like Llama (tests/models/hf_tiny.py) as an HF folder."""
    from tests.models.hf_tiny import build_hf

    model = build_hf("smollm2", max_position_embeddings=2048, **overrides)
    model.save_pretrained(folder)
    return folder


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_safetensors(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _broken_folders(root: Path) -> None:
    good = _model_folder(root / "good")
    weights = (good / "model.safetensors").read_bytes()

    def copy(name: str) -> Path:
        folder = root / name
        folder.mkdir()
        (folder / "config.json").write_text((good / "config.json").read_text())
        (folder / "model.safetensors").write_bytes(weights)
        return folder

    (copy("bad_json") / "config.json").write_text('{"model_type": "llama",')
    (copy("config_list") / "config.json").write_text("[1, 2]")
    (copy("truncated") / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    (copy("zeros") / "model.safetensors").write_bytes(bytes(len(weights)))
    (copy("huge_header") / "model.safetensors").write_bytes(struct.pack("<Q", 2**62) + weights[8:])
    header, data = _header(good / "model.safetensors")
    name = next(k for k in header if k != "__metadata__")
    past = dict(header)
    past[name] = {**header[name], "data_offsets": [len(data), len(data) + 4 * 48]}
    _write_safetensors(copy("offsets") / "model.safetensors", past, data)
    missing = {k: v for k, v in header.items() if k != "model.norm.weight"}
    _write_safetensors(copy("missing_tensor") / "model.safetensors", missing, data)
    config = json.loads((good / "config.json").read_text())
    (copy("shape_mismatch") / "config.json").write_text(
        json.dumps({**config, "intermediate_size": 96})
    )
    (root / "junk_gguf").mkdir()
    (root / "junk_gguf" / "model.gguf").write_bytes(b"not a gguf file " * 64)
    (root / "weights.txt").write_text("a file where a model folder belongs\n")
    (root / "empty_tok").mkdir()
    remote = root / "remote_tok"
    remote.mkdir()
    (remote / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}})
    )
    (remote / "tokenization_x.py").write_text("raise SystemExit('remote code ran')\n")


@dataclasses.dataclass(frozen=True)
class Paths:
    root: Path


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> Paths:
    root = tmp_path_factory.mktemp("bad_inputs_more")
    (root / "bomb.yaml").write_text(f"base: {TINY}\n" + _BOMB)
    (root / "recursive.yaml").write_text(f"base: {TINY}\nx: &x [*x]\n")
    (root / "data.jsonl").write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n' * 4)
    _broken_folders(root)
    from jaxrl_llm import models

    tok = models.load_tokenizer(models.default_model_path())
    tok.chat_template = _SLOW_TEMPLATE
    tok.save_pretrained(root / "slow_template_tok")
    return Paths(root=root)


def test_the_bomb_is_small():
    assert len(_BOMB) < 650 and _BOMB.count("*") == 80


# ---------------------------------------------------------------------------------------------
# The catalogue: one command each, exit status 2, the message, nothing written.


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    argv: Callable[[Paths, Path], list[str]]
    expect: tuple[str, ...]


def train(*overrides: str, config: str | None = None) -> Callable[[Paths, Path], list[str]]:
    """``jaxrl-llm train`` into a new run dir; ``{root}`` is the fixture folder."""

    def argv(p: Paths, run_dir: Path) -> list[str]:
        cfg = TINY if config is None else str(p.root / config)
        items = [o.replace("{root}", str(p.root)) for o in overrides]
        return ["train", "--config", cfg, "--run-dir", str(run_dir), "--no-progress", *items]

    return argv


def model(name: str, *overrides: str) -> Callable[[Paths, Path], list[str]]:
    return train(f"model.path={{root}}/{name}", "model.tokenizer=default", *overrides)


def other(command: str, *args: str) -> Callable[[Paths, Path], list[str]]:
    """``evaluate`` / ``export`` / ``generate`` with ``{root}`` and ``{run}`` filled in."""

    def argv(p: Paths, run_dir: Path) -> list[str]:
        fill = lambda a: a.replace("{root}", str(p.root)).replace("{run}", str(run_dir))
        return [command, *(fill(a) for a in args)]

    return argv


def generate(name: str, *args: str) -> Callable[[Paths, Path], list[str]]:
    return other("generate", "--model", f"{{root}}/{name}", "--prompt", "Hi", *args)


_WEIGHTS = {
    "truncated": ("truncated/model.safetensors", "inside the file's", "truncated or corrupt"),
    "zeros": ("zeros/model.safetensors", "header length is 0", "zero-filled"),
    "huge_header": ("huge_header/model.safetensors", "4,611,686,018,427,387,904 bytes"),
    "offsets": ("offsets/model.safetensors", "data_offsets", "inside the file's"),
    "missing_tensor": ("missing_tensor", "lacks 1 tensor(s)", "model.norm.weight"),
    "shape_mismatch": (
        "shape_mismatch",
        "mlp.down_proj.weight has shape (48, 80)",
        "expects (48, 96)",
        "intermediate_size=96",
        "do not belong to this config.json",
    ),
}

CASES = [
    # --- hangs, bounded
    Case("yaml_alias_bomb", train(config="bomb.yaml"), ("bomb.yaml", "100,000", "alias bomb")),
    Case("yaml_recursive_alias", train(config="recursive.yaml"), ("recursive.yaml:", "recursive")),
    Case(
        "override_alias_bomb",
        train("data.system_prompt=" + _BOMB.replace("\n", ", ").join("{}")),
        ("override data.system_prompt", "alias bomb"),
    ),
    Case(
        "chat_template_that_never_ends",
        train("model.tokenizer={root}/slow_template_tok"),
        ("chat template ran for more than 0.5 s on one conversation", "chat_template=False"),
    ),
    # --- silent wrong results
    Case(
        "data_path_without_source_file",
        train("data.path={root}/data.jsonl"),
        ("data.path = ", "data.source = 'arithmetic'", "add data.source=file"),
    ),
    Case(
        "eval_path_with_arithmetic",
        train("data.eval_path={root}/nope.jsonl"),
        ("data.eval_path = ", "would be ignored", "data.eval_path=null"),
    ),
    Case(
        "override_value_is_a_comment",
        train("train.seed=#3"),
        ("train.seed = '#3'", "reads as None", "'#' starts a YAML comment", "quote the value"),
    ),
    Case(
        "override_value_is_a_mapping",
        train("rollout.temperature=hot: 1"),
        ("rollout.temperature = 'hot: 1'", "': ' makes a mapping", "quote the value"),
    ),
    Case(
        "override_value_is_not_yaml",
        train("rewards=[gsm8k, {type: regex"),
        ("rewards = '[gsm8k, {type: regex'", "not valid YAML", "expected ',' or '}'"),
    ),
    Case(
        "evaluate_without_held_out_set",
        other("evaluate", "--config", TINY, "--run-dir", "{run}", "data.eval_size=0"),
        ("data.eval_size = 0", "no held-out set", "data.eval_size=N"),
    ),
    # --- limits and seeds, before any model is loaded
    Case("negative_seed", train("train.seed=-1"), ("train.seed = -1", "[0, 2^63 - 1)")),
    Case(
        "seed_over_2_64",
        train(f"data.seed={2**64}"),
        (f"data.seed = {2**64}", "[0, 2^63 - 1)"),
    ),
    Case(
        "max_new_tokens_over_the_context",
        train("rollout.max_new_tokens=4096"),
        ("128 + 4096", "context of 2048 tokens", "the tiny-random model", "rollout.max_new_tokens"),
    ),
    Case(
        "prompts_over_the_context",
        model("good", "data.max_prompt_length=2000", "rollout.max_new_tokens=100"),
        ("data.max_prompt_length + rollout.max_new_tokens = 2000 + 100", "good/config.json"),
    ),
    Case(
        "evaluate_max_new_tokens_over_the_context",
        other("evaluate", "--config", TINY, "--run-dir", "{run}", "--max-new-tokens", "5000"),
        ("train.eval_max_new_tokens = 128 + 5000", "context of 2048"),
    ),
    Case(
        "generate_negative_max_new_tokens",
        other("generate", "--prompt", "Hi", "--max-new-tokens", "-3"),
        ("--max-new-tokens -3", "≥ 1"),
    ),
    Case(
        "generate_max_new_tokens_over_the_context",
        generate("good", "--max-new-tokens", "4096"),
        ("--max-new-tokens 4096", "context of 2048", "good/config.json"),
    ),
    Case(
        "generate_default_model_max_new_tokens_over_the_context",
        other("generate", "--prompt", "Hi", "--max-new-tokens", "9000"),
        ("--max-new-tokens 9000", "context of 8192 tokens", "config.json"),
    ),
    Case("generate_bad_seed", other("generate", "--prompt", "Hi", "--seed", "-1"), ("--seed -1",)),
    # --- broken model folders, in every command
    *[
        Case(f"{cmd}_config_json_invalid", argv, ("bad_json/config.json", "not valid JSON"))
        for cmd, argv in [
            ("train", model("bad_json")),
            ("generate", generate("bad_json")),
            (
                "evaluate",
                other(
                    "evaluate", "--config", TINY, "--run-dir", "{run}", "model.path={root}/bad_json"
                ),
            ),
            (
                "export",
                other(
                    "export", "--config", TINY, "--run-dir", "{run}", "model.path={root}/bad_json"
                ),
            ),
        ]
    ],
    Case("config_json_not_an_object", model("config_list"), ("config.json: a JSON list",)),
    *[Case(f"train_{name}", model(name), expect) for name, expect in _WEIGHTS.items()],
    *[Case(f"generate_{name}", generate(name), expect) for name, expect in _WEIGHTS.items()],
    *[
        Case(
            f"evaluate_{name}",
            other(
                "evaluate",
                *("--config", TINY, "--run-dir", "{run}", f"model.path={{root}}/{name}"),
                "model.tokenizer=default",
            ),
            _WEIGHTS[name],
        )
        for name in ("truncated", "missing_tensor")
    ],
    Case("train_junk_gguf", model("junk_gguf"), ("model.gguf", "not a readable GGUF file")),
    Case("generate_junk_gguf", generate("junk_gguf"), ("model.gguf", "not a readable GGUF file")),
    Case(
        "file_where_a_folder_belongs",
        model("weights.txt"),
        ("weights.txt is a file", "expected a checkpoint folder"),
    ),
    Case(
        "generate_file_where_a_folder_belongs",
        generate("weights.txt"),
        ("weights.txt is a file",),
    ),
    Case(
        "empty_tokenizer_folder",
        train("model.tokenizer={root}/empty_tok"),
        ("empty_tok: no tokenizer files", "tokenizer.json", "model.tokenizer=DIR"),
    ),
    Case(
        "remote_code_tokenizer_refused",
        train("model.tokenizer={root}/remote_tok"),
        ("remote_tok", "trust_remote_code", "model.trust_remote_code=true"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, paths, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tokens, "CHAT_TEMPLATE_TIMEOUT", 0.5)
    run_dir = tmp_path / "run"
    start = time.monotonic()
    assert main(case.argv(paths, run_dir)) == 2
    assert time.monotonic() - start < 60, "a bounded failure took too long"
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    for fragment in case.expect:
        assert fragment in err, f"{fragment!r} not in:\n{err}"
    written = sorted(p.name for p in run_dir.rglob("*") if p.is_file()) if run_dir.exists() else []
    assert not [n for n in written if n.startswith(("metrics", "config"))], written
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())


@pytest.mark.parametrize("hidden", list(GGUF_LOADER_PACKAGES))
def test_a_gguf_without_its_loader_packages_names_them(hidden, tmp_path, capsys, monkeypatch):
    """A plain install (no `test` extra) lacks torch, gguf and accelerate, which transformers'
    GGUF loader needs: the default model's first conversion, `generate` and a GGUF model path
    each say which package is missing and how to install it, and write nothing."""
    import sys

    from jaxrl_llm import models
    from jaxrl_llm.models.default import smollm2_gguf_path

    try:
        gguf_path = smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    monkeypatch.setenv("JAXRL_LLM_CACHE", str(tmp_path / "cache"))  # not converted yet
    monkeypatch.setitem(sys.modules, hidden, None)  # find_spec and import now fail, as uninstalled
    expect = (str(gguf_path), f"needs {hidden}, not installed", "pip install", "model.path")
    for argv in (
        ["train", "--config", TINY, "--run-dir", str(tmp_path / "run"), "model.path=default"],
        ["generate", "--prompt", "Hi", "--max-new-tokens", "2"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and all(f in err for f in expect), err
    with pytest.raises(ModelLoadError, match=f"needs {hidden}, not installed"):
        models.from_pretrained(gguf_path)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.json"))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_good_folder_loads(paths):
    """The broken folders are broken copies of a folder that loads (so each case tests one
    fault)."""
    from jaxrl_llm import models

    lm = models.from_pretrained(paths.root / "good", dtype="float32")
    assert lm.config.hidden_size == 48 and lm.config.max_position_embeddings == 2048


# ---------------------------------------------------------------------------------------------
# The pieces: override strings, YAML size, reward timeout and sys.exit, template time.


def test_override_text_goes_to_string_fields():
    config = load_config(TINY, ["data.system_prompt=# Task: add", "data.prompt_field=q: a"])
    assert config.data.system_prompt == "# Task: add" and config.data.prompt_field == "q: a"
    assert type(config.data.system_prompt) is str  # not the engine's marker type
    quoted = load_config(TINY, ["data.system_prompt='a #b'", "rollout.temperature=0.5"])
    assert quoted.data.system_prompt == "a #b" and quoted.rollout.temperature == 0.5
    flow = load_config(TINY, ["rewards.terms=[{type: integer_answer, name: acc}]"])
    assert flow.rewards.terms[0].name == "acc"


def test_alias_bomb_is_refused_fast(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(f"base: {TINY}\n" + _BOMB)
    start = time.monotonic()
    with pytest.raises(ConfigError, match="alias bomb"):
        load_config(path)
    assert time.monotonic() - start < 5
    # Shared anchors that stay small are fine.
    path.write_text(f"base: {TINY}\nrollout: &r {{num_samples: 2}}\n")
    assert load_config(path).rollout.num_samples == 2


def _hang(prompts, completions, **fields):
    import threading

    threading.Event().wait(600)
    return [1.0] * len(completions)


def _slow_second(prompts, completions, **fields):
    if len(completions) > 1:
        raise RuntimeError("batched scoring is broken")
    if completions[0] == "b":
        _hang(prompts, completions)
    return [1.0]


def _exits(prompts, completions, **fields):
    raise SystemExit(3)


def test_reward_timeout_raises_naming_the_reward():
    reward = R.WeightedSum([R.RewardTerm("slow", _hang)], timeout=0.2)
    start = time.monotonic()
    with pytest.raises(R.RewardError, match=r"reward 'slow' did not return within") as e:
        reward(["p", "q"], ["a", "b"])
    assert time.monotonic() - start < 2
    assert "rewards.timeout = 0.2 s" in str(e.value) and e.value.reward == "slow"


def test_reward_timeout_with_on_error_zero_scores_the_unscored_zero():
    fine = R.RewardTerm("fine", lambda p, c, **f: [1.0] * len(c))
    reward = R.WeightedSum([R.RewardTerm("slow", _hang), fine], on_error="zero", timeout=0.2)
    out = reward(["p", "q"], ["a", "b"])
    np.testing.assert_array_equal(out.components["slow"], [0.0, 0.0])
    np.testing.assert_array_equal(out.total_n, [1.0, 1.0])
    assert out.num_errors == {"slow": 2, "fine": 0}
    # One sample alone hangs after the batch raised: the samples before it keep their scores.
    scores, errors = R.checked_call(
        _slow_second, ["p"] * 3, ["a", "b", "c"], name="s", on_error="zero", timeout=0.3
    )
    np.testing.assert_array_equal(scores, [1.0, 0.0, 0.0])
    assert errors == 2


def test_reward_sys_exit_is_a_reward_error():
    for timeout in (None, 5.0):
        reward = R.WeightedSum([R.RewardTerm("quits", _exits)], timeout=timeout)
        with pytest.raises(R.RewardError, match=r"reward 'quits' raised RewardExited") as e:
            reward(["p"], ["a"])
        assert "sys.exit(3)" in str(e.value)
    zero = R.WeightedSum([R.RewardTerm("quits", _exits)], on_error="zero")
    assert zero(["p", "q"], ["a", "b"]).num_errors == {"quits": 2}


def test_reward_without_timeout_runs_in_the_calling_thread():
    import threading

    seen = []
    fn = lambda p, c, **f: seen.append(threading.current_thread()) or [0.0] * len(c)
    R.WeightedSum([R.RewardTerm("t", fn)])(["p"], ["a"])
    R.WeightedSum([R.RewardTerm("t", fn)], timeout=5.0)(["p"], ["a"])
    assert seen[0] is threading.current_thread() and seen[1] is not seen[0]


def test_chat_template_time_is_bounded(monkeypatch):
    from jaxrl_llm import models

    tok = models.load_tokenizer(models.default_model_path())
    fast = tokens.render_prompts(
        ["What is 1 + 1?"], tok, system_prompt=None, chat_template=True, source="t"
    )
    tok.chat_template = _SLOW_TEMPLATE
    monkeypatch.setattr(tokens, "CHAT_TEMPLATE_TIMEOUT", 0.2)
    start = time.monotonic()
    with pytest.raises(DataError, match=r"ran for more than 0\.2 s on one conversation"):
        tokens.render_prompts(["Hi"], tok, system_prompt=None, chat_template=True, source="t")
    assert time.monotonic() - start < 3
    assert len(fast[0]) > 5


def test_reward_timeout_through_the_trainer_config():
    config = load_config(TINY, ["rewards.timeout=0.5", "rewards.on_error=zero"])
    from jaxrl_llm.train.setup import build_reward

    reward = build_reward(config)
    assert reward.timeout == 0.5 and reward.on_error == "zero"
    assert load_config(TINY, ["rewards.timeout=null"]).rewards.timeout is None
    with pytest.raises(ConfigError, match=r"rewards\.timeout = 0"):
        load_config(TINY, ["rewards.timeout=0"])


def test_gguf_metadata_agrees_with_the_gguf_package(tmp_path):
    """The header reader behind the context check and the junk-GGUF error reads what
    ``gguf.GGUFReader`` reads (scalars and strings; arrays skipped), and a cut file is an error."""
    import gguf

    from jaxrl_llm.models import hub
    from jaxrl_llm.models.default import smollm2_gguf_path

    path = smollm2_gguf_path()
    ours = hub._gguf_metadata(path)
    reference = {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items()}
    assert ours["llama.context_length"] == 8192 and ours["general.architecture"] == "llama"
    for key, value in ours.items():
        assert (
            value == pytest.approx(reference[key])
            if isinstance(value, float)
            else (value == reference[key])
        ), key
    skipped = {k for k in reference if not k.startswith("GGUF.")} - set(ours)
    assert skipped and all(isinstance(reference[k], list) for k in skipped)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:4096])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf: not a readable GGUF file \(corrupt"):
        hub._gguf_metadata(cut)


def _exits_in_a_reward() -> None:
    import sys

    sys.exit(0)


@pytest.mark.parametrize("patched", [False, True])
def test_a_reward_exit_is_located_at_its_caller_even_when_sys_exit_is_patched(monkeypatch, patched):
    """wandb replaces ``sys.exit`` with a Python hook once a run has used it (another test in
    the same worker, in the suite): the reported line is still the reward's, not the hook's."""
    import sys

    from jaxrl_llm.train.cli import _raise_site

    if patched:  # on top of wandb's hook when a tracking test ran first in this worker
        earlier = sys.exit

        def exit(code: object = None) -> None:  # what wandb's ExitHooks.exit does
            earlier(code)

        monkeypatch.setattr(sys, "exit", exit)
    try:
        _exits_in_a_reward()
    except SystemExit as e:
        frame = _raise_site(e.__traceback__)
    assert (frame.name, Path(frame.filename).name) == ("_exits_in_a_reward", Path(__file__).name)
