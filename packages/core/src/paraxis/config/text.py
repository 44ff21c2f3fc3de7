"""Text and validation helpers of the configuration loaders: a YAML file read with
``${VAR}`` expansion and its syntax errors as problems naming the file and line,
``key.path=value`` overrides, and pydantic's errors as
:class:`~paraxis.config.errors.Problem` s (a misspelled key with the nearest valid
name)."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from paraxis.config.errors import ConfigError, Problem

__all__ = ["apply_overrides", "expand_env", "nearest", "parse_yaml", "problem_from_pydantic",
           "read_config"]


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


def parse_yaml(text: str, source: str = "<config>", *, lines: bool = True) -> Any:
    """``yaml.safe_load``; a syntax error is a :class:`ConfigError` naming ``source``, the
    line (unless ``lines`` is false: a one-line override) and the text there, not a
    traceback from inside the parser. The line is where the parser stopped, unless that
    is past the text (an unclosed bracket or quote): then where the construct it was
    reading began."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        rows = text.splitlines()
        mark = getattr(exc, "problem_mark", None)
        begun = getattr(exc, "context_mark", None)
        if begun is not None and (mark is None or mark.line >= len(rows)
                                  or not rows[mark.line].strip()):
            mark = begun
        line = mark.line if mark is not None else len(rows)
        what = getattr(exc, "problem", None) or str(exc)
        context = getattr(exc, "context", None)
        raise ConfigError([Problem(
            f"{source}:{line + 1}" if lines and mark is not None else source,
            rows[line].strip() if line < len(rows) else "",
            f"is not valid YAML: {what}" + (f" ({context})" if context else ""),
            "correct the YAML there (indent with spaces, close every bracket and quote, "
            "write key: value)")]) from None


def read_config(path: str | os.PathLike[str], env: Mapping[str, str]) -> dict[str, Any]:
    """The YAML mapping in ``path``, ``${VAR}`` expanded from ``env``; an unreadable
    file, a syntax error or a top level that is not a mapping is a ConfigError."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([Problem("--config", str(path), f"cannot be read ({exc})",
                                   "give the path of a YAML run configuration")]) from None
    raw = parse_yaml(expand_env(text, env, source=str(path)), str(path)) or {}
    if not isinstance(raw, dict):
        raise ConfigError([Problem(str(path), type(raw).__name__, "must be a YAML mapping",
                                   "write sections such as 'train:' at top level")])
    return raw


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> None:
    """``train.steps=50`` sets raw["train"]["steps"] = 50 (the value parsed as YAML);
    every malformed override is reported, all at once."""
    bad = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            bad.append(Problem("override", item, "must look like section.key=value",
                               "write e.g. train.steps=50"))
            continue
        node = raw
        *parents, leaf = key.split(".")
        for depth, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                where = ".".join(parents[:depth + 1])
                bad.append(Problem(f"override {item}", node, f"{where} is not a section",
                                   f"override the keys of a section, not of {where}"))
                break
        else:
            try:
                node[leaf] = parse_yaml(value, f"override {key}", lines=False)
            except ConfigError as exc:
                bad += exc.problems
    if bad:
        raise ConfigError(bad)


def nearest(name: str, valid: list[str] | tuple[str, ...]) -> str | None:
    """The valid name closest to a misspelled ``name`` (difflib's ratio), or None."""
    found = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return found[0] if found else None


def _keys_at(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> list[str] | None:
    """The keys a mapping at ``loc`` (under ``model``) may hold: the field names and
    aliases of the section model found by walking ``loc``'s fields, or None when the
    walk leaves the sections (a free-form mapping)."""
    for part in loc:
        field = model.model_fields.get(str(part)) if model is not None else None
        if field is None:
            field = next((f for f in (model.model_fields.values() if model else ())
                          if f.alias == part), None)
        kind = getattr(field, "annotation", None)
        if not (isinstance(kind, type) and issubclass(kind, BaseModel)):
            return None
        model = kind
    if model is None:
        return None
    return [*model.model_fields, *(f.alias for f in model.model_fields.values() if f.alias)]


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


def problem_from_pydantic(err: Mapping[str, Any], model: type[BaseModel] | None = None
                          ) -> Problem:
    """One pydantic error as a :class:`Problem`. With ``model`` (the section type that was
    validated), a key no section has (``train.setps``) names the nearest valid key as
    its fix (``train.steps``), or the keys there are when none is near."""
    loc = tuple(err["loc"])
    field = ".".join(str(p) for p in loc)
    fix = _FIXES.get(err["type"], "change the value so that the rule holds")
    rule = str(err["msg"]).rstrip(".")
    if err["type"] == "extra_forbidden":
        keys = _keys_at(model, loc[:-1])
        if keys is not None:
            parent = ".".join(str(p) for p in loc[:-1])
            near = nearest(str(loc[-1]), keys)
            prefix = f"{parent}." if parent else ""
            rule = f"is not a key of {parent or 'the configuration'}"
            fix = (f"write {prefix}{near} (the nearest valid key), or remove it" if near
                   else f"use one of {', '.join(sorted(keys))}, or remove it")
    return Problem(field, err.get("input"), rule, fix)
