"""GPU: modules adapted from the OpenFold, Boltz, OpenFold 3 fused and lucidrains forms run
pairgen's kernels, matching the source module in fp32 (fp32 standard, against float64 of the
source) and bf16 (bf16 standard); patched models likewise."""
from __future__ import annotations

import pytest
import torch

import pairgen
from pairgen.ops.trimul import TRIMUL
from pairgen.tuning.check import compare
from test_adapters import BoltzTriangleMultiplicationOutgoing, OpenFold3FusedForm, OpenFoldForm, _inputs, _randomize

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("make", [lambda: OpenFoldForm(64, 32, _outgoing=False),
                                  lambda: BoltzTriangleMultiplicationOutgoing(64),
                                  lambda: OpenFold3FusedForm(64, 32, _outgoing=True)],
                         ids=["openfold", "boltz", "openfold3-fused"])
@pytest.mark.parametrize("dtype,precision", [(torch.float32, "float32"), (torch.bfloat16, "bfloat16")])
def test_adapted_modules_run_kernels_and_match_the_source(make, dtype, precision):
    source = _randomize(make(), 5).cuda().to(dtype)
    adapted = pairgen.adapt(source)
    x, mask = (t.cuda() for t in _inputs(64, 6))
    x = x.to(dtype)
    assert adapted.variant_for(9, x.device, precision) is not None, "a kernel, not the reference"
    with torch.no_grad():
        out = adapted(x, mask)
        expected = source.double()(x.double(), mask.double())
    assert out.dtype == dtype
    assert compare(out, expected, TRIMUL.tolerance[precision]).ok


@pytest.mark.parametrize("trunk,seed,swapped", [("Trunk", 9, 3), ("LucidrainsTrunk", 19, 2)])
def test_patched_model_runs_kernels_and_matches_itself_before(trunk, seed, swapped):
    """A model of the AlphaFold 3 / OpenFold forms, and one of lucidrains' (the gate in hidden
    width), patched: every supported module swapped, the result within fp32's standard of the
    unpatched model in float64."""
    import test_adapters

    model = _randomize(getattr(test_adapters, trunk)(), seed).cuda()
    x, mask = (t.cuda() for t in _inputs(16, seed + 1))
    with torch.no_grad():
        before = model.double()(x.double(), mask.double())
        model.float()
        assert len(pairgen.patch(model)) == swapped
        after = model(x, mask)
    assert compare(after, before, TRIMUL.tolerance["float32"]).ok


@pytest.mark.parametrize("dtype,precision", [(torch.float32, "float32"), (torch.bfloat16, "bfloat16")])
def test_the_lucidrains_form_runs_kernels_with_the_gate_in_hidden_width(dtype, precision):
    """The hidden gate placement's kernels (bmm or fused in fp32, wgmma in bf16), within the dtype's
    standard of float64 of the source."""
    from test_adapters import LucidrainsTriangleMultiplicativeModule

    source = _randomize(LucidrainsTriangleMultiplicativeModule(dim=64, hidden_dim=32, mix="ingoing"), 7).cuda().to(dtype)
    adapted = pairgen.adapt(source)
    x, mask = (t.cuda() for t in _inputs(64, 8))
    x = x.to(dtype)
    variant = adapted.variant_for(9, x.device, precision)
    assert variant is not None and variant.plan.widths["gate_hidden"] == 1
    with torch.no_grad():
        out = adapted(x, mask)
        expected = source.double()(x.double(), mask.double())
    assert out.dtype == dtype
    assert compare(out, expected, TRIMUL.tolerance[precision]).ok
