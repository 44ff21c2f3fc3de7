"""With every package installed, entry points wire the axes and integrations into core."""

from paraxis import ParallelConfig, make_plugin_manager
from paraxis.engine.resolve import resolve_strategies


def test_installed_entry_points_are_found():
    names = {name for name, _ in make_plugin_manager().list_name_plugin()}
    assert {"data", "hf", "wandb"} <= names


def test_installed_entry_point_provides_the_data_axis():
    (cls,) = resolve_strategies(ParallelConfig.from_kwargs(data=2), make_plugin_manager())
    assert cls.__module__ == "paraxis_dp.strategy"
