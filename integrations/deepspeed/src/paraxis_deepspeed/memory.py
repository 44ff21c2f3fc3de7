"""Bytes DeepSpeed keeps resident for this rank's model state, on the device and on
the host (the offload target).

The tensors are DeepSpeed's own: the module's working weights (ZeRO-3: this rank's
partitions, plus the small persistent parameters), the fp32 master partitions and
their gradient buffers, and the optimizer's state. Each is counted once (by storage)
where DeepSpeed placed it: on the host when it lies on the CPU while the accelerator is
not the CPU, or, on a CPU-only machine where both are the same memory, when DeepSpeed's
offload config sends that kind of state to the host (offload_optimizer: master weights,
gradient partitions and optimizer state; offload_param: parameter partitions).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["resident_bytes"]


def _master_tensors(zero: Any) -> Iterator[torch.Tensor]:
    flats = (getattr(zero, "single_partition_of_fp32_groups", None)
             or getattr(zero, "fp32_partitioned_groups_flat", None) or [])
    for flat in flats:
        yield flat
        if flat.grad is not None:
            yield flat.grad
    for state in zero.optimizer.state.values():
        yield from (t for t in state.values() if isinstance(t, torch.Tensor))


def _working_tensors(module: torch.nn.Module) -> Iterator[tuple[torch.Tensor, bool]]:
    """(tensor, partitioned) for the module's weights: ZeRO-3 partitions, or the
    parameters themselves."""
    for p in module.parameters():
        part = getattr(p, "ds_tensor", None)
        if part is not None and not getattr(p, "ds_persist", False):
            yield part, True
        else:
            yield p.data, False


def _offloaded(section: Any) -> bool:
    return section is not None and section.device != "none"  # a str enum


def resident_bytes(engine: Any) -> dict[str, float]:
    """``{"deepspeed_device_bytes", "deepspeed_host_bytes"}`` for this rank."""
    from deepspeed.accelerator import get_accelerator

    cpu_accelerator = get_accelerator().device_name() == "cpu"
    zero_cfg = engine._config.zero_config
    opt_off = _offloaded(zero_cfg.offload_optimizer)
    par_off = _offloaded(zero_cfg.offload_param)
    seen: set[int] = set()
    out = {"deepspeed_device_bytes": 0.0, "deepspeed_host_bytes": 0.0}

    def count(t: torch.Tensor, offloaded: bool) -> None:
        key = t.untyped_storage().data_ptr() if t.numel() else id(t)
        if key in seen:
            return
        seen.add(key)
        host = offloaded if cpu_accelerator else t.device.type == "cpu"
        side = "deepspeed_host_bytes" if host else "deepspeed_device_bytes"
        out[side] += float(t.untyped_storage().nbytes() if t.numel() else 0)

    for t in _master_tensors(engine.optimizer):
        count(t, opt_off)
    for t, partitioned in _working_tensors(engine.module):
        count(t, par_off and partitioned)
    return out
