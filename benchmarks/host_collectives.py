"""Host all-gather and reduce-scatter: paraxis's (one broadcast per rank; an in-place
all-reduce of a send buffer the caller gives up) against torch's gloo ops, memory and
time paired in the same run (issue 36, item 5).

    torchrun --nproc-per-node 4 benchmarks/host_collectives.py
    torchrun --nproc-per-node 8 benchmarks/host_collectives.py --mib 32 --no-write

gloo's ``all_gather_into_tensor`` gathers into a temporary as large as the output and
``reduce_scatter_tensor`` clones its input (:mod:`paraxis.runtime.host_collectives`).
Each variant's transient is the peak resident set during the call over the resident set
before it (sampled every millisecond by a thread, the output and input already
touched), the worst over every measured call on rank 0; time is the paired rule's
(rounds of alternating calls; ratio paraxis / torch, target <= 1.0).
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
import torch.distributed as dist
from common import machine, ratio_line, round_args, rounds, summary, write_section

from paraxis.runtime.collectives import all_gather_into, reduce_scatter_into
from paraxis.runtime.grid import Grid

MiB = 1 << 20


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Peak:
    """The resident set's peak over a call, sampled by a thread (reading and keeping a
    sample under one lock: a sample read before the reset is never kept after it)."""

    def __init__(self) -> None:
        self.peak, self.on, self.lock = 0, True, threading.Lock()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while self.on:
            with self.lock:
                self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def over(self, fn) -> int:
        time.sleep(0.005)
        with self.lock:
            before = self.peak = rss()
        fn()
        time.sleep(0.005)
        with self.lock:
            return self.peak - before


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=122.0, help="size of the whole tensor")
    round_args(p, steps=4, warmup=1)
    args = p.parse_args()
    dist.init_process_group("gloo")
    grid = Grid.build({"data": dist.get_world_size()})
    group, n = grid.group("data"), grid.world_size
    per = int(args.mib * MiB / 4) // n
    part, whole = torch.ones(per), torch.zeros(n * per)
    send, out = torch.ones(n * per), torch.zeros(per)
    peak = Peak()
    worst: dict[str, int] = {}

    def measured(name, fn):
        def run() -> None:
            worst[name] = max(worst.get(name, 0), peak.over(fn))
        return run

    def fresh() -> None:
        send.fill_(1.0)

    ops = {
        "gather torch": lambda: dist.all_gather_into_tensor(whole, part, group=group.pg),
        "gather paraxis": lambda: all_gather_into(whole, part, group),
        "scatter torch": lambda: (fresh(), dist.reduce_scatter_tensor(out, send,
                                                                      group=group.pg)),
        "scatter paraxis": lambda: (fresh(), reduce_scatter_into(out, send, group,
                                                                 consume=True)),
    }
    run = rounds({k: measured(k, fn) for k, fn in ops.items()}, rounds=args.rounds,
                 steps_per_round=args.steps, warmup=args.warmup)
    assert torch.all(whole == 1) and torch.all(out == n)
    lines, payload = [], {"worst_transient_bytes": worst, "mib": args.mib, "ranks": n}
    for op in ("gather", "scatter"):
        s = summary(run.ratios(f"{op} paraxis", f"{op} torch"), 1.0)
        payload[op] = s
        lines.append(f"- {'all-gather' if op == 'gather' else 'reduce-scatter'}: "
                     f"transient torch +{worst[f'{op} torch'] / MiB:.0f} MiB, paraxis "
                     f"+{worst[f'{op} paraxis'] / MiB:.0f} MiB; " +
                     ratio_line("time paraxis / torch", s))
    if grid.rank == 0:
        text = "\n".join([
            "## Host collectives without gloo's copies: paraxis against torch's gloo ops",
            "",
            f"`torchrun --nproc-per-node {n} benchmarks/host_collectives.py` ({args.mib:.0f}"
            f" MiB fp32 tensor over {n} ranks, gloo; {machine()}; {args.rounds} rounds of "
            f"{args.steps} alternating calls after {args.warmup}). Transient: the worst "
            "peak resident set over a call above the one before it, rank 0.", "", *lines])
        print(text)
        if not args.no_write:
            write_section("host_collectives", text, payload)
    grid.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
