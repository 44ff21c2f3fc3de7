"""The measured timeline on one clock (paraxis_pp.measure): passes timed by events on the
stream are read as host seconds against the step's anchor, and ranks on other hosts,
whose monotonic clocks share no origin, are moved onto the first rank's. No GPU here:
stand-in events keep a clock of their own (the host's, 1000 s later), and a rank 'on
another host' reads a host clock 500 s off, so a timeline left on either clock spans
minutes where the step took a fraction of a second."""

import time
import types

import pytest
import torch

import paraxis
from paraxis.models.tiny import TinyConfig, TinyTransformer
from paraxis.runtime import clock as clock_module
from paraxis.runtime.clock import Stopwatch
from paraxis_pp import mailbox as mailbox_module
from paraxis_pp import measure as measure_module
from paraxis_pp.executor import HOST_CLOCK
from paraxis_pp.measure import StepTimer

CFG = TinyConfig(vocab_size=61, hidden_size=32, num_layers=4, num_heads=4,
                 intermediate_size=64, seq_length=16)
EVENT_CLOCK_S, HOST_OFFSET_S = 1000.0, 500.0


class _StandInEvent:
    """A CUDA event on CPU: recorded now, on a clock 1000 s ahead of the host's."""

    def record(self):
        self.at = time.perf_counter() + EVENT_CLOCK_S

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


def _one_step(case):
    """One 1F1B step over 2 stages, timed as ``case`` says: (rank 0's host clock before
    and after the step, the gathered timeline, the run summary's line)."""
    torch.manual_seed(0)
    engine = paraxis.parallelize(TinyTransformer(CFG), pipeline=2, microbatches=4,
                                 pipeline_schedule="1f1b",
                                 train={"steps": 2, "lr": 1e-3, "seq_length": CFG.seq_length})
    runner = engine.ctx.forward_backward
    rank = torch.distributed.get_rank()
    saved = (clock_module.time, mailbox_module.time, measure_module.time,
             measure_module.socket)
    try:
        if case == "stream":
            runner.timer = StepTimer(Stopwatch(on_stream=True, event=_StandInEvent),
                                     runner.device)
        elif case == "hosts":
            measure_module.socket = types.SimpleNamespace(gethostname=lambda: f"host{rank}")
            if rank == 1:
                off = types.SimpleNamespace(
                    perf_counter=lambda: time.perf_counter() + HOST_OFFSET_S)
                clock_module.time = mailbox_module.time = measure_module.time = off
        before = time.perf_counter()
        engine.train_step(torch.randint(0, CFG.vocab_size, (8, CFG.seq_length)))
        after = time.perf_counter()
        if case == "eval":  # forwards only, 2 microbatches: not the schedule's step
            engine.eval_step(torch.randint(0, CFG.vocab_size, (4, CFG.seq_length)))
        timeline = runner.measured()
        _, line = runner.measured_svg()
    finally:
        (clock_module.time, mailbox_module.time, measure_module.time,
         measure_module.socket) = saved
    engine.close()
    return before, after, timeline, line


def _inside(timeline, before, after):
    """Every pass and hand-over of ``timeline`` lies within rank 0's step."""
    spans = [(s, e) for row in timeline.entries for _, s, e in row]
    spans += [span for row in timeline.transfers for span in row]
    slack = 0.05  # the barrier's exit spread and the step's own start, generously
    return all(before - slack <= s <= e <= after + slack for s, e in spans)


def test_passes_timed_on_the_stream_read_as_host_seconds_without_hand_overs(worlds):
    """With stream timing the passes' events are read against the step's anchor: the
    timeline is rank 0's step on the host clock. The mailbox's hand-overs, host spans
    that do not hold a stream, are left out of it and of the summary."""
    (before, after, timeline, line), (_, _, other, other_line) = worlds.run(
        2, _one_step, "stream")
    assert timeline == other and line == other_line
    assert _inside(timeline, before, after), timeline
    assert all(len(row) == 8 for row in timeline.entries)  # 4 F and 4 B a stage
    assert not any(timeline.transfers) and "p2p" not in line, line
    assert 0.0 < timeline.bubble < 1.0


def test_ranks_on_other_hosts_are_moved_onto_the_first_ranks_clock(worlds):
    """Rank 1 on a host of its own, whose clock reads 500 s more: its passes and
    hand-overs come back within rank 0's step, and the bubble is the pipeline's."""
    (before, after, timeline, line), _ = worlds.run(2, _one_step, "hosts")
    assert _inside(timeline, before, after), timeline
    assert timeline.makespan < after - before
    assert all(timeline.transfers) and "p2p" in line, line
    assert 0.0 < timeline.bubble < 0.9


@pytest.mark.parametrize(("device", "said"), [("cpu", False), ("meta", False),
                                              ("cuda", True)])
def test_passes_on_a_device_timed_on_the_host_are_said_to_be_launches(device, said):
    """A device's passes timed on the host clock measure their launch: the run summary
    says so (HOST_CLOCK) unless stream timing is on."""
    assert StepTimer(Stopwatch(), torch.device(device)).times_launches == said
    on_stream = StepTimer(Stopwatch(on_stream=True), torch.device(device))
    assert not on_stream.times_launches
    assert "launch times" in HOST_CLOCK and "stream_timing" in HOST_CLOCK



def test_an_evaluation_leaves_the_last_training_steps_timeline(worlds):
    """An evaluation after the training step runs forwards only (not the schedule): the
    summary keeps the training step's timeline, the one its theory and replay are of
    (the run summary of a run that evaluated had raised in the replay)."""
    (before, after, timeline, line), _ = worlds.run(2, _one_step, "eval")
    assert _inside(timeline, before, after), timeline
    assert [sorted({a.kind for a, _, _ in row}) for row in timeline.entries] == [["B", "F"]] * 2
    assert all(len(row) == 8 for row in timeline.entries)
    assert all(timeline.transfers) and "its passes alone" in line, line
