"""Layer 4, checkpoints that encode the grid (DESIGN section 6).

``state`` (the :class:`TrainState` a checkpoint reads; no engine needed), ``format``
(keys, pieces and the index), ``buffers`` (the model's persistent buffers), ``files``
(checked before trusted), ``write`` (the save's stages), ``background`` (the same stages
with the write in a thread), ``read`` (any grid's checkpoint onto this grid),
``inspect`` (what a checkpoint holds). Imports the parallel contract, the runtime and
config.
"""

from paraxis.checkpoint.files import FORMAT_VERSION, CheckpointError
from paraxis.checkpoint.format import resolve
from paraxis.checkpoint.read import load_checkpoint, read_model_tensors
from paraxis.checkpoint.state import Restored, StateRecord, TrainState
from paraxis.checkpoint.write import save_checkpoint

__all__ = ["FORMAT_VERSION", "CheckpointError", "Restored", "StateRecord", "TrainState",
           "load_checkpoint", "read_model_tensors", "resolve", "save_checkpoint"]
