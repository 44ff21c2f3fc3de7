"""Layer 5, the engine: ``parallelize`` and what it builds.

``apply`` (preflight checks, the strategies applied in phase order, the one call),
``resolve`` (which axes a run needs and the installed packages that provide them),
``plugins`` (the plugin manager factory) and ``builtin`` (core's own plugin),
``engine`` (the :class:`Engine`: steps, loss, clipping, metrics; a checkpoint's
``TrainState``), ``probe`` (the parity probe: refuse, never mistrain), ``loss``,
``optim`` and ``metrics``. Imports the checkpoint layer and everything below it.
"""

from paraxis.engine.apply import parallelize
from paraxis.engine.engine import Engine

__all__ = ["Engine", "parallelize"]
