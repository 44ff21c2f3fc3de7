"""ZeRO-3 offload constructs the model partitioned (``deepspeed.zero.Init``), through
the trainer's ``paraxis_model_context``, and trains it: the partitions hold a share
of each weight, placements keep the global shapes, and the losses are those of paraxis's
reference run of the same model on the same data."""

from pathlib import Path

import torch
import torch.distributed as dist

import paraxis
from paraxis.config.run import RunConfig
from paraxis.engine.plugins import make_plugin_manager
from paraxis.parallel.placement import placement_of
from paraxis.testing.tolerance import assert_losses_close
from paraxis.train.loop import build_model, train

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "offload.yaml"
OVERRIDES = ["model.config.hidden_size=32", "model.config.num_layers=2",
             "model.config.intermediate_size=64", "train.steps=4", "train.warmup_steps=1",
             "train.seq_length=16", "train.global_batch=8", "data.max_bytes=60000",
             "logging.wandb=false", "logging.progress=false", "train.log_every=1"]


def config(*extra):
    return RunConfig.load(EXAMPLE, [*OVERRIDES, *extra],
                          env={"DATA_PARALLEL_DEGREE": str(dist.get_world_size())})


def partitioned_then_trained():
    cfg = config()
    pm = make_plugin_manager()
    spec = cfg.model.model_copy(update={"config": {**cfg.model.config, "vocab_size": 256,
                                                   "seq_length": 16}})
    context = pm.hook.paraxis_model_context(config=cfg)
    assert context is not None
    with context:
        model = build_model(spec, pm, seed=0)
    held = {n: (tuple(p.ds_shape), p.ds_tensor.numel()) for n, p in model.named_parameters()}
    engine = paraxis.parallelize(model, config=cfg, train=cfg.train, plugin_manager=pm,
                                 verify=False)
    shapes = {placement_of(p).name: placement_of(p).global_shape
              for p in engine.model.parameters()}
    engine.close()
    history = []
    train(cfg, history)
    return held, shapes, [m["loss"] for m in history]


def reference():
    history = []
    train(config("parallelism.zero=0", "parallelism.offload.optimizer=none",
                 "parallelism.offload.parameters=none"), history)
    return [m["loss"] for m in history]


def test_zero3_offload_builds_the_model_partitioned_and_trains_it(worlds):
    (held, shapes, losses), _ = worlds.run(2, partitioned_then_trained)
    ref = worlds.run(1, reference)[0]
    big = {n: v for n, v in held.items() if torch.Size(v[0]).numel() > 10 * 32}
    assert big, held
    for name, (shape, local) in big.items():
        assert local <= -(-torch.Size(shape).numel() // 2), (name, shape, local)
        assert shapes[name] == shape
    assert_losses_close(losses, ref)
