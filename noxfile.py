"""Sessions: demo, tests, tests_isolated, lint, bench, coverage.

    nox -s tests            the cross-package tests with every package installed, then
                            each package's own tests with only core and that package
    nox -s tests_isolated   the same per-package runs, each in a fresh environment
    nox -s lint             ruff, and import-linter's contracts (core's layers)
    nox -s demo             the default multi-process training run
    nox -s bench            the paired benchmarks (updates benchmarks/RESULTS.md)
    nox -s coverage         every transformers causal LM, every axis (docs/coverage.md)
    nox -s gpu              the single-GPU checks of the CUDA paths (tests/gpu)
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

ROOT = Path(__file__).parent
# The CPU wheel on this machine's disk; an unpinned torch would pull a CUDA build.
TORCH = "torch==2.13.0"
# The test sessions install under constraints.txt: one transformers release for the tests
# and the coverage matrix (docs/coverage.md names it).
PINNED = ("-c", "constraints.txt")
CORE = "packages/core"
PACKAGES = sorted(
    str(p.parent.relative_to(ROOT))
    for p in [*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("integrations/*/pyproject.toml"),
              *ROOT.glob("tools/*/pyproject.toml")]
)
DEV = nox.project.dependency_groups(nox.project.load_toml("pyproject.toml"), "dev")

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True


def install_all(session: nox.Session) -> None:
    session.install(TORCH)
    session.install(*PINNED, *(f"--editable={p}" for p in PACKAGES))


def _meta(package: str) -> dict:
    return nox.project.load_toml(f"{package}/pyproject.toml")


def _needs(package: str) -> list[str]:
    """The other paraxis packages a package's tests need (an integration's
    ``[tool.paraxis] requires``)."""
    return _meta(package).get("tool", {}).get("paraxis", {}).get("requires", [])


DISTS = sorted(_meta(p)["project"]["name"] for p in PACKAGES)


# pytest-xdist: whole files per worker (module fixtures stay shared), at most 4 workers
# (each may hold worlds of up to 8 ranks in memory).
XDIST = ["-n", str(min(4, os.cpu_count() or 1)), "--dist", "loadfile"]
# Tests never reach the W&B service; the code under test must not care.
TEST_ENV = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}


@nox.session
def tests(session: nox.Session) -> None:
    """The cross-package tests (tests/) with every package installed; then, in the same
    environment, each package's own tests with only core and that package of paraxis
    installed (``pip uninstall`` the others, no reinstall of torch or transformers), which
    is how a user who installs one axis gets it. Every test runs once."""
    session.install(TORCH)
    session.install(*PINNED, *DEV, *(f"--editable={_with_test_extra(p)}" for p in PACKAGES))
    session.run("pytest", *XDIST, "tests", *session.posargs, env=TEST_ENV)
    for package in PACKAGES:
        _alone(session, package)
        session.run("pytest", *XDIST, f"{package}/tests", *session.posargs, env=TEST_ENV)
    session.install("--no-deps", *(f"--editable={p}" for p in PACKAGES))  # whole again


def _alone(session: nox.Session, package: str) -> None:
    """Leave only core, ``package`` and what its tests need of paraxis installed."""
    session.run("pip", "uninstall", "--quiet", "--yes", *DISTS, silent=True)
    keep = dict.fromkeys([CORE, package, *_needs(package)])
    session.install("--no-deps", *(f"--editable={p}" for p in keep))


def _with_test_extra(package: str) -> str:
    """``./package[extra,...]`` with every extra the package declares, whatever its
    name: a package's own tests cover its optional features (issue 32: seq-context's
    Hugging Face tests need the transformers its ``hf`` extra names, and a session that
    installed ``[test]`` alone skipped them)."""
    extras = sorted(_meta(package)["project"].get("optional-dependencies", {}))
    return f"./{package}[{','.join(extras)}]" if extras else f"./{package}"


@nox.session
@nox.parametrize("package", PACKAGES)
def tests_isolated(session: nox.Session, package: str) -> None:
    """One package's tests with only core and that package installed (not editable),
    which is how a user who installs one axis gets it; a package needing another
    paraxis package (an integration) lists it under ``[tool.paraxis] requires``."""
    session.install(TORCH)
    needs = (f"./{n}" for n in _needs(package))
    session.install(*PINNED, *{f"./{CORE}", _with_test_extra(package), *needs}, "pytest",
                    "pytest-timeout")
    # -rs: a test skipped for want of an installed module is named in the output.
    session.run("pytest", "-rs", f"{package}/tests", *session.posargs, env=TEST_ENV)


SOURCES = [str(p) for p in sorted([*ROOT.glob("packages/*/src"),
                                   *ROOT.glob("integrations/*/src"), *ROOT.glob("tools/*/src")])]


@nox.session
def lint(session: nox.Session) -> None:
    """ruff, then import-linter's contracts (pyproject.toml): core's layers in order, no
    cycle, no axis imported by core, axes through the contract only, no axis importing
    another, no pytest in product code. import-linter reads the sources; nothing is
    installed but the two tools."""
    session.install("ruff", "import-linter")
    session.run("ruff", "check", ".")
    session.run("lint-imports", "--no-cache", env={"PYTHONPATH": os.pathsep.join(SOURCES)})


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
    machine). Arguments go to ``python -m paraxis_coverage`` (the matrix's own package,
    tools/coverage: ``--only llama gemma2``,
    ``--json rows.json``)."""
    install_all(session)
    session.run("python", "-m", "paraxis_coverage", *session.posargs, env=TEST_ENV)


@nox.session
def gpu(session: nox.Session) -> None:
    """The one command a machine with CUDA runs to validate paraxis's CUDA paths
    (paraxis.runtime.cuda_paths): tests/gpu, single-GPU checks that need no second
    device (bf16 autocast, fused AdamW, the stream clock of collectives and MoE timers,
    the pipeline's step timer, a step of a 1B Llama with its MFU), sized for under 10
    minutes on one GPU (not yet run on one). Each test skips with one line where CUDA
    is absent. Then tests/gpu/record.py prints, for each path every test of its file
    passed, the record to add to its table entry. On Linux, PyPI's torch wheel is the
    CUDA build (this project's own machines resolve it to a CPU one)."""
    install_all(session)
    session.install(*PINNED, "transformers", "pytest", "pytest-timeout")
    junit = str(Path(session.create_tmp()) / "gpu-junit.xml")
    session.run("pytest", "-p", "no:cacheprovider", f"--junitxml={junit}",
                "tests/gpu", *session.posargs, env=TEST_ENV)
    session.run("python", "tests/gpu/record.py", junit, env=TEST_ENV)
