"""All-gather and reduce-scatter of host tensors without gloo's whole-sized copies.

torch 2.13's gloo process group runs ``all_gather_into_tensor`` by gathering into a flat
temporary as large as the output and copying it out, and ``reduce_scatter_tensor`` by
cloning the whole input and all-reducing the clone (``ProcessGroupGloo::
allgather_coalesced`` and ``::reduce_scatter_tensor_coalesced``). For ZeRO-3 that is a
second copy of every unit in flight, as large as the head for the head. Here, for
tensors on the host (what gloo carries):

* all-gather: each rank's part is broadcast by its owner straight into its slot of the
  output, one broadcast per rank, issued in slot order on every rank (so every rank
  agrees on the sequence of collectives). Nothing but the output is written.
* reduce-scatter, where the caller gives up its input (a send buffer it drops after):
  the input is all-reduced in place and this rank's part copied out. It moves what
  gloo's own op moved (which all-reduced its clone), without the clone.

``python benchmarks/host_collectives.py`` measures both against gloo's own ops (memory
and time, in RESULTS.md). The bytes a caller records stay the logical collective's (the
ring's, what NCCL moves and the planner models); a CUDA tensor takes torch's ops.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from paraxis.runtime.works import Works

__all__ = ["gather_by_broadcasts", "on_host", "scatter_by_all_reduce"]


def on_host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _slots(t: torch.Tensor, pg: Any) -> tuple[torch.Tensor, int, int]:
    n = dist.get_world_size(pg)
    return t.view(n, -1), dist.get_rank(pg), n


def _done(works: Works, async_op: bool) -> Works | None:
    if async_op:
        return works
    works.wait()
    return None


def gather_by_broadcasts(out: torch.Tensor, part: torch.Tensor, *, group: Any,
                         async_op: bool = False) -> Works | None:
    """``out`` (contiguous, flat) = every rank's ``part`` in group-rank order."""
    slots, me, n = _slots(out, group)
    slots[me].copy_(part.reshape(-1))
    works = [dist.broadcast(slots[k], src=dist.get_global_rank(group, k), group=group,
                            async_op=True) for k in range(n)]
    return _done(Works(works), async_op)


def scatter_by_all_reduce(out: torch.Tensor, flat: torch.Tensor, *, group: Any,
                          async_op: bool = False) -> Works | None:
    """``out`` = this rank's equal part of the sum of ``flat`` over ``group``;
    ``flat`` is summed in place (the caller gives it up)."""
    slots, me, _ = _slots(flat, group)
    work = dist.all_reduce(flat, group=group, async_op=True)
    return _done(Works([work], lambda: out.view(-1).copy_(slots[me])), async_op)
