"""A split backward (the I and W of ZB-H1, ZB-V and DualPipeV's drain) on one pipeline
stage: paraxis's deferred linear weight GEMMs (:mod:`paraxis_pp.deferred`) against
torch's graph split (``stage_backward_input`` / ``stage_backward_weight``, what torch's
zero-bubble schedules run), with the whole backward beside them for scale.

    python benchmarks/split_backward.py

The stage is a middle stage of pp_vs_torch's ZB-V: two decoder layers of its Llama
(hidden 256, seq 128, a microbatch of 2), in one process. Each variant's step is one
forward and its backward (I then W for the splits) on its own copy of the same layers;
the variants alternate in rounds (:mod:`common`). Reported: median step times, the
median I and W of each split, and the ratio paraxis / torch (target <= 1.0).
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
from common import (
    build_llama,
    llama_parser,
    machine,
    median,
    ratio_line,
    rounds,
    summary,
    write_section,
)
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from paraxis_pp.deferred import DeferredWeights


class Stage(torch.nn.Module):
    """The model's own decoder layers, called as a pipeline stage calls them."""

    def __init__(self, model: torch.nn.Module, seq: int):
        super().__init__()
        self.layers, self.rotary = model.model.layers, model.model.rotary_emb
        self.register_buffer("positions", torch.arange(seq)[None], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embeddings = self.rotary(x, self.positions)
        for layer in self.layers:
            x = layer(x, position_embeddings=embeddings, position_ids=self.positions)
        return x


def main() -> None:
    p = llama_parser(__doc__, steps=10, warmup=3, layers=2, batch=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    base = Stage(build_llama(args), args.seq)
    stages = {name: copy.deepcopy(base) for name in ("whole", "torch", "paraxis")}
    store = DeferredWeights.install(stages["paraxis"])
    assert store is not None, "every matrix of a Llama stage is a linear weight"
    passes: dict[str, list[float]] = {k: [] for k in ("torch I", "torch W", "paraxis I",
                                                      "paraxis W")}
    g = torch.Generator().manual_seed(0)

    def inputs() -> tuple[torch.Tensor, torch.Tensor]:
        shape = (args.batch, args.seq, args.hidden)
        return (torch.randn(shape, generator=g).requires_grad_(),
                torch.randn(shape, generator=g))

    def whole() -> None:
        x, dy = inputs()
        stages["whole"](x).backward(dy)
        stages["whole"].zero_grad(set_to_none=True)

    def split(name: str) -> None:
        stage, (x, dy) = stages[name], inputs()
        out = stage(x)
        start = time.perf_counter()
        if name == "torch":
            _, groups = stage_backward_input([out], [dy], [x], stage.parameters())
        else:
            taken = store.backward_input([out], [dy])
        middle = time.perf_counter()
        if name == "torch":
            stage_backward_weight(stage.parameters(), groups)
        else:
            DeferredWeights.weight(taken)
        passes[f"{name} I"].append(middle - start)
        passes[f"{name} W"].append(time.perf_counter() - middle)
        stage.zero_grad(set_to_none=True)

    run = rounds({"whole backward": whole, "torch split": lambda: split("torch"),
                  "paraxis split": lambda: split("paraxis")},
                 rounds=args.rounds, steps_per_round=args.steps, warmup=args.warmup)
    ratio = summary(run.ratios("paraxis split", "torch split"), 1.0)
    med = {k: run.median(k) * 1e3 for k in run.walls}
    split_ms = {k: median(v) * 1e3 for k, v in passes.items()}
    table = "\n".join([
        "## Split backward on one stage: paraxis's deferred weight GEMMs vs torch's "
        "graph split",
        "",
        f"`python benchmarks/split_backward.py` (a middle stage of pp_vs_torch's ZB-V: "
        f"{args.layers} Llama decoder layers, hidden {args.hidden}, seq {args.seq}, a "
        f"microbatch of {args.batch}; {machine()}; {args.rounds} rounds of {args.steps} "
        f"alternating steps after {args.warmup} warm-up; a step = forward + backward)",
        "",
        "| variant | median step (ms) | I (ms) | W (ms) |",
        "| --- | ---: | ---: | ---: |",
        f"| whole backward | {med['whole backward']:.2f} | | |",
        f"| torch `stage_backward_input` / `_weight` | {med['torch split']:.2f} | "
        f"{split_ms['torch I']:.2f} | {split_ms['torch W']:.2f} |",
        f"| paraxis deferred weight GEMMs | {med['paraxis split']:.2f} | "
        f"{split_ms['paraxis I']:.2f} | {split_ms['paraxis W']:.2f} |",
        "",
        ratio_line("Ratio paraxis / torch (median step time)", ratio),
    ])
    if not args.no_write:
        write_section("split_backward", table, {"args": vars(args), "median_step_ms": med,
                                                "passes_ms": split_ms, "ratio": ratio})
    print(table)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
