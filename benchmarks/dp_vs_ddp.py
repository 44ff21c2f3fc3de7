"""paraxis data parallel against torch DistributedDataParallel, paired in one run.

    torchrun --nproc-per-node 2 benchmarks/dp_vs_ddp.py

Three copies of the same model (same init, same batches, AdamW) step in turn, the
order rotating every iteration so neither side always runs first: paraxis
``DataParallel``, torch DDP with the same bucket size, and a compute-only copy that never
synchronizes. Exposed communication of each = its median step time minus the
compute-only median (DESIGN section 7); for paraxis the time blocked in ``finish()`` is
also reported. The last line printed is the ratio paraxis / DDP: the median of per-round
ratios of median step times, its spread over the rounds and the verdict against the
target (:mod:`common`).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from common import machine, median, ratio_line, round_args, rounds, summary, write_section
from torch.nn.parallel import DistributedDataParallel

from paraxis import Grid, ParallelConfig, apply_parallelism, make_plugin_manager, shutdown
from paraxis.testing.models import TinyConfig, TinyTransformer, causal_lm_loss


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    round_args(p, steps=8, warmup=5)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="per-rank batch")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    return p.parse_args()


def main() -> None:
    args = parse()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = TinyConfig(vocab_size=256, hidden_size=args.hidden, num_layers=args.layers,
                     num_heads=8, intermediate_size=4 * args.hidden, seq_length=args.seq)

    def fresh() -> TinyTransformer:
        torch.manual_seed(0)
        return TinyTransformer(cfg)

    config = ParallelConfig.from_kwargs(data=world, bucket_mb=args.bucket_mb)
    grid = Grid.build(config)
    ours, ctx = apply_parallelism(fresh(), grid=grid, config=config,
                                  plugin_manager=make_plugin_manager())
    ddp = DistributedDataParallel(fresh(), bucket_cap_mb=args.bucket_mb)
    local = fresh()
    n_params = sum(p.numel() for p in local.parameters())

    def stepper(model, finish):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step() -> float | None:
            ids = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_length))
            opt.zero_grad(set_to_none=True)
            causal_lm_loss(model(ids), ids).backward()
            blocked = finish()
            opt.step()
            return blocked
        return step

    variants = {
        "paraxis": stepper(ours, ctx.finish_grad_sync),
        "ddp": stepper(ddp, lambda: None),
        "compute_only": stepper(local, lambda: None),
    }
    names = list(variants)
    run = rounds(variants, rounds=args.rounds, steps_per_round=args.steps,
                 warmup=args.warmup)
    med = {k: run.median(k) for k in names}
    blocked = run.blocked
    ratio = summary(run.ratios("paraxis", "ddp"), 1.05)
    exposed = {k: med[k] - med["compute_only"] for k in ("paraxis", "ddp")}
    if rank == 0:
        payload = {"args": vars(args), "world": world, "params": n_params, "machine": machine(),
                   "median_step_s": med, "exposed_comm_s": exposed,
                   "paraxis_blocked_in_finish_s": median(blocked["paraxis"]),
                   "round_medians_s": {k: run.medians(k) for k in names},
                   "ratio_paraxis_over_ddp": ratio}
        table = "\n".join([
            "## Data parallel: paraxis vs torch DDP",
            "",
            f"`torchrun --nproc-per-node {world} benchmarks/dp_vs_ddp.py` "
            f"({n_params / 1e6:.2f}M parameters, hidden {args.hidden}, {args.layers} layers, "
            f"seq {args.seq}, batch {args.batch}/rank, bucket {args.bucket_mb} MiB, gloo; "
            f"{machine()}; {args.rounds} rounds of {args.steps} alternating steps after "
            f"{args.warmup} warm-up)",
            "",
            "| variant | median step (ms) | exposed comm (ms) |",
            "| --- | ---: | ---: |",
            f"| paraxis DataParallel | {med['paraxis'] * 1e3:.1f} | "
            f"{exposed['paraxis'] * 1e3:.1f} (blocked in finish: "
            f"{median(blocked['paraxis']) * 1e3:.1f}) |",
            f"| torch DDP | {med['ddp'] * 1e3:.1f} | {exposed['ddp'] * 1e3:.1f} |",
            f"| compute only (no sync) | {med['compute_only'] * 1e3:.1f} | 0 |",
            "",
            ratio_line("Ratio paraxis / DDP (median step time)", ratio),
        ])
        if not args.no_write:
            write_section("dp_vs_ddp", table, payload)
        for name in names:
            print(f"{name:>13}: median step {med[name] * 1e3:8.2f} ms")
        for name in ("paraxis", "ddp"):
            print(f"{name:>13}: exposed comm {exposed[name] * 1e3:8.2f} ms")
        print(ratio_line("ratio paraxis/ddp (median step time)", ratio, bold=False))
    del ours, ddp, local, ctx, variants
    shutdown(grid)


if __name__ == "__main__":
    main()
