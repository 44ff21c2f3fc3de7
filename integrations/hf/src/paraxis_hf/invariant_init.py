"""Initial values that do not depend on the layout: any rank computes its own slice alone.

Megatron-LM seeds each tensor-parallel rank's slice from a per-rank seed (its
``model_parallel_cuda_manual_seed``), so the model it starts from depends on the layout;
torchtitan's offset RNG for DTensor keeps one stream but runs on CUDA only. Here the
value of element ``i`` of tensor ``T`` is a function of (seed, ``T``'s name, ``T``'s
global shape, ``i``) alone, in the counter-based spirit of Salmon et al., "Parallel
random numbers: as easy as 1, 2, 3" (SC 2011): the global tensor, seen as a matrix of
its flattened leading dimensions by its last one, is cut into fixed tiles of about
:data:`BLOCK` elements; tile ``k`` of tensor ``T`` is drawn from a fresh
``torch.Generator`` seeded by a hash of (seed, name, k). A rank that owns a slice draws
only the tiles its slice touches and keeps the overlap. A tile is always drawn whole and
by the same call, so the same element gets the same bits on every layout (drawing only
the owned part would not: torch's vectorized samplers treat a run's tail differently).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass

import torch

__all__ = ["BLOCK", "Copy", "Draw", "Fill", "InitRule", "piece_values", "tensor_key"]

BLOCK = 1 << 16  # elements per tile: small enough to waste little at a slice's edge


@dataclass(frozen=True)
class Draw:
    """A random rule: ``normal`` (mean ``a``, std ``b``), ``uniform`` on [``a``, ``b``),
    or ``trunc_normal`` (mean ``a``, std ``b``, cut at [``lo``, ``hi``])."""

    kind: str
    a: float
    b: float
    lo: float = -2.0
    hi: float = 2.0


@dataclass(frozen=True)
class Fill:
    """A constant: zero biases, unit norm weights."""

    value: float


@dataclass(frozen=True, eq=False)
class Copy:
    """Values the family computes whole, from the config and the global RNG seeded
    with the run's seed (Mamba's ``A_log`` from an arange, its ``dt_bias`` from
    ``torch.rand``): the same on every rank, and small (``init_rules.COPY_LIMIT``), so
    every rank holds them whole and keeps its slice."""

    values: torch.Tensor


@dataclass(frozen=True)
class InitRule:
    """How a parameter starts: ``base`` everywhere, then each ``rows`` entry
    ``(start, stop, value)`` sets rows ``[start, stop)`` of dimension 0 to a constant
    (an embedding's padding row)."""

    base: Draw | Fill | Copy
    rows: tuple[tuple[int, int, float], ...] = ()


def tensor_key(seed: int, name: str) -> int:
    """64 bits naming (seed, tensor): blake2b, so no two names share a stream."""
    digest = hashlib.blake2b(f"{seed}\x00{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _mix(key: int, index: int) -> int:
    """splitmix64 (Steele et al., OOPSLA 2014) of ``key + index``: a tile's seed."""
    z = (key + (index + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def _tile(draw: Draw, key: int, index: int, rows: int, cols: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(_mix(key, index))
    out = torch.empty(rows, cols, dtype=torch.float32)
    if draw.kind == "normal":
        return out.normal_(draw.a, draw.b, generator=gen)
    if draw.kind == "uniform":
        return out.uniform_(draw.a, draw.b, generator=gen)
    if draw.kind == "trunc_normal":
        return torch.nn.init.trunc_normal_(out, draw.a, draw.b, draw.lo, draw.hi,
                                           generator=gen)
    raise ValueError(f"unknown draw {draw.kind!r}")


def _row_runs(shape: tuple[int, ...], where: tuple[slice, ...]) -> list[tuple[int, int]]:
    """The rows of the (leading dims) x (last dim) matrix a block covers, as contiguous
    runs in the block's own row order."""
    if len(shape) <= 1:
        return [(0, 1)]
    inner = where[-2]
    outer = [range(s.start, s.stop) for s in where[:-2]]
    runs = []
    for combo in itertools.product(*outer):
        row = 0
        for index, size in zip(combo, shape[:-2], strict=True):
            row = row * size + index
        runs.append((row * shape[-2] + inner.start, row * shape[-2] + inner.stop))
    return runs


def _draw_block(draw: Draw, key: int, shape: tuple[int, ...],
                where: tuple[slice, ...]) -> torch.Tensor:
    cols = shape[-1] if shape else 1
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    width = min(cols, BLOCK)
    height = max(1, BLOCK // width)
    across = math.ceil(cols / width)
    c0, c1 = (where[-1].start, where[-1].stop) if shape else (0, 1)
    runs = _row_runs(shape, where)
    out = torch.empty(sum(b - a for a, b in runs), c1 - c0, dtype=torch.float32)
    cached: tuple[int, torch.Tensor] | None = None
    at = 0
    for r0, r1 in runs:
        for bi in range(r0 // height, (r1 - 1) // height + 1):
            t0, t1 = bi * height, min((bi + 1) * height, rows)
            for bj in range(c0 // width, (c1 - 1) // width + 1):
                u0, u1 = bj * width, min((bj + 1) * width, cols)
                index = bi * across + bj
                if cached is None or cached[0] != index:
                    cached = (index, _tile(draw, key, index, t1 - t0, u1 - u0))
                a, b = max(r0, t0), min(r1, t1)
                c, d = max(c0, u0), min(c1, u1)
                out[at + a - r0:at + b - r0, c - c0:d - c0] = cached[1][a - t0:b - t0,
                                                                        c - u0:d - u0]
        at += r1 - r0
    return out


def piece_values(rule: InitRule, *, seed: int, name: str, global_shape: tuple[int, ...],
                 where: tuple[slice, ...], dtype: torch.dtype) -> torch.Tensor:
    """Block ``where`` (one contiguous slice per dimension) of tensor ``name`` of
    ``global_shape`` under ``rule``: the same values, bit for bit, whichever rank asks
    and whatever else it holds. Drawn in fp32 (a :class:`Copy` kept in its own dtype),
    then cast to ``dtype``."""
    where = tuple(slice(*s.indices(n)) for s, n in zip(where, global_shape, strict=True))
    shape = tuple(s.stop - s.start for s in where)
    if isinstance(rule.base, Fill):
        out = torch.full(shape, rule.base.value, dtype=torch.float32)
    elif isinstance(rule.base, Copy):  # cast from the source's own dtype, as copy_ does
        out = rule.base.values[where].to(dtype, copy=True)
    elif math.prod(shape) == 0:
        out = torch.empty(shape, dtype=torch.float32)
    else:
        block = _draw_block(rule.base, tensor_key(seed, name), global_shape, where)
        out = block.reshape(shape)
    for start, stop, value in rule.rows if where else ():
        a, b = max(start, where[0].start), min(stop, where[0].stop)
        if a < b:
            out[a - where[0].start:b - where[0].start] = value
    return out.to(dtype)
