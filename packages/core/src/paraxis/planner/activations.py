"""Activation bytes of one layer counted from the model's own structure (issue 15).

Korthikanti et al.'s constants (:func:`paraxis.planner.memory.layer_activation_bytes`)
describe GPT-3's layer: LayerNorm, a GELU MLP of 4h, dropout, multi-head attention that
stores its s x s scores. A Llama-style layer (RMSNorm, a gated SiLU MLP of width i,
grouped KV heads, fused scaled-dot-product attention, no dropout) keeps other tensors;
for it the plan counts, per token on the rank, the tensors autograd saves (element size
e, fp32 where the model computes in fp32):

* each RMSNorm: its fp32 input (4), the normalized tensor (e) and 1/rms (4 per token);
  with sequence parallelism these are sequence-split (/t);
* each block's input to its projections (e·h), saved once, whole (gathered under
  sequence parallelism);
* attention: q, k, v and the output (e·(2·h_q + 2·h_kv)/t) and the fp32 log-sum-exp per
  query and head (4·a/t); the s x s scores are never stored by the fused kernel;
* MLP: gate, its SiLU, up and their product (4·e·i/t); a mixture-of-experts layer
  keeps these per routed copy (top-k) at the expert width (/t only when
  ``expert_tensor`` splits it), plus paraxis-moe's dispatch: each routed row in and
  out, the router's fp32 probabilities and indices. Its block stays outside the tensor
  plan, so under sequence parallelism it routes the rank's 1/t of the tokens; with
  ``expert_tensor`` the split FFN runs on the t ranks' rows, gathered (its input kept);
  at expert degree 1 without a capacity nothing is dispatched: the model's own forward
  keeps each routed row's input and its output before weighting, no returned row;
* with context parallelism every per-token term divides by C; Ulysses keeps the
  attention output twice (before and after its all-to-all back).

``selective`` recompute stores the attention block's input instead of its tensors,
``full`` the layer's input only. Per stage: the token ids (8 bytes per token) on the
first, rotary cos/sin (2·s·d·e) on every stage, and on the last the final norm, the
head's input and the loss's fp32 log-softmax (4·v/t per token).
"""

from __future__ import annotations

from typing import Any

from paraxis.planner.model import ModelCounts

__all__ = ["exact_head_bytes", "exact_layer_bytes", "exact_stage_bytes", "is_exact"]


def is_exact(counts: ModelCounts) -> bool:
    """Whether the layer structure is one counted here (else Korthikanti's constants)."""
    return counts.block == "llama"


def _norm(tokens: float, h: int, e: int, shard: int) -> float:
    return ((4 + e) * h + 4) * tokens / shard


def exact_layer_bytes(counts: ModelCounts, *, s: int, b: int, t: int = 1, sp: bool = False,
                      recompute: str = "none", element: int = 2, context: int = 1,
                      moe: bool = False, ulysses: bool = False, etp: int = 1,
                      dispatched: bool = True) -> float:
    """Bytes one Llama-style layer keeps for its backward, per microbatch."""
    e, h = element, counts.hidden_size
    tokens = s * b / context
    shard = t if sp else 1
    if recompute == "full":
        return e * h * tokens / shard
    attention_in = e * h * tokens  # the projections' input, whole
    if recompute == "selective":
        attention = e * h * tokens / shard  # the checkpointed block's input
    else:
        q = counts.num_heads * counts.head_dim
        kv = counts.kv_heads * counts.head_dim
        attention = attention_in + tokens * (e * (2 * q + 2 * kv) + 4 * counts.num_heads) / t
        if ulysses:  # the output comes back through an all-to-all: a second copy
            attention += tokens * e * q / t
    if moe:
        own = tokens / shard  # the block's input is not gathered: it is outside the plan
        mlp = e * h * own + _moe(counts, own, e, t if etp > 1 else 1,
                                 gathered=etp > 1 and sp, dispatched=dispatched)
    else:
        mlp = e * h * tokens + 4 * e * (counts.intermediate_size or 4 * h) * tokens / t
    return 2 * _norm(tokens, h, e, shard) + attention + mlp


def _moe(counts: ModelCounts, tokens: float, e: int, etp: int, gathered: bool,
         dispatched: bool) -> float:
    """paraxis-moe's dispatcher: per token the router's fp32 probabilities and their
    sum (4·E + 4); per routed copy (top-k, balanced) the expert's input row, its MLP
    (4·i/etp), the returned row and its weighted copy (e·(3h + 4i/etp)), and 52 bytes of
    indices and weights (top-k ids, the sort, send and receive orders). ``gathered``:
    the split FFN's rows are the etp ranks' routed rows, its input kept for them all.
    Not ``dispatched`` (the model's own forward): per row its input and its output
    before weighting (e·(2h + 4i/etp)), nothing returned."""
    width = counts.expert_intermediate or counts.intermediate_size or 0
    h = counts.hidden_size
    routed = tokens * counts.top_k
    rows = routed * (etp if gathered else 1)
    if not dispatched:
        return rows * e * (2 * h + 4 * width / etp) + routed * 52 \
            + tokens * (4 * counts.num_experts + 4)
    return rows * e * (h + 4 * width / etp) + routed * (2 * e * h + 52) \
        + tokens * (4 * counts.num_experts + 4)


def exact_stage_bytes(counts: ModelCounts, work: Any, *, t: int, sp: bool, context: int,
                      first: bool) -> float:
    """Per-microbatch bytes a stage keeps outside its layers: the rotary tables (one
    batch row) and, on the first stage, the token ids."""
    tokens = work.seq * work.micro_batch / context
    out = 2 * work.seq / context * counts.head_dim * work.element_size
    return out + (8 * tokens if first else 0.0)


def exact_head_bytes(counts: ModelCounts, work: Any, *, t: int, sp: bool,
                     context: int) -> float:
    """Per-microbatch bytes of the last stage's final norm, the head's input and the
    loss's fp32 log-softmax over this rank's vocabulary."""
    e, h = work.element_size, counts.hidden_size
    tokens = work.seq * work.micro_batch / context
    return _norm(tokens, h, e, t if sp else 1) + e * h * tokens \
        + 4 * tokens * counts.vocab_size / t
