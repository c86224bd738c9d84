"""The notebook `examples/signal_chain.py` runs (its own asserts check the seed's numbers),
draws its plot, and is a valid jupytext notebook."""

import os
import pathlib
import subprocess
import sys

import jupytext
import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "signal_chain.py"


def test_notebook_runs_and_saves_its_plot(tmp_path):
    plot = tmp_path / "signal_chain.png"
    env = dict(os.environ)
    env.update(
        MPLBACKEND="Agg",
        SIGNAL_CHAIN_PLOT=str(plot),
        JAX_PLATFORMS="cpu",
        JAX_NUMPY_RANK_PROMOTION="raise",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
    )
    # One CPU device is enough (the suite's 8 fake ones are not needed); its other XLA flags
    # (tests/conftest.py: faster compiles) are kept.
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
    proc = subprocess.run(
        [sys.executable, str(NOTEBOOK)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "answer A: baseline 7.80, advantage +0.40" in proc.stdout
    assert "answer B: baseline 8.65, advantage -2.15" in proc.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.stat().st_size > 20_000


def test_notebook_is_a_valid_jupytext_notebook():
    notebook = jupytext.read(NOTEBOOK)
    nbformat.validate(notebook)
    kinds = [cell.cell_type for cell in notebook.cells]
    assert kinds[0] == "markdown" and kinds.count("markdown") >= 6 and kinds.count("code") >= 10
    assert notebook.metadata["jupytext"]["formats"] == "py:percent"
    assert not (ROOT / "examples" / "signal_chain.ipynb").exists()  # the .py is the notebook
