"""The efficiency table (issue 38): curves, overrides, files, calibration."""

import json
import re

import pytest

from paraxis.planner import calibrate as calibrate_module
from paraxis.planner.calibrate import _fit_line, calibrate
from paraxis.planner.efficiency import (
    BUILTIN,
    Curve,
    load_efficiency,
    override,
    write_efficiency,
)
from paraxis.planner.units import PlanInputError


def test_curve_interpolates_in_log_size_and_is_flat_beyond_its_ends():
    curve = Curve(((1e6, 0.1), (1e8, 0.5)))
    assert curve.at(1e5) == 0.1 and curve.at(1e9) == 0.5
    assert curve.at(1e7) == pytest.approx(0.3)  # halfway in log(size)


def test_builtin_tables_cite_their_figures_and_stay_shares():
    for eff in BUILTIN.values():
        for curve in (eff.gemm, eff.attention):
            sizes = [s for s, _ in curve.points]
            assert sizes == sorted(sizes) and all(0 < f <= 1 for _, f in curve.points)
        assert eff.sources and 0 < eff.sustained <= 1
    # The Transformer Engine table's attention (cuDNN) is faster than eager SDPA's.
    assert BUILTIN["h100-te"].attention.at(8192) > BUILTIN["h100"].attention.at(8192)


def test_override_sets_single_figures():
    eff = override(BUILTIN["h100"], "gemm=0.5,link=0.7,latency=1e-5")
    assert eff.gemm.at(1e3) == eff.gemm.at(1e13) == 0.5
    assert eff.link_efficiency == 0.7 and eff.collective_s == 1e-5
    assert "with gemm=0.5" in eff.name


@pytest.mark.parametrize(("text", "words"), [
    ("gemms=0.5", "KEY one of"), ("gemm", "KEY=NUMBER"), ("gemm=fast", "not a number"),
    ("gemm=1.5", "share in [0, 1]"), ("launch=-1", ">= 0")])
def test_bad_overrides_are_one_line(text, words):
    with pytest.raises(PlanInputError, match=re.escape(words)) as info:
        override(BUILTIN["h100"], text)
    assert "\n" not in str(info.value)


def test_a_written_table_reads_back(tmp_path):
    path = tmp_path / "table.json"
    write_efficiency(BUILTIN["h200"], path)
    back = load_efficiency(str(path))
    assert back.device == BUILTIN["h200"].device and back.gemm == BUILTIN["h200"].gemm
    assert back.elementwise == BUILTIN["h200"].elementwise
    assert back.sustained == BUILTIN["h200"].sustained


def test_a_missing_or_broken_table_is_one_line(tmp_path):
    with pytest.raises(PlanInputError, match="neither a built-in table"):
        load_efficiency(str(tmp_path / "nope.json"))
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"name": "x"}))
    with pytest.raises(PlanInputError, match="is not an efficiency table"):
        load_efficiency(str(broken))


def test_the_link_fit_recovers_latency_and_bandwidth():
    points = [(x, 50e-6 + x / 2e9) for x in (4e3, 6e4, 1e6, 8e6)]
    latency, bandwidth = _fit_line(points)
    assert latency == pytest.approx(50e-6, rel=1e-6)
    assert bandwidth == pytest.approx(2e9, rel=1e-6)


def test_calibration_measures_this_machine(monkeypatch):
    """One rank (no link probe), a few shapes: shares of the fastest GEMM measured, the
    smallest GEMM the least efficient (shapes of equal FLOPs merge into their median,
    so the top share need not be exactly 1)."""
    monkeypatch.setattr(calibrate_module, "GEMM_M", (8, 256))
    monkeypatch.setattr(calibrate_module, "GEMM_NK", (16, 256))
    monkeypatch.setattr(calibrate_module, "SEQS", (32, 128))
    eff = calibrate(world=1, links=False)
    assert eff.device.peak_flops > 1e8 and eff.device.memory_bw > 1e8
    shares = [f for _, f in eff.gemm.points]
    assert 0.5 < max(shares) <= 1.0 and shares[0] < max(shares)
    assert eff.launch_s == 0 and eff.op_s > 0 and eff.sustained == 1.0
