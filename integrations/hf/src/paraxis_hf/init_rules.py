"""Each parameter's init rule, read from the family's own ``_init_weights``.

A transformers model initializes itself by ``initialize_weights``: the family's
``_init_weights`` on every module, children before parents, each call a
``transformers.initialization`` fill (``normal_(std=initializer_range)`` for Linear and
Embedding weights, ``zeros_`` for biases, ``ones_`` for norms, ModernBERT's
``trunc_normal_`` cut at 2 or 3 std, GPT-2's ``c_proj`` at
``initializer_range / sqrt(2 * n_layer)``, Mamba's ``A_log`` copied from an arange) or a
Tensor method on the parameter. On the meta device those calls fill nothing; here they
are seen two ways, whatever the tensor's device: every entry of
``transformers.initialization.TORCH_INIT_FUNCTIONS`` (the originals its wrappers call) is
replaced for the run by a recorder of its name and arguments (:mod:`paraxis_hf.init_calls`),
and a ``TorchFunctionMode`` sees the Tensor methods (``normal_``, ``uniform_``, ``fill_``,
``zero_``, ``copy_``, an indexed assignment) aimed at a parameter, its ``.data`` or a row
range of it. The last call wins, as it would in place.

Ties follow eager order (issue 32): transformers' ``init_weights`` initializes the
*untied* model and only then ties, so a tied pair starts from its source's own init
(Youtu's embedding, not its head's). The meta model is therefore built untied
(:func:`paraxis_hf.materialize.meta_model`), recorded per parameter object, tied, and
named after tying.

What cannot be replayed layout-invariantly is refused with the parameter's name and the
call's, never guessed: an init function without a rule, an in-place op other than the
fills, a fill through a reshaped view, a copy from a meta tensor (another parameter's
values) or of more than :data:`COPY_LIMIT` elements, a parameter no call reaches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from paraxis_hf.init_calls import init_function_rule, scaled
from paraxis_hf.invariant_init import Copy, Draw, Fill, InitRule, piece_values

__all__ = ["COPY_LIMIT", "InitNotReplayable", "record_init_rules"]

# A copy_ from a real tensor (values the family computes from the config and the global
# RNG: Mamba's A_log from an arange, dt_bias from torch.rand) is kept whole, on every
# rank, until each takes its slice: at most 2^20 elements (4 MiB in fp32) per tensor,
# which a real model's per-channel vectors fit (Mamba-2.8B's A_log is 5120 x 16) and a
# weight matrix, which a rank must never hold whole, does not.
COPY_LIMIT = 1 << 20

# Tensor methods that fill; name -> rule from the arguments after the tensor.
_TENSOR_FILLS: dict[str, Callable[[tuple, dict], Draw | Fill]] = {
    "normal_": lambda a, k: Draw("normal", float(_arg(a, k, 0, "mean", 0.0)),
                                 float(_arg(a, k, 1, "std", 1.0))),
    "uniform_": lambda a, k: Draw("uniform", float(_arg(a, k, 0, "from", 0.0)),
                                  float(_arg(a, k, 1, "to", 1.0))),
    "fill_": lambda a, k: Fill(float(_arg(a, k, 0, "value", 0.0))),
    "zero_": lambda a, k: Fill(0.0),
}
_ALIASES = {"__get__", "detach", "detach_"}  # ``param.data``, ``param.detach()``
_NO_VALUE = {"requires_grad_", "retain_grad", "share_memory_"}  # in place, not values
_SCALE = {"mul": False, "__mul__": False, "__rmul__": False, "div": True,
          "__truediv__": True}  # name -> divides
_SCALE_IN_PLACE = {"mul_": False, "__imul__": False, "div_": True, "__itruediv__": True}
_IN_PLACE_OPERATORS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                       "__imod__", "__ipow__", "__imatmul__", "__iand__", "__ior__",
                       "__ixor__", "__ilshift__", "__irshift__"}  # ``p += x`` and the like
# Factories of values the family computes from the config and the RNG; asked for on the
# parameter's (meta) device, they are made on the CPU when small, so a copy_ of them is
# recordable (Mamba's ``torch.arange(..., device=self.A_log.device)``).
_FACTORIES = {"arange", "rand", "randn", "randint", "randperm", "linspace", "logspace",
              "empty", "zeros", "ones", "full", "tensor", "as_tensor", "eye"}
_LIKE = {"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like"}
_OPAQUE = "opaque"  # a reshaped view: rows of it are not rows of the parameter
Span = tuple[int, int] | str | None  # whole (None), rows [a, b), or _OPAQUE
Target = tuple[int, Span]
Recorded = Draw | Fill | Copy | InitRule | str  # a str: why it is refused


class InitNotReplayable(ValueError):
    """The family's init cannot be replayed piece by piece; ``problems`` maps each
    parameter to why."""

    def __init__(self, message: str, problems: dict[str, str]):
        super().__init__(message)
        self.problems = problems


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if index < len(args) else default


def _scalar(value: Any) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_meta:
        value = value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _on_meta(device: Any) -> bool:
    return device is not None and torch.device(device).type == "meta"


class _Recorder(TorchFunctionMode):
    """Records, per parameter object, the fills aimed at it (or at its ``.data``, or at
    a row range of it); passes every other call through (meta tensors make them free)."""

    def __init__(self, params: dict[int, torch.Tensor]):
        super().__init__()
        self.params = params
        self.views: dict[int, Target] = {}
        self.scaled: dict[int, tuple[int, float]] = {}  # ``p / c``: (parameter, factor)
        self.keep: list[torch.Tensor] = []  # views stay alive, so their ids stay unique
        self.rules: dict[int, InitRule] = {}
        self.refused: dict[int, str] = {}

    def target(self, t: Any) -> Target | None:
        if not isinstance(t, torch.Tensor):
            return None
        if id(t) in self.params:
            return id(t), None
        return self.views.get(id(t))

    def record(self, target: Target, rule: Recorded, call: str) -> None:
        """The last call wins: a whole fill replaces what came before (a refusal too); a
        constant on rows is laid over the rule; anything else refuses."""
        pid, span = target
        old = self.rules.get(pid)
        if isinstance(rule, str):
            self.refused[pid] = rule
        elif span is None:
            self.rules[pid] = rule if isinstance(rule, InitRule) else InitRule(rule)
            self.refused.pop(pid, None)
        elif span == _OPAQUE:
            self.refused[pid] = f"{call} through a reshaped view of it"
        elif isinstance(rule, Fill) and old is not None and not isinstance(old.base, Copy):
            self.rules[pid] = InitRule(old.base, (*old.rows, (*span, rule.value)))
        elif isinstance(rule, (Fill, Copy)) and old is not None and not isinstance(
                old.base, Draw) and self.params[pid].numel() <= COPY_LIMIT:
            self.rules[pid] = InitRule(Copy(self._rows_set(old, pid, span, rule)))
        else:
            self.refused[pid] = f"{call} on rows {span} of it"

    def _rows_set(self, old: InitRule, pid: int, span: tuple[int, int],
                  rule: Fill | Copy) -> torch.Tensor:
        """A small parameter's values whole, rows ``span`` set from ``rule``."""
        shape = tuple(self.params[pid].shape)
        whole = piece_values(old, seed=0, name="", global_shape=shape,
                             where=tuple(slice(0, n) for n in shape),
                             dtype=old.base.values.dtype if isinstance(old.base, Copy)
                             else torch.float32)
        whole[span[0]:span[1]] = rule.value if isinstance(rule, Fill) else rule.values
        return whole

    def init_function(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` (``torch.nn.init.<name>``), recording the call when its tensor is
        a parameter (which it leaves untouched) and running it otherwise."""
        def recorded(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            target = self.target(tensor)
            if target is None:
                return function(tensor, *args, **kwargs)
            self.record(target, init_function_rule(name, function, tensor, args, kwargs),
                        name)
            return tensor

        return recorded

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fname = getattr(func, "__name__", str(func))
        made = self._made_for_real(func, fname, args, kwargs)
        if made is not None:
            return made
        out = self.target(kwargs.get("out"))
        if out is not None:
            self.record(out, f"{fname}(out=...) (an op paraxis cannot replay)", fname)
            return kwargs["out"]
        tensor = args[0] if args else kwargs.get("tensor")
        target = self.target(tensor)
        if target is None:
            return func(*args, **kwargs)
        rest = args[1:] if args else ()
        extra = {k: v for k, v in kwargs.items() if k not in ("tensor", "generator")}
        factor = _scalar(rest[0]) if rest else None
        if fname in _ALIASES or fname == "__getitem__" or fname in _SCALE:
            return self._derived(func, fname, target, args, kwargs, factor)
        if getattr(func, "__module__", None) == "torch.nn.init":  # bypassed the table
            self.record(target, init_function_rule(fname, func, tensor, rest, extra), fname)
        elif fname == "__setitem__":
            self._assign(target, args[1], args[2])
        elif fname in _TENSOR_FILLS:
            self.record(target, _TENSOR_FILLS[fname](rest, extra), fname)
        elif fname in ("copy_", "__set__"):  # ``p.copy_(src)``, ``p.data = src``
            self.record(target, self._copy(target, tensor, _arg(rest, extra, 0, "src", None)),
                        fname)
        elif fname in _SCALE_IN_PLACE and factor is not None:
            factor = 1 / factor if _SCALE_IN_PLACE[fname] else factor
            self.record(target, self._scaled(target, factor, fname), fname)
        elif fname in _IN_PLACE_OPERATORS or (
                fname.endswith("_") and not fname.startswith("__") and fname not in _NO_VALUE):
            self.record(target, f"{fname} (an in-place op paraxis cannot replay slice "
                                "by slice)", fname)
        else:
            result = func(*args, **kwargs)
            if isinstance(result, torch.Tensor) and result._is_view():
                self._view(result, (target[0], _OPAQUE))
            return result
        return tensor

    def _made_for_real(self, func: Any, fname: str, args: tuple,
                       kwargs: dict) -> torch.Tensor | None:
        """A small factory asked for on the meta device (or like a parameter), made on
        the CPU instead; None for any other call."""
        if func is not getattr(torch, fname, None) or not (
                (fname in _FACTORIES and _on_meta(kwargs.get("device"))) or (
                    fname in _LIKE and args and self.target(args[0]) is not None
                    and (kwargs.get("device") is None or _on_meta(kwargs["device"])))):
            return None
        made = func(*args, **kwargs)  # on meta: free, and it tells the size
        if made.numel() > COPY_LIMIT:
            return made
        if fname in _LIKE:
            args = (torch.empty(made.shape, dtype=made.dtype), *args[1:])
        return func(*args, **{**kwargs, "device": "cpu"})

    def _derived(self, func: Any, fname: str, target: Target, args: tuple, kwargs: dict,
                 factor: float | None) -> Any:
        """``param.data``, ``param[rows]``, ``param * c``: a tensor that stands for the
        parameter (or some rows of it, or a multiple of it) in later calls."""
        result = func(*args, **kwargs)
        if fname in _SCALE:
            if factor is not None and target[1] is None and isinstance(result, torch.Tensor):
                self.scaled[id(result)] = (target[0], 1 / factor if _SCALE[fname] else factor)
                self.keep.append(result)
            return result
        self._view(result, target if fname in _ALIASES else (target[0],
                                                             self._rows(target, args[1])))
        return result

    def _view(self, view: Any, target: Target) -> None:
        if isinstance(view, torch.Tensor):
            self.views[id(view)] = target
            self.keep.append(view)

    def _rows(self, target: Target, index: Any) -> Span:
        """The rows of dimension 0 an index selects (an int or a step-1 slice of the
        whole parameter), else :data:`_OPAQUE`."""
        if target[1] is None and isinstance(index, int) and self.params[target[0]].dim():
            row = index % len(self.params[target[0]])
            return (row, row + 1)
        if target[1] is None and isinstance(index, slice) and index.step in (None, 1) and \
                self.params[target[0]].dim():
            return slice(index.start, index.stop).indices(len(self.params[target[0]]))[:2]
        return _OPAQUE

    def _assign(self, target: Target, index: Any, value: Any) -> None:
        """``param[index] = value``: a constant on rows, else a refusal."""
        constant = _scalar(value)
        span = self._rows(target, index)
        if constant is None or span == _OPAQUE:
            self.record(target, f"an indexed assignment ({index!r}) of "
                                f"{type(value).__name__}", "[]=")
        else:
            self.record((target[0], span), Fill(constant), "[]=")

    def _scaled(self, target: Target, factor: float, call: str) -> InitRule | str:
        pid, span = target
        if span is not None or pid not in self.rules:
            return f"{call} on {'rows of ' if span else ''}a parameter without a whole rule"
        return scaled(self.rules[pid], factor)

    def _copy(self, target: Target, tensor: torch.Tensor, src: Any) -> Recorded:
        if id(src) in self.scaled and self.scaled[id(src)][0] == target[0]:
            return self._scaled(target, self.scaled[id(src)][1], "copy_ of a multiple")
        if not isinstance(src, torch.Tensor):
            return f"copy_ from {type(src).__name__}"
        if src.is_meta:
            return ("copy_ from a meta tensor (values computed from another parameter, "
                    "unknown until it is materialized)")
        if tensor.numel() > COPY_LIMIT:
            return (f"copy_ of {tensor.numel()} elements (over the {COPY_LIMIT} a rank "
                    "may hold whole while it takes its slice)")
        try:
            return Copy(src.detach().to("cpu").expand(tensor.shape).clone())
        except RuntimeError as exc:
            return f"copy_ from a tensor of shape {tuple(src.shape)} ({exc})"


@contextlib.contextmanager
def _recording_init_functions(recorder: _Recorder) -> Iterator[None]:
    """Every ``TORCH_INIT_FUNCTIONS`` entry recorded for the run (transformers' wrappers
    look the original up there at each call), and torch's ``_no_grad_trunc_normal_``,
    which ``trunc_normal_`` reaches however it was imported and which returns at once on
    a meta tensor (torch 2.13), so that no trunc_normal_ escapes."""
    try:
        from transformers.initialization import TORCH_INIT_FUNCTIONS as table
    except ImportError:  # transformers 4: the fills reach the mode as themselves
        table = {}
    saved = dict(table)
    trunc = torch.nn.init._no_grad_trunc_normal_
    record_trunc = recorder.init_function("trunc_normal_", torch.nn.init.trunc_normal_)

    def trunc_normal(tensor, mean, std, a, b, generator=None):  # type: ignore[no-untyped-def]
        if recorder.target(tensor) is None:
            return trunc(tensor, mean, std, a, b, generator=generator)
        return record_trunc(tensor, mean, std, a, b)

    try:
        for name, function in saved.items():
            table[name] = recorder.init_function(name, function)
        torch.nn.init._no_grad_trunc_normal_ = trunc_normal
        yield
    finally:
        table.update(saved)
        torch.nn.init._no_grad_trunc_normal_ = trunc


def _clear_flags(model: nn.Module) -> None:
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)


def _tie(model: nn.Module) -> None:
    """transformers' own ``tie_weights``, as ``init_weights`` calls it after the init."""
    tie = getattr(model, "tie_weights", None)
    if tie is None:
        return
    try:
        tie(recompute_mapping=False)
    except TypeError:  # transformers 4
        tie()


def _by_reason(problems: dict[str, str]) -> str:
    """``why: name, name and N more`` for each reason, in the order first met."""
    names: dict[str, list[str]] = {}
    for name, why in problems.items():
        names.setdefault(why, []).append(name)
    return "; ".join(f"{why}: {', '.join(found[:2])}"
                     + (f" and {len(found) - 2} more" if len(found) > 2 else "")
                     for why, found in names.items())


def record_init_rules(model: nn.Module, *, seed: int = 0) -> dict[str, InitRule]:
    """Every parameter's rule, by its first name (tied parameters once), from
    ``model.initialize_weights()`` run on the meta device, then ``tie_weights()`` (the
    eager order; build the model untied, ``meta_model(config, untied=True)``). The
    global RNG is seeded with ``seed`` for the run, so values the family computes from
    it (:class:`Copy`) are the same on every rank. Raises :class:`InitNotReplayable`
    naming the parameters whose init cannot be reproduced layout-invariantly, and why."""
    untied = dict(model.named_parameters())
    if any(not p.is_meta for p in untied.values()):
        raise ValueError("record_init_rules needs a model on the meta device")
    initialize = getattr(model, "initialize_weights", None)
    if initialize is None:
        raise ValueError(f"{type(model).__name__} has no initialize_weights (not a "
                         "transformers model): no init rule to read")
    recorder = _Recorder({id(p): p for p in untied.values()})
    # transformers flags each module it initialized; on the meta device nothing was,
    # and a flag left set would hide the module's fills from the recorder (before) or
    # from a later, real initialize_weights (after).
    _clear_flags(model)
    failed = None
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), \
                _recording_init_functions(recorder), recorder:
            torch.manual_seed(seed)
            initialize()
    except Exception as exc:  # an init that cannot run on meta: refused, with the calls seen
        failed = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
    finally:
        _clear_flags(model)
    _tie(model)
    named = dict(model.named_parameters())
    unreached = ("no fill reaches it (its value is its constructor's, which ran on the meta "
                 "device)" if failed is None else f"not reached: initialize_weights raised "
                 f"{failed} on the meta device")
    problems = {n: recorder.refused.get(id(p), unreached) for n, p in named.items()
                if id(p) in recorder.refused or id(p) not in recorder.rules}
    if problems:
        raise InitNotReplayable(
            f"{type(model).__name__}'s _init_weights cannot be replayed slice by slice "
            f"({len(problems)} parameter(s): {_by_reason(problems)}); build it whole "
            "instead (build_causal_lm(..., deferred=False))", problems)
    return {n: recorder.rules[id(p)] for n, p in named.items()}
