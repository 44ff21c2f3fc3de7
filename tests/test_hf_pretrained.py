"""Starting from Hugging Face weights: ``paraxis_hf.from_pretrained(dir)`` builds the
model on the meta device and each rank reads only its slices of a sharded
``save_pretrained`` directory.

Parity: tensor 2, pipeline 2 x tensor 2 (a vocabulary of 127, padded to 128) and
ZeRO-3 on data 2 (the weights arrive before ZeRO shards them) started from the
directory train with the same per-step losses as one process started from
``AutoModelForCausalLM.from_pretrained`` on the same directory (shared tolerance); so
does ``model.pretrained: DIR`` in a run config. Memory: with a vocabulary large enough
to dominate the model, each rank's peak anonymous resident memory while it builds the
model and ``parallelize`` lays it out (RssAnon sampled by a thread, minus its size
before) is measured against the whole model's bytes: a rank of a two-way split must stay
under three quarters of it, where one rank owning the model whole needs all of it.
(transformers' own ``from_pretrained`` keeps the tensors in the memory-mapped files, so
its anonymous memory says nothing.)"""

from __future__ import annotations

import gc

import pytest
import torch

import paraxis
from paraxis.testing.memory import AnonPeak
from paraxis.testing.tolerance import assert_losses_close

pytest.importorskip("transformers")

LR, STEPS, BATCH, SEQ = 1e-3, 3, 8, 16
BIG_VOCAB = 32_000


def save_debug_llama(directory, **overrides):
    from paraxis_hf import build_debug_model

    model = build_debug_model("llama", seed=5, **overrides)
    model.save_pretrained(directory, max_shard_size="40KB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def train_from(directory, options, pretrained):
    from transformers import AutoModelForCausalLM

    from paraxis_hf import from_pretrained

    model = (from_pretrained(directory) if pretrained
             else AutoModelForCausalLM.from_pretrained(directory))
    engine = paraxis.parallelize(model, **options, train={
        "steps": STEPS, "lr": LR, "warmup_steps": 1, "seq_length": SEQ})
    assert not any(p.is_meta for p in engine.model.parameters())
    g = torch.Generator().manual_seed(3)
    index, count = engine.grid.sample_shard()
    part = slice(index * BATCH // count, (index + 1) * BATCH // count)
    losses = [engine.train_step(torch.randint(0, 127, (BATCH, SEQ), generator=g)[part])["loss"]
              for _ in range(STEPS)]
    probed = engine.ctx.extras["probe"]
    engine.close()
    return losses if not pretrained else (losses, probed)


def test_sharded_directory_has_an_index(tmp_path):
    save_debug_llama(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2


@pytest.mark.parametrize("options", [{"tensor": 2}, {"pipeline": 2, "tensor": 2,
                                                      "microbatches": 2},
                                      {"data": 2, "zero": 3}],
                         ids=["tensor2", "pipeline2xtensor2", "zero3data2"])
def test_parallel_run_from_pretrained_equals_one_process(worlds, tmp_path, options):
    save_debug_llama(tmp_path, vocab_size=127)  # tensor 2 pads it to 128
    want = worlds.run(1, train_from, str(tmp_path), {}, False)[0]
    size = options.get("pipeline", 1) * options.get("tensor", 1) * options.get("data", 1)
    for losses, probed in worlds.run(size, train_from, str(tmp_path), options, True):
        assert_losses_close(losses, want)
        assert probed.startswith("twin: LlamaForCausalLM"), probed  # the probe ran


def wrong_plan(directory):
    """A plan entry that shards the wrong dimension (q_proj split along its input, as a
    row-parallel layer): the twin's probe must refuse it before a weight is read."""
    import dataclasses

    from paraxis.engine.probe import ParityError
    from paraxis_hf import from_pretrained, hf_plan

    model = from_pretrained(directory)
    plan = hf_plan(model)
    plan = dataclasses.replace(plan, tensor={**plan.tensor,
                                             "model.layers.*.self_attn.q_proj": "rowwise"})
    try:
        paraxis.parallelize(model, tensor=2, plan=plan, train={"seq_length": SEQ})
    except ParityError as exc:
        return str(exc)
    return None


def test_the_twin_probe_refuses_a_wrong_plan_for_pretrained_weights(worlds, tmp_path):
    save_debug_llama(tmp_path)
    for message in worlds.run(2, wrong_plan, str(tmp_path)):
        assert message is not None and "LlamaForCausalLM: with tensor 2" in message


def peak_load(directory, options):
    """Bytes this rank read from the safetensors files (counted at the slice reads), the
    anonymous memory it added at its peak while it built the model from ``directory``
    and ``parallelize`` laid it out, and the bytes of parameters it holds. Run twice; the
    first run pays for imports and process groups."""
    from paraxis_hf import from_pretrained, pretrained

    read = []
    opened = pretrained.SafetensorsDir.slice

    def counted(self, name):
        part = opened(self, name)

        class Counting:
            def __getitem__(self, where):
                t = part[where]
                read.append(t.numel() * t.element_size())
                return t
        return Counting()

    pretrained.SafetensorsDir.slice = counted
    try:
        for _ in range(2):
            read.clear()
            gc.collect()
            with AnonPeak() as peak:
                model = from_pretrained(directory)
                engine = paraxis.parallelize(model, **options, verify=False)
            held = sum(p.numel() * p.element_size() for p in engine.model.parameters())
            del model
            engine.close()
    finally:
        pretrained.SafetensorsDir.slice = opened
    return sum(read), peak.added, held


def test_each_rank_reads_only_its_slices(worlds, tmp_path):
    total = save_debug_llama(tmp_path, vocab_size=BIG_VOCAB, hidden_size=64)
    one = worlds.run(1, peak_load, str(tmp_path), {})[0]  # one rank owns it whole
    layouts = [("tensor2", {"tensor": 2}), ("pipeline2", {"pipeline": 2, "microbatches": 2})]
    ranks = {name: worlds.run(2, peak_load, str(tmp_path), options)
             for name, options in layouts}
    print(f"whole model {total / 2**20:.1f} MiB; read / peak anonymous RSS added while "
          f"building it: one process {one[0] / 2**20:.1f} / {one[1] / 2**20:.1f} MiB; "
          + "; ".join(f"{name} " + ", ".join(
              f"rank {r} {n / 2**20:.1f} / {p / 2**20:.1f} MiB (holds {h / 2**20:.1f})"
              for r, (n, p, h) in enumerate(out)) for name, out in ranks.items()))
    # What each rank reads is exact; the memory peak is a measurement (the allocator may
    # reuse what the first run freed), so it is only bounded from above.
    assert one[0] == total
    for out in ranks.values():
        for read, peak, held in out:
            assert read < 0.6 * total and held < 0.6 * total and peak < 0.75 * total


def train_yaml(directory, degrees):
    from paraxis.config.run import RunConfig
    from paraxis.train.loop import train

    history = []
    train(RunConfig.from_dict({
        "parallelism": degrees,
        "model": {"pretrained": directory},
        "train": {"steps": 2, "global_batch": 4, "seq_length": SEQ, "lr": LR,
                  "warmup_steps": 1, "log_every": 100},
        "data": {"max_bytes": 20_000},
        "logging": {"progress": False, "wandb": False},
    }), history)
    return [m["loss"] for m in history]


def test_yaml_model_pretrained(worlds, tmp_path):
    """``model.pretrained: DIR`` in a run config: tensor 2 equals one process."""
    save_debug_llama(tmp_path, vocab_size=256)  # the byte tokenizer's ids
    want = worlds.run(1, train_yaml, str(tmp_path), {})[0]
    for losses in worlds.run(2, train_yaml, str(tmp_path), {"tensor": 2}):
        assert_losses_close(losses, want)
