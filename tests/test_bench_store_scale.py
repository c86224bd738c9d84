"""`scripts/bench_store_scale.py` on three processes: both ways of reading the store return every
process's values in process order (the script checks), so the benchmark cannot rot."""

import json

from tests.scripts import load_script


def test_bench_store_scale_three_processes(tmp_path):
    bench = load_script("bench_store_scale")
    out = tmp_path / "store.json"
    result = bench.main(["--processes", "3", "--rounds", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert "cpu" in result and len(result["load_avg_after"]) == 3
    (row,) = result["rows"]
    assert row["processes"] == 3
    assert row["host_allgather"]["requests_per_call"] == 12  # 4 a process
    assert row["per_key"]["requests_per_call"] == 12  # N·(N+1): equal at 3, 4·N < N·(N+1) after
    for way in ("host_allgather", "per_key"):
        assert row[way]["median_ms_process_0"] > 0
