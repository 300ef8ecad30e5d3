"""The triangle multiplicative update on the CPU: reference against an independent formula for
every option set, the drop-in module against the reference, the kernels' data layout (packed
weights, (B*H, N, N) a/b and the bmm orientation) emulated in PyTorch, state_dict
compatibility, masks, and input validation."""
from __future__ import annotations

import itertools
import re

import pytest
import torch

from helpers import (Unpicklable, assert_copy_and_pickle_compute_the_reference, assert_state_dicts_interchange,
                     deepcopy_dropping_runtime_state, generator)
from pairgen import TriangleMultiplication, TriangleMultiplicationReference
from pairgen.tuning.check import compare, reference64
from pairgen.testdata import random_tensor
from pack_oracles import pack_weights
from pairgen.ops.trimul import TRIMUL, options_of, random_mask, triangle_bmm, weight_offsets

OPTION_SETS = [{"outgoing": o, "gate_normalized": g, "bias": b} for o, g, b in itertools.product((0, 1), (0, 1), (1, 0))]
OPTION_IDS = [f"{'out' if s['outgoing'] else 'in'}-gate_{'norm' if s['gate_normalized'] else 'raw'}-"
              f"{'bias' if s['bias'] else 'nobias'}" for s in OPTION_SETS]
TOL = TRIMUL.tolerance["float32"]


def module_for(P, H, options, seed):
    return TRIMUL.make_module({"P": P, "H": H, **options}, generator(seed))


def independent_trimul(x, mask, p, outgoing, gate_normalized, bias):
    """The triangle update's definition (docs/ops.md) written out in float64 with explicit loops over (i, j) and k, and
    LayerNorm / Linear by hand: no einsum, no nn modules."""
    def ln(v, w, b):
        mean = v.mean(-1, keepdim=True)
        var = ((v - mean) ** 2).mean(-1, keepdim=True)
        return (v - mean) / torch.sqrt(var + 1e-5) * w + b

    def lin(v, name):
        out = v @ p[f"{name}.weight"].t()
        return out + p[f"{name}.bias"] if bias else out

    B, N = x.shape[:2]
    xn = ln(x, p["layer_norm_in.weight"], p["layer_norm_in.bias"])
    m = mask.double().unsqueeze(-1)
    a = lin(xn, "proj_a") * torch.sigmoid(lin(xn, "gate_a")) * m
    b = lin(xn, "proj_b") * torch.sigmoid(lin(xn, "gate_b")) * m
    z = torch.zeros(B, N, N, a.shape[-1], dtype=torch.float64)
    for i in range(N):
        for j in range(N):
            for k in range(N):
                z[:, i, j] += a[:, i, k] * b[:, j, k] if outgoing else a[:, k, i] * b[:, k, j]
    out = lin(ln(z, p["layer_norm_out.weight"], p["layer_norm_out.bias"]), "out_proj")
    return out * torch.sigmoid(lin(xn if gate_normalized else x, "out_gate"))


def kernel_layout_emulation(module, x, mask):
    """What the bmm strategy computes, step by step, in PyTorch (float32, like the kernels):
    the packed weights read back through their offsets, a and b written to ar[(b*H + h), r, c],
    triangle_bmm (the orientation _launch uses), the output read from the (B*H, N, N) product."""
    P, H = module.widths["P"], module.widths["H"]
    bias = bool(module.widths["bias"])
    packed = module.packed_weights()
    off = weight_offsets(P, H, bias)

    def section(name, *shape):
        n = 1
        for s in shape:
            n *= s
        return packed[off[name]: off[name] + n].reshape(shape)

    def layer_norm(v, g, b):
        return torch.nn.functional.layer_norm(v, (v.shape[-1],), g, b, 1e-5)

    B, N = x.shape[:2]
    xn = layer_norm(x, section("ln_in_g", P), section("ln_in_b", P))
    cols = xn @ section("wp", P, 4 * H)                     # column 4h + {pa, ga, pb, gb}
    if bias:
        cols = cols + section("bp", 4 * H)
    pa, ga, pb, gb = cols.reshape(B, N, N, H, 4).unbind(-1)
    m = mask.to(torch.float32).unsqueeze(-1)
    a, b = pa * torch.sigmoid(ga) * m, pb * torch.sigmoid(gb) * m
    ar = a.permute(0, 3, 1, 2).reshape(B * H, N, N)          # ar[(b*H + h), r, c] = a[b, r, c, h]
    br = b.permute(0, 3, 1, 2).reshape(B * H, N, N)
    z = triangle_bmm(ar, br, bool(module.widths["outgoing"]))
    z = z.reshape(B, H, N, N).permute(0, 2, 3, 1)           # the output kernel's read of z
    zn = layer_norm(z, section("ln_out_g", H), section("ln_out_b", H))
    o = zn @ section("wo", H, P) + (section("bo", P) if bias else 0)
    g = (xn if module.widths["gate_normalized"] else x) @ section("wg", P, P) + (section("bg", P) if bias else 0)
    return o * torch.sigmoid(g)


@pytest.mark.parametrize("options", OPTION_SETS, ids=OPTION_IDS)
def test_reference_matches_an_independent_formula(options):
    gen = generator(1)
    module = module_for(16, 8, options, 1).double()
    x = random_tensor((2, 5, 5, 16), gen, "cauchy").double()
    mask = random_mask(2, 5, gen)
    params = dict(module.named_parameters())
    expected = independent_trimul(x, mask, params, **options)
    with torch.no_grad():
        got = module.reference_forward(x, mask)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_defaults_are_the_ops_md_listing():
    ref = TriangleMultiplicationReference(16, 8)
    assert (ref.direction, ref.gate_on) == ("incoming", "input")
    assert all(getattr(ref, n).bias is not None for n in ("proj_a", "gate_a", "proj_b", "gate_b", "out_proj", "out_gate"))
    assert options_of(TRIMUL.presets["seed"][0]) == {"direction": "incoming", "gate_on": "input", "bias": True,
                                                     "gate_at": "output"}
    assert ref.gate_at == "output" and ref.out_gate.weight.shape == (16, 16)


def test_directions_differ_and_a_symmetric_check_would_hide_it():
    """With a != b and a non-symmetric mask, incoming and outgoing (and a transposed bmm) give
    different results; the emulation test below would therefore catch an orientation slip."""
    gen = generator(2)
    module = module_for(16, 8, OPTION_SETS[0], 2)
    x = torch.randn(1, 7, 7, 16, generator=gen)
    mask = random_mask(1, 7, gen)
    assert not torch.equal(mask, mask.transpose(1, 2))
    out = TRIMUL.make_module({"P": 16, "H": 8, "outgoing": 1, "gate_normalized": 0, "bias": 1}, generator(2))
    with torch.no_grad():
        assert (module(x, mask) - out(x, mask)).abs().max() > 1e-3


@pytest.mark.parametrize("options", OPTION_SETS, ids=OPTION_IDS)
@pytest.mark.parametrize("B, N", [(1, 1), (3, 7), (2, 13)])
def test_kernel_layout_emulation_matches_the_float64_reference(options, B, N):
    """Packed weights, the (B*H, N, N) layout and the bmm orientation, on odd N with a != b and a
    non-symmetric mask holding fully masked rows and columns (a symmetric case hides an i/j swap)."""
    gen = generator(3 + N)
    module = module_for(24, 16, options, 3 + N)
    x, mask = TRIMUL.make_inputs({"B": B, "N": N, "P": 24}, gen, "cauchy")
    with torch.no_grad():
        got = kernel_layout_emulation(module, x, mask)
    result = compare(got, reference64(module, (x, mask)), TOL)
    assert result.ok, str(result)


@pytest.mark.parametrize("options", [OPTION_SETS[0], {"outgoing": 1, "gate_normalized": 1, "bias": 1}], ids=["default", "out-norm"])
def test_fp32_at_the_real_widths_is_within_the_tolerance(options):
    """The standard is reachable in fp32 at P = H = 128: both the fp32 reference and the
    kernels' data flow (emulated) stay within 1e-4 abs / 1e-5 rel-L2 of float64 (sums over N terms)."""
    gen = generator(5)
    module = module_for(128, 128, options, 5)
    x, mask = TRIMUL.make_inputs({"B": 1, "N": 64, "P": 128}, gen, "normal")
    ref = reference64(module, (x, mask))
    with torch.no_grad():
        for got in (module.reference_forward(x, mask), kernel_layout_emulation(module, x, mask)):
            result = compare(got, ref, TOL)
            assert result.ok, str(result)


@pytest.mark.parametrize("options", OPTION_SETS, ids=OPTION_IDS)
def test_module_on_cpu_equals_the_reference(options):
    gen = generator(6)
    module = module_for(16, 8, options, 6)
    reference = TriangleMultiplicationReference(16, 8, **options_of(options))
    reference.load_state_dict(module.state_dict())
    x = torch.randn(2, 7, 7, 16, generator=gen)
    mask = random_mask(2, 7, gen)
    torch.testing.assert_close(module(x, mask), reference(x, mask), rtol=0, atol=0)


def test_bool_float_and_integer_masks_give_the_same_result():
    gen = generator(7)
    module = module_for(16, 8, OPTION_SETS[0], 7)
    x = torch.randn(2, 9, 9, 16, generator=gen)
    mask = random_mask(2, 9, gen)
    expected = module(x, mask)
    for other in (mask.float(), mask.double(), mask.to(torch.uint8)):
        torch.testing.assert_close(module(x, other), expected, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(kernel_layout_emulation(module, x, mask.float()),
                                   kernel_layout_emulation(module, x, mask), rtol=0, atol=0)


def test_empty_mask_rows_and_an_all_masked_input():
    """A fully masked row k zeroes a[k, :]: the triangle sums lose one term, nothing is NaN; with
    everything masked every sum is exactly 0 and LayerNorm_out gives its bias."""
    gen = generator(8)
    for options in (OPTION_SETS[0], {"outgoing": 1, "gate_normalized": 0, "bias": 1}):
        module = module_for(16, 8, options, 8)
        x = torch.randn(1, 6, 6, 16, generator=gen)
        mask = torch.ones(1, 6, 6, dtype=torch.bool)
        mask[0, 2, :] = False
        for m in (mask, torch.zeros_like(mask)):
            ref = reference64(module, (x, m))
            assert torch.isfinite(ref).all()
            with torch.no_grad():
                assert compare(kernel_layout_emulation(module, x, m), ref, TOL).ok
        with torch.no_grad():
            none = module.reference_forward(x, torch.zeros_like(mask))
            lno = module.layer_norm_out.bias
            expected = module.out_proj(lno.expand(1, 6, 6, 8)) * torch.sigmoid(module.out_gate(
                module.layer_norm_in(x) if options["gate_normalized"] else x))
        torch.testing.assert_close(none, expected, rtol=1e-6, atol=1e-6)


def test_make_inputs_mask_is_bool_non_symmetric_with_masked_row_and_column():
    x, mask = TRIMUL.make_inputs({"B": 2, "N": 37, "P": 64}, generator(9))
    assert x.shape == (2, 37, 37, 64) and mask.shape == (2, 37, 37) and mask.dtype is torch.bool
    assert not torch.equal(mask, mask.transpose(1, 2))
    for b in range(2):
        assert (~mask[b]).all(dim=1).any() and (~mask[b]).all(dim=0).any()
    assert mask.float().mean() > 0.5


@pytest.mark.parametrize("options", OPTION_SETS, ids=OPTION_IDS)
def test_state_dict_keys_and_round_trip(options):
    kwargs = options_of(options)
    reference = TriangleMultiplicationReference(64, 32, **kwargs)
    module = TriangleMultiplication(64, 32, **kwargs)
    keys = list(module.state_dict())
    assert any(k.endswith(".bias") and not k.startswith("layer_norm") for k in keys) == bool(options["bias"])
    assert_state_dicts_interchange(module, reference)
    assert list(module._slots.names) == keys


def test_packed_weights_follow_in_place_updates():
    module = module_for(16, 8, OPTION_SETS[0], 10)
    with torch.no_grad():
        module.gate_b.weight.mul_(-0.5)
    again = module.packed_weights()
    off = weight_offsets(16, 8, True)
    wp = again[off["wp"]: off["wp"] + 16 * 32].reshape(16, 8, 4)
    torch.testing.assert_close(wp[..., 3], module.gate_b.weight.t(), rtol=0, atol=0)
    torch.testing.assert_close(pack_weights(dict(module.named_parameters()), 16, 8, True), again, rtol=0, atol=0)


def test_non_contiguous_input_and_other_dtypes_run_the_reference():
    gen = generator(11)
    module = module_for(16, 8, OPTION_SETS[0], 11)
    x = torch.randn(2, 9, 9, 16, generator=gen)
    mask = random_mask(2, 9, gen)
    expected = module.reference_forward(x.transpose(1, 2).contiguous(), mask.transpose(1, 2).contiguous())
    torch.testing.assert_close(module(x.transpose(1, 2), mask.transpose(1, 2)), expected, rtol=0, atol=0)
    module64 = module.double()
    torch.testing.assert_close(module64(x.double(), mask), module64.reference_forward(x.double(), mask), rtol=0, atol=0)


@pytest.mark.parametrize("bad, message", [
    (lambda: (torch.randn(2, 5, 5), torch.ones(2, 5, 5)), "must have 4 dimensions"),
    (lambda: (torch.randn(2, 5, 6, 16), torch.ones(2, 5, 6)), "must have shape (B, N, N, 16)"),
    (lambda: (torch.randn(2, 5, 5, 32), torch.ones(2, 5, 5)), "must have shape (B, N, N, 16)"),
    (lambda: (torch.ones(2, 5, 5, 16, dtype=torch.int64), torch.ones(2, 5, 5)), "floating-point"),
    (lambda: (torch.randn(2, 5, 5, 16, dtype=torch.float64), torch.ones(2, 5, 5)), "dtype torch.float64"),
    (lambda: (torch.randn(2, 5, 5, 16, device="meta"), torch.ones(2, 5, 5)), "is on meta"),
    (lambda: ([[1.0]], torch.ones(2, 5, 5)), "must be a torch.Tensor"),
    (lambda: (torch.randn(2, 5, 5, 16), [[1.0]]), "pair_mask must be a torch.Tensor"),
    (lambda: (torch.randn(2, 5, 5, 16), torch.ones(2, 5)), "pair_mask must have shape (B, N, N) = (2, 5, 5)"),
    (lambda: (torch.randn(2, 5, 5, 16), torch.ones(1, 5, 5)), "pair_mask must have shape (B, N, N) = (2, 5, 5)"),
    (lambda: (torch.randn(2, 5, 5, 16), torch.ones(2, 5, 5, dtype=torch.complex64)), "pair_mask must be bool, integer or floating point"),
    (lambda: (torch.randn(2, 5, 5, 16), torch.ones(2, 5, 5, device="meta")), "pair_mask is on meta"),
])
def test_bad_input_raises_a_value_error_saying_what_was_expected(bad, message):
    module = TriangleMultiplication(16, 8)
    with pytest.raises(ValueError, match=re.escape(message)):
        module(*bad())


@pytest.mark.parametrize("kwargs, message", [
    ({"direction": "sideways"}, "direction must be one of"),
    ({"gate_on": "output"}, "gate_on must be one of"),
    ({"bias": 1}, "bias must be True or False"),
])
def test_bad_options_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TriangleMultiplication(16, 8, **kwargs)


def test_gradients_flow_on_cpu():
    module = TriangleMultiplication(16, 8, direction="outgoing", bias=False)
    x = torch.randn(1, 4, 4, 16, requires_grad=True)
    module(x, torch.ones(1, 4, 4, dtype=torch.bool)).sum().backward()
    assert x.grad is not None and module.proj_a.weight.grad is not None


def test_copies_and_pickles_drop_runtime_state():
    module = module_for(16, 8, OPTION_SETS[0], 12)
    clone = deepcopy_dropping_runtime_state(module, {"_variant_cache": {"generation": 0, (0, 7): Unpicklable()},
                                                     "_barrier": (0, Unpicklable()),
                                                     "_slots._params": Unpicklable()})
    assert clone._slots.weights().tensors[0] is clone.layer_norm_in.weight, "the copy packs its own parameters"
    inputs = (torch.randn(1, 5, 5, 16), random_mask(1, 5, generator(0)))
    assert_copy_and_pickle_compute_the_reference(module, clone, inputs)


def test_the_hidden_gate_placement():
    """gate_at="hidden": the out gate, in hidden width, multiplies the normalised triangle sums
    before the output projection (lucidrains' form); "output" stays the default; a module with it
    computes what its reference does on the CPU, packs its gate in hidden width for the fp32
    kernels (run on the GPU by tests/test_trimul_gpu.py), and takes no closed form."""
    import pytest
    import torch

    from pairgen import TriangleMultiplication, TriangleMultiplicationReference
    from pairgen.ops.trimul import TRIMUL

    with pytest.raises(ValueError, match="gate_at"):
        TriangleMultiplicationReference(8, 4, gate_at="input")
    assert TriangleMultiplicationReference(8, 4).gate_at == "output"
    gen = torch.Generator().manual_seed(3)
    module = TriangleMultiplication(8, 4, "outgoing", "normalized", gate_at="hidden")
    for p in module.parameters():
        torch.nn.init.normal_(p, generator=gen)
    assert module.out_gate.weight.shape == (4, 8) and module.widths["gate_hidden"] == 1
    x = torch.randn(2, 5, 5, 8, generator=gen)
    mask = torch.rand(2, 5, 5, generator=gen) > 0.3
    reference = TRIMUL.make_reference(module)
    assert reference.gate_at == "hidden"
    ref = TriangleMultiplicationReference.forward(module, x, mask)
    zn = module.layer_norm_out(torch.einsum("bikh,bjkh->bijh", *_gated(module, x, mask)))
    by_hand = module.out_proj(zn * torch.sigmoid(module.out_gate(module.layer_norm_in(x))))
    torch.testing.assert_close(ref, by_hand)
    torch.testing.assert_close(module(x, mask), reference(x, mask))
    assert not module.closed_form_applies([x, mask])
    assert "gate_hidden" not in TriangleMultiplication(8, 4).widths, "the output placement keeps its tuned keys"
    from pairgen.ops.trimul.common import weight_offsets

    packed, off = module.packed_weights(), weight_offsets(8, 4, True, 4)
    assert packed.numel() == off["total"] and off["bg"] - off["wg"] == 8 * 4
    torch.testing.assert_close(packed[off["wg"]: off["bg"]].view(8, 4), module.out_gate.weight.detach().t())
    torch.testing.assert_close(packed[off["bg"]: off["bg"] + 4], module.out_gate.bias.detach())


def _gated(module, x, mask):
    import torch

    xn = module.layer_norm_in(x)
    m = mask.unsqueeze(-1).float()
    return (module.proj_a(xn) * torch.sigmoid(module.gate_a(xn)) * m,
            module.proj_b(xn) * torch.sigmoid(module.gate_b(xn)) * m)
