"""Messages between pipeline stages: hidden states forward, their gradients backward,
and the auxiliary-loss carry both ways, as point-to-point sends and receives.

Tags encode (kind, microbatch, sending stage), so a message never matches the wrong
receive. Sends are asynchronous (awaited by the runner at the end of the step). A
receive can be posted ahead of the action that needs it (:meth:`Mailbox.post`): the
runner posts the next actions' receives before it computes, so a message lands while
this rank works instead of waiting, when the action asks for it, for the sender to learn
that a buffer is ready (gloo hands unbound-buffer messages over once a receive is
posted). Two stages on one rank (the turn of a V placement) hand tensors over in
memory, with neither a message nor a rounding to the wire dtype.

Each hand-over to the transport (a receive posted, a message sent) is timed into
``transfers``: on gloo a send to a posted receive writes the message in the caller's
thread, time the measured bubble would otherwise count as waiting.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from paraxis.runtime.grid import AxisGroup
from paraxis.runtime.liveness import guard
from paraxis_pp.actions import Schedule

__all__ = ["MESSAGES", "Mailbox"]

# Hidden states forward, gradients backward, and the auxiliary carry both ways.
MESSAGES = {"F": 0, "B": 1, "CF": 2, "CB": 3}


def _tag(kind: str, mb: int, stage: int) -> int:
    return (mb * len(MESSAGES) + MESSAGES[kind]) * 1024 + stage


class Mailbox:
    """This rank's messages over the pipeline group for one step at a time."""

    def __init__(self, group: AxisGroup, schedule: Schedule, device: torch.device):
        self.group, self.schedule, self.device = group, schedule, device
        self.wire = torch.float32  # this step's dtype of hidden states on the wire
        self._local: dict[int, torch.Tensor] = {}
        self._posted: dict[int, tuple[torch.Tensor, list[Any]]] = {}
        # (start, end) of this step's posts and sends, in the machine's monotonic clock.
        self.transfers: list[tuple[float, float]] = []

    def reset(self, wire: torch.dtype) -> None:
        self.wire, self._local, self._posted, self.transfers = wire, {}, {}, []

    def _peer(self, stage: int) -> int:
        return self.group.ranks[self.schedule.place(stage)[0]]

    def here(self, stage: int) -> bool:
        return self.schedule.place(stage)[0] == self.group.rank

    def send(self, t: torch.Tensor, stage: int, kind: str, mb: int, src_stage: int) -> list:
        """Send ``t`` to ``stage``; the works to await (none for this rank's stage)."""
        if self.here(stage):  # the receiving stage is this rank's: no wire, no rounding
            self._local[_tag(kind, mb, src_stage)] = t
            return []
        # Hidden states and their gradients travel in the step's wire dtype; carries
        # stay float64.
        start = time.perf_counter()
        t = (t if kind.startswith("C") else t.to(self.wire)).contiguous()
        op = dist.P2POp(dist.isend, t, self._peer(stage), self.group.pg,
                        _tag(kind, mb, src_stage))
        self.group.stats.add(self.group.axes, "send", t.numel() * t.element_size())
        works = dist.batch_isend_irecv([op])
        self.transfers.append((start, time.perf_counter()))
        return works

    def post(self, shape: tuple[int, ...], stage: int, kind: str, mb: int,
             src_stage: int) -> None:
        """Post the receive of a message from ``stage`` now (once)."""
        tag = _tag(kind, mb, src_stage)
        if tag in self._posted or self.here(stage):
            return
        start = time.perf_counter()
        dtype = torch.float64 if kind.startswith("C") else self.wire
        buf = torch.empty(shape, device=self.device, dtype=dtype)
        op = dist.P2POp(dist.irecv, buf, self._peer(stage), self.group.pg, tag)
        self._posted[tag] = (buf, dist.batch_isend_irecv([op]))
        self.transfers.append((start, time.perf_counter()))

    def recv(self, shape: tuple[int, ...], stage: int, kind: str, mb: int,
             src_stage: int) -> torch.Tensor:
        """The message from ``stage``, in fp32 (float64 for a carry)."""
        if self.here(stage):
            t = self._local.pop(_tag(kind, mb, src_stage))
            return t if t.dtype in (torch.float32, torch.float64) else t.float()
        self.post(shape, stage, kind, mb, src_stage)
        buf, works = self._posted.pop(_tag(kind, mb, src_stage))
        with guard(self.group, "recv"):  # a dead neighbour is named, not waited for
            for work in works:
                work.wait()  # mostly waiting for the other stage's compute: the bubble
        return buf if buf.dtype in (torch.float32, torch.float64) else buf.float()
