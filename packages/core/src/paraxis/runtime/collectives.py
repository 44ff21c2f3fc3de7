"""Collectives shared by every axis, each counting the bytes it puts on the wire and the
seconds the caller sat blocked; a failed one names the dead ranks (:mod:`.liveness`).

Bytes follow the bus-bandwidth convention of NCCL's tests (what a ring moves per rank):
all-reduce ``2(n-1)/n`` x size, all-gather and reduce-scatter ``(n-1)/n`` x the full
size, all-to-all the bytes sent to other ranks, point-to-point the message. Counts go to
the :class:`CommStats` of the group's grid, keyed by the group's axes and the op, so an
engine can report bytes per axis without any axis plumbing its own counter.

These are plain functions on tensors (in place, into buffers, or returning a new
tensor); the differentiable pairs a model's forward needs are in
:mod:`paraxis.runtime.differentiable`, built on these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from paraxis.runtime import host_collectives as host
from paraxis.runtime.clock import Stopwatch
from paraxis.runtime.comm_stats import CommStats
from paraxis.runtime.group import AxisGroup
from paraxis.runtime.liveness import guard

__all__ = [
    "WIRE_DTYPES",
    "CommStats",
    "Pending",
    "all_gather_into",
    "all_gather_object",
    "all_reduce_",
    "all_to_all_dims",
    "barrier",
    "exchange_rows",
    "gather_along",
    "own_part",
    "record",
    "reduce_scatter_along",
    "reduce_scatter_into",
    "summed",
]


# torch 2.13 renamed the flat collectives (the old names warn); torch >= 2.6 is supported.
_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Clock:
    """The time a caller sits blocked on one collective: on gloo its wall time. On NCCL
    the call returns at once and the *compute stream* waits, so with
    ``parallelism.stream_timing`` on (``CommStats.on_stream``) two CUDA events bracket
    the call (or ``wait()``) on the current stream and their gap, read with the step's
    totals (:meth:`CommStats.settle`), is the stall; a CUDA path no GPU has validated
    yet (:mod:`paraxis.runtime.cuda_paths`, ``stream_timing``), off unless asked for."""

    def __init__(self, group: AxisGroup):
        stats = getattr(group, "stats", None)
        self.group, self.stats = group, stats
        # decided once, when the grid made the group and read the config
        on_stream = group.stream_ordered and stats is not None and stats.on_stream
        self.watch = Stopwatch(on_stream=on_stream)
        self.start = self.watch.mark()

    def stop(self, op: str) -> float:
        """Seconds blocked (0 where the events will tell, later)."""
        span = self.watch.since(self.start)
        if not span.on_stream:
            return span.seconds()
        self.stats.add_stream_wait(self.group.axes, op, span.start, span.end)
        return 0.0


# ``parallelism.reduce_dtype`` -> what gradient reductions travel in (None: as held).
WIRE_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}


def record(group: AxisGroup, op: str, nbytes: float, seconds: float) -> None:
    """Add ``nbytes`` and ``seconds`` of ``op`` to the stats of ``group``'s grid (if any)."""
    stats = getattr(group, "stats", None)
    if stats is not None:
        stats.add(group.axes, op, nbytes, seconds)


def _ring(t: torch.Tensor, n: int, factor: float = 1.0) -> float:
    return factor * (n - 1) / n * t.numel() * t.element_size()


class Pending:
    """An asynchronous collective: ``wait()`` blocks, counts the seconds, runs
    ``finish`` (a narrower wire's copy back), and returns the result (if the op
    produces one)."""

    def __init__(self, work: Any, group: AxisGroup, op: str, result: Any = None,
                 finish: Callable[[], Any] | None = None):
        self.work, self.group, self.op, self.result = work, group, op, result
        self.finish = finish

    def wait(self) -> Any:
        if self.work is not None:
            clock = _Clock(self.group)
            with guard(self.group, self.op):
                self.work.wait()
            record(self.group, self.op, 0.0, clock.stop(self.op))
            self.work = None
        if self.finish is not None:
            self.finish()
            self.finish = None
        return self.result


def _narrow(pending: Pending | None, copy_back: Callable[[], Any]) -> Pending | None:
    """Copy a reduction done on a narrower wire tensor back, now or on ``wait()``."""
    if pending is None:
        copy_back()
        return None
    pending.finish = copy_back
    return pending


# ---- in-place and buffer collectives (no autograd) ----------------------------------


def all_reduce_(t: torch.Tensor, group: AxisGroup, *, op: Any = None,
                async_op: bool = False, wire_dtype: torch.dtype | None = None,
                ) -> Pending | None:
    """Sum (or ``op``) ``t`` in place over ``group``; a no-op for a group of one. With
    ``wire_dtype`` (``WIRE_DTYPES``) the reduction runs on a copy in that dtype."""
    if group.size == 1:
        return Pending(None, group, "all_reduce") if async_op else None
    if wire_dtype is not None and wire_dtype != t.dtype:
        wire = t.to(wire_dtype)
        return _narrow(all_reduce_(wire, group, op=op, async_op=async_op),
                       lambda: t.copy_(wire))
    kwargs = {} if op is None else {"op": op}
    clock = _Clock(group)
    with guard(group, "all_reduce"):
        work = dist.all_reduce(t, group=group.pg, async_op=async_op, **kwargs)
    record(group, "all_reduce", _ring(t, group.size, 2.0),
            0.0 if async_op else clock.stop("all_reduce"))
    return Pending(work, group, "all_reduce") if async_op else None


def reduce_scatter_into(out: torch.Tensor, flat: torch.Tensor, group: AxisGroup, *,
                        async_op: bool = False, wire_dtype: torch.dtype | None = None,
                        consume: bool = False) -> Pending | None:
    """``out`` = this rank's part of the sum of ``flat`` over ``group`` (in ``wire_dtype``
    if given); ``consume``: ``flat`` may be summed in place (:mod:`.host_collectives`)."""
    if group.size == 1:
        out.copy_(flat)
        return Pending(None, group, "reduce_scatter") if async_op else None
    if wire_dtype is not None and wire_dtype != flat.dtype:
        part = torch.empty(out.shape, dtype=wire_dtype, device=out.device)
        send = flat.to(wire_dtype)  # held by the closure until the reduction is done
        return _narrow(reduce_scatter_into(part, send, group, async_op=async_op,
                                           consume=True), lambda: (send, out.copy_(part)))
    clock = _Clock(group)
    scatter = host.scatter_by_all_reduce if consume and host.on_host(flat) else _scatter_flat
    with guard(group, "reduce_scatter"):
        work = scatter(out, flat, group=group.pg, async_op=async_op)
    record(group, "reduce_scatter", _ring(flat, group.size),
            0.0 if async_op else clock.stop("reduce_scatter"))
    return Pending(work, group, "reduce_scatter") if async_op else None


def all_gather_into(out: torch.Tensor, part: torch.Tensor, group: AxisGroup, *,
                    async_op: bool = False) -> Pending | None:
    """``out`` (flat) = every rank's ``part``, in rank order (:mod:`.host_collectives`)."""
    if group.size == 1:
        out.copy_(part)
        return Pending(None, group, "all_gather") if async_op else None
    clock = _Clock(group)
    gather = host.gather_by_broadcasts if host.on_host(out) else _gather_flat
    with guard(group, "all_gather"):
        work = gather(out, part, group=group.pg, async_op=async_op)
    record(group, "all_gather", _ring(out, group.size),
            0.0 if async_op else clock.stop("all_gather"))
    return Pending(work, group, "all_gather") if async_op else None


def gather_along(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``, in rank order (contiguous)."""
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((group.size * moved.shape[0], *moved.shape[1:]), dtype=x.dtype,
                      device=x.device)
    all_gather_into(out, moved, group)
    # Contiguous once here: every consumer (q, k and v projections of one gathered
    # block input) would otherwise copy the strided view itself, and autograd would
    # keep each copy for the backward (issue 15's measurement: 3 copies per attention
    # block under sequence parallelism).
    return out.movedim(0, dim).contiguous()


def reduce_scatter_along(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    """This rank's equal part along ``dim`` of the sum of ``x`` over ``group``."""
    if x.shape[dim] % group.size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over "
                         f"{group.size} ranks of {'x'.join(group.axes)}")
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // group.size, *moved.shape[1:]), dtype=x.dtype,
                      device=x.device)
    reduce_scatter_into(out, moved, group)
    return out.movedim(0, dim)


def own_part(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    """This rank's equal part of ``x`` along ``dim`` (no communication)."""
    if x.shape[dim] % group.size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over "
                         f"{group.size} ranks of {'x'.join(group.axes)}")
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


def summed(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """A new tensor: the sum of ``x`` over ``group``."""
    x = x.contiguous().clone()
    all_reduce_(x, group)
    return x


def barrier(group: AxisGroup) -> None:
    """Wait for every rank of ``group`` (a dead one is named, not waited for forever)."""
    if group.size > 1:
        clock = _Clock(group)
        with guard(group, "barrier"):
            dist.barrier(group=group.pg)
        record(group, "barrier", 0.0, clock.stop("barrier"))


def all_gather_object(obj: Any, group: AxisGroup) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (metadata, never tensors)."""
    out: list[Any] = [None] * group.size
    if group.size == 1:
        out[0] = obj
        return out
    with guard(group, "all_gather_object"):
        dist.all_gather_object(out, obj, group=group.pg)
    return out


@overload
def exchange_rows(x: torch.Tensor, group: AxisGroup, send: Sequence[int], recv: Sequence[int],
                  *, async_op: Literal[False] = ...) -> torch.Tensor: ...
@overload
def exchange_rows(x: torch.Tensor, group: AxisGroup, send: Sequence[int], recv: Sequence[int],
                  *, async_op: Literal[True]) -> Pending: ...
def exchange_rows(x: torch.Tensor, group: AxisGroup, send: Sequence[int],
                  recv: Sequence[int], *, async_op: bool = False) -> torch.Tensor | Pending:
    """Rows of ``x`` (dim 0) go to ranks by ``send`` counts; ``recv`` rows come back:
    a new tensor, or with ``async_op`` a :class:`Pending` whose ``wait()`` returns it
    (``result`` is the buffer being filled; the sent rows are held until then)."""
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    row = x[0].numel() * x.element_size() if x.shape[0] else 0
    clock = _Clock(group)
    with guard(group, "all_to_all"):
        work = dist.all_to_all_single(out, x, output_split_sizes=list(recv),
                                      input_split_sizes=list(send), group=group.pg,
                                      async_op=async_op)
    record(group, "all_to_all", float((sum(send) - send[group.rank]) * row),
           0.0 if async_op else clock.stop("all_to_all"))
    return Pending(work, group, "all_to_all", result=out, finish=lambda: x) \
        if async_op else out


def all_to_all_dims(x: torch.Tensor, group: AxisGroup, scatter_dim: int,
                    gather_dim: int) -> torch.Tensor:
    """Part i of ``scatter_dim`` goes to rank i; what arrives is stacked along
    ``gather_dim`` in rank order."""
    n = group.size
    if x.shape[scatter_dim] % n:
        raise ValueError(f"dimension {scatter_dim} of size {x.shape[scatter_dim]} does not "
                         f"split over {n} ranks of {'x'.join(group.axes)}")
    # Chunk i of the scatter dim goes to rank i: split that dim as (n, size/n) and move
    # the rank index first, so whole runs of the dims after it move together (the
    # layout of DeepSpeed-Ulysses' all-to-all; moving the scatter dim itself first
    # copies with a stride per element of it, about twice slower for heads).
    shape = list(x.shape)
    chunk = [*shape[:scatter_dim], shape[scatter_dim] // n, *shape[scatter_dim + 1:]]
    flat = x.reshape(*shape[:scatter_dim], n, *chunk[scatter_dim:]).movedim(
        scatter_dim, 0).contiguous()
    out = torch.empty_like(flat)
    clock = _Clock(group)
    with guard(group, "all_to_all"):
        dist.all_to_all_single(out, flat, group=group.pg)
    record(group, "all_to_all", _ring(flat, n), clock.stop("all_to_all"))
    # out[j] is rank j's chunk for us, stacked along the gather dim in rank order: the
    # rank index put just before that dim and merged with it, a view when the dims
    # before it have size 1 (one sequence per rank); else one concatenation (faster
    # than reshape's strided copy).
    merged = list(chunk)
    merged[gather_dim] *= n
    try:
        return out.movedim(0, gather_dim).view(merged)
    except RuntimeError:
        return torch.cat(out.unbind(0), dim=gather_dim)
