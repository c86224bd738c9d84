"""The README's promises: its install and test commands are the ones CI runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_exactly_the_readme_commands():
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    install, test, main_job = blocks[0], blocks[1], blocks[2]
    ci_lines = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith(("#", "set ", "cd ", "export "))
    ]
    assert ci_lines == [install, test]
    assert main_job.startswith("jaxrl-llm ")


def test_main_job_command_parses_and_its_config_validates():
    """The main job itself takes minutes; here its command line and config are checked."""
    from jaxrl_llm import cli
    from jaxrl_llm.config import load_config

    blocks = _bash_blocks((ROOT / "README.md").read_text())
    args = cli.build_parser().parse_args(blocks[2].split()[1:])
    assert args.command == "train"
    config = load_config(ROOT / args.config, list(args.overrides))
    assert config.algorithm.name == "grpo"


def test_readme_notebook_snippets_run_and_give_the_seed_numbers():
    import numpy as np

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    namespace: dict = {}
    exec(blocks[0] + "\n" + blocks[1], namespace)  # the chain snippets (not the model one)
    np.testing.assert_allclose(namespace["adv_bgt"][0, :, 0], [1.2, -0.5, 2.1], atol=1e-5)
