"""What is trained (:class:`Workload`) and on what (:class:`Hardware`); the layout itself
is a :class:`paraxis.config.parallel.ParallelConfig`, the same object a run validates
(its ``parallelism.context_mode`` says ring or Ulysses)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from paraxis.planner.efficiency import BUILTIN, Efficiency

__all__ = ["DEFAULT_HARDWARE", "Hardware", "Workload"]


@dataclass(frozen=True)
class Workload:
    """``seq`` tokens per sequence, ``global_batch`` sequences per optimizer step,
    ``micro_batch`` sequences per microbatch on one data x expert replica."""

    seq: int = 2048
    global_batch: int = 512
    micro_batch: int = 1
    # mixed: the ZeRO paper's and DeepSpeed's (2-byte weights and gradients, 12 bytes of
    # fp32 master weights and Adam state); bf16, fp16: paraxis's train.precision (fp32
    # weights and gradients, 2-byte activations); fp32.
    precision: Literal["mixed", "bf16", "fp16", "fp32"] = "mixed"
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"  # paraxis's parallelism.reduce_dtype
    optimizer_bytes: float | None = None  # per parameter; None: Adam's for the precision

    @property
    def element_size(self) -> int:
        """Bytes of one activation or communicated element (bf16/fp16 unless fp32)."""
        return 4 if self.precision == "fp32" else 2

    @property
    def grad_wire_bytes(self) -> int:
        """Bytes of one gradient element on the data and ZeRO reductions."""
        if self.precision == "mixed" or self.reduce_dtype == "bf16":
            return 2
        return 4

    @property
    def weight_bytes(self) -> int:
        """Bytes of one weight as held (and as ZeRO gathers it)."""
        return 2 if self.precision == "mixed" else 4


@dataclass(frozen=True)
class Hardware:
    """Per device: memory and peak FLOP/s; links in bytes/s inside and across nodes.

    ``headroom`` is the share of ``device_memory`` kept free for what the plan does not
    count: allocator fragmentation, the CUDA context, kernel workspaces (the seed: they
    "sit on top"). A layout fits when its most loaded rank needs at most the rest.
    ``efficiency`` times each kind of work (:mod:`paraxis.planner.efficiency`); speeds
    not given are its device's.
    """

    gpus_per_node: int = 8
    device_memory: float | None = None
    peak_flops: float | None = None
    intra_bw: float | None = None
    inter_bw: float | None = None
    headroom: float = 0.0
    efficiency: Efficiency = field(default=BUILTIN["h100"], compare=False)

    @property
    def usable_memory(self) -> float | None:
        if self.device_memory is None:
            return None
        return self.device_memory * (1.0 - self.headroom)

    @property
    def timed(self) -> bool:
        return None not in (self.peak_flops, self.intra_bw, self.inter_bw)


    def with_device_speeds(self) -> Hardware:
        """This hardware with the speeds not given taken from its efficiency table's
        device (said so in the report)."""
        d = self.efficiency.device
        return replace(self, peak_flops=self.peak_flops or d.peak_flops,
                       intra_bw=self.intra_bw or d.intra_bw, inter_bw=self.inter_bw or d.inter_bw)


# The default table's device: an H100 SXM's dense bf16 peak, NVLink 4 per direction, one
# 400 Gb/s NIC per GPU.
DEFAULT_HARDWARE = Hardware().with_device_speeds()
