"""Text and validation helpers of the configuration loaders: ``${VAR}`` expansion in
YAML text, and pydantic's errors as :class:`~paraxis.config.errors.Problem` s."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from paraxis.config.errors import ConfigError, Problem

__all__ = ["expand_env", "problem_from_pydantic"]


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(text: str, env: Mapping[str, str], source: str = "<config>") -> str:
    """Replace ``${VAR}`` (or ``${VAR:-default}``) in YAML text before it is parsed.

    Expansion is textual because the seed format puts references inside flow mappings
    (``{data: ${DP}}``), which YAML cannot parse unexpanded; after it, ``data: 2`` parses
    as an integer. Comment lines are left alone. All unset variables are reported
    together, each with its line.
    """
    missing: list[Problem] = []
    lines = text.splitlines(keepends=True)
    for number, line in enumerate(lines, start=1):
        if line.lstrip().startswith("#"):
            continue

        def lookup(match: re.Match[str], number: int = number, line: str = line) -> str:
            name, default = match.group(1), match.group(2)
            if name in env:
                return env[name]
            if default is not None:
                return default
            missing.append(Problem(f"{source}:{number}", line.strip(),
                                   f"environment variable {name} is not set",
                                   f"export {name}=... or write a literal value"))
            return match.group(0)

        lines[number - 1] = _VAR.sub(lookup, line)
    if missing:
        raise ConfigError(missing)
    return "".join(lines)


_FIXES = {
    "extra_forbidden": "remove it or correct its spelling",
    "greater_than": "use a positive value",
    "int_parsing": "use a whole number",
    "int_type": "use a whole number",
    "bool_parsing": "use true or false",
    "literal_error": "use one of the allowed values",
    "model_type": "write this section as a mapping",
    "dict_type": "write this section as a mapping",
}


def problem_from_pydantic(err: Mapping[str, Any]) -> Problem:
    field = ".".join(str(p) for p in err["loc"])
    fix = _FIXES.get(err["type"], "change the value so that the rule holds")
    return Problem(field, err.get("input"), str(err["msg"]).rstrip("."), fix)
