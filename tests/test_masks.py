"""Masks are taken the same way by every op (bool, integer read as != 0, floating point), on the
CPU path here; the GPU tests run the same inputs through the kernels."""
from __future__ import annotations

import pytest
import torch

from helpers import generator
from pairgen.ops import get_op

MASKED = {"trimul": 1, "readout": 2}  # the mask's position among each op's inputs


def _module_and_inputs(name: str, N: int = 7):
    spec = get_op(name)
    shape = {**spec.presets["seed"][0], "B": 2, "N": N}
    module = spec.make_module(spec.widths_of(shape), generator(3))
    if N == 0:  # the generators mask given rows; with no rows, inputs of the right empty shapes
        return module, [t[:, :0, :0] if t.dim() >= 3 and t.shape[1] == t.shape[2] else t[:, :0]
                        for t in spec.make_inputs({**shape, "N": 3}, generator(4))]
    return module, list(spec.make_inputs(shape, generator(4)))


@pytest.mark.parametrize("name", sorted(MASKED))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.int8])
def test_an_integer_mask_means_keep_or_drop(name, dtype):
    module, inputs = _module_and_inputs(name)
    at = MASKED[name]
    as_bool = inputs[at].clone()
    inputs[at] = as_bool.to(dtype) * 3  # 0 or 3: any non-zero keeps the pair
    with torch.no_grad():
        got = module(*inputs)
        inputs[at] = as_bool
        expected = module.reference_forward(*inputs)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_float_mask_of_the_triangle_update_multiplies_as_the_reference_does():
    module, (x, mask) = _module_and_inputs("trimul")
    half = mask.float() * 0.5
    with torch.no_grad():
        torch.testing.assert_close(module(x, half), module.reference_forward(x, half), rtol=0, atol=0)


def test_a_float_mask_of_the_readout_is_read_as_nonzero():
    module, (nodes, pair, mask) = _module_and_inputs("readout")
    with torch.no_grad():
        torch.testing.assert_close(module(nodes, pair, mask.float() * 0.5), module.reference_forward(nodes, pair, mask),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(MASKED))
def test_a_complex_mask_is_refused_with_what_is_accepted(name):
    module, inputs = _module_and_inputs(name)
    inputs[MASKED[name]] = inputs[MASKED[name]].to(torch.complex64)
    with pytest.raises(ValueError, match="must be bool, integer or floating point"):
        module(*inputs)


@pytest.mark.parametrize("name", ["contact", "readout", "trimul"])
def test_no_positions_give_an_empty_result(name):
    """N = 0 gives the reference's empty shape (the readout's reference would raise on the max over
    no partners; the drop-in returns the empty (B, 0, D) on every device)."""
    module, inputs = _module_and_inputs(name, N=0)
    with torch.no_grad():
        out = module(*inputs)
    assert out.numel() == 0 and out.shape[:2] == (2, 0)
