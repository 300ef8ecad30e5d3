"""The GPU tests' case lists, built on the CPU: a case that plans an infeasible point (a parameter
combination a restriction forbids) or no longer plans at all fails here, in CI, instead of at
collection on the GPU machine, where it stops the whole module."""
from __future__ import annotations

import importlib
import pathlib

import pytest

GPU_MODULES = sorted(p.stem for p in pathlib.Path(__file__).parent.glob("test_*_gpu.py"))


def _case_builders(module):
    return [name for name in dir(module) if name.startswith("_") and name.endswith("cases")
            and callable(getattr(module, name))]


@pytest.mark.parametrize("name", GPU_MODULES)
def test_a_gpu_modules_case_lists_build_on_the_cpu(name):
    module = importlib.import_module(name)
    for builder in _case_builders(module):
        cases = getattr(module, builder)()
        assert isinstance(cases, list), f"{name}.{builder}"


def test_the_case_builders_are_found():
    """At least the triangle update's tensor-core cases are among them (the check is not empty)."""
    module = importlib.import_module("test_trimul_mma_gpu")
    assert {"_cases", "_wgmma_cases", "_hidden_gate_cases", "_paired_cases"} <= set(_case_builders(module))
    assert len(module._paired_cases()) >= 30
