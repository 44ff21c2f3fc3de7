"""Run test bodies on N real gloo ranks: one harness for every multi-rank test.

A :class:`DistributedWorld` spawns N processes once (each: a file rendezvous,
``OMP_NUM_THREADS=1``, gloo with a collective timeout) and runs any number of
functions on them, so several checks share one start-up. Every failure raises in the
parent with each failing rank's traceback and the ranks that never answered; nothing
waits longer than the timeout. On close each rank frees what it holds, collects garbage,
meets the others at a barrier and destroys its group: torch 2.13 aborts at interpreter
exit in about one run in ten without that.

The rendezvous is a file store in a fresh temporary folder, not a TCP port: a port
picked free is only free until someone else binds it, and under ``pytest -n 2`` another
worker's ranks sometimes did (EADDRINUSE at start-up, seen in CI at b1246d0).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from paraxis.runtime.liveness import STALE_AFTER_S
from paraxis.runtime.world import free_port

__all__ = ["DistributedWorld", "RankFailure", "WorldPool", "free_port", "run_distributed"]

DEFAULT_TIMEOUT = 120.0


class RankFailure(AssertionError):
    """One or more ranks raised, died or did not answer in time."""


def _worker(rank: int, world: int, store_path: str, timeout: float,
            inbox: Any, outbox: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout))
    except BaseException:
        outbox.put((rank, False, f"rank {rank} failed to join:\n{traceback.format_exc()}"))
        return
    outbox.put((rank, True, pickle.dumps("ready")))
    while True:
        task = inbox.get()
        if task is None:
            break
        try:
            fn, args = pickle.loads(task)
            result = pickle.dumps(fn(*args))
            outbox.put((rank, True, result))
        except BaseException:
            outbox.put((rank, False, f"rank {rank}:\n{traceback.format_exc()}"))
            return  # the world is out of step now; the parent tears it down
        finally:
            task = fn = args = None
            gc.collect()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


class DistributedWorld:
    """N gloo ranks kept alive to run many test bodies; use as a context manager."""

    def __init__(self, world_size: int, *, timeout: float = DEFAULT_TIMEOUT):
        self.world_size = world_size
        self.timeout = timeout
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        self._outbox: Any = None
        self._store_dir: str | None = None
        self.broken = False

    def start(self) -> DistributedWorld:
        ctx = mp.get_context("spawn")
        self._outbox = ctx.Queue()
        self._store_dir = tempfile.mkdtemp(prefix="paraxis-world-")
        store_path = os.path.join(self._store_dir, "store")
        old = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # read when the child's torch starts
        try:
            for rank in range(self.world_size):
                inbox = ctx.Queue()
                proc = ctx.Process(target=_worker, daemon=True, name=f"paraxis-rank{rank}",
                                   args=(rank, self.world_size, store_path, self.timeout, inbox,
                                         self._outbox))
                proc.start()
                self._procs.append(proc)
                self._inboxes.append(inbox)
        finally:
            if old is None:
                os.environ.pop("OMP_NUM_THREADS")
            else:
                os.environ["OMP_NUM_THREADS"] = old
        self._collect(self.timeout, "start-up")
        return self

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """Run ``fn(*args)`` on every rank; return the results in rank order.

        ``fn`` must be importable (module level) and its result picklable.
        """
        if self.broken or not self._procs:
            raise RankFailure("this world is closed or broken by an earlier failure")
        task = pickle.dumps((fn, args))
        for inbox in self._inboxes:
            inbox.put(task)
        return self._collect(timeout or self.timeout, getattr(fn, "__qualname__", repr(fn)))

    def _collect(self, timeout: float, what: str) -> list[Any]:
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(failures) < self.world_size:
            if failures:  # the others may sit in a collective: give them time to name
                # the dead peer (a heartbeat goes stale in STALE_AFTER_S), no more
                deadline = min(deadline, time.monotonic() + STALE_AFTER_S + 6.0)
            try:
                rank, ok, payload = self._outbox.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs)
                        if not p.is_alive() and r not in results and r not in failures]
                for r in dead:
                    failures[r] = f"rank {r} died (exit code {self._procs[r].exitcode})"
                if time.monotonic() > deadline:
                    break
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
        missing = [r for r in range(self.world_size) if r not in results and r not in failures]
        if failures or missing:
            self.broken = True
            self.close()
            lines = [f"{what} failed on {self.world_size} ranks"]
            if missing:
                lines.append(f"ranks {missing} did not answer within {timeout:.0f}s")
            lines += [failures[r] for r in sorted(failures)]
            raise RankFailure("\n".join(lines))
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        if not self.broken:
            for inbox in self._inboxes:
                inbox.put(None)
            for proc in self._procs:
                proc.join(timeout=30)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs.clear()
        self._inboxes.clear()
        if self._store_dir is not None:
            shutil.rmtree(self._store_dir, ignore_errors=True)
            self._store_dir = None

    def __enter__(self) -> DistributedWorld:
        return self.start() if not self._procs else self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.close()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
    """Spawn ``world_size`` ranks, run ``fn(*args)`` on each, shut down, return results."""
    with DistributedWorld(world_size, timeout=timeout) as world:
        return world.run(fn, *args)


class WorldPool:
    """Worlds of several sizes, each started on first use and again after a failure
    broke it (the ``worlds`` fixture of :mod:`paraxis.testing.pytest_plugin`, and the
    planner's accuracy measurement)."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT):
        self.timeout = timeout
        self._worlds: dict[int, DistributedWorld] = {}

    def run(self, world_size: int, fn: Callable[..., Any], *args: Any,
            timeout: float | None = None) -> list[Any]:
        world = self._worlds.get(world_size)
        if world is None or world.broken:
            world = DistributedWorld(world_size, timeout=self.timeout).start()
            self._worlds[world_size] = world
        return world.run(fn, *args, timeout=timeout)

    def restart(self, world_size: int) -> None:
        """Close the world of ``world_size``; the next run starts a fresh one (after a
        failure that may have left a rank inside a collective)."""
        world = self._worlds.pop(world_size, None)
        if world is not None:
            world.broken = True  # do not wait for ranks that may be stuck
            world.close()

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()
