"""A ``lora:`` section that cannot apply is refused with one line per problem before any
process group (issue 34): a target module matching no module of the model (``paraxis
validate`` and ``paraxis train``), and a model peft already wrapped given to
``parallelize`` with a ``lora`` section (a second wrap would stack adapters). A section
that can apply wraps the model at ``parallelize`` as ``paraxis train`` does."""

from pathlib import Path

import pytest
import torch
import yaml

import paraxis
from paraxis.cli.main import main
from paraxis.config.errors import ConfigError
from paraxis.config.run import RunConfig

pytest.importorskip("peft")  # paraxis-hf[peft]

ROOT = Path(__file__).resolve().parents[1]
LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def llama_config(tmp_path, lora):
    """examples/llama.yaml with ``lora``, on 2 data ranks, written to ``tmp_path``."""
    text = (ROOT / "examples/llama.yaml").read_text()
    path = tmp_path / "lora.yaml"
    path.write_text(text.replace("${DATA_PARALLEL_DEGREE:-2}", "2")
                    + yaml.safe_dump({"lora": lora}))
    return path


@pytest.mark.parametrize("command", ["validate", "train"])
def test_a_target_matching_no_module_is_one_line_before_any_process(tmp_path, capsys,
                                                                    command):
    path = llama_config(tmp_path, {**LORA, "target_modules": ["q_proj", "qkv_proj"]})
    assert main([command, "--config", str(path)]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert "lora.target_modules = 'qkv_proj': matches no module of LlamaForCausalLM" in err[0]
    assert "q_proj" in err[0].partition("end in:")[2]  # the names the model has
    assert not torch.distributed.is_initialized()


def test_lora_on_a_model_peft_already_wrapped_is_refused_before_any_group():
    from peft import LoraConfig, get_peft_model

    from paraxis_hf.debug import build_debug_model

    model = get_peft_model(build_debug_model("llama"), LoraConfig(target_modules=["q_proj"]))
    config = RunConfig(lora=LORA)
    with pytest.raises(ConfigError) as refused:
        paraxis.parallelize(model, config=config, train={"steps": 1})
    assert len(refused.value.problems) == 1, refused.value
    assert "already a peft model" in str(refused.value), refused.value
    assert not torch.distributed.is_initialized()


def test_a_lora_section_wraps_the_model_at_parallelize(worlds):
    assert worlds.run(1, _trainable_after_parallelize)[0] == (
        ["lora_A", "lora_B"], 2 * 2 * 2)  # A and B of q and v in each of 2 layers


def _trainable_after_parallelize():
    from paraxis_hf.debug import build_debug_model

    model = build_debug_model("llama")
    engine = paraxis.parallelize(model, config=RunConfig(lora=LORA), train={"steps": 1})
    trainable = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    return sorted({n.split(".")[-3] for n in trainable}), len(trainable)


def _ia3():
    from peft import IA3Config

    return IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                     feedforward_modules=["down_proj"])


def _dora():
    from peft import LoraConfig

    return LoraConfig(target_modules=["q_proj"], use_dora=True)


def _on_experts():
    from peft import LoraConfig

    return LoraConfig(target_modules=["q_proj"], target_parameters=["experts.gate_up_proj"])


@pytest.mark.parametrize(("family", "peft_config", "degrees", "reason"), [
    ("llama", _ia3, {}, "is IA3, not LoRA"),
    ("llama", _dora, {"tensor": 2}, "q_proj is a LoRA variant (DoRA...)"),
    ("mixtral", _on_experts, {}, "mlp.experts: LoRA on routed experts"),
], ids=["other-peft-method", "dora-under-tensor", "lora-on-routed-experts"])
def test_what_paraxis_cannot_place_is_refused_before_any_group(family, peft_config,
                                                               degrees, reason):
    from peft import get_peft_model

    from paraxis_hf.debug import build_debug_model

    model = get_peft_model(build_debug_model(family), peft_config())
    with pytest.raises(ValueError) as refused:  # ConfigError or PlanError
        paraxis.parallelize(model, config=RunConfig.from_kwargs(**degrees),
                            train={"steps": 1})
    assert reason in str(refused.value), refused.value
    assert not torch.distributed.is_initialized()


def test_a_lora_run_resumes_through_paraxis_train(tmp_path):
    """The checks before any rank read the checkpoint against the model the run builds,
    wrapped by peft (its names): a LoRA run resumes, and its steps after the checkpoint
    are those of the run that never stopped (metrics.jsonl's losses)."""
    import json
    import shutil

    path = llama_config(tmp_path, LORA)
    args = ["train", "--config", str(path), "parallelism.data=1", "train.steps=4",
            "train.warmup_steps=1", "train.global_batch=4", "train.seq_length=32",
            "train.checkpoint_every=2", "train.log_every=1", "data.max_bytes=200000",
            "logging.wandb=false", "logging.progress=false"]
    ckpt = tmp_path / "ckpt"
    assert train_here([*args, f"train.checkpoint_dir={ckpt}"]) == 0
    straight = [json.loads(line) for line in (ckpt / "metrics.jsonl").open()]
    shutil.rmtree(ckpt / "step-00000004")  # as if the run had stopped after step 2
    (ckpt / "latest").write_text("step-00000002")
    (ckpt / "metrics.jsonl").unlink()
    assert train_here([*args, f"train.checkpoint_dir={ckpt}"]) == 0
    resumed = [json.loads(line) for line in (ckpt / "metrics.jsonl").open()]
    losses = {m["step"]: m["loss"] for m in straight if "loss" in m}
    again = {m["step"]: m["loss"] for m in resumed if "loss" in m}
    assert sorted(again) == [3, 4] and all(again[s] == losses[s] for s in again), (
        again, losses)


def train_here(args):
    """``paraxis train`` as a user starts it: its own process, stdout to a file. Run in
    the test's process it forks its workers from a pytest worker that already holds
    threads from earlier tests, and a fork of such a process may hang (seen here)."""
    import subprocess
    import sys

    log = Path(args[args.index("--config") + 1]).parent / "train.out"
    with log.open("a") as out:
        code = subprocess.run([sys.executable, "-m", "paraxis", *args], stdout=out,
                              stderr=subprocess.STDOUT, timeout=240).returncode
    if code:
        print(log.read_text()[-4000:])  # shown with the failure
    return code
