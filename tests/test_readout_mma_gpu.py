"""GPU: the readout's tensor-core strategy (mma) against the float64 reference in every precision
(bfloat16, float16: module and inputs in that dtype; tf32x3 at the fp32 standard; tf32), over
sampled points and odd shapes with heavy tails and NaN-prefilled outputs; the mask and NaN
semantics; 16-bit modules, fp32 modules under autocast and tf32x3 modules through the module."""
from __future__ import annotations

import pytest
import torch

from helpers import (ODD_SHAPES, assert_variant_matches_float64, compiled_cases, compiled_variant,
                     feasible_defaults, generator, run_variant, sampled_plans, gpu_params)
from pairgen import runtime
from pairgen.ops.readout import READOUT
from pairgen.spec import HALF_PRECISIONS, MMA_KINDS, DeviceLimits
from pairgen.tuning.check import compare, reference64

pytestmark = pytest.mark.gpu
SEED_WIDTHS = {"D": 96, "P": 16, "H": 192}
#: An fp32 module under autocast, against the float64 fp32 reference: its pair features, weights
#: and (for the residual) node rows rounded to bf16 alone give a few 1e-3.
AUTOCAST_BOUND = 2e-2


def _default_and_two_samples(precision: str, widths: dict) -> list:
    plans = sampled_plans(READOUT.at(precision), "mma", widths, 2, seed=23)
    return list({id(p): p for p in plans[:1] + plans[-2:]}.values())


def _streamed(precision: str, widths: dict) -> list:
    """The weight-streaming mode's first default and a sampled point (resident ones dominate samples)."""
    view = READOUT.at(precision)
    plans = [p for p in view.feasible_plans("mma", widths, DeviceLimits()) if not p.params["resident"]]
    return plans[:1] + plans[len(plans) // 2: len(plans) // 2 + 1]


def _case(precision: str, widths: dict, plan):
    return pytest.param(plan, id=f"{precision}-D{widths['D']}P{widths['P']}H{widths['H']}-{plan.label}")


def _one_launch(precision: str, widths: dict) -> list:
    """The first feasible default made one-launch (the node prologue inside the kernel)."""
    view = READOUT.at(precision)
    return [view.plan("mma", {**p.params, "one_launch": True, "prologue_rows": 8}, widths, precision)
            for p in feasible_defaults(READOUT, "mma", widths, precision)[:1]]


LARGE_WIDTHS = {"D": 256, "P": 64, "H": 512}
CASES = gpu_params(lambda: [_case(precision, w, plan) for precision in MMA_KINDS
                            for w in (SEED_WIDTHS, {"D": 128, "P": 32, "H": 256}, {"D": 48, "P": 24, "H": 80})
                            for plan in _default_and_two_samples(precision, w) + _streamed(precision, w)])
#: The large preset's widths, streamed (16 bits; odd shapes only up to N = 37: the float64 reference
#: of D256 H512 at N = 123 dominates the time).
LARGE_CASES = gpu_params(lambda: [_case(precision, LARGE_WIDTHS, plan) for precision in ("bfloat16", "tf32x3")
                                  for plan in _default_and_two_samples(precision, LARGE_WIDTHS)[:1]])
#: The node prologue inside the kernel (one_launch), in each precision at two widths.
ONE_LAUNCH_CASES = gpu_params(lambda: [_case(precision, w, plan) for precision in MMA_KINDS
                                       for w in (SEED_WIDTHS, {"D": 48, "P": 24, "H": 80})
                                       for plan in _one_launch(precision, w)])
#: Hopper's warpgroup products (16 bits, sm_90a): the default and two samples at three widths,
#: and the large preset's widths (odd shapes up to N = 37, as LARGE_CASES).
WGMMA_WIDTHS = (SEED_WIDTHS, {"D": 128, "P": 32, "H": 256}, {"D": 64, "P": 32, "H": 96})
WGMMA_CASES = gpu_params(lambda: [_case(precision, w, plan) for precision in HALF_PRECISIONS for w in WGMMA_WIDTHS
                                  for plan in sampled_plans(READOUT.at(precision), "wgmma", w, 2, seed=29)])
WGMMA_LARGE = gpu_params(lambda: [_case(precision, LARGE_WIDTHS, plan) for precision in HALF_PRECISIONS
                                  for plan in sampled_plans(READOUT.at(precision), "wgmma", LARGE_WIDTHS, 1)[:1]])
variants = compiled_cases(CASES + LARGE_CASES + ONE_LAUNCH_CASES + WGMMA_CASES + WGMMA_LARGE)


@pytest.mark.parametrize("plan", CASES)
def test_mma_variant_matches_float64_reference(plan, variants):
    assert_variant_matches_float64(READOUT, plan, compiled_variant(variants, plan), ODD_SHAPES)


@pytest.mark.parametrize("plan", ONE_LAUNCH_CASES)
def test_one_launch_matches_float64_reference(plan, variants):
    assert plan.params["one_launch"] and len(plan.kernels) == 1 and not READOUT.infeasible(plan, DeviceLimits())
    assert_variant_matches_float64(READOUT, plan, compiled_variant(variants, plan), ODD_SHAPES)


@pytest.mark.parametrize("plan", WGMMA_CASES)
def test_wgmma_variant_matches_float64_reference(plan, variants):
    assert_variant_matches_float64(READOUT, plan, compiled_variant(variants, plan), ODD_SHAPES)


@pytest.mark.parametrize("plan", WGMMA_LARGE)
def test_wgmma_at_the_large_widths(plan, variants):
    assert_variant_matches_float64(READOUT, plan, compiled_variant(variants, plan), [s for s in ODD_SHAPES if s[1] <= 37])


@pytest.mark.parametrize("plan", LARGE_CASES)
def test_streamed_weights_at_the_large_widths(plan, variants):
    assert plan.strategy == "mma" and not plan.params["resident"]
    assert_variant_matches_float64(READOUT, plan, compiled_variant(variants, plan), [s for s in ODD_SHAPES if s[1] <= 37])


@pytest.mark.parametrize("precision,dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_semantics_in_16_bits(precision, dtype):
    """Fully masked rows give nodes + norm.bias; NaN at a valid edge makes the row NaN, at a masked
    edge it is ignored; the module runs the mma kernel and answers in its dtype."""
    gen = generator(33)
    module = READOUT.make_module(SEED_WIDTHS, gen).cuda().to(dtype)
    nodes, pair, mask = READOUT.make_inputs({"B": 3, "N": 37, **SEED_WIDTHS}, gen)
    nodes, pair, mask = nodes.cuda().to(dtype), pair.cuda().to(dtype), mask.cuda()
    mask[2] = False  # a graph without edges
    pair[0, 5, 9, 3] = float("nan")
    mask[0, 5, 9] = True
    pair[1, 6, 9, 3] = float("nan")
    mask[1, 6, 9] = False
    assert module.kernel_precision(nodes, pair, mask) == precision
    assert module.variant_for(37, nodes.device, precision).plan.strategy == "mma"
    with torch.no_grad():
        out = module(nodes, pair, mask)
    assert out.dtype == dtype
    assert torch.isnan(out[0, 5]).all() and torch.isfinite(out[1, 6]).all()
    expected = (nodes.float() + module.norm.bias.float()).to(dtype)
    torch.testing.assert_close(out[2], expected[2], rtol=0, atol=0)
    torch.testing.assert_close(out[:, 0], expected[:, 0], rtol=0, atol=0)
    ref = reference64(module, (nodes, pair, mask))
    finite = torch.isfinite(ref).all(dim=-1)  # all but node 5 of graph 0
    assert compare(out[finite], ref[finite], READOUT.tolerance[precision]).ok


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_module_under_autocast(dtype):
    """Output dtype as the reference's under the same autocast (fp32: it ends in the residual of
    fp32 nodes); error against the float64 fp32 reference within AUTOCAST_BOUND; a parameter update
    reaches the next call."""
    gen = generator(6)
    widths = {"D": 128, "P": 32, "H": 256}
    module = READOUT.make_module(widths, gen).cuda()
    reference = READOUT.make_reference(module)
    inputs = tuple(t.cuda() for t in READOUT.make_inputs({"B": 2, "N": 45, **widths}, gen))
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        assert module.kernel_precision(*inputs) == {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
        out, ref_out = module(*inputs), reference(*inputs)
    assert out.dtype == ref_out.dtype
    assert compare(out.float(), reference64(module, inputs), READOUT.tolerance["float32"]).rel_l2 <= AUTOCAST_BOUND
    with torch.no_grad():
        module.fuse[2].weight.mul_(2.0)  # an optimizer-style in-place update
        with torch.autocast("cuda", dtype=dtype):
            again = module(*inputs)
    assert compare(again.float(), reference64(module, inputs), READOUT.tolerance["float32"]).rel_l2 <= AUTOCAST_BOUND


@pytest.mark.parametrize("precision", ["tf32x3", "tf32"])
def test_tf32_kinds_through_the_module(precision):
    gen = generator(9)
    widths = {"D": 128, "P": 32, "H": 256}
    module = READOUT.make_module(widths, gen).cuda()
    module.precision = precision
    inputs = tuple(t.cuda() for t in READOUT.make_inputs({"B": 3, "N": 41, **widths}, gen, "cauchy"))
    plan = next(p for p in _default_and_two_samples(precision, widths))
    module.force_variant(runtime.build_variant(plan))
    with torch.no_grad():
        out = module(*inputs)
    assert out.dtype == torch.float32
    assert compare(out, reference64(module, inputs), READOUT.tolerance[precision]).ok


@pytest.mark.parametrize("precision", ["tf32x3", "tf32"])
def test_nan_propagates_in_the_tf32_kinds(precision):
    """A NaN feature at a valid edge makes its node's row NaN (through layer 2, where the hidden
    value is the GPU's own NaN, 0x7fffffff: a rounding add on it carries into the sign bit); one
    at a masked edge is ignored."""
    gen = generator(34)
    widths = {"D": 128, "P": 32, "H": 256}
    module = READOUT.make_module(widths, gen).cuda()
    nodes, pair, mask = (t.cuda() for t in READOUT.make_inputs({"B": 2, "N": 37, **widths}, gen))
    pair[0, 5, 9, 3] = float("nan")
    mask[0, 5, 9] = True
    pair[1, 6, 9, 3] = float("nan")
    mask[1, 6, 9] = False
    plan = _default_and_two_samples(precision, widths)[0]
    out = run_variant(module, (nodes, pair, mask), runtime.build_variant(plan), (2, 37, widths["D"]))
    assert torch.isnan(out[0, 5]).all(), plan.label
    nan_rows = torch.isnan(out).any(-1)
    nan_rows[0, 5] = False
    assert not nan_rows.any(), f"{plan.label}: NaN outside the edge's row"


def test_launch_into_nan_prefilled_output_is_complete():
    """Every row of a B3 N123 output is written (NaN-prefilled, odd N, partial steps)."""
    widths = {"D": 48, "P": 24, "H": 80}
    plan = _default_and_two_samples("bfloat16", widths)[0]
    gen = generator(12)
    module = READOUT.make_module(widths, gen).cuda().to(torch.bfloat16)
    nodes, pair, mask = READOUT.make_inputs({"B": 3, "N": 123, **widths}, gen)
    inputs = (nodes.cuda().bfloat16(), pair.cuda().bfloat16(), mask.cuda())
    out = run_variant(module, inputs, runtime.build_variant(plan), (3, 123, 48))
    assert torch.isfinite(out).all()


def test_16_bit_calls_at_widths_no_mma_tile_fits_run_the_fp32_kernels():
    """D = 100 fits no pass of 16 columns (resident) nor whole fragment pairs per warp (streamed), so a
    small bf16 call runs the exact fp32 kernels on the input made fp32, not the reference."""
    widths = {"D": 100, "P": 16, "H": 64}
    gen = generator(14)
    module = READOUT.make_module(widths, gen).cuda().to(torch.bfloat16)
    nodes, pair, mask = READOUT.make_inputs({"B": 1, "N": 19, **widths}, gen)
    inputs = (nodes.cuda().bfloat16(), pair.cuda().bfloat16(), mask.cuda())
    # The call computes in bf16, but no bf16 kernel fits: the module's dispatch takes the no-kernel path.
    assert module.variant_for(19, 0, "bfloat16") is None and module.kernel_precision(*inputs) == "bfloat16"
    launched = []
    launch = module._launch
    module._launch = lambda *args, **kw: launched.append(args[0].dtype) or launch(*args, **kw)
    with torch.no_grad():
        out = module(*inputs)
    assert launched == [torch.float32] and out.dtype == torch.bfloat16
    assert compare(out, reference64(module, inputs), READOUT.tolerance["bfloat16"]).ok
