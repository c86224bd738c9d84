"""The README's Security section, claim by claim.

* Weights and checkpoints are never unpickled by default: a ``.bin``-only folder is refused
  without ``allow_pickle`` (and even with it torch loads ``weights_only``); checkpoints hold no
  pickles.
* ``trust_remote_code`` is off unless asked for: every transformers ``from_pretrained`` call in
  the package passes it explicitly, ``False`` except the tokenizer's ``model.trust_remote_code``.
* Reward functions are imported only from the config the user wrote.
* Nothing from a dataset (or a config file) is ever evaluated as code.
"""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.config import ConfigError, ModelLoadConfig, load_config
from jaxrl_llm.train import models as train_models
from jaxrl_llm.train import setup as train_setup

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
MARKER_MODULE = "jaxrl_security_marker"


@pytest.fixture(scope="module")
def pickled_folder(tmp_path_factory):
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("pickled")
    config.save_pretrained(folder)
    torch.save(transformers.LlamaForCausalLM(config).state_dict(), folder / "pytorch_model.bin")
    return folder


# ---------------------------------------------------------------------------------------------
# No unpickling by default.


def test_bin_weights_are_refused_without_the_flag(pickled_folder, monkeypatch):
    import torch

    calls = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k) or real_load(*a, **k))
    with pytest.raises(models.UnsafeCheckpointError, match="allow_pickle"):
        models.from_pretrained(pickled_folder)
    assert calls == []  # refused before anything was read
    with pytest.raises(models.UnsafeCheckpointError, match=r"model\.allow_pickle"):
        model = ModelLoadConfig(path=str(pickled_folder))
        train_models.load_policy(model.path, allow_pickle=model.allow_pickle)
    assert calls == []
    models.from_pretrained(pickled_folder, allow_pickle=True)
    assert calls and all(k.get("weights_only") is True for k in calls)


def test_checkpoints_hold_no_pickles(tmp_path):
    from jaxrl_llm.train.checkpoint import Checkpointer
    from jaxrl_llm.train.state import TrainState

    state = TrainState(
        step=np.int32(1),
        params={"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
        opt_state={"mu": np.zeros(3, np.float32)},
        rng=np.zeros(2, np.uint32),
        kl_state={},
        data_position=np.zeros(2, np.int32),
    )
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, state, meta={"data": {"epoch": 0}})
    files = [p for p in (tmp_path / "ckpt").rglob("*") if p.is_file()]
    assert files
    for path in files:
        head = path.read_bytes()[:2]
        # every pickle protocol >= 2 starts with PROTO (0x80) and the protocol number
        assert not (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")), path


# ---------------------------------------------------------------------------------------------
# trust_remote_code.


def _from_pretrained_calls() -> list[tuple[str, ast.Call]]:
    calls = []
    for path in sorted((ROOT / "jaxrl_llm").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "from_pretrained"
            ):
                receiver = ast.unparse(node.func.value)
                if receiver != "models":  # jaxrl_llm.models.from_pretrained: our own loader
                    calls.append((f"{path.relative_to(ROOT)}:{node.lineno} {receiver}", node))
    return calls


def test_every_transformers_call_passes_trust_remote_code_explicitly():
    calls = _from_pretrained_calls()
    assert len(calls) >= 4  # AutoConfig, AutoTokenizer, the GGUF model, the default model
    for where, call in calls:
        kwargs = {k.arg: k.value for k in call.keywords}
        assert "trust_remote_code" in kwargs, where
        value = kwargs["trust_remote_code"]
        if isinstance(value, ast.Constant):
            assert value.value is False, where
        else:  # the tokenizer's: its own parameter, False by default (checked below)
            assert ast.unparse(value) == "trust_remote_code", where
    package = "\n".join(p.read_text() for p in (ROOT / "jaxrl_llm").rglob("*.py"))
    assert "trust_remote_code=True" not in package


def test_trust_remote_code_is_false_unless_the_config_asks(pickled_folder, monkeypatch):
    import transformers

    seen = []
    for cls in (transformers.AutoTokenizer, transformers.AutoConfig):
        real = cls.from_pretrained

        def record(*args, _real=real, _name=cls.__name__, **kwargs):
            seen.append((_name, kwargs.get("trust_remote_code")))
            return _real(*args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", record)
    train_setup.load_tokenizer(ModelLoadConfig(path="tiny-random"))
    models.from_pretrained(pickled_folder, allow_pickle=True)
    # (AutoTokenizer also reads the config through AutoConfig, passing the flag on)
    assert {name for name, _ in seen} == {"AutoTokenizer", "AutoConfig"}
    assert {flag for _, flag in seen} == {False}
    assert ModelLoadConfig().trust_remote_code is False
    seen.clear()
    train_setup.load_tokenizer(ModelLoadConfig(path="tiny-random", trust_remote_code=True))
    assert ("AutoTokenizer", True) in seen


# ---------------------------------------------------------------------------------------------
# Code comes only from the user's config; data is data.


@pytest.fixture
def marker_module(tmp_path, monkeypatch):
    """A module that leaves a file behind when imported."""
    marker = tmp_path / "imported"
    (tmp_path / f"{MARKER_MODULE}.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "def score(prompts, completions, **fields):\n"
        "    return [1.0] * len(completions)\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, MARKER_MODULE, raising=False)
    yield marker
    sys.modules.pop(MARKER_MODULE, None)


def test_dataset_rows_are_text_never_code(tmp_path, marker_module):
    code = f"__import__({MARKER_MODULE!r}); import os; os.system('touch {marker_module}')"
    spec = f"{MARKER_MODULE}:score"
    rows = [
        {"prompt": code, "answer": "41", "reward": spec},
        {"prompt": "{{ 7 * 6 }} ${7 * 6} !!python/object/apply:os.system", "answer": "42"},
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    config = load_config(
        TINY, ["data.source=file", f"data.path={data}", "data.eval_size=0", "data.shuffle=false"]
    )
    tokenizer = train_setup.load_tokenizer(config.model)
    run_data = train_setup.build_data(config, tokenizer)
    reward = train_setup.build_reward(config)  # the config's own rewards: integer_answer
    prompts, answers = run_data.train.prompts, run_data.train.fields["answer"]
    assert prompts[0] == code and run_data.train.fields["reward"][0] == spec  # verbatim text
    assert prompts[1].startswith("{{ 7 * 6 }}")
    out = reward(prompts, ["42", "42"], answer=answers)
    np.testing.assert_array_equal(out.components["integer_answer"], [0.0, 1.0])
    assert not marker_module.exists() and MARKER_MODULE not in sys.modules


def test_a_reward_function_is_imported_only_when_the_config_names_it(marker_module):
    train_setup.build_reward(load_config(TINY))
    assert not marker_module.exists() and MARKER_MODULE not in sys.modules
    config = load_config(TINY, [f"rewards.terms=[{{type: '{MARKER_MODULE}:score'}}]"])
    reward = train_setup.build_reward(config)
    assert marker_module.exists() and reward.names == ("score",)


def test_config_files_are_read_with_a_safe_loader(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.yaml"
    path.write_text(
        f"base: {TINY}\nrun_dir: !!python/object/apply:os.system ['touch {marker}']\n",
        encoding="utf-8",
    )
    with pytest.raises(ConfigError, match=r"evil\.yaml:2"):
        load_config(path)
    assert not marker.exists()
