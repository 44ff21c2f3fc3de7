"""Data at scale: a corpus generated from a seed, prepared into memory-mapped shards and
trained on data 2 x tensor 2, against the in-memory path on the same rows.

    python benchmarks/data_scale.py [--gigabytes 2.0] [--workers 2] [--scratch DIR]

The driver writes the corpus (JSONL of random words drawn from a seed; never committed)
into a scratch directory, times ``paraxis data prepare`` on it, then launches

    torchrun --nproc-per-node 4 benchmarks/data_scale.py --train SHARDS

where every rank
1. measures its resident memory (anonymous and file-backed apart, /proc/self/status)
   before opening the shards and after opening them whole and reading 200 of its
   batches from a stream over the whole corpus: the data memory a rank pays;
2. trains the benchmarks' Llama (``parallelize``, data 2 x tensor 2) in rounds of
   alternating steps from two streams over the same rows: one reads them from the
   memory map, one holds them in memory (the first ``--rows`` rows, materialized), so
   the ratio is the price of reading from the shards.
Rank 0 writes the section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["the", "of", "and", "model", "data", "tensor", "pipeline", "expert", "shard",
         "token", "gradient", "optimizer", "layer", "attention", "batch", "rank"]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gigabytes", type=float, default=2.0, help="corpus size (JSONL)")
    p.add_argument("--workers", type=int, default=2, help="tokenizing processes")
    p.add_argument("--scratch", default=None, help="where the corpus and shards go")
    p.add_argument("--train", default=None, help=argparse.SUPPRESS)  # the torchrun part
    p.add_argument("--prepare-s", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--rows", type=int, default=16384, help="rows both streams share")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="alternating steps per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--no-write", action="store_true")
    return p.parse_args()


def write_corpus(path: Path, gigabytes: float, seed: int = 0) -> int:
    """JSONL documents of 20-400 random words until ``gigabytes``; returns bytes."""
    rng, target, written = random.Random(seed), int(gigabytes * 2**30), 0
    with path.open("w") as f:
        while written < target:
            block = "".join(json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(
                20, 400)))}) + "\n" for _ in range(1000))
            f.write(block)
            written += len(block)
    return written


def driver(args: argparse.Namespace) -> None:
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="paraxis-data-scale-"))
    scratch.mkdir(parents=True, exist_ok=True)
    corpus, shards = scratch / "corpus.jsonl", scratch / "shards"
    size = write_corpus(corpus, args.gigabytes)
    print(f"corpus: {size / 2**30:.2f} GiB at {corpus}", flush=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "paraxis", "data", "prepare", str(corpus),
                    "--out", str(shards), "--workers", str(args.workers), "--quiet"],
                   check=True)
    prepare_s = time.perf_counter() - start
    corpus.unlink()  # only the shards are needed from here
    forwarded = [a for a in sys.argv[1:] if not a.startswith("--scratch")]
    try:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "4", __file__, "--train", str(shards),
                        "--prepare-s", f"{prepare_s:.3f}", *forwarded],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        if args.scratch is None:  # a directory of our own: the shards go with it
            shutil.rmtree(scratch, ignore_errors=True)


def memory() -> dict[str, int]:
    """This process's resident memory, anonymous and file-backed, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def train_part(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from common import build_llama, rounds

    import paraxis
    from paraxis.train.data import BatchStream
    from paraxis.train.shards import token_rows

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    shards = Path(args.train)
    meta = json.loads((shards / "meta.json").read_text())
    before = memory()
    rows = token_rows(shards, args.seq)
    opened = memory()
    config = paraxis.ParallelConfig.from_kwargs(data=2, tensor=2)
    index, count = rank // 2, 2  # data is outside tensor: ranks 0-1 are data index 0
    whole = BatchStream(rows, global_batch=args.batch, rank=index, ranks=count, seed=1)
    for _ in range(200):
        whole.next_batch()
    read = memory()
    n = min(args.rows, len(rows))
    in_memory = rows[torch.arange(n)]  # the same rows, held as a tensor
    streams = {"shards": BatchStream(rows[:n], global_batch=args.batch, rank=index,
                                     ranks=count, seed=2),
               "memory": BatchStream(in_memory, global_batch=args.batch, rank=index,
                                     ranks=count, seed=2)}
    engine = paraxis.parallelize(build_llama(args), config=config, train={
        "seq_length": args.seq, "lr": 1e-3, "warmup_steps": 1})
    assert engine.grid.sample_shard() == (index, count), engine.grid.sample_shard()

    def step(name: str):
        def run() -> None:
            engine.train_step(streams[name].next_batch())
        return run

    timing = rounds({k: step(k) for k in streams}, rounds=args.rounds,
                    steps_per_round=args.steps, warmup=args.warmup)
    mem = [None] * dist.get_world_size()
    dist.all_gather_object(mem, {"before": before, "opened": opened, "read": read})
    if rank == 0:
        report(args, meta, mem, timing, len(rows), n)
    engine.close()


def report(args, meta, mem, timing, total_rows, n) -> None:
    from common import machine, ratio_line, summary, write_section

    anon = max(m["read"]["RssAnon"] - m["before"]["RssAnon"] for m in mem)
    file = max(m["read"]["RssFile"] - m["before"]["RssFile"] for m in mem)
    corpus_bytes = meta["tokens"] * (2 if meta["dtype"] == "uint16" else 4)
    s = summary(timing.ratios("shards", "memory"), 1.05)
    table = "\n".join([
        "## Data at scale: memory-mapped shards against in-memory rows",
        "",
        f"`python benchmarks/data_scale.py --gigabytes {args.gigabytes}` (JSONL of random "
        f"words from seed 0, prepared with `paraxis data prepare --workers {args.workers}` "
        f"in {args.prepare_s:.0f} s: {meta['documents']:,} documents, {meta['tokens']:,} "
        f"tokens, {corpus_bytes / 2**20:,.0f} MiB of {meta['dtype']}; trained on data 2 x "
        f"tensor 2, Llama hidden {args.hidden}, {args.layers} layers, seq {args.seq}, "
        f"global batch {args.batch}; gloo; {machine()})",
        "",
        "| per rank, after opening the shards and reading 200 batches | MiB |",
        "| --- | ---: |",
        f"| anonymous memory added (the most of any rank) | {anon / 2**20:.1f} |",
        f"| file-backed pages resident (the most of any rank) | {file / 2**20:.1f} |",
        f"| the corpus's token file | {corpus_bytes / 2**20:,.0f} |",
        "",
        "File-backed pages are the kernel's page cache of the token file (shared and "
        "reclaimable); anonymous memory is what the data path holds for itself.",
        "",
        "| stream (the same first "
        f"{n:,} of {total_rows:,} rows) | median step (ms) |",
        "| --- | ---: |",
        f"| from the memory map | {timing.median('shards') * 1e3:.1f} |",
        f"| held in memory | {timing.median('memory') * 1e3:.1f} |",
        "",
        ratio_line("Ratio shards / in memory (median step time)", s),
    ])
    print(table, flush=True)
    if not args.no_write:
        write_section("data_scale", table, {"args": vars(args), "meta": meta,
                                            "memory": mem, "ratio": s})


def main() -> None:
    args = parse()
    if args.train:
        train_part(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
