"""What the MoE timers measure, and the chunked dispatch's default on NCCL, without
processes (paraxis_moe.stats, paraxis_moe.overlap; issue 32 item 7).

The timers read the run's clock: the host clock by default (seconds known at once; on
CUDA, launch times), or CUDA events on the stream with ``parallelism.stream_timing``,
kept as pairs and read only when the step's metrics are reduced. No GPU here: stream
events are stand-ins, one second apart per record. ``moe.dispatch_chunks`` > 1 on a
stream-ordered (NCCL) group is an unvalidated CUDA path: one warning per model."""

import warnings

import pytest
import torch

from paraxis.config.parallel import MoEConfig
from paraxis.runtime.clock import Span, Stopwatch
from paraxis.runtime.cuda_paths import UnvalidatedCudaPath
from paraxis.runtime.grid import AxisGroup
from paraxis_moe.overlap import chunked_wanted
from paraxis_moe.stats import LayerStats, MoEStats

BLOCKS = ["model.layers.*.mlp"]


class Stream:
    """Stand-in CUDA events: each record is one second after the previous one."""

    def __init__(self):
        self.now, self.events = 0.0, []

    def event(self):
        return _Event(self)

    def synced(self):
        return [e.synced for e in self.events]


class _Event:
    def __init__(self, stream):
        self.stream, self.ms, self.synced = stream, None, False
        stream.events.append(self)

    def record(self):
        self.stream.now += 1000.0
        self.ms = self.stream.now

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, end):
        return end.ms - self.ms


def group(size, nccl):
    return AxisGroup(("expert",), tuple(range(size)), 0, stream_ordered=nccl)


def test_host_spans_are_added_at_once():
    stats = LayerStats(4)
    stats.add_time("dispatch_s", Span(1.0, 1.25))
    stats.add_time("compute_s_per_expert", Span(0.0, 2.0), torch.tensor([0.5, 0.5, 0, 0]))
    assert float(stats.values["dispatch_s"]) == 0.25 and not stats.pending
    assert stats.values["compute_s_per_expert"].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_stream_spans_are_read_when_the_step_is_reduced_not_before():
    stream = Stream()
    clock = Stopwatch(on_stream=True, event=stream.event)
    stats = MoEStats(4, ["l0"], clock)
    layer = stats.layers["l0"]
    start = clock.mark()
    clock.mark()  # something else recorded in between: the span covers it
    layer.add_time("dispatch_s", clock.since(start))
    layer.add_time("compute_s_per_expert", clock.since(start), torch.tensor([0.25, 0.75, 0, 0]))
    assert float(layer.values["dispatch_s"]) == 0.0 and not any(stream.synced())
    reduced = stats.reduce(None)["l0"]
    assert float(reduced["dispatch_s"]) == 2.0
    assert reduced["compute_s_per_expert"].tolist() == [0.75, 2.25, 0.0, 0.0]
    assert not layer.pending


def _trained_block(clock):
    """One forward and backward of a one-block Mixtral at expert 1, timed on ``clock``;
    the block's expert_compute_s before the metrics are read, and the metrics."""
    pytest.importorskip("transformers")
    from moe_tiny_models import build

    from paraxis_moe import ExpertParallel

    model = build("mixtral")
    ep = ExpertParallel(model, BLOCKS, group(1, False), clock=clock)
    ep.set_recording(True)
    model(input_ids=torch.randint(0, 64, (2, 6))).logits.sum().backward()
    before = float(ep.stats.layers["model.layers.0.mlp"].values["expert_compute_s"])
    return before, ep.step_metrics()


def test_by_default_compute_seconds_are_the_host_clock_at_once():
    before, metrics = _trained_block(None)
    assert before > 0.0 and metrics["moe/expert_compute_s"] == before


def test_on_the_stream_compute_seconds_wait_for_the_step_and_span_the_events():
    stream = Stream()
    before, metrics = _trained_block(Stopwatch(on_stream=True, event=stream.event))
    assert before == 0.0
    # Forward: a mark before and after the experts (1 s); backward: the probes around
    # them fire in turn (1 s). Read once, at the step's metrics.
    assert metrics["moe/expert_compute_s"] == 2.0
    assert stream.synced() == [False, True, False, True]  # each span's end, once


@pytest.mark.parametrize(("chunks", "size", "nccl", "want", "warned"), [
    (1, 2, True, False, 0),   # the default: no chunked path, nothing to say
    (2, 2, False, True, 0),   # gloo: run on CPU by the parity tests
    (2, 1, True, False, 0),   # one rank: nothing to exchange
    (2, 2, True, True, 1),    # NCCL: never run, runs as asked with one warning
])
def test_chunked_dispatch_is_resolved_once_and_warns_on_nccl(chunks, size, nccl, want, warned):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert chunked_wanted(chunks, group(size, nccl)) is want
    seen = [w for w in seen if w.category is UnvalidatedCudaPath]
    assert len(seen) == warned
    assert all("'moe_dispatch_chunks'" in str(w.message) for w in seen)


def test_a_model_of_many_blocks_warns_once():
    pytest.importorskip("transformers")
    from moe_tiny_models import build

    from paraxis_moe import ExpertParallel

    model = build("mixtral", layers=3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ep = ExpertParallel(model, BLOCKS, group(2, True), moe=MoEConfig(dispatch_chunks=2))
    assert len(ep.experts) == 3 and all(e.chunked for e in ep.experts.values())
    assert len([w for w in seen if w.category is UnvalidatedCudaPath]) == 1
