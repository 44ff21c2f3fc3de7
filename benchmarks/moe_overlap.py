"""Chunked, overlapped expert dispatch (``moe.dispatch_chunks``) against the same layout
without it, paired, on expert=2.

    torchrun --nproc-per-node 2 benchmarks/moe_overlap.py

moe_vs_peer.py's Mixtral (built from config) is laid out over expert=2 (2 ranks, each its
own tokens) once per chunk count (``--chunks``, 1 = today's blocking exchanges, first);
steps alternate; per round, the ratios chunked / 1 of the median step time and of the
median exposed all-to-all time (``moe/dispatch_s``: seconds the busiest rank of each
layer sat blocked in the expert axis's all-to-alls, forward and backward, summed over
layers). Also reported: ``moe/a2a_exposed_share`` (blocked / the exchanges' lifetime
from launch to the end of the wait; 1 at one chunk) and the exposed time against the
step. First-step losses are checked equal (parity). The section is ``moe_overlap`` at
the default width, ``moe_overlap_h<hidden>`` at another ``--hidden``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from common import (
    build_mixtral,
    machine,
    median,
    ratio_line,
    round_args,
    rounds,
    summary,
    write_section,
)

import paraxis
from paraxis import shutdown


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    round_args(p, steps=6, warmup=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4])
    return p.parse_args()


def main() -> None:
    args = parse()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    engines = {c: paraxis.parallelize(
        build_mixtral(args), expert=world, moe={"dispatch_chunks": c},
        train={"steps": 10**6, "lr": 1e-4, "warmup_steps": 0, "seq_length": args.seq})
        for c in args.chunks}
    g = torch.Generator().manual_seed(1 + rank)
    fixed = torch.randint(0, 256, (args.batch, args.seq), generator=g)
    first = {c: e.train_step(fixed)["loss"] for c, e in engines.items()}
    shares: dict[int, list[float]] = {c: [] for c in args.chunks}

    def stepper(c: int):
        def step() -> float:
            m = engines[c].train_step(torch.randint(0, 256, (args.batch, args.seq),
                                                    generator=g))
            shares[c].append(m["moe/a2a_exposed_share"])
            return m["moe/dispatch_s"]
        return step

    load = os.getloadavg()[0]
    r = rounds({str(c): stepper(c) for c in args.chunks}, rounds=args.rounds,
               steps_per_round=args.steps, warmup=args.warmup)
    load_end = os.getloadavg()[0]
    if rank == 0:
        report(args, r, first, shares, (load, load_end))
    for e in engines.values():
        e.close()
    shutdown()


def per_round(xs: list[float], n: int) -> list[float]:
    return [median(xs[i:i + n]) for i in range(0, len(xs), n)]


def report(args, r, first, shares, load) -> None:
    base = str(args.chunks[0])
    exposed = {c: per_round(r.blocked[c], args.steps) for c in r.walls}
    rows = [f"| {c} | {1e3 * r.median(c):.1f} | {1e3 * median(r.blocked[c]):.1f} | "
            f"{median(shares[int(c)][args.warmup:]):.3f} | "
            f"{median(r.blocked[c]) / r.median(c):.3f} |" for c in r.walls]
    lines, payload = [], {"args": vars(args), "first_loss": first, "load": load}
    for c in list(r.walls)[1:]:
        steps = summary(r.ratios(c, base), 1.0)
        exp = summary([a / b for a, b in zip(exposed[c], exposed[base], strict=True)], 1.0)
        payload[c] = {"step": steps, "exposed": exp}
        lines += [ratio_line(f"Exposed all-to-all time, chunks {c} / {base}", exp),
                  ratio_line(f"Step time, chunks {c} / {base}", steps)]
    same = len({round(v, 6) for v in first.values()}) == 1
    losses = ", ".join(f"chunks {c}: {v:.6f}" for c, v in first.items())
    command = (f"torchrun --nproc-per-node 2 benchmarks/moe_overlap.py --hidden {args.hidden} "
               f"--seq {args.seq} --steps {args.steps} --warmup {args.warmup}")
    setup = (f"Mixtral from config: hidden {args.hidden}, FFN {2 * args.hidden}, "
             f"{args.layers} layers, {args.experts} experts top-{args.top_k}, seq {args.seq}, "
             f"batch {args.batch} per rank; expert=2, gloo; {machine()}; {args.rounds} rounds "
             f"of {args.steps} alternating steps after {args.warmup} warm-up; first-step "
             f"loss {losses}{' (equal)' if same else ' (DIFFERENT)'}; load average "
             f"{load[0]:.1f} at the start, {load[1]:.1f} at the end")
    header = ("| dispatch_chunks | median step (ms) | median exposed all-to-all (ms) | "
              "median `moe/a2a_exposed_share` | exposed / step |")
    md = "\n".join([
        "## Overlapped expert dispatch: chunks of tokens, all-to-all beside the expert "
        "compute", "", f"`{command}` ({setup})", "", header,
        "| --- | ---: | ---: | ---: | ---: |", *rows, "", *(x + "\n" for x in lines)])
    print(md)
    if not args.no_write:
        write_section("moe_overlap" if args.hidden == 256 else f"moe_overlap_h{args.hidden}",
                      md, payload)
    print(lines[-1])


if __name__ == "__main__":
    main()
