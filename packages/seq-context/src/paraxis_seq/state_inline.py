"""State passing for mixers whose recurrence runs in their own forward, not through a
module-level kernel function (issue 35): paraxis_seq.recurrent calls one of these with
the mixer's own forward, by the mixer's class (:data:`paraxis_seq.recurrent.OWNED`).

* :class:`LightningAttention`, MiniMax's lightning attention (Qin et al., "Lightning
  Attention-2", arXiv:2401.04658): per head ``S_t = lambda S_{t-1} + k_t^T v_t`` and
  ``o_t = q_t S_t`` before its norm and gate, computed block by block inline. Its
  forward starts the block loop from ``torch.zeros(b, h, d, d)`` and returns the final
  state; the state a chunk exits with from zero is that, the transition over ``L``
  tokens ``exp(-slope_rate L)`` (the ``block_decay`` it applies per block, from its
  own buffer), and a chunk a state enters is run again with its block loop starting
  from that state (the name ``torch`` of its module resolves, for that call, to
  torch with ``zeros`` answering the state): its norm and gate follow the recurrence,
  so the state's part cannot be added after the forward.
* :class:`GriffinBlock`, RecurrentGemma's recurrent block (Griffin, De et al.,
  arXiv:2402.19427): its temporal ``Conv1d`` gets the previous chunk's last inputs
  (:class:`paraxis_seq.state_kernels.ConvolutionHalo` around the module's own call),
  and its RG-LRU's ``_rnn_scan`` method, a diagonal recurrence taking an initial state,
  is a :class:`paraxis_seq.state_kernels.StateScan` for the call.
* :class:`ConvolutionalProjection`, ZAYA's compressed convolutional attention projection
  (Figliolia et al., arXiv:2510.04476): q/k through two stacked causal convolutions
  (``m = (k0-1) + (k1-1)`` tokens back) and half of each value from the previous token.
  Every output depends on the ``m`` tokens before it alone, so each chunk runs the
  projection's own forward with the ``m`` hidden states before it prepended (fewer
  where the sequence starts closer) and keeps its own positions: a halo on its input.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from paraxis_seq.state_exchange import (
    carried,
    document_runs,
    entering_states,
    gather_chunks,
    joined,
    preceding,
)
from paraxis_seq.state_kernels import ConvolutionHalo, MixerCall, StateScan, bind

__all__ = ["ConvolutionalProjection", "GriffinBlock", "LightningAttention"]

Named = dict[str, Any]


def _cut(named: Named, shape: torch.Size, start: int, end: int, row: int | None = None,
         ) -> Named:
    """The arguments of one piece: each tensor laid out ``(b, s, ...)`` like the
    hidden states (tuples of them too: rotary embeddings) cut to ``[start, end)``, and to
    one row where ``row`` is given and the tensor has every row."""
    def one(t: Any) -> Any:
        if isinstance(t, tuple):
            return tuple(one(x) for x in t)
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[1] != shape[1]:
            return t
        if row is not None and t.shape[0] == shape[0]:
            t = t[row:row + 1]
        return t[:, start:end]

    return {k: one(v) for k, v in named.items()}


@contextlib.contextmanager
def _zeros_answering(scope: dict[str, Any], state: torch.Tensor) -> Iterator[None]:
    """``torch`` in ``scope`` (a module's globals) is torch, but ``torch.zeros`` of the
    state's shape gives ``state``; any other ``zeros`` call is an error (the forward
    changed: its zero state is no longer the one this replaces)."""
    real = scope["torch"]

    class _Torch:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def zeros(self, *size: Any, dtype: Any = None, device: Any = None, **_: Any) -> Any:
            if tuple(size) != tuple(state.shape):
                raise ValueError(f"lightning attention asked for zeros {tuple(size)}, not its "
                                 f"state {tuple(state.shape)}: its forward changed")
            return state.to(dtype=dtype, device=device)

    scope["torch"] = _Torch()
    try:
        yield
    finally:
        scope["torch"] = real


class LightningAttention:
    """MiniMax's ``MiniMaxLightningAttention`` (module docstring)."""

    def __call__(self, module: nn.Module, forward: Callable, call: MixerCall, *args: Any,
                 **kwargs: Any) -> Any:
        named = bind(forward, args, kwargs)
        if named.get("cache") is not None:
            raise ValueError("lightning attention was given a cache, which context-parallel "
                             "training never builds")
        shape = named["hidden_states"].shape
        held, ids = call.chunks.held(), call.chunk_ids()
        if shape[1] % len(held):
            raise ValueError(f"a shard of {shape[1]} tokens does not split into its "
                             f"{len(held)} layout chunks")
        size = shape[1] // len(held)
        pieces = [_cut(named, shape, j * size, (j + 1) * size) for j in range(len(held))]
        outs, exits, transitions, firsts = [], [], [], []
        decay = torch.exp(-module.slope_rate * size)[None].expand(shape[0], -1, -1, -1)
        for j, chunk in enumerate(held):
            out, final, first = self.from_zero(forward, pieces[j], None if ids is None
                                               else ids[j])
            outs.append(out)
            exits.append(final)
            firsts.append(first)
            t = decay.to(final.dtype) if chunk < call.chunks.total - 1 else \
                torch.zeros_like(decay, dtype=final.dtype)
            if first is not None:  # a row with a document start inside: no state crosses
                t = t * (first == size).to(t.device, t.dtype).view(-1, 1, 1, 1)
            transitions.append(t)
        carry = None if ids is None else carried(ids, call.chunks)
        states, gathered = entering_states(exits, transitions, call.chunks,
                                           lambda t, h: t * h, carry)
        outs[0] = joined(outs[0], gathered)
        scope = inspect.unwrap(type(module).forward).__globals__
        for j, entering in enumerate(states):
            if entering is not None:
                outs[j] = self.from_state(forward, pieces[j], entering, firsts[j], outs[j],
                                          scope)
        return torch.cat(outs, dim=1), None

    def from_zero(self, forward: Callable, piece: Named, ids: torch.Tensor | None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The piece's outputs and final state from a zero state (each document of a row
        from its own), and per row its first document's length (None: no documents)."""
        if ids is None:
            out, final = forward(**piece)
            return out, final, None
        shape = piece["hidden_states"].shape
        outs, finals, firsts = [], [], []
        for b in range(shape[0]):
            runs = document_runs(ids[b])
            parts = [forward(**_cut(piece, shape, a, e, b)) for a, e in runs]
            outs.append(torch.cat([o for o, _ in parts], dim=1))
            finals.append(parts[-1][1])
            firsts.append(runs[0][1])
        return torch.cat(outs), torch.cat(finals), torch.tensor(firsts)

    def from_state(self, forward: Callable, piece: Named, entering: torch.Tensor,
                   first: torch.Tensor | None, out: torch.Tensor, scope: dict[str, Any],
                   ) -> torch.Tensor:
        """The piece's outputs with ``entering`` as the state before it: the forward run
        again from it (over each row's first document only, where documents start)."""
        if first is None:
            with _zeros_answering(scope, entering):
                return forward(**piece)[0]
        shape, rows = piece["hidden_states"].shape, []
        for b in range(shape[0]):
            end = int(first[b])
            with _zeros_answering(scope, entering[b:b + 1]):
                head = forward(**_cut(piece, shape, 0, end, b))[0]
            rows.append(torch.cat([head, out[b:b + 1, end:]], dim=1))
        return torch.cat(rows)


_RG_LRU = StateScan(inputs=("hidden_states", "recurrent_gate", "reset"),
                    zeroed="hidden_states", state="recurrent_states", final=None,
                    transition="diagonal", pair=True)


class GriffinBlock:
    """RecurrentGemma's ``RecurrentGemmaRecurrentBlock`` (module docstring): for one
    call its ``conv_1d`` and its ``rg_lru._rnn_scan`` are replaced on the instances."""

    def __call__(self, module: nn.Module, forward: Callable, call: MixerCall, *args: Any,
                 **kwargs: Any) -> Any:
        conv, lru = module.conv_1d, module.rg_lru
        if conv.padding[0] != conv.kernel_size[0] - 1 or conv.groups != conv.in_channels:
            raise ValueError(f"{type(module).__name__}'s convolution is not the causal "
                             "depthwise one paraxis passes inputs across ranks for")

        own = conv.forward

        def causal(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return own(hidden_states)[..., :hidden_states.shape[-1]]

        def convolve(x: torch.Tensor) -> torch.Tensor:
            return ConvolutionHalo()(causal, call, x, conv.weight[:, 0, :])

        with _on_instance(conv, "forward", convolve), \
                _on_instance(lru, "_rnn_scan", functools.partial(_RG_LRU, lru._rnn_scan, call)):
            return forward(*args, **kwargs)


class ConvolutionalProjection:
    """ZAYA's ``ZayaCCAProjection`` (module docstring), returning (query, key, value)."""

    def __call__(self, module: nn.Module, forward: Callable, call: MixerCall, *args: Any,
                 **kwargs: Any) -> Any:
        named = bind(forward, args, kwargs)
        if named.get("cache") is not None or named.get("conv_mask") is not None or \
                call.documents is not None:
            raise ValueError("ZAYA's convolutional attention under context parallelism "
                             "takes neither a cache nor padded or packed rows (its "
                             "convolutions would reach across a document's start); train "
                             "on full rows")
        width = module.conv_kernel_size
        shape = named["hidden_states"].shape
        held = call.chunks.held()
        size = shape[1] // len(held)
        pieces = [_cut(named, shape, j * size, (j + 1) * size) for j in range(len(held))]
        keep = min(width, size)
        tails = gather_chunks([p["hidden_states"][:, -keep:].transpose(1, 2) for p in pieces],
                              call.chunks)
        outs = []
        for j, chunk in enumerate(held):
            before = min(width, chunk * size)  # no halo before the sequence's start
            piece = pieces[j]
            if before:
                halo = preceding(tails, chunk, before).transpose(1, 2)
                piece = {**piece, "hidden_states": torch.cat([halo, piece["hidden_states"]], 1)}
            outs.append([t[:, before:] for t in forward(**piece)])
        outs[0][0] = joined(outs[0][0], tails[0])
        return tuple(torch.cat(parts, dim=1) for parts in zip(*outs, strict=True))


@contextlib.contextmanager
def _on_instance(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` for the duration (an instance attribute, shadowing
    the class's method), then what it was."""
    missing = object()
    saved = vars(owner).get(name, missing)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if saved is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, saved)
