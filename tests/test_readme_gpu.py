"""GPU: the README's training example trains under bf16 autocast (finite gradients, every
parameter moved), its triangle update's backward at every step the one its settings ask for: by
default ("auto") the 16-bit closed form from the intermediates its forward kept, on the Python
path at the first step (recorded) and replayed from compiled code at the next two, at this small
size too (the size threshold, lowered here too, weighs a host time replays do not pay); with
recompute_for_backward the kernel forward and the closed form from the inputs; with "reference"
the reference whatever the size. And every python block of the README runs as written on the GPU."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pairgen import TriangleMultiplication
from test_docs import _missing_import, python_blocks, training_example

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("compiled_fast_path")]


@pytest.mark.parametrize("mode,recompute,min_pairs,expected", [("auto", False, None, ["saved"]),
                                                                ("auto", False, 0, ["saved"]),
                                                                ("closed_form", True, None, ["recomputed"] * 3),
                                                                ("reference", False, 0, [])])
def test_the_readme_training_example_trains_on_the_gpu(monkeypatch, mode, recompute, min_pairs, expected):
    used = []
    recomputed, saved = TriangleMultiplication.analytic_gradients, TriangleMultiplication.saved_gradients
    monkeypatch.setattr(TriangleMultiplication, "analytic_gradients",
                        lambda self, *args, **kw: used.append("recomputed") or recomputed(self, *args, **kw))
    monkeypatch.setattr(TriangleMultiplication, "saved_gradients",
                        staticmethod(lambda *args: used.append("saved") or saved(*args)))
    monkeypatch.setattr(TriangleMultiplication, "_backward_mode", mode)
    monkeypatch.setattr(TriangleMultiplication, "recompute_for_backward", recompute)
    if min_pairs is not None:
        monkeypatch.setattr(TriangleMultiplication, "routing",
                            replace(TriangleMultiplication.routing, closed_form_16_bit_training_min_pairs=min_pairs))
    monkeypatch.delenv("PAIRGEN_FUSED_BACKWARD", raising=False)
    scope = {}
    exec(compile(training_example(), "README.md", "exec"), scope)
    assert scope["device"] == "cuda"
    assert used == expected, "each autocast step's triangle update takes the backward asked for"
    model = scope["model"]
    assert len(model.tri._training_replays) == (1 if mode == "auto" else 0)
    torch.manual_seed(0)
    initial = scope["PairModel"]().cuda()
    for (name, p), p0 in zip(model.named_parameters(), initial.parameters()):
        assert torch.isfinite(p.grad).all(), name
        assert not torch.equal(p, p0), f"{name} did not move"


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_every_readme_python_block_runs_on_the_gpu(index):
    """Each python block of the README runs as written on the GPU (through the kernels)."""
    code = python_blocks()[index]
    missing = _missing_import(code)
    if missing:
        pytest.skip(f"the block imports {missing}, not installed (pip install --no-deps -r tests/real-models.txt)")
    exec(compile(code, f"README.md python block {index}", "exec"), {})
