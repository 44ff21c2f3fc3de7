"""Run a schedule: this rank's actions in order, activations forward and their gradients
backward between adjacent stages (:class:`paraxis_pp.mailbox.Mailbox`).

Sends are asynchronous and awaited at the end of the step (a legal schedule never needs
a send to finish before the sender's next action); the receives of the next
``RECEIVES_AHEAD`` actions (``RECEIVES_AHEAD_HOST`` for host tensors) are posted before
an action computes, and an action blocks only until its own data is there. Adjacent
stages on the same rank (the turn of a V placement, stages ``p-1`` and ``p``) hand their
tensors over in memory. Activations of a microbatch are dropped as soon as its whole
backward (B) or its weight gradient (W, after a split backward's I) has run. A split
backward defers the linear layers' weight GEMMs from I to W (:mod:`paraxis_pp.deferred`)
where a chunk allows it, else splits the graph with torch's helpers. Each action's
compute time is recorded for the measured timeline (a W that ran a whole backward as
the B it was; :mod:`paraxis_pp.measure`: the host clock, or CUDA events with stream
timing), beside the mailbox's hand-overs to the transport between actions (posting
receives, sending): the part of the measured bubble that is point-to-point, not waiting
for another stage.

Auxiliary-loss carries (:class:`paraxis.parallel.batch.AuxLosses`): when a strategy declared one,
each forward sends, beside the hidden states, the sum of the stages' contributions so
far (float64); the last stage finalizes it and sends the result back beside the
gradient, so each stage resolves its exact auxiliary parts before its backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from paraxis.parallel.batch import Batch
from paraxis.parallel.strategy import ApplyContext
from paraxis.runtime.clock import Stopwatch
from paraxis.runtime.differentiable import autocast_dtype
from paraxis.runtime.grid import AxisGroup
from paraxis.runtime.liveness import guard
from paraxis.runtime.world import device_for_rank
from paraxis_pp.actions import Action, Schedule
from paraxis_pp.deferred import DeferredWeights
from paraxis_pp.mailbox import Mailbox
from paraxis_pp.measure import StepTimer
from paraxis_pp.simulate import Timeline, replay, theoretical_bubble
from paraxis_pp.timeline import render_svg, stage_times

__all__ = ["PipelineRunner"]


def _split_backward() -> tuple[Any, Any]:
    """torch's own B/W split (what its zero-bubble schedules use; private but stable),
    or (None, None) on a torch without it (W re-walks the graph instead). Imported
    when a split backward first runs: ``torch.distributed.pipelining`` costs about a
    second of CPU per process, which every run paid when loading this plugin."""
    try:
        from torch.distributed.pipelining._backward import (
            stage_backward_input,
            stage_backward_weight,
        )
    except ImportError:  # pragma: no cover - older torch
        return None, None
    return stage_backward_input, stage_backward_weight


# Receives posted ahead of the action that needs them: the next actions' (each holds one
# microbatch's hidden states until its action runs). Host tensors (gloo) look further:
# two actions ahead, a receive posted after its sender had announced the message blocked
# the poster for up to 7 ms (gloo's thread still handing the previous message over), and
# the middle rank of pp_vs_torch's ZB-V spent 28-38 ms a step posting (instrumented);
# eight ahead, 1-3 ms. Device tensors keep two: a longer window has not run on
# NCCL, whose receives hold the stream they are posted on.
RECEIVES_AHEAD = 2
RECEIVES_AHEAD_HOST = 8


# Said by the run summary where the passes ran on a device but were timed on the host.
HOST_CLOCK = (", timed on the host clock: launch times, not the device's "
              "(parallelism.stream_timing: on times the stream)")


@dataclass
class _Step:
    """One step's state on this rank, keyed by (microbatch, chunk)."""

    microbatches: list[Batch]
    loss_fn: Callable
    scale: Any
    train: bool
    aux_scale: float
    carrying: bool  # an auxiliary carry travels with activations and gradients
    total: torch.Tensor
    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    grads: dict[tuple[int, int], Any] = field(default_factory=dict)
    # (what this stage carried, the carry sum so far or the finalized numbers)
    carries: dict[tuple[int, int], tuple[Any, torch.Tensor]] = field(default_factory=dict)
    sends: list[Any] = field(default_factory=list)


class PipelineRunner:
    """``ctx.forward_backward`` for a pipeline: runs one step's schedule on this rank.

    Each chunk is a stage of the model (:mod:`paraxis.parallel.stages`) called with this
    microbatch's ids (first stage) or the received hidden states, plus its position ids
    and the plan's forward kwargs. Auxiliary losses a stage's modules add during a
    forward are back-propagated with that stage's backward of the same microbatch."""

    def __init__(self, chunks: list[nn.Module], schedule: Schedule, group: AxisGroup,
                 ctx: ApplyContext, forward_kwargs: dict[str, Any], *, hidden: int):
        self.chunks, self.schedule, self.group, self.ctx = chunks, schedule, group, ctx
        self.rank = group.rank
        self.forward_kwargs, self.hidden = forward_kwargs, hidden
        self.device = next(p for c in chunks for p in c.parameters()).device
        if self.device.type == "meta":  # weights read after the split (from_pretrained)
            self.device = device_for_rank()
        # Each action's (start, end) this step, on the run's clock.
        self.timer = StepTimer(Stopwatch(on_stream=ctx.grid.comm.on_stream), self.device)
        self.mail = Mailbox(group, schedule, self.device)
        # (microbatch, chunk) whose backward is split; chunks among them defer the linear
        # layers' weight GEMMs to W. Stage 0 too: it has no input gradient to send, but
        # its W then sums each microbatch's weight gradient in the GEMM, where a whole
        # backward at W added a new gradient to the held one (on pp_vs_torch's Llama at
        # hidden 1024, 1.38 s of B+W a step on stage 0's rank against 1.13 s deferred on
        # the other's, whose wait was then the bubble).
        self._split = {(a.mb, a.chunk) for a in schedule.actions[self.rank] if a.kind == "I"}
        split_chunks = {chunk for _, chunk in self._split}
        self.deferred = [DeferredWeights.install(c) if i in split_chunks else None
                         for i, c in enumerate(chunks)]

    # ---- messaging ---------------------------------------------------------------

    def _send(self, t: torch.Tensor, stage: int, kind: str, mb: int, src_stage: int) -> list:
        return self.mail.send(t, stage, kind, mb, src_stage)

    def _recv(self, shape: tuple[int, ...], stage: int, kind: str, mb: int,
              src_stage: int) -> torch.Tensor:
        return self.mail.recv(shape, stage, kind, mb, src_stage)

    def _post_receives(self, a: Action, st: _Step) -> None:
        """Post the receives action ``a`` will wait on (see :mod:`paraxis_pp.mailbox`)."""
        s = self.schedule
        stage, last = s.stage(self.rank, a.chunk), s.stages - 1
        shape = self._hidden_shape(st.microbatches[a.mb])
        if a.kind == "F" and stage > 0:
            self.mail.post(shape, stage - 1, "F", a.mb, stage - 1)
            if st.carrying:
                self.mail.post((self.ctx.aux_losses.carry_size,), stage - 1, "CF", a.mb,
                               stage - 1)
        elif a.kind in ("B", "I") and stage < last:
            self.mail.post(shape, stage + 1, "B", a.mb, stage + 1)
            if st.carrying:
                self.mail.post((self.ctx.aux_losses.carry_size,), stage + 1, "CB", a.mb,
                               stage + 1)

    def _hidden_shape(self, mb: Batch) -> tuple[int, int, int]:
        b, s = mb.input_ids.shape
        return (b, s // self.ctx.activation_sequence_shards, self.hidden)

    # ---- one step ----------------------------------------------------------------

    def __call__(self, microbatches: list[Batch], loss_fn: Callable,
                 scale: torch.Tensor | None, train: bool, aux_scale: float = 1.0,
                 ) -> torch.Tensor:
        s = self.schedule
        if train and len(microbatches) != s.microbatches:
            raise ValueError(f"the {s.name} schedule was built for {s.microbatches} "
                             f"microbatches, got {len(microbatches)}")
        actions = s.actions[self.rank] if train else tuple(
            Action("F", i, c) for c in range(s.chunks) for i in range(len(microbatches)))
        st = _Step(microbatches, loss_fn, scale, train, aux_scale,
                   carrying=train and self.ctx.aux_losses.carry_size > 0,
                   total=torch.zeros((), dtype=torch.float64, device=self.device))
        self.timer.begin(train)
        # Under bf16/fp16 hidden states and their gradients cross stages in that dtype
        # (half the bytes; one rounding more, as the residual stream is fp32).
        with self.ctx.forward_context():
            self.mail.reset(autocast_dtype(self.device.type) or torch.float32)
        window = RECEIVES_AHEAD_HOST if self.device.type == "cpu" else RECEIVES_AHEAD
        posted = 0  # actions whose receives are posted (each action's once, this one first)
        with torch.set_grad_enabled(train):
            for i, a in enumerate(actions):
                for ahead in actions[max(posted, i):i + 1 + window]:
                    self._post_receives(ahead, st)
                posted = max(posted, i + 1 + window)
                if a.kind == "F":
                    self._forward_action(a, st)
                elif a.kind in ("B", "I"):
                    self._backward_action(a, st)
                else:  # W: weight gradients of a split backward
                    start = self.timer.mark()
                    key = (a.mb, a.chunk)
                    saved = st.grads.pop(key)
                    self._weight_grads(key, st.outputs[key], saved)
                    # A W that ran the whole backward (torch's split on stage 0, or no
                    # split helpers at all) is recorded as the B it was.
                    self.timer.record(a if saved[0] != "full" else Action("B", a.mb, a.chunk),
                                      start)
                    st.inputs.pop(key), st.outputs.pop(key)
        with guard(self.group, "send"):
            for work in st.sends:
                work.wait()
        self.timer.end(self.mail.transfers)
        return st.total

    def _forward_action(self, a: Action, st: _Step) -> None:
        s, mb = self.schedule, st.microbatches[a.mb]
        stage, key = s.stage(self.rank, a.chunk), (a.mb, a.chunk)
        x = mb.input_ids if stage == 0 else self._recv(
            self._hidden_shape(mb), stage - 1, "F", a.mb, stage - 1)
        if stage > 0 and st.train:
            x.requires_grad_(True)
        if (store := self.deferred[a.chunk]) is not None:
            store.recording = st.train and key in self._split
        start = self.timer.mark()
        with self.ctx.forward_context():
            out = self.chunks[a.chunk](x, **mb.model_kwargs(), **self.forward_kwargs)
        aux = self._forward_aux(key, stage, st)
        if stage == s.stages - 1:
            loss_sum, _ = st.loss_fn(out, mb.targets)
            st.total += loss_sum.detach().double()
            out = loss_sum * st.scale.to(loss_sum.dtype) + aux if st.train else out
        self.timer.record(a, start)
        if stage < s.stages - 1:
            st.sends += self._send(out.detach(), stage + 1, "F", a.mb, stage)
            if st.carrying:
                st.sends += self._send(st.carries[key][1], stage + 1, "CF", a.mb, stage)
        if st.train:
            st.inputs[key] = x
            st.outputs[key] = [out] if stage == s.stages - 1 else [out, aux]

    def _backward_action(self, a: Action, st: _Step) -> None:
        stage, key = self.schedule.stage(self.rank, a.chunk), (a.mb, a.chunk)
        outs = st.outputs[key]
        last = stage == self.schedule.stages - 1
        grad = None if last else self._recv(outs[0].shape, stage + 1, "B", a.mb, stage + 1)
        if st.carrying and not last:
            outs += self._backward_aux(key, stage, st)
        start = self.timer.mark()
        x_grad = self._backward(key, outs, grad, st, stage, whole=a.kind == "B")
        if not (a.kind == "I" and stage == 0 and st.grads[key][0] == "full"):
            self.timer.record(a, start)  # else an I that did nothing: the whole backward is W's
        if stage > 0:
            st.sends += self._send(x_grad, stage - 1, "B", a.mb, stage)
        if st.carrying:
            final = st.carries.pop(key)[1]
            if stage > 0:
                st.sends += self._send(final, stage - 1, "CB", a.mb, stage)

    def _forward_aux(self, key: tuple[int, int], stage: int, st: _Step) -> torch.Tensor:
        """This forward's auxiliary objective (parts known now, times ``aux_scale``).
        With a carry: add this stage's contribution to the received sum; the last stage
        finalizes it and resolves its own parts now, the others keep their resolvers
        (``st.carries[key]`` = (carried, the sum so far)) for their backward."""
        aux = self.ctx.aux_losses
        parts = aux.pop()
        if st.carrying:
            carried = aux.pop_carried(self.device)
            total = carried.contribution
            if stage > 0:
                total = total + self._recv((aux.carry_size,), stage - 1, "CF", key[0],
                                           stage - 1)
            if stage == self.schedule.stages - 1:
                total = aux.finalize(total)
                for name, part in aux.resolve(carried, total).items():
                    parts[name] = parts[name] + part if name in parts else part
            st.carries[key] = (carried, total)
        zero = torch.zeros((), device=self.device)
        weighted = aux.weighted(parts, st.aux_scale)
        return zero if weighted is None else weighted + zero

    def _backward_aux(self, key: tuple[int, int], stage: int, st: _Step) -> list[torch.Tensor]:
        """Before a stage's backward: its carried parts, resolved with the finalized
        numbers that came back beside the gradient (the last stage resolved at F)."""
        aux = self.ctx.aux_losses
        carried, _ = st.carries[key]
        final = self._recv((aux.carry_size,), stage + 1, "CB", key[0], stage + 1)
        st.carries[key] = (carried, final)
        weighted = aux.weighted(aux.resolve(carried, final), st.aux_scale)
        return [] if weighted is None else [weighted]

    @staticmethod
    def _grad_list(outs: list[torch.Tensor], grad: torch.Tensor | None) -> list[Any]:
        """Output gradients: the received one for the hidden states (None on the last
        stage, whose output is the scalar loss), one for an auxiliary objective."""
        return [grad, *(torch.ones_like(o) for o in outs[1:])]

    def _backward(self, key: tuple[int, int], outs: list[torch.Tensor],
                  grad: torch.Tensor | None, st: _Step, stage: int, *, whole: bool,
                  ) -> torch.Tensor | None:
        """The whole backward (``whole``: B), or a split backward's input gradient (I),
        leaving what its W needs in ``st.grads``."""
        inputs, outputs, grads = st.inputs, st.outputs, st.grads
        x = inputs[key]
        if (store := self.deferred[key[1]]) is not None:  # a recomputed block's forward
            store.recording = key in self._split  # runs the linears as its forward did
        live = [(o, g) for o, g in zip(outs, self._grad_list(outs, grad), strict=True)
                if o.requires_grad]
        if whole:
            if live:
                torch.autograd.backward([o for o, _ in live], [g for _, g in live])
            inputs.pop(key), outputs.pop(key)  # activations freed now
            return (x.grad if x.grad is not None else torch.zeros_like(x)) if stage > 0 \
                else None
        # Split backward: the input gradient now (on the critical path), the weight
        # gradients at the W action. With torch's helpers I keeps the intermediate
        # gradients W needs, so nothing is computed twice; without them W walks the
        # graph again from the output.
        if store is not None and live:  # one backward, the linear weights' GEMMs kept
            grads[key] = ("deferred", store.backward_input([o for o, _ in live],
                                                           [g for _, g in live]))
            if stage == 0:  # the ids: no input gradient
                return None
            return x.grad if x.grad is not None else torch.zeros_like(x)
        if stage == 0:  # no input gradient to send: all the work happens at W
            grads[key] = ("full", live)
            return None
        stage_backward_input, _ = _split_backward()
        if stage_backward_input is not None:
            (x_grad,), groups = stage_backward_input(
                [o for o, _ in live], [g for _, g in live], [x],
                self.chunks[key[1]].parameters())
            grads[key] = ("groups", groups)
            return x_grad
        (x_grad,) = torch.autograd.grad([o for o, _ in live], [x], [g for _, g in live],
                                        retain_graph=True)
        grads[key] = ("full", live)
        return x_grad

    def _weight_grads(self, key: tuple[int, int], outs: list[torch.Tensor],
                      saved: tuple) -> None:
        how, value = saved
        if how == "deferred":
            DeferredWeights.weight(value)
        elif how == "groups":
            _split_backward()[1](self.chunks[key[1]].parameters(), value)
        elif value:
            torch.autograd.backward([o for o, _ in value], [g for _, g in value])

    def measured_svg(self) -> tuple[str, str]:
        """(SVG picture, one-line summary) of the last training step's measured timeline
        (an evaluation's forwards are not the schedule), with the
        measured bubble, its p2p part, the bubble its passes make alone (replayed with
        nothing between them) and theory. Collective over the pipeline group."""
        t = self.measured()
        stages = "; ".join(stage_times(t, self.schedule))
        p2p = f"p2p {t.handing_share:.3f} of it, " if any(t.transfers) else ""
        line = (f"pipeline {self.schedule.name}: measured bubble {t.bubble:.3f} ({p2p}its "
                f"passes alone {replay(self.schedule, t).bubble:.3f}), theory "
                f"{theoretical_bubble(self.schedule):.3f} (p={self.schedule.ranks}, "
                f"m={self.schedule.microbatches}, v={self.schedule.chunks})"
                f"{HOST_CLOCK if self.timer.times_launches else ''}; {stages}")
        return render_svg(t), line

    def measured(self) -> Timeline:
        """The last training step's timeline gathered from every stage on one clock
        (collective over the group)."""
        return self.timer.gather(self.group, f"{self.schedule.name} (measured)")
