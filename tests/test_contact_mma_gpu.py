"""GPU: the contact head's tensor-core strategies (mma; wgmma in 16 bits) against the float64 reference in every
precision (bfloat16, float16: module and inputs in that dtype; tf32x3 at the fp32 standard; tf32),
over sampled points and odd shapes with heavy tails and NaN-prefilled outputs; exactly symmetric
outputs; 16-bit modules, fp32 modules under autocast and tf32x3 modules through the module."""
from __future__ import annotations

import pytest
import torch

from helpers import (ODD_SHAPES, assert_variant_matches_float64, compiled_cases, compiled_variant, generator,
                     gpu_params, run_variant, sampled_plans)
from pairgen.ops.contact import CONTACT
from pairgen.spec import HALF_PRECISIONS, MMA_KINDS, DeviceLimits
from pairgen.tuning.check import compare, reference64

pytestmark = pytest.mark.gpu
SHAPES = [(b, n) for b, n in ODD_SHAPES if n <= 64]
#: An fp32 module under autocast, against the float64 fp32 reference: what a bf16 computation of
#: the head can reach (its rounded input and weights alone give ~4e-3).
AUTOCAST_BOUND = 2e-2


def _default_and_two_samples(precision: str, widths: dict, strategy: str = "mma") -> list:
    """The default, two samples, and the default with the other step 1 (ln_quads), where feasible."""
    view = CONTACT.at(precision)
    plans = sampled_plans(view, strategy, widths, 2, seed=21)
    first = plans[0]
    other = view.plan(strategy, {**first.params, "ln_quads": not first.params["ln_quads"]}, widths)
    plans += [] if CONTACT.infeasible(other, DeviceLimits(arch="sm_90")) else [other]
    return list({p.label: p for p in plans[:1] + plans[-3:]}.values())


WIDTHS = ({"P": 64, "H": 32}, {"P": 128, "H": 128}, {"P": 128, "H": 64})


def _case(precision: str, w: dict, plan):
    return pytest.param(plan, id=f"{precision}-P{w['P']}H{w['H']}-{plan.label}")


CASES = gpu_params(lambda: [_case(precision, w, plan) for precision in MMA_KINDS for w in WIDTHS
                            for plan in _default_and_two_samples(precision, w)])


def _wgmma_cases() -> list:
    """Hopper's warpgroup products (16 bits, sm_90a); three and four warpgroups a block (the 384
    and 512 threads cap registers at 168 and 128); layer 1's output kept in registers as layer 2's
    A operand (z_registers), with and without the swizzle and prefetch, at one and four warpgroups."""
    cases = [_case(precision, w, plan) for precision in HALF_PRECISIONS for w in WIDTHS
             for plan in _default_and_two_samples(precision, w, "wgmma")]
    cases += [_case(precision, w, plan) for precision in HALF_PRECISIONS for w in WIDTHS
              for plan in [CONTACT.at(precision).plan("wgmma", {"groups": groups, "swizzle": True, "prefetch": False,
                                                                "ln_quads": True}, w) for groups in (3, 4)]
              if not CONTACT.infeasible(plan, DeviceLimits(arch="sm_90"))]
    cases += [_case(precision, w, plan) for precision in HALF_PRECISIONS for w in WIDTHS
              for plan in [CONTACT.at(precision).plan("wgmma", {"groups": groups, "swizzle": swizzle, "prefetch": prefetch,
                                                                "ln_quads": groups == 4, "z_registers": True}, w)
                           for groups, swizzle, prefetch in ((1, False, False), (4, True, True), (4, True, False))]
              if not CONTACT.infeasible(plan, DeviceLimits(arch="sm_90"))]
    return cases


WGMMA_CASES = gpu_params(_wgmma_cases)
variants = compiled_cases(CASES + WGMMA_CASES)


def _symmetric(module, inputs, variant, k):
    out = run_variant(module, inputs, variant, inputs[0].shape[:3])
    return [] if torch.equal(out, out.transpose(1, 2)) else ["the output is not exactly symmetric"]


@pytest.mark.parametrize("plan", CASES)
def test_mma_variant_matches_float64_reference(plan, variants):
    assert_variant_matches_float64(CONTACT, plan, compiled_variant(variants, plan), SHAPES, also=_symmetric)


@pytest.mark.parametrize("plan", WGMMA_CASES)
def test_wgmma_variant_matches_float64_reference(plan, variants):
    assert_variant_matches_float64(CONTACT, plan, compiled_variant(variants, plan), SHAPES, also=_symmetric)


@pytest.mark.parametrize("precision,dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_modules_run_the_mma_kernel_and_answer_in_their_dtype(precision, dtype):
    gen = generator(7)
    module = CONTACT.make_module({"P": 64, "H": 32}, gen).cuda().to(dtype)
    (x,) = CONTACT.make_inputs({"B": 3, "N": 37, "P": 64, "H": 32}, gen)
    x = x.cuda().to(dtype)
    assert module.kernel_precision(x) == precision
    assert module.variant_for(37, x.device, precision).plan.strategy in ("mma", "wgmma")
    with torch.no_grad():
        out = module(x)
    assert out.dtype == dtype
    assert compare(out, reference64(module, (x,)), CONTACT.tolerance[precision]).ok


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_module_under_autocast(dtype):
    """Output dtype as the reference's under the same autocast; error against the float64 fp32
    reference within AUTOCAST_BOUND; a parameter update reaches the next call."""
    gen = generator(5)
    module = CONTACT.make_module({"P": 128, "H": 128}, gen).cuda()
    reference = CONTACT.make_reference(module)
    (x,) = (t.cuda() for t in CONTACT.make_inputs({"B": 1, "N": 128, "P": 128, "H": 128}, gen))
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        out, ref_out = module(x), reference(x)
    assert out.dtype == ref_out.dtype
    assert compare(out.float(), reference64(module, (x,)), CONTACT.tolerance["float32"]).rel_l2 <= AUTOCAST_BOUND
    assert module.kernel_precision(x) == "float32"  # outside autocast: exact fp32 again
    with torch.no_grad():
        module.mlp[2].weight.mul_(2.0)  # an optimizer-style in-place update
        with torch.autocast("cuda", dtype=dtype):
            again = module(x)
    assert compare(again.float(), reference64(module, (x,)), CONTACT.tolerance["float32"]).rel_l2 <= AUTOCAST_BOUND


def test_tf32x3_module_meets_the_fp32_standard():
    gen = generator(9)
    module = CONTACT.make_module({"P": 128, "H": 64}, gen).cuda()
    module.precision = "tf32x3"
    (x,) = (t.cuda() for t in CONTACT.make_inputs({"B": 1, "N": 123, "P": 128, "H": 64}, gen, "cauchy"))
    with torch.no_grad():
        out = module(x)
    assert out.dtype == torch.float32
    assert compare(out, reference64(module, (x,)), CONTACT.tolerance["tf32x3"]).ok
