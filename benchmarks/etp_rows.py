"""Expert tensor parallelism's uneven row exchanges, point-to-point against the
all-to-all of the rows repeated that they replaced, paired, on gloo.

    torchrun --nproc-per-node 2 benchmarks/etp_rows.py

One step: ``gather_rows`` of this rank's rows (uneven: rank r holds ``rows + 64 r``),
a scale standing in for the split FFN, ``scatter_sum_rows`` back, and the backward of
both. ``repeat`` is the exchange as it was (core's ``all_to_all_uneven`` of
``x.repeat(n)``, and of the partials with a view-and-sum), ``p2p`` is paraxis_moe's
today. Steps alternate; per round, the ratio p2p / repeat of the median step time.
Outputs and input gradients are checked equal first. The memory they allocate is
counted exactly by packages/moe-ep/tests/test_moe_expert_rows.py (the gather: the
gathered rows only, against ``n`` copies of a rank's rows besides).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from common import machine, ratio_line, round_args, rounds, summary, write_section

from paraxis.runtime.differentiable import all_to_all_uneven
from paraxis.runtime.grid import Grid, shutdown
from paraxis_moe.expert_tensor import gather_rows, scatter_sum_rows


def _repeat_gather(x, group, counts):
    n = group.size
    return all_to_all_uneven(x.repeat(n, 1), group, [x.shape[0]] * n, counts)


def _repeat_scatter(x, group, counts):
    n, mine = group.size, counts[group.rank]
    parts = all_to_all_uneven(x, group, counts, [mine] * n, narrow=False)
    return parts.view(n, mine, *x.shape[1:]).sum(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    round_args(p, steps=10, warmup=3)
    p.add_argument("--rows", type=int, default=4096, help="rows on rank 0")
    p.add_argument("--hidden", type=int, default=1024)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    grid = Grid.build({"tensor": dist.get_world_size()})
    group, n, rank = grid.group("tensor"), grid.world_size, grid.rank
    counts = [args.rows + 64 * r for r in range(n)]
    x = torch.randn(counts[rank], args.hidden,
                    generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
    ways = {"repeat": (_repeat_gather, _repeat_scatter),
            "p2p": (gather_rows, scatter_sum_rows)}

    def step(name: str):
        gather, scatter = ways[name]
        out = scatter(gather(x, group, counts) * 0.5, group, counts)
        out.sum().backward()
        grad, x.grad = x.grad, None
        return out.detach(), grad

    same = [torch.equal(a, b) for a, b in zip(step("repeat"), step("p2p"), strict=True)]
    load = os.getloadavg()[0]
    def runner(name: str):
        def run() -> None:
            step(name)
        return run

    r = rounds({k: runner(k) for k in ways}, rounds=args.rounds,
               steps_per_round=args.steps, warmup=args.warmup)
    load_end = os.getloadavg()[0]
    if rank == 0:
        s = summary(r.ratios("p2p", "repeat"), 1.0)
        line = ratio_line("Step time, p2p / repeat", s)
        command = (f"torchrun --nproc-per-node {n} benchmarks/etp_rows.py --rows {args.rows} "
                   f"--hidden {args.hidden} --steps {args.steps} --warmup {args.warmup}")
        md = "\n".join([
            "## Expert tensor parallelism's uneven row exchanges: point-to-point against "
            "an all-to-all of the rows repeated", "",
            f"`{command}` ({n} ranks, gloo, rows {counts}, hidden {args.hidden}, fp32; "
            f"{machine()}; {args.rounds} rounds of {args.steps} alternating steps after "
            f"{args.warmup} warm-up; outputs and gradients equal: {all(same)}; load "
            f"average {load:.1f} at the start, {load_end:.1f} at the end)", "",
            "| way | median step (ms) |", "| --- | ---: |",
            *(f"| {k} | {1e3 * r.median(k):.1f} |" for k in ways), "", line])
        print(md)
        if not args.no_write:
            write_section("etp_rows", md, {"args": vars(args), "step": s, "same": same})
        print(line)
    shutdown(grid)


if __name__ == "__main__":
    main()
