"""``paraxis plan --dry-run`` at scale: the real construction and apply path of every
pipeline stage's first and last rank, on the meta device in a fake process group of the
whole world, against the plan's per-rank bytes (issues 24 and 32).

    python benchmarks/plan_dryrun.py

Two layouts, each in its own process (so each one's peak resident memory is its own):
Llama-3-70B on 512 ranks (its config.json as published, torch_dtype bfloat16; data 8 x
tensor 8 x pipeline 8, ZeRO-1, sequence parallel) and Mixtral-8x7B on 256 (data 2 x
expert 8 x tensor 4 x pipeline 4, ZeRO-1, sequence parallel), bf16, sequence 4096.
Reported per layout: the worst |measured / planned - 1| over every stage's parameters,
gradients and optimizer state on its first and last rank, whether the stage cut passed
its checks, the wall time and the child's peak RSS, against the targets (2%, 3 minutes,
4 GB). The counts are deterministic (no rounds: nothing here varies from run to run but
the time).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import machine, write_section

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "Llama-3-70B": ("examples/plan/Meta-Llama-3-70B",
                    ["--data", "8", "--tensor", "8", "--pipeline", "8"]),
    "Mixtral-8x7B": ("examples/plan/mixtral-8x7b.json",
                     ["--data", "2", "--expert", "8", "--tensor", "4", "--pipeline", "4"]),
}
COMMON = ["--zero", "1", "--sequence-parallel", "--precision", "bf16", "--seq", "4096",
          "--global-batch", "512", "--dry-run", "--json"]
TARGETS = {"ratio": 0.02, "wall_s": 180.0, "rss_bytes": 4 * 2**30}


# The child runs the CLI in process and reports its own peak resident memory.
CHILD = ("import json, resource, sys; from paraxis.cli.main import main; "
         "code = main(sys.argv[1:]); "
         "print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss), "
         "file=sys.stderr); sys.exit(code)")


def run(model: str, degrees: list[str]) -> dict:
    """One dry run in a child process: its worst ratio, stage-cut verdict, wall time and
    peak RSS (the child exits 1 when the dry run disagrees; its JSON says how)."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, "plan", "--model", str(ROOT / model),
                          *degrees, *COMMON],
                         capture_output=True, text=True, check=False, cwd=ROOT)
    wall = time.perf_counter() - start
    if not out.stdout.strip():
        raise RuntimeError(f"the dry run of {model} printed nothing:\n{out.stderr[-3000:]}")
    peak_kb = int(out.stderr.strip().splitlines()[-1])
    run = json.loads(out.stdout)["dry_run"]
    worst = max(run["rows"], key=lambda r: abs(r["ratio"] - 1))
    return {"wall_s": wall, "rss_bytes": peak_kb * 1024, "rows": len(run["rows"]),
            "cut_problems": run["problems"],
            "worst": {k: worst[k] for k in ("stage", "rank", "term", "ratio")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = p.parse_args()
    results = {name: run(*LAYOUTS[name]) for name in LAYOUTS}
    lines = ["## Dry run at scale: the real layout on the meta device against the plan", "",
             f"`python benchmarks/plan_dryrun.py` (each: `paraxis plan --model <json> "
             f"<degrees> {' '.join(COMMON)}`; {machine()}). Targets (issues 24 and 32): "
             "every stage's parameters, gradients and optimizer state, on its first and "
             "its last rank, within 2% of the plan, the stage cut passing its checks, at "
             "most 3 minutes and 4 GB peak RSS on this machine.", "",
             "| model | layout | rows (stages x 2 ranks x terms) | worst ratio (stage, rank, "
             "term) | stage cut | wall (s) | peak RSS (MB) | verdict |",
             "| --- | --- | ---: | --- | --- | ---: | ---: | --- |"]
    for name, r in results.items():
        w = r["worst"]
        met = (abs(w["ratio"] - 1) <= TARGETS["ratio"] and r["wall_s"] <= TARGETS["wall_s"]
               and r["rss_bytes"] <= TARGETS["rss_bytes"] and not r["cut_problems"])
        degrees = " x ".join(f"{a.lstrip('-')} {v}" for a, v in
                             zip(LAYOUTS[name][1][::2], LAYOUTS[name][1][1::2], strict=True))
        cut = "; ".join(r["cut_problems"]) or "passed"
        lines.append(f"| {name} | {degrees}, ZeRO-1, SP | {r['rows']} | {w['ratio']:.4f} "
                     f"(stage {w['stage']}, rank {w['rank']}, {w['term']}) | {cut} | "
                     f"{r['wall_s']:.0f} | {r['rss_bytes'] / 2**20:,.0f} | "
                     f"{'met' if met else 'NOT met'} |")
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        write_section("plan_dryrun", table, results)


if __name__ == "__main__":
    main()
