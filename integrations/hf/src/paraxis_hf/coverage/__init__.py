"""The coverage matrix: every transformers causal LM through paraxis' parallel layouts.

``python -m paraxis_hf.coverage`` writes ``docs/coverage.md``. Split by concern:
:mod:`~paraxis_hf.shrink` (tiny configs, as data plus rules),
:mod:`~paraxis_hf.coverage.families` (which types are text-only causal LMs; their tiny
models), :mod:`~paraxis_hf.coverage.checks` (the columns, run on ranks),
:mod:`~paraxis_hf.coverage.runner` (worlds kept alive, timeouts) and
:mod:`~paraxis_hf.coverage.report` (the markdown).
"""

from paraxis_hf.coverage.checks import CHECKS, Check, Outcome, available_checks
from paraxis_hf.coverage.families import Family, build_family, causal_lm_types
from paraxis_hf.coverage.runner import Row, run_family
from paraxis_hf.shrink import tiny_config

__all__ = ["CHECKS", "Check", "Family", "Outcome", "Row", "available_checks", "build_family",
           "causal_lm_types", "run_family", "tiny_config"]
