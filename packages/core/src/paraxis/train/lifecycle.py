"""Runs that end cleanly: one writer per checkpoint directory, workers that die with
their launcher, and a stop at a step boundary on SIGINT or SIGTERM.

* :class:`DirectoryLock`: a run holds an exclusive ``flock`` on
  ``<checkpoint_dir>/.paraxis.lock`` for its lifetime, with its host and pid written in
  the file. A second run against the directory fails at once, naming the holder. The
  kernel drops the lock when its holder dies, however it dies, so a lock whose holder is
  gone is taken over (with a warning naming the previous holder).
* :func:`die_with_parent`: torchrun starts each worker in a session of its own, so when
  the launcher is killed (SIGKILL leaves it no chance to clean up) nothing stops the
  workers: they kept training and writing checkpoints for minutes. A worker asks the
  kernel to kill it when its parent dies (``PR_SET_PDEATHSIG``, Linux) and a watchdog
  thread checks its parent every second elsewhere.
* :class:`StopRequest`: SIGINT (Ctrl-C; torchrun forwards it to its workers) and SIGTERM
  (a scheduler's notice before its time limit) only set a flag. The engine shares the
  flags of all ranks in its per-step all-gather, so every rank stops after the same
  step; the trainer then writes a checkpoint, as Megatron's exit-signal handler does, and
  prints one line. A second signal restores the default handler (a second Ctrl-C quits).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time
import warnings
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = ["DirectoryLock", "LockedError", "StopRequest", "die_with_parent"]

LOCK_NAME = ".paraxis.lock"
LOCK_ENV = "PARAXIS_LOCK_HELD"  # set by a launcher holding the lock for its workers


class LockedError(RuntimeError):
    """Another live run holds the checkpoint directory."""


class DirectoryLock:
    """An exclusive, advisory lock on a checkpoint directory for the life of a run.

    ``fcntl.flock`` works across processes on one host and on most shared filesystems
    that support it (NFSv4, Lustre with ``flock``); the holder is recorded for the
    error message, never trusted for correctness.
    """

    def __init__(self, directory: str | os.PathLike[str]):
        self.path = Path(directory) / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> DirectoryLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_holder(fd)
            os.close(fd)
            raise LockedError(
                f"checkpoint directory {self.path.parent} is in use by another run "
                f"(pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
                f"since {holder.get('since', '?')}): two runs must never write one "
                "directory. Stop that run, or use another train.checkpoint_dir") from None
        previous = _read_holder(fd)
        if previous:
            warnings.warn(f"taking over the lock of {self.path.parent} from pid "
                          f"{previous.get('pid')} on {previous.get('host')}, which is no "
                          "longer running", stacklevel=2)
        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                             "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        self.fd = fd
        return self

    def keep_across_exec(self) -> None:
        """Let the lock survive ``os.exec*`` (the process that execs keeps holding it)."""
        if self.fd is not None:
            os.set_inheritable(self.fd, True)

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        raw = os.pread(fd, 4096, 0)
        return json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return {}


PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Kill this process when its parent (the launcher's agent) dies."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent or parent == 1:  # it died before the kernel was told
        os.kill(os.getpid(), sig)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name="paraxis-parent-watchdog", daemon=True).start()


class StopRequest:
    """SIGINT / SIGTERM set :attr:`requested` (a signal name); nothing else happens in
    the handler. Install on every rank; uninstall restores the previous handlers."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None:  # a second signal: give up waiting, quit now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested = signal.Signals(signum).name

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
