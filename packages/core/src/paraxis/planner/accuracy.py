"""The plan against measurement on this machine (issue 15).

    python -m paraxis.planner.accuracy            # every case, writes docs/plan-accuracy.md
    python -m paraxis.planner.accuracy --cases tp2-sp,pp2 --no-write

Each case is a small model built from config (through the ``paraxis_build_model`` hook,
so Hugging Face families need paraxis-hf; core never imports transformers) trained one
real step through :func:`paraxis.parallelize` on CPU ranks (gloo, fp32). Per rank it
measures model state (parameters, gradients, optimizer state resident before
``zero_grad``: :func:`paraxis.engine.metrics.memory_stats`), the peak of activation bytes held
for backward over the step (:class:`~paraxis.planner.measure.SavedActivations`) and the
bytes each axis sent (``grid.comm``, the counters of :mod:`paraxis.runtime.collectives`). The
planner evaluates the same layout; the most loaded rank of each pipeline stage and the
busiest rank per axis are compared with the plan, within :data:`BOUND`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from paraxis.config.parallel import SAMPLE_AXES

__all__ = ["BOUND", "CASES", "Case", "measure", "planned"]

BOUND = 0.10  # the bound on |planned / measured - 1|
# Under train.precision bf16/fp16 the plan counts every saved activation at 2 bytes, but
# autocast keeps the residual stream and the norms in fp32 and holds a bf16 copy of each
# weight for the backward: measured 1.49x the plan on dp2 (1,871,368 against 1,261,056
# bytes). Not modelled yet, so those cases compare model state and bytes only.
AUTOCAST_ACTIVATIONS = "not modelled under autocast"


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    degrees: dict[str, int]
    options: dict[str, Any] = field(default_factory=dict)
    microbatches: int = 1
    seq: int = 32
    batch: int = 8  # global, sequences
    overrides: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)  # precision, optimizer

    @property
    def world(self) -> int:
        n = 1
        for d in self.degrees.values():
            n *= d
        return n


_LLAMA = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
          "max_position_embeddings": 64}
_MOE = {**_LLAMA, "num_local_experts": 4, "num_experts_per_tok": 2}

_QWEN2 = {**_LLAMA, "num_hidden_layers": 2}

CASES: tuple[Case, ...] = (
    Case("llama", "llama", {}, overrides=_LLAMA),
    Case("llama-selective", "llama", {}, {"activation_checkpointing": "selective"},
         overrides=_LLAMA),
    Case("llama-full", "llama", {}, {"activation_checkpointing": "full"}, overrides=_LLAMA),
    Case("dp2", "llama", {"data": 2}, overrides=_LLAMA),
    Case("dp2-zero1", "llama", {"data": 2}, {"zero": 1}, overrides=_LLAMA),
    Case("dp2-zero2", "llama", {"data": 2}, {"zero": 2}, overrides=_LLAMA),
    Case("dp2-zero3", "llama", {"data": 2}, {"zero": 3}, overrides=_LLAMA),
    Case("tp2", "llama", {"tensor": 2}, overrides=_LLAMA),
    Case("tp2-sp", "llama", {"tensor": 2}, {"sequence_parallel": True}, overrides=_LLAMA),
    Case("pp2-1f1b", "llama", {"pipeline": 2}, microbatches=4, overrides=_LLAMA),
    Case("ep2-mixtral", "mixtral", {"expert": 2}, overrides=_MOE),
    Case("cp2-ring", "llama", {"context": 2}, overrides=_LLAMA),
    Case("cp2-ulysses", "llama", {"context": 2}, {"context_mode": "ulysses"},
         overrides=_LLAMA),
    Case("qwen2-dp2-tp2-sp", "qwen2", {"data": 2, "tensor": 2},
         {"sequence_parallel": True}, overrides=_QWEN2),
    Case("pp4-1f1b", "llama", {"pipeline": 4}, microbatches=8, overrides=_LLAMA),
    Case("dp2-zero3-tp2", "llama", {"data": 2, "tensor": 2}, {"zero": 3}, overrides=_LLAMA),
    Case("ep2-dp2-mixtral", "mixtral", {"data": 2, "expert": 2}, overrides=_MOE),
    Case("tp2-sp-mixtral", "mixtral", {"tensor": 2}, {"sequence_parallel": True},
         overrides=_MOE),
    Case("tp2-sp-etp2-mixtral", "mixtral", {"tensor": 2},
         {"sequence_parallel": True, "expert_tensor": 2}, overrides=_MOE),
    Case("tp2-etp2-mixtral", "mixtral", {"tensor": 2}, {"expert_tensor": 2},
         overrides=_MOE),
    Case("ep2-tp2-etp2-mixtral", "mixtral", {"expert": 2, "tensor": 2},
         {"expert_tensor": 2}, overrides=_MOE),
    Case("dp2-tp2-sp-pp2", "llama", {"data": 2, "tensor": 2, "pipeline": 2},
         {"sequence_parallel": True}, microbatches=2, overrides=_LLAMA),
    # train.precision bf16 (fp32 master parameters, autocast), each ZeRO stage, and
    # the bf16 gradient reduction; SGD with momentum (4 bytes of state, not Adam's 8).
    *(Case(f"dp2-zero{z}-bf16", "llama", {"data": 2}, {"zero": z}, overrides=_LLAMA,
           train={"precision": "bf16"}) for z in range(4)),
    Case("dp2-bf16-reduce", "llama", {"data": 2}, {"reduce_dtype": "bf16"},
         overrides=_LLAMA, train={"precision": "bf16"}),
    Case("dp2-zero1-sgd", "llama", {"data": 2}, {"zero": 1}, overrides=_LLAMA,
         train={"optimizer": "sgd"}),
    # Issue 36: ZeRO-3 gathering bf16 with bf16 reductions; ZeRO-2 and 3 beside a
    # pipeline; HSDP (zero_shard 2 of data 4); expert state over data with one local
    # expert per rank (split along its rows, not its experts).
    Case("dp2-zero3-bf16-reduce", "llama", {"data": 2}, {"zero": 3, "reduce_dtype": "bf16"},
         overrides=_LLAMA, train={"precision": "bf16"}),
    *(Case(f"dp2-pp2-zero{z}", "llama", {"data": 2, "pipeline": 2}, {"zero": z},
           microbatches=2, overrides=_LLAMA) for z in (2, 3)),
    Case("dp4-zero3-hsdp2", "llama", {"data": 4}, {"zero": 3, "zero_shard": 2},
         overrides=_LLAMA),
    Case("ep2-dp2-mixtral-zero1", "mixtral", {"data": 2, "expert": 2}, {"zero": 1},
         overrides={**_MOE, "num_local_experts": 2}),
)
# The test's sample: one 2-rank world, every kind of quantity.
SAMPLE = ("dp2-zero3", "tp2-sp", "pp2-1f1b")


def _build(case: Case) -> torch.nn.Module:
    from paraxis.engine.plugins import make_plugin_manager

    torch.manual_seed(0)
    model = make_plugin_manager().hook.paraxis_build_model(family=case.family,
                                                          config=dict(case.overrides))
    if model is None:
        raise RuntimeError(f"no plugin builds model_type {case.family!r}; install paraxis-hf")
    return model


def _config(case: Case) -> Any:
    from paraxis.config.parallel import ParallelConfig

    return ParallelConfig.from_kwargs(**case.degrees, **case.options,
                                      microbatches=case.microbatches)


def measure(case: Case) -> dict[str, Any]:
    """On every rank of a ``case.world`` world: one training step, measured."""
    from paraxis.engine.apply import parallelize
    from paraxis.planner.measure import SavedActivations

    model = _build(case)
    engine = parallelize(model, config=_config(case),
                         train={"seq_length": case.seq, "steps": 2, **case.train})
    index, count = engine.grid.sample_shard()
    vocab = case.overrides["vocab_size"]
    ids = torch.randint(0, vocab, (case.batch, case.seq),
                        generator=torch.Generator().manual_seed(1))
    part = ids[index * case.batch // count:(index + 1) * case.batch // count]
    mark = engine.grid.comm.mark()
    with SavedActivations(parameters_of=engine.model) as saved:
        metrics = engine.train_step(part)
    out = {"coords": engine.grid.layout.coords(engine.grid.rank),
           "model_state": metrics["model_state_bytes"], "activations": saved.peak,
           "comm": engine.grid.comm.since(mark)["bytes"]}
    engine.close()
    return out


def planned(case: Case) -> Any:
    """The planner's :class:`~paraxis.planner.Plan` of the case's layout and workload."""
    from paraxis.config.run import TrainSection
    from paraxis.engine.plugins import make_plugin_manager
    from paraxis.parallel.optimizers import optimizer_state_bytes
    from paraxis.planner import Hardware, Workload, count_model, evaluate
    from paraxis.planner.model import ModelSource, build_on_meta

    source = ModelSource(case.family, dict(case.overrides), f"case {case.name}", {})
    counts = count_model(build_on_meta(source, make_plugin_manager()), case.family, case.seq)
    replicas = math.prod(case.degrees.get(a, 1) for a in SAMPLE_AXES)
    train = TrainSection(**case.train)
    work = Workload(seq=case.seq, global_batch=case.batch, precision=train.precision,
                    micro_batch=case.batch // (replicas * case.microbatches),
                    reduce_dtype=case.options.get("reduce_dtype", "fp32"),
                    optimizer_bytes=optimizer_state_bytes(train))
    return evaluate(counts, _config(case), work, Hardware(gpus_per_node=case.world))


@dataclass(frozen=True)
class Row:
    case: str
    quantity: str
    planned: float
    measured: float

    @property
    def ratio(self) -> float:
        if self.measured == 0:
            return 1.0 if self.planned == 0 else float("inf")
        return self.planned / self.measured

    @property
    def error(self) -> float:
        return abs(self.ratio - 1.0)


def _axis(key: str) -> str | None:
    """The plan's axis for a counter key (``dataxexpertxcontext`` is the replicas' sync);
    None for the engine's own whole-grid metrics gather."""
    from paraxis.config.parallel import AXES

    if key == "data_replica":  # HSDP's all-reduce across the shard groups
        return key
    axes = re.findall("|".join(AXES), key)
    if not axes or len(axes) == len(AXES):
        return None
    return "data" if "data" in axes else axes[0]


def compare(case: Case, results: list[dict[str, Any]]) -> list[Row]:
    """Rows for one case: per pipeline stage its most loaded rank's model state and
    activations; per axis the busiest rank's bytes."""
    plan = planned(case)
    rows: list[Row] = []
    for mem in plan.memory:
        stage = [r for r in results if r["coords"]["pipeline"] == mem.stage]
        where = f" stage {mem.stage}" if len(plan.memory) > 1 else ""
        rows.append(Row(case.name, f"model state{where}",
                        mem.parameters + mem.gradients + mem.optimizer,
                        max(r["model_state"] for r in stage)))
        if case.train.get("precision", "fp32") == "fp32":  # see AUTOCAST_ACTIVATIONS
            rows.append(Row(case.name, f"activations{where}", mem.activations,
                            max(r["activations"] for r in stage)))
    measured: list[dict[str, float]] = []
    for r in results:
        per: dict[str, float] = {}
        for (key, _op), n in r["comm"].items():
            axis = _axis(key)
            if axis is not None:
                per[axis] = per.get(axis, 0.0) + n
        measured.append(per)
    axes = {a.axis: a.bytes for a in plan.comm}
    if "expert_tensor" in axes:  # the split experts' traffic runs on the tensor group
        axes["tensor"] = axes.get("tensor", 0.0) + axes.pop("expert_tensor")
    for axis in sorted(set(axes) | {a for m in measured for a in m}):
        if axis not in axes and max(m.get(axis, 0.0) for m in measured) < 1024:
            # The MoE routing counts and statistics, reduced over the ranks holding
            # distinct tokens (tens of bytes a step), are not modelled; where the plan has
            # no other traffic on that group they alone would be a row planned at 0.
            continue
        rows.append(Row(case.name, f"{axis} bytes", axes.get(axis, 0.0),
                        max(m.get(axis, 0.0) for m in measured)))
    return rows


def run(cases: list[Case], pool: Any) -> list[Row]:
    """Measure every case on ``pool`` (a :class:`paraxis.testing.distributed.WorldPool`
    or anything with ``run(world_size, fn, *args)``) and compare."""
    rows: list[Row] = []
    for case in sorted(cases, key=lambda c: c.world):
        rows += compare(case, pool.run(case.world, measure, case))
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    # By module name, so the ranks unpickle the same functions under `python -m`.
    from paraxis.planner import accuracy as this
    from paraxis.planner.accuracy_doc import fmt, markdown
    from paraxis.testing.distributed import WorldPool

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--out", default="docs/plan-accuracy.md")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    names = args.cases.split(",") if args.cases else [c.name for c in CASES]
    unknown = sorted(set(names) - {c.name for c in CASES})
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {[c.name for c in CASES]}")
    pool = WorldPool()
    try:
        rows = this.run([c for c in this.CASES if c.name in names], pool)
    finally:
        pool.close()
    for r in rows:
        print(f"{r.case:18} {r.quantity:22} {fmt(r.planned):>12} {fmt(r.measured):>12} "
              f"{r.ratio:8.4f}")
    worst = max(rows, key=lambda r: r.error)
    print(f"worst: {worst.case} {worst.quantity} ratio {worst.ratio:.4f}")
    if not args.no_write:
        command = "python -m paraxis.planner.accuracy" + (
            f" --cases {args.cases}" if args.cases else "")
        Path(args.out).write_text(markdown(rows, command, cases=CASES, bound=BOUND))
    return 0 if worst.error <= BOUND else 1


if __name__ == "__main__":
    raise SystemExit(main())
