"""Quantities on the command line and in reports: bytes, bytes per second, FLOP/s.

Decimal prefixes are decimal (``80GB`` is 80e9 bytes, the convention of the ZeRO paper's
tables and of link datasheets); binary ones are binary (``80GiB`` is 80 x 2^30). Every
parse error is a :class:`PlanInputError` whose message is one line saying what was
wrong, the value seen and what to write instead.
"""

from __future__ import annotations

import re

__all__ = ["PlanInputError", "fmt_bytes", "fmt_count", "fmt_rate", "fmt_seconds",
           "parse_bandwidth", "parse_bytes", "parse_flops"]


class PlanInputError(ValueError):
    """Bad input to the planner; the message is one line meant for the user."""


_PREFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "KI": 2.0**10, "MI": 2.0**20, "GI": 2.0**30, "TI": 2.0**40, "PI": 2.0**50}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGTP]i?)?(.*?)\s*$",
                       re.IGNORECASE)


def _parse(text: str, units: tuple[str, ...], what: str, example: str) -> float:
    match = _QUANTITY.match(str(text))
    if match is None or match.group(3).upper() not in units:
        raise PlanInputError(f"{what} {text!r} is not a quantity I can read; write e.g. "
                             f"{example}")
    number, prefix = float(match.group(1)), (match.group(2) or "").upper()
    value = number * _PREFIX[prefix]
    if value <= 0:
        raise PlanInputError(f"{what} {text!r} must be positive; write e.g. {example}")
    return value


def parse_bytes(text: str, what: str = "--device-memory") -> float:
    """``80GB`` -> 8e10, ``80GiB`` -> 85899345920.0, ``8e10`` -> 8e10."""
    return _parse(text, ("", "B"), what, "80GB or 80GiB")


def parse_flops(text: str, what: str = "--peak-flops") -> float:
    """``989T`` or ``989TFLOPS`` or ``9.89e14`` -> 9.89e14 FLOP/s."""
    return _parse(text, ("", "FLOPS", "FLOP/S"), what, "989e12 or 989T")


def parse_bandwidth(text: str) -> dict[str, float]:
    """``intra=450GB/s,inter=50GB/s`` -> {"intra": 4.5e11, "inter": 5e10} (bytes/s)."""
    out: dict[str, float] = {}
    for part in str(text).split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in ("intra", "inter"):
            raise PlanInputError(f"--bandwidth {text!r}: each part must be intra=RATE or "
                                 "inter=RATE; write e.g. intra=450GB/s,inter=50GB/s")
        out[key] = _parse(value, ("", "B/S", "B"), f"--bandwidth {key}", "450GB/s")
    missing = [k for k in ("intra", "inter") if k not in out]
    if missing:
        raise PlanInputError(f"--bandwidth {text!r} lacks {' and '.join(missing)}; give "
                             "both links, e.g. intra=450GB/s,inter=50GB/s")
    return out


def fmt_bytes(n: float) -> str:
    """Decimal units: 1.5e9 -> '1.50 GB'."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_rate(n: float) -> str:
    return fmt_bytes(n) + "/s"


def fmt_seconds(s: float) -> str:
    """0.0123 -> '12.3 ms'."""
    if abs(s) >= 1:
        return f"{s:.2f} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.1f} us"


def fmt_count(n: float) -> str:
    """70553706496 -> '70.6B', 84288 -> '84.3k'."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"
