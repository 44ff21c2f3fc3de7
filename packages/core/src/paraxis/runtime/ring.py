"""One hop of a ring: send a block to the next member of a group while the previous one's
block arrives, asynchronously, so the caller computes on what it already holds meanwhile.

The building block of collectives cut into steps and interleaved with compute (a ring
all-gather whose chunks are consumed as they arrive; a ring reduce-scatter whose partial
sums are computed one destination at a time: Wang et al., "Overlap communication with
dependent computation via decomposition", ASPLOS 2023; Megatron-LM's tp_comm_overlap).
Bytes are the message sent, so ``t - 1`` hops of a ``1/t`` block count what an
all-gather or reduce-scatter of the whole tensor counts in :mod:`.collectives`
(``(t-1)/t`` of its size); blocked seconds are those ``wait()`` sits (a stream stall on
a stream-ordered group, read from CUDA events, :class:`~.collectives.Pending`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from paraxis.runtime.collectives import Pending, record
from paraxis.runtime.group import AxisGroup
from paraxis.runtime.liveness import guard
from paraxis.runtime.works import Works

__all__ = ["RingHop", "ring_gather", "ring_reduce_scatter"]


class RingHop:
    """Send to the member after this rank, receive from the one before (in ``ranks``
    order), counted under ``op`` on the group's stats."""

    def __init__(self, group: AxisGroup, op: str):
        n, i = group.size, group.rank
        self.group, self.op = group, op
        self.next, self.prev = group.ranks[(i + 1) % n], group.ranks[(i - 1) % n]

    def start(self, send: torch.Tensor) -> Pending:
        """Post the send of ``send`` and the receive of a block like it; ``wait()`` on
        the result returns the received block (and releases ``send``)."""
        send = send.contiguous()
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.irecv, recv, self.prev, group=self.group.pg),
               dist.P2POp(dist.isend, send, self.next, group=self.group.pg)]
        with guard(self.group, self.op):
            works = dist.batch_isend_irecv(ops)
        record(self.group, self.op, float(send.numel() * send.element_size()), 0.0)
        return Pending(Works(works), self.group, self.op, result=recv,
                       finish=lambda: send)  # keeps the sent block alive until then


def ring_gather(mine: torch.Tensor, group: AxisGroup, on_block: Callable[[int, torch.Tensor],
                Any], *, op: str = "all_gather_ring") -> list[torch.Tensor]:
    """Every rank's ``mine`` (list in rank order), calling ``on_block(rank, block)`` on
    this rank's block first and then on each block as it arrives, while the next hop is
    in flight."""
    hop, n = RingHop(group, op), group.size
    blocks: list[torch.Tensor | None] = [None] * n
    index, block = group.rank, mine
    for step in range(n):
        pending = hop.start(block) if step < n - 1 else None
        blocks[index] = block
        on_block(index, block)
        if pending is not None:
            block, index = pending.wait(), (index - 1) % n
    return blocks  # type: ignore[return-value]


def ring_reduce_scatter(partial: Callable[[int], torch.Tensor], group: AxisGroup, *,
                        wire: torch.dtype | None = None, before_last_wait: Callable[[], Any]
                        | None = None, op: str = "reduce_scatter_ring") -> torch.Tensor:
    """This rank's block of the sum over ``group`` of ``partial(block)``, each partial
    computed just before it is needed: the ``block`` whose sum ends at rank ``b`` travels
    ``b + 1, ..., b`` round the ring, gaining each rank's partial, so a rank computes the
    block for the rank before it first and its own last, each while the previous hop is
    in flight. ``wire``: the dtype the running sums travel in (summed in the partial's).
    ``before_last_wait`` runs after the last partial, while the last hop is in flight
    (a weight gradient that needs none of the result)."""
    hop, n, rank = RingHop(group, op), group.size, group.rank
    pending, total = None, None
    for step in range(n):
        part = partial((rank - 1 - step) % n)
        if step == n - 1 and before_last_wait is not None:
            before_last_wait()
        total = part if pending is None else pending.wait().to(part.dtype) + part
        if step < n - 1:
            pending = hop.start(total if wire is None else total.to(wire))
    assert total is not None
    return total
