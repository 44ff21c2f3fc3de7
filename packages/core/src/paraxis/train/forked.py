"""Workers forked from the launcher, so that what every rank would do alike is done once.

torchrun starts each worker as a fresh interpreter, which imports torch, paraxis and its
plugins and the model's transformers modules, and tokenizes an in-memory corpus, before
it trains: on the default job (4 ranks on 2 cores) each rank spent about 6.5 of its 9.5
seconds before the first step importing and 1.3-1.9 packing the corpus, four times
over (issue 38, item 5). ``paraxis train`` outside torchrun does it once in the launcher
(the ``warm`` of :func:`paraxis.train.launcher.run_workers`) and the agent forks the
workers from it (torch elastic's ``start_method="fork"``), so each begins with all of it
in memory, shared copy-on-write.

A process that has made a CUDA context cannot fork workers that use CUDA, and the
launcher's own checks may make one (``torch.cuda.is_bf16_supported``), so the workers
are forked only where no rank can use CUDA (:func:`fork_safe`: torch built without it,
or no device the driver reports) and started as torchrun starts them everywhere else.
``PARAXIS_FORK_WORKERS=0`` starts them as torchrun does on CPU too.

A forked worker gets what torchrun gives its own: a session of its own (a terminal's
Ctrl-C reaches the agent, which passes it on once), its environment (rank, world,
rendezvous), and here its thread count set from ``OMP_NUM_THREADS`` (the launcher's
OpenMP settings are inherited, not read again). An exception's traceback is printed with
the rank before each line, as torchrun's workers print theirs; the worker exits with the
CLI's code.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
import uuid
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["FORK_ENV", "fork_safe", "launch_forked", "malloc_from_environment",
           "prepare_fork"]

FORK_ENV = "PARAXIS_FORK_WORKERS"


def fork_safe() -> bool:
    """Whether workers may be forked from this process (see the module docstring)."""
    if os.environ.get(FORK_ENV, "1") == "0" or sys.platform != "linux":
        return False
    import torch

    if not (torch.backends.cuda.is_built() or torch.version.hip):
        return True
    if torch.cuda.is_initialized():
        return False
    try:  # NVML: asks the driver without a CUDA context (-1: it cannot tell)
        return int(torch.cuda._device_count_nvml()) == 0
    except Exception:
        return False


def prepare_fork(warm: Callable[[], None] | None) -> None:
    """This process made ready to fork workers from: ``warm()`` run (an error there is
    left to the ranks, which meet it and say it), one thread (no OpenMP team a child
    would inherit half of), and what exists frozen out of the garbage collector."""
    import torch

    torch.set_num_threads(1)
    try:
        if warm is not None:
            warm()
    except Exception:  # only a head start: each rank meets it and says it
        pass
    # What the workers inherit is never collected: their gc.collect() (the engine runs
    # a few: 1.4 s each in a forked twin probe on the default job) would walk every
    # module and class imported here, and touching those objects copies their pages
    # (the gc module's advice for fork without exec).
    gc.collect()
    gc.freeze()


# glibc's mallopt parameters for the two variables the launcher sets (malloc.h).
_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_MMAP_THRESHOLD_": -3}


def malloc_from_environment() -> list[str]:
    """The ``MALLOC_*`` thresholds of this process's environment applied with mallopt;
    the names applied. glibc reads them once, at a process's first allocation, so a
    worker forked from the launcher (which set them for its workers after it started)
    would keep glibc's dynamic threshold, and ZeRO-3's freed layers their pages (issue
    36, item 5)."""
    import ctypes

    applied = []
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: nothing to apply
        return applied
    for name, param in _MALLOPT.items():
        value = os.environ.get(name)
        if value is not None and value.isdigit() and mallopt(param, int(value)) == 1:
            applied.append(name)
    return applied


def _worker(entry: Callable[[list[str]], int], argv: list[str]) -> None:
    """One forked worker: ``entry(argv)`` as a worker of the agent's world."""
    os.setsid()
    malloc_from_environment()
    import torch

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    try:
        code = entry(argv)
    except Exception:
        rank = os.environ.get("RANK", "?")
        for line in traceback.format_exc().rstrip().splitlines():
            print(f"[rank{rank}]: {line}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        sys.exit(code)


def launch_forked(args: Any, entry: Callable[[list[str]], int], argv: Sequence[str]) -> Any:
    """``torch.distributed.run.run(args)`` with each worker ``entry(argv)`` forked from
    this process (``args``: torchrun's parsed arguments, from
    :func:`paraxis.train.launcher.torchrun_args`)."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    if args.standalone:  # as torchrun's run() sets a single node up
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    if getattr(args, "master_port", None) is None:
        args.master_port = 29500
    config, _, _ = config_from_args(args)
    config.start_method = "fork"
    return elastic_launch(config=config, entrypoint=_worker)(entry, list(argv))
