"""moe-ep's ``paraxis_summarize_run``: the most and least loaded expert over a run, from
the per-expert ``assigned`` metrics the engine logged each step (no process group)."""

from paraxis.parallel.metric_names import moe_array, moe_total
from paraxis_moe._plugin import paraxis_summarize_run

BLOCKS = ("model.layers.0.mlp", "model.layers.1.mlp")


def history() -> list[dict[str, float]]:
    """Two steps over two blocks of four experts; block 1's expert 2 takes the most
    tokens over the run, block 0's expert 3 the fewest."""
    steps = [{0: 10, 1: 10, 2: 10, 3: 2}, {0: 10, 1: 10, 2: 30, 3: 8}]
    out = []
    for assigned in steps:
        metrics = {"loss": 1.0}
        for b, block in enumerate(BLOCKS):
            for e, n in assigned.items():
                metrics[moe_array(block, "assigned", e)] = float(n + 10 * b * (e == 2))
                metrics[moe_array(block, "dropped", e)] = 100.0  # not a load
        out.append(metrics)
    return out


def test_the_run_summary_names_the_most_and_least_loaded_expert():
    report = paraxis_summarize_run(ctx=None, history=history())
    # totals over both steps: block 0: 20 20 40 10, block 1: 20 20 60 10; mean 25
    assert report.values == {moe_total("most_loaded_vs_mean"): 60 / 25,
                             moe_total("least_loaded_vs_mean"): 10 / 25}
    assert report.rows[0] == ("most loaded expert",
                              "model.layers.1.mlp #2: 60 routed (2.40x mean)")
    assert report.rows[1][0] == "least loaded expert"
    assert report.rows[1][1].endswith(": 10 routed (0.40x mean)")


def test_a_run_without_experts_adds_nothing():
    assert paraxis_summarize_run(ctx=None, history=[{"loss": 1.0}]) is None
