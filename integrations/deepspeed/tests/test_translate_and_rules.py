"""The generated DeepSpeed config and the bridge's validation, without processes."""

import json

import pytest

from paraxis import ConfigError, ParallelConfig, make_plugin_manager, validate
from paraxis.cli.main import main
from paraxis.config.run import TrainSection
from paraxis.engine.resolve import required_axes
from paraxis_deepspeed import deepspeed_config, rules, version

OFFLOAD3 = {"optimizer": "cpu", "parameters": "cpu"}


def test_translation_carries_stage_offload_buckets_accumulation_and_adamw():
    cfg = ParallelConfig.from_kwargs(data=2, zero=3, microbatches=4, offload=OFFLOAD3)
    train = TrainSection(global_batch=32, lr=2e-4, betas=(0.9, 0.98), weight_decay=0.05,
                         grad_clip=0.7, bf16=True)
    ds = deepspeed_config(cfg, train, hidden_size=64)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "cpu"
    assert zero["offload_param"]["device"] == "cpu"
    # transformers' "auto" rules, from the hidden size
    assert zero["reduce_bucket_size"] == 64 * 64
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert zero["stage3_param_persistence_threshold"] == 10 * 64
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["train_micro_batch_size_per_gpu"] == 32 // (2 * 4)
    assert ds["train_batch_size"] == 4 * 4 * 2
    assert ds["gradient_clipping"] == 0.7 and ds["bf16"] == {"enabled": True}
    assert ds["optimizer"] == {"type": "AdamW", "params": {
        "lr": 2e-4, "betas": [0.9, 0.98], "eps": 1e-8, "weight_decay": 0.05}}
    assert "scheduler" not in ds  # paraxis's WarmupCosine drives the rate


def test_fp16_becomes_deepspeeds_dynamic_scaler_and_bf16_reduction_its_comm_dtype():
    cfg = ParallelConfig.from_kwargs(data=2, zero=2, offload={"optimizer": "cpu"},
                                     reduce_dtype="bf16")
    train = TrainSection(precision="fp16", loss_scale={"initial": 2.0**12,
                                                       "growth_interval": 50})
    ds = deepspeed_config(cfg, train)
    assert ds["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                          "loss_scale_window": 50, "hysteresis": 1, "min_loss_scale": 1.0}
    assert ds["bf16"] == {"enabled": False}
    assert ds["communication_data_type"] == "bf16"
    assert "communication_data_type" not in deepspeed_config(
        ParallelConfig.from_kwargs(data=2, zero=2, offload={"optimizer": "cpu"}), train)


def test_what_deepspeed_cannot_express_is_refused_before_any_rank(tmp_path):
    from paraxis_deepspeed.translate import train_problems

    assert train_problems(TrainSection(precision="fp16")) == []
    said = " ".join(p.rule for p in train_problems(TrainSection(
        optimizer="sgd", precision="fp16", loss_scale={"backoff_factor": 0.25})))
    assert "AdamW" in said and "halves" in said
    path = tmp_path / "run.yaml"  # the CLI reports them with the config's problems
    path.write_text("parallelism: {data: 2, zero: 2, offload: {optimizer: cpu}}\n"
                    "train: {global_batch: 8, optimizer: sgd}\n")
    assert main(["validate", "--config", str(path)]) == 1


def test_stage2_has_no_stage3_keys_and_nvme_carries_its_path():
    cfg = ParallelConfig.from_kwargs(data=2, zero=2, offload={"optimizer": "cpu"})
    zero = deepspeed_config(cfg, TrainSection(), hidden_size=32)["zero_optimization"]
    assert "offload_param" not in zero and "stage3_prefetch_bucket_size" not in zero
    nvme = ParallelConfig.from_kwargs(data=2, zero=3, offload={
        "optimizer": "nvme", "parameters": "nvme", "nvme_path": "/mnt/nvme"})
    zero = deepspeed_config(nvme, TrainSection())["zero_optimization"]
    assert zero["offload_param"] == {"device": "nvme", "pin_memory": False,
                                     "nvme_path": "/mnt/nvme"}
    assert "reduce_bucket_size" not in zero  # no model: DeepSpeed's defaults


def test_offload_requires_the_bridge_axis():
    assert required_axes(ParallelConfig.from_kwargs(data=2, zero=2,
                                                    offload={"optimizer": "cpu"})) == ["offload"]


def problems(**kwargs):
    with pytest.raises(ConfigError) as err:
        validate(ParallelConfig.from_kwargs(**kwargs), plugin_manager=make_plugin_manager())
    return str(err.value)


def test_offload_with_zero_0_is_refused():
    assert "parallelism.zero = 0: must be a ZeRO stage" in problems(
        data=2, offload={"optimizer": "cpu"})


def test_parameters_need_stage_3_and_pipeline_expert_are_refused():
    text = problems(data=2, zero=2, offload=OFFLOAD3)
    assert "parallelism.offload.parameters = 'cpu': needs ZeRO-3" in text
    text = problems(data=2, zero=3, pipeline=2, microbatches=2, offload=OFFLOAD3)
    assert "parallelism.pipeline = 2: cannot combine with offload" in text
    assert "paraxis's pipeline runner drives each stage's backward" in text


def test_sequence_parallelism_is_refused():
    # Which norms' gradients are partial sums is decided at the first backward, after
    # DeepSpeed has already reduced them (tests/test_offload_tensor_parallel.py trained
    # with SP drifted 3.7e-4 from paraxis's own run before this rule).
    text = problems(data=2, tensor=2, zero=2, sequence_parallel=True,
                    offload={"optimizer": "cpu"})
    assert "parallelism.sequence_parallel = True: cannot combine with offload" in text


def test_nvme_without_a_path_or_with_an_unwritable_one(tmp_path, monkeypatch):
    monkeypatch.setattr(rules, "aio_problem", lambda: None)
    text = problems(data=2, zero=3, offload={"optimizer": "nvme"})
    assert "nvme_path = None: must name a directory" in text
    locked = tmp_path / "ro"
    locked.mkdir(mode=0o500)
    missing = tmp_path / "nowhere"
    for path in (missing,) + ((locked,) if not _root() else ()):
        text = problems(data=2, zero=3, offload={"optimizer": "nvme", "nvme_path": str(path)})
        assert f"nvme_path = '{path}': is not a writable directory" in text


def _root():
    import os

    return os.geteuid() == 0  # root writes anywhere: the read-only case cannot fail


def test_nvme_without_libaio_names_the_system_package(tmp_path, monkeypatch):
    from deepspeed.ops.op_builder import AsyncIOBuilder

    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    text = problems(data=2, zero=3, offload={"optimizer": "nvme", "nvme_path": str(tmp_path)})
    assert "system package libaio-dev (libaio) is missing" in text
    assert "apt-get install libaio-dev" in text


def test_deepspeed_outside_the_supported_range(monkeypatch):
    monkeypatch.setattr(version, "installed_version", lambda: "0.14.2")
    monkeypatch.setattr(rules, "installed_version", lambda: "0.14.2")
    text = problems(data=2, zero=2, offload={"optimizer": "cpu"})
    assert "deepspeed = '0.14.2': is outside the range the bridge supports" in text
    assert "pip install 'deepspeed>=0.19.8,<0.20'" in text
    monkeypatch.setattr(rules, "installed_version", lambda: None)
    assert "pip install 'deepspeed>=0.19.8,<0.20'" in problems(
        data=2, zero=2, offload={"optimizer": "cpu"})
    assert version.supported("0.19.8") and version.supported("0.19.10+cpu")
    assert not version.supported("0.20.0") and not version.supported("0.19.7")


def test_validate_show_deepspeed_prints_the_generated_dict(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("parallelism: {data: 2, zero: 3, offload: {optimizer: cpu, "
                    "parameters: cpu}}\nschedule: {microbatches: 2}\nmodel: {family: tiny, "
                    "config: {hidden_size: 48, num_heads: 4}}\ntrain: {global_batch: 8}\n")
    assert main(["validate", "--config", str(path), "--world-size", "2",
                 "--show-deepspeed"]) == 0
    out = capsys.readouterr().out
    generated = json.loads(out[out.index("{"):])
    assert generated["zero_optimization"]["reduce_bucket_size"] == 48 * 48
    assert generated["gradient_accumulation_steps"] == 2


def test_a_slow_extension_build_is_announced_until_done(monkeypatch):
    import time

    from paraxis_deepspeed import ops

    class SlowBuilder:
        name = "cpu_adam"

        def load(self, verbose=False):
            time.sleep(0.5)

    monkeypatch.setattr(ops, "_builders", lambda: [SlowBuilder()])
    monkeypatch.setattr(ops, "QUIET_S", 0.05)
    monkeypatch.setattr(ops, "HEARTBEAT_S", 0.1)
    said = []
    ops.build_ops(said.append)
    time.sleep(0.2)  # the announcer's last line
    assert said[0].startswith("paraxis-deepspeed: building DeepSpeed's cpu_adam")
    assert any("still compiling cpu_adam" in s for s in said)
    assert said[-1].startswith("paraxis-deepspeed: cpu_adam ready after")
