"""The ``lora:`` section: low-rank adapters on a frozen model (LoRA, Hu et al.,
arXiv:2106.09685), built by peft through paraxis-hf (``pip install 'paraxis-hf[peft]'``).

``paraxis train`` wraps the model it built (``model.family`` or ``model.pretrained``)
with ``peft.get_peft_model(model, LoraConfig(...))`` before any axis applies: every
weight of the model is frozen but the adapters and ``modules_to_save``, and each axis
places an adapter with its base layer (docs/architecture.md, "LoRA").
"""

from __future__ import annotations

from pydantic import Field, PositiveFloat, PositiveInt

from paraxis.config.parallel import _Section

__all__ = ["LoraSection"]


class LoraSection(_Section):
    """``rank`` r and ``alpha``: the adapter's update is ``B A x * alpha / r``.
    ``target_modules``: peft's rule, a list of module-name suffixes (``q_proj``) or one
    regular expression matched against whole names, or ``all-linear`` (every linear
    layer but the head); None takes peft's default for the model type (Llama: q_proj and
    v_proj). Each listed name must match some module, or the run is refused before it
    starts. ``modules_to_save``: modules trained whole beside the adapters (a resized
    embedding or head)."""

    rank: PositiveInt = 8
    alpha: PositiveFloat = 16.0
    dropout: float = Field(default=0.0, ge=0, lt=1)
    target_modules: list[str] | str | None = None
    modules_to_save: list[str] = Field(default_factory=list)
