"""Stages, alive microbatches and the bubble, without processes."""

import pytest

from paraxis.planner.schedule import alive_units, closed_form_bubble, rank_chunks


def test_rank_chunks_are_the_pipeline_axis_split():
    """The planner counts each stage's layers with the split the pipeline axis cuts the
    model with (paraxis.parallel.split): the costliest stage as cheap as can be (its
    tie-break leaves the first stage the fewest layers)."""
    assert rank_chunks(10, 4) == [[(0, 1)], [(1, 3)], [(4, 3)], [(7, 3)]]
    inter = rank_chunks(8, 2, 2)  # global stage k on rank k % p
    assert inter == [[(0, 2), (4, 2)], [(2, 2), (6, 2)]]
    # A head costing a layer and more moves layers off the last stage; split points win.
    assert rank_chunks(8, 2, hidden=64, vocab=64 * 12 * 2) == [[(0, 5)], [(5, 3)]]
    assert rank_chunks(8, 2, points=[2]) == [[(0, 2)], [(2, 6)]]
    # A V (ZB-V, DualPipeV): rank r holds stages r and 2p-1-r.
    assert rank_chunks(8, 2, 2, placement="v") == [[(0, 2), (6, 2)], [(2, 2), (4, 2)]]


def test_alive_microbatches_per_schedule():
    assert [alive_units("1f1b", 4, 8, 1, r) for r in range(4)] == [4, 3, 2, 1]
    assert alive_units("1f1b", 4, 2, 1, 0) == 2  # never more than there are
    assert alive_units("gpipe", 4, 8, 1, 3) == 8
    assert alive_units("zero_bubble_h1", 4, 8, 1, 0) == 4
    assert alive_units("interleaved_1f1b", 4, 8, 2, 0) == 2 * 3 + 4 + 1
    assert alive_units("gpipe", 1, 8, 1, 0) == 1  # no pipeline: one after another
    # The V schedules, in chunks of half a stage: ZB-V 1F1B's 2p, DualPipeV one more.
    assert [alive_units("zbv", 4, 8, 2, r) for r in range(4)] == [8] * 4
    assert [alive_units("zbv", 4, 4, 2, r) for r in range(4)] == [5, 6, 7, 8]
    assert alive_units("dualpipev", 4, 8, 2, 3) == 9


@pytest.mark.parametrize(("schedule", "v", "expected"), [
    ("gpipe", 1, 3 / 11), ("1f1b", 1, 3 / 11), ("interleaved_1f1b", 2, 3 / 19),
    ("zero_bubble_h1", 1, 6 / 30), ("zbv", 2, 3 / 51), ("dualpipev", 2, 3 / 51),
])
def test_closed_form_bubbles(schedule, v, expected):
    assert closed_form_bubble(schedule, 4, 8, v).fraction == pytest.approx(expected)
    assert closed_form_bubble(schedule, 1, 8, v).fraction == 0.0
