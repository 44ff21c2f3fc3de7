"""Chunked, overlapped dispatch (``moe.dispatch_chunks``): one MoE block sharded over 2
and 4 gloo ranks with its tokens cut into 2 or 3 chunks, against the unsharded block in
one process (outputs, input gradients, every parameter's gradient; test_moe_parity's
check), dropless and with capacity; and the exposed-share metric.

Planted: the chunks' outputs concatenated in reverse order fail the output check
(mixtral, fp64, 2 ranks, 2 chunks: 384 of 384 elements off, up to 23 absolute).

And the overlap itself, from a trace of launches, waits and expert compute: every
chunk's compute, forward and backward, runs while another chunk's exchange is in
flight."""

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


def overlap_trace(chunks):
    """Events of one forward and backward of a block at ``chunks`` chunks: exchanges
    launched and waited on, expert compute started and ended (backward compute by
    probes on its output and input)."""
    import torch
    import torch.distributed as dist
    from moe_tiny_models import HIDDEN, build

    from paraxis.parallel.placement import record_replicated
    from paraxis.runtime.grid import Grid
    from paraxis_moe import ExpertParallel, MoEConfig, overlap
    from paraxis_moe.stats import probe

    log = []
    launch, wait = overlap.Flight.launch, overlap.Flight.wait
    overlap.Flight.launch = lambda self, x: (log.append(("launch", id(self))),
                                             launch(self, x))[1]
    overlap.Flight.wait = lambda self: (log.append(("wait", id(self))), wait(self))[1]
    try:
        grid = Grid.build({"expert": dist.get_world_size()})
        model = build("mixtral")
        record_replicated(model)
        ExpertParallel(model, ["model.layers.0.mlp"], grid.group("expert"),
                       moe=MoEConfig(dispatch_chunks=chunks), token_group=grid.group("expert"))
        block = model.get_submodule("model.layers.0.mlp")
        local = block.experts._local_experts

        def traced(d):
            log.append(("compute", "start"))
            d.tokens = probe(d.tokens, lambda: log.append(("compute", "end")))
            out = local(d)
            log.append(("compute", "end"))
            return probe(out, lambda: log.append(("compute", "start")))

        block.experts._local_experts = traced
        x = torch.randn(2, 6, HIDDEN, generator=torch.Generator().manual_seed(dist.get_rank()))
        y = block(x.requires_grad_(True))
        log.append(("backward", ""))
        (y[0] if isinstance(y, tuple) else y).sum().backward()
        grid.destroy()
    finally:
        overlap.Flight.launch, overlap.Flight.wait = launch, wait
    return log


def hidden_computes(log):
    """Per pass, for each compute segment: whether an exchange was in flight all along."""
    flying, out, seg, phase = set(), {"forward": [], "backward": []}, None, "forward"
    for kind, what in log:
        if kind == "backward":
            phase = kind
        elif kind == "launch":
            flying.add(what)
        elif kind == "wait":
            flying.discard(what)
            seg = False if seg is not None else None
        elif what == "start":
            seg = bool(flying)
        else:
            out[phase].append(bool(seg))
            seg = None
    return out


# The overlap itself: every chunk's expert compute, forward and backward, runs while
# another chunk's exchange is in flight. Planted: a backward that waits for its gradient
# exchange as soon as it launches it (_Wait.backward calling wait) leaves the backward
# computes exposed, [False, False], and fails here.
@pytest.mark.parametrize("chunks", [2, 4])
def test_every_chunks_compute_runs_beside_an_exchange(worlds, chunks):
    for log in worlds.run(2, overlap_trace, chunks):
        hidden = hidden_computes(log)
        assert hidden["forward"] == [True] * chunks, log
        assert hidden["backward"] == [True] * chunks, log
