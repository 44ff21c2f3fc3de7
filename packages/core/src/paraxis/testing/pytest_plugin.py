"""pytest fixture ``worlds``: shared multi-rank worlds for the whole test session.

Load it from a conftest with ``pytest_plugins = ["paraxis.testing.pytest_plugin"]``.
``worlds.run(4, fn, *args)`` runs ``fn`` on the 4-rank world, starting it on first use
and again after a failure broke it, so many tests pay for one start-up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from paraxis.testing.distributed import DEFAULT_TIMEOUT, DistributedWorld


class WorldPool:
    def __init__(self, timeout: float = DEFAULT_TIMEOUT):
        self.timeout = timeout
        self._worlds: dict[int, DistributedWorld] = {}

    def run(self, world_size: int, fn: Callable[..., Any], *args: Any,
            timeout: float | None = None) -> list[Any]:
        world = self._worlds.get(world_size)
        if world is None or world.broken:
            world = DistributedWorld(world_size, timeout=self.timeout).start()
            self._worlds[world_size] = world
        return world.run(fn, *args, timeout=timeout)

    def restart(self, world_size: int) -> None:
        """Close the world of ``world_size``; the next run starts a fresh one (after a
        failure that may have left a rank inside a collective)."""
        world = self._worlds.pop(world_size, None)
        if world is not None:
            world.broken = True  # do not wait for ranks that may be stuck
            world.close()

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()


@pytest.fixture(scope="session")
def worlds() -> Iterator[WorldPool]:
    pool = WorldPool()
    try:
        yield pool
    finally:
        pool.close()
