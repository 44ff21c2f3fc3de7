"""TensorBoard as a sink (issue 38): a run's event files read back with TensorBoard's own
reader hold the losses the run logged, the MoE heatmap and the pipeline timeline are
images, and a resumed run's curves show each step once."""

import json

import numpy as np
import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import (
    IMAGES,
    SCALARS,
    EventAccumulator,
)

from paraxis.config.run import RunConfig
from paraxis.testing import run_distributed
from paraxis_tensorboard import TensorBoardSink
from paraxis_tensorboard.pictures import load_heatmap, svg_picture


def read(directory):
    events = EventAccumulator(str(directory), size_guidance={SCALARS: 0, IMAGES: 0})
    events.Reload()
    return events


def config(tmp_path):
    return RunConfig.from_dict({
        "parallelism": {},
        "model": {"family": "tiny", "config": {"hidden_size": 32, "num_layers": 2,
                                               "num_heads": 4, "intermediate_size": 64}},
        "train": {"steps": 6, "global_batch": 4, "seq_length": 32, "warmup_steps": 2,
                  "log_every": 2},
        "data": {"max_bytes": 60_000},
        "logging": {"progress": False, "wandb": False, "dir": str(tmp_path / "run"),
                    "tensorboard": str(tmp_path / "tb")},
    })


def train_once(cfg):
    from paraxis.train.loop import train

    history = []
    train(cfg, history)
    return history


def test_a_run_reads_back_from_tensorboard_with_the_losses_it_logged(tmp_path):
    (history,) = run_distributed(train_once, 1, config(tmp_path))
    logged = [m for m in history if int(m["step"]) % 2 == 0]
    assert [int(m["step"]) for m in logged] == [2, 4, 6]
    # metrics.jsonl in the run's directory: every logged step, every metric, as reported
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text()
            .splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6]
    for row, metrics in zip(rows, logged, strict=True):
        assert row == {**metrics, "step": int(metrics["step"])}
    # TensorBoard stores scalars as float32: the same values, at that width
    events = read(tmp_path / "tb")
    losses = [(e.step, e.value) for e in events.Scalars("loss")]
    assert losses == [(int(m["step"]), float(np.float32(m["loss"]))) for m in logged]
    assert {"lr", "tokens_per_s", "step_time_s", "exposed_comm_s"} <= set(
        events.Tags()["scalars"])


MOE_STEP = {"loss": 4.0, "moe/aux_loss": 0.01,
            **{f"moe/model.layers.{i}.mlp/assigned/{e}": float(10 + 5 * e)
               for i in (0, 1) for e in range(4)}}
TIMELINE = ('<svg xmlns="http://www.w3.org/2000/svg" width="200" height="60">'
            '<text x="4" y="18">1f1b</text>'
            '<rect x="0" y="10" width="200" height="20" fill="#EEEEEE"/>'
            '<rect x="20" y="10" width="30" height="20" fill="#4C78A8" stroke="white">'
            '<title>F0</title></rect></svg>')


def test_moe_load_and_the_pipeline_timeline_are_images(tmp_path):
    heat = load_heatmap({"a": {"assigned": [0.0, 10.0, 20.0, 30.0]}})
    assert heat.shape == (24, 96, 3) and heat.dtype == np.uint8
    assert tuple(heat[5, 5]) == (255, 255, 255)  # no tokens: white
    assert tuple(heat[5, 24 * 3 + 5]) == (30, 90, 200)  # twice the mean (15) or more
    picture = svg_picture(TIMELINE)
    assert picture.shape == (60, 200, 3)
    assert tuple(picture[15, 30]) == (0x4C, 0x78, 0xA8) and tuple(picture[15, 100]) == (
        0xEE, 0xEE, 0xEE) and tuple(picture[50, 100]) == (255, 255, 255)
    assert svg_picture("not svg") is None

    sink = TensorBoardSink(tmp_path)
    sink.start(None, {}, 0)
    sink.metrics(1, MOE_STEP)
    sink.figure("pipeline_timeline", TIMELINE, 1)
    sink.end({"final_loss": 4.0})
    events = read(tmp_path)
    assert {"moe/load_heatmap", "pipeline_timeline"} <= set(events.Tags()["images"])
    (image,) = events.Images("pipeline_timeline")
    assert (image.width, image.height) == (200, 60)
    assert "moe/aux_loss" in events.Tags()["scalars"]
    assert not any("/assigned/" in tag for tag in events.Tags()["scalars"])


def test_a_resumed_run_shows_each_step_once(tmp_path):
    first = TensorBoardSink(tmp_path)
    first.start(None, {}, 0)
    for step in (1, 2, 3, 4):  # the run died after step 4; its checkpoint was step 2
        first.metrics(step, {"loss": float(step)})
    first.end(None)
    again = TensorBoardSink(tmp_path)
    again.start(None, {}, 2)
    for step in (3, 4):
        again.metrics(step, {"loss": 10.0 + step})
    again.end(None)
    losses = [(e.step, e.value) for e in read(tmp_path).Scalars("loss")]
    assert losses == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
