"""A LoRA run's model state per rank, measured on a real run against the planner
(issue 34's memory criterion).

    python benchmarks/lora_state.py           # spawns a world of 4 ranks itself

A 0.1B Llama (hidden 768, 12 layers, vocab 32000: 134M parameters, built from config)
with rank-8 adapters on every linear layer of its layers (peft's ``all-linear``, as
``paraxis plan --lora-rank 8`` assumes), trained 2 real steps under ZeRO-3 over data 4
in bf16 with AdamW, and the same model fully fine-tuned in the same layout. Measured:
the engine's ``model_state_bytes`` on every rank after the second step (every storage
behind parameters, gradients, the optimizer's shards and state, counted once). Planned:
``paraxis plan``'s parameters + gradients + optimizer for the same layout. The test
``tests/test_lora_plan.py`` checks the same figures on the meta device (the dry run);
this is the run itself, with real tensors, collectives and optimizer steps.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
from pathlib import Path

import torch
from common import machine, write_section

import paraxis
from paraxis.cli.main import main as paraxis_main
from paraxis.testing import DistributedWorld

LLAMA_100M = {"model_type": "llama", "hidden_size": 768, "intermediate_size": 2048,
              "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 12,
              "vocab_size": 32000, "max_position_embeddings": 2048,
              "tie_word_embeddings": False}
RANKS, SEQ, GLOBAL_BATCH, LORA_RANK = 4, 256, 8, 8
STATE = ("parameters", "gradients", "optimizer")
MiB = 2**20


def build(lora: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_100M))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK,
                                                 target_modules="all-linear"))
    return model


def measure(lora: bool) -> dict:
    model = build(lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine = paraxis.parallelize(model, data=RANKS, zero=3, train={
        "steps": 2, "lr": 1e-4, "seq_length": SEQ, "precision": "bf16",
        "global_batch": GLOBAL_BATCH})
    g = torch.Generator().manual_seed(torch.distributed.get_rank())
    metrics = {}
    for _ in range(2):
        ids = torch.randint(0, LLAMA_100M["vocab_size"], (GLOBAL_BATCH // RANKS, SEQ),
                            generator=g)
        metrics = engine.train_step(ids)
    engine.close()
    moved = sum(v for k, v in metrics.items() if k.startswith("comm/") and k.endswith("_bytes"))
    return {"state": metrics["model_state_bytes"], "trainable": trainable,
            "loss": float(metrics["loss"]), "bytes": moved}


def planned(lora: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(LLAMA_100M))
        args = ["plan", "--model", tmp, "--data", str(RANKS), "--zero", "3", "--precision",
                "bf16", "--seq", str(SEQ), "--global-batch", str(GLOBAL_BATCH),
                "--micro-batch", str(GLOBAL_BATCH // RANKS), "--json"]  # one per step
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert paraxis_main([*args, "--lora-rank", str(LORA_RANK)] if lora else args) == 0
    plan = json.loads(out.getvalue())
    return {**{term: plan["memory"][term] for term in STATE},
            "bytes": sum(plan["communication"].values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = {}
    with DistributedWorld(RANKS, timeout=1200) as world:
        for lora in (True, False):
            ranks = world.run(measure, lora)
            plan = planned(lora)
            rows["lora" if lora else "full"] = {
                "ranks": ranks, "plan": plan,
                "planned": sum(plan[term] for term in STATE)}
    lora, full = rows["lora"], rows["full"]
    lines = ["## LoRA: model state per rank, a real run against the plan (issue 34)", "",
             f"`python benchmarks/lora_state.py` ({machine()}): a 0.1B Llama (134M "
             "parameters, from config), rank-8 adapters on every linear layer of its layers "
             f"(peft `all-linear`: {lora['ranks'][0]['trainable']:,} trainable), ZeRO-3 over "
             f"data {RANKS}, bf16, AdamW, seq {SEQ}, global batch {GLOBAL_BATCH}; 2 real "
             "steps; the engine's `model_state_bytes` after the second step on each rank "
             "against `paraxis plan`'s parameters + gradients + optimizer; bytes moved: "
             "the step's `comm/<group>_bytes` against the plan's communication (frozen "
             "weights are gathered by ZeRO-3 but their gradients are not reduced).", "",
             "| rank | LoRA measured (MiB) | LoRA planned (MiB) | measured / plan | full "
             "fine-tuning measured (MiB) | LoRA / full | LoRA bytes moved / plan | full "
             "bytes moved / plan |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for rank, (mine, theirs) in enumerate(zip(lora["ranks"], full["ranks"], strict=True)):
        lines.append(
            f"| {rank} | {mine['state'] / MiB:.2f} | {lora['planned'] / MiB:.2f} | "
            f"{mine['state'] / lora['planned']:.4f} | {theirs['state'] / MiB:.2f} | "
            f"{mine['state'] / theirs['state']:.4f} | "
            f"{mine['bytes'] / lora['plan']['bytes']:.4f} | "
            f"{theirs['bytes'] / full['plan']['bytes']:.4f} |")
    worst = max(abs(r["state"] / lora["planned"] - 1) for r in lora["ranks"])
    share = max(m["state"] / t["state"] for m, t in zip(lora["ranks"], full["ranks"],
                                                         strict=True))
    lines += ["", f"Worst rank: {worst:.2%} off the plan (target within 2%), LoRA / full "
              f"fine-tuning at most {share:.4f} (target below 0.3)."]
    print("\n".join(lines))
    if not args.no_write:
        write_section("lora_state", "\n".join(lines), rows)


if __name__ == "__main__":
    main()
