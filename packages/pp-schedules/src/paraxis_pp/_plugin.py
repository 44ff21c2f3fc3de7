"""Entry point of paraxis-pp-schedules in the ``paraxis`` plugin group."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paraxis.config.parallel import PIPELINE_SCHEDULES, V_SCHEDULES
from paraxis.parallel.hookspecs import hookimpl
from paraxis.parallel.strategy import ApplyContext, Strategy


@hookimpl
def paraxis_validate_config(config: Any, model: Any, problems: list[Any]) -> None:
    from paraxis_pp.rules import check_pipeline

    problems.extend(check_pipeline(config, model))


@hookimpl
def paraxis_register_strategies(register: Callable[[type[Strategy]], None]) -> None:
    from paraxis_pp.strategy import PipelineStrategy

    register(PipelineStrategy)


@hookimpl
def paraxis_pipeline_bubble(schedule: str, stages: int, microbatches: int,
                            virtual_stages: int) -> float | None:
    """The bubble of a dry run with unit F, B and W costs (the planner asks)."""
    from paraxis_pp.schedules import build
    from paraxis_pp.simulate import simulate

    try:
        return simulate(build(schedule, stages, microbatches, virtual_stages),
                        f=1.0, b=1.0, w=1.0).bubble
    except ValueError:  # a schedule these degrees cannot build: the closed form
        return None


@hookimpl
def paraxis_summarize_run(ctx: ApplyContext, history: list[dict[str, float]]) -> Any:
    """The last training step's measured timeline (SVG) and its bubble against theory.
    Collective over the pipeline group."""
    from paraxis.parallel.summary import RunReport
    from paraxis_pp.executor import PipelineRunner

    runner = ctx.forward_backward
    if not isinstance(runner, PipelineRunner):
        return None
    svg, line = runner.measured_svg()
    return RunReport(figures=[("pipeline_timeline", svg)], text=[line])


def _timeline(args: argparse.Namespace) -> int:
    """Simulate a schedule and draw it (SVG), with its bubble against theory."""
    from paraxis_pp.schedules import build
    from paraxis_pp.simulate import simulate, theoretical_bubble
    from paraxis_pp.timeline import render_svg, render_text

    chunks = args.chunks or (2 if args.schedule in V_SCHEDULES else 1)
    try:
        schedule = build(args.schedule, args.stages, args.microbatches, chunks)
    except ValueError as exc:  # degrees the schedule cannot hold: one line, no trace
        print(f"paraxis pp-timeline: {exc}", file=sys.stderr)
        return 2
    t = simulate(schedule, f=args.f, b=args.b, w=args.w)
    Path(args.out).write_text(render_svg(t))
    print(render_text(t))
    print(f"{schedule.name}: bubble {t.bubble:.3f} (theory {theoretical_bubble(schedule):.3f}); "
          f"picture: {args.out}")
    return 0


@hookimpl
def paraxis_cli_commands(subparsers: Any) -> None:
    cmd = subparsers.add_parser("pp-timeline", help=_timeline.__doc__)
    cmd.add_argument("--schedule", default="1f1b", choices=PIPELINE_SCHEDULES)
    cmd.add_argument("--stages", type=int, default=4,
                     help="pipeline ranks (the stages, when each holds one chunk)")
    cmd.add_argument("--microbatches", type=int, default=8)
    cmd.add_argument("--chunks", type=int, default=None,
                     help="model chunks per rank (default: 2 for zbv and dualpipev, else 1)")
    cmd.add_argument("--f", type=float, default=1.0, help="forward cost")
    cmd.add_argument("--b", type=float, default=1.0, help="input-gradient cost")
    cmd.add_argument("--w", type=float, default=1.0, help="weight-gradient cost")
    cmd.add_argument("--out", default="pp-timeline.svg")
    cmd.set_defaults(func=_timeline)
