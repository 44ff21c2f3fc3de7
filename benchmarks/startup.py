"""Start-up: the default job's seconds from ``paraxis train`` to its first step, this
tree against a baseline tree, paired (issue 38, item 5).

Each launch starts the default job (``examples/default.yaml``: Llama from config, data
2 x tensor 2 on 4 CPU ranks, W&B offline) from one tree in a fresh directory and times
from the command's start to the first step's console line (``logging.progress=false
train.log_every=1``, so that the line is printed as the step ends); the job is then
killed. Launches alternate between the trees, who goes first rotating; they are cut
into rounds of ``--launches`` per tree, and a round's ratio is the ratio of its two
medians (benchmarks/common.py's rule, a launch for a step). The section reports the
median ratio, its spread over the rounds and the verdict against the target: at most
half (the issue's done-when). The baseline is a source tree of an earlier commit, e.g.
``git archive 999c2b6 | tar -x -C /tmp/base``.

    python benchmarks/startup.py --baseline /tmp/base [--rounds 5] [--launches 3]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import Rounds, machine, median, ratio_line, summary, write_section

ROOT = Path(__file__).resolve().parents[1]
FIRST_STEP = re.compile(rb"^step\s+1/")
TARGET = 0.5


def sources(tree: Path) -> str:
    """PYTHONPATH putting ``tree``'s packages first (they beat the editable installs)."""
    return os.pathsep.join(str(p) for pattern in ("packages/*/src", "integrations/*/src")
                           for p in sorted(tree.glob(pattern)))


def first_step_seconds(tree: Path, timeout: float) -> float:
    """Seconds from starting the default job from ``tree`` to its first step's line."""
    with tempfile.TemporaryDirectory(prefix="paraxis-startup-") as work:
        env = {**os.environ, "PYTHONPATH": sources(tree), "WANDB_MODE": "offline",
               "WANDB_DIR": work}
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                    "OMP_NUM_THREADS"):
            env.pop(var, None)
        argv = [sys.executable, "-m", "paraxis", "train", "--config",
                str(tree / "examples/default.yaml"), "logging.progress=false",
                "train.log_every=1", f"train.checkpoint_dir={work}/ckpt"]
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                cwd=work, env=env, start_new_session=True)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if FIRST_STEP.match(line):
                    return time.perf_counter() - start
                if time.perf_counter() - start > timeout:
                    break
            raise RuntimeError(f"{tree}: no first step within {timeout:.0f} s (exit "
                               f"{proc.poll()})")
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers
            proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", required=True, type=Path, help="the earlier source tree")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--launches", type=int, default=3, help="launches per tree per round")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    trees = {"baseline": args.baseline.resolve(), "this tree": ROOT}
    seconds: dict[str, list[float]] = {name: [] for name in trees}
    for i in range(args.rounds * args.launches):
        for name in list(trees)[i % 2:] + list(trees)[:i % 2]:
            seconds[name].append(first_step_seconds(trees[name], args.timeout))
        print(f"launch {i + 1}: " + ", ".join(f"{n} {v[-1]:.2f} s"
                                              for n, v in seconds.items()), flush=True)
    walls = Rounds(seconds, {n: [0.0] * len(v) for n, v in seconds.items()}, args.launches)
    s = summary(walls.ratios("this tree", "baseline"), TARGET)
    line = ratio_line("Ratio this tree / baseline (seconds to the first step)", s)
    print(line)
    if args.no_write:
        return
    rows = "\n".join(f"| {n} | {min(v):.2f} | {median(v):.2f} | {max(v):.2f} |"
                     for n, v in seconds.items())
    write_section("startup", f"""
## Start-up: the default job's seconds to its first step, against a baseline tree

`python benchmarks/startup.py --baseline {args.baseline}` (examples/default.yaml: data 2
x tensor 2, 4 ranks, W&B offline; from the command's start to the first step's line;
{args.rounds} rounds of {args.launches} launches per tree, alternating who starts first;
{machine()}; load average at the end {os.getloadavg()[0]:.1f})

| tree | min (s) | median (s) | max (s) |
| --- | ---: | ---: | ---: |
{rows}

{line}
""", {"seconds": seconds, "ratio": s})


if __name__ == "__main__":
    main()
