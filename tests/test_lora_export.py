"""A LoRA run out (issue 34, items 2-3 and the example): ``examples/sft_lora.yaml``
(LoRA on attention and MLP through peft, data 2 x tensor 2) trained on the stand-ins
``examples/sft_chat.py`` writes, then ``paraxis checkpoint export-hf``: the merged model
(``from_pretrained``) and the adapter directory (``--adapter``: adapter_config.json and
adapter_model.safetensors, loaded by ``PeftModel.from_pretrained`` on the saved base)
each give the run's last eval loss on the same held-out rows within STEP_RTOL; the run
summary's trainable parameters are the adapters written, with their share of the model."""

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file
from test_sft_export import example_config as sft_example
from test_sft_export import held_out_loss

from paraxis.cli.main import main
from paraxis.config.run import LoraSection, RunConfig
from paraxis.testing.tolerance import STEP_RTOL

pytest.importorskip("peft")  # paraxis-hf[peft]

ROOT = Path(__file__).resolve().parents[1]
STEPS = 20  # the example's 60 steps are its own; the exports' agreement needs few


def example_config(root):
    return sft_example(root, "sft_lora.yaml", f"train.steps={STEPS}",
                       f"train.eval_every={STEPS}")


def train_example(cfg):
    from paraxis.train.loop import train

    summary = train(cfg)
    return summary["eval_loss"], summary["trainable_params"], summary["trainable_share"]


def test_the_lora_example_exports_merged_and_as_an_adapter(worlds, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from paraxis.train.data import load_tokenizer

    cfg = example_config(tmp_path)
    assert (cfg.degrees["data"], cfg.degrees["tensor"]) == (2, 2)
    run_eval, trainable, share = worlds.run(4, train_example, cfg)[0]
    ckpt, tok = str(tmp_path / "checkpoints"), load_tokenizer(cfg.data.tokenizer)
    assert main(["checkpoint", "export-hf", ckpt, str(tmp_path / "merged")]) == 0
    assert main(["checkpoint", "export-hf", "--adapter", ckpt, str(tmp_path / "lora")]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in (tmp_path / "lora").iterdir()}
    assert json.loads((tmp_path / "lora/adapter_config.json").read_text())["r"] == 8
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"))
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "lora")).eval()
    losses = [held_out_loss(exported, cfg, tok) for exported in (merged, adapted)]
    untrained = held_out_loss(AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "model")).eval(), cfg, tok)
    print(f"run {run_eval:.7f}, merged {losses[0]:.7f}, adapter {losses[1]:.7f}, "
          f"base {untrained:.7f}")
    for loss in losses:
        assert abs(loss - run_eval) <= STEP_RTOL * run_eval, (loss, run_eval)
    # The summary's trainable line: the adapters peft wrote, and their share of the model
    adapters = sum(t.numel() for t in load_file(tmp_path / "lora/adapter_model.safetensors")
                   .values())
    whole = sum(p.numel() for p in base.parameters())  # the base with its adapters now
    assert (trainable, share) == (adapters, adapters / whole), (trainable, share, adapters)
    assert abs(untrained - run_eval) > 100 * STEP_RTOL * run_eval, (untrained, run_eval)


def first_loss(cfg):
    from paraxis.train.loop import train

    history = []
    train(cfg, history=history)
    return history[0]["loss"], history[-1]["loss"]


def test_a_family_built_lora_model_starts_where_the_unwrapped_one_does(worlds, tmp_path):
    """``paraxis train`` of ``model.family`` builds on the meta device and draws each
    weight from (seed, name, element); peft renames the base weights
    (``….q_proj.base_layer.weight``) and B starts at zero, so the first loss is the
    unwrapped model's (paraxis_hf.lora_init.PeftMaterializer), and training moves it."""
    def config(lora):
        overrides = ["parallelism.data=1", "train.steps=2", "train.warmup_steps=1",
                     "train.global_batch=4", "train.seq_length=32",
                     "data.max_bytes=200000", "logging.wandb=false",
                     "logging.progress=false", f"train.checkpoint_dir={tmp_path}/{lora}"]
        cfg = RunConfig.load(ROOT / "examples/llama.yaml", overrides, env={})
        section = LoraSection(rank=4, target_modules=["q_proj", "v_proj"])
        return cfg.model_copy(update={"lora": section if lora else None})

    full, adapted = (worlds.run(1, first_loss, config(lora))[0] for lora in (False, True))
    assert abs(adapted[0] - full[0]) <= STEP_RTOL * full[0], (adapted, full)
    assert adapted[1] != adapted[0] and adapted[1] != full[1], (adapted, full)
