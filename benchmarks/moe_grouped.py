"""Grouped expert GEMMs against the per-expert loop, paired (issue 22, item 4).

    python benchmarks/moe_grouped.py            # one process; fp32, bf16 and fp64

A rank's local experts (transformers' ``MixtralExperts`` from config: hidden 256, expert
intermediate 512, SwiGLU) compute the rows an all-to-all handed them, as
``ExpertParallelExperts._local_experts`` calls them (local expert ids, unit weights):
``--rows`` rows per local expert on average, routed uniformly at random (the same rows
for every variant and step), forward and backward. At 4 and 16 local experts, three
ways alternate step by step (:func:`common.rounds`):

* ``loop``: the family's own per-expert loop (``experts_implementation="eager"``);
* ``grouped_mm``: transformers' ``grouped_mm`` (one ``torch.nn.functional.grouped_mm``
  per projection over the experts' row ranges), where torch has a kernel for the dtype;
* ``padded_bmm``: paraxis's grouped form where it has none
  (:func:`paraxis_moe.grouped.padded_bmm_forward`: rows padded to the busiest expert).

The ratio line is grouped / loop (grouped = ``grouped_mm`` where it runs, else
``padded_bmm``: what :func:`paraxis_moe.grouped.local_kernel` would pick) per (dtype,
experts): target <= 1.0, by the rounds rule of :mod:`common`. The grouped form is the
default only where the whole spread meets it (:data:`paraxis_moe.grouped.GROUPED_DEFAULT`).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from common import machine, ratio_line, round_args, rounds, summary, write_section

from paraxis_moe.grouped import grouped_mm_available, padded_bmm_forward

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    round_args(p, steps=6, warmup=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--rows", type=int, default=128, help="rows per local expert (mean)")
    p.add_argument("--experts", default="4,16", help="local expert counts")
    p.add_argument("--dtypes", default="float32,bfloat16,float64")
    return p.parse_args()


def build_experts(args: argparse.Namespace, n: int, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("mixtral", hidden_size=args.hidden,
                               intermediate_size=args.intermediate, num_local_experts=n)
    experts = MixtralExperts(cfg)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.05)
    return experts.to(dtype)


def variants(args: argparse.Namespace, n: int, dtype: torch.dtype) -> dict:
    """name -> one forward + backward of the local experts, all on the same rows."""
    experts = build_experts(args, n, dtype)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(args.rows * n, args.hidden, generator=g).to(dtype).requires_grad_()
    ids = torch.randint(0, n, (args.rows * n, 1), generator=g)
    ones = torch.ones(ids.shape, dtype=dtype)

    def run(fn) -> None:
        fn(x, ids, ones).float().square().mean().backward()
        experts.zero_grad(set_to_none=True)
        x.grad = None

    def with_implementation(name: str):
        def step() -> None:
            experts.config._experts_implementation = name
            run(experts)
        return step

    out = {"loop": with_implementation("eager")}
    if grouped_mm_available(torch.device("cpu"), dtype):
        out["grouped_mm"] = with_implementation("grouped_mm")
    out["padded_bmm"] = lambda: run(lambda *a: padded_bmm_forward(experts, *a))
    return out


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    results = []
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        for n in (int(e) for e in args.experts.split(",")):
            steps = variants(args, n, dtype)
            r = rounds(steps, rounds=args.rounds, steps_per_round=args.steps,
                       warmup=args.warmup)
            grouped = "grouped_mm" if "grouped_mm" in steps else "padded_bmm"
            row = {"dtype": dtype_name, "experts": n, "grouped": grouped,
                   "ms": {k: 1e3 * r.median(k) for k in steps},
                   "ratio": summary(r.ratios(grouped, "loop"), 1.0),
                   "padded_ratio": summary(r.ratios("padded_bmm", "loop"), 1.0)}
            results.append(row)
            print(f"{dtype_name} E={n}: " + ", ".join(f"{k} {v:.1f} ms"
                                                     for k, v in row["ms"].items()))
            print(ratio_line(f"{grouped} / loop", row["ratio"], bold=False))
    dist.destroy_process_group()
    write(args, results)


def write(args: argparse.Namespace, results: list[dict]) -> None:
    lines = [
        "## Grouped expert GEMMs: one grouped matmul per projection vs the per-expert loop",
        "",
        f"`python benchmarks/moe_grouped.py` (a rank's local experts: transformers' "
        f"`MixtralExperts` from config, hidden {args.hidden}, expert intermediate "
        f"{args.intermediate}, {args.rows} rows per local expert on average, uniform "
        f"routing, forward + backward; {machine()}; {args.rounds} rounds of {args.steps} "
        f"alternating steps after {args.warmup} warm-up). Grouped: transformers' "
        "`grouped_mm` (torch's grouped matmul) where torch has the kernel, else paraxis's "
        "padded `bmm`.",
        "",
        "| dtype | local experts | loop (ms) | grouped_mm (ms) | padded bmm (ms) "
        "| grouped / loop | padded bmm / loop |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for row in results:
        ms, s, p = row["ms"], row["ratio"], row["padded_ratio"]
        gm = f"{ms['grouped_mm']:.1f}" if "grouped_mm" in ms else "no kernel"
        lines.append(
            f"| {row['dtype']} | {row['experts']} | {ms['loop']:.1f} | {gm} | "
            f"{ms['padded_bmm']:.1f} | {s['median']:.3f} [{s['min']:.3f}–{s['max']:.3f}] "
            f"{s['verdict']} | {p['median']:.3f} [{p['min']:.3f}–{p['max']:.3f}] |")
    lines.append("")
    for row in results:
        lines.append(ratio_line(f"{row['grouped']} / loop, {row['dtype']}, "
                                f"{row['experts']} local experts", row["ratio"]) + "  ")
    lines += ["", "The grouped form is the default for a (device, dtype) only where every "
              "grouped / loop spread above meets the target "
              "(`paraxis_moe.grouped.GROUPED_DEFAULT`); GPUs are not measured here, and "
              "there the model's own choice (transformers' `grouped_mm`) stands."]
    if not args.no_write:
        write_section("moe_grouped", "\n".join(lines), {"rows": results})


if __name__ == "__main__":
    main()
