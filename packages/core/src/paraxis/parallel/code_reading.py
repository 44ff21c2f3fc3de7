"""What a class's code does, read from its code objects rather than guessed from names:
what it calls (the anatomy's ``mixer_calls``: the scans and recurrences an axis cutting
the sequence wraps, issue 35) and whether its backward reads its weights (ZeRO-3)."""

from __future__ import annotations

import functools
import inspect
import types

from torch import nn

__all__ = ["class_calls", "reads_weights_back"]


@functools.cache
def class_calls(cls: type) -> tuple[str, ...]:
    """The module-level functions the methods of ``cls`` and its bases (short of
    ``nn.Module``) call by name, decorators unwrapped: read from the code, not names."""
    bases = [b for b in inspect.getmro(cls) if b not in inspect.getmro(nn.Module)]
    codes = [(f.__code__, f.__globals__) for b in bases for f in map(inspect.unwrap, [
        m for m in vars(b).values() if inspect.isfunction(m)])]
    found: set[str] = set()
    while codes:  # nested functions' code objects too
        code, scope = codes.pop()
        codes += [(c, scope) for c in code.co_consts if isinstance(c, types.CodeType)]
        found |= {n for n in code.co_names if inspect.isfunction(scope.get(n))}
    return tuple(sorted(found))


def reads_weights_back(module: nn.Module) -> bool:
    """Whether ``module``'s backward reads its weights. A plain embedding lookup's does
    not (the table's gradient is the output's, added into rows by index), so ZeRO-3
    gathers it for forward only, and the planner counts that. A subclass with a forward
    of its own might, so only :class:`nn.Embedding`'s own forward is trusted."""
    return type(module).forward is not nn.Embedding.forward
