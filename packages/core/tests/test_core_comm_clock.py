"""Exposed communication per axis (``comm/<axes>_exposed_s``): the blocked wall time on
gloo, and on a stream-ordered backend the gap between two CUDA events around the wait,
read when the step's totals are (CommStats.settle). No GPU here: the event path is
checked with stand-in events that report a known gap."""

from paraxis.runtime.comm_stats import CommStats


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
