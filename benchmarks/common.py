"""Shared helpers for paired benchmarks: timing, medians, and the RESULTS.md writer."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

RESULTS = Path(__file__).with_name("RESULTS.md")
OUT = Path(__file__).with_name("out")


def timed_step(step: Callable[[], float | None]) -> tuple[float, float]:
    """Run one training step between barriers; return (wall seconds, blocked seconds).

    The barriers make every rank's step cover the slowest rank, which is what a
    synchronous trainer pays.
    """
    dist.barrier()
    start = time.perf_counter()
    blocked = step() or 0.0
    dist.barrier()
    return time.perf_counter() - start, blocked


def llama_parser(doc: str, *, steps: int, warmup: int, layers: int,
                 batch: int) -> argparse.ArgumentParser:
    """The arguments every paired Llama benchmark takes, with its own defaults."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    return p


def build_llama(args: argparse.Namespace) -> torch.nn.Module:
    """The benchmarks' Llama, from config (8 heads, 4 kv heads, byte vocabulary)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", hidden_size=args.hidden,
                               intermediate_size=args.hidden * 8 // 3 // 8 * 8,
                               num_hidden_layers=args.layers, num_attention_heads=8,
                               num_key_value_heads=4, vocab_size=256,
                               max_position_embeddings=args.seq)
    return AutoModelForCausalLM.from_config(cfg)


def alternate(variants: dict[str, Callable[[], float | None]], *, steps: int,
              warmup: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Step every variant in turn for ``warmup + steps`` rounds, rotating who goes first
    each round so that no variant always runs on a warm (or cold) machine. Returns, per
    variant, the wall times and the blocked times of the measured rounds."""
    names = list(variants)
    walls: dict[str, list[float]] = {n: [] for n in names}
    blocked: dict[str, list[float]] = {n: [] for n in names}
    for i in range(warmup + steps):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            wall, wait = timed_step(variants[name])
            if i >= warmup:
                walls[name].append(wall)
                blocked[name].append(wait)
    return walls, blocked


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def machine() -> str:
    threads = torch.get_num_threads()
    return (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{threads} thread(s) per rank")


def write_section(name: str, markdown: str, payload: dict) -> None:
    """Replace the ``name`` section of RESULTS.md (or append it) and save the raw JSON."""
    OUT.mkdir(exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(payload, indent=2))
    begin, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else f"{text}\n{block}\n"
    RESULTS.write_text(text)
