"""scripts/capacity_table.py: each row's `jaxrl-llm plan` command, and its markdown row read
back from the plan's JSON (a tiny plan here; the real rows take minutes each)."""

import importlib.util
import json
import pathlib

import pytest

from jaxrl_llm.config import load_config
from jaxrl_llm.train import plan as P
from tests.scripts import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def table():
    return load_script("capacity_table")


def test_commands_name_the_target_the_model_and_the_method(table):
    tpu = table.command("qwen2.5-7b", "v5p-32", 16, "qlora")
    assert tpu[tpu.index("--topology") + 1] == "v5p-32" and "--devices" not in tpu
    assert f"model.path={ROOT / 'configs' / 'models' / 'qwen2.5-7b'}" in tpu
    assert {
        "optim.micro_batch_size=16",
        "model.lora.quantize=nf4",
        "--json",
        "--no-suggest",
    } <= set(tpu)
    gpu = table.command("llama-3.1-8b", "8xH200", 8, "full")
    assert (
        gpu[gpu.index("--devices") + 1] == "8" and gpu[gpu.index("--device-memory") + 1] == "141GB"
    )
    assert not any(a.startswith("model.lora") for a in gpu)
    tp = table.command("llama-3.1-70b", "v5p-128", 64, "full", ("rollout.tensor_parallel=4",))
    assert tp[-1] == "rollout.tensor_parallel=4" and tp[:-1] == table.command(
        "llama-3.1-70b", "v5p-128", 64, "full"
    )


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed")
def test_a_markdown_row_is_the_plans_figures(table):
    config = load_config("configs/tiny.yaml", ["mesh.preset=fsdp", "mesh.data=1", "mesh.fsdp=4"])
    plan = json.loads(json.dumps(P.plan_run(config, P.parse_target("v5e:2x2")).to_dict()))
    cells = table.markdown("qwen2.5-7b", "v5e-16", plan, 12.3, "full").strip("| ").split(" | ")
    b = plan["per_device_bytes"]
    state = sum(b[k]["per_device"] for k in ("parameters", "optimizer", "reference"))
    assert cells[:3] == ["Qwen2.5-7B", "v5e-16", "fsdp=4"]
    assert cells[3] == f"{state / 2**30:.2f} GiB"
    assert cells[7] == f"{b['peaks']['rollout'] / 2**30:.2f} GiB"
    assert cells[10].startswith("FITS (+") and cells[-1] == "12 s"
    lora = table.markdown("qwen2.5-7b", "8xH200", plan, 1.0, "lora").strip("| ").split(" | ")
    assert lora[1:3] == ["8×H200 141 GB (estimate)", "LoRA r16"]
