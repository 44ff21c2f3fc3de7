"""The W&B logger never stops training: offline runs, failures, and switching off."""

import time

import pytest

from paraxis.config.run import RunConfig
from paraxis_wandb import WandbLogger


def config(**logging):
    return RunConfig.from_dict({"logging": {"run_name": "unit", **logging}})


def test_offline_run_records_config_metrics_and_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    logger = WandbLogger()
    logger.start(config(), {"degrees": {"data": 2}, "rank": 0})
    assert logger.run is not None
    logger.metrics(1, {"loss": 5.0, "tokens_per_s": 1000.0})
    logger.end({"final_loss": 4.0})
    (record,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    keys = (b"tokens_per_s", b"final_loss", b"degrees", b"unit")
    # W&B's writer is another process: finish() can return before the last records
    # reach the file (seen on a loaded machine), so wait for them, briefly.
    deadline = time.monotonic() + 30
    while not all(k in record.read_bytes() for k in keys) and time.monotonic() < deadline:
        time.sleep(0.2)
    data = record.read_bytes()
    for key in keys:
        assert key in data, key


def test_switched_off_opens_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    logger = WandbLogger()
    logger.start(config(wandb=False), {})
    assert logger.run is None
    logger.metrics(1, {"loss": 1.0})  # no-ops, no errors
    logger.end({})
    assert not (tmp_path / "wandb").exists()


class _Broken:
    def log(self, *a, **k):
        raise ConnectionError("unreachable")


def test_a_failing_service_disables_logging_once(caplog):
    logger = WandbLogger()
    logger.run = _Broken()
    logger.metrics(3, {"loss": 1.0})
    assert logger.run is None
    assert "logging disabled" in caplog.text
    logger.metrics(4, {"loss": 1.0})  # stays quiet and off


def test_init_failure_falls_back_to_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    real_init, modes = wandb.init, []

    def flaky_init(*args, mode=None, **kwargs):
        modes.append(mode)
        if mode is None:
            raise TimeoutError("no route to api.wandb.ai")
        return real_init(*args, mode=mode, **kwargs)

    monkeypatch.setattr(wandb, "init", flaky_init)
    logger = WandbLogger()
    logger.start(config(), {})
    assert modes == [None, "offline"] and logger.run is not None
    logger.end({})


MOE_STEP = {
    "loss": 4.0, "moe/aux_loss": 0.002, "moe/load_imbalance": 1.5,
    **{f"moe/model.layers.{i}.mlp/{kind}/{e}": float(10 * (i + 1) + e)
       for i in (0, 1, 10) for kind in ("assigned", "accepted", "dropped", "processed",
                                        "dispatch_bytes", "compute_s", "prob_mean")
       for e in range(4)},
    **{f"moe/model.layers.0.mlp/prob_hist/{b}": 1.0 for b in range(10)},
}


def test_moe_arrays_become_a_table_and_a_heatmap(tmp_path, monkeypatch):
    from paraxis_wandb.moe import heatmap_svg, split_moe_arrays, table_rows

    scalars, arrays = split_moe_arrays(MOE_STEP)
    assert set(scalars) == {"loss", "moe/aux_loss", "moe/load_imbalance"}
    assert list(arrays) == ["model.layers.0.mlp", "model.layers.1.mlp", "model.layers.10.mlp"]
    assert arrays["model.layers.1.mlp"]["assigned"] == [20.0, 21.0, 22.0, 23.0]
    assert len(arrays["model.layers.0.mlp"]["prob_hist"]) == 10
    columns, rows = table_rows(arrays)
    assert columns[:3] == ["layer", "expert", "assigned"] and len(rows) == 12
    svg = heatmap_svg(arrays, title="t")
    assert svg.startswith("<svg") and svg.count("<rect") == 12 and "13 1.13x" in svg

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    logger = WandbLogger()
    logger.start(config(), {})
    logger.metrics(1, MOE_STEP)
    assert logger.run is not None  # logging the panels did not fail
    logger.end({})
    (run,) = tmp_path.glob("wandb/offline-run-*")
    assert list(run.glob("files/media/table/moe/experts_*.table.json"))
    (picture,) = run.glob("files/media/html/moe/load_heatmap_*.html")
    assert "model.layers.10.mlp" in picture.read_text()


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    """The run id is kept beside the checkpoints: a run resuming from them logs into the
    same W&B run; one that starts afresh (train.resume: false) gets a new one."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    ckpt = tmp_path / "ckpt"

    def run_id(resume=True):
        cfg = RunConfig.from_dict({"logging": {"run_name": "unit"},
                                   "train": {"checkpoint_dir": str(ckpt), "resume": resume}})
        logger = WandbLogger()
        logger.start(cfg, {})
        assert logger.run is not None
        rid = logger.run.id
        logger.end({})
        return rid

    first = run_id()
    assert (ckpt / "wandb-run-id").read_text().strip() == first
    assert run_id() == first
    assert run_id(resume=False) != first
