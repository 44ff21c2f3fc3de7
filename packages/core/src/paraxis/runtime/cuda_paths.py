"""The CUDA paths paraxis has, and the GPU runs that validated them: one table.

The sessions that wrote these paths had no GPU (issue 32, item 7), so each is written
for CUDA and tested on CPU only through stand-ins. Until a run on a GPU has passed the
check named in its entry, a path is never on by default: its option's ``auto`` resolves
to off (:func:`cuda_path_on`), and turning it on by hand runs it with one warning
naming it (:class:`UnvalidatedCudaPath`, through Python's ``warnings``, as paraxis's
other run warnings). A passing run adds a :class:`Validation` to the entry's ``runs``
(``nox -s gpu`` prints the record to paste); ``auto`` then turns the path on. A run on
another torch or NCCL version than the one recorded is trusted too: the record says
what was run, and the next ``nox -s gpu`` on a new version is what re-checks it.

Today no entry has a run.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

__all__ = ["CUDA_PATHS", "CudaPath", "UnvalidatedCudaPath", "Validation", "cuda_path_on"]


class UnvalidatedCudaPath(UserWarning):
    """A CUDA path no GPU run has validated was turned on by hand."""


@dataclass(frozen=True)
class Validation:
    """One GPU run that passed a path's check: what it ran on."""

    torch: str      # torch.__version__
    cuda: str       # torch.version.cuda
    nccl: str       # torch.cuda.nccl.version(), dotted
    device: str     # torch.cuda.get_device_name()
    commit: str     # the paraxis commit that ran
    check: str      # the command that passed


@dataclass(frozen=True)
class CudaPath:
    """A path that runs only on CUDA: the option that turns it on by hand, what it does,
    the check a GPU run must pass, and the runs that passed it."""

    name: str
    option: str
    does: str
    check: str
    runs: tuple[Validation, ...] = ()

    @property
    def validated(self) -> bool:
        return bool(self.runs)


CUDA_PATHS: dict[str, CudaPath] = {p.name: p for p in (
    CudaPath("tensor_overlap", "parallelism.tensor_overlap: on",
             "sequence parallel's ring steps on the NCCL communicator's stream beside the "
             "tensor-parallel GEMMs (paraxis_tp.overlap)",
             "tests/test_tp_overlap.py with NCCL on 2 GPUs (not in nox -s gpu: one GPU)"),
    CudaPath("moe_dispatch_chunks", "moe.dispatch_chunks > 1",
             "chunked MoE all-to-alls launched asynchronously on NCCL beside the expert "
             "compute (paraxis_moe.overlap)",
             "tests/test_moe_dispatch_overlap.py with NCCL on 2 GPUs (not in nox -s gpu)"),
    CudaPath("stream_timing", "parallelism.stream_timing: on",
             "seconds read from CUDA events on the compute stream: core's exposed "
             "communication (exposed_comm_s, comm/<axes>_exposed_s), the MoE timers "
             "(moe/dispatch_s, a2a_span_s, expert_compute_s) and the pipeline's measured "
             "timeline (paraxis_pp.measure)",
             "nox -s gpu: tests/gpu/test_gpu_timing.py"),
)}


def cuda_path_on(name: str, option: str) -> bool:
    """Whether CUDA path ``name`` runs, for its option ``auto``, ``on`` or ``off``, where
    it applies (the caller decides that: an NCCL group, CUDA tensors). ``auto`` is on
    only once a GPU run validated it; ``on`` runs it anyway, warning once per call
    (callers resolve once per run) when none has."""
    path = CUDA_PATHS[name]
    if option not in ("auto", "on", "off"):
        raise ValueError(f"{path.option.split(':')[0]} = {option!r}: expected auto, on or off")
    if option == "off":
        return False
    if option == "auto":
        return path.validated
    if not path.validated:
        warnings.warn(
            f"CUDA path {name!r} ({path.option}) has never been validated on a GPU: "
            f"{path.does}. It runs because it was asked for; its check is {path.check} "
            "(paraxis.runtime.cuda_paths records the runs that passed it)",
            UnvalidatedCudaPath, stacklevel=3)
    return True
