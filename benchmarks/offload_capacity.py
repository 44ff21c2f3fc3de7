"""How large a model this machine trains with ZeRO-3, parameters and optimizer state
offloaded to the CPU through the DeepSpeed bridge.

    torchrun --nproc-per-node 2 benchmarks/offload_capacity.py --hidden 2048 --layers 10

The model (paraxis's tiny Llama-style family) is constructed partitioned, as
``paraxis train`` does (``paraxis_model_context``: ``deepspeed.zero.Init``), then trains
``--steps`` steps on random tokens. Reported per rank: peak resident memory, the bytes
DeepSpeed keeps for the model state, and the step time; the last line is the parameter
count trained.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from common import machine, write_section

import paraxis
from paraxis.config.run import RunConfig
from paraxis.models.tiny import TinyConfig, TinyTransformer


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="per-rank batch")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--no-write", action="store_true")
    return p.parse_args()


def main() -> None:
    args = parse()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    from paraxis_deepspeed.construct import partitioned_construction

    world = dist.get_world_size()
    tiny = {"vocab_size": 256, "hidden_size": args.hidden, "num_layers": args.layers,
            "num_heads": max(1, args.hidden // 128), "intermediate_size": 4 * args.hidden,
            "seq_length": args.seq}
    cfg = RunConfig.from_dict({
        "parallelism": {"data": world, "zero": 3,
                        "offload": {"optimizer": "cpu", "parameters": "cpu"}},
        "model": {"family": "tiny", "config": tiny},
        "train": {"steps": args.steps, "warmup_steps": 0, "seq_length": args.seq,
                  "global_batch": args.batch * world, "lr": 1e-4}})
    start = time.perf_counter()
    with partitioned_construction(cfg):
        torch.manual_seed(0)
        model = TinyTransformer(TinyConfig(**tiny))
    built = time.perf_counter() - start
    n_params = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    engine = paraxis.parallelize(model, config=cfg, train=cfg.train, verify=False)
    gen = torch.Generator().manual_seed(dist.get_rank())
    metrics = [engine.train_step(torch.randint(0, 256, (args.batch, args.seq), generator=gen))
               for _ in range(args.steps)]
    last = metrics[-1]
    rss = torch.tensor([last["peak_rss_bytes"]], dtype=torch.float64)
    every = [torch.zeros_like(rss) for _ in range(world)]
    dist.all_gather(every, rss)
    if dist.get_rank() == 0:
        report(args, world, n_params, built, metrics, [float(r) for r in every])
    engine.close()
    paraxis.shutdown()


def report(args, world, n_params, built, metrics, rss) -> None:
    last = metrics[-1]
    gib = 2**30
    table = "\n".join([
        "## Offload capacity: the largest model trained on this machine",
        "",
        f"`torchrun --nproc-per-node {world} benchmarks/offload_capacity.py --hidden "
        f"{args.hidden} --layers {args.layers}` (tiny Llama-style model, "
        f"**{n_params / 1e6:.0f}M parameters**, fp32, ZeRO-3 with parameters and optimizer "
        f"state on the CPU, constructed partitioned; seq {args.seq}, batch {args.batch}/rank; "
        f"{machine()}; 24 GiB shared by every rank and every other process)",
        "",
        "| figure | value |",
        "| --- | ---: |",
        f"| whole model, fp32 weights only | {n_params * 4 / gib:.2f} GiB |",
        f"| whole training state, fp32 + Adam (16 B/param) | {n_params * 16 / gib:.2f} GiB |",
        f"| peak RSS per rank | {', '.join(f'{r / gib:.2f} GiB' for r in rss)} |",
        f"| DeepSpeed host bytes, rank 0 | {last['deepspeed_host_bytes'] / gib:.2f} GiB |",
        f"| DeepSpeed device bytes, rank 0 | {last['deepspeed_device_bytes'] / gib:.3f} GiB |",
        f"| construction (partitioned) | {built:.0f} s |",
        f"| step time (last of {args.steps}) | {last['step_time_s']:.1f} s |",
        "| losses | " + ", ".join(f"{m['loss']:.3f}" for m in metrics) + " |",
    ])
    if not args.no_write:
        write_section("offload_capacity", table, {
            "args": vars(args), "params": n_params, "peak_rss_bytes": rss,
            "metrics": metrics, "construction_s": built})
    print(table)
    print(f"trained parameters: {n_params}")


if __name__ == "__main__":
    main()
