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
        lines = [f"{len(self.problems)} configuration problem(s):"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


class MissingAxisPackageError(ImportError):
    """A parallel axis was requested whose package is not installed."""

    def __init__(self, axis: str, distribution: str):
        self.axis = axis
        self.distribution = distribution
        super().__init__(
            f"the '{axis}' axis was requested but no installed plugin provides it. "
            f"Install it with: pip install {distribution}"
        )
