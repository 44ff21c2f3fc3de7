"""Plugin manager factory and strategy collection (DESIGN section 4)."""

from __future__ import annotations

import pluggy

from paraxis.config.axes import BUILTIN_AXES, AxisSpec, AxisTable
from paraxis.engine import builtin
from paraxis.parallel import hookspecs
from paraxis.parallel.strategy import Strategy

__all__ = ["axis_table", "collect_strategies", "make_plugin_manager"]


def make_plugin_manager(*, load_entrypoints: bool = True, builtins: bool = True,
                        plugins: tuple[object, ...] = ()) -> pluggy.PluginManager:
    """A fresh manager with the specs, core's own strategies (``builtins``), the installed
    plugins and any ``plugins`` given.

    Tests pass ``load_entrypoints=False`` (and ``builtins=False``) and their own plugins
    to get a clean manager.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    if builtins:
        pm.register(builtin, name="paraxis-core")
    if load_entrypoints:
        pm.load_setuptools_entrypoints(hookspecs.PROJECT)
    for plugin in plugins:
        pm.register(plugin)
    return pm


def collect_strategies(pm: pluggy.PluginManager) -> dict[str, type[Strategy]]:
    """Every registered strategy class, by the axis it implements."""
    found: dict[str, type[Strategy]] = {}

    def register(cls: type[Strategy]) -> None:
        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            raise TypeError(f"register() takes a Strategy subclass, got {cls!r}")
        if cls.axis in found and found[cls.axis] is not cls:
            raise ValueError(f"two strategies for axis '{cls.axis}': "
                             f"{found[cls.axis].__qualname__} and {cls.__qualname__}")
        found[cls.axis] = cls

    pm.hook.paraxis_register_strategies(register=register)
    return found


def axis_table(pm: pluggy.PluginManager) -> AxisTable:
    """The grid's axes: core's five and every axis a plugin registers
    (``paraxis_register_axes``), in mesh order."""
    added: dict[str, AxisSpec] = {}

    def register(spec: AxisSpec) -> None:
        if not isinstance(spec, AxisSpec):
            raise TypeError(f"register() takes an AxisSpec, got {spec!r}")
        if spec.name in BUILTIN_AXES.names or added.get(spec.name, spec) != spec:
            raise ValueError(f"grid axis {spec.name!r} is registered twice, differently")
        added[spec.name] = spec

    pm.hook.paraxis_register_axes(register=register)
    return BUILTIN_AXES.extended(added.values())
