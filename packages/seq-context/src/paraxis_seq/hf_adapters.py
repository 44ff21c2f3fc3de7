"""Per-family adapters: what a family's attention needs beyond transformers' interface
call to be context parallel, named in one table (:data:`ADAPTERS`, by attention class).

transformers' attention interface carries q, k, v and the keywords of the call; a few
families compute something around that call from positions they take to be the whole
sequence's, which a rank holding a shard gets wrong. The adapter for each says what
and corrects it from true global positions. Everything else about a variant (windows,
chunks, soft-capping, sinks) is arithmetic of the kernels (:mod:`paraxis_seq.variant`).

* ``Llama4TextAttention``: temperature tuning of the NoPE layers (Nakanishi,
  arXiv:2501.19399, as Llama 4 applies it) scales each query by
  ``1 + attn_scale·log1p(floor((p + 1) / floor_scale))`` with ``p`` counted by
  ``torch.arange`` over the module's input, so a rank would use 0..s/C-1 for its shard.
  The queries reach the attention function already scaled; the adapter multiplies them
  by ``f(global) / f(local)``. Below ``floor_scale`` tokens (8192 by default) the factor
  is 1 on every rank and nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ADAPTERS", "Adapter", "adapter_of", "chunk_of"]

# A correction of the queries a module computed from shard-local positions:
# (module, query (b, h, s, d), local positions, global positions) -> query.
QueryCorrection = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Adapter:
    """One family's adapter: ``reason`` says what the module does that needs it."""

    reason: str
    queries: QueryCorrection | None = None


def _llama4_temperature(module: nn.Module, query: torch.Tensor, local: torch.Tensor,
                        global_: torch.Tensor) -> torch.Tensor:
    if not (module.attn_temperature_tuning and not module.use_rope):
        return query

    def scale(pos: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((pos.double() + 1.0) / module.floor_scale)) \
            * module.attn_scale + 1.0

    factor = scale(global_) / scale(local)
    if bool((factor == 1).all()):
        return query
    return query * factor.to(query.device, query.dtype).view(1, 1, -1, 1)


ADAPTERS: dict[str, Adapter] = {
    "Llama4TextAttention": Adapter(
        "temperature tuning of the NoPE layers counts positions by torch.arange over the "
        "module's input (a rank's shard): queries rescaled from true positions",
        queries=_llama4_temperature),
}


def adapter_of(module: nn.Module) -> Adapter | None:
    return ADAPTERS.get(type(module).__name__)


def chunk_of(module: nn.Module) -> int | None:
    """The attention chunk of a module in a ``chunked_attention`` layer (Llama 4: the
    layer's kind in ``config.layer_types``, the size ``config.attention_chunk_size``,
    which transformers applies through the mask it builds); None for other layers."""
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    kinds = getattr(config, "layer_types", None) or ()
    if index is None or index >= len(kinds) or kinds[index] != "chunked_attention":
        return None
    return int(config.attention_chunk_size)
