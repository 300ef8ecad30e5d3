"""pairgen.adapt and pairgen.patch against the projects' own classes, where they import: Boltz's
TriangleMultiplicationOutgoing/Incoming and OpenFold 3's (its unfused and its fused linear_ab_*
classes). Skipped where the projects are not installed; CI does not
install them (their dependency trees are large). To run these locally without their dependencies:

    pip install --no-deps --target /tmp/eco boltz scipy openfold3 gemmi ml_collections absl-py biotite
    PYTHONPATH=/tmp/eco python -m pytest tests/test_ecosystem.py

Protenix 2.0 builds a CUDA extension when its triangle module is imported (it needs CUDA_HOME): its
module has the OpenFold form without biases, which tests/test_adapters.py covers."""
from __future__ import annotations

import pytest
import torch

import pairgen


def _randomize(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return module


def _inputs(P, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 11, 11, P, generator=gen)
    mask = (torch.rand(2, 11, 11, generator=gen) > 0.25).float()
    mask[:, 4] = 0.0
    return x, mask


@pytest.mark.parametrize("name", ["TriangleMultiplicationOutgoing", "TriangleMultiplicationIncoming"])
def test_boltz_modules(name):
    boltz = pytest.importorskip("boltz.model.layers.triangular_mult")
    source = _randomize(getattr(boltz, name)(32), 1)
    x, mask = _inputs(32, 2)
    with torch.no_grad():
        expected = source(x, mask)
        torch.testing.assert_close(pairgen.adapt(source)(x, mask), expected, rtol=1e-5, atol=1e-5)
        holder = torch.nn.ModuleDict({"tri": source})
        assert pairgen.patch(holder)[0].endswith(f"form, {'outgoing' if 'Out' in name else 'incoming'})")
        torch.testing.assert_close(holder["tri"](x, mask, use_kernels=True), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["TriangleMultiplicationOutgoing", "TriangleMultiplicationIncoming",
                                  "FusedTriangleMultiplicationOutgoing", "FusedTriangleMultiplicationIncoming"])
def test_openfold3_modules(name):
    of3 = pytest.importorskip("openfold3.core.model.layers.triangular_multiplicative_update")
    source = _randomize(getattr(of3, name)(c_z=24, c_hidden=16), 3)
    x, mask = _inputs(24, 4)
    fused = name.startswith("Fused")
    with torch.no_grad():
        expected = source(x, mask)
        adapted = pairgen.adapt(source)
        if fused:
            assert torch.equal(adapted.proj_b.weight, source.linear_ab_p.weight[16:]), "b's rows: the second half"
        else:
            assert adapted.proj_a.weight is source.linear_a_p.weight, "shared"
        torch.testing.assert_close(adapted(x, mask), expected, rtol=1e-5, atol=1e-5)
        holder = torch.nn.ModuleDict({"tri": source})
        keys = list(holder.state_dict())
        report = pairgen.patch(holder)
        assert ("OpenFold 3 fused form" in report[0]) == fused and "swapped for pairgen" in report[0]
        assert list(holder.state_dict()) == keys, "the model's state_dict keys are kept"
        # as OpenFold 3's pair block calls it: its kernel flags, and the in-place add
        got = holder["tri"](x, mask=mask, inplace_safe=False, _add_with_inplace=True, use_cueq_triangle_kernels=False)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        z = x.clone()
        added = holder["tri"](z, mask=mask, inplace_safe=True, _add_with_inplace=True)
        assert added.data_ptr() == z.data_ptr()
        torch.testing.assert_close(added, x + expected, rtol=1e-5, atol=1e-5)
