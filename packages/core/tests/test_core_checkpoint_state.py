"""The checkpoint format written and read without an Engine: any TrainState will do."""

import torch
from torch import nn

from paraxis.checkpoint import StateRecord, load_checkpoint, read_model_tensors, save_checkpoint
from paraxis.config.parallel import ParallelConfig
from paraxis.parallel.placement import record_replicated
from paraxis.runtime.grid import Grid
from paraxis.runtime.world import init_distributed


def _state(seed: int, grid: Grid) -> StateRecord:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
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
    path = save_checkpoint(saved, directory)
    fresh = _state(1, grid)
    restored = load_checkpoint(fresh, directory)
    same_weights = all(torch.equal(a, b) for a, b in zip(
        saved.model.parameters(), fresh.model.parameters(), strict=True))
    same_state = all(torch.equal(saved.optimizer.state[a]["exp_avg"],
                                 fresh.optimizer.state[b]["exp_avg"])
                     for a, b in zip(saved.model.parameters(), fresh.model.parameters(),
                                     strict=True))
    _, tensors = read_model_tensors(path)
    grid.destroy()
    return same_weights, same_state, restored.step, restored.data_state, sorted(tensors)


def test_any_train_state_saves_and_restores(worlds, tmp_path):
    weights, state, step, data, names = worlds.run(1, save_and_restore, str(tmp_path))[0]
    assert weights and state
    assert (step, data) == (7, {"position": 42})  # handed back, not written into the state
    assert names == ["0.bias", "0.weight", "1.bias", "1.weight"]
