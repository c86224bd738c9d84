"""``jaxrl-llm generate`` through run_generate, on a tiny random model with SmolLM2's tokenizer."""

import argparse
import json
from pathlib import Path

import pytest

from jaxrl_llm.rollout.cli import add_generate_parser, run_generate, sampling_settings
from tests.models import hf_tiny


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, smollm2_tokenizer):
    path = tmp_path_factory.mktemp("cli_model")
    hf_tiny.build_hf("smollm2", vocab_size=len(smollm2_tokenizer)).save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    return path


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="jaxrl-llm")
    add_generate_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["generate", *argv])


def test_generate_prints_every_completion(tiny_checkpoint, capsys):
    args = parse(
        "--model",
        str(tiny_checkpoint),
        "--prompt",
        "What is 2 + 3?",
        "--prompt",
        "Hi",
        "--num-samples",
        "2",
        "--max-new-tokens",
        "8",
        "--temperature",
        "1.0",
        "--json",
    )
    assert args.func is run_generate
    assert run_generate(args) == 0
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in out.splitlines()]
    assert [(r["prompt"], r["sample"]) for r in records] == [
        ("What is 2 + 3?", 0),
        ("What is 2 + 3?", 1),
        ("Hi", 0),
        ("Hi", 1),
    ]
    assert all(isinstance(r["completion"], str) and 1 <= r["num_tokens"] <= 8 for r in records)
    assert "new tokens" in err
    args = parse(
        "--model",
        str(tiny_checkpoint),
        "--prompt",
        "Hi",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
    )
    assert run_generate(args) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("### prompt 1/1: Hi\n")


def test_generate_reports_bad_arguments(tiny_checkpoint, tmp_path, capsys):
    assert run_generate(parse("--model", str(tmp_path / "missing"), "--prompt", "Hi")) == 2
    assert "cannot load model" in capsys.readouterr().err
    run = tmp_path / "run"  # a training run's folder given as the model: where its model is
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("{}")
    assert run_generate(parse("--model", str(run), "--prompt", "Hi")) == 2
    said = f"is a training run's folder: `jaxrl-llm export --run-dir {run}` writes"
    assert said in capsys.readouterr().err
    (run / "export").symlink_to(tiny_checkpoint)
    assert run_generate(parse("--model", str(run), "--prompt", "Hi")) == 2
    assert f"its exported model is --model {run / 'export'}" in capsys.readouterr().err
    args = parse("--model", str(tiny_checkpoint), "--prompt", "Hi", "--max-new-tokens", "0")
    assert run_generate(args) == 2
    assert "--max-new-tokens 0: expected an integer ≥ 1" in capsys.readouterr().err
    args = parse("--model", str(tiny_checkpoint), "--prompt", "Hi", "--top-p", "1.5")
    assert run_generate(args) == 2
    assert "--top-p 1.5: expected a number in (0, 1]" in capsys.readouterr().err


def test_generate_engines_agree_and_the_choices_are_the_libraries(tiny_checkpoint, capsys):
    from jaxrl_llm.rollout import engine, pages

    greedy = ("--model", str(tiny_checkpoint), "--prompt", "Hi", "--prompt", "What is 2 + 3?")
    greedy += ("--max-new-tokens", "6", "--temperature", "0", "--json")
    texts = {}
    for name in ("static", "paged", "auto"):
        assert run_generate(parse(*greedy, "--engine", name)) == 0
        texts[name] = [
            json.loads(line)["completion"] for line in capsys.readouterr().out.split("\n") if line
        ]
    assert texts["static"] == texts["paged"] == texts["auto"]
    # Loaded sharded over the 8 devices and sampled on 4 two-device engines: the same text.
    assert run_generate(parse(*greedy, "--tensor-parallel", "2")) == 0
    out = capsys.readouterr().out
    assert [json.loads(line)["completion"] for line in out.split("\n") if line] == texts["auto"]
    for bad, said in (("-1", "expected an integer ≥ 0"), ("3", "dividing the parameters' mesh")):
        assert run_generate(parse(*greedy, "--tensor-parallel", bad)) == 2
        assert said in capsys.readouterr().err
    assert run_generate(parse(*greedy, "--tensor-parallel", "2", "--engine", "static")) == 2
    assert "drop --engine static" in capsys.readouterr().err
    assert parse(*greedy).engine == "auto" and parse(*greedy).paged_attention == "auto"
    parser = argparse.ArgumentParser(prog="jaxrl-llm")
    sub = add_generate_parser(parser.add_subparsers(dest="command", required=True))
    choices = {a.dest: a.choices for a in sub._actions if a.choices}
    assert tuple(sorted(choices["engine"])) == tuple(sorted(engine.ENGINES))
    assert tuple(sorted(choices["paged_attention"])) == tuple(sorted(pages.ATTENTION_BACKENDS))
    with pytest.raises(SystemExit):
        parse(*greedy, "--engine", "vllm")


def test_sampling_defaults_come_from_the_generation_config_as_in_transformers():
    where = Path("/m/generation_config.json")
    plain = parse("--prompt", "Hi")

    def settings(generation, *argv, at=where):
        got = sampling_settings(parse("--prompt", "Hi", *argv), generation, at)
        return got if isinstance(got, str) else got[:3]

    # No file, or one that does not set do_sample: greedy, as transformers' generate.
    assert settings({}, at=None) == (0.0, 0, 1.0)
    assert sampling_settings(plain, {}, None).said == "greedy (no generation_config.json)"
    assert settings({"temperature": 0.7, "do_sample": False}) == (0.0, 0, 1.0)
    # do_sample: its values, transformers' defaults (1.0, 50, 1.0) for those it leaves out.
    llama = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}
    assert settings(llama) == (0.6, 50, 0.9)
    said = sampling_settings(plain, llama, where).said
    assert said == f"temperature 0.6, top-k 50, top-p 0.9 (temperature, top-k, top-p from {where})"
    assert settings({"do_sample": True}) == (1.0, 50, 1.0)
    # Flags win, each on its own; --temperature 0 is greedy whatever the file says.
    assert settings(llama, "--top-k", "0", "--temperature", "1.2") == (1.2, 0, 0.9)
    assert settings(llama, "--temperature", "0") == (0.0, 50, 0.9)
    assert settings({}, "--temperature", "0.5", at=None) == (0.5, 0, 1.0)
    # A greedy default with several samples would repeat one completion: refused, with the fix.
    refused = settings({}, "--num-samples", "3")
    assert refused.startswith("--num-samples 3: this model's default is greedy")
    assert refused.endswith("pass --temperature (e.g. 1.0) to sample")
    assert settings({}, "--num-samples", "3", "--temperature", "0") == (0.0, 0, 1.0)
    # What the sampler has no counterpart for is named; bad values name the file.
    qwen = {"do_sample": True, "temperature": 0.7, "top_k": 20, "repetition_penalty": 1.05}
    said = sampling_settings(plain, qwen, where).said
    assert said.endswith("; not applied from generation_config.json: repetition_penalty 1.05")
    for bad in ({"top_p": 0}, {"temperature": "hot"}, {"top_k": 2.5}, {"temperature": True}):
        message = settings({"do_sample": True, **bad})
        assert isinstance(message, str) and message.startswith(f"{where}: ")


def test_generate_samples_as_the_checkpoint_says_and_stops_at_its_eos_ids(
    tiny_checkpoint, tmp_path, capsys, monkeypatch
):
    import shutil

    from jaxrl_llm.rollout import engine

    calls = []

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return generate(*args, **kwargs)

    generate = engine.generate
    monkeypatch.setattr(engine, "generate", recording)
    folder = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, folder)
    base = ("--model", str(folder), "--prompt", "Hi", "--max-new-tokens", "6", "--json")
    # transformers' own generation_config.json for this model sets no do_sample: greedy.
    assert json.loads((folder / "generation_config.json").read_text()).get("do_sample") is None
    assert run_generate(parse(*base)) == 0
    out, err = capsys.readouterr()
    assert f"sampling: greedy ({folder / 'generation_config.json'} does not set do_sample)" in err
    assert run_generate(parse(*base, "--temperature", "0")) == 0
    assert capsys.readouterr().out == out
    assert calls[0]["temperature"] == 0.0 and calls[0]["stop_token_ids"] == [2]
    # A checkpoint that samples, and lists another end-of-turn id.
    sampling = {"do_sample": True, "temperature": 0.7, "top_k": 20, "eos_token_id": [2, 9]}
    (folder / "generation_config.json").write_text(json.dumps(sampling))
    assert run_generate(parse(*base, "--num-samples", "2")) == 0
    err = capsys.readouterr().err
    assert "sampling: temperature 0.7, top-k 20, top-p 1 (temperature, top-k, top-p from" in err
    last = calls[-1]
    assert (last["temperature"], last["top_k"], last["top_p"]) == (0.7, 20, 1.0)
    assert last["stop_token_ids"] == [2, 9]
    (folder / "generation_config.json").write_text("{")
    assert run_generate(parse(*base)) == 2
    assert "generation_config.json: not valid JSON (Expecting" in capsys.readouterr().err
