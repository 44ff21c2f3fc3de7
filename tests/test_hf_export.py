"""``paraxis checkpoint export-hf``: a checkpoint written on tensor 2 (a vocabulary of
127, padded to 128), on pipeline 2, or of Mixtral with its experts on expert 2 becomes a
``save_pretrained`` directory (sharded, with an index, above a small max shard size)
that ``AutoModelForCausalLM.from_pretrained`` loads, and its logits on a fixed batch
equal those of the trained weights, gathered from the ranks that trained them."""

from __future__ import annotations

import json

import pytest
import torch

import paraxis
from paraxis.cli.main import main
from paraxis.testing.parity import assemble, local_shards

pytest.importorskip("transformers")

STEPS, BATCH, SEQ, VOCAB = 2, 8, 16, 127


def train_and_save(family, options, ckpt):
    from paraxis_hf import build_debug_model

    engine = paraxis.parallelize(build_debug_model(family, vocab_size=VOCAB), **options,
                                 train={"steps": STEPS, "lr": 1e-2, "warmup_steps": 1,
                                        "seq_length": SEQ})
    g = torch.Generator().manual_seed(3)
    index, count = engine.grid.sample_shard()
    part = slice(index * BATCH // count, (index + 1) * BATCH // count)
    for _ in range(STEPS):
        engine.train_step(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)[part])
    engine.save(ckpt)
    shards = local_shards(engine.model)
    engine.close()
    return shards


@pytest.mark.parametrize(("family", "options"), [
    ("llama", {"tensor": 2}), ("llama", {"pipeline": 2, "microbatches": 2}),
    ("mixtral", {"expert": 2})], ids=["tensor2", "pipeline2", "mixtral-expert2"])
def test_export_hf_loads_with_the_trained_logits(worlds, tmp_path, family, options):
    from transformers import AutoModelForCausalLM

    from paraxis_hf import build_debug_model

    ckpt, out = str(tmp_path / "ckpt"), tmp_path / "hf"
    trained = assemble(worlds.run(2, train_and_save, family, options, ckpt))
    assert main(["checkpoint", "export-hf", ckpt, str(out), "--max-shard-size", "40KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    exported = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    reference = build_debug_model(family, seed=9, vocab_size=VOCAB).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(trained[name])
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, reference(ids).logits)


def test_export_hf_names_a_missing_checkpoint(tmp_path, capsys):
    assert main(["checkpoint", "export-hf", str(tmp_path / "none"), str(tmp_path / "o")]) == 1
    assert "no checkpoint" in capsys.readouterr().err
