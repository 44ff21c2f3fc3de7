"""Chunked, overlapped expert dispatch (``moe.dispatch_chunks``) on debug-sized Mixtral
trained through ``parallelize`` against one process (tests/hf_parity.py): the first
step's gradients parameter by parameter, per-step losses, gradient norms and router
losses, the evaluation loss and the final weights, at the shared tolerance; and the
exposed share of all-to-all time in the metrics.

Planted: the chunks' outputs concatenated in reverse order are refused at
``parallelize`` by the engine's parity probe (loss 4.82804 against 4.82754, 1.0e-4 over
1e-5) before this test's checks, and fail the block check of
packages/moe-ep/tests/test_moe_overlap.py.
"""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("paraxis_moe")

from hf_parity import compare

LAYOUTS = {
    "expert2": ({"expert": 2}, {}),
    "expert2_tensor2_sp": ({"expert": 2, "tensor": 2}, {"sequence_parallel": True}),
    "expert2_expert_tensor2_sp": ({"expert": 2, "tensor": 2},
                                  {"sequence_parallel": True, "expert_tensor": 2}),
    "expert2_pipeline2": ({"expert": 2, "pipeline": 2}, {"microbatches": 2}),
    "expert2_pipeline2_zero_bubble": ({"expert": 2, "pipeline": 2},
                                      {"microbatches": 2,
                                       "pipeline_schedule": "zero_bubble_h1"}),
    "expert2_recompute": ({"expert": 2}, {"activation_checkpointing": "full"}),
    "expert2_data2": ({"expert": 2, "data": 2}, {}),
    "expert2_context2": ({"expert": 2, "context": 2}, {}),
    "expert2_data2_zero3": ({"expert": 2, "data": 2}, {"zero": 3}),
}


@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunked_dispatch_matches_one_process(worlds, layout, chunks):
    degrees, options = LAYOUTS[layout]
    out = compare(worlds, "mixtral", degrees, steps=6, moe={"dispatch_chunks": chunks},
                  **options)
    assert all(h[2] > 0 for h in out[0][0]), "the router loss is trained every step"


# Under train.precision bf16 the dispatched rows (and their gradients) travel in bf16,
# as the unchunked dispatch sends them; the experts' outputs go back as computed.
def test_chunked_dispatch_in_bf16_matches_one_process_bf16(worlds):
    from paraxis.testing.tolerance import BF16_RTOL

    compare(worlds, "mixtral", {"expert": 2}, steps=6, recipe={"precision": "bf16"},
            rtol=BF16_RTOL, moe={"dispatch_chunks": 2})


def exposed_shares(chunks):
    """Two steps at 1 and ``chunks`` chunks on the same batch: per step, the exposed
    share, the blocked and lifetime seconds, and the bytes moved (moe's and comm's)."""
    import torch

    import paraxis
    from paraxis import ParallelConfig
    from paraxis_hf import build_debug_model

    out = {}
    for c in (1, chunks):
        model = build_debug_model("mixtral")
        engine = paraxis.parallelize(model, config=ParallelConfig.from_kwargs(
            expert=2, moe={"dispatch_chunks": c}), train={"steps": 2, "seq_length": 16})
        ids = torch.randint(0, model.config.vocab_size, (4, 16),
                            generator=torch.Generator().manual_seed(0))
        out[c] = []
        for _ in range(2):
            m = engine.train_step({"input_ids": ids, "labels": ids})
            out[c].append((m["moe/a2a_exposed_share"], m["moe/dispatch_s"],
                           m["moe/a2a_span_s"], m["moe/dispatch_bytes"], m["comm/expert_bytes"]))
        engine.close()
    return out


@pytest.mark.parametrize("chunks", [2, 4])
def test_exposed_all_to_all_share_is_logged(worlds, chunks):
    for rank in worlds.run(2, exposed_shares, chunks):
        for c, steps in rank.items():
            for share, exposed, span, _, _ in steps:
                assert 0 < exposed <= span and span > 0
                assert share == pytest.approx(exposed / span)
                if c == 1:  # blocking exchanges: all of their time is exposed
                    assert share == pytest.approx(1.0)
        # The same rows move, in more messages: the same bytes, forward and backward
        # (core's counts gain only the count exchange's few bytes per chunk).
        for one, more in zip(rank[1], rank[chunks], strict=True):
            assert one[3] == more[3]
            assert one[4] <= more[4] <= one[4] + 8 * 64 * chunks
