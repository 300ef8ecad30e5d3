"""GPU: pairgen.triangle_multiplicative_update runs the kernels and matches the float64 reference
(fp32 at the fp32 standard, bf16 at the bf16 one) and, where it is importable, cuEquivariance's
function of the same name on the same arguments."""
from __future__ import annotations

import pytest
import torch

import pairgen
from pairgen import functional
from pairgen.ops.trimul import TRIMUL
from pairgen.tuning.check import compare
from test_functional import P, H, weights  # noqa: F401 (P, H: the widths the weights have)
from test_functional import assert_gradients_meet_the_fp32_standard

#: Widths the 16-bit kernels take (their tiles need P and H in multiples of 16).
KERNEL_WIDTHS = {"P": 32, "H": 16}

pytestmark = pytest.mark.gpu


def _float64(x, direction, mask, w):
    """The definition in float64 (the biases the call left out are absent: None)."""
    w64 = {name: (w[name].double() if name in w else None) for name in functional._WEIGHT_NAMES}
    return functional.reference(x.double(), direction, mask.double(), w64)


@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
@pytest.mark.parametrize("dtype,precision", [(torch.float32, "float32"), (torch.bfloat16, "bfloat16")])
def test_kernels_match_float64(direction, dtype, precision):
    gen = torch.Generator().manual_seed(6)
    w = {k: v.cuda().to(dtype) for k, v in weights(gen, bias=False, **KERNEL_WIDTHS).items()}
    x = torch.randn(2, 37, 37, KERNEL_WIDTHS["P"], generator=gen).cuda().to(dtype)
    mask = (torch.rand(2, 37, 37, generator=gen) > 0.2).cuda()
    functional._structures.clear()
    with torch.no_grad():
        out = pairgen.triangle_multiplicative_update(x, direction, mask, **w)
    module = next(iter(functional._structures.values()))
    assert module.variant_for(37, x.device, precision) is not None, "a kernel, not the reference"
    assert out.dtype == dtype
    assert compare(out, _float64(x, direction, mask, w), TRIMUL.tolerance[precision]).ok


def test_matches_cuequivariance_where_importable():
    cueq = pytest.importorskip("cuequivariance_torch")
    gen = torch.Generator().manual_seed(7)
    w = {k: v.cuda() for k, v in weights(gen, bias=False).items()}
    x = torch.randn(1, 64, 64, P, generator=gen).cuda()
    mask = (torch.rand(1, 64, 64, generator=gen) > 0.2).float().cuda()
    with torch.no_grad():
        ours = pairgen.triangle_multiplicative_update(x, "outgoing", mask, **w)
        theirs = cueq.triangle_multiplicative_update(x, "outgoing", mask, **w, precision="ieee")
    assert compare(ours, theirs.double(), TRIMUL.tolerance["float32"]).ok


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recomputed"])
@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
def test_gradients_through_the_kernels_meet_the_standard(direction, recompute, monkeypatch):
    """With gradients wanted: the closed form on the GPU (its forward keeping the intermediates,
    or the kernel forward and a backward that recomputes them), its gradients mapped onto the
    caller's fused weights; every gradient within relative L2 2e-5 of float64 autograd (fp32)."""
    monkeypatch.setattr(pairgen.TriangleMultiplication, "recompute_for_backward", recompute)
    gen = torch.Generator().manual_seed(8)
    w = {k: v.cuda().requires_grad_() for k, v in weights(gen, bias=True, **KERNEL_WIDTHS).items()}
    x = torch.randn(2, 37, 37, KERNEL_WIDTHS["P"], generator=gen).cuda().requires_grad_()
    mask = (torch.rand(2, 37, 37, generator=gen) > 0.2).cuda()
    g = torch.randn(x.shape, generator=gen).cuda()
    functional._modules.clear()
    (pairgen.triangle_multiplicative_update(x, direction, mask, **w) * g).sum().backward()
    module = next(iter(functional._modules.values()))
    assert module.variant_for(37, x.device, "float32") is not None, "a kernel, not the reference"
    assert_gradients_meet_the_fp32_standard(x, direction, mask, w, g)


@pytest.mark.parametrize("norms", ["given", "left out"])
def test_a_repeated_call_is_replayed_before_any_python_check(norms, compiled_fast_path, monkeypatch):
    """A call like a recorded one, its weights made anew (a torch.cat on every call, as OpenFold 3
    and Protenix call it), is served by the replay at the top of the function: none of the Python
    checks run, and the result is the recorded path's, bit for bit."""
    gen = torch.Generator().manual_seed(8)
    w = {k: v.cuda().to(torch.bfloat16) for k, v in weights(gen, bias=False, **KERNEL_WIDTHS).items()
         if norms == "given" or not k.startswith("norm_")}
    x = torch.randn(1, 24, 24, KERNEL_WIDTHS["P"], generator=gen).cuda().to(torch.bfloat16)
    mask = (torch.rand(1, 24, 24, generator=gen) > 0.2).cuda()
    functional._structures.clear()
    functional._replayers.clear()
    with torch.no_grad():
        first = pairgen.triangle_multiplicative_update(x, "incoming", mask, **w)
        assert functional._replayers, "the first call was recorded"

        def no_check(*args):
            raise AssertionError("the Python path ran")

        monkeypatch.setattr(functional, "_check", no_check)
        fresh = {name: t.clone() for name, t in w.items()}  # new tensors, same values
        again = pairgen.triangle_multiplicative_update(x, "incoming", mask, **fresh)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert compare(first, _float64(x, "incoming", mask, w), TRIMUL.tolerance["bfloat16"]).ok
