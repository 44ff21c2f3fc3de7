"""Per-rank attention compute of causal ring attention: zigzag versus contiguous shards.

Each rank's ring work is its step plans (:func:`paraxis_seq.ring.step_plan`) run one
after another; this script runs every rank's plans in one process, one thread, on
tensors of the real shapes, so the timings measure compute alone: no transfers, no
contention between ranks sharing cores (CPU time of the thread, the minimum of the
runs). It reports per rank the score elements (analytic) and the forward+backward
seconds, and for each layout the spread max/min and max/mean. Zigzag does the same
work on every rank and should time within 10%; contiguous does not (rank r computes
r + 1 blocks).

    python packages/seq-context/benchmarks/balance.py --ranks 4 --seq 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from paraxis_seq.blockwise import Block, block_backward, block_forward
from paraxis_seq.ring import step_plan


def rank_plans(seq: int, ranks: int, rank: int, layout: str) -> list[Block]:
    plans = [step_plan(seq, ranks, rank, (rank - i) % ranks, layout, True, None)
             for i in range(ranks)]
    return [p for p in plans if p is not None]


def run_rank(plans: list[Block], tensors: list[torch.Tensor], dim: int) -> float:
    """CPU seconds of one rank's forward and backward block computations (thread time:
    on a shared machine wall time also counts the time other processes held the core)."""
    q, k, v, do = tensors
    begin = time.thread_time()
    for p in plans:
        r, c = p.rows, p.cols
        out, lse = block_forward(q[:, r], k[:, c], v[:, c], scale=dim ** -0.5, mask=p.mask,
                                 causal=p.causal)
        delta = (do[:, r] * out).sum(-1).transpose(1, 2)
        block_backward(do[:, r], q[:, r], k[:, c], v[:, c], lse, delta,
                       scale=dim ** -0.5, mask=p.mask, causal=p.causal, out=out)
    return time.thread_time() - begin


def measure(args: argparse.Namespace, layout: str) -> dict[str, object]:
    """Ranks run round-robin, ``repeats`` times, after one warm-up; the minimum per rank
    is its compute time (the least disturbed run)."""
    g = torch.Generator().manual_seed(0)
    shape = (1, args.seq // args.ranks, args.heads, args.dim)
    tensors = [torch.randn(shape, generator=g) for _ in range(4)]
    plans = [rank_plans(args.seq, args.ranks, r, layout) for r in range(args.ranks)]
    seconds = [[] for _ in range(args.ranks)]
    for rep in range(args.repeats + 1):
        for r in range(args.ranks):
            t = run_rank(plans[r], tensors, args.dim)
            if rep:
                seconds[r].append(t)
    best = [min(t) for t in seconds]
    return {
        "scores_per_rank": [sum(p.area for p in ps) for ps in plans],
        "seconds_per_rank": [round(t, 4) for t in best],
        "max_over_min": round(max(best) / min(best), 3),
        "max_over_mean": round(max(best) / statistics.mean(best), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = {layout: measure(args, layout) for layout in ("zigzag", "contiguous")}
    print(json.dumps({"args": vars(args), **report}, indent=2))


if __name__ == "__main__":
    main()
