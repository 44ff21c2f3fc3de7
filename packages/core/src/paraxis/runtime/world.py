"""Joining the process group: torchrun's environment, or a world of one.

NCCL on CUDA, gloo on CPU; the collective timeout is explicit so that no run hangs
forever on a dead peer.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["device_for_rank", "free_port", "init_distributed", "launched_world_size"]

DEFAULT_TIMEOUT_S = 600


def free_port() -> int:
    """A TCP port free on localhost right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launched_world_size() -> int:
    """The world size torchrun announced, or 1 outside torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def device_for_rank() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Initialize the default group once. Outside torchrun this makes a world of one on
    localhost, so single-process runs take the same code path."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(device_for_rank())
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
        return
    # an in-memory store: a world of one needs no port, so nothing can take it first
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timeout)
