"""The seed's recurring checks, answered in sentences for one plan.

shared/seeds ("The Recurring Checks"): what must be resident; what can be sharded
without changing semantics; which collective moves the hot bytes; can communication
overlap compute; which physical link carries it; what new failure mode appears.
"""

from __future__ import annotations

from paraxis.planner.evaluate import Plan
from paraxis.planner.units import fmt_bytes, fmt_seconds

__all__ = ["explain"]

LINKS = {"intra": "inside a node (NVLink/NVSwitch class)",
         "inter": "across nodes (InfiniBand/Ethernet class)"}


def _resident(plan: Plan) -> str:
    m, w = plan.worst, plan.work
    weights = {"mixed": "bf16/fp16 weights and gradients, fp32 master weights and Adam "
                        "moments",
               "fp32": "fp32 weights, gradients and Adam moments"}.get(
        w.precision, f"fp32 weights (the master copy) and gradients, optimizer state; "
                     f"{w.precision} activations")
    alive = m.notes["alive_microbatches"]
    return (f"1. Resident: the most loaded rank (stage {m.stage}) holds "
            f"{fmt_bytes(m.parameters)} of weights, {fmt_bytes(m.gradients)} of gradients "
            f"and {fmt_bytes(m.optimizer)} of optimizer state ({weights}), "
            f"{fmt_bytes(m.activations)} of activations for {alive} microbatch(es) of "
            f"{m.notes['layers']} layers, and {fmt_bytes(m.buffers)} of communication "
            f"buffers: {fmt_bytes(m.total)}, the largest term being {m.largest[0]}.")


def _sharded(plan: Plan) -> str:
    par, sched = plan.layout.parallelism, plan.layout.schedule
    parts = []
    if par.tensor > 1:
        parts.append(f"weight matrices and the vocabulary over {par.tensor} tensor ranks")
    if par.pipeline > 1:
        parts.append(f"layers over {par.pipeline} pipeline stages")
    if par.expert > 1:
        parts.append(f"experts over {par.expert} expert ranks")
    replicas = plan.layout.token_replicas
    zero = {1: "the optimizer state",
            2: "optimizer state and gradients", 3: "optimizer state, gradients and weights"}
    if replicas == 1:
        parts.append("there are no data-parallel replicas")
    elif par.zero == 0:
        parts.append(f"nothing of the model state over the {replicas} data-parallel "
                     "replicas, each of which holds it whole (no ZeRO)")
    else:
        hsdp = par.zero_shard and par.zero_shard < par.data
        over = (f"groups of {par.zero_shard} of the {par.data} data ranks, replicated "
                "across the groups (HSDP)") if hsdp else \
            f"the {replicas} data-parallel replicas"
        parts.append(f"ZeRO-{par.zero} shards {zero[par.zero]} over {over}")
    acts = {"none": "all activations are stored",
            "selective": "the attention block is recomputed instead of stored",
            "full": "only each layer's input is stored; the rest is recomputed"}
    act = acts[sched.activation_checkpointing]
    if par.sequence_parallel:
        act += ", and sequence parallelism splits norms and dropout along the sequence"
    if par.context > 1:
        act += f", and context parallelism splits each sequence over {par.context} ranks"
    return f"2. Sharded: {'; '.join(parts)}. As for activations, {act}."


def _hot(plan: Plan) -> str:
    if not plan.comm:
        return "3. Hot bytes: none; one rank does not communicate."
    hot = max(plan.comm, key=lambda a: (plan.step.exposed_s.get(a.axis, 0.0), a.bytes))
    return (f"3. Hot bytes: the {hot.axis} {hot.collective} ({hot.per}) moves "
            f"{fmt_bytes(hot.bytes)} per rank per step and costs the most exposed time, "
            f"{fmt_seconds(plan.step.exposed_s.get(hot.axis, 0.0))}.")


def _overlap(plan: Plan) -> str:
    """How each axis hides, as the engine runs it (paraxis.planner.step)."""
    if not plan.comm:
        return "4. Overlap: nothing to overlap."
    st = plan.step
    parts = [f"{a.axis}: {st.overlap.get(a.axis, a.overlap)} "
             f"({fmt_seconds(st.exposed_s.get(a.axis, 0.0))} of "
             f"{fmt_seconds(st.comm_s.get(a.axis, 0.0))} exposed)" for a in plan.comm]
    return "4. Overlap: " + "; ".join(parts) + "."


def _links(plan: Plan) -> str:
    if not plan.comm:
        return "5. Links: none used."
    parts = [f"{a.axis} ({a.group} ranks) {LINKS[a.link]}" for a in plan.comm]
    return "5. Links: " + "; ".join(parts) + "."


def _failure_modes(plan: Plan) -> str:
    par, sched = plan.layout.parallelism, plan.layout.schedule
    c, m = plan.counts, sched.microbatches
    watch = []
    if par.pipeline > 1:
        watch.append(f"a {plan.bubble.fraction:.0%} pipeline bubble with {m} microbatches "
                     f"for {par.pipeline} stages; the last stage's vocabulary projection "
                     f"(about {c.vocab_size / (12 * c.hidden_size):.2f} of a layer) can "
                     "make it the straggler")
    if any(a.axis == "tensor" and a.link == "inter" for a in plan.comm):
        watch.append("tensor-parallel collectives crossing nodes on every layer")
    exposed = plan.step.exposed_s.get("tensor", 0.0)
    if exposed > 0.05 * plan.step.step_s:
        watch.append(f"tensor-parallel collectives exposed on every layer, "
                     f"{exposed / plan.step.step_s:.0%} of the step "
                     f"(parallelism.tensor_overlap {par.tensor_overlap})")
    if par.zero == 3:
        watch.append("all-gather latency exposed when a layer's compute is too short to "
                     "hide it, and transient peaks from unevenly sized gathered units")
    if par.expert > 1:
        watch.append("router load imbalance: log tokens assigned, accepted and dropped per "
                     "expert")
    if par.context > 1 and par.context_mode == "ring":
        watch.append("causal attention makes later sequence chunks costlier than earlier "
                     "ones unless chunks are load-balanced")
    if sched.activation_checkpointing != "none" and par.pipeline > 1:
        watch.append("recomputation must not reach across a stage boundary")
    cap = plan.hardware.device_memory
    if cap and plan.worst.total > 0.9 * cap:
        watch.append(f"only {1 - plan.worst.total / cap:.0%} of the device left for allocator "
                     "fragmentation and kernel workspaces, which this plan does not count")
    if not watch:
        watch.append("little: with data parallelism alone, watch stragglers and "
                     "gradient-accumulation settings that differ across ranks")
    return "6. Failure modes to watch: " + "; ".join(watch) + "."


def explain(plan: Plan) -> str:
    return "\n".join(f(plan) for f in (_resident, _sharded, _hot, _overlap, _links,
                                        _failure_modes))
