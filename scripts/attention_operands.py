"""The attention kernels' operands in a packed 1B update step, lowered for CUDA (no GPU needed).

    python scripts/attention_operands.py --widths 2048,8192,32768 --out /tmp/attention_operands.json

For each packed-row width ``W`` (``optim.micro_batch_tokens``: one row of ``W`` tokens per
micro-batch), the trainer's fused GRPO step of Llama-3.2-1B's shapes (random weights, bf16,
remat full) is lowered for CUDA twice, with ``model.attention=cudnn`` and ``pallas_gpu``, and
the operands of each attention call's forward kernel are read from the StableHLO: cuDNN takes
segments and padding as a dense ``[B, 1, T, S]`` bias, the Pallas kernel as ``[B, T]`` int32
ids (and its key/value heads repeated to the query heads: it has no GQA). The bytes are per
call, i.e. per layer and micro-batch; nothing is compiled or run (XLA:GPU's own buffers need
the GPU). cuDNN's trace-time checks ask the installed cuDNN and GPU; they are answered for an
H200 (cuDNN 9.8, sm_90), as ``tests/test_gpu_lowering.py`` does.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_1B = str(ROOT / "configs" / "models" / "llama-3.2-1b")
KERNELS = {"cudnn": r"__cudnn\$fmhaScaleBiasSoftmax", "pallas_gpu": r"__gpu\$xla\.gpu\.triton"}
BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "i1": 1, "ui8": 1}


def _answer_cudnn_checks_for_an_h200() -> None:
    from jax._src.cudnn import fused_attention_stablehlo as fa

    def capability(c: str) -> tuple[int, ...]:
        return tuple(int(x) for x in c.split("."))

    fa.check_cudnn_version = lambda: 90800
    fa.check_compute_capability = lambda c: capability(c) <= (9, 0)
    fa.is_cuda_compute_capability_equal = lambda c: capability(c) == (9, 0)


def forward_operands(attention: str, width: int) -> list[dict]:
    """The first forward attention call's operands: shape, dtype, bytes."""
    import jax

    from jaxrl_llm.config import build_recipe, load_config
    from jaxrl_llm.models import sharding as shd
    from jaxrl_llm.train import plan as P

    prompt = 64
    config = load_config(
        str(ROOT / "configs" / "tiny.yaml"),
        [
            f"model.path={LLAMA_1B}",
            "model.dtype=bfloat16",
            "model.remat=full",
            f"model.attention={attention}",
            "rollout.prompts_per_step=1",
            "rollout.num_samples=2",
            f"data.max_prompt_length={prompt}",
            f"rollout.max_new_tokens={width - prompt}",
            f"optim.micro_batch_tokens={width}",
        ],
    )
    recipe = build_recipe(config)
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    run = P.abstract_run(config, recipe, mesh, P.model_config(config.model, accelerator=True))
    text = P.lower_step(run, config, recipe, platform="gpu", lowering_platforms=("cuda",)).as_text()
    call = next(
        line
        for line in text.splitlines()
        if re.search(rf"custom_call @{KERNELS[attention]}\(", line)
        and (attention == "cudnn" or "mha_forward" in line)
    )
    operands = []
    for dims, dtype in re.findall(
        r"tensor<([0-9x]+)x(\w+)>", call.split(" : (")[-1].split("->")[0]
    ):
        shape = [int(d) for d in dims.split("x")]
        size = BYTES[dtype]
        for d in shape:
            size *= d
        operands.append({"shape": shape, "dtype": dtype, "bytes": size})
    return operands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="2048,8192,32768", help="packed row widths, tokens")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    _answer_cudnn_checks_for_an_h200()
    results = []
    for width in (int(w) for w in args.widths.split(",")):
        for attention in KERNELS:
            operands = forward_operands(attention, width)
            mask = operands[3]  # q, k, v, then the bias (cuDNN) or the segment ids (Pallas)
            row = {
                "width": width,
                "attention": attention,
                "operands": operands,
                "mask_bytes": mask["bytes"],
                "qkv_bytes": sum(o["bytes"] for o in operands[:3]),
            }
            results.append(row)
            print(
                f"W={width:6d} {attention:10s} mask {mask['shape']} {mask['dtype']}: "
                f"{mask['bytes'] / 2**20:9.3f} MiB; q+k+v {row['qkv_bytes'] / 2**20:8.1f} MiB",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
