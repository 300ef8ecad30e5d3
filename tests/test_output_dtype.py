"""A module's output_dtype on the CPU: what it accepts, every path's output in it (the reference's
dtype where it is None), a copy keeping it, and the closed form's forward making an fp32 output from
16-bit math that rounds back to its 16-bit one."""
from __future__ import annotations

import copy

import pytest
import torch

from helpers import generator
from pairgen.ops.trimul import TRIMUL, TriangleMultiplication
from pairgen.ops.trimul import backward

MODELS = {"P": 48, "H": 24, "outgoing": 1, "gate_normalized": 1, "bias": 0}


def _module_and_inputs(dtype=torch.float32, N: int = 9):
    module = TRIMUL.make_module(MODELS, generator(1)).to(dtype)
    x, mask = TRIMUL.make_inputs({"B": 2, "N": N, **MODELS}, generator(2), "normal")
    return module, x.to(dtype), mask


@pytest.mark.parametrize("bad", ["float32", torch.int32, 3])
def test_output_dtype_takes_none_or_a_floating_dtype(bad):
    module = TriangleMultiplication(16, 8)
    with pytest.raises(ValueError, match="output_dtype must be None"):
        module.output_dtype = bad
    with pytest.raises(ValueError, match="output_dtype must be None"):
        TriangleMultiplication(16, 8, output_dtype=bad)
    assert module.output_dtype is None and "output_dtype" not in repr(module)


@pytest.mark.parametrize("dtype, wanted", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                           (torch.float16, None)])
def test_a_cpu_call_returns_output_dtype(dtype, wanted):
    """The reference path (CPU): its output cast to output_dtype, equal to the reference's own
    output cast; None returns the reference's dtype unchanged."""
    module, x, mask = _module_and_inputs(dtype)
    with torch.no_grad():
        own = module(x, mask)
        module.output_dtype = wanted
        out = module(x, mask)
    assert own.dtype == dtype
    assert out.dtype == (wanted or dtype) and torch.equal(out, own.to(wanted or dtype))
    assert copy.deepcopy(module).output_dtype is wanted
    if wanted is not None:
        assert f"output_dtype={wanted}" in repr(module)


def test_a_training_call_returns_output_dtype_and_its_gradient_flows():
    module, x, mask = _module_and_inputs(torch.bfloat16)
    module.output_dtype = torch.float32
    x.requires_grad_(True)
    out = module(x, mask)
    assert out.dtype == torch.float32 and out.requires_grad
    out.float().square().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad.float()).all()


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_the_closed_form_forward_makes_fp32_from_16_bit_math(precision):
    """forward_only with out_dtype fp32: an fp32 tensor that rounds to the 16-bit output exactly
    (on the CPU the gate's product is PyTorch's, rounded to 16 bits, then widened)."""
    module, x, mask = _module_and_inputs()
    params = {name: p.detach() for name, p in module.named_parameters()}
    narrow = backward.forward_only(module, x, mask, params, precision)
    wide = backward.forward_only(module, x, mask, params, precision, torch.float32)
    assert narrow.dtype != torch.float32 and wide.dtype == torch.float32
    assert torch.equal(wide.to(narrow.dtype), narrow)


@pytest.mark.parametrize("op_name", ["contact", "readout"])
def test_every_op_casts_to_output_dtype(op_name):
    """The contact head and the readout (no kernel writes another dtype for them): the reference's
    output cast, on the CPU, in both directions of width."""
    from pairgen.ops import get_op

    spec = get_op(op_name)
    shape = dict(spec.presets["seed"][0])
    module = spec.make_module(spec.widths_of(shape), generator(3))
    inputs = spec.make_inputs(shape, generator(4))
    with torch.no_grad():
        own = module(*inputs)
        for wanted in (torch.bfloat16, torch.float64):
            module.output_dtype = wanted
            out = module(*inputs)
            assert out.dtype == wanted and torch.equal(out, own.to(wanted))
