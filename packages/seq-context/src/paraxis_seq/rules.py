"""The context axis' own rules, checked before any process group exists.

:func:`check_context` runs through ``paraxis_validate_config`` (the model's shape);
:func:`check_module` through ``ContextParallelStrategy.check_model`` (the module
itself: what only the module shows, such as attention that bypasses transformers'
interface).

* **Sequence.** Ring attention shards zigzag: the sequence is cut into ``2C`` chunks
  so that causal work is balanced (:mod:`paraxis_seq.zigzag`). Ulysses shards
  contiguously (``C`` chunks): every rank attends over the whole gathered sequence for
  its heads, so its work is balanced in any layout, and contiguous shards need no
  permutation around the kernel. Under sequence parallelism each rank's shard is cut
  again over ``tensor`` (the tensor axis checks ``tensor x context``).
* **Ulysses heads.** Heads are split by tensor first, then by Ulysses' all-to-all, so
  query heads must divide by ``tensor x context``. KV heads need not: kv heads that do
  not divide over C are repeated before the exchange so each rank receives the ones
  its query heads use (:func:`paraxis_seq.ulysses.kv_replication`, documented there);
  kv heads are split by tensor first, which the tensor axis requires to divide.
* **Ring** attention splits no heads: any head count works.
"""

from __future__ import annotations

from typing import Any

from paraxis.config.errors import Problem
from paraxis.config.parallel import ParallelConfig
from paraxis.config.rules import divisors
from paraxis.config.shape import ModelShape
from paraxis.parallel.anatomy import Anatomy

__all__ = ["EQUIVALENT_IMPLEMENTATIONS", "LAYOUT_OF_MODE", "check_context", "check_module"]

# How each mode shards the sequence (see above): the ring needs zigzag for balanced
# causal work; Ulysses is balanced anyway and saves the zigzag permutation.
LAYOUT_OF_MODE = {"ring": "zigzag", "ulysses": "contiguous"}

# transformers attention implementations whose arithmetic the context kernels reproduce
# (softmax attention, causal and sliding window from the module and its call); any
# other (a custom registered kernel, a hub kernel) would be silently replaced.
EQUIVALENT_IMPLEMENTATIONS = frozenset({
    None, "eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention",
    "paraxis_ring", "paraxis_ulysses",
})


def check_context(config: ParallelConfig, model: ModelShape | None,
                  layout: str | None = None) -> list[Problem]:
    """Problems of ``config``'s context axis with a model of shape ``model``
    (``layout``: the one the mode shards with, unless given)."""
    par = config.parallelism
    c, t = par.context, par.tensor
    if c == 1 or model is None:
        return []
    layout = layout or LAYOUT_OF_MODE[par.context_mode]
    problems: list[Problem] = []
    parts = 2 * c if layout == "zigzag" else c
    seq = model.seq_length
    if seq is not None and seq % parts:
        rule = (f"must divide into 2 x context = {parts} equal chunks (zigzag sharding: "
                "rank r holds chunks r and 2C-1-r, which balances causal attention)"
                if layout == "zigzag" else f"must divide over context = {c} ranks "
                f"({layout} shards, {par.context_mode} mode)")
        problems.append(Problem("model.seq_length", seq, rule,
                                f"use a multiple of {parts} (e.g. {seq + parts - seq % parts})"))
    heads = model.num_attention_heads
    # No attention heads (Mamba): only recurrent layers, whose state passes in any layout.
    if par.context_mode == "ulysses" and heads is not None and heads % (t * c):
        local = heads // t if heads % t == 0 else heads
        problems.append(Problem(
            "model.num_attention_heads", heads,
            f"must be divisible by tensor x context = {t * c} in Ulysses mode (heads are "
            "split by tensor first, then by Ulysses' all-to-all over context)",
            f"set parallelism.context_mode: ring, or choose context among "
            f"{divisors(local)}"))
    return problems


def check_module(config: ParallelConfig, model: Any,
                 anatomy: Anatomy | None = None) -> list[Problem]:
    """Problems only the module shows: attention paraxis cannot intercept (named), or an
    attention implementation it would silently replace."""
    if config.parallelism.context == 1:
        return []
    from paraxis_seq.hf_attention import interceptable

    field = "parallelism.context"
    try:
        reason = interceptable(model, anatomy)
    except ImportError:  # no transformers: the model cannot be a transformers model
        reason = (f"{type(model).__name__} is not a transformers model (transformers is not "
                  "installed); call paraxis_seq.ring_attention or ulysses_attention from "
                  "its attention")
    if reason is not None:
        return [Problem(field, config.parallelism.context,
                        f"cannot make {type(model).__name__} context parallel: {reason}",
                        "run it without the context axis (context: 1)")]
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl not in EQUIVALENT_IMPLEMENTATIONS:
        return [Problem(field, config.parallelism.context,
                        f"the model's attention implementation {impl!r} is not one whose "
                        "arithmetic paraxis' ring/Ulysses kernels reproduce (eager, sdpa, "
                        "flash_attention_2/3, flex_attention); context parallelism would "
                        "replace it silently",
                        "build the model with attn_implementation='sdpa', or run it "
                        "without the context axis")]
    return []
