"""Chunked, overlapped expert dispatch (``moe.dispatch_chunks`` > 1).

A block's tokens are cut into ``c`` contiguous chunks, each dispatched and combined on
its own, so an all-to-all of one chunk is in flight while the local experts compute
another (the chunked overlap of Megatron-Core's ``--overlap-moe-expert-parallel-comm``
and of DeepSeek-V3's DualPipe, arXiv:2412.19437, section 3.2.2, here within one
forward)::

    launch d0 | wait d0, launch d1, compute 0, launch c0 | wait d1, launch d2, compute 1,
    launch c1 | ... | wait c0, c1, ... and unpermute

The uneven split sizes of every chunk are exchanged first, in one blocking all-to-all of
the ``(c, E)`` counts; then each exchange is launched (``async_op``) and waited on by two
autograd nodes, :class:`_Launch` and :class:`_Wait`. Backward mirrors them: ``_Wait``'s
backward launches the gradient's exchange (passing the gradient on unchanged, so shapes
check) and ``_Launch``'s ignores what reaches it and waits for the exchange, so the
gradient all-to-all of one chunk is in flight while autograd runs the experts' backward of
another (the engine runs ready nodes latest-created first; the graph is the same on every
rank, so every rank issues the exchanges in the same order).

Seconds: ``exposed`` is the time spent waiting (plus the blocking count exchange), ``span``
the time from each launch to the end of its wait (its lifetime); at one chunk both are the
blocking time, so ``moe/a2a_exposed_share`` is 1 there. Both come from the dispatcher's
clock: on NCCL without ``parallelism.stream_timing`` a wait returns once the stream is
told to wait, so they measure launches (:mod:`paraxis_moe.stats`).

On NCCL this path has never run (no GPU was lent): it is the CUDA path
``moe_dispatch_chunks`` of :mod:`paraxis.runtime.cuda_paths`. ``dispatch_chunks``
defaults to 1 (off); setting it above 1 on NCCL warns once, naming it
(:func:`chunked_wanted`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from paraxis.runtime.clock import Span, Stopwatch
from paraxis.runtime.collectives import exchange_rows
from paraxis.runtime.cuda_paths import cuda_path_on
from paraxis.runtime.differentiable import wire_dtype
from paraxis.runtime.grid import AxisGroup
from paraxis_moe.dispatcher import AllToAllDispatcher, Dispatched, local_ids, unpermute

__all__ = ["Flight", "chunk_bounds", "chunked_exchange", "chunked_wanted", "counted",
           "merged"]

# (exposed span, lifetime span) of one finished exchange.
OnDone = Callable[[Span, Span], None]


def chunked_wanted(chunks: int, group: AxisGroup) -> bool:
    """Whether ``moe.dispatch_chunks`` = ``chunks`` runs the chunked exchange over
    ``group``, resolved once per run: more than one chunk and rank; on a stream-ordered
    group (NCCL) the unvalidated CUDA path ``moe_dispatch_chunks``, run as asked with one
    warning (:mod:`paraxis.runtime.cuda_paths`)."""
    wanted = chunks > 1 and group.size > 1
    if wanted and group.stream_ordered:
        return cuda_path_on("moe_dispatch_chunks", "on")
    return wanted


class Flight:
    """One uneven all-to-all of rows in flight over ``group``: ``send[i]`` rows to rank
    i, ``recv[j]`` from rank j; sent in ``wire`` (None: as held) and cast back; timed on
    ``clock``."""

    def __init__(self, group: AxisGroup, send: tuple[int, ...], recv: tuple[int, ...],
                 wire: torch.dtype | None, on_done: OnDone | None, clock: Stopwatch):
        self.group, self.send, self.recv, self.wire = group, send, recv, wire
        self.on_done, self.clock = on_done, clock

    def launch(self, x: torch.Tensor) -> torch.Tensor:
        """Start sending ``x``; returns the buffer being filled (read it after wait).
        Core's exchange counts the bytes (once, at launch) and the blocked seconds."""
        self.dtype = x.dtype
        sent = x if self.wire is None else x.to(self.wire)
        self.start = self.clock.mark()
        self.pending = exchange_rows(sent, self.group, self.send, self.recv, async_op=True)
        return self.pending.result

    def wait(self) -> torch.Tensor:
        begin = self.clock.mark()
        out = self.pending.wait()
        end = self.clock.mark()
        del self.pending  # the sent rows are released with it
        if self.on_done is not None:
            self.on_done(Span(begin, end), Span(self.start, end))
        return out if self.wire is None else out.to(self.dtype)


class _Ticket:
    """The forward and backward flights of one exchange."""

    def __init__(self, group: AxisGroup, send: tuple[int, ...], recv: tuple[int, ...],
                 wire: torch.dtype | None, on_done: OnDone | None, clock: Stopwatch):
        self.forward = Flight(group, send, recv, wire, on_done, clock)
        self.backward = Flight(group, recv, send, wire, on_done, clock)


class _Launch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ticket: _Ticket) -> torch.Tensor:
        ctx.ticket = ticket
        return ticket.forward.launch(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.ticket.backward.wait(), None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, buffer: torch.Tensor, ticket: _Ticket) -> torch.Tensor:
        ctx.ticket = ticket
        out = ticket.forward.wait()
        return buffer.view_as(buffer) if out is buffer else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # Start the mirrored exchange and pass the gradient on unchanged: _Launch's
        # backward ignores it and waits for the exchange's result.
        ctx.ticket.backward.launch(grad)
        return grad, None


def launch(x: torch.Tensor, ticket: _Ticket) -> torch.Tensor:
    return _Launch.apply(x, ticket)


def wait(buffer: torch.Tensor, ticket: _Ticket) -> torch.Tensor:
    return _Wait.apply(buffer, ticket)


def chunk_bounds(num_tokens: int, chunks: int) -> list[slice]:
    """``chunks`` contiguous token ranges, as equal as whole tokens allow. Never fewer
    (some may be empty): every rank of the group must run the same exchanges, whatever
    its token count."""
    edges = [num_tokens * i // chunks for i in range(chunks + 1)]
    return [slice(a, b) for a, b in itertools.pairwise(edges)]


def chunked_exchange(dispatcher: AllToAllDispatcher, hidden: torch.Tensor,
                     top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                     keep: torch.Tensor | None, chunks: int,
                     compute: Callable[[Dispatched], torch.Tensor],
                     on_done: OnDone | None) -> tuple[torch.Tensor, list[Dispatched], Span]:
    """Dispatch, ``compute`` and combine ``hidden`` (T, h) in ``chunks`` overlapped
    chunks; returns each token's weighted sum over its slots, the chunks' dispatch
    records, and the span of the blocking count exchange."""
    group, k, clock = dispatcher.group, top_k_index.shape[-1], dispatcher.clock
    n, local = group.size, dispatcher.num_local
    bounds = chunk_bounds(hidden.shape[0], chunks)
    planned = [dispatcher.permute(top_k_index, keep, b) for b in bounds]
    # The split sizes of every chunk in one exchange: rank j gets (chunk, its experts).
    start = clock.mark()
    sent = torch.stack([s for _, s in planned]).view(chunks, n, local)
    got = exchange_rows(sent.transpose(0, 1).contiguous().view(n * chunks, local), group,
                        [chunks] * n, [chunks] * n).view(n, chunks, local)
    count = clock.since(start)
    row_bytes = hidden.shape[-1] * hidden.element_size()
    wire = wire_dtype(hidden)
    records, tickets = [], []
    for i, (pairs, per_expert) in enumerate(planned):
        recv_counts = got[:, i]
        send = tuple(per_expert.view(n, local).sum(1).tolist())
        recv = tuple(recv_counts.sum(1).tolist())
        records.append(Dispatched(hidden[pairs // k], local_ids(recv_counts), pairs, send,
                                  recv, per_expert, recv_counts, row_bytes, group.rank))
        tickets.append(_Ticket(group, send, recv, wire, on_done, clock))
    buffers = [launch(records[0].tokens, tickets[0])]
    backs = []
    for i, d in enumerate(records):
        d.tokens = wait(buffers[i], tickets[i])
        if i + 1 < chunks:
            buffers.append(launch(records[i + 1].tokens, tickets[i + 1]))
        out = compute(d)
        # Expert outputs go back as computed (fp32 where the experts ran outside
        # autocast), as the unchunked combine sends them.
        ticket = _Ticket(group, d.recv, d.send, None, on_done, clock)
        backs.append((launch(out, ticket), ticket))
    outs = [unpermute(wait(buffer, ticket), d.pairs - b.start * k, top_k_weights[b],
                      None if keep is None else keep[b])
            for b, d, (buffer, ticket) in zip(bounds, records, backs, strict=True)]
    return torch.cat(outs), records, count


def merged(records: list[Dispatched]) -> Dispatched:
    """The chunks' dispatch records as one (counts and bytes summed; no rows), for the
    statistics the unchunked path records."""
    first = records[0]
    return Dispatched(first.tokens[:0], first.local_ids[:0], first.pairs[:0],
                      tuple(map(sum, zip(*(d.send for d in records), strict=True))),
                      tuple(map(sum, zip(*(d.recv for d in records), strict=True))),
                      sum(d.sent_per_expert for d in records),  # type: ignore[arg-type]
                      sum(d.recv_counts for d in records),  # type: ignore[arg-type]
                      first.row_bytes, first.rank)


def counted(stats: Any) -> OnDone | None:
    """What adds a finished exchange's exposed and lifetime spans to ``stats`` (a
    :class:`paraxis_moe.stats.LayerStats`; None: nothing is counted)."""
    if stats is None:
        return None

    def done(exposed: Span, lifetime: Span) -> None:
        stats.add_time("dispatch_s", exposed)
        stats.add_time("a2a_span_s", lifetime)
    return done
