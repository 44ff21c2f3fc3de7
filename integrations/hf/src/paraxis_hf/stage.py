"""How a pipeline stage runs a transformers causal LM (:class:`paraxis.parallel.stages.StageCalls`).

Core builds each stage from the model itself (other stages' layers skipped, see
:mod:`paraxis.parallel.stages`); this module only says how to call it: the last stage calls the
causal LM's own forward for logits, so the head, any logit softcapping or scaling stay
the model's; the others call its base model (``base_model_prefix``) for the hidden
states after the layers. Stages after the first pass the received hidden states as
``inputs_embeds``, which every transformers decoder accepts in place of ids.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paraxis.parallel.model_plan import PlanError

__all__ = ["HFStageCalls"]


class HFStageCalls:
    def __init__(self, prefix: str):
        self.prefix = prefix

    def logits(self, model: nn.Module, **kwargs: Any) -> torch.Tensor:
        # The class's forward: the stage's own instance forward is what calls us.
        return type(model).forward(model, **kwargs).logits

    def hidden(self, model: nn.Module, **kwargs: Any) -> torch.Tensor:
        try:  # a dotted path under a wrapper (peft's base_model.model.model)
            base = model.get_submodule(self.prefix)
        except AttributeError:
            base = None
        if base is None:
            raise PlanError(f"{type(model).__name__} has no base model "
                            f"{self.prefix!r} to run a pipeline stage's layers")
        return base(**kwargs).last_hidden_state
