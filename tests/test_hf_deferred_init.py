"""Models built from config on the meta device (``build_causal_lm(..., deferred=True)``,
what ``paraxis train`` builds): each rank draws only the pieces it owns, and every
layout starts from the same model.

Equality: the initial weights, gathered from the ranks (``paraxis.testing.parity.
assemble``), equal one process's element for element (``torch.equal``, no tolerance) on
Llama (tensor 2, pipeline 2 x tensor 2, ZeRO-3 over data 4), GPT-2 (its scaled residual
projections and tied head; it has no tensor or pipeline plan, so ZeRO-3 over data 2 and
4), Qwen2 (zero q/k/v biases sharded with their heads: tensor 2, pipeline 2 x tensor 2),
Gemma-2 (its embedding scale a buffer beside a parameter: tensor 2) and Mixtral
(experts stacked in one tensor: expert 2, expert 2 x tensor 2, ZeRO-3 over
data 2). A rank that drew its slice from its own seed, as Megatron does, fails this
(``test_a_rank_local_seed_is_caught`` plants that bug). Memory: each rank of a two-way
split allocates exactly its parameters' bytes, under 0.6 of the whole model, and its
peak anonymous memory while the model is built and laid out stays under 0.75 of it;
under tensor 2 x pipeline 2 and under ZeRO-3 over data 4 (each rank drawing its shard
alone) a 0.13B model costs each rank at most 0.30 of it.
Training: a few steps from the deferred model match one process at the shared tolerance,
and so does ``paraxis train`` of a family from config."""

from __future__ import annotations

import gc

import pytest
import torch

import paraxis
from paraxis import ParallelConfig
from paraxis.testing.memory import AnonPeak
from paraxis.testing.parity import assemble, local_shards, train_on_random_tokens
from paraxis.testing.tolerance import assert_losses_close

pytest.importorskip("transformers")

SEED, LR, STEPS, BATCH, SEQ = 11, 1e-3, 3, 8, 16
BIG_VOCAB = 32_000


def deferred_model(family, **overrides):
    from paraxis_hf import DEBUG_CONFIGS, build_causal_lm

    return build_causal_lm(family, {**DEBUG_CONFIGS[family], **overrides}, deferred=True,
                           seed=SEED)


def initial_shards(family, options, overrides=None):
    """This rank's initial parameters (no probe: only the values are compared here)."""
    model = deferred_model(family, **(overrides or {}))
    engine = paraxis.parallelize(model, config=ParallelConfig.from_kwargs(**options),
                                 train={"seq_length": SEQ}, verify=False)
    shards = local_shards(engine.model)
    engine.close()
    return shards


LAYOUTS = [
    ("llama", {"tensor": 2}), ("llama", {"pipeline": 2, "tensor": 2, "microbatches": 2}),
    ("llama", {"data": 4, "zero": 3}),
    ("gpt2", {"data": 2, "zero": 3}), ("gpt2", {"data": 4, "zero": 3}),
    ("qwen2", {"tensor": 2}), ("qwen2", {"pipeline": 2, "tensor": 2, "microbatches": 2}),
    ("gemma2", {"tensor": 2}),
    ("mixtral", {"expert": 2}), ("mixtral", {"expert": 2, "tensor": 2}),
    ("mixtral", {"data": 2, "zero": 3}),
]
_whole: dict[str, dict[str, torch.Tensor]] = {}


def one_process(worlds, family):
    if family not in _whole:
        _whole[family] = assemble(worlds.run(1, initial_shards, family, {}))
    return _whole[family]


def assert_identical(full, want):
    assert full.keys() == want.keys(), sorted(full.keys() ^ want.keys())
    for name, tensor in want.items():
        assert torch.equal(full[name], tensor), f"{name} differs from one process's"


@pytest.mark.parametrize(("family", "options"), LAYOUTS,
                         ids=[f"{f}-" + "x".join(f"{k}{v}" for k, v in o.items()
                                                 if k != "microbatches")
                              for f, o in LAYOUTS])
def test_initial_weights_are_identical_on_every_layout(worlds, family, options):
    size = ParallelConfig.from_kwargs(**options).world_size
    assert_identical(assemble(worlds.run(size, initial_shards, family, options)),
                     one_process(worlds, family))


def rank_local_seed(family, options):
    """The planted bug: each rank draws its pieces from a seed of its own."""
    import torch.distributed as dist

    from paraxis_hf import materialize

    value = materialize.InvariantInit.value

    def own_seed(self, rec, piece):
        self.seed = SEED + dist.get_rank()
        return value(self, rec, piece)

    materialize.InvariantInit.value = own_seed
    try:
        return initial_shards(family, options)
    finally:
        materialize.InvariantInit.value = value


def test_a_rank_local_seed_is_caught(worlds):
    full = assemble(worlds.run(2, rank_local_seed, "llama", {"tensor": 2}))
    with pytest.raises(AssertionError, match="differs from one process's"):
        assert_identical(full, one_process(worlds, "llama"))


SMALL = {"vocab_size": BIG_VOCAB, "hidden_size": 64}
# About 100M parameters (0.13B: 12 layers of hidden 768, a 16,000-token vocabulary), the
# size at which the issue asks the suite for the benchmark's ratio. A rank of the first
# stage holds half the embedding and half of six layers: a quarter of the model.
LARGE = {"vocab_size": 16_000, "hidden_size": 768, "intermediate_size": 3072,
         "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 4,
         "max_position_embeddings": 64}


def construction(options, overrides):
    """Bytes the materializer allocated on this rank, the peak anonymous memory added
    while the model was built and laid out, and the bytes of parameters it holds. A
    small build first pays for imports and process groups."""
    from paraxis.parallel.strategy import MATERIALIZE_ATTR

    for sizes in (SMALL, overrides):
        gc.collect()
        with AnonPeak() as peak:
            model = deferred_model("llama", **sizes)
            materializer = getattr(model, MATERIALIZE_ATTR)
            engine = paraxis.parallelize(model, **options, verify=False)
        held = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        del model
        engine.close()
    return materializer.allocated_bytes, peak.added, held


def whole_bytes(overrides):
    return sum(p.numel() * 4 for p in deferred_model("llama", **overrides).parameters())


def report(options, total, out):
    print(f"{options}: whole model {total / 2**20:.1f} MiB; per rank allocated / peak "
          "anonymous RSS added: " + ", ".join(
              f"{a / 2**20:.1f} / {p / 2**20:.1f} MiB" for a, p, *_ in out))


def test_each_rank_materializes_only_its_share(worlds):
    total = whole_bytes(SMALL)
    assert worlds.run(1, construction, {}, SMALL)[0][0] == total
    for options in ({"tensor": 2}, {"pipeline": 2, "microbatches": 2}):
        out = worlds.run(2, construction, options, SMALL)
        report(options, total, out)
        for allocated, peak, held in out:
            assert allocated == held and allocated < 0.6 * total and peak < 0.75 * total


def test_a_100m_model_costs_each_rank_under_0_3_of_it(worlds):
    """Tensor 2 x pipeline 2: each rank adds at most 0.30 of the whole model's fp32
    bytes while it is built and laid out (benchmarks/construct_memory.py, at 0.40B)."""
    options = {"tensor": 2, "pipeline": 2, "microbatches": 2}
    total = whole_bytes(LARGE)
    out = worlds.run(4, construction, options, LARGE)
    report(options, total, out)
    for allocated, peak, held in out:
        assert allocated == held and peak <= 0.30 * total


def test_a_100m_model_under_zero3_costs_each_rank_under_0_3_of_it(worlds):
    """ZeRO-3 over data 4: each rank draws its dim-0 chunk of every tensor straight into
    its shard (only the init tiles that overlap it), so it adds at most 0.30 of the whole
    model's fp32 bytes while it is built and laid out, never the whole tensor."""
    options = {"data": 4, "zero": 3}
    total = whole_bytes(LARGE)
    out = worlds.run(4, construction, options, LARGE)
    report(options, total, out)
    for allocated, peak, held in out:
        assert allocated == held and peak <= 0.30 * total


def train_deferred(family, options):
    model = deferred_model(family)
    engine = paraxis.parallelize(model, config=ParallelConfig.from_kwargs(**options), train={
        "steps": STEPS, "lr": LR, "warmup_steps": 1, "seq_length": SEQ})
    losses = train_on_random_tokens(engine, steps=STEPS, batch=BATCH, seq=SEQ,
                                    vocab=model.config.vocab_size)
    probed = engine.ctx.extras["probe"]
    engine.close()
    return losses, probed


@pytest.mark.parametrize(("family", "options"), [
    ("llama", {"pipeline": 2, "tensor": 2, "microbatches": 2}),
    ("gpt2", {"data": 2, "zero": 3}), ("mixtral", {"expert": 2}),
    # Activation checkpointing wraps the meta model; ZeRO-3 then draws its shards.
    ("llama", {"data": 2, "zero": 3, "activation_checkpointing": "full"})],
    ids=["llama-pipeline2xtensor2", "gpt2-zero3data2", "mixtral-expert2",
         "llama-zero3data2-recompute"])
def test_training_from_the_deferred_model_equals_one_process(worlds, family, options):
    want, _ = worlds.run(1, train_deferred, family, {})[0]
    size = ParallelConfig.from_kwargs(**options).world_size
    for losses, probed in worlds.run(size, train_deferred, family, options):
        assert_losses_close(losses, want)
        assert probed.startswith("twin: "), probed  # the probe ran, on a twin


def train_yaml(degrees):
    from paraxis.config.run import RunConfig
    from paraxis.train.loop import start
    from paraxis_hf import DEBUG_CONFIGS

    history = []
    run = start(RunConfig.from_dict({
        "parallelism": degrees,
        "model": {"family": "llama", "config": {**DEBUG_CONFIGS["llama"], "vocab_size": 256}},
        "train": {"steps": 2, "global_batch": 4, "seq_length": SEQ, "lr": LR,
                  "warmup_steps": 1, "log_every": 100},
        "data": {"max_bytes": 20_000},
        "logging": {"progress": False, "wandb": False},
    }), history)
    out = run.engine.ctx.extras["probe"], local_shards(run.engine.model)
    run.engine.close()
    return out


def test_paraxis_train_builds_from_config_on_the_meta_device(worlds):
    """``model.family: llama`` in a run config: built deferred (the probe ran on a twin)
    and tensor 2 starts from one process's weights."""
    probed, want = worlds.run(1, train_yaml, {})[0]
    assert probed.startswith("twin: LlamaForCausalLM"), probed
    out = worlds.run(2, train_yaml, {"tensor": 2})
    assert_identical(assemble([shards for _, shards in out]), assemble([want]))


# Families paraxis train crashed on or drew at another spread before issue 32: GPT-Neo
# and XGLM (buffers beside children with parameters), ModernBERT-decoder (trunc_normal_
# unseen on meta; its twin's padding index), Youtu (its tied embedding at its head's std).
ISSUE_32_FAMILIES = ("gpt_neo", "xglm", "modernbert-decoder", "youtu")
# The issue's bar: each parameter's std within 15% of an eager build's. It is meaningful
# only where sampling noise is well inside it: two stds of n draws each differ by about
# sigma / sqrt(n), so the test also requires 15% to exceed the derived two-sample
# allowance (SampleAllowance.std, times sqrt(2)) of every tensor it compares.
STD_BAR = 0.15


def train_family(family, overrides):
    """``paraxis train`` of ``family`` from config on this world: how it was built (the
    probe's line), this rank's initial parameters, and the losses of two steps."""
    from paraxis.config.run import RunConfig
    from paraxis.train.loop import run_steps, start

    history = []
    run = start(RunConfig.from_dict({
        "model": {"family": family, "config": overrides},
        "train": {"steps": 2, "global_batch": 4, "seq_length": SEQ, "lr": LR,
                  "warmup_steps": 1, "log_every": 100},
        "data": {"max_bytes": 20_000},
        "logging": {"progress": False, "wandb": False},
    }), history)
    initial, probed = local_shards(run.engine.model), run.engine.ctx.extras["probe"]
    run_steps(run)
    run.engine.close()
    return probed, initial, [h["loss"] for h in history]


@pytest.mark.parametrize("family", ISSUE_32_FAMILIES)
def test_paraxis_train_builds_the_family_at_its_eager_spread(worlds, family):
    import math

    from paraxis.testing.samples import SampleAllowance
    from paraxis_hf.families import build_family, build_model, causal_lm_types

    tiny = build_family(family, causal_lm_types()[family])
    probed, initial, losses = worlds.run(1, train_family, family, tiny.overrides)[0]
    assert probed.startswith("twin: "), probed  # built on the meta device, probed on a twin
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    got = {name: t.double().std().item() if t.numel() > 1 else 0.0
           for name, t in assemble([initial]).items()}
    eager = dict(build_model(family, tiny.overrides).named_parameters())
    assert got.keys() == eager.keys()
    for name, param in eager.items():
        want = param.double().std().item() if param.numel() > 1 else 0.0
        assert abs(got[name] - want) <= STD_BAR * want, (name, got[name], want)
        if want:
            assert math.sqrt(2) * SampleAllowance.of(param.numel()).std(1.0) < STD_BAR, name
