"""State passing around a model's own sequence kernels, one adapter per kernel kind
(issue 35). transformers runs every state-space scan, linear-attention recurrence and
short convolution of its hybrid families through a few module-level functions (its
torch reference paths here, ``mamba_ssm`` / ``fla`` / ``causal_conv1d`` kernels where
installed, same signatures); :mod:`paraxis_seq.recurrent` puts an adapter in place of
each while a wrapped mixer runs. An adapter calls the model's own function on this
rank's chunks from a zero state and adds what the state entering each chunk
contributes (:mod:`paraxis_seq.state_exchange`):

* :class:`StateScan`, kernels that take an initial state (Mamba-2's chunked scan; the
  gated delta rule of Qwen3-Next, Qwen3.5, OLMo-Hybrid, Lara; Kimi's delta attention).
  Their output and final state are affine in the initial state, so with the input that
  writes the state set to zero (Mamba-2's ``x``, the delta rule's values) the same
  kernel gives the state's part alone: from ``h`` the correction ``J h``, from ones
  (diagonal decay, Mamba-2) or the identity (the delta rule's ``(I - beta k k^T)``
  products) the transition ``T``.
* :class:`SelectiveScan`, Mamba-1's scan, whose reference path takes no initial state:
  ``T = exp(A sum dt)`` and ``J h = silu(z) C exp(A cumsum dt) h``, the discretization
  the kernel documents (Gu & Dao, arXiv:2312.00752, eq. 4), from its own arguments.
* :class:`ConvolutionHalo`, a causal depthwise convolution: the previous chunk's last
  ``k-1`` inputs are prepended and their outputs dropped (a halo exchange).

The extra kernel calls (transition, correction) run under activation recomputation:
they keep only their inputs, which the chunk's own call keeps anyway, so a rank holds
1/C of one process's activations for these layers (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from paraxis_seq.state_exchange import (
    ChunkLayout,
    carried,
    document_runs,
    entering_states,
    gather_chunks,
    halo_mask,
    joined,
    preceding,
)

__all__ = ["ConvolutionHalo", "MixerCall", "SelectiveScan", "StateScan", "refuse_step"]

Named = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class MixerCall:
    """One call of a wrapped mixer: the chunk layout and this call's document ids
    ``(b, s_local)`` (pads -1), or None when the batch has neither padding nor packing."""

    chunks: ChunkLayout
    documents: torch.Tensor | None = None

    def chunk_ids(self) -> list[torch.Tensor] | None:
        held = len(self.chunks.held())
        return None if self.documents is None else list(self.documents.chunk(held, dim=1))


def bind(function: Callable, args: tuple, kwargs: dict) -> Named:
    """The call's arguments by name, the keywords its ``**kwargs`` took among them (the
    function took them all, so it can be called again with them by name)."""
    signature = inspect.signature(function)
    named = dict(signature.bind(*args, **kwargs).arguments)
    for p in signature.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(p.name, {}))
    return named


def refuse_step(name: str) -> Callable[..., Any]:
    """Stands in for a kernel that steps one token from a cache (decoding): context
    parallelism trains without a cache, so reaching one is a bug to report."""

    def step(*args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"{name} steps one token from a cache, which context-parallel "
                         "training never builds (use_cache is off): a caller passed one")

    return step


class _Chunked:
    """What the adapters share: the tensors of a call that run along the sequence
    (``inputs``, sequence on ``seq_dim``; each adapter declares both)."""

    inputs: tuple[str, ...]
    seq_dim: int

    def cut(self, named: Named, start: int, end: int, rows: slice = slice(None)) -> Named:
        out = dict(named)
        for name in self.inputs:
            t = named.get(name)
            if isinstance(t, torch.Tensor):
                out[name] = t[rows].narrow(self.seq_dim, start, end - start)
        return out

    def chunks(self, named: Named, n: int) -> list[Named]:
        length = named[self.inputs[0]].shape[self.seq_dim]
        if length % n:
            raise ValueError(f"a shard of {length} tokens does not split into its {n} "
                             "layout chunks")
        size = length // n
        return [self.cut(named, i * size, (i + 1) * size) for i in range(n)]


@dataclasses.dataclass(frozen=True)
class StateScan(_Chunked):
    """A scan ``y, S = kernel(inputs, initial)`` (see the module docstring): ``zeroed``
    the input that writes the state, ``state`` / ``final`` the initial-state argument
    and the final-state flag, ``transition`` "diagonal" (state x T) or "matrix" (T @
    state, over the state's second-last dim), ``pair`` whether the kernel always returns
    (output, final state)."""

    inputs: tuple[str, ...]
    zeroed: str
    state: str
    final: str | None
    transition: str
    pair: bool = False
    seq_dim: int = 1

    def __call__(self, original: Callable, call: MixerCall, *args: Any, **kwargs: Any) -> Any:
        named = bind(original, args, kwargs)
        if named.get(self.final) or named.get(self.state) is not None:
            raise ValueError(f"{original.__name__} was asked to carry a state from or into "
                             "a cache, which context-parallel training never builds")
        run = self.runner(original)
        held = call.chunks.held()
        pieces, ids = self.chunks(named, len(held)), call.chunk_ids()
        outs, exits, transitions, firsts = [], [], [], []
        for j, chunk in enumerate(held):
            out, final, first = self.from_zero(run, pieces[j], None if ids is None else ids[j])
            outs.append(out)
            exits.append(final)
            firsts.append(first)
            if chunk == call.chunks.total - 1:  # nothing follows the sequence's last chunk
                transitions.append(torch.zeros_like(self.identity(run, pieces[j], final)))
                continue
            t = checkpoint(self.chunk_transition, run, pieces[j], final, use_reentrant=False)
            if first is not None:  # a row with a document start inside: no state crosses
                single = first == pieces[j][self.inputs[0]].shape[self.seq_dim]
                t = t * single.to(t.device, t.dtype).view(-1, *[1] * (t.dim() - 1))
            transitions.append(t)
        carry = None if ids is None else carried(ids, call.chunks)
        states, gathered = entering_states(exits, transitions, call.chunks, self.apply, carry)
        outs[0] = joined(outs[0], gathered)
        for j, entering in enumerate(states):
            if entering is not None:
                part = checkpoint(self.correction, run, pieces[j], entering,
                                  use_reentrant=False)
                if firsts[j] is not None:  # the state reaches the first document only
                    part = self.first_run_only(part, firsts[j])
                outs[j] = outs[j] + part.to(outs[j].dtype)
        out = torch.cat(outs, dim=self.seq_dim)
        return (out, None) if self.pair else out

    def runner(self, original: Callable) -> _Runner:
        return _Runner(original, self.final, self.state)

    def from_zero(self, run: _Runner, piece: Named, ids: torch.Tensor | None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The chunk's outputs and final state from a zero state (each document of a row
        from its own), and per row the length of its first document run (None: no
        documents, the whole chunk)."""
        rows = piece[self.inputs[0]].shape[0]
        if ids is None:
            out, final = run(piece)
            return out, final, None
        outs, finals, firsts = [], [], []
        for b in range(rows):
            runs = document_runs(ids[b])
            parts = [run(self.cut(piece, a, e, slice(b, b + 1))) for a, e in runs]
            outs.append(torch.cat([o for o, _ in parts], dim=self.seq_dim))
            finals.append(parts[-1][1])
            firsts.append(runs[0][1])
        return torch.cat(outs), torch.cat(finals), torch.tensor(firsts)

    def first_run_only(self, part: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(part.shape[self.seq_dim], device=part.device)
        keep = (positions[None, :] < first.to(part.device)[:, None]).to(part.dtype)
        shape = [part.shape[0]] + [1] * (part.dim() - 1)
        shape[self.seq_dim] = part.shape[self.seq_dim]
        return part * keep.view(shape)

    def identity(self, run: _Runner, piece: Named, final: torch.Tensor) -> torch.Tensor:
        """The state a transition is read from: ones (diagonal) or the identity."""
        if self.transition == "diagonal":
            return torch.ones_like(final)
        k = final.shape[-2]
        return torch.eye(k, dtype=final.dtype, device=final.device).expand(
            *final.shape[:-1], k).contiguous()

    def chunk_transition(self, run: _Runner, piece: Named, final: torch.Tensor) -> torch.Tensor:
        start = self.identity(run, piece, final)
        zero = piece[self.zeroed]
        width = start.shape[-1] if self.transition == "matrix" else zero.shape[-1]
        zeros = zero.new_zeros(*zero.shape[:-1], width)
        return run({**piece, self.zeroed: zeros}, start)[1]

    def correction(self, run: _Runner, piece: Named, entering: torch.Tensor) -> torch.Tensor:
        zero = piece[self.zeroed]
        return run({**piece, self.zeroed: torch.zeros_like(zero)}, entering)[0]

    def apply(self, transition: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return transition * state if self.transition == "diagonal" else transition @ state


@dataclasses.dataclass(frozen=True)
class _Runner:
    """The model's kernel on one piece from ``initial`` (None: zero; ``state`` None: the
    kernel takes no initial state), returning (output, final state)."""

    original: Callable
    final: str | None  # None: the kernel always returns its final state
    state: str | None

    def __call__(self, piece: Named, initial: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        named = dict(piece) if self.final is None else {**piece, self.final: True}
        if self.state is not None:
            named[self.state] = initial
        elif initial is not None:
            raise ValueError(f"{self.original.__name__} takes no initial state")
        got = self.original(**named)
        return got[0], got[1]


@dataclasses.dataclass(frozen=True)
class SelectiveScan(StateScan):
    """Mamba-1's ``selective_scan_fn`` (``u, delta, A, B, C, D, z``; the sequence last):
    no initial state in its reference path, so the transition and the correction are the
    scan's documented discretization of its own arguments (module docstring)."""

    inputs: tuple[str, ...] = ("hidden_states", "dt", "B", "C", "z")
    zeroed: str = "hidden_states"
    state: str = "initial_state"  # the reference path has none (see runner)
    final: str = "return_last_state"
    transition: str = "diagonal"
    seq_dim: int = 2

    def runner(self, original: Callable) -> _Runner:
        return _Runner(original, self.final, None)

    def chunk_transition(self, run: Any, piece: Named, final: torch.Tensor) -> torch.Tensor:
        steps = self.steps(piece)
        return torch.exp(piece["A"].float()[None] * steps.sum(-1)[..., None])

    def correction(self, run: Any, piece: Named, entering: torch.Tensor) -> torch.Tensor:
        decay = torch.exp(piece["A"].float()[None, :, None, :] * self.steps(piece).cumsum(-1)
                          [..., None])  # (b, d, s, n)
        c = piece["C"].float().transpose(1, 2)[:, None]  # (b, 1, s, n)
        out = (decay * c * entering.float()[:, :, None, :]).sum(-1)
        z = piece.get("z")
        return out if z is None else out * F.silu(z.float())

    def steps(self, piece: Named) -> torch.Tensor:
        dt = piece["dt"].float()
        if piece.get("delta_bias") is not None:
            dt = dt + piece["delta_bias"].float()[..., None]
        return F.softplus(dt) if piece.get("delta_softplus") else dt


@dataclasses.dataclass(frozen=True)
class ConvolutionHalo(_Chunked):
    """``causal_conv1d_fn(x (b, channels, s), weight (channels, k), bias, activation)``:
    each chunk convolves the ``k-1`` inputs before it (from the chunks before it; zero
    before the sequence and across a document's start) and keeps its own outputs."""

    inputs: tuple[str, ...] = ("hidden_states",)
    seq_dim: int = 2

    def __call__(self, original: Callable, call: MixerCall, *args: Any, **kwargs: Any) -> Any:
        named = bind(original, args, kwargs)
        width = named["weight"].shape[-1] - 1
        held = call.chunks.held()
        pieces, ids = self.chunks(named, len(held)), call.chunk_ids()
        length = pieces[0]["hidden_states"].shape[-1]
        if width == 0:
            return original(**named)
        keep = min(width, length)  # a chunk shorter than the halo: reach further back
        tails = gather_chunks([p["hidden_states"][..., -keep:] for p in pieces], call.chunks)
        masks = None if ids is None else halo_mask(ids, call.chunks, width, keep)
        outs = []
        for j, chunk in enumerate(held):
            before = preceding(tails, chunk, width)
            if masks is not None and chunk:
                before = before * masks[chunk].unsqueeze(1).to(before.dtype)
            outs.append(self.convolve(original, pieces[j], before,
                                      None if ids is None else ids[j]))
        outs[0] = joined(outs[0], tails[0])
        return torch.cat(outs, dim=-1)

    def convolve(self, original: Callable, piece: Named, before: torch.Tensor,
                 ids: torch.Tensor | None) -> torch.Tensor:
        def with_halo(x: torch.Tensor, halo: torch.Tensor) -> torch.Tensor:
            full = original(**{**piece, "hidden_states": torch.cat([halo, x], -1)})
            return full[..., halo.shape[-1]:]

        x = piece["hidden_states"]
        if ids is None:
            return with_halo(x, before)
        rows = []
        for b in range(x.shape[0]):
            runs = document_runs(ids[b])
            first = [with_halo(x[b:b + 1, :, :runs[0][1]], before[b:b + 1])]
            rest = [original(**{**piece, "hidden_states": x[b:b + 1, :, a:e]})
                    for a, e in runs[1:]]
            rows.append(torch.cat(first + rest, dim=-1))
        return torch.cat(rows)
