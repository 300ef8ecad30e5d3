"""GPU: the README's training example trains under bf16 autocast (finite gradients, every
parameter moved). With the default backward_mode ("auto") an autocast training call is PyTorch's
own autocast forward and backward of the reference; with "closed_form" the triangle update runs its
kernel and then its closed-form backward at every step."""
from __future__ import annotations

import pytest
import torch

from pairgen import TriangleMultiplication
from test_docs import training_example

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode,closed_form_calls", [("auto", []), ("closed_form", [True, True, True])])
def test_the_readme_training_example_trains_on_the_gpu(monkeypatch, mode, closed_form_calls):
    closed_form = []
    original = TriangleMultiplication.analytic_gradients
    monkeypatch.setattr(TriangleMultiplication, "analytic_gradients",
                        lambda self, *args, **kw: closed_form.append(kw.get("autocast")) or original(self, *args, **kw))
    monkeypatch.setattr(TriangleMultiplication, "_backward_mode", mode)
    scope = {}
    exec(compile(training_example(), "README.md", "exec"), scope)
    assert scope["device"] == "cuda"
    assert closed_form == closed_form_calls, "autocast steps' triangle update: the closed form only when asked for"
    model = scope["model"]
    torch.manual_seed(0)
    initial = scope["PairModel"]().cuda()
    for (name, p), p0 in zip(model.named_parameters(), initial.parameters()):
        assert torch.isfinite(p.grad).all(), name
        assert not torch.equal(p, p0), f"{name} did not move"
