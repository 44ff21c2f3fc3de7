"""The coverage matrix: every transformers causal LM through paraxis' parallel layouts.

A tool, not part of the product (issue 33): ``python -m paraxis_coverage`` (``nox -s
coverage``) writes ``docs/coverage.md``. Split by concern: :mod:`~paraxis_coverage.cells`
(the columns and what a cell says), :mod:`~paraxis_coverage.checks` (the runs on ranks
and their comparison), :mod:`~paraxis_coverage.shares` (the shard proof),
:mod:`~paraxis_coverage.drift` (ill-conditioned models), :mod:`~paraxis_coverage.runner`
(worlds kept alive, timeouts), :mod:`~paraxis_coverage.report` (the markdown) and
:mod:`~paraxis_coverage.init_census` (the families whose init paraxis-hf replays). The
tiny models are paraxis-hf's (:mod:`paraxis_hf.families`, :mod:`paraxis_hf.shrink`).
"""

from paraxis_coverage.cells import CHECKS, Check, Outcome, available_checks
from paraxis_coverage.runner import Row, run_family

__all__ = ["CHECKS", "Check", "Outcome", "Row", "available_checks", "run_family"]
