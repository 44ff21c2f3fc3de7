"""Each parameter's init rule, read from the family's own ``_init_weights``.

A transformers model initializes itself by ``initialize_weights``: the family's
``_init_weights`` on every module, children before parents, each call one of the
``torch.nn.init`` fills (``normal_(std=initializer_range)`` for Linear and Embedding
weights, ``zeros_`` for biases, ``ones_`` for norms, GPT-2's ``c_proj`` at
``initializer_range / sqrt(2 * n_layer)`` after its Conv1D default, and so on). On the
meta device those calls fill nothing, but a ``TorchFunctionMode`` sees each of them with
its arguments, so running ``initialize_weights`` under :class:`_Recorder` yields, per
parameter, the rule the family meant, the last call winning as it would in place. What
the recorder cannot replay layout-invariantly (a fill it does not know, a copy from
another tensor, a parameter no call reaches) is refused with the parameter's name,
rather than guessed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from paraxis_hf.invariant_init import Draw, Fill, InitRule

__all__ = ["record_init_rules"]

# torch.nn.init fills that reach the mode as themselves (they check for overrides) and
# the Tensor methods the others end in; name -> rule from (args, kwargs) after the tensor.
_FILLS = {
    "normal_": lambda a, k: Draw("normal", _arg(a, k, 0, "mean", 0.0),
                                 _arg(a, k, 1, "std", 1.0)),
    "uniform_": lambda a, k: Draw("uniform", _arg(a, k, 0, "a", _arg(a, k, 0, "from", 0.0)),
                                  _arg(a, k, 1, "b", _arg(a, k, 1, "to", 1.0))),
    "trunc_normal_": lambda a, k: Draw("trunc_normal", _arg(a, k, 0, "mean", 0.0),
                                       _arg(a, k, 1, "std", 1.0), _arg(a, k, 2, "a", -2.0),
                                       _arg(a, k, 3, "b", 2.0)),
    "constant_": lambda a, k: Fill(float(_arg(a, k, 0, "val", 0.0))),
    "fill_": lambda a, k: Fill(float(_arg(a, k, 0, "value", 0.0))),
    "zero_": lambda a, k: Fill(0.0),
    "zeros_": lambda a, k: Fill(0.0),
    "ones_": lambda a, k: Fill(1.0),
}
_ALIASES = {"__get__", "detach", "detach_"}  # ``param.data``, ``param.detach()``
_NO_VALUE = {"requires_grad_", "retain_grad"}  # in place, but not on the values


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if index < len(args) else default


class _Recorder(TorchFunctionMode):
    """Records the fills that target a parameter (or its ``.data``, or a row range of
    it); passes every other call through (the meta tensors make them free)."""

    def __init__(self, names: dict[int, str]):
        super().__init__()
        self.names = names
        self.views: dict[int, tuple[str, tuple[int, int] | None]] = {}
        self.keep: list[torch.Tensor] = []  # views stay alive, so their ids stay unique
        self.rules: dict[str, InitRule] = {}
        self.refused: dict[str, str] = {}

    def _target(self, t: Any) -> tuple[str, tuple[int, int] | None] | None:
        if not isinstance(t, torch.Tensor):
            return None
        if id(t) in self.names:
            return self.names[id(t)], None
        return self.views.get(id(t))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args else kwargs.get("tensor")
        target = self._target(tensor)
        if target is None:
            return func(*args, **kwargs)
        name, rows = target
        fname = getattr(func, "__name__", str(func))
        rest = args[1:] if args else ()
        extra = {k: v for k, v in kwargs.items() if k not in ("tensor", "generator")}
        if fname in _ALIASES or fname == "__getitem__":
            out = func(*args, **kwargs)
            span = rows if fname != "__getitem__" else self._rows(name, rows, args[1])
            self.views[id(out)] = (name, span)
            self.keep.append(out)
            return out
        if fname in _FILLS:
            self._record(name, rows, _FILLS[fname](rest, extra), fname)
            return tensor
        if fname.endswith("_") and not fname.startswith("__") and fname not in _NO_VALUE:
            self.refused.setdefault(name, f"{fname} (an in-place op paraxis cannot replay "
                                          "slice by slice)")
            return tensor
        return func(*args, **kwargs)

    def _rows(self, name: str, rows: tuple[int, int] | None,
              index: Any) -> tuple[int, int] | None:
        """The rows of dimension 0 an index selects (an int or a step-1 slice), else a
        refusal noted for ``name``."""
        if rows is None and isinstance(index, int):
            return (index, index + 1)
        if rows is None and isinstance(index, slice) and index.step in (None, 1):
            return (index.start or 0, index.stop if index.stop is not None else 1 << 62)
        self.refused.setdefault(name, f"an indexed fill ({index!r})")
        return (0, 0)

    def _record(self, name: str, rows: tuple[int, int] | None, rule: Draw | Fill,
                fname: str) -> None:
        if rows is None:
            self.rules[name] = InitRule(rule)
        elif isinstance(rule, Fill) and name in self.rules:
            old = self.rules[name]
            self.rules[name] = InitRule(old.base, (*old.rows, (*rows, rule.value)))
        else:
            self.refused.setdefault(name, f"{fname} on rows {rows} of it")


def _clear_flags(model: nn.Module) -> None:
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)


def record_init_rules(model: nn.Module) -> dict[str, InitRule]:
    """Every parameter's rule, by its first name (tied parameters once), from
    ``model.initialize_weights()`` run on the meta device. Raises ValueError naming the
    parameters whose init cannot be reproduced layout-invariantly, and why."""
    named = dict(model.named_parameters())
    if any(not p.is_meta for p in named.values()):
        raise ValueError("record_init_rules needs a model on the meta device")
    initialize = getattr(model, "initialize_weights", None)
    if initialize is None:
        raise ValueError(f"{type(model).__name__} has no initialize_weights (not a "
                         "transformers model): no init rule to read")
    recorder = _Recorder({id(p): n for n, p in named.items()})
    # transformers flags each module it initialized; on the meta device nothing was,
    # and a flag left set would hide the module's fills from the recorder (before) or
    # from a later, real initialize_weights (after).
    _clear_flags(model)
    try:
        with torch.no_grad(), recorder:
            initialize()
    finally:
        _clear_flags(model)
    missing = [n for n in named if n not in recorder.rules and n not in recorder.refused]
    problems = {**recorder.refused, **dict.fromkeys(missing, "no fill reaches it")}
    if problems:
        listed = "; ".join(f"{n}: {why}" for n, why in sorted(problems.items())[:5])
        raise ValueError(
            f"{type(model).__name__}'s _init_weights cannot be replayed slice by slice "
            f"({len(problems)} parameter(s): {listed}); build it whole instead "
            "(build_causal_lm(..., deferred=False))")
    return recorder.rules
