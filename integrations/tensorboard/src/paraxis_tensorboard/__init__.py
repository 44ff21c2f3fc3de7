"""paraxis-tensorboard: TensorBoard event files for paraxis runs."""

from paraxis_tensorboard.sink import TensorBoardSink

__all__ = ["TensorBoardSink"]
