"""The plan as text: a few aligned blocks a person reads top to bottom."""

from __future__ import annotations

from paraxis.config.parallel import Parallelism
from paraxis.planner.evaluate import Plan
from paraxis.planner.inputs import Hardware
from paraxis.planner.reasons import is_tie, tie_reason, why_slower
from paraxis.planner.schedule import closed_form_bubble
from paraxis.planner.search import Ranking
from paraxis.planner.units import fmt_bytes, fmt_rate, fmt_seconds

__all__ = ["format_plan", "format_ranking"]


def _options(plan: Plan) -> str:
    par, sched = plan.layout.parallelism, plan.layout.schedule
    parts = [f"ZeRO-{par.zero}" if par.zero else "no ZeRO"]
    if par.zero and par.zero_shard and par.zero_shard < par.data:
        parts[0] += f" over groups of {par.zero_shard} data ranks (HSDP)"
    if par.sequence_parallel:
        parts.append("sequence parallel")
    parts.append(f"recompute {sched.activation_checkpointing}")
    if par.pipeline > 1:
        v = f" x {sched.virtual_stages} chunks" if sched.virtual_stages > 1 else ""
        parts.append(f"{sched.pipeline_schedule}{v}")
    if par.context > 1:
        parts.append(f"{par.context_mode} context")
    return ", ".join(parts)


def _memory_block(plan: Plan) -> list[str]:
    worst = plan.worst
    p = plan.layout.parallelism.pipeline
    where = f"pipeline stage {worst.stage} of {p}, " if p > 1 else ""
    lines = [f"memory per rank, most loaded ({where}{worst.notes['layers']} layers, "
             f"{worst.notes['alive_microbatches']} microbatch(es) of activations alive)"]
    for name, value in worst.as_dict().items():
        lines.append(f"  {name:<12} {fmt_bytes(value):>10}")
    hw = plan.hardware
    if hw.device_memory:
        verdict = "fits" if plan.fits else "DOES NOT FIT"
        keep = f" less {hw.headroom:.0%} headroom" if hw.headroom else ""
        lines[-1] += f"   {verdict} {fmt_bytes(hw.device_memory)}{keep} " \
            f"({worst.total / hw.device_memory:.0%} of the device)"
    return lines


def _comm_block(plan: Plan) -> list[str]:
    if not plan.comm:
        return ["communication: none (one rank)"]
    el, st = plan.work.element_size, plan.step
    lines = [f"communication per step per rank (bytes sent, bus convention, {el}-byte "
             "elements; time on the link, and what stays exposed)",
             f"  {'axis':<9} {'collective':<30} {'bytes':>10}  {'link':<5} {'group':>5} "
             f"{'time':>9} {'exposed':>9}  overlap"]
    for a in plan.comm:
        lines.append(f"  {a.axis:<9} {a.collective:<30} {fmt_bytes(a.bytes):>10}  "
                     f"{a.link:<5} {a.group:>5} {fmt_seconds(st.comm_s.get(a.axis, 0.0)):>9} "
                     f"{fmt_seconds(st.exposed_s.get(a.axis, 0.0)):>9}  "
                     f"{st.overlap.get(a.axis, a.overlap)}")
    return lines


STEP_WORDS = {"gemm": "GEMMs", "attention": "attention", "elementwise": "elementwise",
              "launch": "launches", "optimizer": "optimizer"}


def _step_line(plan: Plan) -> list[str]:
    st = plan.step
    parts = [f"{STEP_WORDS.get(k, k)} {fmt_seconds(v)}" for k, v in st.detail.items() if v > 0]
    if st.recompute_s:
        parts.append(f"recompute {fmt_seconds(st.recompute_s)}")
    if st.bubble_s:
        parts.append(f"bubble {fmt_seconds(st.bubble_s)}")
    parts += [f"{axis} {fmt_seconds(s)} exposed" for axis, s in st.exposed_s.items() if s > 0]
    hw = plan.hardware
    eff = hw.efficiency
    lines = [f"step       {fmt_seconds(st.step_s)} ({', '.join(parts)}); MFU {st.mfu:.1%}, "
             f"{st.tokens_per_s:,.0f} tokens/s",
             f"           each kind of work at its measured efficiency: table {eff.name!r} "
             f"(sustained {eff.sustained:.2f}; docs/plan-step-time.md)"]
    if not hw.timed:
        d = hw.with_device_speeds()
        lines.append(f"           assumed {eff.device.name}: {(d.peak_flops or 0) / 1e12:.0f} "
                     f"TFLOP/s, HBM {fmt_rate(eff.device.memory_bw)}, intra "
                     f"{fmt_rate(d.intra_bw or 0)}, inter {fmt_rate(d.inter_bw or 0)}; give "
                     "--peak-flops and --bandwidth, or --efficiency, for yours")
    return lines


def format_plan(plan: Plan) -> str:
    w, sched = plan.work, plan.layout.schedule
    b = plan.bubble
    lines = [
        f"model      {plan.counts.describe()}",
        f"workload   seq {w.seq}, global batch {w.global_batch}, micro-batch "
        f"{w.micro_batch}, {sched.microbatches} microbatches per replica, {w.precision} "
        "precision",
        f"layout     {plan.degrees_text()} (world {plan.layout.world_size}, "
        f"{plan.hardware.gpus_per_node} per node); {_options(plan)}",
        "",
        *_memory_block(plan),
        "",
        *_comm_block(plan),
        "",
    ]
    if plan.layout.parallelism.pipeline > 1:
        how = f"closed form {b.formula}"
        if b.source != "closed form":
            closed = closed_form_bubble(sched.pipeline_schedule, plan.layout.parallelism.pipeline,
                                        sched.microbatches, sched.virtual_stages)
            how = f"{b.source}; closed form {b.formula} = {closed.fraction:.1%}"
        lines.append(f"bubble     {b.fraction:.1%} ({sched.pipeline_schedule}, "
                     f"{sched.microbatches} microbatches; {how})")
    else:
        lines.append("bubble     none (no pipeline)")
    lines += _step_line(plan)
    if plan.unchecked:
        lines.append(_unchecked_line(plan.unchecked))
    return "\n".join(lines)


def _unchecked_line(axes: tuple[str, ...]) -> str:
    from paraxis.config.axes import BUILTIN_AXES
    from paraxis.engine.resolve import PACKAGE_FOR_STRATEGY

    def package(axis: str) -> str:
        return BUILTIN_AXES.spec(axis).package if axis in BUILTIN_AXES.names \
            else PACKAGE_FOR_STRATEGY[axis]

    installs = " ".join(sorted({package(a) for a in axes}))
    return (f"unchecked  the rules of {', '.join(axes)} were not checked: the package is not "
            f"installed (pip install {installs}); a run may refuse this layout")


def _zero_cell(par: Parallelism) -> str:
    """The ZeRO stage, with its shard group's data ranks under HSDP (3/8)."""
    hsdp = par.zero and par.zero_shard and par.zero_shard < par.data
    return f"{par.zero}/{par.zero_shard}" if hsdp else str(par.zero)


def format_ranking(r: Ranking, *, world: int, top: int, hw: Hardware) -> str:
    keep = f" less {hw.headroom:.0%} headroom" if hw.headroom else ""
    fit = f"{len(r.plans)} fit {fmt_bytes(hw.device_memory)}{keep}" if hw.device_memory else \
        f"{len(r.plans)} ranked (no --device-memory: nothing rejected for size)"
    lines = [f"searched {r.grids} grids of {world} ranks: {r.valid} valid, {fit}; "
             f"the best {min(top, len(r.plans))}:",
             f"  {'#':>2} {'data':>4} {'tensor':>6} {'pipe':>4} {'expert':>6} {'ctx':>3} "
             f"{'zero':>4} {'sp':>3} {'recompute':<9} {'memory':>10} {'step':>9} "
             f"{'MFU':>6}  why slower than #1"]
    best = r.plans[0]
    unchecked: set[str] = set()
    for i, plan in enumerate(r.plans[:top], start=1):
        d, par = plan.layout.degrees, plan.layout.parallelism
        why = "" if i == 1 else why_slower(plan, best)
        previous = r.plans[i - 2] if i > 2 else None
        if previous is not None and plan.step.step_s < previous.step.step_s:
            why += f"; {tie_reason(plan, previous, i - 1)}"  # a tie put it below
        if plan.unchecked:  # a star: rules of an axis not installed went unchecked
            why = f"* {why}".rstrip()
            unchecked.update(plan.unchecked)
        lines.append(
            f"  {i:>2} {d['data']:>4} {d['tensor']:>6} {d['pipeline']:>4} {d['expert']:>6} "
            f"{d['context']:>3} {_zero_cell(par):>4} "
            f"{'yes' if par.sequence_parallel else 'no':>3} "
            f"{plan.layout.schedule.activation_checkpointing:<9} "
            f"{fmt_bytes(plan.worst.total):>10} {fmt_seconds(plan.step.step_s):>9} "
            f"{plan.step.mfu:>6.1%}  {why}".rstrip())
    if unchecked:
        lines.append("* " + _unchecked_line(tuple(sorted(unchecked))).removeprefix(
            "unchecked  "))
    lines.append(seed_sentence(r))
    return "\n".join(lines)


def seed_sentence(r: Ranking) -> str:
    """Where the ranking departs from the seeds' placement order, and why."""
    order = ("the seeds' placement order (tensor inside a node, pipeline until the state "
             "fits, experts inside a node, the rest data)")
    if r.seed is None:
        return f"{order[0].upper()}{order[1:]} finds no fitting layout here."
    best = r.plans[0]
    rank = next((i for i, p in enumerate(r.plans, 1)
                 if p.layout.degrees == r.seed.layout.degrees), None)
    grid = r.seed.degrees_text()
    if rank == 1:
        return f"The ranking agrees with {order}: {grid}."
    where = f"#{rank}" if rank else "unranked"
    if is_tie(r.seed, best):
        return (f"The ranking departs from {order}, which gives {grid} ({where}): it "
                f"{why_slower(r.seed, best)}.")
    return (f"The ranking departs from {order}, which gives {grid} ({where}, "
            f"{fmt_seconds(r.seed.step.step_s)}): it is slower than #1 by "
            f"{fmt_seconds(r.seed.step.step_s - best.step.step_s)}; "
            f"{why_slower(r.seed, best)}.")
