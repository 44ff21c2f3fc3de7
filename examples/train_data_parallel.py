"""Train a tiny Llama-style model with paraxis data parallelism on CPU ranks.

    python examples/train_data_parallel.py [--config examples/default.yaml] [--steps 200]

Outside torchrun it relaunches itself under torchrun with the configured world size.
The corpus is the byte stream of the running interpreter's standard-library sources,
which exists offline on every machine with Python.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist

from paraxis import Grid, ParallelConfig, apply_parallelism, shutdown, validate
from paraxis.testing.models import TinyConfig, TinyTransformer, causal_lm_loss

HERE = Path(__file__).parent


def stdlib_tokens(limit_bytes: int) -> torch.Tensor:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    data = bytearray()
    for f in files:
        data += f.read_bytes()
        if len(data) >= limit_bytes:
            break
    return torch.frombuffer(bytearray(data[:limit_bytes]), dtype=torch.uint8).long()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(HERE / "default.yaml"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=64)
    args = p.parse_args()
    config = ParallelConfig.from_yaml(args.config)
    if "RANK" not in os.environ:  # relaunch under torchrun, one process per rank
        validate(config)
        cmd = ["torchrun", f"--nproc-per-node={config.world_size}", __file__, *sys.argv[1:]]
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.execvp(cmd[0], cmd)

    dist.init_process_group("gloo")
    validate(config, world_size=dist.get_world_size())
    grid = Grid.build(config)
    data = grid.group(("data", "expert", "context"))
    torch.manual_seed(0)
    cfg = TinyConfig(vocab_size=256, hidden_size=128, num_layers=4, num_heads=4,
                     intermediate_size=512, seq_length=args.seq)
    model, ctx = apply_parallelism(TinyTransformer(cfg), grid=grid, config=config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = stdlib_tokens(args.steps * args.batch * args.seq)
    seqs = tokens[: len(tokens) // args.seq * args.seq].view(-1, args.seq)
    per_rank, mbs = args.batch // data.size, config.schedule.microbatches
    start = time.perf_counter()
    for step in range(args.steps):
        batch = seqs[step * args.batch:(step + 1) * args.batch]
        local = batch[data.rank * per_rank:(data.rank + 1) * per_rank]
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for i, mb in enumerate(local.chunk(mbs)):
            with ctx.no_sync() if i < mbs - 1 else torch.enable_grad():
                loss = causal_lm_loss(model(mb), mb) / mbs
                loss.backward()
            total += loss.detach()
        ctx.finish_grad_sync()
        opt.step()
        dist.all_reduce(total)
        if grid.rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            tps = (step + 1) * args.batch * args.seq / (time.perf_counter() - start)
            print(f"step {step:4d}  loss {total.item() / dist.get_world_size():.4f}  "
                  f"tokens/s {tps:,.0f}", flush=True)
    del model, opt, ctx
    shutdown(grid)


if __name__ == "__main__":
    main()
