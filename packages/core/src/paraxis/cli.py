"""The ``paraxis`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from paraxis.config import ParallelConfig
from paraxis.errors import ConfigError
from paraxis.plugins import make_plugin_manager
from paraxis.strategy import resolve_strategies
from paraxis.validation import ModelShape, validate

__all__ = ["main"]


def _cmd_validate(args: argparse.Namespace) -> int:
    """Check a config (and optionally a model config) without starting any process."""
    try:
        config = ParallelConfig.from_yaml(args.config)
        model = ModelShape.from_file(args.model) if args.model else None
        pm = make_plugin_manager()
        validate(config, world_size=args.world_size, model=model, plugin_manager=pm)
        strategies = resolve_strategies(config, pm)
    except ConfigError as exc:
        print(f"{args.config}: {exc}", file=sys.stderr)
        return 1
    except (ImportError, OSError) as exc:
        print(f"{args.config}: {exc}", file=sys.stderr)
        return 1
    degrees = " x ".join(f"{a}={d}" for a, d in config.degrees.items())
    names = ", ".join(f"{s.axis} ({s.phase.name.lower()})" for s in strategies) or "none"
    print(f"{args.config}: valid. world size {config.world_size} ({degrees}); "
          f"strategies: {names}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paraxis", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    val = sub.add_parser("validate", help=_cmd_validate.__doc__)
    val.add_argument("--config", required=True, help="YAML run configuration")
    val.add_argument("--model", help="model config: config.json, or YAML with a model: section")
    val.add_argument("--world-size", type=int, default=None,
                     help="check against this many processes")
    val.set_defaults(func=_cmd_validate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
