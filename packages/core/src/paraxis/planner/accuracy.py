"""The plan against measurement on this machine (issue 15).

    python -m paraxis.planner.accuracy            # every case, writes docs/plan-accuracy.md
    python -m paraxis.planner.accuracy --cases tp2-sp,pp2 --no-write

Each case is a small model built from config (through the ``paraxis_build_model`` hook,
so Hugging Face families need paraxis-hf; core never imports transformers) trained one
real step through :func:`paraxis.parallelize` on CPU ranks (gloo, fp32). Per rank it
measures model state (parameters, gradients, optimizer state resident before
``zero_grad``: :func:`paraxis.metrics.memory_stats`), the peak of activation bytes held
for backward over the step (:class:`~paraxis.planner.measure.SavedActivations`) and the
bytes each axis sent (``grid.comm``, the counters of :mod:`paraxis.collectives`). The
planner evaluates the same layout; the most loaded rank of each pipeline stage and the
busiest rank per axis are compared with the plan, within :data:`BOUND`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["BOUND", "CASES", "Case", "measure", "planned"]

BOUND = 0.10  # the bound on |planned / measured - 1|


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

CASES: tuple[Case, ...] = (
    Case("one", "llama", {}, overrides=_LLAMA),
    Case("dp2", "llama", {"data": 2}, overrides=_LLAMA),
    Case("dp2-zero1", "llama", {"data": 2}, {"zero": 1}, overrides=_LLAMA),
    Case("dp2-zero2", "llama", {"data": 2}, {"zero": 2}, overrides=_LLAMA),
    Case("dp2-zero3", "llama", {"data": 2}, {"zero": 3}, overrides=_LLAMA),
    Case("tp2", "llama", {"tensor": 2}, overrides=_LLAMA),
    Case("tp2-sp", "llama", {"tensor": 2}, {"sequence_parallel": True}, overrides=_LLAMA),
    Case("pp2", "llama", {"pipeline": 2}, microbatches=4, overrides=_LLAMA),
    Case("ep2", "mixtral", {"expert": 2}, overrides=_MOE),
    Case("cp2-ring", "llama", {"context": 2}, overrides=_LLAMA),
    Case("cp2-ulysses", "llama", {"context": 2}, {"context_mode": "ulysses"},
         overrides=_LLAMA),
)


def _build(case: Case) -> torch.nn.Module:
    from paraxis.plugins import make_plugin_manager

    torch.manual_seed(0)
    model = make_plugin_manager().hook.paraxis_build_model(family=case.family,
                                                          config=dict(case.overrides))
    if model is None:
        raise RuntimeError(f"no plugin builds model_type {case.family!r}; install paraxis-hf")
    return model


def _config(case: Case) -> Any:
    from paraxis import ParallelConfig

    return ParallelConfig.from_kwargs(**case.degrees, **case.options,
                                      microbatches=case.microbatches)


def measure(case: Case) -> dict[str, Any]:
    """On every rank of a ``case.world`` world: one training step, measured."""
    import paraxis
    from paraxis.planner.measure import SavedActivations

    model = _build(case)
    engine = paraxis.parallelize(model, config=_config(case),
                                 train={"seq_length": case.seq, "steps": 2})
    index, count = engine.grid.sample_shard()
    vocab = case.overrides["vocab_size"]
    ids = torch.randint(0, vocab, (case.batch, case.seq),
                        generator=torch.Generator().manual_seed(1))
    part = ids[index * case.batch // count:(index + 1) * case.batch // count]
    mark = engine.grid.comm.mark()
    with SavedActivations(exclude=engine.model.parameters()) as saved:
        metrics = engine.train_step(part)
    out = {"coords": engine.grid.layout.coords(engine.grid.rank),
           "model_state": metrics["model_state_bytes"], "activations": saved.peak,
           "comm": engine.grid.comm.since(mark)["bytes"]}
    engine.close()
    return out


def planned(case: Case) -> Any:
    """The planner's :class:`~paraxis.planner.Plan` of the case's layout and workload."""
    from paraxis.planner import Hardware, Workload, count_model, evaluate
    from paraxis.planner.model import ModelSource, build_on_meta
    from paraxis.plugins import make_plugin_manager

    source = ModelSource(case.family, dict(case.overrides), f"case {case.name}", {})
    counts = count_model(build_on_meta(source, make_plugin_manager()), case.family, case.seq)
    replicas = case.degrees.get("data", 1) * case.degrees.get("expert", 1)
    work = Workload(seq=case.seq, global_batch=case.batch, precision="fp32",
                    micro_batch=case.batch // (replicas * case.microbatches),
                    context_impl=case.options.get("context_mode", "ring"))
    return evaluate(counts, _config(case), work, Hardware(gpus_per_node=case.world))
