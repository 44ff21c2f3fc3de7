"""``paraxis plan --lora-rank`` (issue 34, item 4): a LoRA run's model state counted
trainable and frozen (frozen weights: no gradient, no optimizer state), checked against
the layout built for it on the meta device (``--dry-run``: the model wrapped by peft,
placed by every axis as the run places it).

A 0.1B Llama (hidden 768, 12 layers, vocab 32000: 134M parameters) with rank-8 adapters
on every linear layer of its layers, under ZeRO-3 over data 4: each rank's model-state
bytes as laid out within 2% of the plan (the dry run's bound), and below 0.3x those of
full fine-tuning of the same layout. A target no layer has is one line, exit 1."""

import json

import pytest

from paraxis.cli.main import main

pytest.importorskip("peft")  # paraxis-hf[peft]: the dry run wraps the model

LLAMA_100M = {"model_type": "llama", "hidden_size": 768, "intermediate_size": 2048,
              "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 12,
              "vocab_size": 32000, "max_position_embeddings": 2048,
              "tie_word_embeddings": False}
LAYOUT = ["--data", "4", "--zero", "3", "--precision", "bf16", "--seq", "256",
          "--global-batch", "8"]
STATE = ("parameters", "gradients", "optimizer")


def plan(capsys, model, *extra):
    assert main(["plan", "--model", str(model), *LAYOUT, *extra, "--dry-run", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def measured_state(out, rank=0):
    """Model-state bytes of ``rank`` as the dry run laid it out."""
    return sum(r["measured"] for r in out["dry_run"]["rows"]
               if r["rank"] == rank and r["term"] in STATE)


def test_lora_model_state_is_planned_and_below_a_third_of_full_fine_tuning(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_100M))
    lora = plan(capsys, tmp_path, "--lora-rank", "8")
    full = plan(capsys, tmp_path)
    assert lora["dry_run"]["ok"], lora["dry_run"]  # every term within 2% of the plan
    assert lora["model"]["trainable"] < 0.02 * lora["model"]["parameters"], lora["model"]
    for rank in {r["rank"] for r in lora["dry_run"]["rows"]}:
        planned = sum(r["planned"] for r in lora["dry_run"]["rows"]
                      if r["rank"] == rank and r["term"] in STATE)
        got = measured_state(lora, rank)
        print(f"rank {rank}: LoRA model state {got:,.0f} bytes measured, {planned:,.0f} "
              f"planned; full fine-tuning {measured_state(full, rank):,.0f}")
        assert abs(got - planned) <= 0.02 * planned, (got, planned)
        assert got < 0.3 * measured_state(full, rank), (got, measured_state(full, rank))


def test_a_lora_target_no_layer_has_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_100M, "num_hidden_layers": 2}))
    assert main(["plan", "--model", str(tmp_path), *LAYOUT, "--lora-rank", "8",
                 "--lora-targets", "q_proj,qkv"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lora.target_modules = 'qkv': matches no module" in err[0], err


def test_the_lora_example_dry_run_agrees_with_its_plan_over_tensor_2(tmp_path, capsys):
    """examples/sft_lora.yaml (data 2 x tensor 2): an adapter's side its base does not
    split is whole on every tensor rank, and the plan counts it so."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("sft_chat", root / "examples/sft_chat.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.write_stand_ins(tmp_path, rows=40)
    assert main(["train", "--config", str(root / "examples/sft_lora.yaml"), "--dry-run",
                 "--json", f"model.pretrained={tmp_path}/model",
                 f"data.source={tmp_path}/chat.jsonl",
                 f"data.tokenizer={tmp_path}/tokenizer"]) == 0
    text = capsys.readouterr().out
    out = json.loads(text[text.index("{"):])  # after the stand-ins' line
    assert out["model"]["lora_rank"] == 8 and out["dry_run"]["ok"], out["dry_run"]


TINY = {**LLAMA_100M, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256}


def _bytes_moved(zero):
    """One LoRA step under ZeRO-``zero`` over data 2: this rank's data-axis bytes."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    import paraxis

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(LlamaConfig(**TINY)),
                           LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    engine = paraxis.parallelize(model, data=2, zero=zero,
                                 train={"steps": 1, "seq_length": 32, "global_batch": 4})
    metrics = engine.train_step(torch.randint(0, 256, (2, 32)))
    engine.close()
    return sum(v for k, v in metrics.items() if k.startswith("comm/") and k.endswith("_bytes"))


@pytest.mark.parametrize("zero", [1, 3])
def test_the_plan_moves_the_adapters_gradients_only(tmp_path, capsys, zero):
    """The bytes the plan says a LoRA step moves on the data axis are those the run
    moves: the adapters' gradients (and under ZeRO-1 their updated weights), never the
    frozen weights' (ZeRO-3 still gathers those). Counting every gradient (the plan's
    rule before LoRA) read 7.60x the run's bytes under ZeRO-1 and 1.41x under ZeRO-3."""
    from paraxis.testing import DistributedWorld

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert main(["plan", "--model", str(tmp_path), "--data", "2", "--zero", str(zero),
                 "--seq", "32", "--global-batch", "4", "--micro-batch", "2",
                 "--precision", "fp32", "--lora-rank", "8", "--json"]) == 0
    planned = sum(json.loads(capsys.readouterr().out)["communication"].values())
    with DistributedWorld(2, timeout=120) as world:
        moved = world.run(_bytes_moved, zero)
    for rank, got in enumerate(moved):
        assert abs(got - planned) <= 0.02 * planned, (rank, got, planned)
