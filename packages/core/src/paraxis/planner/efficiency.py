"""How fast each kind of work runs: the planner's efficiency table (issue 38).

A training step is GEMMs, attention, elementwise work, kernel launches and collectives,
and each runs at its own share of the device's datasheet figures, a share that depends
on its size: a 4096³ GEMM reaches 79% of an H100's bf16 peak, a 512x256x256 one 1.2%.
The planner times every kind of work with this table (:mod:`paraxis.planner.cost`,
:mod:`paraxis.planner.step`) instead of "matmuls at the peak, nothing else costs time".

Built-in tables (``paraxis plan --efficiency NAME``), each figure with its source:

* ``h100`` (the default) and ``h200``: the kernels a paraxis run launches in eager
  PyTorch on an H100 / H200 SXM (Hugging Face layers, torch's SDPA, cuBLAS GEMMs);
* ``h100-te``: fused kernels as Megatron-Core with Transformer Engine runs them (cuDNN
  attention, norms fused into GEMMs, fused RoPE and SwiGLU), to check the step model
  against Megatron's published runs (:mod:`paraxis.planner.published`).

``--efficiency FILE`` reads a JSON or YAML table of the same fields (what ``paraxis plan
--calibrate`` writes for this machine); ``--efficiency-set KEY=VALUE,...`` overrides
single figures (:data:`OVERRIDABLE`).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from paraxis.planner.units import PlanInputError

__all__ = [
    "BUILTIN",
    "OVERRIDABLE",
    "Curve",
    "Device",
    "Efficiency",
    "Elementwise",
    "load_efficiency",
    "override",
    "write_efficiency",
]


@dataclass(frozen=True)
class Curve:
    """Achieved fraction of a peak by size: points ``(size, fraction)`` with sizes rising,
    interpolated linearly in log(size), flat beyond the ends."""

    points: tuple[tuple[float, float], ...]

    def at(self, size: float) -> float:
        pts = self.points
        if size <= pts[0][0]:
            return pts[0][1]
        for (s0, f0), (s1, f1) in itertools.pairwise(pts):
            if size <= s1:
                w = math.log(size / s0) / math.log(s1 / s0)
                return f0 + w * (f1 - f0)
        return pts[-1][1]

    def scaled(self, factor: float) -> Curve:
        return Curve(tuple((s, min(1.0, f * factor)) for s, f in self.points))


@dataclass(frozen=True)
class Device:
    """Datasheet figures: dense bf16 FLOP/s, HBM bytes/s, links per direction (bytes/s),
    memory (bytes)."""

    name: str
    peak_flops: float
    memory_bw: float
    intra_bw: float
    inter_bw: float
    memory: float


@dataclass(frozen=True)
class Elementwise:
    """Bytes one transformer layer's non-GEMM operations read and write per token,
    forward and backward together: ``hidden`` x h + ``intermediate`` x i + ``query`` x
    q + ``kv`` x h_kv (q, h_kv: the query and key/value widths), plus ``per_weight``
    bytes per weight parameter per microbatch (autocast's casts of fp32 masters), in
    ``ops`` operations (kernels) per layer; ``accumulate``: bytes per parameter each
    further microbatch's gradient accumulation moves (``grad += new``)."""

    hidden: float
    intermediate: float
    query: float
    kv: float
    per_weight: float
    ops: int
    accumulate: float = 0.0


# Eager Hugging Face Llama layer, forward + backward, by train precision, measured on
# this machine by `python -m paraxis.planner.census` (bytes in and out of every non-GEMM
# aten operation of a 3-layer model minus a 2-layer one, fitted over 12 shapes: worst
# fit error 0.27%); tests/test_planner_census.py re-measures two shapes against these.
# "mixed": the model held in bf16 (torchtitan's FSDP2 mixed precision, Megatron's bf16
# weights); "bf16"/"fp16": paraxis's train.precision (fp32 masters under autocast: an
# fp32 residual stream and a cast of every weight per microbatch). Accumulation
# (autograd's grad += new: read, read, write) moves 6 bytes per bf16 parameter, 12 per
# fp32 one.
EAGER = {
    "mixed": Elementwise(304.6, 28.3, 53.2, 68.6, 0.0, 113, 6.0),
    "bf16": Elementwise(395.8, 28.8, 97.3, 123.3, 12.0, 139, 12.0),
    "fp16": Elementwise(395.8, 28.8, 97.3, 123.3, 12.0, 139, 12.0),
    "fp32": Elementwise(329.2, 56.6, 106.3, 137.0, 0.0, 105, 12.0),
}
# Transformer Engine's fused layer (bf16 activations), counted kernel by kernel: RMSNorm
# fused into the next GEMM (6 x 2h per norm, forward + backward), two residual adds
# (10 x 2h), fused RoPE (4 x 2(q + h_kv)), fused SwiGLU (8 x 2i); about 40 kernels;
# the weight-gradient GEMM accumulates into the fp32 main gradient itself (Megatron's
# gradient_accumulation_fusion), no separate pass.
FUSED = {p: Elementwise(44.0, 16.0, 8.0, 8.0, 0.0, 40, 0.0) for p in EAGER}

# XLA's measured GEMM table for sm_90, "NVIDIA H100 80GB HBM3", bf16xbf16->bf16
# (openxla/xla, xla/service/gpu/model/matmul_interpolator_data.h): FLOP/s of b x m x n x
# k GEMMs; as (FLOPs per call, share of 989.4 TFLOP/s): 512x256x256 11.5T,
# 256x2048x256 41.8T, 1024x2048x256 139.5T, 1024x1024x2048 350.0T, 1024x2048x2048
# 524.3T, 2048³ 632.0T, 4 x 2048³ 725.7T, 4096³ 783.3T; flat beyond: the maximum
# achievable matmul FLOPS stas00/ml-engineering measures on an H100 SXM is 794.5T (80.3%).
H100_GEMM = Curve(((6.71e7, 0.0116), (2.68e8, 0.0423), (1.07e9, 0.141), (4.29e9, 0.354),
                   (8.59e9, 0.530), (1.72e10, 0.639), (6.87e10, 0.733), (1.37e11, 0.792)))
# Causal attention, head dim 128, forward + backward, by sequence length, FLOPs counted
# as FlashAttention's benchmark counts them (causal half, backward 2.5 x forward). torch
# SDPA's flash backend is FlashAttention-2: Dao-AILab/flash-attention README, "H100 80GB
# SXM5", causal, head dim 128: 163, 221, 265, 294, 308, 328 TFLOP/s at 512 ... 16k.
FA2_H100 = Curve(((512, 0.165), (1024, 0.223), (2048, 0.268), (4096, 0.297), (8192, 0.311),
                  (16384, 0.332)))
# cuDNN's fused attention forward, same README (FlashAttention-3 figure), causal head dim
# 128: 315, 410, 484, 518, 529, 539 TFLOP/s; scaled by FlashAttention-2's forward+backward
# / forward ratio at the same lengths (163/191 ... 328/335), since no backward figure for
# cuDNN is published there.
CUDNN_H100 = Curve(((512, 0.272), (1024, 0.352), (2048, 0.435), (4096, 0.483),
                    (8192, 0.495), (16384, 0.534)))

H100 = Device("H100 SXM", 989.4e12, 3.35e12, 450e9, 50e9, 80e9)  # NVIDIA H100 datasheet
H200 = Device("H200 SXM", 989.4e12, 4.8e12, 450e9, 50e9, 141e9)  # NVIDIA H200 datasheet
# Datasheets: dense bf16 989.4 TFLOP/s; HBM3 3.35 TB/s (H200: HBM3e 4.8 TB/s); NVLink 4,
# 900 GB/s both ways = 450 per direction; one 400 Gb/s NIC per GPU = 50 GB/s.


@dataclass(frozen=True)
class Efficiency:
    """One device's efficiency table (see the module docstring)."""

    name: str
    device: Device
    gemm: Curve  # share of peak_flops by FLOPs per GEMM call
    attention: Curve  # share of peak_flops by sequence (block) length, fwd + bwd
    elementwise: dict[str, Elementwise]  # by train precision
    # Share of memory_bw eager elementwise kernels reach. No published sustained HBM
    # figure found for H100; 0.85 sits between the 80-88% of spec that copies reach on
    # NVLink and PCIe (stas00/ml-engineering, nvbandwidth) and STREAM-class kernels.
    memory_efficiency: float = 0.85
    op_s: float = 2e-6  # device time every non-GEMM operation costs at least
    # Host seconds per eager operation (dispatch, autograd, cudaLaunchKernel; PyTorch
    # eager's few to tens of microseconds), hidden behind longer kernels; 0 on a CPU,
    # whose per-operation cost is op_s (it runs each operation itself).
    launch_s: float = 10e-6
    # NCCL busbw of a large collective: about 80% of the unidirectional link
    # (stas00/ml-engineering, network: "that ~80% expectation holds on newer hardware").
    link_efficiency: float = 0.8
    collective_s: float = 20e-6  # latency of one collective call
    overlap: float = 1.0  # share of overlappable communication actually hidden
    # Share of the kernel benchmarks' speed compute-bound kernels (GEMMs, attention) hold
    # through a training run: clocks under the power limit, concurrent kernels, stragglers.
    sustained: float = 1.0
    sources: tuple[str, ...] = field(default_factory=tuple)

    def compute_share(self, curve: Curve, size: float) -> float:
        """Share of the peak a GEMM (``self.gemm``) or attention call of ``size`` holds."""
        return curve.at(size) * self.sustained

    def elementwise_for(self, precision: str) -> Elementwise:
        return self.elementwise.get(precision) or self.elementwise["mixed"]

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["gemm"], out["attention"] = list(self.gemm.points), list(self.attention.points)
        return out


# Fitted, the one figure that is: the share of the kernel benchmarks' speed that makes
# NeMo's Llama 3.1 8B on 8 H100s (NVIDIA/dgxc-benchmarking, 10,153 tokens/s per GPU)
# come out exact; `python -m paraxis.planner.published --fit` prints it, and the other
# published runs there are predictions with it.
SUSTAINED = 0.807
_SOURCES = ("GEMM: openxla/xla matmul_interpolator_data.h (sm_90); stas00/ml-engineering "
            "MAMF table", "attention: Dao-AILab/flash-attention README (H100 SXM5)",
            "elementwise: python -m paraxis.planner.census", "device: NVIDIA datasheets")
BUILTIN: dict[str, Efficiency] = {
    "h100": Efficiency("h100 (eager PyTorch)", H100, H100_GEMM, FA2_H100, EAGER,
                       sustained=SUSTAINED, sources=_SOURCES),
    "h200": Efficiency("h200 (eager PyTorch)", H200, H100_GEMM, FA2_H100, EAGER,
                       sustained=SUSTAINED, sources=_SOURCES),
    "h100-te": Efficiency("h100 (Transformer Engine kernels)", H100, H100_GEMM, CUDNN_H100,
                          FUSED, launch_s=2e-6, sustained=SUSTAINED, sources=_SOURCES),
}

# --efficiency-set keys: what each sets.
OVERRIDABLE = {
    "gemm": "a flat share of the peak for every GEMM (replaces the size curve)",
    "attention": "a flat share of the peak for attention (replaces the length curve)",
    "memory": "share of the HBM bandwidth elementwise work reaches",
    "launch": "host seconds per eager operation",
    "op": "device seconds every non-GEMM operation costs at least",
    "link": "share of a link's bandwidth a large collective reaches",
    "latency": "seconds of latency per collective call",
    "overlap": "share of overlappable communication actually hidden",
}


def override(eff: Efficiency, text: str) -> Efficiency:
    """``gemm=0.6,link=0.7,...`` applied to ``eff`` (:data:`OVERRIDABLE`)."""
    fields: dict[str, Any] = {}
    for part in str(text).split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in OVERRIDABLE:
            raise PlanInputError(f"--efficiency-set {part!r}: each part is KEY=NUMBER with "
                                 f"KEY one of {', '.join(OVERRIDABLE)}; e.g. gemm=0.6")
        try:
            number = float(value)
        except ValueError:
            raise PlanInputError(f"--efficiency-set {key}={value!r} is not a number") from None
        if number < 0 or (key not in ("launch", "op", "latency") and number > 1):
            raise PlanInputError(f"--efficiency-set {key}={number} must be a share in "
                                 "[0, 1]" if key not in ("launch", "op", "latency")
                                 else f"--efficiency-set {key}={number} must be >= 0")
        flat = Curve(((1.0, number),))
        fields.update({"gemm": {"gemm": flat}, "attention": {"attention": flat},
                       "memory": {"memory_efficiency": number}, "launch": {"launch_s": number},
                       "op": {"op_s": number}, "link": {"link_efficiency": number},
                       "latency": {"collective_s": number},
                       "overlap": {"overlap": number}}[key])
    return replace(eff, name=f"{eff.name}, with {text}", **fields)


def load_efficiency(spec: str) -> Efficiency:
    """A built-in table by name, or a JSON/YAML file of :meth:`Efficiency.to_json`'s
    fields (the ``--calibrate`` output)."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    path = Path(spec)
    if not path.is_file():
        raise PlanInputError(f"--efficiency {spec!r} is neither a built-in table "
                             f"({', '.join(BUILTIN)}) nor a file; give one, or write one "
                             "with paraxis plan --calibrate FILE")
    try:
        import yaml

        text = path.read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = yaml.safe_load(text)
        return _from_json(data, spec)
    except (KeyError, TypeError, ValueError, yaml.YAMLError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise PlanInputError(f"--efficiency {spec!r} is not an efficiency table: {first} "
                             "(write one with paraxis plan --calibrate FILE)") from None


def _from_json(data: dict[str, Any], origin: str) -> Efficiency:
    curves = {k: Curve(tuple((float(s), float(f)) for s, f in data[k]))
              for k in ("gemm", "attention")}
    base = BUILTIN["h100"]
    elementwise = {p: Elementwise(**e) for p, e in data.get("elementwise", {}).items()} \
        or base.elementwise
    scalars = {k: float(data[k]) for k in ("memory_efficiency", "op_s", "launch_s",
                                           "link_efficiency", "collective_s", "overlap",
                                           "sustained") if k in data}
    device = {k: v if k == "name" else float(v) for k, v in data["device"].items()}
    return Efficiency(str(data.get("name", origin)), Device(**device), **curves,
                      elementwise=elementwise, sources=tuple(data.get("sources", (origin,))),
                      **scalars)


def write_efficiency(eff: Efficiency, path: str | Path) -> None:
    Path(path).write_text(json.dumps(eff.to_json(), indent=2) + "\n")
