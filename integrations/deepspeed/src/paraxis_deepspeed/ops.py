"""DeepSpeed's C++ extensions (CPU Adam; on a CPU accelerator also its shared-memory
communication op) compile on first use: about a minute on an idle machine, many on a
busy one. The bridge builds them before ``deepspeed.initialize`` and says so, with a
line every few seconds until done, so a first run never sits silent."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

__all__ = ["build_ops", "is_built"]

HEARTBEAT_S = 15.0
QUIET_S = 3.0


def _builders() -> list:
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    names = ["CPUAdamBuilder"]
    if accel.device_name() == "cpu":
        names.append("ShareMemCommBuilder")
    builders = [accel.create_op_builder(n) for n in names]
    return [b for b in builders if b is not None]


def is_built(builder) -> bool:
    """Whether ``builder``'s extension is already compiled (precompiled or JIT cache)."""
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import _get_build_directory

    if installed_ops.get(builder.name, False):
        return True
    directory = _get_build_directory(builder.name, verbose=False)
    return os.path.exists(os.path.join(directory, f"{builder.name}.so"))


def build_ops(say: Callable[[str], None] | None) -> float:
    """Compile (or load) the extensions the bridge needs; ``say`` (None on silent ranks)
    prints progress. Returns the seconds spent. Every rank calls it: torch's extension
    builder lets one rank compile while the others wait on its lock. A build torch
    decides to redo (changed flags) is announced too, after :data:`QUIET_S`."""
    start = time.perf_counter()
    for builder in _builders():
        done = threading.Event()
        if say is not None:
            threading.Thread(target=_announce, args=(builder.name, say, done, is_built(builder)),
                             daemon=True).start()
        try:
            builder.load(verbose=False)
        finally:
            done.set()
    return time.perf_counter() - start


def _announce(name: str, say: Callable[[str], None], done: threading.Event,
              built: bool) -> None:
    """Say that ``name`` compiles (at once when nothing is built, else once loading
    takes longer than :data:`QUIET_S`), then every :data:`HEARTBEAT_S`, then done."""
    since = time.perf_counter()
    if built and done.wait(QUIET_S):
        return
    say(f"paraxis-deepspeed: compiling DeepSpeed's {name} extension (first use on this "
        "machine: about a minute, several on a busy one)")
    while not done.wait(HEARTBEAT_S):
        say(f"paraxis-deepspeed: still compiling {name} ({time.perf_counter() - since:.0f} s)")
    say(f"paraxis-deepspeed: {name} ready after {time.perf_counter() - since:.0f} s")
