"""``paraxis plan --calibrate FILE``: this machine's efficiency table, measured (issue 38).

The planner's built-in tables describe H100s and H200s from published kernel
benchmarks; on any other machine they are guesses. Calibration measures the same fields
here, with the thread count a rank of an N-rank run gets (the launcher's
cpus / N), and writes a table ``paraxis plan --efficiency FILE`` reads:

* GEMMs: ``torch.mm`` over a grid of shapes (m tokens x n x k widths) in the run's
  dtype; the fastest rate is the device's peak, each size's rate its share of it;
* attention: ``scaled_dot_product_attention`` causal, forward and backward, by
  sequence length, FLOPs counted as :mod:`paraxis.planner.cost` counts them;
* memory: the bandwidth of a large elementwise add (the device's HBM figure, reached
  whole: ``memory_efficiency`` 1), and ``op_s``, the cost of one tiny eager operation
  with autograd recording (on a CPU the per-operation overhead sits on the timeline;
  ``launch_s`` 0);
* links: N gloo ranks on this host all-reduce messages of 4 kB to 8 MB; a line through
  (bus bytes, seconds) gives the bandwidth (both links: one host), ``link_efficiency``
  1; the latency per call is the larger of the line's intercept and what a small
  all-reduce adds to a loop of compute with no barrier between (the peer's lateness
  included, as in a step); ``overlap``: how much of an all-reduce in flight a GEMM loop
  on the same rank hides, (alone + alone - together) / the shorter, the least of three
  rounds.

``sustained`` stays 1: what is measured here is what a run here gets.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from paraxis.planner.efficiency import BUILTIN, Curve, Device, Efficiency

__all__ = ["calibrate", "summary"]

GEMM_M = (16, 64, 256, 1024)
GEMM_NK = (32, 128, 512)
SEQS = (32, 64, 128, 256, 512)
MESSAGES = (4 << 10, 64 << 10, 1 << 20, 8 << 20)


def _time(fn: Callable[[], Any], *, budget: float = 0.02, repeats: int = 5) -> float:
    """Seconds of one call of ``fn``: the median of ``repeats`` samples, each long enough
    to time. The median, not the fastest: a run shares the machine as the calibration
    does, and the link figures below include that sharing too (the peer's lateness)."""
    fn()
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < budget / 4:
        fn()
        n += 1
    n = max(1, n * 4 // max(1, repeats))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


def _gemm_rates(dtype: torch.dtype) -> list[tuple[float, float]]:
    out = []
    for m in GEMM_M:
        for n in GEMM_NK:
            for k in GEMM_NK:
                a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
                flops = 2.0 * m * n * k
                out.append((flops, flops / _time(lambda a=a, b=b: torch.mm(a, b))))
    return out


def _curve(rates: list[tuple[float, float]], peak: float) -> Curve:
    """Share of ``peak`` per size, sizes rising; shapes of equal size (FLOPs) merged
    into their median."""
    by_size: dict[float, list[float]] = {}
    for size, rate in rates:
        by_size.setdefault(size, []).append(rate / peak)
    return Curve(tuple((s, min(1.0, statistics.median(f))) for s, f in sorted(by_size.items())))


def _attention_rates(dtype: torch.dtype, heads: int = 4, head_dim: int = 16,
                     ) -> list[tuple[float, float]]:
    out = []
    for s in SEQS:
        q, k, v = (torch.randn(1, heads, s, head_dim, dtype=dtype, requires_grad=True)
                   for _ in range(3))

        def step(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> None:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            y.sum().backward()

        flops = 3.5 * 2.0 * s * s * heads * head_dim  # causal half, backward 2.5x
        out.append((float(s), flops / _time(step)))
    return out


def _memory() -> tuple[float, float]:
    """(bytes/s of a large add, seconds of one tiny autograd-recorded add)."""
    x, y, z = (torch.randn(1 << 22) for _ in range(3))
    bandwidth = 3 * x.numel() * 4 / _time(lambda: torch.add(x, y, out=z))
    a, b = torch.randn(8, requires_grad=True), torch.randn(8)
    return bandwidth, _time(lambda: a * b)


def _collective_time(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of ``fn``, a collective: the same count on every rank, each rep
    started together (a barrier), so no rank waits on another's loop."""
    import torch.distributed as dist

    samples = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _link_probe(messages: tuple[int, ...]) -> dict[str, Any]:
    """On each gloo rank: seconds per all-reduce of each message, and the overlap test."""
    import torch.distributed as dist

    n = dist.get_world_size()
    times = []
    for size in messages:
        t = torch.zeros(size // 4)
        times.append((2 * (n - 1) / n * size,
                      _collective_time(lambda t=t: dist.all_reduce(t), 15)))
    big = torch.zeros(MESSAGES[-1] // 4)
    reduce = _collective_time(lambda: dist.all_reduce(big), 9)
    a = torch.randn(256, 256)
    # As much compute as the all-reduce lasts (the same count on every rank): overlap is
    # measured where it matters most, and neither side's noise swamps the other.
    gemms = torch.tensor([max(1, int(reduce / _time(lambda: torch.mm(a, a))))])
    dist.all_reduce(gemms, op=dist.ReduceOp.MIN)

    def compute() -> None:
        for _ in range(int(gemms)):
            torch.mm(a, a)

    def together() -> None:
        work = dist.all_reduce(big, async_op=True)
        compute()
        work.wait()

    return {"times": times, "compute": _collective_time(compute, 9), "reduce": reduce,
            "both": _collective_time(together, 9), "in_run": _in_run_latency()}


def _in_run_latency(reps: int = 60) -> float:
    """Seconds one small collective adds to a running job: ranks loop over a little
    compute and an all-reduce of 4 kB with no barrier between, so each collective also
    waits for the slower rank as a training step's do (scheduling skew, the peer late),
    which a barrier-aligned timing hides. Minus the compute alone, per collective."""
    import torch.distributed as dist

    a, small = torch.randn(96, 96), torch.zeros(1024)

    def loop(collective: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, a)
            if collective:
                dist.all_reduce(small)
        return time.perf_counter() - t0

    alone = min(loop(False) for _ in range(3))
    return max(0.0, statistics.median(loop(True) for _ in range(3)) - alone) / reps


def _fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept seconds, bytes per second) of the line t = a + x / b fitted to
    ``points`` (x, t) by least squares on relative errors (weights 1/t²), so the small
    messages set the latency and the large ones the bandwidth."""
    w = [1.0 / t**2 for _, t in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points, strict=True))
    sy = sum(wi * t for wi, (_, t) in zip(w, points, strict=True))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points, strict=True))
    sxy = sum(wi * x * t for wi, (x, t) in zip(w, points, strict=True))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    return max(0.0, (sy - slope * sx) / sw), 1.0 / max(slope, 1e-15)


def _links(world: int, rounds: int = 3) -> tuple[float, float, float]:
    """(latency, bus bytes/s, overlap) of ``world`` gloo ranks on this host, the median
    of ``rounds`` probes; a collective lasts as long as its slowest rank, so each
    round's figure is the ranks' maximum."""
    from paraxis.testing.distributed import DistributedWorld

    found = []
    with DistributedWorld(world) as ranks:
        for _ in range(rounds):
            probes = ranks.run(_link_probe, MESSAGES)
            points = [(x, max(p["times"][i][1] for p in probes))
                      for i, (x, _) in enumerate(probes[0]["times"])]
            fitted, bus = _fit_line(points)
            latency = max(fitted, max(p["in_run"] for p in probes))
            c, a, both = (max(p[k] for p in probes) for k in ("compute", "reduce", "both"))
            found.append((latency, bus, max(0.0, min(1.0, (c + a - both) / min(c, a)))))
    # Latency and bandwidth: the median round. Overlap: the least any round saw, since
    # a communication thread that needs a core the compute holds hides nothing, and a
    # busy machine flatters a single round either way.
    return (statistics.median(f[0] for f in found), statistics.median(f[1] for f in found),
            min(f[2] for f in found))


def calibrate(*, world: int = 2, dtype: torch.dtype = torch.float32,
              links: bool = True) -> Efficiency:
    """Measure this machine's efficiency table for ranks of a ``world``-rank run."""
    threads = max(1, (os.cpu_count() or 1) // world)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gemm = _gemm_rates(dtype)
        attention = _attention_rates(dtype)
        bandwidth, op_s = _memory()
    finally:
        torch.set_num_threads(old)
    peak = max(rate for _, rate in gemm)
    latency, bus, overlap = 0.0, bandwidth, 1.0
    if links and world > 1:
        latency, bus, overlap = _links(world)
    memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    device = Device(f"this machine ({os.cpu_count()} cpus, {threads} thread(s) per rank of "
                    f"{world}, {str(dtype).removeprefix('torch.')})", peak, bandwidth, bus,
                    bus, memory)
    return Efficiency(f"calibrated: {device.name}", device, _curve(gemm, peak),
                      _curve(attention, peak), BUILTIN["h100"].elementwise,
                      memory_efficiency=1.0, op_s=op_s, launch_s=0.0, link_efficiency=1.0,
                      collective_s=latency, overlap=overlap, sustained=1.0,
                      sources=("paraxis plan --calibrate",))


def summary(eff: Efficiency) -> str:
    d = eff.device
    gemm = ", ".join(f"{s:.0e}: {f:.0%}" for s, f in eff.gemm.points[::4])
    attn = ", ".join(f"{s:.0f}: {f:.0%}" for s, f in eff.attention.points)
    return "\n".join([
        f"device     {d.name}",
        f"peak       {d.peak_flops / 1e9:.1f} GFLOP/s (the fastest GEMM measured)",
        f"GEMMs      share of the peak by FLOPs per call: {gemm}",
        f"attention  share by sequence length (causal, forward + backward): {attn}",
        f"memory     {d.memory_bw / 1e9:.1f} GB/s; {eff.op_s * 1e6:.1f} us per eager operation",
        f"links      {d.intra_bw / 1e9:.2f} GB/s bus bandwidth, {eff.collective_s * 1e6:.0f} us "
        f"per collective, {eff.overlap:.0%} of an all-reduce hidden under GEMMs",
    ])
