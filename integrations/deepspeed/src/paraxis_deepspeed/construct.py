"""Constructing a model partitioned (ZeRO-3's ``deepspeed.zero.Init``, Rajbhandari et
al., arXiv:1910.02054, section 7), so a model larger than one rank's memory can be
built: each module's parameters are partitioned over the ranks as soon as the module is
constructed, and offloaded when parameters offload.

The trainer enters :func:`partitioned_construction` (through ``paraxis_model_context``)
around ``paraxis_build_model``. It applies under ZeRO-3 offload without tensor
parallelism: tensor parallelism cuts each weight from the whole tensor, so such a model
is built whole first. The partitions span the whole world, which is DeepSpeed's
data-parallel group then (paraxis's dense replica group with tensor = pipeline = 1).
Hugging Face models initialize their weights after construction; transformers does so
under ``GatheredParameters`` when its DeepSpeed config is set, which this context does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from importlib import metadata
from typing import Any

__all__ = ["partitioned_construction", "wants_partitioned_construction"]


def wants_partitioned_construction(config: Any) -> bool:
    par = config.parallelism
    return par.offload.enabled and par.zero == 3 and par.tensor == 1 and par.pipeline == 1


def partitioned_construction(config: Any) -> contextlib.AbstractContextManager[Any] | None:
    """``deepspeed.zero.Init`` with the run's generated DeepSpeed config, or None."""
    if not wants_partitioned_construction(config) or not hasattr(config, "train"):
        return None
    return _zero_init(config)


@contextlib.contextmanager
def _zero_init(config: Any) -> Iterator[None]:
    import deepspeed

    from paraxis.config.shape import config_size
    from paraxis_deepspeed.ops import extension_cache, skip_inference_comm_op
    from paraxis_deepspeed.translate import deepspeed_config

    extension_cache()
    hidden = config_size(config.model.config, "hidden_size")
    ds_config = deepspeed_config(config, config.train, hidden_size=hidden)
    # DeepSpeed's communication layer over the already joined default group; without it
    # zero.Init would read its config for a world of one.
    skip_inference_comm_op()
    deepspeed.init_distributed(dist_init_required=False)
    with contextlib.ExitStack() as stack:
        if config.model.family != "tiny":  # plain torch modules initialize in __init__
            stack.enter_context(_transformers_knows(ds_config))
        stack.enter_context(deepspeed.zero.Init(config_dict_or_path=ds_config))
        yield


@contextlib.contextmanager
def _transformers_knows(ds_config: dict[str, Any]) -> Iterator[None]:
    """Keep transformers' DeepSpeed config alive (it holds it by weak reference), so a
    Hugging Face model initializes its partitioned weights under GatheredParameters.
    Without it transformers would initialize empty partitions: refused, not mistrained."""
    try:
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig(ds_config)
    except (ImportError, metadata.PackageNotFoundError) as exc:
        raise RuntimeError(
            "paraxis-deepspeed: building a Hugging Face model partitioned (ZeRO-3 offload) "
            "needs transformers' DeepSpeed integration, which needs accelerate "
            f"({exc}); pip install 'accelerate>=1.1.0'") from None
    try:
        yield
    finally:
        del keep
