"""The CUDA paths no GPU has validated (paraxis.runtime.cuda_paths, issue 32 item 7):
``auto`` is off until a run is recorded, ``on`` runs with one warning naming the path,
and the table names options and checks that exist. No GPU here: NCCL is a patched
backend name."""

import dataclasses
import re
import warnings
from pathlib import Path

import pytest

from paraxis import ParallelConfig
from paraxis.runtime import grid as grid_module
from paraxis.runtime.cuda_paths import (
    CUDA_PATHS,
    UnvalidatedCudaPath,
    Validation,
    cuda_path_on,
)

ROOT = Path(__file__).resolve().parents[3]
RUN = Validation(torch="2.13.0", cuda="12.8", nccl="2.27.3", device="a GPU", commit="0" * 7,
                 check="nox -s gpu")


def resolved(name, option):
    """(whether it runs, the warnings it gave), every warning recorded."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        on = cuda_path_on(name, option)
    return on, [w for w in seen if w.category is UnvalidatedCudaPath]


@pytest.mark.parametrize("name", sorted(CUDA_PATHS))
def test_an_unvalidated_path_is_off_under_auto_and_warns_once_when_on(name):
    validated = CUDA_PATHS[name].validated
    assert resolved(name, "auto") == (validated, [])
    assert resolved(name, "off") == (False, [])
    on, seen = resolved(name, "on")
    assert on and len(seen) == (0 if validated else 1)
    if validated:
        return
    assert repr(name) in str(seen[0].message) and CUDA_PATHS[name].check in str(seen[0].message)


def test_a_recorded_run_turns_auto_on_and_on_quiet(monkeypatch):
    path = CUDA_PATHS["tensor_overlap"]
    monkeypatch.setitem(CUDA_PATHS, "tensor_overlap", dataclasses.replace(path, runs=(RUN,)))
    assert resolved("tensor_overlap", "auto") == (True, [])
    assert resolved("tensor_overlap", "on") == (True, [])
    assert resolved("tensor_overlap", "off") == (False, [])


def test_an_unknown_option_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"'yes'.*auto, on or off"):
        cuda_path_on("stream_timing", "yes")


@pytest.mark.parametrize("name", sorted(CUDA_PATHS))
def test_each_entry_names_a_config_field_and_checks_that_exist(name):
    path = CUDA_PATHS[name]
    section, field = re.match(r"(\w+)\.(\w+)", path.option).groups()
    assert field in ParallelConfig.model_fields[section].annotation.model_fields, path.option
    files = re.findall(r"tests/[\w/]+\.py", path.check)
    assert files, f"{name}: its check names no test file: {path.check}"
    for file in files:
        assert (ROOT / file).is_file(), f"{name}: {file} does not exist"


@pytest.mark.parametrize(("backend", "option", "want", "warned"), [
    ("gloo", "on", False, 0),   # no CUDA stream to time on: nothing to turn on
    ("nccl", "auto", False, 0),
    ("nccl", "off", False, 0),
    ("nccl", "on", True, 1),
])
def test_stream_timing_is_resolved_once_per_grid(monkeypatch, backend, option, want, warned):
    monkeypatch.setattr(grid_module.dist, "get_backend", lambda *a: backend)
    config = ParallelConfig.from_kwargs(stream_timing=option)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert grid_module._stream_timing(config) is want
    assert len([w for w in seen if w.category is UnvalidatedCudaPath]) == warned
