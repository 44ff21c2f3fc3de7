"""The step model against published runs of Llama 3 on H100s (issue 38).

    python -m paraxis.planner.published          # the table, as in docs/plan-step-time.md
    python -m paraxis.planner.published --fit    # the sustained share, fitted on RUNS[0]

Each run is the publisher's own layout, batch and sequence, planned as paraxis would
plan it, with the efficiency table of the kernels that framework launches: Megatron-Core
(NeMo) with Transformer Engine's fused kernels (``h100-te``), torchtitan in eager
PyTorch (``h100``, its parameters in bf16: precision ``mixed``). Their MFU and ours
count the same model FLOPs, 6N + 12·L·H·Q·T per token against 989.4 TFLOP/s (NVIDIA's
recipe states 4.74e14 FLOPs per 8192-token sequence for 8B, 3.94e15 for 70B; torchtitan
computes it in train.py), so the ratio of MFUs is the ratio of tokens per second.

One figure is fitted, not taken from a kernel benchmark: the share of their speed
compute-bound kernels hold through a training run (``Efficiency.sustained``), set so
that the first run (NeMo, 8B on 8) comes out exact; every other run is a prediction.

Sources:

* NVIDIA/dgxc-benchmarking at e6afea3 (NeMo 24.09, Megatron-Core), llama3.1/README_8b.md
  and README_70b.md, BF16 tables: 8B on 8 H100s (TP 1, PP 1, CP 2, MBS 1, GBS 128)
  12.91 s per step, 81,222 tokens/s, MFU 59.37%; on 64 (GBS 1024) 13.08 s, 641,331
  tokens/s, 58.60%; 70B on 64 (TP 4, PP 4, CP 2, VP 5, MBS 1, GBS 128) 14.72 s, 71,235
  tokens/s, 54.10%. NeMo's recipes run the distributed optimizer (ZeRO-1), sequence
  parallelism and tensor-parallel communication overlap.
* pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3:
  Llama 3.1 8B, FSDP (ZeRO-3), local batch 2, sequence 8192, selective activation
  checkpointing, without torch.compile: 5,762 tokens/s per GPU on 8 H100s (the text:
  33% MFU), 5,605 on 128. Their H100s: 96 GB HBM2e (2.4 TB/s), run at 500 W of 700.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from paraxis.planner.efficiency import BUILTIN, H100, Efficiency
from paraxis.planner.evaluate import Plan, evaluate, make_layout
from paraxis.planner.inputs import Hardware, Workload
from paraxis.planner.run_checks import load_counts

__all__ = ["BOUND", "RUNS", "PublishedRun", "predict", "table"]

BOUND = 0.20  # the bound on |predicted / published MFU - 1|
EXAMPLES = Path(__file__).resolve().parents[5] / "examples" / "plan"
TORCHTITAN_H100 = replace(H100, name="H100 96GB HBM2e at 500 W (torchtitan's)",
                          memory_bw=2.4e12, memory=96e9)
NEMO = "NVIDIA/dgxc-benchmarking e6afea3, NeMo 24.09"
TITAN = "pytorch/torchtitan benchmarks/llama3_h100_202412"


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    model: str  # a config.json under examples/plan
    degrees: dict[str, int]
    options: dict[str, Any]
    global_batch: int
    micro_batch: int
    tokens_per_gpu_s: float  # published
    mfu: float | None  # published, where the source states it
    table: str  # the efficiency table of the kernels that framework runs
    seq: int = 8192
    precision: str = "mixed"
    device: Any = None  # the publisher's GPU when it is not the table's
    layout: str = field(default="", compare=False)  # the publisher's words for it

    @property
    def world(self) -> int:
        out = 1
        for d in self.degrees.values():
            out *= d
        return out


_NEMO = {"zero": 1, "sequence_parallel": True, "tensor_overlap": "on"}
RUNS: tuple[PublishedRun, ...] = (
    PublishedRun("8B, 8 H100s", NEMO, "llama-3-8b.json", {"data": 4, "context": 2},
                 {"zero": 1}, 128, 1, 81222 / 8, 0.5937, "h100-te", layout="TP1 PP1 CP2"),
    PublishedRun("8B, 64 H100s", NEMO, "llama-3-8b.json", {"data": 32, "context": 2},
                 {"zero": 1}, 1024, 1, 641331 / 64, 0.5860, "h100-te", layout="TP1 PP1 CP2"),
    PublishedRun("70B, 64 H100s", NEMO, "llama-3-70b.json",
                 {"data": 2, "tensor": 4, "pipeline": 4, "context": 2},
                 {**_NEMO, "pipeline_schedule": "interleaved_1f1b", "virtual_stages": 5},
                 128, 1, 71235 / 64, 0.5410, "h100-te", layout="TP4 PP4 CP2 VP5"),
    PublishedRun("8B, 8 H100s", TITAN, "llama-3-8b.json", {"data": 8},
                 {"zero": 3, "activation_checkpointing": "selective"}, 16, 2, 5762, 0.33,
                 "h100", device=TORCHTITAN_H100, layout="FSDP 8, selective AC"),
    PublishedRun("8B, 128 H100s", TITAN, "llama-3-8b.json", {"data": 128},
                 {"zero": 3, "activation_checkpointing": "selective"}, 256, 2, 5605, None,
                 "h100", device=TORCHTITAN_H100, layout="FSDP 128, selective AC"),
)


def _efficiency(run: PublishedRun) -> Efficiency:
    if isinstance(run.device, Efficiency):  # a trial table (fit_sustained)
        return run.device
    eff = BUILTIN[run.table]
    return replace(eff, device=run.device) if run.device else eff


@functools.lru_cache(maxsize=8)
def _counts(model: str, seq: int) -> Any:
    return load_counts(str(EXAMPLES / model), seq)[0]


def predict(run: PublishedRun) -> Plan:
    """The plan of ``run``'s layout on its hardware and kernels."""
    counts = _counts(run.model, run.seq)
    work = Workload(seq=run.seq, global_batch=run.global_batch, micro_batch=run.micro_batch,
                    precision=run.precision)  # type: ignore[arg-type]
    layout = make_layout(run.degrees, run.options, work)
    return evaluate(counts, layout, work, Hardware(gpus_per_node=8,
                                                   efficiency=_efficiency(run)),
                    simulate=False)


def table() -> str:
    """Markdown: each published run, its figure and ours."""
    rows = ["| run | source | layout | published tokens/s/GPU | predicted | MFU published "
            "| MFU predicted | ratio |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for run in RUNS:
        plan = predict(run)
        ours = plan.step.tokens_per_s / run.world
        mfu = plan.step.mfu
        theirs_mfu = run.mfu or mfu * run.tokens_per_gpu_s / ours  # derived when unstated
        rows.append(f"| {run.name} | {run.source} | {run.layout} ({run.table}) | "
                    f"{run.tokens_per_gpu_s:,.0f} | {ours:,.0f} | {theirs_mfu:.1%} | "
                    f"{mfu:.1%} | {ours / run.tokens_per_gpu_s:.3f} |")
    return "\n".join(rows)


def fit_sustained(run: PublishedRun = RUNS[0]) -> float:
    """The ``sustained`` share at which ``run`` is predicted exactly (bisection)."""
    lo, hi = 0.3, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        trial = replace(run, table="", device=replace(_efficiency(run), sustained=mid))
        if _ratio(trial) > 1:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2


def _ratio(run: PublishedRun) -> float:
    return predict(run).step.tokens_per_s / run.world / run.tokens_per_gpu_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="print the fitted sustained share")
    args = parser.parse_args(argv)
    if args.fit:
        print(f"sustained = {fit_sustained():.4f} (fitted on {RUNS[0].name}, {RUNS[0].source})")
        return 0
    print(table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
