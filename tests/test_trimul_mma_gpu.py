"""GPU: the triangle update's tensor-core strategy against the float64 reference in every precision
(bfloat16, float16: module and inputs in that dtype; tf32x3 at the fp32 standard; tf32), over
sampled points, every option set and odd shapes with heavy tails, empty rows and NaN-prefilled
outputs; fp32 modules under autocast; the packed weights following the parameters."""
from __future__ import annotations

import itertools

import pytest
import torch

from helpers import (ODD_SHAPES, assert_variant_matches_float64, compiled_cases, compiled_variant, generator,
                     run_variant, sampled_plans, gpu_params)
from pairgen import runtime
from pairgen.ops.trimul import TRIMUL
from pairgen.ops.trimul.strategies import wgmma
from pairgen.spec import DeviceLimits
from pairgen.spec import AUTOCAST_TOLERANCE, MMA_KINDS
from pairgen.tuning.check import compare, reference64

pytestmark = pytest.mark.gpu
OPTION_SETS = [{"outgoing": o, "gate_normalized": g, "bias": b} for o, g, b in itertools.product((0, 1), (0, 1), (1, 0))]
SHAPES = [(b, n) for b, n in ODD_SHAPES if n <= 64]
#: An fp32 module under autocast against the float64 fp32 reference (cuEquivariance's bf16 error).
AUTOCAST_BOUND = AUTOCAST_TOLERANCE.rel_l2


def _cases():
    cases = []
    for precision in MMA_KINDS:
        view = TRIMUL.at(precision)
        for widths in ({"P": 64, "H": 32, **OPTION_SETS[0]}, {"P": 128, "H": 128, **OPTION_SETS[-1]}):
            for plan in sampled_plans(view, "mma", widths, 2, seed=11):
                cases.append(pytest.param(plan, id=f"{precision}-P{widths['P']}-{plan.label}"))
        for k, options in enumerate(OPTION_SETS):  # every option set at the mma default point
            widths = {"P": 48, "H": 24, **options}
            plan = next(p for p in (view.plan(s, params, widths) for s, params in view.default_points if s == "mma")
                        if not TRIMUL.infeasible(p, DeviceLimits()))
            cases.append(pytest.param(plan, id=f"{precision}-P48-opts{k}"))
    return cases


def _wgmma_cases():
    """The Hopper strategy (16-bit only): sampled points at the seed's and the models' widths, and
    every option set at P = 48, H = 24 (k padded to whole steps)."""
    cases = []
    for precision in ("bfloat16", "float16"):
        view = TRIMUL.at(precision)
        for widths in ({"P": 64, "H": 32, **OPTION_SETS[0]}, {"P": 128, "H": 128, **OPTION_SETS[-1]}):
            for plan in sampled_plans(view, "wgmma", widths, 2, seed=13):
                cases.append(pytest.param(plan, id=f"wgmma-{precision}-P{widths['P']}-{plan.label}"))
        for k, options in enumerate(OPTION_SETS):
            plan = sampled_plans(view, "wgmma", {"P": 48, "H": 24, **options}, 1, seed=k)[0]
            cases.append(pytest.param(plan, id=f"wgmma-{precision}-P48-opts{k}"))
    return cases


def _hidden_gate_cases():
    """The out gate in hidden width (gate_hidden): mma in every kind and wgmma in 16 bits, sampled
    points at P > H (with and without the gate on the normalised input, biases) and P = H; mma's
    resident and staged weights; wgmma's swizzled and interleaved layouts."""
    cases = []
    for precision in MMA_KINDS:
        view = TRIMUL.at(precision)
        strategies = ("mma", "wgmma") if precision in ("bfloat16", "float16") else ("mma",)
        for widths in ({"P": 64, "H": 32, **OPTION_SETS[0]}, {"P": 128, "H": 128, **OPTION_SETS[-1]},
                       {"P": 128, "H": 64, **OPTION_SETS[5]}):
            widths = {**widths, "gate_hidden": 1}
            for strategy in strategies:
                plans = sampled_plans(view, strategy, widths, 1, seed=17)  # its first feasible default, a sample
                for plan in {id(p): p for p in plans[:1] + plans[-1:]}.values():
                    cases.append(pytest.param(plan, id=f"hidden-{precision}-P{widths['P']}H{widths['H']}-{plan.label}"))
    return cases


#: wgmma with paired columns (two channels per lane, stmatrix staging, the sigmoid's halves folded
#: into the staged constants): small passes for any P a multiple of 16 and H of 8.
PAIRED = {"p_groups": 2, "p_stages": 1, "p_wn": 32, "o_groups": 2, "o_wn": 16, "o_stages": 1, "swizzle": False,
          "consts_smem": True, "paired_columns": True}


def _paired_cases():
    """Paired columns in both 16-bit types: every option set at P = 48, H = 24 (k padded, 12 passes
    of 32 columns), the seed's widths, the models' form at the first default point with pairing in
    both directions (swizzled, 4 warpgroups, x in registers) and with two stages, and the gate in
    hidden width; the early x fetch with and without pairing (8 and 3 passes of the projection); x in
    registers at 3 warpgroups and at k padded; the triangle sums in registers at the models' form
    (3 and 4 warpgroups) and at H = 16, 32, 48 (one to three k-steps); the projection's epilogue
    constants loaded before the wait for its products."""
    cases = []
    for precision in ("bfloat16", "float16"):
        view = TRIMUL.at(precision)
        # the first default without its normalised operands, the output's x in registers and its staged
        # stores (their own cases)
        first_default = {**next(params for s, params in view.default_points if s == "wgmma"), "paired_columns": True,
                         **wgmma.REGISTER_VARIANTS_OFF}
        points = [({"P": 48, "H": 24, **options}, PAIRED) for options in OPTION_SETS]
        points += [({"P": 64, "H": 32, **OPTION_SETS[0]}, PAIRED),
                   ({"P": 128, "H": 128, **OPTION_SETS[-1]}, first_default),
                   ({"P": 128, "H": 128, **OPTION_SETS[-2], "outgoing": 0}, first_default),
                   ({"P": 128, "H": 128, **OPTION_SETS[-1]}, {**first_default, "p_groups": 2, "p_stages": 2,
                                                              "o_groups": 2, "o_stages": 2, "x_registers": False}),
                   ({"P": 128, "H": 64, **OPTION_SETS[5], "gate_hidden": 1}, PAIRED),
                   # the next tile's x fetched as this tile's last products finish (odd and even pass counts)
                   ({"P": 128, "H": 128, **OPTION_SETS[-1]}, {**first_default, "early_x_fetch": True,
                                                              "x_registers": False, "p_wn": 64}),
                   ({"P": 128, "H": 128, **OPTION_SETS[-2], "outgoing": 0},
                    {**first_default, "early_x_fetch": True, "x_registers": False, "p_wn": 64}),
                   ({"P": 48, "H": 24, **OPTION_SETS[2]}, {**PAIRED, "early_x_fetch": True}),
                   ({"P": 48, "H": 24, **OPTION_SETS[3]}, {**PAIRED, "early_x_fetch": True, "paired_columns": False,
                                                           "consts_smem": False, "p_groups": 3}),
                   # x in registers (the passes read only Wp from shared memory)
                   ({"P": 128, "H": 128, **OPTION_SETS[-1]}, {**first_default, "x_registers": True, "p_groups": 3,
                                                              "p_wn": 64}),
                   ({"P": 48, "H": 24, **OPTION_SETS[1]}, {**PAIRED, "x_registers": True}),
                   ({"P": 64, "H": 32, **OPTION_SETS[0]}, {**PAIRED, "x_registers": True}),
                   # the triangle sums in registers (the out product's A from the staging by ldmatrix.trans; the
                   # first default has them: here also without, and at 4 warpgroups)
                   ({"P": 128, "H": 128, **OPTION_SETS[-1]}, {**first_default, "z_registers": False}),
                   ({"P": 128, "H": 128, **OPTION_SETS[-2], "outgoing": 0},
                    {**first_default, "z_registers": True, "o_groups": 4, "o_wn": 32}),
                   ({"P": 64, "H": 32, **OPTION_SETS[2]}, {**PAIRED, "z_registers": True}),
                   ({"P": 48, "H": 48, **OPTION_SETS[4]}, {**PAIRED, "z_registers": True, "o_wn": 48 // 3}),
                   ({"P": 48, "H": 16, **OPTION_SETS[7]}, {**PAIRED, "z_registers": True, "x_registers": True}),
                   # the mask loaded a tile ahead (p_mask_early): the first default, 3 warpgroups of 64
                   # columns with x in shared memory, k padded
                   ({"P": 128, "H": 128, **OPTION_SETS[-1]}, {**first_default, "p_mask_early": True}),
                   ({"P": 128, "H": 128, **OPTION_SETS[-2], "outgoing": 0},
                    {**first_default, "p_mask_early": True, "x_registers": False, "p_groups": 3, "p_wn": 64}),
                   ({"P": 48, "H": 24, **OPTION_SETS[3]}, {**PAIRED, "p_mask_early": True}),
                   # x normalised in registers (p_normalized_x): the first default both ways, 3 warpgroups
                   # of 64 columns, k padded, every option set at small widths (biases, gates on the input)
                   ({"P": 128, "H": 128, **OPTION_SETS[-1]}, {**first_default, "p_normalized_x": True}),
                   ({"P": 128, "H": 128, **OPTION_SETS[-2], "outgoing": 0},
                    {**first_default, "p_normalized_x": True, "p_mask_early": False, "p_groups": 3, "p_wn": 64}),
                   ({"P": 48, "H": 24, **OPTION_SETS[3]}, {**PAIRED, "x_registers": True, "p_normalized_x": True})]
        points += [({"P": 64, "H": 32, **options}, {**PAIRED, "x_registers": True, "p_normalized_x": True})
                   for options in OPTION_SETS]
        # the output's sums and x normalised in registers (o_normalized): with the projection's, alone at 2
        # warpgroups of 128 columns, and every option set at small widths (biases, the gate on the input)
        points += [({"P": 128, "H": 128, **OPTION_SETS[-1]}, {**first_default, "o_x_registers": True,
                                                              "o_normalized": True, "p_normalized_x": True}),
                   ({"P": 128, "H": 128, **OPTION_SETS[-2], "outgoing": 0},
                    {**first_default, "o_x_registers": True, "o_normalized": True, "o_groups": 2, "o_wn": 128})]
        points += [({"P": 48, "H": 16, **options}, {**PAIRED, "z_registers": True, "x_registers": True,
                                                    "o_x_registers": True, "o_normalized": True})
                   for options in OPTION_SETS]
        # the output's 16-bit rows through a per-warp staging (o_staged_stores): the first default both
        # ways, the sums in registers alone at 4 warpgroups, every option set at small widths
        points += [({"P": 128, "H": 128, **OPTION_SETS[-1]}, {**first_default, "o_x_registers": True,
                                                              "o_normalized": True, "p_normalized_x": True,
                                                              "o_staged_stores": True}),
                   ({"P": 128, "H": 128, **OPTION_SETS[-2], "outgoing": 0},
                    {**first_default, "o_staged_stores": True, "o_groups": 4, "o_wn": 32})]
        points += [({"P": 64, "H": 32, **options}, {**PAIRED, "z_registers": True, "o_staged_stores": True})
                   for options in OPTION_SETS]
        for k, (widths, params) in enumerate(points):
            plan = view.plan("wgmma", params, widths)
            assert not TRIMUL.infeasible(plan, DeviceLimits()), (widths, params)
            cases.append(pytest.param(plan, id=f"paired-{precision}-{k}-P{widths['P']}H{widths['H']}"))
    return cases


def _sliced_cases():
    """Column slices (each block holding a slice of the projection's and of the output's weight
    rows, the rows' statistics from their own kernel), in both 16-bit types: at the wide widths
    where a point's kernels fit only sliced (the fewest slices that fit: a quarter of each kernel's
    rows a block at P = 384, H = 128 outgoing and P = H = 256 incoming), and with counts named at
    small widths: every option set, the projection's k padded, slices of one and of several passes,
    the sums in shared memory and in registers, two x stages, the early fetch, one kernel sliced
    and the other not; and the wide widths' default points (128-column passes, one output
    warpgroup; 64-column output passes at P = 384, H = 256, incoming)."""
    cases = []
    for precision in ("bfloat16", "float16"):
        view = TRIMUL.at(precision)
        wide = {"p_groups": 2, "p_stages": 1, "p_wn": 64, "o_groups": 2, "o_wn": 32, "o_stages": 1, "swizzle": True,
                "consts_smem": True, "paired_columns": True, "z_registers": True}
        small = {**PAIRED, "p_slices": 4, "o_slices": 4}  # P = 64, H = 32: one pass a slice in both kernels
        points = [({"P": 384, "H": 128, **OPTION_SETS[-1]}, wide),
                  ({"P": 256, "H": 256, **OPTION_SETS[-2], "outgoing": 0}, wide)]
        for widths in ({"P": 384, "H": 128, **OPTION_SETS[-1]}, {"P": 384, "H": 256, **OPTION_SETS[-2], "outgoing": 0}):
            default = TRIMUL.default_plan(widths, DeviceLimits(), precision)
            assert default.strategy == "wgmma" and default.params["p_wn"] == 128, default.label
            points.append((widths, default.params))
        points += [({"P": 64, "H": 32, **options}, small) for options in OPTION_SETS]
        points += [({"P": 48, "H": 32, **OPTION_SETS[5]}, {**PAIRED, "p_slices": 4}),
                   ({"P": 64, "H": 32, **OPTION_SETS[0]}, {**PAIRED, "p_slices": 2, "o_slices": 2, "z_registers": True}),
                   ({"P": 64, "H": 32, **OPTION_SETS[3]}, {**PAIRED, "p_slices": 2, "p_stages": 2, "o_slices": 2,
                                                           "o_stages": 2}),
                   ({"P": 64, "H": 32, **OPTION_SETS[6]}, {**PAIRED, "p_slices": 4, "early_x_fetch": True}),
                   ({"P": 64, "H": 32, **OPTION_SETS[7]}, {**PAIRED, "o_slices": 2, "x_registers": True})]
        for k, (widths, params) in enumerate(points):
            plan = view.plan("wgmma", params, widths)
            assert not TRIMUL.infeasible(plan, DeviceLimits()), (widths, params, TRIMUL.infeasible(plan, DeviceLimits()))
            assert plan.context["p_slices"] > 1 or plan.context["o_slices"] > 1, (widths, params)
            cases.append(pytest.param(plan, id=f"sliced-{precision}-{k}-P{widths['P']}H{widths['H']}"))
    return cases


def _w_registers_point(precision: str) -> dict:
    """The first default with the projection's Wp in registers (two warpgroups, two x stages)."""
    return wgmma.w_registers_point(TRIMUL, precision)


def _w_registers_cases():
    """The projection with Wp in registers (its products' operands swapped: Wp's 64-row blocks as A
    from registers, the x tile shared by the block's warpgroups as B, a and b stored from the
    accumulators), in both 16-bit types: the models' form in both directions (4 row blocks a
    warpgroup), every option set at P = 64, H = 32 (one a warpgroup), one warpgroup of 4 blocks (H =
    64), k padded and unswizzled (P = 48), the gate in hidden width; and the output kernel's x in
    registers (o_x_registers) with it and alone."""
    cases = []
    for precision in ("bfloat16", "float16"):
        view = TRIMUL.at(precision)
        model = _w_registers_point(precision)
        small = {**PAIRED, "w_registers": True, "p_stages": 2}
        points = [({"P": 128, "H": 128, **OPTION_SETS[-1]}, model),
                  ({"P": 128, "H": 128, **OPTION_SETS[-2], "outgoing": 0}, model),
                  ({"P": 128, "H": 64, **OPTION_SETS[-1]}, {**model, "p_groups": 1})]
        points += [({"P": 64, "H": 32, **options}, small) for options in OPTION_SETS]
        points += [({"P": 48, "H": 32, **OPTION_SETS[5]}, small),
                   ({"P": 128, "H": 64, **OPTION_SETS[5], "gate_hidden": 1}, small)]
        # slices of Wp's row blocks (the wide widths; named at small ones), the statistics from their kernel
        wide = {**model, "o_groups": 2, "o_wn": 32}
        points += [({"P": 384, "H": 128, **OPTION_SETS[-1]}, wide),
                   ({"P": 256, "H": 256, **OPTION_SETS[-2], "outgoing": 0}, wide),
                   ({"P": 64, "H": 64, **OPTION_SETS[2]}, {**small, "p_slices": 2}),
                   ({"P": 48, "H": 64, **OPTION_SETS[7]}, {**small, "p_slices": 2, "o_wn": 16})]
        # the output kernel's x in registers too (o_x_registers), and alone: both directions,
        # the gate on the raw input, k padded
        with_x = {**next(params for s, params in view.default_points if s == "wgmma"), **wgmma.REGISTER_VARIANTS_OFF,
                  "o_x_registers": True}
        points += [({"P": 128, "H": 128, **OPTION_SETS[-1]}, {**model, "o_x_registers": True}),
                   ({"P": 128, "H": 128, **OPTION_SETS[-2], "outgoing": 0}, with_x),
                   ({"P": 64, "H": 32, **OPTION_SETS[1]}, {**PAIRED, "z_registers": True, "o_x_registers": True}),
                   ({"P": 48, "H": 48, **OPTION_SETS[4]}, {**PAIRED, "z_registers": True, "o_x_registers": True,
                                                           "o_wn": 16})]
        for k, (widths, params) in enumerate(points):
            plan = view.plan("wgmma", params, widths)
            assert not TRIMUL.infeasible(plan, DeviceLimits()), (widths, params, TRIMUL.infeasible(plan, DeviceLimits()))
            cases.append(pytest.param(plan, id=f"w_registers-{precision}-{k}-P{widths['P']}H{widths['H']}"))
    return cases


#: The streamed kernels' switches (off until timed): their cases are planned and run with both on.
STREAMED_SWITCHES = ("OUTPUT_STREAMED", "PROJECTION_STREAMED")


def _streamed_cases():
    """The streamed kernels (wgmma.OUTPUT_STREAMED, wgmma.PROJECTION_STREAMED), in both 16-bit types:
    the wide classes' default points with one, two and three output warpgroups (3, 3 and 2 slices)
    and two to four projection warpgroups, both directions, the gate on the raw input, biases and an
    fp32 output."""
    cases, saved = [], {name: getattr(wgmma, name) for name in STREAMED_SWITCHES}
    for name in STREAMED_SWITCHES:
        setattr(wgmma, name, True)
    try:
        for precision in ("bfloat16", "float16"):
            view = TRIMUL.at(precision)
            points = [({"P": 384, "H": 256, **OPTION_SETS[-1]}, {}),
                      ({"P": 384, "H": 256, **OPTION_SETS[-2], "outgoing": 0}, {"o_groups": 2, "p_groups": 4, "p_wn": 64}),
                      ({"P": 256, "H": 256, **OPTION_SETS[-1]}, {"o_groups": 3, "o_wn": 32, "p_groups": 3, "p_wn": 64}),
                      ({"P": 384, "H": 128, **OPTION_SETS[5], "out_fp32": 1}, {"o_groups": 2})]
            for k, (widths, override) in enumerate(points):
                default = TRIMUL.default_plan(widths, DeviceLimits(), precision)
                plan = view.plan("wgmma", {**default.params, **override}, widths)
                assert plan.context["o_streamed"] and plan.context["p_streamed"], (widths, override)
                assert not TRIMUL.infeasible(plan, DeviceLimits()), (widths, override)
                cases.append(pytest.param(plan, id=f"streamed-{precision}-{k}-P{widths['P']}H{widths['H']}"))
    finally:
        for name, value in saved.items():
            setattr(wgmma, name, value)
    return cases


CASES = gpu_params(lambda: _cases() + _wgmma_cases() + _hidden_gate_cases() + _paired_cases() + _sliced_cases()
                   + _w_registers_cases())
variants = compiled_cases(CASES)
STREAMED_CASES = gpu_params(_streamed_cases)
streamed_variants = compiled_cases(STREAMED_CASES)


@pytest.mark.parametrize("plan", CASES)
def test_mma_variant_matches_float64_reference(plan, variants):
    assert_variant_matches_float64(TRIMUL, plan, compiled_variant(variants, plan), SHAPES)


@pytest.mark.parametrize("plan", STREAMED_CASES)
def test_the_streamed_kernels_match_float64_reference(plan, streamed_variants, monkeypatch):
    """The streamed kernels' cases, run with their switches on as made (a call that wants an fp32
    output plans its kernels again, and must plan the streamed ones)."""
    for name in STREAMED_SWITCHES:
        monkeypatch.setattr(wgmma, name, True)
    assert_variant_matches_float64(TRIMUL, plan, compiled_variant(streamed_variants, plan), SHAPES)


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_w_registers_projection_over_many_tiles_a_block(precision):
    """The projection with Wp in registers is persistent: a block takes every gridDim-th tile, the
    two x buffers and the statistics alternating. The cases above have at most a few tiles a block;
    here N = 123, 300 and B2 N97 (odd N: a and b's channel rows unaligned, tiles straddling batches)
    give up to ~11 a block."""
    plan = TRIMUL.at(precision).plan("wgmma", _w_registers_point(precision), {"P": 128, "H": 128, **OPTION_SETS[-1]})
    variant = runtime.variant_of(plan, torch.cuda.current_device())
    assert_variant_matches_float64(TRIMUL, plan, variant, [(1, 123), (1, 300), (2, 97)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("options", [OPTION_SETS[0], OPTION_SETS[-1]])
def test_fp32_module_under_autocast(dtype, options):
    """Output dtype as the reference's under the same autocast; error against the float64 fp32
    reference within cuEquivariance's bf16 error; a parameter update reaches the next call."""
    widths = {"P": 128, "H": 128, **options}
    gen = generator(5)
    module = TRIMUL.make_module(widths, gen).cuda()
    reference = TRIMUL.make_reference(module)
    x, mask = (t.cuda() for t in TRIMUL.make_inputs({"B": 1, "N": 128, **widths}, gen))
    expected = reference64(module, (x, mask))
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        out, ref_out = module(x, mask), reference(x, mask)
    assert out.dtype == ref_out.dtype == dtype
    result = compare(out, expected, TRIMUL.tolerance["float32"])
    assert result.rel_l2 <= AUTOCAST_BOUND, str(result)
    assert module.kernel_precision(x, mask) == "float32"  # outside autocast: exact fp32 again
    with torch.no_grad():
        module.out_proj.weight.mul_(2.0)  # an optimizer-style in-place update
        with torch.autocast("cuda", dtype=dtype):
            again = module(x, mask)
    assert compare(again, reference64(module, (x, mask)), TRIMUL.tolerance["float32"]).rel_l2 <= AUTOCAST_BOUND


def test_half_modules_choose_the_mma_kernels_and_answer_in_their_dtype():
    widths = {"P": 64, "H": 32, **OPTION_SETS[0]}
    for precision, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        gen = generator(7)
        module = TRIMUL.make_module(widths, gen).cuda().to(dtype)
        x, mask = TRIMUL.make_inputs({"B": 3, "N": 37, **widths}, gen)
        x, mask = x.cuda().to(dtype), mask.cuda()
        assert module.kernel_precision(x, mask) == precision
        assert module.variant_for(37, x.device, precision).plan.strategy == "mma"
        with torch.no_grad():
            out = module(x, mask)
        assert out.dtype == dtype
        assert compare(out, reference64(module, (x, mask)), TRIMUL.tolerance[precision]).ok


def test_tf32x3_module_meets_the_fp32_standard_with_tf32_allowed_elsewhere():
    widths = {"P": 128, "H": 128, **OPTION_SETS[-1]}
    gen = generator(9)
    module = TRIMUL.make_module(widths, gen).cuda()
    module.precision = "tf32x3"
    x, mask = (t.cuda() for t in TRIMUL.make_inputs({"B": 1, "N": 123, **widths}, gen, "cauchy"))
    saved = torch.backends.cuda.matmul.fp32_precision
    try:
        with torch.no_grad():
            out = module(x, mask)
    finally:
        torch.backends.cuda.matmul.fp32_precision = saved
    assert torch.backends.cuda.matmul.fp32_precision == saved, "the caller's setting is restored"
    assert compare(out, reference64(module, (x, mask)), TRIMUL.tolerance["tf32x3"]).ok


@pytest.mark.parametrize("precision", MMA_KINDS)
def test_nan_propagates_along_its_row_and_column(precision):
    """A NaN feature at (p, p) reaches, through the projections (whose LayerNorm row is the GPU's
    own NaN, 0x7fffffff: a rounding add on it carries into the sign bit), exactly the outputs that
    sum over it: row p and column p, outgoing and incoming alike."""
    widths = {"P": 64, "H": 32, **OPTION_SETS[-1]}
    view = TRIMUL.at(precision)
    plan = sampled_plans(view, "mma", widths, 0, seed=11)[0]
    gen = generator(10)
    module = TRIMUL.make_module(widths, gen).cuda()
    x, mask = (t.cuda() for t in TRIMUL.make_inputs({"B": 2, "N": 29, **widths}, gen))
    if precision in ("bfloat16", "float16"):
        module, x = module.to(getattr(torch, precision)), x.to(getattr(torch, precision))
    mask = torch.ones_like(mask)
    x[1, 11, 11, 5] = float("nan")
    out = run_variant(module, (x, mask), runtime.build_variant(plan), x.shape)
    expected = torch.zeros(x.shape[:3], dtype=torch.bool, device=x.device)
    expected[1, 11, :] = expected[1, :, 11] = True
    assert torch.equal(torch.isnan(out).any(-1), expected), plan.label
