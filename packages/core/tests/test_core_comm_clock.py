"""Exposed communication per axis (``comm/<axes>_exposed_s``): the blocked wall time on
gloo, and on a stream-ordered backend the gap between two CUDA events around the wait,
read when the step's totals are (CommStats.settle), where ``parallelism.stream_timing``
is on (off under auto until a GPU run validates it: paraxis.runtime.cuda_paths); else
the host clock. No GPU here: the event path is checked with stand-in events that report
a known gap."""

from paraxis.runtime import clock as clock_module
from paraxis.runtime.collectives import _Clock
from paraxis.runtime.comm_stats import CommStats
from paraxis.runtime.group import AxisGroup


class _Event:
    def __init__(self, ms):
        self.ms, self.synced = ms, False

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, end):
        return end.ms - self.ms


def test_stream_waits_are_read_into_seconds_per_axis_at_the_next_mark():
    stats = CommStats()
    mark = stats.mark()
    stats.add(("tensor",), "all_gather", 1024.0, 0.0)
    start, end = _Event(10.0), _Event(12.5)
    stats.add_stream_wait(("tensor",), "all_gather", start, end)
    stats.add(("data",), "all_reduce", 8.0, 0.25)
    assert stats.seconds_by_axis(mark) == {"tensor": 0.0025, "data": 0.25}
    assert end.synced and stats.stream_waits == []
    assert stats.bytes_by_axis(mark) == {"tensor": 1024.0, "data": 8.0}


class _Stream:
    """Stand-in CUDA events on one stream: each record is one second later."""

    def __init__(self):
        self.now, self.events = 0.0, []

    def event(self):
        stream = self

        class Recorded(_Event):
            def __init__(self):
                super().__init__(None)
                stream.events.append(self)

            def record(self):
                stream.now += 1000.0
                self.ms = stream.now
        return Recorded()


def _nccl_group(stats):
    return AxisGroup(axes=("tensor",), ranks=(0, 1), rank=0, stats=stats, stream_ordered=True)


def test_on_nccl_without_stream_timing_the_clock_reads_the_host():
    stats = CommStats()  # on_stream False: parallelism.stream_timing auto, unvalidated
    clock = _Clock(_nccl_group(stats))
    assert clock.stop("all_gather") >= 0.0 and stats.stream_waits == []


def test_with_stream_timing_the_clock_defers_to_events_read_at_the_mark(monkeypatch):
    stream = _Stream()
    monkeypatch.setattr(clock_module, "_cuda_event", stream.event)
    stats = CommStats(on_stream=True)
    mark = stats.mark()
    assert _Clock(_nccl_group(stats)).stop("all_gather") == 0.0
    assert len(stats.stream_waits) == 1 and not any(e.synced for e in stream.events)
    assert stats.seconds_by_axis(mark) == {"tensor": 1.0}  # one record apart
    assert stream.events[-1].synced
