"""The import contracts of pyproject.toml can fail: each is kept by the tree as it is,
and broken by a violation planted in a copy of the sources (the check must be able to
fail). No process group, no model: import-linter only reads the sources."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*ROOT.glob("packages/*/src/*"), *ROOT.glob("integrations/*/src/*"),
                  *ROOT.glob("tools/*/src/*")])

# contract id -> (file to plant, relative to the copied sources; its text)
PLANTED = {
    "core-layers": ("paraxis/config/_planted.py", "import paraxis.engine.engine\n"),
    # Outside core: the contract covers every package (issue 33; moe-ep's router and
    # balance once imported each other through a function-level import).
    "acyclic": ("paraxis_moe/_planted_cycle.py", "import paraxis_moe.router\n"),
    "core-knows-no-axis": ("paraxis/planner/_planted.py", "import paraxis_pp.schedules\n"),
    "axes-use-the-contract": ("paraxis_dp/_planted.py", "import paraxis.engine.apply\n"),
    "packages-independent": ("paraxis_tp/_planted.py", "import paraxis_dp.sync\n"),
    "no-pytest-in-product": ("paraxis_moe/_planted.py", "import pytest\n"),
}


def _lint(src: Path, config: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([str(exe), "--config", str(config), "--no-cache"], cwd=src,
                          env=env, capture_output=True, text=True, timeout=120)


def _copy(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    for package in SOURCES:
        shutil.copytree(package, src / package.name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return src


@pytest.fixture(scope="module")
def copied(tmp_path_factory):
    if shutil.which("lint-imports", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("import-linter is not installed (the dev dependency group has it)")
    return _copy(tmp_path_factory.mktemp("layers"))


def test_the_tree_keeps_every_contract(copied):
    out = _lint(copied, ROOT / "pyproject.toml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(PLANTED)} kept, 0 broken" in out.stdout


def _contract_names() -> dict[str, str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    return {c["id"]: c["name"] for c in contracts}


@pytest.mark.parametrize("contract", sorted(PLANTED))
def test_a_planted_violation_breaks_its_contract(copied, tmp_path, contract):
    names = _contract_names()
    assert set(names) == set(PLANTED)  # every contract has its plant
    src = _copy(tmp_path)
    path, text = PLANTED[contract]
    (src / path).write_text(text)
    if contract == "acyclic":  # the cycle's other half: the router imports it back
        router = src / "paraxis_moe/router.py"
        router.write_text(router.read_text() + "\nimport paraxis_moe._planted_cycle  # noqa\n")
    out = _lint(src, ROOT / "pyproject.toml")
    assert out.returncode != 0
    assert f"{names[contract]} BROKEN" in out.stdout, out.stdout
