"""Layer 2, runtime: the processes of a run and how they talk.

``world`` (joining the default group: torchrun's environment or a world of one; the
device), ``group`` (one rank's :class:`AxisGroup`), ``grid`` (the rank layout and every
named group, passed explicitly), ``comm_stats`` (bytes and blocked seconds per axis and
op), ``collectives`` (counted collectives on tensors and buffers), ``differentiable``
(the conjugate pairs a model's forward needs), ``ring`` (collectives cut into ring hops
interleaved with compute), ``liveness`` (which rank died). Imports
only :mod:`paraxis.config`.
"""

from paraxis.runtime.grid import DENSE_REPLICA_AXES, EXPERT_REPLICA_AXES, Grid, GridLayout, shutdown
from paraxis.runtime.group import AxisGroup

__all__ = ["DENSE_REPLICA_AXES", "EXPERT_REPLICA_AXES", "AxisGroup", "Grid", "GridLayout",
           "shutdown"]
