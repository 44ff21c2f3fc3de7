"""The plan against measurement (issue 15): a sample of docs/plan-accuracy.md's cases,
one 2-rank world, every row within the bound (model state, activations held for
backward, bytes per axis). The whole table: ``python -m paraxis.planner.accuracy``."""

from paraxis.planner.accuracy import BOUND, CASES, SAMPLE, run


def test_planned_bytes_match_measured_within_the_bound(worlds):
    cases = [c for c in CASES if c.name in SAMPLE]
    assert {c.world for c in cases} == {2}, "the sample shares one world"
    rows = run(cases, worlds)
    quantities = {r.quantity.split(" stage")[0] for r in rows}
    assert {"model state", "activations", "data bytes", "tensor bytes",
            "pipeline bytes"} <= quantities
    over = [f"{r.case} {r.quantity}: planned {r.planned:,.0f}, measured "
            f"{r.measured:,.0f} (ratio {r.ratio:.3f})" for r in rows if r.error > BOUND]
    assert not over, "\n".join(over)
