"""Step metrics (DESIGN section 7): timeline, exposed communication, MFU, memory.

* A per-rank :class:`Tracer` records compute and communication spans; exported as a
  Chrome trace (JSON for Perfetto / chrome://tracing).
* Exposed communication is the time the training thread sat blocked on collectives:
  the step's critical path minus its compute (overlapped communication is free).
* MFU counts model FLOPs per token as 6N + 12·L·H·Q·T (PaLM, arXiv:2204.02311,
  appendix B): N non-embedding parameters, L layers, H heads, Q head dim, T sequence
  length; divided by the configured peak FLOP/s per device. Recomputation is not counted
  (that would be HFU). Without a peak, MFU is not reported.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paraxis.config.shape import ModelShape
from paraxis.parallel.metric_names import comm_metric, group_names
from paraxis.parallel.placement import placement_of

if TYPE_CHECKING:
    from paraxis.runtime.grid import Grid

__all__ = ["Tracer", "flops_per_token", "memory_stats", "mfu", "model_flops_per_token",
           "non_embedding_params", "peak_rss_bytes", "step_metrics", "tensors_held_by"]


@dataclass
class Span:
    name: str
    cat: str  # "compute" or "comm"
    start: float
    end: float


class Tracer:
    """Spans of this rank's training thread, in seconds since the tracer started. While
    ``ranges`` is on (a ``train.profile`` window) each span is also a
    ``torch.profiler.record_function`` range named ``paraxis/<span>``, so torch's trace
    shows paraxis's phases around its own events."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.origin = time.perf_counter()
        self.spans: list[Span] = []
        self.ranges = False

    @contextlib.contextmanager
    def span(self, name: str, cat: str = "compute") -> Iterator[None]:
        start = time.perf_counter() - self.origin
        marked = (torch.profiler.record_function(f"paraxis/{name}") if self.ranges
                  else contextlib.nullcontext())
        try:
            with marked:
                yield
        finally:
            self.spans.append(Span(name, cat, start, time.perf_counter() - self.origin))

    def add(self, name: str, cat: str, seconds: float) -> None:
        """A span that just ended, lasting ``seconds`` (e.g. a wait measured elsewhere)."""
        end = time.perf_counter() - self.origin
        self.spans.append(Span(name, cat, end - seconds, end))

    def comm_seconds(self, since: int = 0) -> float:
        return sum(s.end - s.start for s in self.spans[since:] if s.cat == "comm")

    def clear(self) -> None:
        self.spans.clear()

    def export(self, path: str | Path) -> Path:
        """Write the spans as Chrome trace events (one process per rank)."""
        events = [{"name": s.name, "cat": s.cat, "ph": "X", "pid": self.rank,
                   "tid": 0 if s.cat == "compute" else 1,
                   "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6} for s in self.spans]
        events.append({"name": "process_name", "ph": "M", "pid": self.rank,
                       "args": {"name": f"rank {self.rank}"}})
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        return path


def non_embedding_params(model: nn.Module) -> int:
    """Parameters outside embedding tables (token and learned position embeddings).
    The output projection is a matmul per token and stays counted."""
    embedding = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
                 for p in m.parameters()}
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen or id(p) in embedding:
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def flops_per_token(n_params: int, layers: int, heads: int, head_dim: int, seq: int) -> float:
    """6N + 12·L·H·Q·T: forward and backward matmuls plus attention scores."""
    return 6.0 * n_params + 12.0 * layers * heads * head_dim * seq


def mfu(tokens_per_s: float, per_token: float, peak_flops: float, devices: int) -> float:
    return tokens_per_s * per_token / (peak_flops * devices)


def model_flops_per_token(model: nn.Module, shape: ModelShape | None) -> float | None:
    """:func:`flops_per_token` of a parallelized model: N from the placements' global
    shapes (every rank counts the whole model), None without the standard sizes."""
    if shape is None or not shape.hidden_size or not shape.num_attention_heads:
        return None  # a config without the standard size names: no MFU
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding)
                  for p in m.parameters()}
    n = sum(math.prod(placement_of(p).global_shape) for p in model.parameters()
            if id(p) not in embeddings)
    head_dim = shape.hidden_size // shape.num_attention_heads
    return flops_per_token(n, shape.num_layers, shape.num_attention_heads, head_dim,
                           shape.seq_length or 0)


def step_metrics(grid: Grid, comm_mark: Any, *, step: int, loss: float, norm: float,
                 lr: float, times: tuple[float, float], tokens: int,
                 peak_flops: float | None, flops_per_token: float | None,
                 devices: int) -> dict[str, float]:
    """One step's metrics, the same on every rank: ``times`` are the fastest and the
    slowest rank's step time, ``tokens`` the global batch's. Communication is reported
    per group under the names of :func:`paraxis.parallel.metric_names.group_names`
    (a group of one rank is left out)."""
    fastest, slowest = times
    comm = grid.comm
    out = {
        "step": float(step),
        "loss": float(loss),
        "grad_norm": norm,
        "lr": float(lr),
        "step_time_s": slowest,
        "tokens_per_s": tokens / slowest,
        # Seconds this rank sat blocked in core's collectives: the thread's wait on gloo,
        # the compute stream's stall (CUDA events) on NCCL (runtime.collectives._Clock);
        # communication overlapped with compute costs nothing and is not counted.
        "exposed_comm_s": comm.total_seconds(comm_mark),
        "straggler_spread_s": slowest - fastest,
        "comm_bytes": comm.total_bytes(comm_mark),
    }
    names = group_names(grid.axes, grid.layout.degrees)
    for kind, by_group in (("bytes", comm.bytes_by_axis(comm_mark)),
                           ("exposed_s", comm.seconds_by_axis(comm_mark))):  # blocked time
        for key, n in sorted(by_group.items()):
            name = names.get(key, key)
            if name is not None:  # groups of one rank are left out
                out[comm_metric(name, kind)] = n
    if peak_flops and flops_per_token:
        out["mfu"] = mfu(out["tokens_per_s"], flops_per_token, peak_flops, devices)
    return out


def tensors_held_by(obj: Any, depth: int = 5, seen: set[int] | None = None,
                    ) -> Iterator[torch.Tensor]:
    """Every tensor one of paraxis's own objects holds, through its attributes and
    containers (a gradient synchronizer's buckets, flat gradient buffers, reduce-scatter
    staging); not through modules (their parameters are counted as such), nor the grid."""
    from paraxis.runtime.grid import AxisGroup, Grid

    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if isinstance(obj, nn.Module | Grid | AxisGroup):
        return
    if isinstance(obj, dict):
        children: Any = obj.values()
    elif isinstance(obj, list | tuple | set):
        children = obj
    elif type(obj).__module__.startswith("paraxis") and hasattr(obj, "__dict__"):
        children = vars(obj).values()
    else:
        return
    for child in children:
        yield from tensors_held_by(child, depth - 1, seen)


def memory_stats(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 device: torch.device, holders: tuple[Any, ...] = ()) -> dict[str, float]:
    """Peak memory of this rank: the CUDA allocator's peak on GPU; on CPU the bytes of
    model state and the process's peak RSS.

    Model state is every storage behind the model's parameters and their gradients, the
    optimizer's parameters (a ZeRO optimizer's shards) and their gradients, the
    optimizer state, and every tensor the ``holders`` (the gradient synchronizers) keep
    (ZeRO-1's reduce-scatter staging is behind no gradient; issue 32), each storage
    counted once: a view (a gradient inside a bucket, a shard inside a parameter) adds
    nothing, the flat buffer behind it is counted whole. The engine measures before
    ``zero_grad``, so gradient buffers count."""
    if device.type == "cuda":
        return {"peak_alloc_bytes": float(torch.cuda.max_memory_allocated(device))}
    tensors: list[torch.Tensor | None] = [t for h in holders for t in tensors_held_by(h)]
    for p in model.parameters():
        tensors += [p, p.grad]
    if optimizer is not None:
        for group in optimizer.param_groups:  # an optimizer holding its weights elsewhere
            for p in group.get("params", ()):  # (the DeepSpeed bridge) lists none here
                tensors += [p, p.grad]
        for st in optimizer.state.values():
            tensors += [t for t in st.values() if isinstance(t, torch.Tensor)]
    seen: set[int] = set()
    state = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            state += storage.nbytes()
    return {"model_state_bytes": float(state), "peak_rss_bytes": float(peak_rss_bytes())}


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024)  # Linux reports KiB
