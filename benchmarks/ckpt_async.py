"""Step stall of an asynchronous checkpoint against a synchronous one, paired in one run.

    torchrun --nproc-per-node 2 benchmarks/ckpt_async.py

One engine (core's tiny model, data 2, AdamW) trains; after every step one kind of save
runs, alternating which goes first each round: ``sync`` (paraxis.checkpoint.
save_checkpoint: copy, write, checksum, publish, barrier) and ``async``
(paraxis.checkpoint.background.AsyncSaver: host snapshot and one all-gather on the training
thread, the rest in a background thread). The stall is the wall time the training loop
spends inside ``save`` (between barriers, so it covers the slowest rank); for async the
next training step's time (the writer thread competes for the cores) and the time left
to wait for the write are reported too, against a step with no save. The last line
printed is the stall ratio async / sync: the median of the per-round ratios and their spread.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
from common import machine, median, ratio_line, summary, write_section

import paraxis
from paraxis.checkpoint.background import AsyncSaver
from paraxis.checkpoint.write import save_checkpoint
from paraxis.models.tiny import TinyConfig, TinyTransformer


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="global batch")
    p.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    return p.parse_args()


def _timed(fn):
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    args = parse()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = TinyConfig(vocab_size=256, hidden_size=args.hidden, num_layers=args.layers,
                     num_heads=8, intermediate_size=4 * args.hidden, seq_length=args.seq)
    torch.manual_seed(0)
    engine = paraxis.parallelize(TinyTransformer(cfg), data=int(os.environ["WORLD_SIZE"]),
                                 train={"steps": 1000, "seq_length": args.seq})
    rank, world = engine.grid.rank, engine.grid.world_size
    root = tempfile.mkdtemp(prefix="ckpt-async-") if rank == 0 else None
    root = [root]
    dist.broadcast_object_list(root, 0)
    root = root[0]
    saver = AsyncSaver()
    per = args.batch // world

    def step():
        engine.train_step(torch.randint(0, 256, (per, args.seq)))

    kinds = {
        "sync": lambda: save_checkpoint(engine, f"{root}/sync"),
        "async": lambda: saver.save(engine, f"{root}/async"),
    }
    stall = {k: [] for k in kinds}
    after, wait, plain = [], [], []
    for i in range(args.warmup + args.rounds):
        order = list(kinds) if i % 2 == 0 else list(reversed(kinds))
        for kind in order:
            _timed(step)
            t = _timed(kinds[kind])
            if kind == "async":
                s = _timed(step)  # while the writer runs
                w = _timed(saver.wait)
            if i >= args.warmup:
                stall[kind].append(t)
                if kind == "async":
                    after.append(s)
                    wait.append(w)
        p = _timed(step)
        if i >= args.warmup:
            plain.append(p)
    n_params = sum(p.numel() for p in engine.model.parameters())
    med = {k: median(v) for k, v in stall.items()}
    # Each round saves once each way: its ratio is one sample of the spread.
    ratio = summary([a / s for a, s in zip(stall["async"], stall["sync"], strict=True)],
                    None)
    if rank == 0:
        ckpt_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in
                         os.walk(f"{root}/sync") for f in fs if f.endswith(".safetensors"))
        payload = {"args": vars(args), "world": world, "params": n_params,
                   "machine": machine(), "median_stall_s": med,
                   "median_step_after_async_s": median(after),
                   "median_wait_left_s": median(wait), "median_plain_step_s": median(plain),
                   "checkpoint_bytes_all_saves": ckpt_bytes, "ratio_async_over_sync": ratio}
        table = "\n".join([
            "## Checkpoints: async save stall vs synchronous",
            "",
            f"`torchrun --nproc-per-node {world} benchmarks/ckpt_async.py` "
            f"({n_params / 1e6:.2f}M parameters + AdamW state, data {world}, "
            f"{machine()}; median of {args.rounds} alternating rounds)",
            "",
            "| | median (ms) |",
            "| --- | ---: |",
            f"| sync save: stall | {med['sync'] * 1e3:.1f} |",
            f"| async save: stall (snapshot + index gather) | {med['async'] * 1e3:.1f} |",
            f"| step with the async writer running | {median(after) * 1e3:.1f} |",
            f"| step, no save | {median(plain) * 1e3:.1f} |",
            f"| wait left for the write after that step | {median(wait) * 1e3:.1f} |",
            "",
            ratio_line("Ratio async / sync stall", ratio),
            "",
            "Here the model computes on the same CPU cores the writer thread uses, so "
            "part of the write's time reappears in the next step: async stall + the extra "
            f"step time = {(med['async'] + median(after) - median(plain)) * 1e3:.0f} ms "
            f"against the sync stall's {med['sync'] * 1e3:.0f} ms. With the step on an "
            "accelerator the writer competes only for host memory bandwidth and the disk.",
        ])
        if not args.no_write:
            write_section("ckpt_async", table, payload)
        print("\n".join(table.splitlines()[4:11]))
        print(ratio_line("ratio async/sync stall", ratio, bold=False))
        shutil.rmtree(root, ignore_errors=True)
    engine.close()
    paraxis.shutdown()


if __name__ == "__main__":
    main()
