"""GPU: the README's training example runs through pairgen's kernels under bf16 autocast, its
triangle update's backward in closed form at every step, and trains (finite gradients, every
parameter moved)."""
from __future__ import annotations

import pytest
import torch

from pairgen import TriangleMultiplication
from test_docs import training_example

pytestmark = pytest.mark.gpu


def test_the_readme_training_example_trains_on_the_gpu(monkeypatch):
    closed_form = []
    original = TriangleMultiplication.analytic_gradients
    monkeypatch.setattr(TriangleMultiplication, "analytic_gradients",
                        lambda self, *args, **kw: closed_form.append(kw.get("autocast")) or original(self, *args, **kw))
    scope = {}
    exec(compile(training_example(), "README.md", "exec"), scope)
    assert scope["device"] == "cuda"
    assert closed_form == [True, True, True], "each step's triangle update: the kernel, then the closed form"
    model = scope["model"]
    torch.manual_seed(0)
    initial = scope["PairModel"]().cuda()
    for (name, p), p0 in zip(model.named_parameters(), initial.parameters()):
        assert torch.isfinite(p.grad).all(), name
        assert not torch.equal(p, p0), f"{name} did not move"
