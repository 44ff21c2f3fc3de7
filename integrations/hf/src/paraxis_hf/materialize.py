"""A transformers model on the meta device, and the loop that gives each rank its pieces.

Both ways to start a model bigger than a rank share these. :func:`meta_model` builds it
with no parameter storage (buffers, rotary frequencies and the like, are computed for
real: their values come from the config, not from a file or a seed).
:func:`fill_meta_parameters` is the loop behind ``MATERIALIZE_ATTR``
(``paraxis.parallel.strategy``) that core calls once the layout is known: each
parameter still on the meta device gets a tensor of its local shape, and each real
block of it (``Placement.pieces``: tensor shards, packed blocks, an expert's rows;
padding rows stay zero) is asked of a source, a safetensors slice
(:mod:`paraxis_hf.pretrained`) or a layout-invariant draw (:class:`InvariantInit`). A
rank never holds more than its own parameters (DeepSpeed-style meta init,
transformers' ``device_map`` loading).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from paraxis.parallel.placement import Piece, Placement, placement_of
from paraxis_hf.invariant_init import InitRule, piece_values

__all__ = ["InvariantInit", "fill_local", "fill_meta_parameters", "meta_model"]


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter a module registers moves to the meta device at once; buffers
    stay where they are made (accelerate's ``init_empty_weights(include_buffers=False)``).
    A constructor's ``torch.empty`` is freed untouched, so it does not stay resident."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = type(param)(param.to("meta"),
                                                   requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def meta_model(config: Any, *, untied: bool = False) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` with every parameter on the meta device and
    every buffer computed for real: they come from the config, not from a file or a
    seed, and are small. A module whose subtree holds buffers only (rotary embeddings)
    is rebuilt from the config; if a module holds parameters too, in itself or its
    children (Gemma's scaled embedding, BERT's embeddings with their position ids), or
    its constructor takes more than the config, the model is built a second time with
    only its parameters on the meta device (:func:`_parameters_on_meta`) and its buffers
    are taken from there. That second build is kept for those families: its
    constructors' freed ``torch.empty`` buffers move glibc's mmap threshold, which costs
    a sharded rank a few MB of heap. With ``untied``, transformers' ``tie_weights`` is
    skipped (``no_tie_weights``), so that the init can be recorded in eager order
    (:func:`paraxis_hf.init_rules.record_init_rules` ties afterwards)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), _no_tie(untied):
        model = AutoModelForCausalLM.from_config(config)
    _parameters_to_meta(model)
    if not _rebuild_buffer_modules(model, config):
        with _parameters_on_meta(), _no_tie(untied):
            real = dict(AutoModelForCausalLM.from_config(config).named_buffers())
        for name, buffer in list(model.named_buffers()):
            if buffer.is_meta:
                parent, _, attr = name.rpartition(".")
                model.get_submodule(parent)._buffers[attr] = real[name]
    return model


def _parameters_to_meta(model: nn.Module) -> None:
    """A parameter a constructor made on the CPU in spite of the meta device (XLNet's
    ``torch.FloatTensor(...)``, DiffLlama's ``torch.normal(..., size=...)``) moved to
    it, shared ones shared still: its init is then recorded as any other's."""
    moved: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and not param.is_meta:
                if id(param) not in moved:
                    moved[id(param)] = type(param)(param.to("meta"),
                                                   requires_grad=param.requires_grad)
                module._parameters[name] = moved[id(param)]


def _no_tie(untied: bool) -> contextlib.AbstractContextManager[Any]:
    try:
        from transformers.initialization import no_tie_weights
    except ImportError:  # transformers 4: tied at build, the last init call wins
        return contextlib.nullcontext()
    return no_tie_weights() if untied else contextlib.nullcontext()


def _rebuild_buffer_modules(model: nn.Module, config: Any) -> bool:
    """Each module with meta buffers and no parameters in its subtree, rebuilt from the
    config with the same buffers, real. False if some module could not be (it holds
    parameters, its constructor wants more than the config, or the rebuilt module
    differs): the caller then takes the buffers from a second build."""
    done: list[str] = []
    for name, module in list(model.named_modules()):
        if any(name.startswith(f"{d}.") for d in done) or not any(
                b.is_meta for b in module.buffers(recurse=False)):
            continue
        if any(True for _ in module.parameters()):
            return False
        try:
            rebuilt = type(module)(config=getattr(module, "config", config))
        except Exception:  # any constructor error: the second build answers
            return False
        want = {n: b.shape for n, b in module.named_buffers()}
        got = {n: b.shape for n, b in rebuilt.named_buffers()}
        if got != want or any(b.is_meta for b in rebuilt.buffers()) or any(
                True for _ in rebuilt.parameters()):
            return False
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, rebuilt)
        done.append(name)
    return True


# Elements asked of the source at a time: a piece is split along its first dimension
# so that the transient copy stays small beside the parameter it fills (an embedding's
# piece whole would double its rank's peak while it is copied in).
CHUNK = 1 << 18


def _row_chunks(piece: Piece) -> list[Piece]:
    """``piece`` cut along dimension 0 into blocks of about :data:`CHUNK` elements
    (``local`` and ``where`` cut; the sources read nothing else)."""
    if not piece.where:
        return [piece]
    row = math.prod(s.stop - s.start for s in piece.where[1:])
    first, last = piece.where[0].start, piece.where[0].stop
    step = max(1, CHUNK // max(row, 1))
    if last - first <= step:
        return [piece]
    at = piece.local[0].start
    return [dataclasses.replace(
        piece, local=(slice(at + a - first, at + min(a + step, last) - first),
                      *piece.local[1:]),
        where=(slice(a, min(a + step, last)), *piece.where[1:]))
        for a in range(first, last, step)]


@torch.no_grad()
def fill_local(out: torch.Tensor, rec: Placement,
               value: Callable[[Placement, Piece], torch.Tensor]) -> None:
    """Write each real block of ``rec`` (a tensor of ``rec.local_shape``: a tensor
    shard, or a ZeRO-3 shard of one) into ``out``, from ``value(rec, piece)`` in row
    chunks; padding rows are left as they are."""
    for piece in rec.pieces():
        for part in _row_chunks(piece):
            out[part.local] = value(rec, part)


@torch.no_grad()
def fill_meta_parameters(model: nn.Module, device: torch.device,
                         value: Callable[[Placement, Piece], torch.Tensor]) -> int:
    """Give every meta parameter of ``model`` its local tensor on ``device``, each piece
    from ``value(record, piece)``; buffers follow to ``device``. The parameter object
    stays the same (every reference, tied ones included, holds). Returns the bytes
    allocated."""
    allocated = 0
    for param in model.parameters():
        if not param.is_meta:
            continue
        rec = placement_of(param)
        local = torch.zeros(rec.local_shape, dtype=param.dtype, device=device)
        fill_local(local, rec, value)
        new = nn.Parameter(local, requires_grad=param.requires_grad)
        new.__dict__.update(param.__dict__)  # the placement and anything else set
        torch.utils.swap_tensors(param, new)
        allocated += local.numel() * local.element_size()
    model.to(device)  # buffers
    return allocated


class InvariantInit:
    """Materializes a model built from config: each piece drawn from (seed, name,
    element) by :func:`paraxis_hf.invariant_init.piece_values` under the family's own
    rule (:func:`paraxis_hf.init_rules.record_init_rules`), so every layout starts from
    the same model."""

    def __init__(self, rules: dict[str, InitRule], seed: int,
                 device: torch.device | None = None):
        self.rules, self.seed, self.device = rules, seed, device
        self.allocated_bytes = 0

    def value(self, rec: Placement, piece: Piece) -> torch.Tensor:
        rule = self.rules.get(rec.name)
        if rule is None:
            raise KeyError(f"{rec.name}: no init rule recorded (known: "
                           f"{sorted(self.rules)[:3]}...); was the model rebuilt?")
        return piece_values(rule, seed=self.seed, name=rec.name,
                            global_shape=rec.global_shape, where=piece.where,
                            dtype=rec.dtype)

    def fill(self, rec: Placement, out: torch.Tensor) -> None:
        """``rec``'s values into ``out`` (``MATERIALIZE_ATTR``'s ``fill``: ZeRO-3 draws
        its shard alone, only the tiles that overlap it)."""
        fill_local(out, rec, self.value)
        self.allocated_bytes += out.numel() * out.element_size()

    def __call__(self, model: nn.Module) -> None:
        from paraxis.runtime.world import device_for_rank

        device = self.device or device_for_rank()
        self.allocated_bytes += fill_meta_parameters(model, device, self.value)
