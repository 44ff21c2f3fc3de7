"""End to end: the default job relaunches itself under torchrun and trains on 2 ranks."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_default_example_trains_on_two_ranks():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples/train_data_parallel.py"), "--steps", "30"],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out.stdout)]
    assert len(losses) >= 2, out.stdout
    assert losses[-1] < losses[0] - 1.0, losses  # byte-level loss falls from ~5.5


def test_installed_entry_point_provides_the_data_axis():
    from paraxis import ParallelConfig, make_plugin_manager
    from paraxis.strategy import resolve_strategies

    (cls,) = resolve_strategies(ParallelConfig.from_kwargs(data=2), make_plugin_manager())
    assert cls.__module__ == "paraxis_dp.strategy"
