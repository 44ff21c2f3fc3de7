"""pytest fixture ``worlds``: shared multi-rank worlds for the whole test session.

Load it from a conftest with ``pytest_plugins = ["paraxis.testing.pytest_plugin"]``.
``worlds.run(4, fn, *args)`` runs ``fn`` on the 4-rank world, starting it on first use
and again after a failure broke it, so many tests pay for one start-up.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from paraxis.testing.distributed import WorldPool

__all__ = ["WorldPool", "worlds"]


@pytest.fixture(scope="session")
def worlds() -> Iterator[WorldPool]:
    pool = WorldPool()
    try:
        yield pool
    finally:
        pool.close()
