"""module.explain(n) where torch sees no CUDA GPU says so, and that a call there runs the PyTorch
reference, instead of failing in torch.cuda (an AssertionError: Torch not compiled with CUDA)."""
from __future__ import annotations

import pytest
import torch

from pairgen.ops import get_op, op_names


def _module(name: str):
    spec = get_op(name)
    shape = spec.presets["seed"][0]
    return spec.make_module(spec.widths_of(shape), torch.Generator().manual_seed(0)), shape["N"]


@pytest.mark.parametrize("name", op_names())
def test_explain_without_a_gpu_says_a_call_runs_the_reference(name, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without a GPU
    module, n = _module(name)
    explained = module.explain(n)
    assert explained.strategy is None and explained.params is None
    text = str(explained)
    assert f"{name} N={n}" in text and "the PyTorch reference" in text and "no CUDA GPU" in text


@pytest.mark.parametrize("name", op_names())
def test_explain_for_the_cpu_device_says_a_call_runs_the_reference(name):
    """CPU tensors always run the reference, GPU or not."""
    module, n = _module(name)
    explained = module.explain(n, "cpu", "float32")
    assert explained.strategy is None and "the PyTorch reference" in str(explained)
