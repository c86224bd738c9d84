"""The ``jaxrl-llm`` command line. String names are resolved here and nowhere below."""

from __future__ import annotations

import argparse
import sys


def _explain(args: argparse.Namespace) -> int:
    from jaxrl_llm import algorithms
    from jaxrl_llm.explain import comparison_table, explain, format_explanation

    if args.all:
        print(comparison_table())
        print()
        for name in algorithms.RECIPES:
            print(format_explanation(explain(algorithms.get(name, numerics=args.numerics))))
            print()
        return 0
    if not args.algorithm:
        print("jaxrl-llm explain: name an algorithm or pass --all", file=sys.stderr)
        return 2
    if args.algorithm not in algorithms.RECIPES:
        print(
            f"jaxrl-llm explain: unknown algorithm {args.algorithm!r}; available: "
            f"{', '.join(algorithms.RECIPES)}",
            file=sys.stderr,
        )
        return 2
    print(format_explanation(explain(algorithms.get(args.algorithm, numerics=args.numerics))))
    return 0


def _configs(args: argparse.Namespace) -> int:
    from jaxrl_llm.config import ConfigError, describe_configs, resolve_config

    if args.path is not None:
        try:
            path = resolve_config(args.path)
            if not path.is_file():
                raise ConfigError(f"config file not found: {args.path}")
        except ConfigError as e:
            print(f"jaxrl-llm configs: {e}", file=sys.stderr)
            return 2
        print(path)
        return 0
    configs = describe_configs()
    width = max(map(len, configs), default=0)
    for name, description in configs.items():
        print(f"{name:<{width}}  {description}".rstrip())
    return 0


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: a prefix must not silently become another flag (argparse
    # read `evaluate --n 4` as --num-processes 4).
    parser = argparse.ArgumentParser(
        prog="jaxrl-llm",
        description="JAX-native reinforcement learning for language models.",
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    explain = sub.add_parser(
        "explain",
        help="answer the five questions (reward, KL, baseline, normalisation, "
        "objective) for an algorithm",
        allow_abbrev=False,
    )
    explain.add_argument("algorithm", nargs="?", help="algorithm name, e.g. grpo")
    explain.add_argument("--all", action="store_true", help="compare every algorithm")
    explain.add_argument(
        "--numerics",
        default="default",
        choices=["default", "verl", "trl", "openrlhf"],
        help="numerical conventions preset",
    )
    explain.set_defaults(func=_explain)

    configs = sub.add_parser(
        "configs",
        help="list the shipped configs (names --config takes from any directory)",
        description="The configs shipped with the package, by the name --config takes "
        "(e.g. `jaxrl-llm train --config quickstart --run-dir runs/q`), each with its first "
        "comment line.",
        allow_abbrev=False,
    )
    configs.add_argument(
        "--path",
        metavar="NAME",
        default=None,
        help="print the file `--config NAME` reads instead (e.g. to copy and edit it)",
    )
    configs.set_defaults(func=_configs)

    from jaxrl_llm.rollout.cli import add_generate_parser
    from jaxrl_llm.train.cli import add_train_parsers
    from jaxrl_llm.train.plan import add_arguments as add_plan_arguments

    add_train_parsers(sub)
    add_generate_parser(sub)
    plan = sub.add_parser(
        "plan",
        help="will this run fit? compile its rollout and RL step for a TPU slice or N GPUs "
        "(shapes only, nothing allocated) and print per-device memory, FLOPs and FITS",
        allow_abbrev=False,
    )
    add_plan_arguments(plan)
    plan.set_defaults(func=_plan)
    return parser


def _plan(args: argparse.Namespace) -> int:
    from jaxrl_llm.train.plan import run_cli

    return run_cli(args)


def main(argv: list[str] | None = None) -> int:
    from jaxrl_llm.train.plan import quiet_cpu_platform

    quiet_cpu_platform()  # libtpu installed on a machine without TPUs: CPU, no libtpu warnings
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
