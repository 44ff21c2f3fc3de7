"""Token-balanced batches against contiguous shares, paired in one run (issue 23, item 5).

    torchrun --nproc-per-node 2 benchmarks/token_balance.py

Unpacked rows (one document each, right-padded, :class:`paraxis.train.balance.PaddedRows`)
with lengths from a long-tailed log-normal (median ``--median`` tokens, capped at
``--seq``), the same global batches in the same order for both variants:

* ``contiguous``: :class:`~paraxis.train.data.BatchStream`, rank r takes rows
  [r B/R, (r+1) B/R) of each global batch, as every other run does;
* ``balanced``: :class:`~paraxis.train.balance.TokenBalancedStream`
  (``data.balance_tokens``), rows assigned by real tokens, largest first.

Each rank cuts its rows to its longest (a multiple of 8). Per step and variant, three
figures: the real tokens per rank (max / min over ranks); the compute spread, the
slowest minus the fastest rank's forward + backward of its share on a copy that never
synchronizes (what the fastest rank waits at the gradient reduction, the
``straggler_spread_s`` of a step before synchronization hides it); and the paraxis data
parallel step (:meth:`Engine.train_step`'s ``step_time_s``, the slowest rank's). The
ratio lines are balanced / contiguous per round (:mod:`common`'s rule): the compute
spread and the synchronized step, target <= 1.0.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch
import torch.distributed as dist
from common import machine, ratio_line, round_args, rounds, summary, write_section

import paraxis
from paraxis.models.tiny import TinyConfig, TinyTransformer
from paraxis.parallel.batch import Batch
from paraxis.train.balance import PaddedRows, TokenBalancedStream
from paraxis.train.data import BatchStream


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    round_args(p, steps=6, warmup=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--median", type=int, default=90, help="median document length")
    p.add_argument("--batch", type=int, default=16, help="global batch (rows)")
    return p.parse_args()


def corpus(args: argparse.Namespace, n: int = 4096) -> PaddedRows:
    """``n`` documents of random tokens, log-normal lengths (sigma 1: a long tail)."""
    rng = random.Random(0)
    lengths = [min(args.seq, max(2, int(rng.lognormvariate(
        float(torch.tensor(args.median).log()), 1.0)))) for _ in range(n)]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 256, (n, args.seq), generator=g)
    ids *= torch.arange(args.seq) < torch.tensor(lengths)[:, None]
    return PaddedRows(ids, torch.tensor(lengths), multiple=8)


def gather(x: float) -> list[float]:
    out = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([x], dtype=torch.float64))
    return [float(t) for t in out]


def variant(stream: BatchStream, engine, local: TinyTransformer, log: dict) -> callable:
    """One step: the compute-only forward + backward (timed between barriers, gathered),
    then the engine's synchronized step on the same rows (its wall time is the step)."""

    def step() -> None:
        batch = stream.next_batch()
        rows = Batch.from_user(batch)
        dist.barrier()
        start = time.perf_counter()
        logits = local(rows.input_ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows.targets.flatten(),
                                                 ignore_index=-100, reduction="sum")
        loss.backward()
        local.zero_grad(set_to_none=True)
        times = gather(time.perf_counter() - start)
        tokens = gather(float(batch["attention_mask"].sum()))
        log["spread_s"].append(max(times) - min(times))
        log["tokens_ratio"].append(max(tokens) / min(tokens))
        dist.barrier()
        metrics = engine.train_step(batch)
        log["step_s"].append(metrics["step_time_s"])
        log["straggler_spread_s"].append(metrics["straggler_spread_s"])
    return step


def main() -> None:
    args = parse()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = TinyConfig(vocab_size=256, hidden_size=args.hidden, num_layers=args.layers,
                     num_heads=4, intermediate_size=4 * args.hidden, seq_length=args.seq)
    rows = corpus(args)
    steps, logs = {}, {}
    for name, kind in (("contiguous", BatchStream), ("balanced", TokenBalancedStream)):
        torch.manual_seed(0)
        engine = paraxis.parallelize(TinyTransformer(cfg), data=world, train={
            "seq_length": args.seq, "global_batch": args.batch, "lr": 1e-4,
            "warmup_steps": 0}, verify=False)
        torch.manual_seed(0)
        logs[name] = {"spread_s": [], "tokens_ratio": [], "step_s": [],
                      "straggler_spread_s": []}
        stream = kind(rows, global_batch=args.batch, rank=rank, ranks=world, seed=1)
        steps[name] = variant(stream, engine, TinyTransformer(cfg), logs[name])
    rounds(steps, rounds=args.rounds, steps_per_round=args.steps, warmup=args.warmup)
    measured = {n: {k: v[args.warmup:] for k, v in log.items()} for n, log in logs.items()}
    if rank == 0:
        report(args, world, measured)
    dist.destroy_process_group()


def per_round(xs: list[float], per: int) -> list[float]:
    return [statistics.median(xs[i:i + per]) for i in range(0, len(xs), per)]


def report(args: argparse.Namespace, world: int, measured: dict) -> None:
    per = args.steps
    spread = {n: per_round(m["spread_s"], per) for n, m in measured.items()}
    step = {n: per_round(m["step_s"], per) for n, m in measured.items()}
    ratios = {
        "tokens": {n: statistics.median(m["tokens_ratio"]) for n, m in measured.items()},
        "tokens_p90": {n: sorted(m["tokens_ratio"])[int(0.9 * len(m["tokens_ratio"]))]
                       for n, m in measured.items()},
        "spread": summary([b / c for b, c in zip(spread["balanced"], spread["contiguous"],
                                                  strict=True)], 1.0),
        "step": summary([b / c for b, c in zip(step["balanced"], step["contiguous"],
                                                strict=True)], 1.0),
    }
    lines = [
        "## Token-balanced batches: balanced vs contiguous shares of variable-length rows",
        "",
        f"`torchrun --nproc-per-node {world} benchmarks/token_balance.py` (tiny model, "
        f"hidden {args.hidden}, {args.layers} layers; unpacked rows of log-normal lengths, "
        f"median {args.median}, capped at {args.seq}; global batch {args.batch} over "
        f"data {world}, each rank's rows cut to its longest; gloo; {machine()}; "
        f"{args.rounds} rounds of {args.steps} alternating steps after {args.warmup} "
        "warm-up). Spread: slowest minus fastest rank's forward + backward per step, "
        "no synchronization; step: the paraxis data parallel step's `step_time_s` (its "
        "slowest rank's).",
        "",
        "| variant | real tokens max/min per step, median (p90) | compute spread (ms), "
        "median [round min–max] | step (ms) | engine straggler_spread_s (ms) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for n, m in measured.items():
        lines.append(
            f"| {n} | {ratios['tokens'][n]:.3f} ({ratios['tokens_p90'][n]:.3f}) | "
            f"{1e3 * statistics.median(m['spread_s']):.1f} "
            f"[{1e3 * min(spread[n]):.1f}–{1e3 * max(spread[n]):.1f}] | "
            f"{1e3 * statistics.median(m['step_s']):.1f} | "
            f"{1e3 * statistics.median(m['straggler_spread_s']):.1f} |")
    lines += ["", ratio_line("Compute spread, balanced / contiguous", ratios["spread"]) + "  ",
              ratio_line("Step time, balanced / contiguous", ratios["step"]), "",
              "The engine's own `straggler_spread_s` is measured after the gradient "
              "reduction, where the fast rank has already waited for the slow one; the "
              "compute spread is the wait itself. A rank pays its rows times its longest "
              "row (its rows are padded to it), and the rank holding the batch's longest "
              "row bounds the step under either assignment: balancing real tokens "
              "shortens the others' wait more than the step."]
    print("\n".join(lines))
    if not args.no_write:
        write_section("token_balance", "\n".join(lines), {"args": vars(args), **ratios,
                                                          "measured": measured})


if __name__ == "__main__":
    main()
