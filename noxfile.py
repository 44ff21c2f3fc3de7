"""Sessions: demo, tests, tests_isolated, lint, bench, coverage.

    nox -s tests            everything, in one environment with every package
    nox -s tests_isolated   each package's tests with only core and that package installed
    nox -s lint             ruff
    nox -s demo             the default multi-process training run
    nox -s bench            the paired benchmarks (updates benchmarks/RESULTS.md)
    nox -s coverage         every transformers causal LM, every axis (docs/coverage.md)
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

ROOT = Path(__file__).parent
# The CPU wheel on this machine's disk; an unpinned torch would pull a CUDA build.
TORCH = "torch==2.13.0"
# The coverage matrix describes one transformers release; docs/coverage.md names it.
TRANSFORMERS = "transformers==5.24.0"
CORE = "packages/core"
PACKAGES = sorted(
    str(p.parent.relative_to(ROOT))
    for p in [*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("integrations/*/pyproject.toml")]
)
DEV = nox.project.dependency_groups(nox.project.load_toml("pyproject.toml"), "dev")

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True


def install_all(session: nox.Session) -> None:
    session.install(TORCH)
    session.install(*(f"--editable={p}" for p in PACKAGES))


# pytest-xdist: whole files per worker (module fixtures stay shared), at most 4 workers
# (each may hold worlds of up to 8 ranks in memory).
XDIST = ["-n", str(min(4, os.cpu_count() or 1)), "--dist", "loadfile"]
# Tests never reach the W&B service; the code under test must not care.
TEST_ENV = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}


@nox.session
def tests(session: nox.Session) -> None:
    """Every package's tests and the cross-package tests, in one environment."""
    install_all(session)
    session.install(*DEV)
    session.run("pytest", *XDIST, *session.posargs, env=TEST_ENV)


def _with_test_extra(package: str) -> str:
    """``./package[test]`` when the package declares test-only dependencies (a package
    whose tests build Hugging Face models from config needs transformers)."""
    meta = nox.project.load_toml(f"{package}/pyproject.toml")["project"]
    extras = meta.get("optional-dependencies", {})
    return f"./{package}[test]" if "test" in extras else f"./{package}"


@nox.session
@nox.parametrize("package", PACKAGES)
def tests_isolated(session: nox.Session, package: str) -> None:
    """One package's tests with only core and that package installed (not editable),
    which is how a user who installs one axis gets it; a package needing another
    paraxis package (an integration) lists it under ``[tool.paraxis] requires``."""
    session.install(TORCH)
    meta = nox.project.load_toml(f"{package}/pyproject.toml")
    needs = meta.get("tool", {}).get("paraxis", {}).get("requires", [])
    session.install(*{f"./{CORE}", _with_test_extra(package), *(f"./{n}" for n in needs)},
                    "pytest", "pytest-timeout")
    session.run("pytest", f"{package}/tests", *session.posargs, env=TEST_ENV)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")


@nox.session
def demo(session: nox.Session) -> None:
    """A real multi-process training run with the default configuration (a fresh run
    each time: the previous demo's checkpoints are removed first)."""
    install_all(session)
    session.run("rm", "-rf", "runs/default", external=True)
    # The demo logs to W&B offline (./wandb) unless WANDB_MODE says otherwise: it must
    # run on a machine with no W&B account; `wandb sync` uploads the run later.
    session.run("paraxis", "train", "--config", "examples/default.yaml", *session.posargs,
                env={"WANDB_MODE": os.environ.get("WANDB_MODE", "offline")})


@nox.session
def bench(session: nox.Session) -> None:
    """Paired benchmarks against the peers; each rewrites its section of RESULTS.md."""
    install_all(session)
    scripts = [*ROOT.glob("benchmarks/*_vs_*.py"), ROOT / "benchmarks/deepspeed_bridge.py"]
    for script in sorted(str(p.relative_to(ROOT)) for p in scripts):
        session.run("torchrun", "--nproc-per-node", "2", script, *session.posargs,
                    env={"OMP_NUM_THREADS": "1"})


@nox.session
def coverage(session: nox.Session) -> None:
    """Every causal-LM model type of transformers through every installed axis, against
    one process; rewrites docs/coverage.md (about 10 minutes on a shared 2-core
    machine). Arguments go to ``python -m paraxis_hf.coverage`` (``--only llama gemma2``,
    ``--json rows.json``)."""
    install_all(session)
    session.install(TRANSFORMERS)
    session.run("python", "-m", "paraxis_hf.coverage", *session.posargs, env=TEST_ENV)
