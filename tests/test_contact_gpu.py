"""GPU: every contact strategy over sampled params and odd shapes against the float64 reference."""
from __future__ import annotations

import pytest
import torch

from helpers import (ODD_SHAPES, REAL_WIDTHS, SEED_WIDTHS, assert_16_bit_gradients_meet_the_standard,
                     assert_closed_form_meets_the_standard,
                     assert_variant_matches_float64, check_tuned_entries, compiled_cases, compiled_variant, generator,
                     gpu_params, run_under_graph_capture, run_variant, sampled_cases, sampled_plans)
from pairgen import runtime
from pairgen.tuning.check import compare, reference64
from pairgen.spec import DeviceLimits
from pairgen.ops.contact import CONTACT

pytestmark = pytest.mark.gpu
TOL = CONTACT.tolerance["float32"]
WIDTHS = (SEED_WIDTHS, *REAL_WIDTHS)
POINTS_PER_STRATEGY = 6


def staged_cases() -> list:
    """cp.async staging, one buffer and prefetching, on a persistent grid so that a block runs
    several tiles (the buffers' reuse is what can go wrong) and on one block per tile."""
    cases = []
    for widths in WIDTHS:
        for strategy, tile in (("tiled", {"tile_rows": 32}), ("symmetric_tiled", {"tile_side": 4})):
            for stage_rows, blocks_per_sm in ((1, 0), (1, 1), (2, 1)):
                params = {**tile, "threads": 128, "tn": 4, "unroll": 2, "ln_rows": 2, "weights_smem": True,
                          "blocks_per_sm": blocks_per_sm, "stage_rows": stage_rows}
                plan = CONTACT.plan(strategy, params, widths)
                assert not CONTACT.infeasible(plan, DeviceLimits()), plan.label
                cases.append(pytest.param(plan, id=f"P{widths['P']}H{widths['H']}-staged-{plan.label}"))
    return cases


def grouped_layernorm_cases() -> list:
    """ln_lanes lanes per pair, with several rounds per tile (64 threads) and one (256), on a
    persistent grid and on one block per tile."""
    cases = []
    for widths in WIDTHS:
        for strategy, tile in (("tiled", {"tile_rows": 64}), ("symmetric_tiled", {"tile_side": 8})):
            for ln_lanes, threads, blocks_per_sm in ((4, 64, 1), (8, 256, 0), (4, 256, 0)):
                params = {**tile, "threads": threads, "tn": 4, "unroll": 2, "ln_rows": 2, "weights_smem": threads > 64,
                          "blocks_per_sm": blocks_per_sm, "stage_rows": 0, "ln_lanes": ln_lanes}
                plan = CONTACT.plan(strategy, params, widths)
                if CONTACT.infeasible(plan, DeviceLimits()):
                    continue
                cases.append(pytest.param(plan, id=f"P{widths['P']}H{widths['H']}-grouped-{plan.label}"))
    return cases


CASES = gpu_params(lambda: sampled_cases(CONTACT, WIDTHS, POINTS_PER_STRATEGY) + staged_cases() + grouped_layernorm_cases())


variants = compiled_cases(CASES)  # every sampled variant, compiled in parallel once


@pytest.mark.parametrize("plan", CASES)
def test_variant_matches_float64_reference(plan, variants):
    assert_variant_matches_float64(CONTACT, plan, compiled_variant(variants, plan), ODD_SHAPES)


def test_module_forward_noncontiguous_and_tuned_choice():
    gen = generator(11)
    module = CONTACT.make_module(SEED_WIDTHS, gen).cuda()
    base = torch.randn(2, 37, 37, SEED_WIDTHS["P"], generator=gen).cuda()
    x = base.transpose(1, 2)  # non-contiguous, still (B, N, N, P)
    assert not x.is_contiguous()
    with torch.no_grad():
        out = module(x)
    assert compare(out, reference64(module, (x,)), TOL).ok


def test_input_that_starts_mid_vector():
    """A contiguous view 4 bytes past an aligned start: the kernels' 16-byte reads need a copy."""
    gen = generator(15)
    module = CONTACT.make_module(SEED_WIDTHS, gen).cuda()
    P = SEED_WIDTHS["P"]
    flat = torch.randn(1 + 2 * 7 * 7 * P, generator=gen).cuda()
    x = flat[1:].view(2, 7, 7, P)
    assert x.is_contiguous() and x.data_ptr() % 16 == 4
    with torch.no_grad():
        out = module(x)
    assert compare(out, reference64(module, (x,)), TOL).ok


def test_runs_on_the_current_stream_and_under_graph_capture():
    gen = generator(12)
    module = CONTACT.make_module(SEED_WIDTHS, gen).cuda()
    x = torch.randn(3, 37, 37, SEED_WIDTHS["P"], generator=gen).cuda()
    ref = reference64(module, (x,))
    out = run_under_graph_capture(module, (x,))  # a launch on the legacy default stream would break capture
    assert compare(out, ref, TOL).ok


@pytest.mark.parametrize("fused", ["0", "1"])
@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recomputed"])
def test_gradients_meet_the_standard(recompute, fused, monkeypatch):
    """The closed-form backward (pairgen/ops/contact/backward.py), from the intermediates its
    forward kept or recomputed after the kernel's forward, with PyTorch's LayerNorm and with the
    row LayerNorm kernels (PAIRGEN_FUSED_BACKWARD): every gradient within relative L2 2e-5 of
    float64 autograd, at an odd length with heavy tails."""
    monkeypatch.setenv("PAIRGEN_FUSED_BACKWARD", fused)
    gen = generator(13)
    module = CONTACT.make_module(SEED_WIDTHS, gen).cuda()
    module.recompute_for_backward = recompute
    (x,) = (t.cuda() for t in CONTACT.make_inputs({"B": 2, "N": 37, **SEED_WIDTHS}, gen, "cauchy"))
    g = torch.randn(2, 37, 37, generator=gen).cuda()
    assert_closed_form_meets_the_standard(module, (x,), g)


#: Every strategy in every precision that runs it, at one point (the default, where it has one),
#: and wgmma with layer 1's ReLU output kept in registers (z_registers); the seed widths are every
#: strategy's.
def _nan_plans() -> list:
    plans = [sampled_plans(CONTACT.at(precision), strategy, SEED_WIDTHS, 1, seed=21)[0]
             for precision in CONTACT.precisions for strategy in CONTACT.at(precision).strategies]
    return plans + [CONTACT.at(precision).plan("wgmma", {"groups": 1, "swizzle": True, "prefetch": False, "ln_quads": True,
                                                         "z_registers": True}, SEED_WIDTHS) for precision in ("bfloat16", "float16")]


@pytest.mark.parametrize("plan", gpu_params(lambda: [pytest.param(plan, id=plan.label) for plan in _nan_plans()]))
def test_nan_propagates_to_both_symmetric_outputs(plan):
    """A NaN feature at (i, j) makes out[i, j] and out[j, i] NaN and nothing else, as in the
    reference: a ReLU as fmaxf(v, 0) returns 0 for NaN and hid it, and a TF32 split's rounding add
    on the GPU's own NaN (0x7fffffff) carries into the sign bit; the other outputs as the float64
    reference's."""
    precision = plan.precision
    gen = generator(8)
    module = CONTACT.make_module(SEED_WIDTHS, gen).cuda()
    (x,) = CONTACT.make_inputs({"B": 2, "N": 37, **SEED_WIDTHS}, gen)
    dtype = getattr(torch, precision) if precision in ("bfloat16", "float16") else torch.float32
    module, x = module.to(dtype), x.cuda().to(dtype)
    x[1, 4, 30, 7] = float("nan")
    out = run_variant(module, (x,), runtime.build_variant(plan), x.shape[:3])
    expected = torch.zeros_like(out, dtype=torch.bool)
    expected[1, 4, 30] = expected[1, 30, 4] = True
    assert torch.equal(torch.isnan(out), expected), plan.label
    finite = ~expected
    reference = reference64(module, (x,))
    assert compare(out[finite], reference[finite], CONTACT.tolerance[precision]).ok, plan.label


def test_weights_updated_in_place_are_repacked():
    gen = generator(14)
    module = CONTACT.make_module(SEED_WIDTHS, gen).cuda()
    x = torch.randn(1, 7, 7, SEED_WIDTHS["P"], generator=gen).cuda()
    with torch.no_grad():
        module(x)
        module.mlp[0].weight.mul_(-0.5)  # an optimizer step, in effect
        out = module(x)
    assert compare(out, reference64(module, (x,)), TOL).ok


def test_tuned_entries_load_and_run():
    check_tuned_entries(CONTACT)


#: The one case the MLP kernel misses, and the closed form without it too (on the CPU emulator: the
#: same 0.028 for mlp.2.weight and 0.034 for mlp.2.bias against bounds of 0.027 and 0.025, also
#: with the backward's products in fp32): at B2 N37 P48 H32 those gradients rest on about twenty
#: ReLU flips in h2 (the reference has more, but they fall where they weigh less). Strict: a
#: change that makes it pass must say why here.
SMALL_SHAPE_MISS = pytest.mark.xfail(strict=True, reason="bf16 P48 H32: the closed form's mlp.2 gradients, about "
                                                         "twenty ReLU flips (see SMALL_SHAPE_MISS)")


@pytest.mark.parametrize("dtype,widths", [
    (torch.bfloat16, {"P": 128, "H": 128}), (torch.float16, {"P": 128, "H": 128}),
    pytest.param(torch.bfloat16, {"P": 48, "H": 32}, marks=SMALL_SHAPE_MISS), (torch.float16, {"P": 48, "H": 32})],
    ids=["bf16-P128H128", "fp16-P128H128", "bf16-P48H32", "fp16-P48H32"])
def test_16_bit_training_through_the_mlp_kernel_meets_the_16_bit_standard(dtype, widths, monkeypatch):
    """A 16-bit training step that recomputes (the kernel forward, then the closed form from the
    input) runs the MLP's forward and backward in one kernel (templates/contact/mlp_backward.cu.j2)
    where it applies: every gradient within the 16-bit standard, at an odd length with heavy tails."""
    from pairgen.ops.contact import fused_backward

    monkeypatch.setattr(fused_backward, "MLP_KERNEL", True)  # off by default (see its comment)
    runs = []
    real = fused_backward.mlp_forward_backward
    monkeypatch.setattr(fused_backward, "mlp_forward_backward", lambda *a: runs.append(a) or real(*a))
    gen = generator(17)
    module = CONTACT.make_module(widths, gen).cuda().to(dtype)
    module.recompute_for_backward = True
    module.backward_mode = "closed_form"
    (x,) = CONTACT.make_inputs({"B": 2, "N": 37, **widths}, gen, "cauchy")
    x, g = x.cuda().to(dtype), torch.randn(2, 37, 37, generator=gen).cuda().to(dtype)
    leaf = x.clone().requires_grad_()
    (module(leaf) * g).sum().backward()
    assert runs, "the MLP kernel did not run"
    assert_16_bit_gradients_meet_the_standard(module, (x,), g, [leaf.grad] + [p.grad for p in module.parameters()])
