"""paraxis ZeRO: optimizer state (1), gradients (2) and parameters (3) sharded over
the data axis (Rajbhandari et al., arXiv:1910.02054)."""

from paraxis_zero.layout import ShardLayout
from paraxis_zero.optimizer import zero_optimizer
from paraxis_zero.stage3 import ShardedParameters
from paraxis_zero.stage12 import ShardedOptimizerSync
from paraxis_zero.strategy import ZeroStrategy
from paraxis_zero.whole import WHOLE_BELOW

__all__ = ["WHOLE_BELOW", "ShardLayout", "ShardedOptimizerSync", "ShardedParameters",
           "ZeroStrategy", "zero_optimizer"]
