"""Which DeepSpeed the bridge supports, read without importing DeepSpeed."""

from __future__ import annotations

import re
from importlib import metadata

__all__ = ["SUPPORTED", "installed_version", "parse", "supported"]

# [lowest, first unsupported): written and tested against 0.19.8's engine, ZeRO
# optimizers and tensor-fragment API (safe_get_full_*), which 0.20 may change.
SUPPORTED = ((0, 19, 8), (0, 20, 0))
SUPPORTED_SPEC = "deepspeed>=0.19.8,<0.20"


def parse(version: str) -> tuple[int, int, int]:
    """``0.19.8`` (or ``0.19.8+abc``, ``0.20.0rc1``) -> (0, 19, 8)."""
    parts = [int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3]]
    return tuple([*parts, 0, 0, 0][:3])  # type: ignore[return-value]


def installed_version() -> str | None:
    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return None


def supported(version: str) -> bool:
    low, high = SUPPORTED
    return low <= parse(version) < high
