"""A check must be able to fail: plant a 2x gradient on one small parameter (a norm
weight) under tensor 2 + sequence parallel and under pipeline 2, and watch which checks
see it.

The old checks (per-step losses and global gradient norms over 20 steps, final weights
at the Adam tolerance) pass it: Adam is invariant to a gradient's scale, and the
parameter's share of the global norm is so small that doubling it moves the norm by
less than the tolerance. The per-parameter gradient comparison fails it, naming the
parameter, and so does the parity probe of ``parallelize``, which compares every
parameter's gradient norm."""

import pytest
import torch

import paraxis
from paraxis import ParallelConfig
from paraxis.engine.probe import ParityError, Probe
from paraxis.parallel.placement import placement_of
from paraxis.testing.parity import (
    assemble,
    assert_same_gradients,
    assert_same_weights,
    local_gradients,
    local_shards,
    random_token_shares,
)
from paraxis.testing.tolerance import STEP_RTOL, assert_losses_close
from paraxis_hf import build_debug_model

LR, STEPS, BATCH, SEQ = 1e-3, 20, 4, 16
# The norm weight with the smallest share of the debug Llama's gradient norm (8.7e-4 at
# the first step, measured; the test checks it is below what the norm can see).
PLANTED = "model.layers.1.post_attention_layernorm.weight"


def _plant(engine):
    for p in engine.model.parameters():
        if placement_of(p).name == PLANTED:
            p.register_hook(lambda g: 2 * g)


def train(degrees, plant):
    config = ParallelConfig.from_kwargs(**degrees)
    engine = paraxis.parallelize(build_debug_model("llama"), config=config, train={
        "steps": STEPS, "lr": LR, "warmup_steps": 2, "seq_length": SEQ})
    if plant:  # after parallelize: the planted defect is the layout's, every rank's
        _plant(engine)
    shares = random_token_shares(engine, steps=STEPS, batch=BATCH, seq=SEQ,
                                 vocab=engine.model.config.vocab_size)
    grads = local_gradients(engine, shares[0])
    history = [engine.train_step(s) for s in shares]
    shards = local_shards(engine.model)
    engine.close()
    return [m["loss"] for m in history], [m["grad_norm"] for m in history], shards, grads


def probe_finds(degrees):
    """The parity probe on a planted layout: the whole model's numbers first, then the
    parallel engine's, as ``parallelize`` does (here by hand, after planting)."""
    config = ParallelConfig.from_kwargs(**degrees)
    model = build_debug_model("llama")
    probe = Probe.before(model, config, seq_length=SEQ, vocab=model.config.vocab_size,
                         forward_kwargs={})
    engine = paraxis.parallelize(model, config=config, train={"seq_length": SEQ})
    _plant(engine)
    try:
        probe.check(engine, str(degrees))
    except ParityError as exc:
        return str(exc)
    finally:
        engine.close()
    return None


@pytest.mark.parametrize("degrees", [{"tensor": 2, "sequence_parallel": True},
                                     {"pipeline": 2, "microbatches": 2}],
                         ids=["tensor2-sp", "pipeline2"])
def test_only_per_parameter_gradients_see_a_planted_2x(worlds, degrees):
    ref_losses, ref_norms, ref_shards, ref_grads = worlds.run(1, train, {}, False)[0]
    full = assemble([ref_grads])
    share = float(full[PLANTED].norm() / torch.sqrt(sum(g.pow(2).sum() for g in full.values())))
    assert 1.5 * share ** 2 < STEP_RTOL  # doubling it moves the global norm less than that
    out = worlds.run(2, train, degrees, True)
    # The old checks pass the defect...
    for losses, norms, _, _ in out:
        assert_losses_close(losses, ref_losses)
        assert_losses_close(norms, ref_norms, "gradient norms")
    assert_same_weights([s for _, _, s, _ in out], ref_shards, lr=LR, steps=STEPS)
    # ...the per-parameter gradients do not.
    with pytest.raises(AssertionError, match=rf"{PLANTED} \(relative error 1\.00e\+00"):
        assert_same_gradients([g for *_, g in out], ref_grads)
    # Nor does the probe of parallelize.
    for message in worlds.run(2, probe_finds, degrees):
        assert message is not None and f"gradient of {PLANTED}" in message
