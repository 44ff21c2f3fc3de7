"""DeepSpeed's C++ extension (CPU Adam) compiles on first use: about a minute on an idle
machine, many on a busy one. The bridge builds it before ``deepspeed.initialize`` and
says so, with a line every few seconds until done, so a first run never sits silent.

On a CPU accelerator DeepSpeed's communication layer also compiles a shared-memory
all-reduce kernel when it starts (``deepspeed.comm.torch.build_shm_op``). Only
``inference_all_reduce`` uses it, which training never calls (and which falls back to
the process group's all-reduce without it), so the bridge starts the layer without it
(:func:`skip_inference_comm_op`): another minute or more of compiling saved."""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["build_ops", "extension_cache", "is_built", "skip_inference_comm_op"]

HEARTBEAT_S = 15.0
QUIET_S = 3.0
STALE_LOCK_S = 600.0


def extension_cache() -> str:
    """Where torch keeps compiled extensions: ``$TORCH_EXTENSIONS_DIR`` when set, else a
    folder of this Python environment. torch's default (``~/.cache/torch_extensions``)
    is keyed by Python and CUDA version only, so two environments on one machine
    (another torch or DeepSpeed) rebuild each other's extensions, and wait on each
    other's build locks, on every start."""
    return os.environ.setdefault("TORCH_EXTENSIONS_DIR",
                                 os.path.join(sys.prefix, "torch_extensions"))


def _builders() -> list:
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("CPUAdamBuilder")
    return [builder] if builder is not None else []


def skip_inference_comm_op() -> None:
    """Start DeepSpeed's CPU communication layer without its inference-only shared-memory
    kernel (see the module docstring). Call before ``deepspeed.init_distributed`` or
    ``deepspeed.initialize``; a no-op on other accelerators."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        # By module name: ``deepspeed.comm.torch`` as an attribute is torch itself.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


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
    extension_cache()
    start = time.perf_counter()
    for builder in _builders():
        done = threading.Event()
        if say is not None:
            threading.Thread(target=_announce, args=(builder.name, say, done),
                             daemon=True).start()
        try:
            builder.load(verbose=False)
        finally:
            done.set()
    return time.perf_counter() - start


def _announce(name: str, say: Callable[[str], None], done: threading.Event) -> None:
    """Say that ``name`` compiles once loading takes longer than :data:`QUIET_S`, then
    every :data:`HEARTBEAT_S`, then that it is done. A build killed half-way leaves
    torch's lock file behind and every later start waits on it: say where it is."""
    from torch.utils.cpp_extension import _get_build_directory

    since = time.perf_counter()
    if done.wait(QUIET_S):
        return
    say(f"paraxis-deepspeed: building DeepSpeed's {name} extension (compiled on first use in this "
        "environment: about a minute, several on a busy machine)")
    lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
    while not done.wait(HEARTBEAT_S):
        waited = time.perf_counter() - since
        hint = (f"; if no compiler is running, a killed build left {lock}: remove it"
                if waited > STALE_LOCK_S and os.path.exists(lock) else "")
        say(f"paraxis-deepspeed: still compiling {name} ({waited:.0f} s){hint}")
    say(f"paraxis-deepspeed: {name} ready after {time.perf_counter() - since:.0f} s")
