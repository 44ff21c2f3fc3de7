"""After ``nox -s gpu``: the record to add to :mod:`paraxis.runtime.cuda_paths` for
each CUDA path this run validated, from pytest's JUnit XML.

A path counts as validated only when every test of its file ran and passed: one skip
(no CUDA, too little memory) and nothing is printed to paste. Usage:
``python tests/gpu/record.py JUNIT.xml``.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET

# The CUDA path (paraxis.runtime.cuda_paths) each file of tests/gpu validates.
VALIDATES = {"stream_timing": "test_gpu_timing"}


def outcomes(junit: str) -> dict[str, list[str]]:
    """Per test module, the outcome of each of its tests (passed, skipped, failed)."""
    out: dict[str, list[str]] = {}
    for case in ET.parse(junit).iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        kinds = {child.tag for child in case}
        outcome = ("failed" if kinds & {"failure", "error"} else
                   "skipped" if "skipped" in kinds else "passed")
        out.setdefault(module, []).append(outcome)
    return out


def environment() -> dict[str, str]:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else ()
    return {"torch": torch.__version__, "cuda": str(torch.version.cuda),
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
            "commit": commit, "check": "nox -s gpu"}


def main(junit: str) -> int:
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: no CUDA path was validated by this run")
        return 0
    seen = outcomes(junit)
    for path, module in VALIDATES.items():
        results = seen.get(module, [])
        if not results or set(results) != {"passed"}:
            counts = {k: results.count(k) for k in sorted(set(results))}
            print(f"{path}: not validated by this run ({module}: {counts or 'no tests'})")
            continue
        fields = ", ".join(f"{k}={v!r}" for k, v in environment().items())
        print(f"{path}: validated by this run. Add to its CudaPath in "
              f"packages/core/src/paraxis/runtime/cuda_paths.py, with this run's output "
              f"in the commit message:\n    runs=(Validation({fields}),),")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
