"""``jaxrl-llm train | evaluate | export``: the trainer's subcommands.

Wire them into the main parser with ``add_train_parsers(subparsers)``::

    jaxrl-llm train --config FILE --run-dir DIR [--max-steps N] [dotted.key=value ...]
    jaxrl-llm evaluate --run-dir DIR [--config FILE] [--mode greedy|sampled] [key=value ...]
    jaxrl-llm export --run-dir DIR [--config FILE] [--out DIR] [--critic] [key=value ...]

Re-running ``train`` on a directory with checkpoints resumes; ``--overwrite`` starts over (a
directory that holds a run without a usable checkpoint is refused without it; one writer per
run directory, see :mod:`jaxrl_llm.train.rundir`). SIGTERM / SIGINT save a checkpoint after the
current step and exit 143 / 130 (:mod:`jaxrl_llm.train.faults`); a second Ctrl-C exits 130 at
once. ``evaluate`` and ``export`` read
``RUN_DIR/config.yaml`` (written by ``train``) unless ``--config`` is given. A config error
prints the message and exits with status 2.

All three take the multi-process flags (``--coordinator``, ``--num-processes``, ``--process-id``,
``--distributed``, and JAX's ``--heartbeat-timeout`` / ``--init-timeout``; docs/scaling.md):
every process runs the same command, and process 0 alone prints and writes files.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable


def _load(args: argparse.Namespace, *, need_config: bool):
    from jaxrl_llm.config import load_config
    from jaxrl_llm.train.loop import CONFIG_FILE
    from jaxrl_llm.train.rundir import run_dir_path

    path = args.config
    run_dir_path(args.run_dir)  # `--run-dir ""`: an error, not the current directory
    if path is None:
        saved = Path(args.run_dir) / CONFIG_FILE
        if not need_config and not Path(args.run_dir).exists():
            raise FileNotFoundError(
                f"--run-dir {args.run_dir}: no such folder (give a run's folder, which holds "
                f"its {CONFIG_FILE}, or --config FILE)"
            )
        if need_config or not saved.exists():
            raise FileNotFoundError(
                f"give --config FILE{'' if need_config else f' (no {saved} to read)'}"
            )
        path = saved
    return load_config(path, list(args.overrides))


def _input_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message is for the user (config, files, models, rewards, run directory,
    a checkpoint that cannot be written): printed without a traceback, exit status 2."""
    from jaxrl_llm.config import ConfigError
    from jaxrl_llm.data import DataError
    from jaxrl_llm.distributed import DistributedError
    from jaxrl_llm.models import ModelLoadError, UnsafeCheckpointError, UnsupportedModelError
    from jaxrl_llm.rewards import RewardConfigError, RewardError
    from jaxrl_llm.train.checkpoint import CheckpointMismatchError, CheckpointSaveError
    from jaxrl_llm.train.faults import NonFiniteUpdateError
    from jaxrl_llm.train.rundir import RunDirError
    from jaxrl_llm.train.tracking import TrackerError

    return (
        ConfigError,
        FileNotFoundError,
        DataError,
        UnsupportedModelError,
        UnsafeCheckpointError,
        ModelLoadError,  # a broken model folder: the path, the file and what is wrong
        RewardConfigError,
        RewardError,
        CheckpointMismatchError,
        CheckpointSaveError,  # disk full: the message names the step and the intact checkpoint
        DistributedError,  # the multi-process flags: the message names the flag or variable
        RunDirError,  # the run directory or --out: what is wrong with it and what to do
        NonFiniteUpdateError,  # NaN / inf update (on_nonfinite: raise): nothing of it written
        TrackerError,  # logging.wandb / logging.trackio: not installed, or wandb.init failed
    )


def _run(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def wrapped(args: argparse.Namespace) -> int:
        from jaxrl_llm.train.faults import TrainingInterrupted

        try:
            return fn(args)
        except TrainingInterrupted as e:  # SIGTERM / SIGINT: the checkpoint is saved
            print(f"jaxrl-llm {args.command}: {e}", file=sys.stderr)
            return e.exit_status
        except KeyboardInterrupt:  # Ctrl-C outside the loop, or twice: nothing more is saved
            print(
                f"\njaxrl-llm {args.command}: interrupted (Ctrl-C); the run directory keeps its "
                "newest complete checkpoint; rerun the command to resume",
                file=sys.stderr,
            )
            return 130
        except _input_errors() as e:
            print(f"jaxrl-llm {args.command}: {e}", file=sys.stderr)
            cause = e.__cause__
            if cause is not None and cause.__traceback__ is not None and hasattr(e, "reward"):
                frame = _raise_site(cause.__traceback__)
                print(
                    f"  ({type(cause).__name__} raised at {frame.filename}:{frame.lineno}, "
                    f"in {frame.name})",
                    file=sys.stderr,
                )
            return 2

    return wrapped


def _raise_site(tb: Any) -> traceback.FrameSummary:
    """The innermost frame of ``tb``, less the frames of ``sys.exit`` hooks: the line that
    called ``sys.exit``. wandb replaces ``sys.exit`` with a Python ``exit`` once a run has used
    it, and a hook may call an earlier one; the builtin adds no frame. A hook is the current
    ``sys.exit``'s code or a trailing function named ``exit``."""
    frames = traceback.extract_tb(tb)
    code = getattr(sys.exit, "__code__", None)
    hook = (code.co_filename, code.co_name) if code is not None else None
    while len(frames) > 1 and (
        frames[-1].name == "exit" or hook == (frames[-1].filename, frames[-1].name)
    ):
        frames.pop()
    return frames[-1]


def _add_distributed_args(p: argparse.ArgumentParser) -> None:
    """The multi-process flags, read by :func:`_init_distributed`."""
    g = p.add_argument_group(
        "multi-process (docs/scaling.md)",
        "one process per host or GPU, all with the same command; none of these: one process",
    )
    g.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address and a port")
    g.add_argument("--num-processes", type=int, metavar="N", help="number of processes")
    g.add_argument("--process-id", type=int, metavar="I", help="this process, in [0, N)")
    g.add_argument(
        "--distributed",
        action="store_true",
        help="let JAX detect the cluster (Cloud TPU VM, SLURM srun, Open MPI) for what is not "
        "given; also read from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID",
    )
    g.add_argument(
        "--heartbeat-timeout",
        type=int,
        metavar="S",
        help="seconds the other processes go on after one stops answering (killed, out of "
        "memory, a lost host) before the run ends (default: JAX's, 100)",
    )
    g.add_argument(
        "--init-timeout",
        type=int,
        metavar="S",
        help="seconds each process waits at start for all N to connect (default: JAX's, 300)",
    )


def _init_distributed(args: argparse.Namespace) -> bool:
    """Starts ``jax.distributed`` from :func:`_add_distributed_args`' flags (nothing without any
    setting); returns whether this process prints and writes files (process 0).

    Must run before anything touches a JAX backend. A bad combination raises
    :class:`~jaxrl_llm.distributed.DistributedError` (reported by ``_run``, exit status 2).
    """
    from jaxrl_llm import distributed as dist

    dist.initialize(
        args.coordinator,
        args.num_processes,
        args.process_id,
        auto=args.distributed,
        heartbeat_timeout_s=args.heartbeat_timeout,
        init_timeout_s=args.init_timeout,
    )
    return dist.is_primary()


def _quiet(*_: object) -> None:
    """The ``log`` of processes other than 0."""


# What the closing "final:" line shows of the last step's metrics (dpo has no reward/mean: its
# preference accuracy and margin on the training pairs, as TRL's DPOTrainer logs them)
FINAL_METRICS = ("eval/", "reward/mean", "dpo/reward_accuracy", "dpo/reward_margin", "step")


@_run
def _train(args: argparse.Namespace) -> int:
    from jaxrl_llm.config import ConfigError, check_model_paths
    from jaxrl_llm.train.loop import train

    primary = _init_distributed(args)
    config = _load(args, need_config=True)
    if args.max_steps is not None and args.max_steps < 1:
        raise ConfigError(f"--max-steps {args.max_steps}: expected an integer ≥ 1")
    check_model_paths(config)  # before the preflight reads the model's config
    if config.train.preflight:  # docs/plan.md: shapes only, before any weight is read
        from jaxrl_llm.train.plan import PlanError, preflight

        try:
            preflight(config, log=print if primary else _quiet)
        except PlanError as e:
            print(f"jaxrl-llm train: {e}", file=sys.stderr)
            return 2
    final = train(
        config,
        run_dir=args.run_dir,
        max_steps=args.max_steps,
        progress=not args.no_progress,
        overwrite=args.overwrite,
    )
    shown = {k: v for k, v in final.items() if k.startswith(FINAL_METRICS)}
    if primary:
        print("final: " + ", ".join(f"{k}={v:.4g}" for k, v in shown.items()))
    return 0


@_run
def _evaluate(args: argparse.Namespace) -> int:
    import json

    from jaxrl_llm.config import ConfigError, apply_overrides, check_evaluation, check_model_limits
    from jaxrl_llm.data import DataError
    from jaxrl_llm.train.loop import evaluate
    from jaxrl_llm.train.tracking import sample_summary

    primary = _init_distributed(args)
    config = _load(args, need_config=False)
    check_evaluation(config)  # no held-out set: say so before loading anything
    n = args.max_new_tokens
    if n is not None:
        if n < 1:
            raise ConfigError(f"--max-new-tokens {n}: expected an integer ≥ 1")
        check_model_limits(apply_overrides(config, [f"train.eval_max_new_tokens={n}"]))
    k = args.num_samples
    if k is not None and k < 1:
        raise ConfigError(f"--num-samples {k}: expected an integer ≥ 1")
    if args.show < 0:
        raise ConfigError(f"--show {args.show}: expected an integer ≥ 0")
    if (k or config.train.eval_num_samples) > 1 and args.mode == "greedy":
        raise ConfigError(
            f"--mode greedy with {k or config.train.eval_num_samples} samples per prompt: "
            "K > 1 samples at the rollout temperature (drop --mode or use --mode sampled)"
        )
    shown: list[dict] = []
    out = evaluate(
        config,
        run_dir=args.run_dir,
        mode=args.mode,
        max_new_tokens=args.max_new_tokens,
        num_samples=k,
        log=print if primary else _quiet,
        samples=shown,
        show=args.show,
    )
    if not out:
        raise DataError(
            f"no held-out prompts to evaluate: all {config.data.eval_size} were dropped (longer "
            f"than data.max_prompt_length = {config.data.max_prompt_length} tokens?)"
        )
    if primary:
        for i, record in enumerate(shown, 1):
            print(f"### held-out prompt {i}/{len(shown)}\n{record['prompt']}")
            for sample in record["samples"]:
                print(f"--- {sample_summary(sample)}")
                print(sample["completion"])
            print()
        print(json.dumps(out, indent=2))
    return 0


@_run
def _export(args: argparse.Namespace) -> int:
    from jaxrl_llm.train.loop import export

    primary = _init_distributed(args)  # every process joins the gathers; process 0 writes
    config = _load(args, need_config=False)
    path = export(
        config,
        run_dir=args.run_dir,
        out=args.out,
        log=print if primary else _quiet,
        critic=args.critic,
    )
    if primary:
        print(f"exported to {path}")
    return 0


def _common(p: argparse.ArgumentParser, *, config_required: bool) -> None:
    p.add_argument(
        "--config",
        required=config_required,
        default=None,
        help="YAML config: a file, or the name of a shipped config such as quickstart or "
        "algorithms/grpo (`jaxrl-llm configs` lists them; base documents every knob)"
        + ("" if config_required else "; default RUN_DIR/config.yaml"),
    )
    p.add_argument("--run-dir", required=True, help="the run directory")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted config overrides, e.g. optim.lr=1e-6",
    )


def add_train_parsers(sub: argparse._SubParsersAction) -> None:
    """Adds ``train``, ``evaluate`` and ``export`` to ``sub`` (``add_subparsers()``'s result)."""
    p = sub.add_parser("train", help="train (or resume) a run", allow_abbrev=False)
    _common(p, config_required=True)
    p.add_argument("--max-steps", type=int, default=None, help="override train.max_steps")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start over at step 0: delete RUN_DIR's config.yaml, metrics.jsonl, tensorboard/, "
        "checkpoints/ and export/ first (without it a run resumes from its latest checkpoint, "
        "and a run directory holding a run without a usable checkpoint is refused)",
    )
    _add_distributed_args(p)
    p.set_defaults(func=_train)

    p = sub.add_parser(
        "evaluate", help="held-out accuracy / mean reward of a run's checkpoint", allow_abbrev=False
    )
    _common(p, config_required=False)
    p.add_argument(
        "--mode",
        choices=["greedy", "sampled"],
        default=None,
        help="decoding (default train.eval_mode)",
    )
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument(
        "--num-samples",
        type=int,
        default=None,
        metavar="K",
        help="completions per prompt (default train.eval_num_samples); K > 1 samples at the "
        "rollout temperature and reports eval/pass@k (k = 1, 2, 4, ... and K), eval/mean@K, "
        "eval/best@K, eval/maj@K with 95%% bootstrap intervals",
    )
    p.add_argument(
        "--show",
        type=int,
        default=0,
        metavar="N",
        help="also print the first N held-out prompts (as the model reads them) with their "
        "completions, rewards and lengths",
    )
    _add_distributed_args(p)
    p.set_defaults(func=_evaluate)

    p = sub.add_parser(
        "export",
        help="write a run's latest checkpoint as a Hugging Face folder",
        allow_abbrev=False,
    )
    _common(p, config_required=False)
    p.add_argument("--out", default=None, help="output folder (default RUN_DIR/export)")
    p.add_argument(
        "--critic",
        action="store_true",
        help="also write a PPO run's critic to OUT/critic (a value model: "
        "AutoModelForSequenceClassification loads it, critic.path starts a run from it)",
    )
    _add_distributed_args(p)
    p.set_defaults(func=_export)


__all__ = ["add_train_parsers"]
