"""The bridge's validation rules, run before any process starts
(``paraxis_validate_config``). Every rule says what, the value seen and the fix."""

from __future__ import annotations

import os
from pathlib import Path

from paraxis.config.errors import Problem
from paraxis.config.parallel import ParallelConfig
from paraxis_deepspeed.version import SUPPORTED_SPEC, installed_version, supported

__all__ = ["aio_problem", "check_offload"]

LIBAIO_PACKAGE = "libaio-dev"


def check_offload(config: ParallelConfig, problems: list[Problem]) -> None:
    """Append a problem for everything the bridge cannot run, when offload is asked."""
    par = config.parallelism
    off = par.offload
    if not off.enabled:
        return
    _check_version(problems)
    if par.zero == 0:
        problems.append(Problem(
            "parallelism.zero", 0, "must be a ZeRO stage when parallelism.offload is set: "
            "DeepSpeed offloads ZeRO's partitions", "set parallelism.zero to 1, 2 or 3 "
            "(3 to offload parameters)"))
    elif off.parameters != "none" and par.zero != 3:
        problems.append(Problem(
            "parallelism.offload.parameters", off.parameters,
            f"needs ZeRO-3 (zero is {par.zero}): only stage 3 partitions parameters",
            "set parallelism.zero=3 or offload.parameters=none"))
    if off.optimizer == "nvme" and par.zero not in (0, 3):
        problems.append(Problem(
            "parallelism.offload.optimizer", "nvme", f"needs ZeRO-3 (zero is {par.zero}): "
            "DeepSpeed swaps optimizer state to NVMe only under ZeRO-Infinity",
            "set parallelism.zero=3 or offload.optimizer=cpu"))
    if par.pipeline > 1:
        problems.append(Problem(
            "parallelism.pipeline", par.pipeline, "cannot combine with offload: DeepSpeed's "
            "engine owns backward and the optimizer step of the whole model, while paraxis's "
            "pipeline runner drives each stage's backward itself (and DeepSpeed's ZeRO-2/3 "
            "refuse pipeline parallelism)", "use pipeline=1 with offload, or drop offload"))
    if par.expert > 1:
        problems.append(Problem(
            "parallelism.expert", par.expert, "cannot combine with offload: DeepSpeed averages "
            "every gradient over its data-parallel group, but paraxis's expert shards must "
            "average over data x context only", "use expert=1 with offload"))
    if par.sequence_parallel and par.tensor > 1:
        problems.append(Problem(
            "parallelism.sequence_parallel", True, "cannot combine with offload: which "
            "replicated parameters' gradients are partial sums over the tensor group (the "
            "norms that see only a rank's share of the sequence) is decided at the first "
            "backward, after the gradients are summed; DeepSpeed's engine reduces and "
            "partitions each gradient inside that backward, before the decision could apply",
            "set sequence_parallel: false with offload"))
    if "nvme" in (off.optimizer, off.parameters):
        _check_nvme(off.nvme_path, problems)
    train = getattr(config, "train", None)  # a whole run's config (the CLI) has one
    if train is not None:
        from paraxis_deepspeed.translate import train_problems

        problems += train_problems(train)


def _check_version(problems: list[Problem]) -> None:
    version = installed_version()
    if version is None:
        problems.append(Problem("parallelism.offload", "deepspeed not installed",
                                "offload runs on DeepSpeed", f"pip install '{SUPPORTED_SPEC}'"))
    elif not supported(version):
        problems.append(Problem(
            "deepspeed", version, f"is outside the range the bridge supports ({SUPPORTED_SPEC})",
            f"pip install '{SUPPORTED_SPEC}'"))


def _check_nvme(path: str | None, problems: list[Problem]) -> None:
    if not path:
        problems.append(Problem("parallelism.offload.nvme_path", path,
                                "must name a directory when offloading to nvme",
                                "set parallelism.offload.nvme_path to a writable directory "
                                "on an NVMe drive"))
    elif not Path(path).is_dir() or not os.access(path, os.W_OK | os.X_OK):
        problems.append(Problem("parallelism.offload.nvme_path", path,
                                "is not a writable directory",
                                f"create it (mkdir -p {path}) and make it writable, or choose "
                                "another path"))
    problem = aio_problem()
    if problem is not None:
        problems.append(problem)


def aio_problem() -> Problem | None:
    """A problem when DeepSpeed's async I/O extension (NVMe offload) cannot build here."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError:  # reported by the version rule
        return None
    if AsyncIOBuilder().is_compatible(verbose=False):
        return None
    return Problem("parallelism.offload", "nvme",
                   "needs DeepSpeed's async I/O extension, which cannot build here: the "
                   f"system package {LIBAIO_PACKAGE} (libaio) is missing",
                   f"apt-get install {LIBAIO_PACKAGE} (dnf install libaio-devel), or "
                   "offload to cpu")
