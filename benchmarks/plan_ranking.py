"""The planner's ranking against runs of its top three layouts on this machine
(issue 38, item 6).

    python benchmarks/plan_ranking.py                 # calibrate, plan, run, write
    python benchmarks/plan_ranking.py --table FILE    # reuse a calibrated table

1. ``paraxis plan --calibrate`` measures this machine's efficiency table for 2 ranks
   (``benchmarks/out/plan_ranking_table.json``), unless ``--table`` gives one;
2. the planner ranks every layout of a small Llama (built from config through
   paraxis-hf, fp32) on 2 ranks with that table;
3. its top three layouts train on 2 gloo ranks in the same processes, alternating step
   by step in rounds (``common.rounds``: the order rotates, no layout always runs first);
4. for #1 vs #2 and #2 vs #3, each round's ratio of median step times (lower-ranked /
   higher-ranked) and the spread rule against 1: "met" when every round has the
   lower-ranked layout slower, as planned; "not met" when every round has it faster;
   else inside the noise. The measured order matches the plan's when both are met.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import torch
from common import OUT, machine, median, ratio_line, summary, write_section

MODEL = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 256,
         "max_position_embeddings": 512, "tie_word_embeddings": False}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--table", help="a calibrated efficiency table (default: calibrate now)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="global batch, sequences")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6, help="alternating steps per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    return p.parse_args()


def plan_top_three(args: argparse.Namespace, table: str) -> list[Any]:
    """The planner's three fastest layouts of the small Llama on 2 ranks."""
    from paraxis.engine.plugins import make_plugin_manager
    from paraxis.planner.efficiency import load_efficiency
    from paraxis.planner.inputs import Hardware, Workload
    from paraxis.planner.model import ModelSource, build_on_meta, count_model
    from paraxis.planner.search import search

    pm = make_plugin_manager()
    source = ModelSource("llama", MODEL, "benchmarks/plan_ranking.py", {})
    counts = count_model(build_on_meta(source, pm), "llama", args.seq)
    work = Workload(seq=args.seq, global_batch=args.batch, micro_batch=1, precision="fp32")
    hw = Hardware(gpus_per_node=2, efficiency=load_efficiency(table)).with_device_speeds()
    ranking = search(counts, work, hw, world=2, fixed={}, options={}, plugin_manager=pm)
    return list(ranking.plans[:3])


def run_layouts(configs: list[dict[str, Any]], seq: int, batch: int, rounds: int,
                steps: int, warmup: int) -> dict[str, Any]:
    """On each of 2 gloo ranks: the three layouts' engines, stepped in alternation."""
    import torch.distributed as dist
    from common import rounds as alternate_rounds

    import paraxis
    from paraxis.config.parallel import ParallelConfig
    from paraxis.engine.plugins import make_plugin_manager

    pm = make_plugin_manager()
    engines, names = {}, []
    for i, data in enumerate(configs):
        torch.manual_seed(0)
        model = pm.hook.paraxis_build_model(family="llama", config=dict(MODEL))
        config = ParallelConfig.model_validate(data)
        name = f"#{i + 1}"
        engines[name] = paraxis.parallelize(
            model, config=config, train={"steps": 10**6, "lr": 1e-4, "warmup_steps": 0,
                                         "global_batch": batch, "seq_length": seq})
        names.append(name)
    g = torch.Generator().manual_seed(0)

    def stepper(engine: Any) -> Any:
        index, count = engine.grid.sample_shard()
        part = slice(index * batch // count, (index + 1) * batch // count)

        def step() -> None:
            ids = torch.randint(0, MODEL["vocab_size"], (batch, seq), generator=g)
            engine.train_step(ids[part])
        return step

    run = alternate_rounds({n: stepper(engines[n]) for n in names}, rounds=rounds,
                           steps_per_round=steps, warmup=warmup)
    for engine in engines.values():
        engine.close()
    return {"walls": run.walls, "per_round": steps, "rank": dist.get_rank()}


def main() -> None:
    args = parse()
    OUT.mkdir(exist_ok=True)
    table = args.table
    if table is None:
        from paraxis.planner.calibrate import calibrate
        from paraxis.planner.efficiency import write_efficiency

        table = str(OUT / "plan_ranking_table.json")
        write_efficiency(calibrate(world=2), table)
    plans = plan_top_three(args, table)
    from paraxis.testing.distributed import DistributedWorld

    with DistributedWorld(2, timeout=1800) as world:
        per_rank = world.run(run_layouts, [p.layout.model_dump() for p in plans], args.seq,
                             args.batch, args.rounds, args.steps, args.warmup)
    report(args, table, plans, per_rank)


def _round_medians(walls: list[float], per_round: int) -> list[float]:
    return [median(walls[i:i + per_round]) for i in range(0, len(walls), per_round)]


def report(args: argparse.Namespace, table: str, plans: list[Any],
           per_rank: list[dict[str, Any]]) -> None:
    """Rank 0's walls (every step ends at a barrier: the ranks' walls agree)."""
    from paraxis.planner.efficiency import load_efficiency

    walls = per_rank[0]["walls"]
    names = [f"#{i + 1}" for i in range(len(plans))]
    medians = {n: _round_medians(walls[n], per_rank[0]["per_round"]) for n in names}
    rows, checks = [], []
    for n, plan in zip(names, plans, strict=True):
        measured = median(walls[n])
        rows.append(f"| {n} | {plan.degrees_text()} | {_options(plan)} | "
                    f"{plan.step.step_s * 1e3:.1f} | {measured * 1e3:.1f} | "
                    f"{plan.step.step_s / measured:.2f} |")
    for hi, lo in itertools.pairwise(names):
        ratios = [a / b for a, b in zip(medians[lo], medians[hi], strict=True)]
        checks.append((f"{lo} / {hi}", summary(ratios, 1.0, better="higher")))
    matches = all(s["verdict"] == "met" for _, s in checks)
    verdicts = ", ".join(f"{label}: {s['verdict']}" for label, s in checks)
    eff = load_efficiency(table)
    lines = [
        "## The planner's ranking on this machine: its top three layouts, run",
        "",
        f"`python benchmarks/plan_ranking.py` (Llama from config: hidden "
        f"{MODEL['hidden_size']}, {MODEL['num_hidden_layers']} layers, seq {args.seq}, "
        f"global batch {args.batch}, fp32, 2 gloo ranks; {machine()}; {args.rounds} rounds "
        f"of {args.steps} alternating steps after {args.warmup} warm-up). The table: "
        f"`paraxis plan --calibrate` ({eff.device.peak_flops / 1e9:.0f} GFLOP/s peak GEMM, "
        f"{eff.device.intra_bw / 1e9:.2f} GB/s and {eff.collective_s * 1e6:.0f} us per "
        f"gloo collective, {eff.overlap:.0%} overlap).",
        "",
        "| plan rank | layout | options | planned step (ms) | measured median (ms) | "
        "planned / measured |",
        "| --- | --- | --- | ---: | ---: | ---: |",
        *rows,
        "",
        *(ratio_line(f"Measured {label} (planned > 1)", s, bold=False) for label, s in checks),
        "",
        "**The measured order matches the plan's** (both pairs met by the spread rule)."
        if matches else "**The measured order does not match the plan's by the spread "
        f"rule** ({verdicts}).",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        write_section("plan_ranking", text, {
            "plans": [p.config_dict() | {"planned_step_s": p.step.step_s} for p in plans],
            "walls": walls, "checks": dict(checks), "table": json.loads(Path(table).read_text())})


def _options(plan: Any) -> str:
    par, sched = plan.layout.parallelism, plan.layout.schedule
    parts = [f"ZeRO-{par.zero}" if par.zero else "no ZeRO"]
    if par.sequence_parallel:
        parts.append("SP")
    parts.append(f"{sched.microbatches} microbatches")
    return ", ".join(parts)


if __name__ == "__main__":
    main()
