"""``train.compile`` (TorchInductor, per layer) against eager, paired in one run.

    python benchmarks/compile.py [--layout tensor2_sp|data2]

Two engines over the same model and batches on 2 gloo ranks, one with every layer
compiled by TorchInductor (``train.compile: true``), one eager, step in turn; the first
compiled step (compilation) is timed apart and the warm-up absorbs recompilations (the
probe's shapes, train mode). Reported: the ratio compiled / eager of median step times
per round, its median and spread, the compile time, and the graphs and graph breaks
dynamo counted. No target: this is what regional compilation buys on a 2-core CPU.
"""

from __future__ import annotations

import time

import torch
from common import build_llama, llama_parser, machine, ratio_line, rounds, summary, write_section

from paraxis.testing import run_distributed

LAYOUTS = {"tensor2_sp": {"tensor": 2, "sequence_parallel": True}, "data2": {"data": 2}}


def paired(args) -> dict:
    import paraxis

    degrees = LAYOUTS[args.layout]
    engines, first_step = {}, {}
    index = count = None
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 256, (args.batch, args.seq), generator=g)

    for name, setting in (("eager", False), ("compiled", True)):
        engine = paraxis.parallelize(build_llama(args), **degrees, train={
            "seq_length": args.seq, "compile": setting, "steps": 1000}, verify=False)
        index, count = engine.grid.sample_shard()
        share = batch[index * args.batch // count:(index + 1) * args.batch // count]
        start = time.perf_counter()
        engine.train_step(share)
        first_step[name] = time.perf_counter() - start
        engines[name] = engine

    def stepper(engine):
        def step() -> None:
            ids = torch.randint(0, 256, (args.batch, args.seq), generator=g)
            engine.train_step(ids[index * args.batch // count:
                                  (index + 1) * args.batch // count])
        return step

    run = rounds({k: stepper(e) for k, e in engines.items()}, rounds=args.rounds,
                 steps_per_round=args.steps, warmup=args.warmup)
    from torch._dynamo.utils import counters

    out = {"ratios": run.ratios("compiled", "eager"),
           "median_s": {k: run.median(k) for k in engines}, "first_step_s": first_step,
           "graphs": int(counters["stats"]["unique_graphs"]),
           "graph_breaks": int(sum(counters["graph_break"].values())),
           "breaks_by_reason": {str(k)[:120]: v for k, v in
                                counters["graph_break"].most_common(3)}}
    for engine in engines.values():
        engine.close()
    return out


def main() -> None:
    p = llama_parser(__doc__, steps=6, warmup=3, layers=4, batch=4)
    p.add_argument("--layout", choices=list(LAYOUTS), default="tensor2_sp")
    args = p.parse_args()
    r = run_distributed(paired, 2, args, timeout=3600)[0]
    ratio = summary(r["ratios"], None)
    table = "\n".join([
        f"## Compile: TorchInductor per layer against eager ({args.layout})",
        "",
        f"`python benchmarks/compile.py --layout {args.layout}` (Llama hidden "
        f"{args.hidden}, {args.layers} layers, seq {args.seq}, batch {args.batch}, 2 gloo "
        f"ranks; {machine()}; {args.rounds} rounds of {args.steps} alternating steps "
        f"after {args.warmup} warm-up)",
        "",
        "| variant | first step (s) | median step (ms) |",
        "| --- | ---: | ---: |",
        *(f"| {k} | {r['first_step_s'][k]:.1f} | {r['median_s'][k] * 1e3:.1f} |"
          for k in ("eager", "compiled")),
        "",
        ratio_line("Step time compiled / eager", ratio),
        "",
        f"Dynamo compiled {r['graphs']} graphs with {r['graph_breaks']} graph breaks "
        "(paraxis's collectives run from hooks, eagerly, between compiled pieces); most "
        f"frequent reasons: {r['breaks_by_reason']}.",
    ])
    if not args.no_write:
        write_section(f"compile_{args.layout}", table, {"args": vars(args), **r,
                                                         "ratio": ratio})
    print(table)


if __name__ == "__main__":
    main()
