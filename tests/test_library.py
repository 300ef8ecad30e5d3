"""pairgen's operators for torch.compile on the CPU (the reference implementations): opcheck for
every op, a compiled model with all three modules (fullgraph, dynamic lengths) against eager in
outputs and gradients, frozen parameters, and the module handles."""
from __future__ import annotations

import gc

import pytest
import torch

from pairgen import library
from pairgen.ops import get_op

WIDTHS = {"trimul": {"P": 16, "H": 8, "outgoing": 1, "gate_normalized": 1, "bias": 0},
          "contact": {"P": 16, "H": 8}, "readout": {"D": 12, "P": 8, "H": 16}}


def _module_and_inputs(op: str, n: int, seed: int = 0):
    spec = get_op(op)
    gen = torch.Generator().manual_seed(seed)
    module = spec.make_module(WIDTHS[op], gen)
    return module, spec.make_inputs({"B": 2, "N": n, **WIDTHS[op]}, gen)


@pytest.mark.parametrize("op", sorted(WIDTHS))
def test_opcheck(op):
    module, inputs = _module_and_inputs(op, 5)
    args = (list(inputs), list(module.parameters()), library.register(module))
    torch.library.opcheck(getattr(torch.ops.pairgen, op).default, args)


def test_opcheck_with_the_hidden_gate_placement():
    """A module with the gate in hidden width (gate_at="hidden") is an operator like the others:
    its fake implementation and registered autograd agree with the reference it runs (on the CPU)."""
    from pairgen import TriangleMultiplication

    module = TriangleMultiplication(16, 8, "outgoing", "normalized", gate_at="hidden")
    _, inputs = _module_and_inputs("trimul", 5)
    args = (list(inputs), list(module.parameters()), library.register(module))
    torch.library.opcheck(torch.ops.pairgen.trimul.default, args)


def test_opcheck_with_a_float_mask():
    module, (x, mask) = _module_and_inputs("trimul", 4)
    args = ([x, mask.float()], list(module.parameters()), library.register(module))
    torch.library.opcheck(torch.ops.pairgen.trimul.default, args)


class Trunk(torch.nn.Module):
    """The three modules in one model, as a user's would hold them."""

    def __init__(self):
        super().__init__()
        self.trimul, _ = _module_and_inputs("trimul", 1, seed=1)
        self.contact, _ = _module_and_inputs("contact", 1, seed=2)
        self.readout, _ = _module_and_inputs("readout", 1, seed=3)
        self.to_pair = torch.nn.Linear(16, 8)

    def forward(self, x, mask, nodes):
        z = self.trimul(x, mask) + x
        return self.contact(z), self.readout(nodes, self.to_pair(z), mask)


def _trunk_inputs(n: int, gen: torch.Generator):
    x = torch.randn(2, n, n, 16, generator=gen, requires_grad=True)
    mask = torch.rand(2, n, n, generator=gen) > 0.2
    return x, mask, torch.randn(2, n, 12, generator=gen, requires_grad=True)


def test_compiled_model_matches_eager_with_dynamic_lengths_and_no_graph_break():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = Trunk()
    gen = torch.Generator().manual_seed(4)
    model(*_trunk_inputs(3, gen))  # an eager call first: what users do before compiling
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for n in (5, 7, 11):
        inputs = _trunk_inputs(n, gen)
        eager_inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        out, eager = compiled(*inputs), model(*eager_inputs)
        weights = [torch.randn(o.shape, generator=gen) for o in out]
        sum((o * w).sum() for o, w in zip(out, weights)).backward()
        grads = [inputs[0].grad, inputs[2].grad] + [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        sum((o * w).sum() for o, w in zip(eager, weights)).backward()
        eager_grads = [eager_inputs[0].grad, eager_inputs[2].grad] + [p.grad for p in model.parameters()]
        model.zero_grad()
        for a, b in zip(out, eager):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(grads, eager_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1, "one graph for every length (dynamic=True, no recompiles)"


def test_frozen_parameters_get_no_gradient_through_the_operator():
    module, (x, mask) = _module_and_inputs("trimul", 6)
    module.out_gate.weight.requires_grad_(False)
    compiled = torch.compile(module, fullgraph=True)
    compiled(x.requires_grad_(), mask).sum().backward()
    assert module.out_gate.weight.grad is None and module.out_proj.weight.grad is not None and x.grad is not None


def test_a_compiled_module_returns_its_output_dtype_and_trains_through_the_cast():
    """output_dtype under torch.compile(fullgraph=True): the operator's output cast in the graph,
    the gradient flowing back through it."""
    module, (x, mask) = _module_and_inputs("trimul", 6)
    module.output_dtype = torch.float64
    compiled = torch.compile(module, fullgraph=True)
    out = compiled(x.requires_grad_(), mask)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, module.reference_forward(x, mask).double().detach(), rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert x.grad is not None and x.grad.dtype == x.dtype


def test_handles_name_live_modules_only():
    module, _ = _module_and_inputs("contact", 3)
    handle = library.register(module)
    assert library.module_of(handle) is module and library.register(module) == handle
    del module
    gc.collect()
    with pytest.raises(RuntimeError, match="no live module"):
        library.module_of(handle)
