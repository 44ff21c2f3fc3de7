"""train.precision, fp16's loss scaler and train.optimizer, without processes: the
schedule of the scale, what is refused before any process group, and the optimizer's
state size the planner uses."""

import pytest
import torch

import paraxis
from paraxis.config.errors import ConfigError
from paraxis.config.parallel import ParallelConfig
from paraxis.config.run import LossScaling, TrainSection
from paraxis.engine.precision import LossScaler, precision_problems
from paraxis.models.tiny import TinyConfig, TinyTransformer
from paraxis.parallel.optimizers import (
    make_optimizer,
    optimizer_problems,
    optimizer_state_bytes,
)


def test_loss_scale_backs_off_on_overflow_and_grows_after_clean_steps():
    scaler = LossScaler(LossScaling(initial=8.0, growth_interval=2, min_scale=2.0))
    seen = []
    for overflow in (False, True, False, False, False, True, True, True):
        scaler.update(overflow)
        seen.append(scaler.scale)
    assert seen == [8.0, 4.0, 4.0, 8.0, 8.0, 4.0, 2.0, 2.0]  # never below min_scale
    assert scaler.skipped == 4
    restored = LossScaler(LossScaling())
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()


def test_bf16_true_is_precision_bf16_and_cannot_say_fp16_too():
    assert TrainSection(bf16=True).precision == "bf16"
    with pytest.raises(ValueError, match="keep one"):
        TrainSection(bf16=True, precision="fp16")


class Shampooish(torch.optim.Optimizer):
    """Stands for an optimizer that needs whole matrices (not declared elementwise)."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        return None


def test_whole_matrix_optimizers_are_refused_where_slices_reach_them():
    name = f"{__name__}:Shampooish"
    sharded = ParallelConfig.from_kwargs(tensor=2)
    said = " ".join(p.rule for p in optimizer_problems(TrainSection(optimizer=name), sharded))
    assert "whole matrices" in said and "tensor 2" in said
    zero = ParallelConfig.from_kwargs(data=2, zero=1)
    assert optimizer_problems(TrainSection(optimizer=name), zero)
    assert not optimizer_problems(TrainSection(optimizer=name),
                                  ParallelConfig.from_kwargs(data=2))
    assert not optimizer_problems(TrainSection(optimizer="sgd"), zero)
    assert not optimizer_problems(TrainSection(optimizer="torch.optim.RAdam"), sharded)


def test_bad_optimizer_names_and_arguments_are_named():
    cfg = ParallelConfig()
    [p] = optimizer_problems(TrainSection(optimizer="torch.optim.NoSuch"), cfg)
    assert "cannot import" in p.rule
    [p] = optimizer_problems(TrainSection(optimizer="math.sqrt"), cfg)
    assert "not a torch.optim.Optimizer" in p.rule
    [p] = optimizer_problems(TrainSection(optimizer="sgd",
                                          optimizer_kwargs={"betas": (0.9, 0.9)}), cfg)
    assert "SGD takes no betas" in p.rule


def test_parallelize_refuses_before_any_process_group():
    model = TinyTransformer(TinyConfig(vocab_size=64, hidden_size=32, num_layers=1,
                                       num_heads=2, intermediate_size=64))
    with pytest.raises(ConfigError, match="cannot import"):
        paraxis.parallelize(model, train={"optimizer": "nowhere.Adam"})

    class OwnsItsStep(torch.optim.SGD):
        clips_in_step = True

    mine = OwnsItsStep(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="cannot skip an overflowed step"):
        paraxis.parallelize(model, optimizer=mine, train={"precision": "fp16"})
    assert not torch.distributed.is_initialized()
    assert precision_problems(TrainSection(precision="fp16"), mine)
    assert not precision_problems(TrainSection(precision="bf16"), mine)


def test_optimizer_state_is_measured_per_element():
    assert optimizer_state_bytes(TrainSection()) == 8.0  # AdamW: two fp32 moments
    assert optimizer_state_bytes(TrainSection(optimizer="sgd")) == 4.0  # momentum
    assert optimizer_state_bytes(TrainSection(optimizer="sgd",
                                              optimizer_kwargs={"momentum": 0.0})) == 0.0


def test_matrices_decay_and_vectors_do_not_whatever_the_optimizer():
    params = [torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))]
    opt = make_optimizer(params, TrainSection(optimizer="sgd", weight_decay=0.1, lr=0.5))
    assert [(len(g["params"]), g["weight_decay"]) for g in opt.param_groups] == [
        (1, 0.1), (1, 0.0)]
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[0]["lr"] == 0.5
