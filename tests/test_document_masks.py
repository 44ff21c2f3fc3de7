"""Packed documents with their boundaries (issue 23): a row holding several documents,
with ``position_ids`` that restart at each one, gives the loss of the same documents
run one per right-padded row, on one process and under every axis that moves or cuts
the sequence (data, tensor + sequence parallel, pipeline, expert, context ring and
Ulysses); and the per-parameter gradients of the packed rows equal one process's. The
mask is really applied: the same packed rows without the restarting positions give
another loss."""

import pytest
import torch

import paraxis
from paraxis.testing.parity import assert_same_gradients, local_gradients
from paraxis.testing.tolerance import STEP_RTOL, assert_losses_close
from paraxis_hf import build_debug_model

SEQ, VOCAB = 16, 128
# Document lengths per packed row (each row holds SEQ tokens).
ROWS = ((5, 7, 4), (9, 7), (3, 6, 7), (16,))


def packed_and_padded():
    g = torch.Generator().manual_seed(11)
    ids, pos, docs = [], [], []
    for lengths in ROWS:
        row = [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]
        docs += row
        ids.append(torch.cat(row))
        pos.append(torch.cat([torch.arange(n) for n in lengths]))
    padded = torch.zeros(len(docs), SEQ, dtype=torch.long)
    mask = torch.zeros(len(docs), SEQ, dtype=torch.long)
    for i, d in enumerate(docs):
        padded[i, :len(d)], mask[i, :len(d)] = d, 1
    return ({"input_ids": torch.stack(ids), "position_ids": torch.stack(pos)},
            {"input_ids": padded, "attention_mask": mask})


def _model(family):
    torch.manual_seed(0)
    return build_debug_model(family, vocab_size=VOCAB)


def one_process(family):
    packed, padded = packed_and_padded()
    engine = paraxis.parallelize(_model(family), train={"seq_length": SEQ})
    # The same rows and targets, but positions 0..s-1: attention crosses the documents.
    labels = packed["input_ids"].masked_fill(packed["position_ids"] == 0, -100)
    unmasked = {"input_ids": packed["input_ids"], "labels": labels}
    out = (engine.eval_step(packed), engine.eval_step(padded), engine.eval_step(unmasked),
           local_gradients(engine, packed))
    engine.close()
    return out


def layout_run(family, degrees):
    packed, _ = packed_and_padded()
    engine = paraxis.parallelize(_model(family), **degrees, train={"seq_length": SEQ})
    index, count = engine.grid.sample_shard()
    part = slice(index * len(ROWS) // count, (index + 1) * len(ROWS) // count)
    share = {k: v[part] for k, v in packed.items()}
    out = engine.eval_step(share), local_gradients(engine, share)
    engine.close()
    return out


@pytest.mark.parametrize("family", ["qwen3", "mixtral"])
def test_packed_documents_equal_one_per_padded_row(worlds, family):
    packed, padded, unmasked, _ = worlds.run(1, one_process, family)[0]
    assert_losses_close([packed], [padded], "packed against padded rows")
    # Without the restarts the same targets give another loss (by far more than noise).
    assert abs(unmasked - padded) > 10 * STEP_RTOL * padded


LAYOUTS = [("qwen3", {"data": 2}),
           ("qwen3", {"tensor": 2, "sequence_parallel": True}),
           ("qwen3", {"pipeline": 2, "microbatches": 2}),
           ("mixtral", {"expert": 2}),
           ("qwen3", {"context": 2}),
           ("qwen3", {"context": 2, "context_mode": "ulysses"})]


@pytest.mark.parametrize(("family", "degrees"), LAYOUTS,
                         ids=["data2", "tensor2-sp", "pipeline2", "expert2", "context2-ring",
                              "context2-ulysses"])
def test_packed_documents_under_every_layout(worlds, family, degrees):
    _, padded, _, ref_grads = worlds.run(1, one_process, family)[0]
    out = worlds.run(2, layout_run, family, degrees)
    for loss, _ in out:
        assert_losses_close([loss], [padded], "packed rows against padded rows")
    assert_same_gradients([g for _, g in out], ref_grads)


def padded_under_context(mode):
    _, padded = packed_and_padded()
    engine = paraxis.parallelize(_model("qwen3"), context=2, context_mode=mode,
                                 train={"seq_length": SEQ})
    loss = engine.eval_step(padded)
    engine.close()
    return loss


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_context_parallel_takes_padding(worlds, mode):
    _, padded, _, _ = worlds.run(1, one_process, "qwen3")[0]
    for loss in worlds.run(2, padded_under_context, mode):
        assert_losses_close([loss], [padded], "padded rows under context parallelism")
