"""Which softmax attention a layer computes: the variants the context kernels implement,
and which (query, key) pairs each lets through.

A :class:`Variant` is what distinguishes one layer's attention from plain scaled
dot-product attention, as transformers' attention modules declare it:

* ``causal``: a query sees keys at or before its position (``module.is_causal``).
* ``window``: a sliding window of that many keys, the query's own included
  (``sliding_window=``; transformers' ``sliding_window_overlay``: ``q - k < window``).
* ``chunk``: chunked attention (Llama 4's ``chunked_attention`` layers,
  ``config.attention_chunk_size``; transformers' ``chunked_overlay``): a query sees the
  keys of its own chunk of ``chunk`` positions, ``q // chunk == k // chunk``.
* ``softcap``: logit soft-capping (Gemma 2, ``softcap=``): every score ``s`` becomes
  ``softcap · tanh(s / softcap)`` before the softmax. It acts on each score, so the
  ring applies it to each block's scores before the block's log-sum-exp enters the
  merge; capping anything after the merge (the merged log-sum-exp or output) is another
  function, which the planted test shows.

Attention sinks (gpt-oss ``s_aux``) are not part of the variant: they are a learned
tensor (one extra logit per head in every row's normalizer, attending to nothing) that
enters the merge once, after every key block (:func:`paraxis_seq.blockwise.merge_sinks`).

Visibility is decided from true global positions, so the zigzag layout's skips and a
window's or chunk's skips fall out of the same rule (:func:`paraxis_seq.blockwise.plan_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Variant", "visible"]


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, *, causal: bool,
            window: int | None, chunk: int | None = None) -> torch.Tensor | None:
    """``(sq, sk)`` bool: may the query at ``q_pos[i]`` see the key at ``k_pos[j]``; None
    when all may (see the module docstring for the window and chunk rules)."""
    if not causal and window is None and chunk is None:
        return None
    diff = q_pos[:, None] - k_pos[None, :]
    mask = diff >= 0 if causal else torch.ones_like(diff, dtype=torch.bool)
    if window is not None:
        mask &= diff < window
    if chunk is not None:
        mask &= (q_pos[:, None] // chunk) == (k_pos[None, :] // chunk)
    return mask


@dataclass(frozen=True)
class Variant:
    """A layer's attention variant (hashable: the ring caches its plans by it)."""

    causal: bool = True
    window: int | None = None
    chunk: int | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if value is not None and (not self.causal or value < 1):
                raise ValueError(
                    f"a {'sliding window' if name == 'window' else 'chunked attention'} "
                    f"(got {name}={value}) needs causal=True and {name} >= 1: transformers' "
                    "bidirectional window and flash-attention disagree on its edge, and no "
                    "causal LM here needs it")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be positive (it divides the scores), got "
                             f"{self.softcap}")

    def visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        return visible(q_pos, k_pos, causal=self.causal, window=self.window, chunk=self.chunk)

    @property
    def plain(self) -> bool:
        """Scores as plain SDPA computes them (masks aside): no soft-capping."""
        return self.softcap is None
