"""The CUDA path ``stream_timing`` on one GPU (paraxis.runtime.cuda_paths): every test
here passing is what records a run for it. Skipped, one line each, without CUDA.

* core's collective clock (``runtime.collectives._Clock``): with stream timing on, a
  compute stream that stalls on another stream's work (what waiting for an NCCL
  collective is) reads the stall from its two events, at the step's mark; the host
  clock around the same calls reads the launch only, which is why stream timing exists;
* the MoE timers: the experts' forward timed on the stream agrees with the same work
  measured with the device drained around each call;
* through ``parallelize``: ``parallelism.stream_timing: on`` warns once, and a step's
  ``moe/`` seconds come back read from the events;
* the pipeline's step timer (``paraxis_pp.measure``): a pass timed on the stream is read
  as host seconds against the step's anchor, inside the host's drained window, as long
  as the drained measurement of the same work.
"""

from __future__ import annotations

import time
import warnings

import torch
from gpu_checks import needs_cuda, synchronized_seconds

from paraxis.runtime.clock import Stopwatch
from paraxis.runtime.collectives import _Clock
from paraxis.runtime.comm_stats import CommStats
from paraxis.runtime.cuda_paths import UnvalidatedCudaPath
from paraxis.runtime.group import AxisGroup

# torch.cuda._sleep spins this many cycles: about 25-50 ms at 1-2 GHz, long beside the
# tens of microseconds a launch or an event record takes.
SLEEP_CYCLES = 50_000_000
# A stream span and a drained host measurement of the same work differ by a launch at
# the start and a wake-up at the end (tens of microseconds each): 10% of work lasting
# milliseconds bounds those, plus one millisecond for a host thread descheduled once.
TIMING_RTOL, TIMING_ATOL_S = 0.10, 1e-3
MOE = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 1,
       "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1024,
       "num_local_experts": 8, "num_experts_per_tok": 2}
BLOCKS = ["model.layers.*.mlp"]
TOKENS, REPEATS = 8192, 10


def close_in_time(got: float, want: float) -> bool:
    return abs(got - want) <= TIMING_RTOL * want + TIMING_ATOL_S


def _stall_on_side_stream(side: torch.cuda.Stream) -> tuple[torch.cuda.Event, ...]:
    """The current stream waits for a sleep on ``side``: how a wait on an NCCL
    collective looks to the compute stream. Returns the side's events around the sleep."""
    begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        begin.record()
        torch.cuda._sleep(SLEEP_CYCLES)
        end.record()
    torch.cuda.current_stream().wait_stream(side)
    return begin, end


@needs_cuda("core's collective clock on the stream")
def test_the_stream_clock_reads_the_stall_and_the_host_clock_the_launch():
    side = torch.cuda.Stream()
    _stall_on_side_stream(side)  # warm: the first sleep and event records set things up
    torch.cuda.synchronize()
    stats = CommStats(on_stream=True)
    group = AxisGroup(("tensor",), (0, 1), 0, stats=stats, stream_ordered=True)
    mark = stats.mark()
    clock, host = _Clock(group), time.perf_counter()
    begin, end = _stall_on_side_stream(side)
    host = time.perf_counter() - host
    assert clock.stop("all_gather") == 0.0 and len(stats.stream_waits) == 1
    stall = stats.seconds_by_axis(mark)["tensor"]  # reads (waits for) the events
    slept = begin.elapsed_time(end) / 1e3
    print(f"stall on the stream {stall * 1e3:.2f} ms, sleep {slept * 1e3:.2f} ms, "
          f"host clock {host * 1e3:.3f} ms")
    assert close_in_time(stall, slept), (stall, slept)
    assert host < slept / 10  # what the host clock reads on NCCL: the launch


def _experts_on_the_stream():
    """A one-block Mixtral on the GPU at expert 1, its statistics timed on the stream,
    and a forward of its experts on TOKENS random tokens."""
    from paraxis_hf import build_causal_lm
    from paraxis_moe import ExpertParallel

    torch.manual_seed(0)
    model = build_causal_lm("mixtral", MOE).cuda()
    # The model's per-expert loop: grouped_mm on CUDA is another path, not timed here.
    model.set_experts_implementation("eager")
    ep = ExpertParallel(model, BLOCKS, AxisGroup(("expert",), (0,), 0),
                        clock=Stopwatch(on_stream=True))
    (name, experts), = ep.experts.items()
    hidden = torch.randn(TOKENS, MOE["hidden_size"], device="cuda", requires_grad=True)
    index = torch.randint(0, MOE["num_local_experts"], (TOKENS, 2), device="cuda")
    weights = torch.rand(TOKENS, 2, device="cuda").softmax(-1)
    return ep, name, lambda: experts(hidden, index, weights)


@needs_cuda("the MoE timers on the stream")
def test_moe_compute_on_the_stream_matches_the_drained_measurement():
    ep, name, forward = _experts_on_the_stream()
    for _ in range(3):
        forward()
    torch.cuda.synchronize()
    ep.stats.reset()
    for _ in range(REPEATS):
        forward()
    assert ep.stats.layers[name].pending  # nothing read yet
    timed = float(ep.stats.reduce(None)[name]["expert_compute_s"]) / REPEATS
    drained = synchronized_seconds(forward, REPEATS)
    print(f"expert forward: stream {timed * 1e3:.3f} ms, drained {drained * 1e3:.3f} ms")
    assert close_in_time(timed, drained), (timed, drained)


@needs_cuda("parallelism.stream_timing through parallelize")
def test_stream_timing_on_warns_once_and_times_a_step():
    import paraxis
    from paraxis_hf import build_debug_model

    model = build_debug_model("mixtral")
    model.set_experts_implementation("eager")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine = paraxis.parallelize(model, stream_timing="on", train={"seq_length": 32})
    named = [w for w in seen if w.category is UnvalidatedCudaPath]
    assert engine.grid.comm.on_stream, "an NCCL world of one did not turn stream timing on"
    assert len(named) == 1, [str(w.message) for w in seen]
    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    metrics = engine.train_step({"input_ids": ids, "labels": ids})
    engine.close()
    # Forward and backward expert compute on the stream, inside the step (the step's
    # host time ends after the clip's norm is read back, so after the backward).
    assert 0.0 < metrics["moe/expert_compute_s"] <= metrics["step_time_s"], metrics


@needs_cuda("the pipeline's step timer on the stream")
def test_the_pipeline_timer_reads_a_stream_pass_as_host_seconds():
    from paraxis_pp import Action
    from paraxis_pp.measure import StepTimer

    def sleep():
        torch.cuda._sleep(SLEEP_CYCLES)

    sleep()
    torch.cuda.synchronize()
    timer = StepTimer(Stopwatch(on_stream=True), torch.device("cuda"))
    before = time.perf_counter()
    timer.begin()
    start = timer.mark()
    sleep()
    timer.record(Action("F", 0), start)
    launched = time.perf_counter()
    ((_, s, e),) = timer.seconds()  # waits for the events
    after = time.perf_counter()
    drained = synchronized_seconds(sleep, 3)
    print(f"pass on the stream {(e - s) * 1e3:.2f} ms, drained {drained * 1e3:.2f} ms, "
          f"launch {(launched - before) * 1e3:.3f} ms")
    assert before <= s <= e <= after, (before, s, e, after)
    assert close_in_time(e - s, drained), (e - s, drained)
    assert launched - before < drained / 2  # the host only queued it
