"""glibc's fixed mmap threshold for CPU workers: 128 KiB against 1 MiB, step time paired
(issue 36, item 5).

    torchrun --nproc-per-node 2 benchmarks/malloc_threshold.py

The launcher fixes ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` for CPU
workers (:data:`paraxis.train.launcher.MALLOC_DEFAULTS`). Below the threshold a block
comes from the heap, whose free chunks between live ones are neither returned nor
always reused: under ZeRO-3 over 8 ranks a 0.17B Llama's worker had 136 MB of its heap
free after four steps at 1 MiB (activations of a few hundred KiB), under 2 MB at 128 KiB.
At 128 KiB they are mapped and unmapped instead, which costs system calls and page
faults. This measures that cost on the same engine: a Llama under ZeRO-3 over data 2,
the two thresholds set with ``mallopt`` before each step, alternating in rounds; the
ratio is 128 KiB / 1 MiB step time (target <= 1.05: the memory is worth at most 5%).
"""

from __future__ import annotations

import ctypes
import os

import torch
import torch.distributed as dist
from common import build_llama, llama_parser, machine, ratio_line, rounds, summary, write_section

import paraxis
from paraxis import shutdown

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
THRESHOLDS = {"1 MiB": 1 << 20, "128 KiB": 128 << 10}


def main() -> None:
    p = llama_parser(__doc__, steps=6, warmup=2, layers=4, batch=4)
    p.set_defaults(hidden=1024)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    libc = ctypes.CDLL(None)
    engine = paraxis.parallelize(build_llama(args), data=dist.get_world_size(), zero=3,
                                 train={"steps": 10**6, "lr": 1e-4, "warmup_steps": 0,
                                        "seq_length": args.seq})
    g = torch.Generator().manual_seed(dist.get_rank())

    def step(threshold: int):
        def run() -> None:
            libc.mallopt(M_MMAP_THRESHOLD, threshold)
            libc.mallopt(M_TRIM_THRESHOLD, threshold)
            engine.train_step(torch.randint(0, 256, (args.batch // 2, args.seq),
                                            generator=g))
        return run

    run = rounds({name: step(t) for name, t in THRESHOLDS.items()}, rounds=args.rounds,
                 steps_per_round=args.steps, warmup=args.warmup)
    s = summary(run.ratios("128 KiB", "1 MiB"), 1.05)
    line = ratio_line("Step time, mmap threshold 128 KiB / 1 MiB", s)
    if dist.get_rank() == 0:
        text = "\n".join([
            "## glibc's mmap threshold for CPU workers: 128 KiB against 1 MiB", "",
            f"`torchrun --nproc-per-node 2 benchmarks/malloc_threshold.py` (Llama from "
            f"config: hidden {args.hidden}, {args.layers} layers, byte vocabulary, "
            f"seq {args.seq}, batch {args.batch}; ZeRO-3 over data 2, gloo; {machine()}; "
            f"{args.rounds} rounds of {args.steps} alternating steps after {args.warmup} "
            "warm-up; the thresholds set with mallopt before each step). Median step: "
            + ", ".join(f"{n} {run.median(n) * 1e3:.1f} ms" for n in THRESHOLDS) + ".", "",
            line])
        print(text)
        if not args.no_write:
            write_section("malloc_threshold", text, s)
    engine.close()
    shutdown()


if __name__ == "__main__":
    main()
