"""DeepSeek's sparse attention (DSA, arXiv:2512.02556) under context parallelism (issue 35,
item 4): the indexer picks each query's keys from the whole sequence.

The attention modules of the DSA families (deepseek_v32, glm_moe_dsa, axk2, dots3_note,
hy_v4) call their indexer as ``indexer(hidden_states, q_resid, position_embeddings,
attention_mask[:, 0], position_ids, cache=)``; it scores every (query, key) pair as
``Σ_h w[q, h]·relu(q_h·k)`` over its own heads, masks what the mask hides with -inf and
returns each query's top-k key indices ``(b, s, k)``. Outside eager and SDPA the module
hands those indices to the attention function (``indices=``); a shared layer
(glm_moe_dsa, hy_v4: ``indexer_types`` "shared") reuses the previous full layer's.

A rank holds a shard of the sequence, so its own indexer call would rank only the keys
it holds. :class:`GatheredSelection` wraps the attention module's forward: while it runs,
the indexer's forward gathers its inputs over the context group into the true order, builds
the causal (and document) mask of the whole sequence, and calls the module's own indexer
on them, so every rank holds the selection of every query, in global key positions,
computed by the model's code. The indexer is ``torch.no_grad`` in transformers (its
weights learn from no loss there), so the gather needs no backward. The indices then
reach the attention function, which turns them into a mask of selected keys
(:func:`selection`) that the ring applies per key block, Ulysses over the gathered
sequence: both through the blockwise kernel, so the two modes share one arithmetic.

transformers builds no mask for a context-parallel implementation, and the module slices
the mask it is given for the indexer; the wrapper hands it :data:`NO_MASK`, which the
indexer here ignores and the attention function drops. Cost: the selection is computed
on every rank for the whole sequence (the indexer's scores are ``(b, s, s)``, as in one
process) and the mask of this rank's queries is ``(b, s/C, s)`` booleans.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from paraxis.parallel.batch import DOC_IDS_KWARG
from paraxis.runtime.collectives import gather_along
from paraxis_seq.zigzag import in_true_order

__all__ = ["NO_MASK", "GatheredSelection", "indexed_modules", "selection",
           "use_gathered_indexers"]

# The mask an indexed attention module is handed in place of transformers' (which it
# does not build here): the module slices it for its indexer, which ignores it, and
# passes it on to the attention function, which drops it (identity, not value).
NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)


def indexed_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The attention modules of ``model`` that run a DSA indexer of their own (a shared
    layer's module holds ``indexer = None`` and reuses the previous selection)."""
    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, "indexer", None), nn.Module)
            and type(m.indexer).__name__.endswith("Indexer")}


def use_gathered_indexers(model: nn.Module, group: Any, *, layout: str) -> tuple[str, ...]:
    """Wrap every indexed attention module of ``model``; returns their names. A module
    wrapped before (the function registered again, for a new grid) takes the new group."""
    wrapped = []
    for name, module in indexed_modules(model).items():
        held = module.__dict__.get("forward")
        if isinstance(held, GatheredSelection):
            held.group, held.layout = group, layout
        else:
            module.forward = GatheredSelection(module, group, layout)
        module.paraxis_context = "DSA indexer over the gathered sequence"
        wrapped.append(name)
    return tuple(wrapped)


class GatheredSelection:
    """The forward of an indexed attention module whose indexer, while it runs, selects
    from the whole sequence (module docstring)."""

    def __init__(self, module: nn.Module, group: Any, layout: str) -> None:
        self.forward, self.indexer = module.forward, module.indexer
        self.owner, self.group, self.layout = type(module).__name__, group, layout

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("attention_mask") is not None:
            raise ValueError(f"{self.owner} got an attention mask under context "
                             "parallelism: its indexer needs the whole sequence's, which "
                             "a rank's shard mask is not; do not pass one")
        kwargs["attention_mask"] = NO_MASK
        select = functools.partial(self._select, type(self.indexer).forward.__get__(
            self.indexer), kwargs.get(DOC_IDS_KWARG))
        self.indexer.forward = select
        try:
            return self.forward(*args, **kwargs)
        finally:
            del self.indexer.forward

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (sequence on dim 1) in the sequence's true order."""
        gathered = gather_along(x.detach().contiguous(), 1, self.group)
        return in_true_order(gathered, self.group.size, layout=self.layout)

    def _select(self, indexer: Any, docs: torch.Tensor | None, hidden_states: torch.Tensor,
                q_resid: torch.Tensor, position_embeddings: tuple[torch.Tensor, ...],
                attention_mask: Any = None, position_ids: Any = None,
                cache: Any = None) -> torch.Tensor:
        if cache is not None:
            raise ValueError(f"{self.owner}'s indexer got a cache: context parallelism "
                             "trains without one (use_cache=False)")
        with torch.no_grad():
            hidden, resid = self._whole(hidden_states), self._whole(q_resid)
            cos, sin = (self._whole(t) for t in position_embeddings)
            s = hidden.shape[1]
            mask = torch.ones(s, s, dtype=torch.bool, device=hidden.device).tril()
            mask = mask.expand(hidden.shape[0], s, s)
            if docs is not None:
                ids = self._whole(docs.to(hidden.device).long())
                mask = mask & (ids[:, :, None] == ids[:, None, :]) & (ids[:, None, :] >= 0)
            return indexer(hidden, resid, (cos, sin), mask, None, cache=None)


def selection(indices: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The ``(b, s, seq_len)`` boolean mask of the keys ``indices`` ``(b, s, k)`` select
    (True: attended where causality and documents allow, as transformers' eager path
    applies the indexer: its mask AND the selection)."""
    chosen = torch.zeros(*indices.shape[:2], seq_len, dtype=torch.bool, device=indices.device)
    return chosen.scatter(-1, indices.long(), True)
