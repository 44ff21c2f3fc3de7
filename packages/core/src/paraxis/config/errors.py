"""Errors that report every problem at once, each with the field, value, rule and fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ConfigError", "MissingAxisPackageError", "Problem"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a configuration.

    ``field`` is a dotted path (``parallelism.tensor``), ``value`` what was seen,
    ``rule`` the constraint it breaks and ``fix`` what to change.
    """

    field: str
    value: Any
    rule: str
    fix: str

    def __str__(self) -> str:
        return f"{self.field} = {self.value!r}: {self.rule}. Fix: {self.fix}."


class ConfigError(ValueError):
    """A configuration broke one or more rules; ``problems`` lists all of them."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        if len(self.problems) == 1:  # one problem, one line (the CLI prints it as is)
            super().__init__(str(self.problems[0]))
            return
        lines = [f"{len(self.problems)} configuration problem(s):"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


class MissingAxisPackageError(ConfigError, ImportError):
    """A parallel axis was requested whose package is not installed.

    It is a :class:`ConfigError` too: ``problems`` holds the missing package's problem
    and every other problem found before any process group (a user who installed core
    alone sees the configuration's own mistakes in the same message)."""

    def __init__(self, axis: str, distribution: str, problems: list[Problem] | None = None):
        self.axis = axis
        self.distribution = distribution
        super().__init__(list(problems or []))
        lead = (f"the '{axis}' axis was requested but no installed plugin provides it. "
                f"Install it with: pip install {distribution}")
        others = [p for p in self.problems if distribution not in p.fix]
        if others:
            lead += "\n" + "\n".join([f"{len(others)} other configuration problem(s):",
                                       *(f"  - {p}" for p in others)])
        self.args = (lead,)
