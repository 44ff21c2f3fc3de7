"""``paraxis train`` outside torchrun: start the workers through torchrun's elastic agent,
run in this process, so that this process holds the checkpoint directory's lock for the
whole run and reports the outcome in a few lines.

* One node: ``--standalone`` rendezvous on localhost.
* Several: ``--nnodes N --node-rank R --rdzv-endpoint HOST:PORT`` pass through to
  torchrun's c10d rendezvous. Under SLURM (``srun paraxis train ...``, one task per
  node) they default to the job's node count, node id and job id, and the endpoint to
  ``MASTER_ADDR`` or else the first host of ``SLURM_JOB_NODELIST``, port ``MASTER_PORT``
  or 29500. ``--print-sbatch`` writes a batch script for the configured layout.
* ``--max-restarts N``: when a worker dies the agent restarts every worker, and the run
  resumes from the checkpoint directory's ``latest`` (the gap is at most
  ``train.checkpoint_every`` steps).
* On a machine without CUDA the workers start with glibc's ``MALLOC_MMAP_THRESHOLD_``
  and ``MALLOC_TRIM_THRESHOLD_`` at 128 KiB (:func:`worker_environment`, issue 36):
  glibc raises its mmap threshold to each large block freed (up to 32 MiB), so the
  layers ZeRO-3 gathers and frees every step, and every gradient and activation below
  that, come from the heap afterwards and their pages stay with the process; a 0.5B
  Llama under ZeRO-3 over 8 ranks peaked at 0.90 of the whole fp32 model per rank, where
  model state is 0.50. A fixed threshold turns the adjustment off: blocks of 128 KiB and
  more are mapped and unmapped, and the heap is trimmed above 128 KiB free. At 1 MiB the
  heap's free chunks between live ones (activations of a few hundred KiB) reached 136
  MB after four ZeRO-3 steps of a 0.17B Llama over 8 ranks; at 128 KiB they stay under
  2 MB, for a step time of 1.001 [0.991-1.007] of 1 MiB's
  (``benchmarks/malloc_threshold.py``; 0.991 on a first run). A value already in the
  environment is kept. glibc reads them when a process starts, so a worker forked from
  the launcher applies them itself with mallopt
  (:func:`paraxis.train.forked.malloc_from_environment`).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from paraxis.config.errors import ConfigError, Problem
from paraxis.train.failures import REPORT_ENV, explain
from paraxis.train.forked import fork_safe, launch_forked, prepare_fork
from paraxis.train.lifecycle import LOCK_ENV, DirectoryLock
from paraxis.train.notices import WarningLines

__all__ = ["MALLOC_DEFAULTS", "LaunchOptions", "add_launch_arguments", "run_workers",
           "sbatch_script", "slurm_hosts", "torchrun_args", "worker_environment"]

DEFAULT_PORT = "29500"
# glibc's allocator, fixed for CPU workers (see the module docstring): bytes.
MALLOC_DEFAULTS = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10),
                   "MALLOC_TRIM_THRESHOLD_": str(128 << 10)}


def worker_environment(env: dict[str, str], *, cuda: bool) -> dict[str, str]:
    """What the launcher adds to the workers' environment: the malloc thresholds on a
    machine without CUDA (there host memory holds the model), unless ``env`` sets them."""
    if cuda:
        return {}
    return {k: v for k, v in MALLOC_DEFAULTS.items() if k not in env}


def slurm_hosts(nodelist: str) -> list[str]:
    """Host names of a SLURM node list, as ``scontrol show hostnames`` expands it, for the
    usual grammar: comma-separated names, each with at most one bracket of numbers and
    ranges kept at their width (``gpu[01-03,7],login`` -> gpu01 gpu02 gpu03 gpu7 login)."""
    hosts = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,]*)?", nodelist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if match is None:
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            for n in range(int(first), int(last or first) + 1):
                hosts.append(f"{prefix}{n:0{len(first)}d}{suffix}")
    return hosts


@dataclass(frozen=True)
class LaunchOptions:
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_id: str = "paraxis"
    max_restarts: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace,
                  env: dict[str, str] | None = None) -> LaunchOptions:
        env = dict(os.environ if env is None else env)
        nnodes, node_rank = args.nnodes, args.node_rank
        endpoint, rdzv_id = args.rdzv_endpoint, env.get("SLURM_JOB_ID", "paraxis")
        if nnodes is None and int(env.get("SLURM_JOB_NUM_NODES", "1")) > 1:
            nnodes = int(env["SLURM_JOB_NUM_NODES"])
            node_rank = int(env.get("SLURM_NODEID", "0")) if node_rank is None else node_rank
            nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
            host = env.get("MASTER_ADDR") or next(iter(slurm_hosts(nodelist)), None)
            if endpoint is None and host:
                endpoint = f"{host}:{env.get('MASTER_PORT', DEFAULT_PORT)}"
        nnodes, node_rank = nnodes or 1, node_rank or 0
        if nnodes > 1 and not endpoint:
            raise ConfigError([Problem(
                "--rdzv-endpoint", None, f"is needed to rendezvous {nnodes} nodes",
                "pass --rdzv-endpoint HOST:PORT (the same on every node), or set "
                "MASTER_ADDR and MASTER_PORT")])
        return cls(nnodes, node_rank, endpoint, rdzv_id, args.max_restarts)


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nnodes", type=int, default=None, help="nodes in the job")
    parser.add_argument("--node-rank", type=int, default=None, help="this node's rank")
    parser.add_argument("--rdzv-endpoint", default=None,
                        help="HOST:PORT of the c10d rendezvous (several nodes)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart every worker up to N times when one dies, "
                        "resuming from the latest checkpoint")
    parser.add_argument("--print-sbatch", action="store_true",
                        help="print a SLURM batch script for this layout and exit")
    parser.add_argument("--gpus-per-node", type=int, default=8,
                        help="with --print-sbatch: accelerators (ranks) per node")


def sbatch_script(world_size: int, gpus_per_node: int, argv: Sequence[str]) -> str:
    """A batch script that runs ``paraxis train`` with ``argv`` (less the sbatch options)
    on as many nodes as the layout needs, one launcher task per node; the launchers find
    each other through the job's environment (:meth:`LaunchOptions.from_args`)."""
    if gpus_per_node < 1 or (world_size > gpus_per_node and world_size % gpus_per_node):
        raise ConfigError([Problem("--gpus-per-node", gpus_per_node,
                                   f"must divide the world size {world_size}",
                                   "give the accelerators per node of your cluster")])
    nodes = max(1, world_size // gpus_per_node)
    per_node = world_size // nodes
    keep, skip = [], False
    for arg in argv:
        if skip or arg == "--print-sbatch":
            skip = False
            continue
        if arg == "--gpus-per-node":
            skip = True
            continue
        if not arg.startswith("--gpus-per-node="):
            keep.append(arg)
    return "\n".join([
        "#!/bin/bash",
        f"# Written by `paraxis train --print-sbatch`: world size {world_size} as "
        f"{nodes} node(s) x {per_node} rank(s).",
        "#SBATCH --job-name=paraxis",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={per_node}",
        "#SBATCH --exclusive",
        "# paraxis reads SLURM_JOB_NUM_NODES, SLURM_NODEID, SLURM_JOB_ID and the first host",
        "# of SLURM_JOB_NODELIST (the rendezvous) from the job; each task starts "
        f"{per_node} workers.",
        f"export MASTER_PORT=${{MASTER_PORT:-{DEFAULT_PORT}}}",
        f"srun {shlex.join(['paraxis', *keep])}",
        ""])


def torchrun_args(world_size: int, opts: LaunchOptions, argv: Sequence[str]) -> list[str]:
    if world_size % opts.nnodes:
        raise ConfigError([Problem("--nnodes", opts.nnodes,
                                   f"must divide the world size {world_size}",
                                   "use a node count that divides the degrees' product")])
    where = (["--standalone"] if opts.nnodes == 1 else
             [f"--nnodes={opts.nnodes}", f"--node-rank={opts.node_rank}",
              "--rdzv-backend=c10d", f"--rdzv-endpoint={opts.rdzv_endpoint}",
              f"--rdzv-id={opts.rdzv_id}"])
    return [*where, f"--nproc-per-node={world_size // opts.nnodes}",
            f"--max-restarts={opts.max_restarts}", "-m", "paraxis", *argv]


def run_workers(world_size: int, opts: LaunchOptions, argv: Sequence[str],
                checkpoint_dir: str | None, *, entry: Callable[[list[str]], int] | None = None,
                warm: Callable[[], None] | None = None) -> int:
    """Run torchrun's agent here; return the job's exit code. With ``entry`` (the CLI's
    ``main``) and where it is safe, the workers are forked from this process after
    ``warm()`` did here what each would do alike (:mod:`paraxis.train.forked`);
    otherwise torchrun starts each as ``python -m paraxis argv``. The environment it sets
    for the workers is this process's again when it returns (a later ``main`` in it, a
    test's, would otherwise inherit a removed report directory)."""
    saved = dict(os.environ)
    try:
        return _run_workers(world_size, opts, argv, checkpoint_dir, entry, warm)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _run_workers(world_size, opts, argv, checkpoint_dir, entry, warm) -> int:
    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    cpus = os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cpus * opts.nnodes // world_size)))
    os.environ["PARAXIS_COMMAND"] = shlex.join(["paraxis", *argv])
    os.environ.update(worker_environment(dict(os.environ), cuda=torch.cuda.is_available()))
    # torchrun shares its rendezvous store with the workers' process groups across
    # restarts, so a restarted worker may read a peer's address from the previous
    # attempt and fail to connect (pytorch/pytorch#135712; seen here on restart after a
    # killed rank, in about half the runs). A store per attempt avoids it.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    report = tempfile.mkdtemp(prefix="paraxis-report-")  # the workers' records
    os.environ[REPORT_ENV] = report
    lines = WarningLines().install()  # this process's warnings as the workers' (one line)
    lock = None
    if checkpoint_dir and opts.node_rank == 0:  # one writer: the first node holds it
        lock = DirectoryLock(checkpoint_dir).acquire()
        os.environ[LOCK_ENV] = "1"
    # The agent logs each stop it makes ("Sending process ... closing signal", "failed
    # (exitcode: 1)"), and torch.multiprocessing, which runs forked workers, the peers it
    # terminates once one failed ("Terminating process ... via signal SIGTERM", when a
    # peer has not exited yet: seen under load); explain() says what happened to each
    # rank instead, once.
    quiet = [logging.getLogger(n) for n in ("torch.distributed.elastic",
                                            "torch.multiprocessing.spawn")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.CRITICAL)
    try:
        args = parse_args(torchrun_args(world_size, opts, argv))
        if entry is not None and fork_safe():
            prepare_fork(warm)
            sys.stdout.flush()
            launch_forked(args, entry, argv)
        else:
            sys.stdout.flush()
            run(args)
        return 0
    except ChildFailedError as exc:
        failed = {rank: failure.signal_name() if failure.exitcode < 0 else None
                  for rank, failure in exc.failures.items()}
        for line in explain(report, failed):
            print(f"paraxis: {line}", file=sys.stderr)
        return 1
    except SignalException as exc:  # the workers were told and stopped at a step
        return 128 + int(exc.sigval)
    finally:
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)
        shutil.rmtree(report, ignore_errors=True)
        if lock is not None:
            lock.release()
        lines.uninstall()
