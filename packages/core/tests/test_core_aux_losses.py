"""The auxiliary-loss channel (paraxis.parallel.batch.AuxLosses): parts, and carries that keep a
loss joint over pipeline stages exact, walked through by hand as a runner does."""

import pytest
import torch

from paraxis.parallel.aux_losses import AuxLosses


def test_parts_are_summed_scaled_and_counted():
    aux = AuxLosses()
    aux.declare("a")
    with pytest.raises(KeyError, match="not declared"):
        aux.add("b", torch.ones(()))
    aux.add("a", torch.tensor(2.0))
    aux.add("a", torch.tensor(1.0))
    assert float(aux.objective(torch.tensor(10.0), 0.5)) == 11.5
    assert aux.totals == {"a": 3.0}
    aux.add("a", torch.tensor(5.0))
    aux.clear()  # evaluation drops what was added
    assert aux.pop() == {}


def _joint(w1, w2, x1, x2):
    """A loss joint over two stages: counts of both (no gradient) times each stage's
    differentiable sums, divided by the global row count (the Switch shape)."""
    p1, p2 = torch.softmax(x1 @ w1, -1), torch.softmax(x2 @ w2, -1)
    counts = (p1 > 0.3).double().sum(0) + (p2 > 0.3).double().sum(0)
    rows = x1.shape[0] + x2.shape[0]
    return ((counts / rows).float() * (p1.sum(0) + p2.sum(0))).sum() / rows, p1, p2


def _stage(aux, slot, w, x):
    """One stage's forward: its contribution (counts, rows) and its resolver."""
    p = torch.softmax(x @ w, -1)
    contribution = torch.cat([(p > 0.3).double().sum(0), torch.tensor([float(x.shape[0])])])

    def resolve(final):
        rows = final[-1].item()
        return {"lb": ((final[:-1] / rows).float() * p.sum(0)).sum() / rows}

    aux.carry(slot, contribution, resolve)


def test_a_carry_makes_each_stage_back_propagate_its_exact_part():
    g = torch.Generator().manual_seed(0)
    w1, w2 = (torch.randn(3, 4, generator=g, requires_grad=True) for _ in range(2))
    x1, x2 = torch.randn(5, 3, generator=g), torch.randn(7, 3, generator=g)
    want, _, _ = _joint(w1, w2, x1, x2)
    want_grads = torch.autograd.grad(want, [w1, w2])

    finalized = []
    aux = AuxLosses()
    aux.declare("lb")
    slot = aux.declare_carry(5, lambda t: finalized.append(t) or t.clone())
    assert aux.carry_size == 5
    # Stage 0 forward: its sum travels on with the hidden states.
    _stage(aux, slot, w1, x1)
    first = aux.pop_carried()
    # Stage 1 forward: adds its own, finalizes (once), resolves its part now.
    _stage(aux, slot, w2, x2)
    second = aux.pop_carried()
    final = aux.finalize(second.contribution + first.contribution)
    part2 = aux.resolve(second, final)["lb"]
    # Stage 0 backward: the finalized numbers came back beside the gradient.
    part1 = aux.resolve(first, final)["lb"]
    assert len(finalized) == 1
    torch.testing.assert_close(part1 + part2, want)
    torch.testing.assert_close(aux.totals["lb"], float(want.detach()))
    got = torch.autograd.grad(part1, w1)[0], torch.autograd.grad(part2, w2)[0]
    for g_got, g_want in zip(got, want_grads, strict=True):
        torch.testing.assert_close(g_got, g_want)


def test_without_a_pipeline_the_objective_finalizes_the_carry_itself():
    g = torch.Generator().manual_seed(1)
    w1, w2 = (torch.randn(3, 4, generator=g, requires_grad=True) for _ in range(2))
    x1, x2 = torch.randn(5, 3, generator=g), torch.randn(7, 3, generator=g)
    aux = AuxLosses()
    aux.declare("lb")
    slot = aux.declare_carry(5, torch.clone)
    _stage(aux, slot, w1, x1)
    _stage(aux, slot, w2, x2)  # two modules of one forward share the slot
    got = aux.objective(torch.zeros(()), 2.0)
    want, _, _ = _joint(w1, w2, x1, x2)
    torch.testing.assert_close(got, 2.0 * want)
