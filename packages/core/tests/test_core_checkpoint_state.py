"""The checkpoint format written and read without an Engine: any TrainState will do.
Persistent buffers (BatchNorm's running statistics) are saved and restored, non-persistent
ones are not; a format-2 checkpoint (no buffers) leaves the model's own, with a warning; a
format-3 one that lacks a buffer is another model's."""

import json
import warnings
from pathlib import Path

import torch
from torch import nn

from paraxis.checkpoint import (
    CheckpointError,
    StateRecord,
    load_checkpoint,
    read_model_tensors,
    save_checkpoint,
)
from paraxis.config.parallel import ParallelConfig
from paraxis.parallel.placement import record_replicated
from paraxis.runtime.grid import Grid
from paraxis.runtime.world import init_distributed


def _state(seed: int, grid: Grid) -> StateRecord:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.BatchNorm1d(3))
    model[2].register_buffer("scratch", torch.randn(3), persistent=False)
    record_replicated(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return StateRecord(model=model, optimizer=optimizer, grid=grid, config=ParallelConfig(),
                       step=7, data_state={"position": 42})


def save_and_restore(directory: str) -> tuple[bool, bool, int, dict, list]:
    init_distributed()
    grid = Grid.build(ParallelConfig())
    saved = _state(0, grid)
    saved_scratch = saved.model[2].scratch
    path = save_checkpoint(saved, directory)
    fresh = _state(1, grid)
    restored = load_checkpoint(fresh, directory)
    same_weights = all(torch.equal(a, b) for a, b in zip(
        saved.model.parameters(), fresh.model.parameters(), strict=True))
    same_state = all(torch.equal(saved.optimizer.state[a]["exp_avg"],
                                 fresh.optimizer.state[b]["exp_avg"])
                     for a, b in zip(saved.model.parameters(), fresh.model.parameters(),
                                     strict=True))
    same_buffers = all(torch.equal(a, b) for a, b in zip(
        saved.model.buffers(), fresh.model.buffers(), strict=True) if a is not saved_scratch)
    index, tensors = read_model_tensors(path)
    grid.destroy()
    buffers = sorted(k for k in index["tensors"] if k.startswith("buffer/"))
    return (same_weights and same_buffers, same_state, restored.step, restored.data_state,
            sorted(tensors), buffers, not torch.equal(saved_scratch, fresh.model[2].scratch))


def test_any_train_state_saves_and_restores(worlds, tmp_path):
    weights, state, step, data, names, buffers, scratch_kept = worlds.run(
        1, save_and_restore, str(tmp_path))[0]
    assert weights and state
    assert (step, data) == (7, {"position": 42})  # handed back, not written into the state
    assert names == ["0.bias", "0.weight", "1.bias", "1.weight", "2.bias", "2.weight"]
    assert buffers == ["buffer/2.num_batches_tracked", "buffer/2.running_mean",
                       "buffer/2.running_var"]  # not the non-persistent scratch
    assert scratch_kept  # the model's own value of a buffer the checkpoint does not hold


def _drop_buffers(step_dir: Path, version: int) -> None:
    """Rewrite the index as a checkpoint of ``version`` without buffers."""
    path = step_dir / "index.json"
    index = json.loads(path.read_text())
    index["format_version"] = version
    index["tensors"] = {k: v for k, v in index["tensors"].items()
                        if not k.startswith("buffer/")}
    path.write_text(json.dumps(index))


def load_without_buffers(directory: str, version: int) -> tuple[bool, list[str], str]:
    """Load a checkpoint whose buffers were dropped, as format ``version``: whether the
    model kept its own running mean, the warnings, and the refusal ("" if none)."""
    init_distributed()
    grid = Grid.build(ParallelConfig())
    _drop_buffers(Path(save_checkpoint(_state(0, grid), directory)), version)
    fresh = _state(1, grid)
    own = fresh.model[2].running_mean.clone()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_checkpoint(fresh, directory)
    except CheckpointError as exc:
        return False, [], str(exc)
    finally:
        grid.destroy()
    kept = torch.equal(own, fresh.model[2].running_mean)
    return kept, [str(w.message) for w in caught], ""


def test_a_checkpoint_from_before_buffers_keeps_the_models_own(worlds, tmp_path):
    kept, caught, refused = worlds.run(1, load_without_buffers, str(tmp_path), 2)[0]
    assert kept and not refused
    assert len(caught) == 1 and "format 2, which saved no buffers" in caught[0]
    assert "2.running_mean" in caught[0]


def test_a_current_checkpoint_missing_a_buffer_is_another_models(worlds, tmp_path):
    refused = worlds.run(1, load_without_buffers, str(tmp_path), 3)[0][2]
    assert "saved from another model: buffer 2.running_mean is missing" in refused
