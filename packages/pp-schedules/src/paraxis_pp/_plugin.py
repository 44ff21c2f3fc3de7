"""Entry point of paraxis-pp-schedules in the ``paraxis`` plugin group."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paraxis.hookspecs import hookimpl
from paraxis.strategy import Strategy


@hookimpl
def paraxis_validate_config(config: Any, model: Any, problems: list[Any]) -> None:
    from paraxis_pp.rules import check_pipeline

    problems.extend(check_pipeline(config, model))


@hookimpl
def paraxis_register_strategies(register: Callable[[type[Strategy]], None]) -> None:
    from paraxis_pp.strategy import PipelineStrategy

    register(PipelineStrategy)


def _timeline(args: argparse.Namespace) -> int:
    """Simulate a schedule and draw it (SVG), with its bubble against theory."""
    from paraxis_pp.schedules import build
    from paraxis_pp.simulate import simulate, theoretical_bubble
    from paraxis_pp.timeline import render_svg, render_text

    schedule = build(args.schedule, args.stages, args.microbatches, args.chunks)
    t = simulate(schedule, f=args.f, b=args.b, w=args.w)
    Path(args.out).write_text(render_svg(t))
    print(render_text(t))
    print(f"{schedule.name}: bubble {t.bubble:.3f} (theory {theoretical_bubble(schedule):.3f}); "
          f"picture: {args.out}")
    return 0


@hookimpl
def paraxis_cli_commands(subparsers: Any) -> None:
    cmd = subparsers.add_parser("pp-timeline", help=_timeline.__doc__)
    cmd.add_argument("--schedule", default="1f1b")
    cmd.add_argument("--stages", type=int, default=4)
    cmd.add_argument("--microbatches", type=int, default=8)
    cmd.add_argument("--chunks", type=int, default=1)
    cmd.add_argument("--f", type=float, default=1.0, help="forward cost")
    cmd.add_argument("--b", type=float, default=1.0, help="input-gradient cost")
    cmd.add_argument("--w", type=float, default=1.0, help="weight-gradient cost")
    cmd.add_argument("--out", default="pp-timeline.svg")
    cmd.set_defaults(func=_timeline)
