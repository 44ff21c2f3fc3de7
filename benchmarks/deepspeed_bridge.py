"""The DeepSpeed offload bridge against DeepSpeed driven directly, paired in one run.

    torchrun --nproc-per-node 2 benchmarks/deepspeed_bridge.py

Both sides run DeepSpeed's engine with the *same* generated config (the bridge's own
translation, ZeRO-3 with optimizer and parameters offloaded to the CPU by default) on
the same model and batches, stepping in turn, the order rotating every round. The
bridge's step is ``Engine.train_step`` (batch preparation, the global token count,
microbatching through ``ctx.backward``, DeepSpeed's step, the schedule, the metrics
gather and DeepSpeed's resident-bytes accounting); the direct step is the loop a
DeepSpeed user writes (``engine(x)``, ``engine.backward``, ``engine.step`` per
microbatch). The last line printed is the bridge overhead ratio bridge / direct (median
of per-round ratios of median step times, spread, verdict against the target <= 1.02;
:mod:`common`).

paraxis zero-shard against DeepSpeed at the same stage without offload is
``benchmarks/zero_vs_deepspeed.py``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from common import machine, ratio_line, round_args, rounds, summary, write_section

import paraxis
from paraxis.models.tiny import TinyConfig, TinyTransformer


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    round_args(p, steps=4, warmup=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="per-rank batch")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--zero", type=int, default=3)
    return p.parse_args()


def main() -> None:
    args = parse()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    import deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = TinyConfig(vocab_size=256, hidden_size=args.hidden, num_layers=args.layers,
                     num_heads=8, intermediate_size=4 * args.hidden, seq_length=args.seq)
    offload = {"optimizer": "cpu", "parameters": "cpu" if args.zero == 3 else "none"}
    train = {"lr": 1e-4, "warmup_steps": 0, "steps": 10_000, "seq_length": args.seq,
             "global_batch": args.batch * world}

    def fresh() -> TinyTransformer:
        torch.manual_seed(0)
        return TinyTransformer(cfg)

    bridge = paraxis.parallelize(fresh(), data=world, zero=args.zero, offload=offload,
                                 microbatches=args.microbatches, train=train, verify=False)
    ds_config = bridge.ctx.extras["offload"]["deepspeed_config"]
    model = fresh()
    direct, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config)
    n_params = sum(p.numel() for p in fresh().parameters())
    gen = torch.Generator().manual_seed(rank)

    def batch() -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=gen)

    def bridge_step() -> None:
        bridge.train_step(batch())

    def direct_step() -> None:
        for ids in batch().chunk(args.microbatches):
            logits = direct(ids)
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, cfg.vocab_size).float(), ids[:, 1:].reshape(-1))
            direct.backward(loss)
            direct.step()

    variants = {"bridge": bridge_step, "direct": direct_step}
    run = rounds(variants, rounds=args.rounds, steps_per_round=args.steps,
                 warmup=args.warmup)
    if rank == 0:
        report(args, world, n_params, run, ds_config)
    bridge.close()
    direct.destroy()
    paraxis.shutdown()


def report(args, world, n_params, run, ds_config) -> None:
    med = {k: run.median(k) for k in run.walls}
    ratio = summary(run.ratios("bridge", "direct"), 1.02)
    zero = ds_config["zero_optimization"]
    where = ", ".join(f"{k.removeprefix('offload_')} -> {v['device']}"
                      for k, v in zero.items() if k.startswith("offload_"))
    table = "\n".join([
        "## DeepSpeed bridge: paraxis offload vs DeepSpeed driven directly",
        "",
        f"`torchrun --nproc-per-node {world} benchmarks/deepspeed_bridge.py` "
        f"({n_params / 1e6:.2f}M parameters, tiny model hidden {args.hidden}, "
        f"{args.layers} layers, seq {args.seq}, batch {args.batch}/rank in "
        f"{args.microbatches} microbatches; ZeRO-{args.zero}, {where}; DeepSpeed's CPU Adam; "
        f"gloo; {machine()}; {args.rounds} rounds of {args.steps} alternating steps after "
        f"{args.warmup} warm-up; both sides use the same generated DeepSpeed config)",
        "",
        "| variant | median step (ms) |",
        "| --- | ---: |",
        f"| paraxis Engine.train_step through the bridge | {med['bridge'] * 1e3:.1f} |",
        f"| DeepSpeed engine driven directly | {med['direct'] * 1e3:.1f} |",
        "",
        ratio_line("Bridge overhead ratio (median step time, bridge / direct)", ratio),
        "",
        "paraxis zero-shard against DeepSpeed at the same stage without offload: the "
        "ZeRO section (`benchmarks/zero_vs_deepspeed.py`).",
    ])
    if not args.no_write:
        write_section("deepspeed_bridge", table, {
            "args": vars(args), "world": world, "params": n_params, "machine": machine(),
            "median_step_s": med, "ratio_bridge_over_direct": ratio,
            "round_medians_s": {k: run.medians(k) for k in run.walls},
            "deepspeed_config": ds_config})
    for name, t in med.items():
        print(f"{name:>7}: median step {t * 1e3:8.2f} ms")
    print(ratio_line("bridge overhead ratio (median step time, bridge/direct)", ratio,
                     bold=False))


if __name__ == "__main__":
    main()
