"""The shape of core's tree (issue 25's layout): every module reads in a sitting (at most
300 lines), and the folders are the layers docs/architecture.md maps. Reads files only."""

from pathlib import Path

import paraxis

CORE = Path(paraxis.__file__).parent
LIMIT = 300
LAYERS = {"config", "runtime", "parallel", "models", "checkpoint", "engine", "train",
          "planner", "cli", "testing"}


def test_no_core_module_is_over_the_limit():
    long = {str(p.relative_to(CORE)): n for p in CORE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > LIMIT}
    assert not long, f"core modules over {LIMIT} lines: {long}"


def test_the_folders_are_the_layers():
    folders = {p.name for p in CORE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == LAYERS
