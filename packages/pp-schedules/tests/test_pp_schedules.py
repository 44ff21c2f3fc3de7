"""Schedules are data: checked and dry-run without processes."""

import pytest

from paraxis.parallel.split import balanced_split, ranges_from_points
from paraxis_pp import Action, Schedule, ScheduleError, build, check, simulate, theoretical_bubble
from paraxis_pp.simulate import Timeline
from paraxis_pp.timeline import render_svg, render_text

GRID = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 4, 8, 16) if m >= p]


@pytest.mark.parametrize(("p", "m"), GRID)
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zero_bubble_h1"])
def test_every_schedule_is_legal(name, p, m):
    legality = check(build(name, p, m))
    if name == "gpipe":
        assert legality.peak_activations == (m,) * p
    if name == "1f1b":  # rank r keeps at most p - r microbatches alive
        assert legality.peak_activations == tuple(min(p - r, m) for r in range(p))


@pytest.mark.parametrize(("p", "m", "v"), [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 3),
                                           (3, 6, 2), (8, 16, 2)])
def test_interleaved_is_legal(p, m, v):
    check(build("interleaved_1f1b", p, m, v))


@pytest.mark.parametrize(("name", "p", "m", "v"), [
    ("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 16, 1),
    ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 4, 16, 4),
    ("zero_bubble_h1", 2, 4, 1), ("zero_bubble_h1", 4, 8, 1), ("zero_bubble_h1", 8, 16, 1)])
def test_simulated_bubble_matches_theory(name, p, m, v):
    s = build(name, p, m, v)
    # Equal stages, backward twice the forward (B + W), as the formulas assume.
    assert simulate(s, f=1, b=1, w=1).bubble == pytest.approx(theoretical_bubble(s))


def test_the_registry_builds_exactly_the_configs_schedules():
    """One list of names (paraxis.config.parallel.PIPELINE_SCHEDULES): the config, the
    planner and the CLI accept exactly what this package builds; the config's V and
    split-backward lists (which the planner and tensor parallel read) say what the
    builders do."""
    from paraxis.config.parallel import (
        PIPELINE_SCHEDULES,
        SPLIT_BACKWARD_SCHEDULES,
        V_SCHEDULES,
    )
    from paraxis_pp.schedules import SCHEDULES

    assert tuple(SCHEDULES) == PIPELINE_SCHEDULES
    built = {name: build(name, 4, 8, 2 if name in V_SCHEDULES or "inter" in name else 1)
             for name in SCHEDULES}
    assert {n for n, s in built.items() if s.placement == "v"} == set(V_SCHEDULES)
    assert {n for n, s in built.items() if s.split_backward} == set(SPLIT_BACKWARD_SCHEDULES)


def test_zero_bubble_beats_1f1b_at_the_same_memory():
    zb, ofob = build("zero_bubble_h1", 4, 8), build("1f1b", 4, 8)
    assert simulate(zb).bubble < simulate(ofob).bubble
    assert simulate(zb).makespan < simulate(ofob).makespan
    assert check(zb).peak_activations[0] <= 2 * check(ofob).peak_activations[0]


def _broken(rows):
    return Schedule("broken", 2, 1, 1, tuple(tuple(r) for r in rows))


def test_checker_finds_deadlock_missing_and_duplicate_actions():
    # Rank 0 waits for B0 from rank 1 before sending F0: neither can move.
    with pytest.raises(ScheduleError, match="deadlock"):
        check(_broken([[Action("B", 0), Action("F", 0)], [Action("F", 0), Action("B", 0)]]))
    with pytest.raises(ScheduleError, match="missing"):
        check(_broken([[Action("F", 0), Action("B", 0)], [Action("F", 0)]]))
    with pytest.raises(ScheduleError, match="more than once"):
        check(_broken([[Action("F", 0), Action("F", 0), Action("B", 0)],
                       [Action("F", 0), Action("B", 0)]]))
    # A whole backward already computed the weight gradients a W would compute again.
    with pytest.raises(ScheduleError, match="more than once"):
        check(_broken([[Action("F", 0), Action("B", 0)],
                       [Action("F", 0), Action("B", 0), Action("W", 0)]]))
    # A W before its input gradient waits forever.
    with pytest.raises(ScheduleError, match="deadlock"):
        check(_broken([[Action("F", 0), Action("B", 0)],
                       [Action("F", 0), Action("W", 0), Action("I", 0)]]))


def test_interleaved_needs_whole_groups_and_others_one_chunk():
    with pytest.raises(ValueError, match="divisible by the pipeline degree"):
        build("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match="one chunk per rank"):
        build("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        build("2f2b", 2, 4)


def test_split_balances_cost_and_never_drops_layers():
    assert balanced_split(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # A costly head pushes layers off the last stage.
    ranges = balanced_split(8, 2, last_extra=2.0)
    assert ranges == [(0, 5), (5, 8)]
    for layers, stages in [(7, 3), (5, 5), (13, 4)]:
        r = balanced_split(layers, stages)
        assert r[0][0] == 0 and r[-1][1] == layers
        assert all(a < b for a, b in r) and all(r[i][1] == r[i + 1][0] for i in range(stages - 1))
    assert ranges_from_points(6, [1, 4]) == [(0, 1), (1, 4), (4, 6)]
    with pytest.raises(ValueError, match="without layers"):
        ranges_from_points(6, [3, 3])


def test_timeline_pictures_show_idle_time():
    t = simulate(build("1f1b", 2, 3))
    svg = render_svg(t)
    assert svg.startswith("<svg") and "stage 1" in svg and "bubble" in svg
    assert svg.count("<rect") == 2 + sum(len(r) for r in t.entries)  # idle rows + cells
    text = render_text(t)
    assert text.splitlines()[1].startswith("stage 1: .")  # stage 1 idles first


V_GRID = [(p, m) for p in (1, 2, 3, 4, 8) for m in (p, p + 1, 2 * p - 1, 2 * p, 3 * p, 16)
          if m <= 16]


@pytest.mark.parametrize(("p", "m"), V_GRID)
def test_v_schedules_are_legal_and_keep_1f1b_memory(p, m):
    """ZB-V keeps 1F1B's activations (2p chunk-microbatches, half a stage each, on the
    busiest rank: Qi et al. section 6); DualPipeV one chunk-microbatch more (DeepSeek's
    PP+1 with PP = 2p stages)."""
    zbv = check(build("zbv", p, m, 2))
    assert zbv.peak_activations == tuple(min(2 * p, m + r + 1) for r in range(p))
    if m >= 2 * p:
        assert check(build("dualpipev", p, m, 2)).peak_activations == (2 * p + 1,) * p


@pytest.mark.parametrize(("name", "p", "m"), [
    ("zbv", 2, 2), ("zbv", 2, 8), ("zbv", 4, 4), ("zbv", 4, 5), ("zbv", 4, 8),
    ("zbv", 8, 10), ("zbv", 8, 32), ("dualpipev", 2, 4), ("dualpipev", 4, 8),
    ("dualpipev", 4, 13), ("dualpipev", 8, 16)])
def test_v_bubbles_match_their_closed_forms(name, p, m):
    s = build(name, p, m, 2)
    assert simulate(s, f=1, b=1, w=1).bubble == pytest.approx(theoretical_bubble(s))


def test_the_v_places_first_and_last_stage_on_rank_zero():
    s = build("zbv", 4, 8, 2)
    assert [[s.stage(r, c) for c in range(2)] for r in range(4)] == [
        [0, 7], [1, 6], [2, 5], [3, 4]]
    assert all(s.place(s.stage(r, c)) == (r, c) for r in range(4) for c in range(2))
    looped = build("interleaved_1f1b", 4, 8, 2)
    assert [looped.stage(r, 1) for r in range(4)] == [4, 5, 6, 7]


def test_v_schedules_halve_zero_bubbles_at_the_same_memory():
    """On one model (a V chunk is half a stage: its passes cost half a stage's), ZB-V and
    DualPipeV idle less than half of what ZB-H1 idles, and ZB-V's busiest rank holds
    1F1B's activations (chunk-microbatches are half a stage's)."""
    zb1 = simulate(build("zero_bubble_h1", 4, 8), f=2, b=2, w=2)
    for name in ("zbv", "dualpipev"):
        v = simulate(build(name, 4, 8, 2), f=1, b=1, w=1)
        assert v.makespan < zb1.makespan
        assert (v.makespan - 48) * 2 <= zb1.makespan - 48  # idle per rank, 48 busy
    assert check(build("zbv", 4, 8, 2)).peak_activations[0] / 2 == \
        check(build("1f1b", 4, 8)).peak_activations[0]


def test_what_a_v_cannot_hold_is_refused():
    with pytest.raises(ValueError, match="exactly two chunks per rank"):
        build("zbv", 4, 8, 1)
    with pytest.raises(ValueError, match="exactly two chunks per rank"):
        build("dualpipev", 4, 8, 4)
    with pytest.raises(ValueError, match="at least 8 microbatches"):
        build("dualpipev", 4, 6, 2)
    with pytest.raises(ValueError, match="even number of chunks"):
        Schedule("odd", 2, 2, 3, ((), ()), placement="v")


def test_v_timeline_names_ranks_and_chunks():
    t = simulate(build("zbv", 2, 4, 2))
    text = render_text(t)
    assert text.startswith("rank 0: F0") and "F0c1" in text and "I0c1" in text
    assert "rank 1" in render_svg(t)


def _torch_order(cls, p, m):
    """torch's per-rank order for its V schedule class, in this package's actions (its
    overlapped F&B pairs expanded; private API, stable since torch 2.9)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as ts

    kinds = {ts.F: "F", ts.I: "I", ts.W: "W", ts.B: "B"}
    fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
    rows = []
    for r in range(p):
        row = []
        for a in filter(None, cls._calculate_single_rank_operations(fake, r)):
            for sub in a.sub_actions if a.computation_type == ts.OVERLAP_F_B else (a,):
                row.append(Action(kinds[sub.computation_type], sub.microbatch_index,
                                  0 if sub.stage_index == r else 1))
        rows.append(tuple(row))
    return tuple(rows)


@pytest.mark.parametrize(("name", "torch_name"), [("zbv", "ScheduleZBVZeroBubble"),
                                                  ("dualpipev", "ScheduleDualPipeV")])
def test_v_orders_are_torchs(name, torch_name):
    """The benchmark's peer runs the very order paraxis runs."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = getattr(schedules, torch_name, None)
    if cls is None or not hasattr(cls, "_calculate_single_rank_operations"):
        pytest.skip(f"this torch has no {torch_name} order to compare with")
    for p, m in V_GRID:
        if name == "dualpipev" and m < 2 * p:
            continue
        assert build(name, p, m, 2).actions == _torch_order(cls, p, m), (p, m)


def test_a_measured_timeline_counts_the_hand_overs_inside_its_makespan():
    """The p2p part of a measured bubble: each rank's transfer spans, clipped to the
    makespan (a send awaited after the last action is not the bubble's)."""
    f0, f1 = Action("F", 0, 0), Action("F", 0, 0)
    t = Timeline(2, (((f0, 0.0, 4.0),), ((f1, 5.0, 10.0),)), "measured",
                 transfers=(((4.0, 5.0), (10.0, 12.0)), ((-1.0, 1.0),)))
    assert t.makespan == 10.0 and t.bubble == pytest.approx(1 - 9 / 20)
    assert (t.handing(0), t.handing(1)) == (1.0, 1.0)
    assert t.handing_share == pytest.approx(2 / 20)
    assert Timeline(2, t.entries).handing_share == 0.0  # simulated: none


def test_stage_0s_whole_backward_is_b_plus_w_and_its_split_one_i_and_w():
    """Without deferred weight GEMMs stage 0's I does nothing and its W runs the whole
    backward, which the runner records as a B (test_pp_tiny runs it): B+W; with them it
    measures I and W apart."""
    from paraxis_pp.timeline import stage_times

    s = build("zero_bubble_h1", 2, 2)
    i0, w0, ms = Action("I", 0, 0), Action("W", 0, 0), 1e-3
    f0 = (Action("F", 0, 0), 0.0, 1 * ms)
    other = ((Action("F", 0, 0), 1 * ms, 2 * ms),)
    b0 = Action("B", 0, 0)
    whole, _ = stage_times(Timeline(2, ((f0, (b0, 3 * ms, 5 * ms)), other)), s)
    split, _ = stage_times(Timeline(2, ((f0, (i0, 3 * ms, 4 * ms), (w0, 4 * ms, 5 * ms)),
                                        other)), s)
    assert "B+W 2 ms" in whole and " I " not in whole and " W " not in whole, whole
    assert "I 1 ms" in split and "W 1 ms" in split and "B+W" not in split, split


def _late(t: Timeline, gap: float) -> Timeline:
    """``t`` as an executor that adds ``gap`` seconds before every action would run it."""
    rows = []
    for row in t.entries:
        rows.append(tuple((a, start + gap * (i + 1), end + gap * (i + 1))
                          for i, (a, start, end) in enumerate(row)))
    return Timeline(t.ranks, tuple(rows), "measured")


@pytest.mark.parametrize(("name", "p", "m", "v"), [
    ("1f1b", 2, 4, 1), ("zero_bubble_h1", 4, 8, 1), ("interleaved_1f1b", 2, 4, 2),
    ("zbv", 2, 8, 2), ("dualpipev", 4, 8, 2)])
def test_a_replay_keeps_the_passes_and_drops_what_lay_between_them(name, p, m, v):
    """Replayed on its own durations, a timeline with nothing between its passes comes
    back as it was; one whose executor added time before every action comes back
    without it, its bubble no larger (the executor's part: measured less replayed)."""
    from paraxis_pp import replay

    s = build(name, p, m, v)
    exact = simulate(s, f=1.0, b=1.3, w=0.7)
    again = replay(s, exact)
    assert [[(a, pytest.approx(x), pytest.approx(y)) for a, x, y in row]
            for row in again.entries] == [list(row) for row in exact.entries]
    late = _late(exact, 0.05)
    assert late.bubble > exact.bubble
    assert replay(s, late).bubble == pytest.approx(exact.bubble)
    # The passes' own durations do show: rank 0 slower, the others wait for it.
    slow = Timeline(p, ((*((a, x, x + 1.5 * (y - x)) for a, x, y in late.entries[0]),),
                        *late.entries[1:]), "measured")
    assert replay(s, slow).bubble > exact.bubble + 0.02


def test_a_replay_runs_a_whole_backward_recorded_for_w_and_refuses_a_missing_pass():
    """A stage 0 without deferred weight GEMMs records no I and its W as the B it ran:
    the replay gives that W the B's duration and the I none. A pass the timeline lacks
    is an error, not a zero."""
    from paraxis_pp import replay

    s = build("zero_bubble_h1", 2, 2)
    exact = simulate(s, f=1.0, b=1.0, w=1.0)
    rows = [list(row) for row in exact.entries]
    rows[0] = [(Action("B", a.mb, a.chunk) if a.kind == "W" else a, x, y + (1.0 if a.kind == "W"
                                                                               else 0.0))
               for a, x, y in rows[0] if a.kind != "I"]
    t = replay(s, Timeline(2, tuple(tuple(r) for r in rows), "measured"))
    took = {a: y - x for a, x, y in t.entries[0]}
    assert took[Action("I", 0, 0)] == 0.0 and took[Action("W", 1, 0)] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="rank 1 has no measured F0"):
        replay(s, Timeline(2, (exact.entries[0], exact.entries[1][1:]), "measured"))
