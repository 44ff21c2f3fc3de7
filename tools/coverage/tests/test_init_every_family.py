"""Every family ``paraxis train`` builds on the meta device starts from its own init
(issue 32), and the counts docs/architecture.md quotes are this census's.

Each text-only causal LM type of the coverage matrix is built as the trainer builds it
(:mod:`paraxis_coverage.init_census`); each one that replays is compared, parameter by
parameter, with an eager build of the same tiny config: the rule must be the
distribution the eager tensor was drawn from (mean, std, Kolmogorov-Smirnov, the reach
of its extremes, its support; constants and padding rows exactly), at the allowances
``paraxis.testing.samples.SampleAllowance`` derives from each tensor's size. Planted:
a recorder blind to ``trunc_normal_`` on meta (torch 2.13 returns before any Tensor
method) and ties recorded after their target's init each fail it.
"""

from __future__ import annotations

import collections
import contextlib
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ARCHITECTURE = Path(__file__).resolve().parents[3] / "docs" / "architecture.md"


@pytest.fixture(scope="module")
def rows():
    import warnings

    from transformers.utils import logging as hf_logging

    from paraxis_coverage.init_census import census

    hf_logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return census()


def test_every_replayed_family_draws_as_its_eager_build(rows):
    count = collections.Counter(r.status for r in rows)
    print("init census:", dict(count))
    assert count["replay"] >= len(rows) // 2, count  # the census ran, and replays
    bad = {r.model_type: list(r.mismatches[:3]) for r in rows if r.mismatches}
    assert not bad, f"{len(bad)} replayed families unlike eager: {bad}"
    assert all(r.compared for r in rows if r.status == "replay")


def test_the_documented_counts_are_this_census(rows):
    """docs/architecture.md quotes ``census_sentence`` for the transformers release it
    names; under another release the counts differ by design and are not compared."""
    import transformers

    from paraxis_coverage.init_census import census_sentence

    doc = " ".join(ARCHITECTURE.read_text().split())
    quoted = re.search(r"text-only causal LM types of transformers (\S+) \(the coverage", doc)
    assert quoted, "docs/architecture.md no longer quotes the init census"
    if quoted.group(1) != transformers.__version__:
        pytest.skip(f"docs/architecture.md quotes transformers {quoted.group(1)}'s census; "
                    f"{transformers.__version__} is installed")
    assert census_sentence(rows) in doc, (
        f"docs/architecture.md's init counts are not this census's ({census_sentence(rows)}); "
        "regenerate with python -m paraxis_coverage.init_census")


def planted_row(family, monkeypatch, plant):
    from paraxis_coverage.init_census import census_family
    from paraxis_hf import init_rules, materialize
    from paraxis_hf.families import build_family, causal_lm_types

    if plant == "trunc_normal_ unseen on meta":
        monkeypatch.setattr(init_rules, "_recording_init_functions",
                            lambda recorder: contextlib.nullcontext())
    else:  # "tied before the init"
        meta_model = materialize.meta_model
        monkeypatch.setattr(materialize, "meta_model",
                            lambda config, untied=False: meta_model(config, untied=False))
    return census_family(build_family(family, causal_lm_types()[family]))


@pytest.mark.parametrize(("family", "plant", "parameter"), [
    ("modernbert-decoder", "trunc_normal_ unseen on meta", "layers.0.attn.Wo.weight: std"),
    ("youtu", "tied before the init", "embed_tokens.weight: std")])
def test_a_planted_recorder_defect_fails_the_comparison(monkeypatch, family, plant, parameter):
    row = planted_row(family, monkeypatch, plant)
    assert row.status == "replay" and any(parameter in m for m in row.mismatches), row
