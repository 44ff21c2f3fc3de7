"""Chunked, overlapped dispatch (``moe.dispatch_chunks``): one MoE block sharded over 2
and 4 gloo ranks with its tokens cut into 2 or 3 chunks, against the unsharded block in
one process (outputs, input gradients, every parameter's gradient; test_moe_parity's
check), dropless and with capacity; and the exposed-share metric.

Planted: the chunks' outputs concatenated in reverse order fail the output check
(mixtral, fp64, 2 ranks, 2 chunks: 384 of 384 elements off, up to 23 absolute)."""

import pytest

pytest.importorskip("transformers")

from test_moe_parity import block_parity

F32, F64 = "float32", "float64"
CASES = [
    ("mixtral", None, "probs", "grouped_mm", F32),
    ("mixtral", None, "probs", "eager", F64),
    ("qwen2_moe", 0.5, "probs", "eager", F64),
    ("deepseek_v3", None, "probs", "grouped_mm", F32),
]


@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(("family", "capacity", "policy", "implementation", "dtype"), CASES)
def test_chunked_block_matches_unsharded(worlds, n, chunks, family, capacity, policy,
                                         implementation, dtype):
    import torch

    out = worlds.run(n, block_parity, family, capacity, policy, implementation,
                     getattr(torch, dtype), chunks)
    worst = max(max(err.values()) for err, _ in out)
    print(f"{family} ep={n} chunks={chunks} capacity={capacity} {implementation} {dtype}: "
          f"max error / max|ref| {worst:.1e}")


# Ranks that receive no rows (every token picks experts 0 and 1), and more chunks than
# tokens (empty chunks): every rank still joins every chunk's exchanges, forward and back.
@pytest.mark.parametrize("chunks", [3, 11])
@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_idle_ranks_and_empty_chunks_join_every_exchange(worlds, implementation, chunks):
    from test_moe_parity import idle_ranks

    assert worlds.run(4, idle_ranks, implementation, chunks) == [False, False, True, True]
