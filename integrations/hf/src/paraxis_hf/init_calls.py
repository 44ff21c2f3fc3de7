"""The ``torch.nn.init`` functions transformers calls, each as a rule on the global shape.

transformers routes every init of ``initialize_weights`` through
``transformers.initialization`` (``guard_torch_init_functions`` swaps ``torch.nn.init.*``
for its own wrappers, which call the originals kept in ``TORCH_INIT_FUNCTIONS``), so the
recorder (:mod:`paraxis_hf.init_rules`) sees each call there by name, with its arguments,
whatever the tensor's device: on the meta device ``trunc_normal_`` and ``orthogonal_``
return before reaching any Tensor method, and a recorder of Tensor methods alone never
sees them (issue 32: ModernBERT's ``Wo`` kept an earlier ``normal_`` at 3.2x its std).
The fan-based functions (Glorot & Bengio 2010; He et al. 2015) become the draw they end
in, with torch's own fan and gain on the meta tensor's global shape, so a shard is drawn
as the whole tensor would be; ``lecun_normal_`` and ``default_flax_embed_init_`` reach
here as the ``trunc_normal_`` / ``normal_`` they call. Any other function (``eye_``,
``dirac_``, ``orthogonal_``, ``sparse_``, one added later) has no rule: the recorder
refuses the parameter by the function's name rather than keep another distribution.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import init

from paraxis_hf.invariant_init import Copy, Draw, Fill, InitRule

__all__ = ["INIT_FUNCTION_RULES", "init_function_rule", "scaled"]


def _spread(kind: str, std: float) -> Draw:
    """The zero-mean ``normal`` of ``std``, or the ``uniform`` of the same std."""
    if kind == "normal":
        return Draw("normal", 0.0, std)
    bound = math.sqrt(3.0) * std  # torch's own: U(-b, b) has std b / sqrt(3)
    return Draw("uniform", -bound, bound)


def _xavier(kind: str) -> Callable[[torch.Tensor, dict[str, Any]], Draw]:
    def rule(tensor: torch.Tensor, args: dict[str, Any]) -> Draw:
        fan_in, fan_out = init._calculate_fan_in_and_fan_out(tensor)
        return _spread(kind, float(args["gain"]) * math.sqrt(2.0 / float(fan_in + fan_out)))

    return rule


def _kaiming(kind: str) -> Callable[[torch.Tensor, dict[str, Any]], Draw]:
    def rule(tensor: torch.Tensor, args: dict[str, Any]) -> Draw:
        fan = init._calculate_correct_fan(tensor, args["mode"])
        gain = init.calculate_gain(args["nonlinearity"], args["a"])
        return _spread(kind, gain / math.sqrt(fan))

    return rule


# name in TORCH_INIT_FUNCTIONS -> rule from (tensor, arguments bound to torch's signature)
INIT_FUNCTION_RULES: dict[str, Callable[[torch.Tensor, dict[str, Any]], Draw | Fill]] = {
    "normal_": lambda t, a: Draw("normal", float(a["mean"]), float(a["std"])),
    "uniform_": lambda t, a: Draw("uniform", float(a["a"]), float(a["b"])),
    "trunc_normal_": lambda t, a: Draw("trunc_normal", float(a["mean"]), float(a["std"]),
                                       float(a["a"]), float(a["b"])),
    "constant_": lambda t, a: Fill(float(a["val"])),
    "ones_": lambda t, a: Fill(1.0),
    "zeros_": lambda t, a: Fill(0.0),
    "xavier_uniform_": _xavier("uniform"),
    "xavier_normal_": _xavier("normal"),
    "kaiming_uniform_": _kaiming("uniform"),
    "kaiming_normal_": _kaiming("normal"),
}


def init_function_rule(name: str, function: Callable[..., Any], tensor: torch.Tensor,
                       args: tuple, kwargs: dict[str, Any]) -> Draw | Fill | str:
    """The rule ``function`` (``torch.nn.init.<name>``) would fill ``tensor`` by, given
    the call's other arguments; or why there is none (a string naming the function)."""
    if name not in INIT_FUNCTION_RULES:
        return (f"torch.nn.init.{name} (paraxis has no layout-invariant rule for it; "
                "known: " + ", ".join(INIT_FUNCTION_RULES) + ")")
    try:
        bound = inspect.signature(function).bind(tensor, *args, **kwargs)
        bound.apply_defaults()
        if tensor.numel() == 0:
            return Fill(0.0)
        return INIT_FUNCTION_RULES[name](tensor, dict(bound.arguments))
    except (TypeError, ValueError, RuntimeError, ZeroDivisionError, NotImplementedError) as exc:
        return f"torch.nn.init.{name} with arguments paraxis cannot read ({exc})"


def scaled(rule: InitRule, factor: float) -> InitRule:
    """``rule`` times ``factor``: GPT-2-style rescaling (``p.mul_(c)``, or
    ``copy_(p, p / c)`` after a draw, as Nemotron-H's ``out_proj`` does)."""
    base = rule.base
    if isinstance(base, Fill):
        new: Draw | Fill | Copy = Fill(base.value * factor)
    elif isinstance(base, Copy):
        new = Copy(base.values * factor)
    elif base.kind == "uniform":
        low, high = sorted((base.a * factor, base.b * factor))
        new = Draw("uniform", low, high)
    elif base.kind == "trunc_normal":  # location, scale and the cut, in order
        low, high = sorted((base.lo * factor, base.hi * factor))
        new = Draw(base.kind, base.a * factor, base.b * abs(factor), low, high)
    else:
        new = Draw(base.kind, base.a * factor, base.b * abs(factor))
    return InitRule(new, tuple((a, b, v * factor) for a, b, v in rule.rows))
