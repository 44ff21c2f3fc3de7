"""The topology-conversion matrix: a checkpoint saved on grid A continues on grid B.

Each row trains 3 steps on grid A and saves; grid B loads it, evaluates a fixed batch
(the loss must equal the uninterrupted run's after 3 steps) and trains 3 more steps
(per-step losses and learning rates must equal the uninterrupted run's). The
uninterrupted run is one process on the same weights and batches; everything is compared
at the shared tolerance (paraxis.testing.tolerance). Debug-sized Llama (hidden 32, a
vocabulary of 127, so tensor 2 pads it) for the dense rows, Mixtral (4 experts, top-2)
for the expert row. Batches are indexed by ``engine.step`` and the data position is
compared after the load, so the step, the schedule, the optimizer state and the data
position must all follow the checkpoint. RNG streams are per rank and restored only on
the same grid (these models have no dropout).

Rows with data/tensor/pipeline that tests/test_checkpoint_resume.py and
packages/zero-shard/tests/test_zero_checkpoint.py already cover on other grids stay
there (same-grid bit-exact resume, ZeRO-3 -> ZeRO-1 data 4 -> one process).
"""

from __future__ import annotations

import pytest
import torch

import paraxis
from paraxis import ParallelConfig
from paraxis.testing.tolerance import assert_losses_close

pytest.importorskip("transformers")

LR, STEPS, SAVE, BATCH, SEQ = 1e-3, 6, 3, 8, 16
MODELS = {"llama": {"vocab_size": 127}, "mixtral": {}}
PP = {"pipeline": 2, "microbatches": 2}
ROWS = {
    "data2xtensor2-pipeline2": ("llama", {"data": 2, "tensor": 2}, PP),
    "pipeline2xtensor2-data2": ("llama", {**PP, "tensor": 2}, {"data": 2}),
    "tensor2-one": ("llama", {"tensor": 2}, {}),
    "zero3data2-tensor2": ("llama", {"data": 2, "zero": 3}, {"tensor": 2}),
    "expert2-expert1xdata2": ("mixtral", {"expert": 2}, {"data": 2}),
    "context2-data2": ("llama", {"context": 2}, {"data": 2}),
    # Sequence parallel on -> off, no ZeRO -> ZeRO-1.
    "tensor2sp-zero1data2": ("llama", {"tensor": 2, "sequence_parallel": True},
                             {"data": 2, "zero": 1}),
    # Reverses.
    "pipeline2-data2xtensor2": ("llama", PP, {"data": 2, "tensor": 2}),
    "data2-context2": ("llama", {"data": 2}, {"context": 2}),
    "data2-expert2": ("mixtral", {"data": 2}, {"expert": 2}),
}


def _batches(vocab):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (STEPS + 1, BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[:, 0, :9] = -100  # uneven token counts over the data ranks
    return ids, labels


def run(family, options, stop, load=None, save=None):
    """Build ``family`` on ``options``; load ``load``; evaluate the fixed batch and train
    until step ``stop`` (batches by engine.step); save to ``save``. Returns the eval
    loss, per-step (loss, lr), the data position after the load."""
    from paraxis_hf import build_debug_model

    model = build_debug_model(family, seed=0 if load is None else 7, **MODELS[family])
    engine = paraxis.parallelize(model, config=ParallelConfig.from_kwargs(**options), train={
        "steps": STEPS, "lr": LR, "warmup_steps": 2, "seq_length": SEQ})
    if load:
        engine.load(load)
    position = dict(engine.data_state)
    ids, labels = _batches(model.config.vocab_size)
    index, count = engine.grid.sample_shard()
    part = slice(index * BATCH // count, (index + 1) * BATCH // count)

    def share(i):
        return {"input_ids": ids[i, part], "labels": labels[i, part]}

    evaluated, history = None, []
    while engine.step < stop:
        if engine.step == SAVE and save is None:  # after the load, or straight through
            evaluated = engine.eval_step(share(STEPS))
        m = engine.train_step(share(engine.step))
        history.append((m["loss"], m["lr"]))
    if save:
        engine.data_state = {"position": engine.step * BATCH, "seed": 0}
        engine.save(save)
    engine.close()
    return evaluated, history, position


_REFERENCES: dict[str, tuple] = {}


def reference(worlds, family):
    """One process, 6 steps straight; its eval loss is taken after step 3."""
    if family not in _REFERENCES:
        _REFERENCES[family] = worlds.run(1, run, family, {}, STEPS)[0]
    return _REFERENCES[family]


@pytest.mark.parametrize("row", list(ROWS))
def test_checkpoint_continues_on_another_grid(worlds, tmp_path, row):
    family, grid_a, grid_b = ROWS[row]
    ref_eval, ref_history, _ = reference(worlds, family)
    ckpt = str(tmp_path / "ckpt")
    size_a = ParallelConfig.from_kwargs(**grid_a).world_size
    size_b = ParallelConfig.from_kwargs(**grid_b).world_size
    saved = worlds.run(size_a, run, family, grid_a, SAVE, None, ckpt)
    assert_losses_close([h[0] for h in saved[0][1]], [h[0] for h in ref_history[:SAVE]],
                        f"{row}: losses before the save")
    for evaluated, history, position in worlds.run(size_b, run, family, grid_b, STEPS, ckpt):
        assert position == {"position": SAVE * BATCH, "seed": 0}, row
        assert_losses_close([evaluated], [ref_eval], f"{row}: loss of the fixed batch")
        assert_losses_close([h[0] for h in history], [h[0] for h in ref_history[SAVE:]],
                            f"{row}: per-step losses after the load")
        assert [h[1] for h in history] == [h[1] for h in ref_history[SAVE:]], row
