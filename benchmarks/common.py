"""Shared helpers for paired benchmarks: timing, rounds of alternating steps, the verdict
rule against a target, and the RESULTS.md writer.

The rule (stated once, in RESULTS.md's header too): a paired benchmark runs ``--rounds``
rounds (5 by default), each a block of ``--steps`` alternating measured steps; a round's
ratio is the ratio of that round's medians. Reported: the median of the per-round ratios
and their spread [min-max]. Against a target the verdict is "met" only when the whole
spread is on the right side of it, "not met" when the whole spread is on the wrong
side, and "inside the noise" otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

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


def round_args(p: argparse.ArgumentParser, *, steps: int, warmup: int) -> None:
    """The arguments of every paired benchmark (``nox -s bench`` passes the same ones to
    all of them): rounds, measured steps per round, warm-up steps, --no-write."""
    p.add_argument("--rounds", type=int, default=5, help="rounds (a ratio each)")
    p.add_argument("--steps", type=int, default=steps,
                   help="measured alternating steps per round")
    p.add_argument("--warmup", type=int, default=warmup, help="unmeasured steps first")
    p.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")


def llama_parser(doc: str, *, steps: int, warmup: int, layers: int,
                 batch: int) -> argparse.ArgumentParser:
    """The arguments every paired Llama benchmark takes, with its own defaults."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    round_args(p, steps=steps, warmup=warmup)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=batch)
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


def build_mixtral(args: argparse.Namespace) -> torch.nn.Module:
    """The MoE benchmarks' Mixtral, from config (8 heads, 4 kv heads, byte vocabulary)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "mixtral", hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=256, num_local_experts=args.experts, num_experts_per_tok=args.top_k,
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


@dataclass
class Rounds:
    """Measured steps of an alternation, cut into rounds of ``per_round`` steps."""

    walls: dict[str, list[float]]
    blocked: dict[str, list[float]]
    per_round: int

    def _cut(self, xs: list[float]) -> list[list[float]]:
        return [xs[i:i + self.per_round] for i in range(0, len(xs), self.per_round)]

    def medians(self, name: str) -> list[float]:
        """The median step time of ``name`` in each round."""
        return [median(r) for r in self._cut(self.walls[name])]

    def median(self, name: str) -> float:
        """The median over every measured step of ``name`` (for the tables)."""
        return median(self.walls[name])

    def ratios(self, num: str, den: str) -> list[float]:
        """Per round, the ratio of the two variants' median step times."""
        return [a / b for a, b in zip(self.medians(num), self.medians(den), strict=True)]


def rounds(variants: dict[str, Callable[[], float | None]], *, rounds: int = 5,
           steps_per_round: int, warmup: int) -> Rounds:
    """Warm up, then ``rounds`` blocks of ``steps_per_round`` alternating steps: one
    continuous :func:`alternate` (its rotation of who goes first runs on across rounds),
    cut into rounds afterwards."""
    if rounds < 1 or steps_per_round < 1:
        raise ValueError(f"rounds={rounds}, steps_per_round={steps_per_round}: both must "
                         "be at least 1")
    walls, blocked = alternate(variants, steps=rounds * steps_per_round, warmup=warmup)
    return Rounds(walls, blocked, steps_per_round)


Better = Literal["lower", "higher"]


def verdict(ratios: list[float], target: float | None, better: Better = "lower") -> str:
    """"met" when the whole spread of per-round ratios is on the right side of
    ``target`` (every ratio <= it for ``better="lower"``), "not met" when the whole
    spread is on the wrong side, else "inside the noise"."""
    if target is None:
        return "no target stated"
    lo, hi = min(ratios), max(ratios)
    good, bad = (hi <= target, lo > target) if better == "lower" else (lo >= target,
                                                                         hi < target)
    return "met" if good else "not met" if bad else "inside the noise"


def summary(ratios: list[float], target: float | None, better: Better = "lower") -> dict:
    """What a section and its JSON report about one ratio."""
    return {"median": median(ratios), "min": min(ratios), "max": max(ratios),
            "per_round": ratios, "target": target, "better": better,
            "verdict": verdict(ratios, target, better)}


def ratio_line(label: str, s: dict, *, bold: bool = True, unit: str = "rounds") -> str:
    """The line of a section (and the last line printed): median ratio, spread [min-max]
    over the rounds (or whatever ``unit`` the ratios were taken over), target and
    verdict."""
    b = "**" if bold else ""
    sign = "<=" if s["better"] == "lower" else ">="
    judged = (f"target {sign} {s['target']}: {b}{s['verdict']}{b}"
              if s["target"] is not None else s["verdict"])
    return (f"{b}{label}: {s['median']:.3f}{b} (median of {len(s['per_round'])} {unit}), "
            f"spread [{s['min']:.3f}–{s['max']:.3f}]; {judged}")


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def machine() -> str:
    threads = torch.get_num_threads()
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"{platform.machine()}, {os.cpu_count()} cores{gpu}, torch {torch.__version__}, "
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
