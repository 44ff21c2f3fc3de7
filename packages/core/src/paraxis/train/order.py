"""A seeded shuffle of ``n`` rows that costs no memory: a keyed Feistel permutation.

``randperm(n)`` holds n int64 (133 MB for the 17M rows of a 2 GB byte-level corpus at
sequence 128), on every rank, and grows with the corpus. Instead the i-th row of an
epoch is ``permute(i)``: a 4-round Feistel network on the smallest even-width bit domain
that holds n, keyed by the seed, with cycle-walking for values >= n (each step lands in
[0, n) with probability above 1/4, so a walk is short). A Feistel network is a bijection
on its domain whatever its round function, and cycle-walking keeps a bijection on
[0, n), so every row is drawn exactly once per epoch. Evaluated per batch, on the rows
the batch needs.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["permute"]

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64's finalizer of ``x ^ key`` (uint64 arithmetic wraps)."""
    z = x ^ key
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _keys(seed: int) -> list[np.uint64]:
    state = np.random.default_rng(seed).integers(0, 2**63, size=4, dtype=np.int64)
    return [np.uint64(k) for k in state]


def _feistel(x: np.ndarray, half: int, keys: list[np.uint64]) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    left, right = x >> np.uint64(half), x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right, key) & mask)
    return (left << np.uint64(half)) | right


def permute(index: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """The images of ``index`` (values in [0, n)) under the seed's permutation of
    [0, n)."""
    if n <= 1:
        return index.clone()
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    keys = _keys(seed)
    x = index.numpy().astype(np.uint64)
    out = _feistel(x, half, keys)
    while (outside := out >= np.uint64(n)).any():  # cycle-walk back into [0, n)
        out[outside] = _feistel(out[outside], half, keys)
    return torch.from_numpy(out.astype(np.int64))
