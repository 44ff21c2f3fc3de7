"""The checkpoint format written and read without an Engine: any TrainState will do.
Persistent buffers (BatchNorm's running statistics) are saved and restored, non-persistent
ones are not; a buffer an axis split (it carries a placement record) saved on tensor=2
loads whole on one process; a format-2 checkpoint (no buffers) leaves the model's own,
with a warning; a format-3 one that lacks a buffer is another model's."""

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
from paraxis.config.parallel import AXES, ParallelConfig
from paraxis.parallel.placement import Placement, record_replicated, set_placement
from paraxis.runtime.grid import Grid
from paraxis.runtime.world import init_distributed


def _state(seed: int, grid: Grid, config: ParallelConfig | None = None) -> StateRecord:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.BatchNorm1d(3))
    model[2].register_buffer("scratch", torch.randn(3), persistent=False)
    record_replicated(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return StateRecord(model=model, optimizer=optimizer, grid=grid,
                       config=config or ParallelConfig(), step=7, data_state={"position": 42})


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


def split_buffer_saved_then_loaded(directory: str, tensor: int) -> torch.Tensor:
    """Save (tensor=2: each rank holds half of a 4-row buffer, with its record) or load
    (tensor=1: the whole buffer) the buffer ``2.split``; returns the buffer after it."""
    init_distributed()
    config = ParallelConfig.from_kwargs(tensor=tensor)
    grid = Grid.build(config)
    state = _state(0, grid, config)
    if tensor == 1:
        state.model[2].register_buffer("split", torch.zeros(4))
        load_checkpoint(state, directory)
    else:
        t = grid.coords["tensor"]
        local = torch.arange(10.0, 14.0)[2 * t:2 * t + 2].clone()
        whole = Placement("2.split", (4,), torch.float32,
                          replicated=tuple(a for a in AXES if a != "pipeline"))
        set_placement(local, whole.sharded(dim=0, axis="tensor", offset=2 * t, length=2))
        state.model[2].register_buffer("split", local)
        save_checkpoint(state, directory)
    grid.destroy()
    return state.model[2].split.clone()


def test_a_split_buffer_saved_on_two_ranks_loads_whole_on_one(worlds, tmp_path):
    halves = worlds.run(2, split_buffer_saved_then_loaded, str(tmp_path), 2)
    assert [h.tolist() for h in halves] == [[10.0, 11.0], [12.0, 13.0]]
    whole = worlds.run(1, split_buffer_saved_then_loaded, str(tmp_path), 1)[0]
    assert whole.tolist() == [10.0, 11.0, 12.0, 13.0]


def snapshot_sharing() -> tuple[int, int, int, bool]:
    from paraxis.checkpoint.write import snapshot

    init_distributed()
    grid = Grid.build(ParallelConfig())
    state = _state(0, grid)
    held = {t.data_ptr() for p in state.model.parameters()
            for t in (p, *state.optimizer.state[p].values()) if t.numel() > 1}
    synchronous = snapshot(state, copy=False)
    background = snapshot(state)
    shared = sum(t.data_ptr() in held for t in synchronous.tensors.values())
    copied = sum(t.data_ptr() in held for t in background.tensors.values())
    # Two views of one storage, the second overlapping the first: it must be copied
    # (safetensors refuses overlapping tensors), the first kept.
    flat = torch.arange(6.0)
    tied = nn.Sequential(nn.Linear(2, 3, bias=False), nn.Linear(3, 2, bias=False))
    tied[0].weight.data = flat.view(3, 2)
    tied[1].weight.data = flat.view(2, 3)
    record_replicated(tied)
    overlap = StateRecord(model=tied, optimizer=torch.optim.SGD(tied.parameters(), lr=0.1),
                          grid=grid, config=ParallelConfig(), step=1, data_state={})
    kept = snapshot(overlap, copy=False).tensors
    ptrs = [t.data_ptr() for k, t in kept.items() if k.startswith("model/")]
    grid.destroy()
    return shared, copied, len(held), ptrs.count(flat.data_ptr()) == 1


def test_the_synchronous_save_writes_host_tensors_without_copying_them(worlds):
    """The synchronous save keeps contiguous host tensors as they are (a copy doubled a
    CPU run's model state while it saved: the peak of a ZeRO-3 run, issue 36); the
    background save copies everything, since training goes on while it writes."""
    shared, copied, held, one_kept = worlds.run(1, snapshot_sharing)[0]
    assert shared == held > 0 and copied == 0
    assert one_kept
