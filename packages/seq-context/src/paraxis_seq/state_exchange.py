"""What the ranks of a context group exchange so that a recurrence cut into chunks gives
the whole sequence's result (issue 35): each chunk's boundary state and transition, the
last inputs a causal convolution needs, and where documents start.

A layer whose output is affine in its initial state (a selective scan, the gated delta
rule, a causal convolution of its inputs) runs each chunk from a zero state, in
parallel; the state entering chunk ``k`` is then ``h_k = T_{k-1} h_{k-1} + S_{k-1}``
(``S`` the chunk's final state from zero, ``T`` the map its steps apply to a state that
enters it), and each chunk adds what ``h_k`` contributes to its outputs. This is the
state passing of Mamba-2's chunked algorithm (Dao & Gu, arXiv:2405.21060, section 6),
one level up: between ranks instead of between chunks of one kernel call.

**Layout.** The state passes through the layout's chunks in the sequence's order,
whatever rank holds them: zigzag (ring attention's layout, rank r holds chunks r and
2C-1-r) and contiguous shards alike. Every rank all-gathers every chunk's (T, S), a
few kilobytes per layer, and folds the recurrence above locally up to its own chunks.
Why not a contiguous layout for models with recurrent layers: their attention layers
would lose zigzag's causal balance, while the recurrent layers, whose work is linear in
a rank's tokens, are balanced in any layout. Why not a chain of sends: C-1 hops of
latency on the critical path, against one all-gather here.

**Documents.** A packed document's first token resets the state: chunk ``k`` carries
``h_k`` only in rows whose document continues across the cut, a chunk holding a
document boundary has no transition (``T = 0``: its exit state is its last document's,
from zero), and inside a chunk each document runs on its own.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import torch

from paraxis.runtime.collectives import gather_along
from paraxis.runtime.differentiable import all_gather

__all__ = ["ChunkLayout", "carried", "document_runs", "entering_states", "gather_chunks",
           "halo_mask", "joined", "preceding"]


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """The chunks one sequence is cut into over the ``group`` (the grid's ``context``
    group): ``2C`` zigzag chunks (rank r holds r and 2C-1-r) or ``C`` contiguous ones."""

    group: Any
    layout: str = "zigzag"

    @property
    def total(self) -> int:
        return 2 * self.group.size if self.layout == "zigzag" else self.group.size

    def held(self, rank: int | None = None) -> tuple[int, ...]:
        """The chunks ``rank`` (this rank by default) holds, in its shard's order."""
        r = self.group.rank if rank is None else rank
        return (r, self.total - 1 - r) if self.layout == "zigzag" else (r,)


def gather_chunks(parts: list[torch.Tensor], chunks: ChunkLayout, *,
                  grad: bool = True) -> list[torch.Tensor]:
    """Every chunk's tensor, in the sequence's order, from each rank's ``parts`` (one per
    chunk it holds, the same shape on every rank). ``grad``: differentiable (backward
    reduce-scatters: each rank uses the chunks differently) or not (document ids)."""
    stacked = torch.stack(parts)
    gathered = all_gather(stacked, chunks.group, dim=0, grad="sum") if grad else \
        gather_along(stacked, 0, chunks.group)
    ordered: list[torch.Tensor | None] = [None] * chunks.total
    for rank in range(chunks.group.size):
        for i, chunk in enumerate(chunks.held(rank)):
            ordered[chunk] = gathered[rank * len(parts) + i]
    return ordered  # type: ignore[return-value]


def entering_states(exits: list[torch.Tensor], transitions: list[torch.Tensor],
                    chunks: ChunkLayout, apply: Callable[[torch.Tensor, torch.Tensor],
                                                         torch.Tensor],
                    carry: list[torch.Tensor | None] | None = None,
                    ) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """The state entering each chunk this rank holds (None for the sequence's first, or
    where every row starts a document there), from this rank's chunks' final states
    from zero (``exits``) and ``transitions``; ``apply(T, h)`` maps a state through a
    chunk; ``carry[k]`` (rows,) says which rows continue a document into chunk ``k``.
    Also the gathered tensor, for :func:`joined`."""
    shapes = [exits[0].shape, transitions[0].shape]
    packed = [torch.cat([t.flatten(1), s.flatten(1)], dim=1)
              for t, s in zip(transitions, exits, strict=True)]
    gathered = gather_chunks(packed, chunks)
    held = chunks.held()
    entering: dict[int, torch.Tensor | None] = {}
    state: torch.Tensor | None = None
    for k in range(max(held) + 1):
        if k in held:
            entering[k] = state
        width = shapes[1].numel() // shapes[1][0]
        transition = gathered[k][:, :width].reshape(shapes[1])
        final = gathered[k][:, width:].reshape(shapes[0])
        state = final if state is None else apply(transition, state) + final
        if carry is not None:
            keep = carry[k + 1] if k + 1 < chunks.total else None
            if keep is not None:
                state = state * keep.to(state.dtype).view(-1, *[1] * (state.dim() - 1))
                state = state if bool(keep.any()) else None
    return [entering[k] for k in held], gathered[0]


class _Joined(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
        ctx.like = (gathered.shape, gathered.dtype, gathered.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.like
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def joined(out: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
    """``out``, with ``gathered`` (a differentiable all-gather's output) made part of its
    graph: the all-gather's backward is a collective, so every rank must run it, also one
    whose chunks used nothing gathered (the sequence's first chunk, a document start)."""
    return _Joined.apply(out, gathered) if gathered.requires_grad else out


def document_runs(ids: torch.Tensor) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of equal document ids in a 1-D ``ids`` (a document,
    or a stretch of padding, -1)."""
    cuts = ((ids[1:] != ids[:-1]).nonzero().flatten() + 1).tolist()
    bounds = [0, *cuts, int(ids.numel())]
    return list(itertools.pairwise(bounds))


def _edges(ids: list[torch.Tensor], chunks: ChunkLayout, width: int) -> list[torch.Tensor]:
    """Per chunk of the sequence, (rows, 1 + width): its first token's document id and
    its last ``width`` tokens'."""
    return gather_chunks([torch.cat([i[:, :1], i[:, -width:]], dim=1) for i in ids], chunks,
                         grad=False)


def carried(ids: list[torch.Tensor], chunks: ChunkLayout) -> list[torch.Tensor | None]:
    """Per chunk of the sequence, (rows,) bool: does its first token continue the
    document the previous chunk ends with (None for the first chunk)?"""
    edges = _edges(ids, chunks, 1)
    return [None] + [edges[k][:, 0] == edges[k - 1][:, -1] for k in range(1, chunks.total)]


def preceding(parts: list[torch.Tensor], chunk: int, width: int, fill: float = 0,
              ) -> torch.Tensor:
    """The last ``width`` columns (last dim) before ``chunk``: the chunks before it
    contribute their ``parts`` (each chunk's last columns) in order, and what lies
    before the sequence is ``fill``; a chunk shorter than ``width`` reaches further back
    (four context ranks cut a 16-token probe into chunks of 2 for a 4-tap convolution)."""
    last = parts[0].new_full((*parts[0].shape[:-1], width), fill)
    return torch.cat([last, *parts[:chunk]], dim=-1)[..., -width:]


def halo_mask(ids: list[torch.Tensor], chunks: ChunkLayout, width: int,
              keep: int) -> list[torch.Tensor | None]:
    """Per chunk of the sequence, (rows, width) bool: which of the ``width`` tokens
    before it are in the document it starts with (None for the first chunk); each
    chunk's last ``keep`` tokens' ids are exchanged."""
    edges = _edges(ids, chunks, keep)
    tails = [e[:, 1:] for e in edges]
    return [None] + [preceding(tails, k, width, fill=-2) == edges[k][:, :1]
                     for k in range(1, chunks.total)]
