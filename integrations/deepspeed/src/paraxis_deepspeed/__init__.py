"""paraxis-deepspeed: DeepSpeed's ZeRO-Offload and ZeRO-Infinity behind paraxis's one call.

``parallelize(model, data=2, zero=3, offload={"optimizer": "cpu", "parameters": "cpu"})``
runs DeepSpeed's engine over the model with paraxis's process groups; the engine,
metrics, checkpoints (paraxis's own format) and CLI stay paraxis's. DeepSpeed is
imported only when a run uses the bridge.
"""

from paraxis_deepspeed.translate import bucket_sizes, deepspeed_config
from paraxis_deepspeed.version import SUPPORTED, SUPPORTED_SPEC

__all__ = ["SUPPORTED", "SUPPORTED_SPEC", "bucket_sizes", "deepspeed_config"]
