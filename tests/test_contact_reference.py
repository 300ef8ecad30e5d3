"""The contact head on the CPU: reference against an independent formula, the drop-in module
against the reference, state_dict compatibility, and input validation."""
from __future__ import annotations

import re

import pytest
import torch

from helpers import (Unpicklable, assert_copy_and_pickle_compute_the_reference, assert_state_dicts_interchange,
                     deepcopy_dropping_runtime_state, generator)
from pairgen import ContactHead, ContactHeadReference
from pairgen.testdata import random_tensor
from pairgen.ops.contact import CONTACT


def independent_contact(x, ln_w, ln_b, w1, b1, w2, b2, w3, b3):
    """The contact head's definition (docs/ops.md) written out by hand in float64, with explicit loops over the pair grid."""
    B, N, _, P = x.shape
    out = torch.empty(B, N, N, dtype=torch.float64)
    for b in range(B):
        for i in range(N):
            for j in range(N):
                rows = []
                for v in (x[b, i, j], x[b, j, i]):
                    mean = v.sum() / P
                    var = ((v - mean) ** 2).sum() / P
                    rows.append((v - mean) / torch.sqrt(var + 1e-5) * ln_w + ln_b)
                s = (rows[0] + rows[1]) / 2
                h1 = torch.clamp(w1 @ s + b1, min=0)
                h2 = torch.clamp(w2 @ h1 + b2, min=0)
                out[b, i, j] = 1 / (1 + torch.exp(-(w3 @ h2 + b3)[0]))
    return out


def test_reference_matches_an_independent_formula():
    gen = generator(1)
    module = CONTACT.make_module({"P": 16, "H": 8}, gen).double()
    x = random_tensor((2, 5, 5, 16), gen, "cauchy").double()
    l1, l2, l3 = module.mlp[0], module.mlp[2], module.mlp[4]
    expected = independent_contact(x, module.layer_norm.weight, module.layer_norm.bias, l1.weight, l1.bias,
                                    l2.weight, l2.bias, l3.weight, l3.bias)
    with torch.no_grad():
        got = module.reference_forward(x)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, got.transpose(1, 2), rtol=0, atol=0)  # exactly symmetric


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 37)])
def test_module_on_cpu_equals_the_reference(shape):
    B, N = shape
    gen = generator(2)
    module = CONTACT.make_module({"P": 64, "H": 32}, gen)
    reference = ContactHeadReference(64, 32)
    reference.load_state_dict(module.state_dict())
    x = torch.randn(B, N, N, 64, generator=gen)
    torch.testing.assert_close(module(x), reference(x), rtol=0, atol=0)


def test_state_dict_keys_and_round_trip():
    reference = ContactHeadReference(64, 32)
    module = ContactHead(64, 32)
    assert_state_dicts_interchange(module, reference)


def test_non_contiguous_input_and_other_dtypes_run_the_reference():
    gen = generator(3)
    module = CONTACT.make_module({"P": 64, "H": 32}, gen)
    x = torch.randn(2, 9, 9, 64, generator=gen)
    expected = module.reference_forward(x.transpose(1, 2).contiguous())
    torch.testing.assert_close(module(x.transpose(1, 2)), expected, rtol=0, atol=0)
    module64 = module.double()
    torch.testing.assert_close(module64(x.double()), module64.reference_forward(x.double()), rtol=0, atol=0)


@pytest.mark.parametrize("bad, message", [
    (lambda: torch.randn(2, 5, 5), "must have 4 dimensions"),
    (lambda: torch.randn(2, 5, 6, 64), "must have shape (B, N, N, 64)"),
    (lambda: torch.randn(2, 5, 5, 32), "must have shape (B, N, N, 64)"),
    (lambda: torch.ones(2, 5, 5, 64, dtype=torch.int64), "floating-point"),
    (lambda: torch.randn(2, 5, 5, 64, dtype=torch.float64), "dtype torch.float64"),
    (lambda: torch.randn(2, 5, 5, 64, device="meta"), "is on meta"),
    (lambda: [[1.0]], "must be a torch.Tensor"),
])
def test_bad_input_raises_a_value_error_saying_what_was_expected(bad, message):
    module = ContactHead(64, 32)
    with pytest.raises(ValueError, match=re.escape(message)):
        module(bad())


def test_gradients_flow_on_cpu():
    module = ContactHead(16, 8)
    x = torch.randn(1, 4, 4, 16, requires_grad=True)
    module(x).sum().backward()
    assert x.grad is not None and module.mlp[0].weight.grad is not None


def test_copies_and_pickles_drop_runtime_state():
    module = CONTACT.make_module({"P": 16, "H": 8}, generator(4))
    clone = deepcopy_dropping_runtime_state(module, {"_variant_cache": {"generation": 0, (0, 7): Unpicklable()},
                                                     "_slots._params": Unpicklable()})
    assert clone._slots.weights().tensors[2] is clone.mlp[0].weight, "the copy packs its own parameters"
    assert clone._slots.anchor() is clone.layer_norm.weight, "the copy validates against its own parameters"
    assert_copy_and_pickle_compute_the_reference(module, clone, (torch.randn(1, 5, 5, 16),))


def test_packed_weights_follow_every_kind_of_parameter_change():
    """Nothing is kept between calls: each pack reads the parameters as they are (an in-place
    update, a `.data` update as an EMA makes it, a replaced parameter)."""
    from pairgen.ops.contact import weight_offsets

    module = CONTACT.make_module({"P": 16, "H": 8}, generator(5))
    off = weight_offsets(16, 8)
    first = module.packed_weights()
    with torch.no_grad():
        module.mlp[0].bias.add_(1.0)  # in place, as an optimizer step does
    second = module.packed_weights()
    torch.testing.assert_close(second[off["b1"]: off["b1"] + 8], module.mlp[0].bias.detach(), rtol=0, atol=0)
    assert not torch.equal(first[off["b1"]: off["b1"] + 8], second[off["b1"]: off["b1"] + 8])
    module.layer_norm.weight.data.mul_(0.5)  # through .data: no version counter moves
    torch.testing.assert_close(module.packed_weights()[off["gamma"]: off["gamma"] + 16], module.layer_norm.weight.detach(),
                               rtol=0, atol=0)
    module.mlp[2].weight = torch.nn.Parameter(torch.full((8, 8), 3.0))  # replaced by assignment
    third = module.packed_weights()
    assert bool((third[off["w2t"]: off["w2t"] + 64] == 3.0).all())
    assert type(module.mlp[2].weight) is torch.nn.Parameter, "a parameter keeps its class"


def test_parameters_made_under_inference_mode_are_read_as_they_are():
    """A module built (or moved) under torch.inference_mode has inference-tensor parameters (no
    version counter): each call packs them as they are, so an update made there is seen, silently."""
    import warnings

    from pairgen.ops.contact import weight_offsets

    off = weight_offsets(16, 8)
    with torch.inference_mode():
        module = CONTACT.make_module({"P": 16, "H": 8}, generator(6))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            first = module.packed_weights()
            module.mlp[0].bias.add_(2.0)
            second = module.packed_weights()
        torch.testing.assert_close(second[off["b1"]: off["b1"] + 8], module.mlp[0].bias, rtol=0, atol=0)
        assert not torch.equal(first[off["b1"]: off["b1"] + 8], second[off["b1"]: off["b1"] + 8])
