"""Padding masks reach the model: left- and right-padded batches equal the model's own
masked loss in one process, and data, tensor + sequence parallel and pipeline layouts
equal one process (issue 23).

The reference is the model's own ``labels=`` loss with ``attention_mask`` (the same call
paraxis makes: positions counted from the first real token, labels -100 at the pads and
at each row's first real token, which nothing precedes), never paraxis in one process
alone (which would share any mistake with the layouts)."""

import pytest
import torch

import paraxis
from paraxis.parallel.batch import Batch
from paraxis.testing.parity import assert_same_gradients, local_gradients
from paraxis.testing.tolerance import REDUCTION_RTOL, assert_losses_close
from paraxis_hf import build_debug_model

SEQ, VOCAB, ROWS = 16, 128, 4
REAL = (10, 7, 13, 16)


def _batch(left: bool):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=g)
    mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    for row, real in enumerate(REAL):
        if left:
            mask[row, :SEQ - real] = 0
        else:
            mask[row, real:] = 0
    return ids.masked_fill(mask == 0, 0), mask


def test_targets_skip_the_pads_and_what_follows_nothing():
    ids, mask = _batch(left=False)
    assert int(Batch.from_user({"input_ids": ids, "attention_mask": mask}).tokens()) == \
        sum(r - 1 for r in REAL)
    ids, mask = _batch(left=True)
    batch = Batch.from_user({"input_ids": ids, "attention_mask": mask})
    assert int(batch.tokens()) == sum(r - 1 for r in REAL)
    assert batch.position_ids[0, SEQ - 10:].tolist() == list(range(10))  # from 0 after pads


def _own_and_mine(family, left):
    torch.manual_seed(0)
    model = build_debug_model(family, vocab_size=VOCAB)
    ids, mask = _batch(left)
    labels = ids.masked_fill(mask == 0, -100)
    first = mask.argmax(-1)
    labels[torch.arange(ROWS), first] = -100  # nothing precedes a row's first real token
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                    labels=labels, use_cache=False).loss.item()
    engine = paraxis.parallelize(model, train={"seq_length": SEQ})
    mine = engine.eval_step({"input_ids": ids, "attention_mask": mask})
    engine.close()
    return own, mine


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])  # rotary; learned absolute positions
@pytest.mark.parametrize("left", [True, False], ids=["left", "right"])
def test_padded_batches_equal_the_models_own_masked_loss(worlds, family, left):
    own, mine = worlds.run(1, _own_and_mine, family, left)[0]
    assert mine == pytest.approx(own, rel=REDUCTION_RTOL)


def _layout_run(degrees, left):
    torch.manual_seed(0)
    model = build_debug_model("qwen3", vocab_size=VOCAB)
    engine = paraxis.parallelize(model, **degrees, train={"seq_length": SEQ, "lr": 1e-3})
    ids, mask = _batch(left)
    index, count = engine.grid.sample_shard()
    part = slice(index * ROWS // count, (index + 1) * ROWS // count)
    share = {"input_ids": ids[part], "attention_mask": mask[part]}
    grads = local_gradients(engine, share)
    losses = [engine.train_step(share)["loss"] for _ in range(3)]
    engine.close()
    return losses, grads


@pytest.mark.parametrize("degrees", [
    {"data": 2}, {"tensor": 2, "sequence_parallel": True},
    {"pipeline": 2, "microbatches": 2}], ids=["data2", "tensor2-sp", "pipeline2"])
def test_left_padding_under_every_layout_equals_one_process(worlds, degrees):
    ref_losses, ref_grads = worlds.run(1, _layout_run, {}, True)[0]
    out = worlds.run(2, _layout_run, degrees, True)
    assert_same_gradients([g for _, g in out], ref_grads)
    for losses, _ in out:
        assert_losses_close(losses, ref_losses)
