"""``paraxis plan``: evaluate a layout (degrees given) or search all of them (omitted),
and ``paraxis validate --device-memory``'s fit warning.

Bad input is one line on stderr and exit code 1, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from paraxis.config.parallel import AXES, PIPELINE_SCHEDULES, V_SCHEDULES
from paraxis.planner.efficiency import (
    BUILTIN,
    OVERRIDABLE,
    Efficiency,
    load_efficiency,
    override,
    write_efficiency,
)
from paraxis.planner.evaluate import Plan, evaluate, make_layout, problems
from paraxis.planner.explain import explain
from paraxis.planner.inputs import Hardware, Workload
from paraxis.planner.model import ModelCounts
from paraxis.planner.reasons import why_slower
from paraxis.planner.report import format_plan, format_ranking, seed_sentence
from paraxis.planner.run_checks import HEADROOM, dry_run_verdict, load_counts, run_builder
from paraxis.planner.search import Ranking, search
from paraxis.planner.svg import plan_svg
from paraxis.planner.units import (
    PlanInputError,
    fmt_bytes,
    parse_bandwidth,
    parse_bytes,
    parse_flops,
)

__all__ = ["add_plan_parser", "run_plan"]




def add_plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="memory, communication, bubble and step time of a "
                       "layout, or the best layouts for a world size, before any run")
    p.add_argument("--model", help="model directory (config.json), a config.json, or a run "
                   "YAML (required unless --calibrate alone)")
    p.add_argument("--world-size", type=int, help="devices; degrees omitted are searched")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--device-memory", help="per device, e.g. 80GB or 80GiB")
    p.add_argument("--headroom", type=float, default=HEADROOM, help="share of the device "
                   "kept free for fragmentation, CUDA context and workspaces (default "
                   f"{HEADROOM})")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the run YAML's, "
                   "else min(2048, the model's maximum))")
    p.add_argument("--global-batch", type=int, help="sequences per step (default: the run "
                   "YAML's, else 8 x world size x micro-batch)")
    p.add_argument("--micro-batch", type=int, default=1)
    for axis in AXES:
        p.add_argument(f"--{axis}", type=int, help=f"{axis}-parallel degree")
    p.add_argument("--zero", type=int, choices=range(4))
    p.add_argument("--zero-shard", type=int, help="ZeRO over groups of this many data "
                   "ranks, replicated across them (HSDP); default: searched")
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction)
    p.add_argument("--expert-tensor", type=int, help="tensor ranks each expert's FFN is "
                   "split over: 1 (experts whole) or the tensor degree")
    p.add_argument("--recompute", choices=("none", "selective", "full"))
    p.add_argument("--schedule", choices=PIPELINE_SCHEDULES)
    p.add_argument("--virtual-stages", type=int, help="model chunks per pipeline rank")
    p.add_argument("--context-impl", choices=("ring", "ulysses"), default="ring")
    p.add_argument("--precision", choices=("mixed", "bf16", "fp16", "fp32"), default="mixed",
                   help="mixed: the ZeRO paper's 2+2+12 bytes per parameter; bf16/fp16: "
                        "paraxis's train.precision (fp32 master parameters, 2-byte "
                        "activations)")
    p.add_argument("--lora-rank", type=int, help="plan a LoRA run: adapters of this rank, "
                   "every other weight frozen (weights only: no gradient, no optimizer state)")
    p.add_argument("--lora-targets", help="linear layers to adapt, by name, comma-separated "
                   "(e.g. q_proj,v_proj); default: every linear layer of the layers")
    p.add_argument("--peak-flops", help="per device, e.g. 989e12 or 989T")
    p.add_argument("--bandwidth", help="intra=450GB/s,inter=50GB/s (bytes per second)")
    p.add_argument("--efficiency", default="h100", metavar="NAME|FILE",
                   help="the efficiency table timing each kind of work: "
                        f"{', '.join(BUILTIN)} (default h100: eager PyTorch on an H100 SXM), "
                        "or a file --calibrate wrote")
    p.add_argument("--efficiency-set", metavar="KEY=V,...", help="override single figures: "
                   + "; ".join(f"{k}: {v}" for k, v in OVERRIDABLE.items()))
    p.add_argument("--calibrate", metavar="FILE", help="measure this machine's efficiency "
                   "table for ranks of a --world-size run (default 2) and write it to FILE; "
                   "with --model, plan with it")
    p.add_argument("--top", type=int, default=5, help="layouts shown when searching")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--explain", action="store_true", help="answer the seed's checks")
    p.add_argument("--svg", metavar="FILE", help="write memory and communication as SVG")
    p.add_argument("--dry-run", action="store_true",
                   help="also lay the model out for the first and last rank of each stage "
                        "on the meta device in a fake process group and compare its bytes "
                        "and its stage cut (exit 1 when they disagree)")
    p.set_defaults(func=run_plan)


def _efficiency(args: argparse.Namespace) -> Efficiency:
    if args.calibrate:
        from paraxis.planner.calibrate import calibrate, summary

        eff = calibrate(world=args.world_size or 2)
        write_efficiency(eff, args.calibrate)
        print(f"calibrated, written to {args.calibrate}:\n{summary(eff)}\n")
    else:
        eff = load_efficiency(args.efficiency)
    return override(eff, args.efficiency_set) if args.efficiency_set else eff


def _hardware(args: argparse.Namespace) -> Hardware:
    """The devices: flags first; a table chosen on purpose (--efficiency other than the
    default, --calibrate) gives the speeds the flags leave out."""
    bw = parse_bandwidth(args.bandwidth) if args.bandwidth else {}
    if args.gpus_per_node < 1:
        raise PlanInputError(f"--gpus-per-node {args.gpus_per_node} must be at least 1")
    if not 0 <= args.headroom < 1:
        raise PlanInputError(f"--headroom {args.headroom} must be in [0, 1), e.g. 0.1")
    hw = Hardware(
        gpus_per_node=args.gpus_per_node,
        device_memory=parse_bytes(args.device_memory) if args.device_memory else None,
        peak_flops=parse_flops(args.peak_flops) if args.peak_flops else None,
        intra_bw=bw.get("intra"), inter_bw=bw.get("inter"), headroom=args.headroom,
        efficiency=_efficiency(args))
    chosen = args.calibrate or args.efficiency != "h100" or args.efficiency_set
    return hw.with_device_speeds() if chosen else hw


def _options(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for key, name in (("zero", "zero"), ("zero_shard", "zero_shard"),
                      ("sequence_parallel", "sequence_parallel"),
                      ("expert_tensor", "expert_tensor"),
                      ("recompute", "activation_checkpointing"),
                      ("schedule", "pipeline_schedule"), ("virtual_stages", "virtual_stages"),
                   ("context_impl", "context_mode")):
        if getattr(args, key) is not None:
            opts[name] = getattr(args, key)
    if opts.get("virtual_stages", 1) > 1 and "pipeline_schedule" not in opts:
        opts["pipeline_schedule"] = "interleaved_1f1b"
    if opts.get("pipeline_schedule") in V_SCHEDULES:  # a V holds two chunks per rank
        opts.setdefault("virtual_stages", 2)
    return opts


def _world(args: argparse.Namespace, fixed: dict[str, int]) -> tuple[int, bool]:
    """(world size, whether to search)."""
    bad = {a: d for a, d in fixed.items() if d < 1}
    if bad:
        raise PlanInputError(f"degrees must be at least 1, got {bad}")
    product = math.prod(fixed.values())
    if args.world_size is None:
        return product, False
    if args.world_size < 1:
        raise PlanInputError(f"--world-size {args.world_size} must be at least 1")
    if product == args.world_size:
        return product, False
    given = " x ".join(f"{a}={d}" for a, d in fixed.items())
    if len(fixed) == len(AXES):
        raise PlanInputError(f"--world-size {args.world_size} is not the product of the "
                             f"degrees {given} = {product}; change one or drop --world-size")
    if args.world_size % product:
        raise PlanInputError(f"the degrees {given} (product {product}) do not divide "
                             f"--world-size {args.world_size}; choose degrees whose product "
                             f"divides it")
    return args.world_size, True


def _workload(args: argparse.Namespace, counts: ModelCounts, defaults: dict[str, Any],
              world: int) -> Workload:
    seq = args.seq or defaults.get("seq_length") or min(2048, counts.max_seq or 2048)
    batch = args.global_batch or defaults.get("global_batch") or 8 * world * args.micro_batch
    for name, value in (("--seq", seq), ("--global-batch", batch),
                        ("--micro-batch", args.micro_batch)):
        if int(value) < 1:
            raise PlanInputError(f"{name} {value} must be at least 1")
    return Workload(seq=int(seq), global_batch=int(batch), micro_batch=args.micro_batch,
                    precision=args.precision)


def _evaluate(counts: ModelCounts, fixed: dict[str, int], args: argparse.Namespace,
              work: Workload, hw: Hardware, world: int) -> Plan:
    from paraxis.engine.plugins import make_plugin_manager

    try:
        layout = make_layout(fixed, _options(args), work)
    except ValueError as exc:  # ConfigError: the options' own types and ranges
        raise PlanInputError(_one_line(exc)) from None
    found = problems(counts, layout, work, world_size=world,
                     plugin_manager=make_plugin_manager())
    if found:
        raise PlanInputError("; ".join(str(p) for p in found))
    return evaluate(counts, layout, work, hw)


def _one_line(exc: BaseException) -> str:
    lines = [line.strip(" -") for line in str(exc).splitlines() if line.strip()]
    return "; ".join(lines[1:] if len(lines) > 1 else lines)


def _search(counts: ModelCounts, fixed: dict[str, int], args: argparse.Namespace,
            work: Workload, hw: Hardware, world: int) -> tuple[Plan, Ranking]:
    from paraxis.engine.plugins import make_plugin_manager

    ranking = search(counts, work, hw, world=world, fixed=fixed, options=_options(args),
                     plugin_manager=make_plugin_manager())
    if not ranking.plans:
        if ranking.closest is None:
            raise PlanInputError(f"no valid layout of {world} ranks for this model "
                                 f"({ranking.grids} grids tried): every one breaks a "
                                 "divisibility rule; try another --world-size")
        c = ranking.closest
        raise PlanInputError(
            f"no layout of {world} ranks fits {fmt_bytes(hw.usable_memory or 0)}: the "
            f"smallest, {c.degrees_text()}, needs {fmt_bytes(c.worst.total)} per rank "
            f"(largest term {c.worst.largest[0]}); add devices or memory")
    best = ranking.plans[0]
    return evaluate(counts, best.layout, work, hw), ranking


def _ranking_json(r: Ranking, top: int) -> dict[str, Any]:
    best = r.plans[0]
    rows = [{"config": p.config_dict(), "memory_total": p.worst.total,
             "estimated_step_s": p.step.step_s, "estimated_mfu": p.step.mfu,
             "why_slower": "" if i == 0 else why_slower(p, best)}
            for i, p in enumerate(r.plans[:top])]
    return {"ranking": rows, "grids": r.grids, "valid": r.valid, "ranked": len(r.plans),
            "seed_order": r.seed.config_dict() if r.seed else None,
            "seed_order_note": seed_sentence(r)}


def run_plan(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except PlanInputError as exc:
        print(f"paraxis plan: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"paraxis plan: {exc.strerror or exc}: {exc.filename or ''}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.model is None and not args.calibrate:
        raise PlanInputError("--model is required (a model directory, config.json or run "
                             "YAML), unless --calibrate FILE alone measures this machine")
    hw = _hardware(args)
    if args.model is None:
        return 0
    fixed = {a: getattr(args, a) for a in AXES if getattr(args, a) is not None}
    world, searching = _world(args, fixed)
    targets = args.lora_targets.split(",") if args.lora_targets else None
    counts, defaults = load_counts(args.model, args.seq, lora_rank=args.lora_rank,
                                   lora_targets=targets)
    work = _workload(args, counts, defaults, world)
    ranking = None
    if searching:
        plan, ranking = _search(counts, fixed, args, work, hw, world)
    else:
        plan = _evaluate(counts, fixed, args, work, hw, world)
    if args.svg:
        Path(args.svg).write_text(plan_svg(plan))
    run = None
    if args.dry_run:
        from paraxis.planner.dryrun import dry_run

        run = dry_run(plan, build=run_builder(args.model, args.lora_rank, targets))
    if args.json:
        out = plan.to_json()
        if ranking is not None:
            out["search"] = _ranking_json(ranking, args.top)
        if run is not None:
            out["dry_run"] = run.to_json()
        print(json.dumps(out, indent=2))
        return dry_run_verdict(run, "paraxis plan")
    if ranking is not None:
        print(format_ranking(ranking, world=world, top=args.top, hw=hw))
        print("\nthe best layout, #1:\n")
    print(format_plan(plan))
    if args.explain:
        print("\n" + explain(plan))
    if run is not None:
        from paraxis.planner.dryrun import format_dry_run

        print("\n" + format_dry_run(run, plan.layout))
    return dry_run_verdict(run, "paraxis plan")
