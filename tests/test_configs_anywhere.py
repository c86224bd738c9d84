"""The shipped configs: ``--config NAME`` from any directory, ``jaxrl-llm configs``, the wheel.

The top-level ``configs/`` is the single source; ``jaxrl_llm/configs`` is a symlink to it that
the build follows, so a wheel carries the YAML files as plain package data.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from jaxrl_llm import cli
from jaxrl_llm.config import (
    ConfigError,
    describe_configs,
    load_config,
    resolve_config,
    shipped_configs,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
ALL_NAMES = sorted(
    p.relative_to(CONFIGS).with_suffix("").as_posix() for p in CONFIGS.rglob("*.yaml")
)


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """A working directory with no configs/ in it."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("name", ["quickstart", "algorithms/grpo", "tiny", "algorithms/dpo"])
def test_a_name_loads_the_shipped_config_from_any_directory(elsewhere, name):
    assert not (elsewhere / "configs").exists()
    assert load_config(name) == load_config(CONFIGS / f"{name}.yaml")
    # the includes (`base: ../quickstart.yaml` -> `base: base.yaml`) resolve inside the package
    assert load_config(name, ["optim.lr=3e-6"]).optim.lr == 3e-6


def test_experiment_names_resolve_through_two_includes(elsewhere):
    name = "experiments/qwen2.5-1.5b-gsm8k-tpu-v5e-8"
    overrides = ["model.path=tiny-random"]
    assert load_config(name, overrides) == load_config(CONFIGS / f"{name}.yaml", overrides)


def test_every_config_in_the_checkout_is_shipped_under_its_name():
    assert sorted(shipped_configs()) == ALL_NAMES
    assert list(shipped_configs())[:3] == ["base", "quickstart", "tiny"]  # top level first
    for name, path in shipped_configs().items():
        assert path.read_bytes() == (CONFIGS / f"{name}.yaml").read_bytes()


def test_the_package_folder_is_a_link_to_the_top_level_configs():
    link = ROOT / "jaxrl_llm" / "configs"
    assert link.is_symlink()
    assert os.readlink(link) == "../configs"
    assert link.resolve() == CONFIGS.resolve()


def test_an_existing_path_wins_over_a_shipped_name(elsewhere):
    (elsewhere / "quickstart").write_text("base: tiny.yaml\n", encoding="utf-8")
    shutil.copy(CONFIGS / "tiny.yaml", elsewhere / "tiny.yaml")
    shutil.copy(CONFIGS / "base.yaml", elsewhere / "base.yaml")
    assert resolve_config("quickstart") == Path("quickstart")
    assert load_config("quickstart") == load_config(CONFIGS / "tiny.yaml")
    assert resolve_config(Path("tiny.yaml")) == Path("tiny.yaml")


def test_an_unknown_name_lists_the_names_and_suggests_the_closest(elsewhere):
    with pytest.raises(ConfigError) as e:
        load_config("quikstart")
    message = str(e.value)
    assert "'quikstart'" in message
    assert "did you mean 'quickstart'?" in message
    assert "algorithms/grpo" in message and "tiny" in message
    with pytest.raises(ConfigError, match="did you mean 'algorithms/grpo'"):
        load_config("algorithms/grpoo")


def test_a_missing_yaml_path_points_at_the_shipped_name(elsewhere):
    with pytest.raises(ConfigError, match=r"not found: configs/quickstart.yaml.*'quickstart'"):
        load_config("configs/quickstart.yaml")
    with pytest.raises(ConfigError, match=r"config file not found: nowhere\.yaml"):
        load_config("nowhere.yaml")


def test_descriptions_are_the_first_comment_lines():
    described = describe_configs()
    assert described["base"].startswith("Every knob of a jaxrl_llm training run")
    assert described["algorithms/grpo"].startswith("GRPO (Shao et al. 2024")
    assert all(not d.startswith("#") for d in described.values())


def test_configs_subcommand_lists_names_with_descriptions(elsewhere, capsys):
    assert cli.main(["configs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    by_name = {line.split()[0]: line for line in lines}
    assert sorted(by_name) == ALL_NAMES
    assert "Quickstart: GRPO teaches SmolLM2-135M-Instruct" in by_name["quickstart"]
    assert cli.main(["configs", "--path", "algorithms/grpo"]) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert printed.read_bytes() == (CONFIGS / "algorithms" / "grpo.yaml").read_bytes()
    assert cli.main(["configs", "--path", "quikstart"]) == 2
    assert "did you mean 'quickstart'?" in capsys.readouterr().err


def test_train_takes_a_name_from_any_directory(elsewhere, capsys):
    # --max-steps 0 is refused right after the config loaded: the name resolved, nothing trained
    argv = ["train", "--config", "tiny", "--run-dir", str(elsewhere / "r"), "--max-steps", "0"]
    assert cli.main(argv) == 2
    assert "--max-steps 0" in capsys.readouterr().err
    assert cli.main(["train", "--config", "tinyy", "--run-dir", "r"]) == 2
    assert "did you mean 'tiny'?" in capsys.readouterr().err
    train = cli.build_parser()._subparsers._group_actions[0].choices["train"]
    help_text = " ".join(train.format_help().split())
    assert "quickstart" in help_text and "jaxrl-llm configs" in help_text


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out.extend(_parsers(sub))
    return out


def test_no_parser_accepts_abbreviations():
    parsers = _parsers(cli.build_parser())
    names = {p.prog.split()[-1] for p in parsers}
    assert {"jaxrl-llm", "train", "evaluate", "export", "generate", "explain", "configs"} <= names
    assert [p.prog for p in parsers if p.allow_abbrev] == []


def test_evaluate_with_an_abbreviated_flag_is_an_error_naming_it(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["evaluate", "--n", "4", "--run-dir", "r"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" in err and "--n" in err
    with pytest.raises(SystemExit):
        cli.main(["train", "--config", "tiny", "--run-dir", "r", "--max-s", "1"])
    assert "--max-s" in capsys.readouterr().err


def _build_wheel(tmp_path: Path) -> Path:
    """Builds the wheel from a copy of the sources (the checkout's build/ stays untouched)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(CONFIGS, src / "configs")
    shutil.copytree(
        ROOT / "jaxrl_llm",
        src / "jaxrl_llm",
        symlinks=True,  # the configs link stays a link, as in the checkout
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    offline = all(importlib.util.find_spec(m) for m in ("setuptools", "wheel"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "w")]
    cmd += ["--no-build-isolation"] if offline else []
    done = subprocess.run([*cmd, str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "w").glob("jaxrl_llm-*.whl")
    return wheel


def test_the_wheel_ships_the_configs_and_they_load_from_elsewhere(tmp_path):
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        shipped = {
            n.removeprefix("jaxrl_llm/configs/"): z.read(n)
            for n in z.namelist()
            if n.startswith("jaxrl_llm/configs/")
        }
    expected = {p.relative_to(CONFIGS).as_posix(): p.read_bytes() for p in CONFIGS.rglob("*.yaml")}
    assert shipped == expected  # plain files with the sources' bytes, nothing else

    # A plain (non-editable) install, then names resolved from a directory without configs/.
    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site)]
    done = subprocess.run([*install, str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    script = textwrap.dedent(
        """
        import importlib.resources, jaxrl_llm
        from jaxrl_llm.config import load_config, resolve_config
        root = importlib.resources.files("jaxrl_llm") / "configs"
        assert str(root).startswith({site!r}) and not root.is_symlink(), root
        assert str(resolve_config("algorithms/grpo")).startswith({site!r})
        assert load_config("algorithms/grpo").algorithm.name == "grpo"
        assert load_config("quickstart").rollout.num_samples >= 2
        print("ok", jaxrl_llm.__file__)
        """
    ).format(site=str(site))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}  # before site-packages (and any editable copy)
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"ok {site}")
