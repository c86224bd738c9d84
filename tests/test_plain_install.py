"""What a plain install (``pip install jaxrl_llm``, no ``test`` extra) can do: torch, gguf and
accelerate are test and benchmark dependencies only (transformers' GGUF loader and the parity
tests need them), so the trainer must run without them once the default model is converted.

The child process hides the three packages (``sys.modules[name] = None``: ``import`` raises and
``importlib.util.find_spec`` answers None, as for a package that is not installed), then runs
``jaxrl-llm train`` on the tiny config, whose tokenizer is the converted default model's.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

from jaxrl_llm.models.weights import GGUF_LOADER_PACKAGES

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_the_trainer_runs_without_torch_gguf_or_accelerate(smollm2_path, tmp_path):
    run_dir = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import sys
        hidden = {tuple(GGUF_LOADER_PACKAGES)!r}
        for name in hidden:
            sys.modules[name] = None
        from jaxrl_llm.cli import main
        argv = ["train", "--config", {str(CONFIGS / "tiny.yaml")!r}, "--run-dir", {str(run_dir)!r},
                "--max-steps", "1", "--no-progress", "data.eval_size=0"]
        status = main(argv)
        loaded = sorted(n for n in hidden if sys.modules.get(n))
        print("status", status, "loaded", loaded)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "status 0 loaded []" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert (run_dir / "metrics.jsonl").exists()
