"""`scripts/bench_head_grad_blocks.py` on the tiny random model, with blocks small enough that
its 12 MiB head takes several: the blocked update's XLA temporaries are lower (by 6.3 MiB when
written), so the benchmark cannot rot. In one micro-batch (the head's own accumulator, over 3
chunks) this model's peak is its logits, and the blocks must not raise it."""

import json

import pytest

from jaxrl_llm.models import logprobs
from tests.scripts import load_script


@pytest.mark.parametrize("rows,seq,micro", [(4, 16, 2), (8, 80, 8)])  # (8, 80, 8): one
def test_bench_head_grad_blocks_on_the_tiny_model(rows, seq, micro, tmp_path, monkeypatch):
    bench = load_script("bench_head_grad_blocks")
    monkeypatch.setattr(logprobs, "HEAD_GRAD_BLOCK_BYTES", 2**20)
    out = tmp_path / "blocks.json"
    argv = ["--models", "tiny-random", "--rows", str(rows), "--seq", str(seq)]
    argv += ["--micro", str(micro)]
    if micro < rows:
        argv += ["--time", "tiny-random", "--time-layers", "1", "--time-rounds", "1"]
    result = bench.main([*argv, "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert "cpu" in result["machine"] and len(result["machine"]["load_avg_after"]) == 3
    (row,) = result["results"]
    one, blocked = row["one_block"], row["blocks"]
    assert (one["vocab_size"], one["hidden_size"]) == (49152, 64)
    assert one["blocks"] == 1 and blocked["blocks"] == 12  # 12 MiB in blocks of 1 MiB
    if micro == rows:
        assert row["saved_mib"] >= 0, row
        return
    assert row["saved_mib"] >= 0.4 * one["head_mib"], row
    (timed,) = result["timed"]
    assert timed["layers"] == 1 and timed["rows"] == 4
    assert [len(v) for v in timed["seconds"].values()] == [1, 1]
