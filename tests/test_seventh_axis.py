"""A seventh axis, added without editing core (issue 33): a package written from the
recipe of docs/architecture.md ("Adding an axis") in a temporary directory registers a
grid axis and its strategy through core's hooks, and a run with it trains the model one
process trains. The axis holds distinct samples (role ``samples``, like data): core
derives from its table entry alone where it sits in the mesh, that the batch is split
over it, that gradients are averaged over it and that one of its ranks writes a
checkpoint's replicated tensors."""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
from pathlib import Path

import torch

import paraxis
from paraxis import ParallelConfig
from paraxis.engine.plugins import make_plugin_manager
from paraxis.models.tiny import TinyConfig, TinyTransformer
from paraxis.testing.parity import local_shards, random_token_shares
from paraxis.testing.tolerance import STEP_RTOL, assert_losses_close, assert_sgd_weights_close

PYPROJECT = """\
[project]
name = "paraxis-toy"
version = "0.1.0"
dependencies = ["paraxis"]

[project.entry-points.paraxis]
toy = "paraxis_toy._plugin"
"""

PLUGIN = '''\
"""paraxis-toy: a grid axis whose ranks hold distinct samples."""

from paraxis.config.axes import AxisSpec
from paraxis.parallel.hookspecs import hookimpl
from paraxis.parallel.strategy import Phase, Strategy


class ToyStrategy(Strategy):
    axis = "toy"
    phase = Phase.PARTITION
    order = 5  # first in its phase: it rewrites nothing

    def apply(self, model, ctx):
        ctx.extras["toy"] = ctx.grid.group("toy").size
        return model


@hookimpl
def paraxis_register_axes(register):
    register(AxisSpec("toy", mesh=150, role="samples", package="paraxis-toy"))


@hookimpl
def paraxis_register_strategies(register):
    register(ToyStrategy)
'''

LR, STEPS, BATCH, SEQ = 0.1, 3, 4, 16
CFG = TinyConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                 intermediate_size=64, seq_length=SEQ)


def write_package(root: Path) -> Path:
    """The recipe: a pyproject naming the plugin in the ``paraxis`` entry points, and the
    plugin registering the axis and its strategy."""
    (root / "paraxis_toy").mkdir(parents=True)
    (root / "pyproject.toml").write_text(PYPROJECT)
    (root / "paraxis_toy" / "__init__.py").write_text("")
    (root / "paraxis_toy" / "_plugin.py").write_text(textwrap.dedent(PLUGIN))
    return root


def train_with_toy(root: str, degree: int, save: str | None = None):
    """Train on a world of ``degree`` toy ranks (one process for degree 1). The plugin
    module goes to the plugin manager as an installed entry point would hand it."""
    sys.path.insert(0, root)
    plugin = importlib.import_module("paraxis_toy._plugin")
    pm = make_plugin_manager(plugins=(plugin,))
    torch.manual_seed(0)
    model = TinyTransformer(CFG)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = ParallelConfig.from_kwargs(axes={"toy": degree})
    engine = paraxis.parallelize(model, config=config, plugin_manager=pm, train={
        "optimizer": "sgd", "lr": LR, "warmup_steps": 0, "steps": STEPS, "grad_clip": 0.0,
        "seq_length": SEQ})
    shares = random_token_shares(engine, steps=STEPS, batch=BATCH, seq=SEQ,
                                 vocab=CFG.vocab_size)
    losses = [engine.train_step(share)["loss"] for share in shares]
    if save:
        engine.save(save)
    out = (losses, {k: v for k, (v, _) in local_shards(engine.model).items()}, initial,
           engine.ctx.extras.get("toy"), engine.grid.describe())
    engine.close()
    return out


def test_a_seventh_axis_written_from_the_recipe_trains_as_one_process(worlds, tmp_path):
    root = str(write_package(tmp_path / "toy"))
    (ref_losses, ref_weights, initial, _, _), = worlds.run(1, train_with_toy, root, 1)
    out = worlds.run(2, train_with_toy, root, 2, str(tmp_path / "ckpt"))
    for losses, weights, _, applied, described in out:
        assert list(described["degrees"])[:2] == ["pipeline", "toy"]  # its mesh place
        assert described["degrees"]["toy"] == 2 and applied == 2
        assert_losses_close(losses, ref_losses)  # the batch split over toy, averaged back
        assert_sgd_weights_close(weights, ref_weights, initial, rtol=STEP_RTOL, steps=STEPS)
    # One toy rank writes each replicated tensor (coordinate 0 on every axis it is
    # replicated over, toy included): every piece of the index but the per-rank random
    # generators comes from rank 0's file.
    ckpt = tmp_path / "ckpt"
    index = json.loads((ckpt / (ckpt / "latest").read_text().strip() / "index.json")
                       .read_text())
    files = {s["file"] for name, entry in index["tensors"].items()
             if not name.startswith("rng/") for s in entry["shards"]}
    assert files == {"rank00000.safetensors"}, files
    assert index["grid"]["degrees"]["toy"] == 2


def test_an_axis_no_package_registers_is_refused_with_the_nearest_name():
    from paraxis.config.errors import ConfigError
    from paraxis.config.rules import validate

    config = ParallelConfig.from_kwargs(axes={"tensr": 2})
    try:
        validate(config, world_size=2)
    except ConfigError as err:
        (problem,) = [p for p in err.problems if p.field == "parallelism.axes.tensr"]
        assert "did you mean 'tensor'" in problem.fix, problem
    else:
        raise AssertionError("an unknown axis was accepted")
