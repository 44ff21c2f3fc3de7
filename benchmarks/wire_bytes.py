"""Bytes a peer puts on the wire, counted below DTensor at the collectives themselves.

A ``TorchDispatchMode`` sees every op; it steps aside for DTensor (returning
``NotImplemented``, as torch's ``CommDebugMode`` does), so DTensor's sharding
propagation runs and the collectives it lowers to (functional collectives on plain
local tensors, in forward and in backward) come back through the mode, where they are
sized. The sizes follow paraxis's bus convention (NCCL tests', what a ring moves per
rank; :mod:`paraxis.runtime.collectives`): all-reduce 2(n-1)/n x the tensor, all-gather
and reduce-scatter (n-1)/n x the full tensor, all-to-all (n-1)/n x the input (even
splits), broadcast the tensor. Only one rank's view is counted: use it on every rank and
compare rank by rank.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["WireBytes"]

_f = torch.ops._c10d_functional
_c = torch.ops.c10d

# op packet -> (name, factor of (n-1)/n, which tensor is sized: "in" or "out")
_FUNCOL = {
    _f.all_reduce: ("all_reduce", 2, "in"), _f.all_reduce_: ("all_reduce", 2, "in"),
    _f.all_reduce_coalesced: ("all_reduce", 2, "in"),
    _f.all_gather_into_tensor: ("all_gather", 1, "out"),
    _f.all_gather_into_tensor_out: ("all_gather", 1, "out"),
    _f.all_gather_into_tensor_coalesced: ("all_gather", 1, "out"),
    _f.reduce_scatter_tensor: ("reduce_scatter", 1, "in"),
    _f.reduce_scatter_tensor_coalesced: ("reduce_scatter", 1, "in"),
    _f.all_to_all_single: ("all_to_all", 1, "in"),
}
_C10D = {
    _c.allreduce_: ("all_reduce", 2, "in"),
    _c._allgather_base_: ("all_gather", 1, "out"),
    _c._reduce_scatter_base_: ("reduce_scatter", 1, "in"),
    _c.alltoall_base_: ("all_to_all", 1, "in"),
}
_OUTPUT_FIRST = {_c._allgather_base_, _c._reduce_scatter_base_, _c.alltoall_base_}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, list | tuple):
        return sum(_nbytes(t) for t in x)
    return 0


def _group_size(args: tuple) -> int:
    for a in args:
        if isinstance(a, dist.ProcessGroup):
            return a.size()
    for a in args:  # c10d's ops (a plain all_reduce) take the group's TorchScript box
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).size()
            except RuntimeError:  # another boxed argument (the reduce op)
                continue
    name = next(a for a in reversed(args) if isinstance(a, str))
    return _resolve_process_group(name).size()


class WireBytes(TorchDispatchMode):
    """``with WireBytes() as wire: step()``, then ``wire.bytes`` (op -> bytes) and
    ``wire.total``."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, float] = defaultdict(float)

    @property
    def total(self) -> float:
        return sum(self.bytes.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor lower it; its collectives come back here
        out = func(*args, **(kwargs or {}))
        packet = func._overloadpacket
        known = _FUNCOL.get(packet) or _C10D.get(packet)
        if known is not None:
            name, factor, which = known
            n = _group_size(args)
            if packet in _OUTPUT_FIRST:  # (output, input, process group, ...)
                sized = args[0] if which == "out" else args[1]
            else:
                sized = out if which == "out" else args[0]
            self.bytes[name] += factor * (n - 1) / n * _nbytes(sized)
        return out
