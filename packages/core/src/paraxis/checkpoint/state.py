"""What a checkpoint reads from a run and gives back: :class:`TrainState`.

The checkpoint code never sees an engine. It reads the fields of a :class:`TrainState`
(the engine is one; a test may pass any object with these fields, such as
:class:`StateRecord`) and :func:`~paraxis.checkpoint.read.load_checkpoint` returns what
the run must take over (:class:`Restored`: the step and the data position) instead of
writing into it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from paraxis.config.parallel import ParallelConfig
    from paraxis.runtime.grid import Grid

__all__ = ["Restored", "StateRecord", "TrainState"]


class TrainState(Protocol):
    """The state of a run a checkpoint holds (DESIGN section 6)."""

    @property
    def model(self) -> nn.Module:
        """Parameters with placement records (:mod:`paraxis.parallel.placement`), and
        persistent buffers (:mod:`paraxis.checkpoint.buffers`)."""
        ...

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """Its state follows its own parameters (the model's, or ZeRO's shards); one
        that holds the weights itself implements ``checkpoint_state`` and
        ``load_checkpoint_state`` (:mod:`paraxis.checkpoint.write`)."""
        ...

    @property
    def scheduler(self) -> Any:
        """``state_dict()`` / ``load_state_dict()``, or None."""
        ...

    # Optionally ``loss_scaler`` (``state_dict()`` / ``load_state_dict()``): fp16's
    # dynamic loss scale (:class:`paraxis.engine.precision.LossScaler`).

    @property
    def grid(self) -> Grid: ...

    @property
    def config(self) -> ParallelConfig: ...

    @property
    def step(self) -> int: ...

    @property
    def data_state(self) -> dict[str, Any]:
        """The data loader's position (samples consumed)."""
        ...

    @property
    def rng_streams(self) -> Mapping[str, Any]:
        """Per-rank random streams besides torch's default one (``get_state()``,
        ``set_state(tensor)``), by name."""
        ...


@dataclass
class StateRecord:
    """A :class:`TrainState` as plain fields (tests, tools)."""

    model: Any
    optimizer: Any
    grid: Any
    config: Any
    scheduler: Any = None
    step: int = 0
    data_state: dict[str, Any] = field(default_factory=dict)
    rng_streams: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Restored:
    """What a loaded checkpoint hands back to the run."""

    step: int
    data_state: dict[str, Any]
