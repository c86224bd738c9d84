"""``jaxrl-llm generate`` through run_generate, on a tiny random model with SmolLM2's tokenizer."""

import argparse
import json

import pytest

from jaxrl_llm.rollout.cli import add_generate_parser, run_generate
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
