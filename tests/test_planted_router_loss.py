"""A check must be able to fail: the router's load-balancing loss's gradient doubled in
backward only (its value, and so every reported loss, unchanged) on the parallel side,
and each per-parameter check that must see it (issue 32, item 3).

Doubling it moves the debug Mixtral's global gradient norm by 1.5e-5 of itself while
its gates' gradients move by 10-11% (2.7-3.4% in norm), so only a per-parameter
comparison whose gradients hold the router loss's can see it: the parity probe of
``parallelize`` (against the model's own ``output_router_logits=True`` loss), the
parity harness's first-step gradients (``tests/hf_parity.py``) and the coverage matrix's
gradient cell (``paraxis_coverage.checks.compare``). Each is also run unplanted: the
router loss is in both sides' gradients and they agree.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pytest
from hf_parity import train

import paraxis
from paraxis import ParallelConfig
from paraxis.engine.probe import ParityError, Probe
from paraxis.parallel.aux_losses import AuxLosses
from paraxis.testing.parity import assemble, assert_same_gradients
from paraxis_hf import build_debug_model

SEQ = 16
GATE = r"model\.layers\.\d\.mlp\.gate\.weight"


@contextlib.contextmanager
def doubled_router_gradient() -> Iterator[None]:
    """Every auxiliary part back-propagated twice over, its value kept: ``2w - w.detach()``
    (the engine and the pipeline runner both weigh parts through ``AuxLosses.weighted``)."""
    original = AuxLosses.__dict__["weighted"]

    def weighted(parts, scale):
        w = original.__func__(parts, scale)
        return None if w is None else 2 * w - w.detach()

    AuxLosses.weighted = staticmethod(weighted)
    try:
        yield
    finally:
        AuxLosses.weighted = original


def probe_verdict(degrees: dict, plant: bool) -> tuple[str | None, str]:
    """The probe of ``parallelize`` on the debug Mixtral, by hand (as ``parallelize``
    runs it), with the plant on the parallel side only: its refusal (or None) and what
    it says of the router loss."""
    config = ParallelConfig.from_kwargs(**degrees)
    model = build_debug_model("mixtral")
    probe = Probe.before(model, config, seq_length=SEQ, vocab=model.config.vocab_size,
                         forward_kwargs={}, router_loss=True)
    engine = paraxis.parallelize(model, config=config, train={"seq_length": SEQ},
                                 verify=False)
    try:
        with doubled_router_gradient() if plant else contextlib.nullcontext():
            said = probe.check(engine, str(degrees))
    except ParityError as exc:
        return str(exc), probe.router
    finally:
        engine.close()
    return None, said


@pytest.mark.parametrize("degrees", [{"data": 2}, {"pipeline": 2, "microbatches": 2}],
                         ids=["data2", "pipeline2"])
def test_the_probe_sees_a_doubled_router_loss_gradient(worlds, degrees):
    for message, router in worlds.run(2, probe_verdict, degrees, False):
        assert message is None, message  # the model's own router loss, equal
        assert router == "router loss: the model's own at router_aux_loss_coef=0.001"
    for message, _ in worlds.run(2, probe_verdict, degrees, True):
        assert message is not None
        print(message)
        assert "gradient of model.layers." in message and ".mlp.gate.weight" in message


@contextlib.contextmanager
def planted_after_parallelize() -> Iterator[None]:
    """The plant switched on once ``parallelize`` returned: its probe refuses the plant
    first (the test above), and what the tests below check is the harness and the
    matrix, as if a defect slipped past the probe."""
    original = paraxis.parallelize
    with contextlib.ExitStack() as stack:
        def parallelize(*args, **kwargs):
            engine = original(*args, **kwargs)
            stack.enter_context(doubled_router_gradient())
            return engine

        paraxis.parallelize = parallelize
        try:
            yield
        finally:
            paraxis.parallelize = original


def planted_train(*args):
    with planted_after_parallelize():
        return train(*args)


def gate_errors(per_rank, reference) -> dict[str, float]:
    """Each router gate's relative gradient error (printed: the figures of the plant)."""
    full, ref = assemble(per_rank), assemble([reference])
    return {name: float((full[name] - g).norm() / g.norm()) for name, g in ref.items()
            if re.fullmatch(GATE, name)}


def test_the_parity_harness_sees_a_doubled_router_loss_gradient(worlds):
    reference = worlds.run(1, train, "mixtral", {}, {}, 1, {})[0][-1]
    for runner in (train, planted_train):
        grads = [out[-1] for out in worlds.run(2, runner, "mixtral", {"expert": 2}, {}, 1, {})]
        if runner is train:
            assert_same_gradients(grads, reference)
            continue
        with pytest.raises(AssertionError, match=GATE) as caught:
            assert_same_gradients(grads, reference)
        print(caught.value, gate_errors(grads, reference))


def planted_parallel_run(*args):
    from paraxis_coverage.checks import parallel_run

    with planted_after_parallelize():
        return parallel_run(*args)


def test_the_matrix_sees_a_doubled_router_loss_gradient(worlds):
    from paraxis_coverage.cells import Check
    from paraxis_coverage.checks import compare, reference_run
    from paraxis_hf.families import build_family, causal_lm_types

    family = build_family("mixtral", causal_lm_types()["mixtral"])
    check = Check("data=2", {"data": 2}, "data")
    reference = worlds.run(1, reference_run, family.model_type, family.overrides)[0]
    assert any(reference["aux"]), reference["aux"]  # a router loss, compared per step
    planted = worlds.run(2, planted_parallel_run, family.model_type, family.overrides,
                         check.kwargs)
    cell = compare(reference, planted, check)
    print(cell.cell(), gate_errors([r["grads"] for r in planted], reference["grads"]))
    # The router loss reaches every parameter before a gate, so many differ.
    assert cell.status == "fail", cell.cell()
    assert "parameter gradient(s) differ from one process" in cell.detail, cell.cell()
