"""The triangle update's wgmma kernels run on the CPU emulator (tests/emulator) against the float64
reference: the column slices (with the statistics kernel), Wp in registers (w_registers, sliced
too), the output's x in registers (o_x_registers) and the projection's mask loaded a tile ahead
(p_mask_early), the operands normalised in registers (p_normalized_x, o_normalized) and the
output's staged stores (o_staged_stores) and its tiles' copies unrolled (o_unrolled_fetch), at
odd shapes with NaN-prefilled outputs,
under a round-robin and a priority thread order. The GPU tests (test_trimul_mma_gpu.py) hold the
same kernels over more points; `--slow` runs all of their cases here, in three thread orders."""
from __future__ import annotations

import shutil

import pytest
import torch

from emulator import emulated, emulated_variant
from helpers import generator
from pairgen import codegen
from pairgen.ops.trimul import TRIMUL
from pairgen.ops.trimul.strategies.wgmma import REGISTER_VARIANTS_OFF
from pairgen.spec import DeviceLimits
from pairgen.tuning.check import compare, reference64
from pairgen.tuning.evaluate import inputs_in_precision, module_in_precision

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")

SHAPES = [(1, 1), (3, 7), (1, 37), (2, 12)]  # (2, 12): whole 64-pair tiles of a 16-byte-aligned N*N
MODELS = {"P": 128, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 0}
SMALL = {"P": 64, "H": 32, "outgoing": 0, "gate_normalized": 0, "bias": 1}
PAIRED = {"p_groups": 2, "p_stages": 1, "p_wn": 32, "o_groups": 2, "o_wn": 16, "o_stages": 1, "swizzle": False,
          "consts_smem": True, "paired_columns": True}
W_REGISTERS = {"p_groups": 2, "p_stages": 2, "p_wn": 32, "o_groups": 3, "o_wn": 64, "o_stages": 1, "swizzle": True,
               "consts_smem": True, "paired_columns": True, "z_registers": True, "w_registers": True}

#: The streamed kernels' small point (32-column passes, sums in registers, staged stores, two
#: output slices) and the wide classes' first default point.
STREAMED = {**PAIRED, "swizzle": True, "z_registers": True, "o_wn": 32, "o_slices": 2, "o_staged_stores": True}
WIDE_DEFAULT = [params for strategy, params in TRIMUL.default_points if strategy == "wgmma"][2]

#: The first wgmma default without its normalised operands, the output's x in registers and its staged
#: stores (their own cases).
FIRST_DEFAULT = {**next(params for strategy, params in TRIMUL.default_points if strategy == "wgmma"),
                 **REGISTER_VARIANTS_OFF}

CASES = {
    "w_registers-models-bf16": ("bfloat16", MODELS, W_REGISTERS),
    "w_registers-models-incoming-fp16": ("float16", {**MODELS, "outgoing": 0}, W_REGISTERS),
    "w_registers-o_x_registers-bf16": ("bfloat16", MODELS, {**W_REGISTERS, "o_x_registers": True}),
    "w_registers-small-k-padded-fp16": ("float16", {**SMALL, "P": 48}, {**PAIRED, "w_registers": True, "p_stages": 2}),
    "w_registers-sliced-bf16": ("bfloat16", {**SMALL, "H": 64, "outgoing": 1},
                                {**PAIRED, "w_registers": True, "p_stages": 2, "p_slices": 2}),
    "mask-early-models-bf16": ("bfloat16", MODELS, {**FIRST_DEFAULT, "o_x_registers": True, "p_mask_early": True}),
    "mask-early-sliced-fp16": ("float16", {**SMALL, "H": 64, "gate_normalized": 1},
                               {**PAIRED, "p_wn": 64, "p_slices": 2, "p_mask_early": True}),
    "mask-early-two-stages-fp16": ("float16", SMALL, {**PAIRED, "p_stages": 2, "p_mask_early": True}),
    "normalized-x-incoming-fp16": ("float16", {**MODELS, "outgoing": 0},
                                   {**FIRST_DEFAULT, "p_normalized_x": True, "p_mask_early": False}),
    "normalized-x-small-k-padded-bf16": ("bfloat16", {**SMALL, "P": 48},
                                         {**PAIRED, "x_registers": True, "p_normalized_x": True}),
    "normalized-output-staged-fp32-out-fp16": ("float16", {**MODELS, "out_fp32": 1},  # (an fp32 output: not staged)
                                               {**FIRST_DEFAULT, "o_x_registers": True, "o_normalized": True,
                                                "o_staged_stores": True}),
    "normalized-output-gate-on-input-bf16": ("bfloat16", {**SMALL, "P": 48, "H": 16},
                                             {**PAIRED, "z_registers": True, "x_registers": True, "o_x_registers": True,
                                              "o_normalized": True}),
    "staged-output-first-default-bf16": ("bfloat16", MODELS, {**FIRST_DEFAULT, "o_x_registers": True, "o_normalized": True,
                                                              "p_normalized_x": True, "o_staged_stores": True}),
    "staged-output-sliced-fp16": ("float16", {**SMALL, "P": 64, "H": 32},
                                  {**PAIRED, "z_registers": True, "o_slices": 2, "o_staged_stores": True}),
    "sliced-both-kernels-bf16": ("bfloat16", SMALL, {**PAIRED, "p_slices": 4, "o_slices": 4}),
    "sliced-two-stages-fp16": ("float16", {**SMALL, "gate_normalized": 1},
                               {**PAIRED, "p_slices": 2, "p_stages": 2, "o_slices": 2, "o_stages": 2}),
    # The output kernel's tiles' copies unrolled (the first default has them at P = 128: 16 chunks
    # a row): 8 chunks (a thread's rows 16 apart) sliced, and 4 (32 apart) with the sums in registers.
    "unrolled-fetch-sliced-bf16": ("bfloat16", SMALL, {**PAIRED, "o_slices": 4, "o_unrolled_fetch": True}),
    "unrolled-fetch-four-chunks-fp16": ("float16", {**SMALL, "P": 32, "gate_normalized": 1},
                                        {**PAIRED, "z_registers": True, "o_unrolled_fetch": True}),
}


def emulated_against_float64(plan, shapes, order: int, soft_mask: bool = False, offset: float = 0.0) -> list[str]:
    """The plan's kernels emulated at each (B, N) against the float64 reference: the failures.
    soft_mask: the mask as floats in [0.5, 1) where kept (its masked rows stay 0); offset: every
    third pair's x moved by this many times its spread (a LayerNorm's mean far from zero)."""
    failures = []
    variant = emulated_variant(plan)
    out_dtype = torch.float32 if plan.widths.get("out_fp32") else None
    for k, (batch, n) in enumerate(shapes):
        gen = generator(k)
        module = module_in_precision(TRIMUL, {w: v for w, v in plan.widths.items() if w != "out_fp32"}, gen,
                                     plan.precision, "cpu")
        inputs = TRIMUL.make_inputs({"B": batch, "N": n, **plan.widths}, gen, "cauchy" if k % 2 else "normal")
        if soft_mask:
            inputs = (inputs[0], inputs[1].float() * (0.5 + 0.5 * torch.rand(inputs[1].shape, generator=gen)))
        if offset:
            x = inputs[0].clone()
            x.view(-1, x.shape[-1])[::3] += offset * x.std()
            inputs = (x, *inputs[1:])
        inputs = inputs_in_precision(inputs, plan.precision, "cpu")
        ref = reference64(module, inputs)
        out = torch.full(tuple(ref.shape), float("nan"), dtype=out_dtype or inputs[0].dtype)
        with emulated(order), torch.no_grad():
            module._launch(*inputs, out=out, variant=variant)
        result = compare(out, ref, TRIMUL.tolerance[plan.precision])
        if not result.ok:
            failures.append(f"B={batch} N={n}: {result}")
    return failures


#: The cases also run under a priority order (a warpgroup runs ahead of the other where it can):
#: those with more than one warpgroup sharing a tile or its statistics.
#: Those past the first two run with --slow (the broad sweep): the first default and the sliced
#: kernels, whose warpgroups share the most, keep the order in the fast run.
PRIORITY = ("staged-output-first-default-bf16", "sliced-both-kernels-bf16", "w_registers-models-bf16",
            "w_registers-o_x_registers-bf16", "mask-early-models-bf16")


#: Cases that run with --slow only: variants of kernels another fast case runs (the other direction,
#: the other 16-bit type, two x stages, the unrolled copies' branch for 4 chunks as for 8), kept out
#: of the README's test command's time.
SLOW_CASES = ("w_registers-models-incoming-fp16", "w_registers-o_x_registers-bf16", "w_registers-small-k-padded-fp16",
              "mask-early-two-stages-fp16", "normalized-x-incoming-fp16", "sliced-two-stages-fp16",
              "unrolled-fetch-four-chunks-fp16")


@pytest.mark.parametrize("case,order", [pytest.param(case, 0, marks=[pytest.mark.slow] if case in SLOW_CASES else [])
                                        for case in CASES] +
                         [pytest.param(case, 3, marks=[pytest.mark.slow] if k >= 2 else [])
                          for k, case in enumerate(PRIORITY)],
                         ids=[f"{case}-round-robin" for case in CASES] + [f"{case}-priority" for case in PRIORITY])
def test_new_wgmma_kernels_match_float64_emulated(case, order):
    precision, widths, params = CASES[case]
    plan = TRIMUL.at(precision).plan("wgmma", params, widths)
    assert not TRIMUL.infeasible(plan, DeviceLimits()), TRIMUL.infeasible(plan, DeviceLimits())
    failures = emulated_against_float64(plan, SHAPES, order)
    assert not failures, f"{plan.label}:\n" + "\n".join(failures)


def plan_with_switch_on(monkeypatch, switch: str, precision: str, widths: dict, params: dict, off_marker: str,
                        on_marker: str):
    """The point's plan with wgmma's `switch` on, once its source is seen without `off_marker` with
    the switch off (the earlier kernels) and with `on_marker` with it on."""
    from pairgen.ops.trimul.strategies import wgmma

    monkeypatch.setattr(wgmma, switch, False)
    assert off_marker not in codegen.render_plan(TRIMUL.at(precision).plan("wgmma", params, widths)).source
    monkeypatch.setattr(wgmma, switch, True)
    plan = TRIMUL.at(precision).plan("wgmma", params, widths)
    assert on_marker in codegen.render_plan(plan).source
    return plan


#: A kernel switch's own cases (wgmma's module-level booleans): the side no shipped kernel renders, and
#: for a switch that is on, its path at more shapes than the cases above run it at (the first default
#: renders every switch that is on): with --slow, out of the README's test command's time.
OTHER_SIDE = pytest.mark.slow


@OTHER_SIDE
def test_the_projections_store_address_remade_each_pass_matches_float64_emulated(monkeypatch):
    """wgmma.PROJECTION_STORE_POINTER: on (the default) the normalised projection stores a and b
    through a pointer made once per tile, which the first default's cases above run; off, each pass
    remakes the address, and that path too meets float64 at whole tiles and odd ones."""
    from pairgen.ops.trimul.strategies import wgmma

    precision, widths, params = CASES["staged-output-first-default-bf16"]
    assert "paired_store_pointer" in codegen.render_plan(TRIMUL.at(precision).plan("wgmma", params, widths)).source
    monkeypatch.setattr(wgmma, "PROJECTION_STORE_POINTER", False)
    plan = TRIMUL.at(precision).plan("wgmma", params, widths)
    assert "paired_store_pointer" not in codegen.render_plan(plan).source
    failures = emulated_against_float64(plan, SHAPES, 0)
    assert not failures, f"{plan.label}:\n" + "\n".join(failures)


@OTHER_SIDE
@pytest.mark.parametrize("case", ["staged-output-first-default-bf16", "normalized-x-incoming-fp16"])
def test_the_statistics_by_mma_match_float64_emulated(monkeypatch, case):
    """wgmma.FRAGMENT_STATS_BY_MMA (on since session 50): the LayerNorm statistics of the rows held as
    fragments (the projection's x, the output's sums and x) from mma.sync sums and Gram diagonals
    meet float64, with rows whose mean is far from zero too (their warps take the two passes); off
    (the earlier kernels), the source has no trace of it."""
    precision, widths, params = CASES[case]
    plan = plan_with_switch_on(monkeypatch, "FRAGMENT_STATS_BY_MMA", precision, widths, params, "fragment_stats_by_mma",
                               "if (fragment_stats_by_mma<K>(xa, mean, rstd)) return;")
    failures = (emulated_against_float64(plan, SHAPES, 0)
                + emulated_against_float64(plan, SHAPES[2:], 0, offset=1000.0))
    assert not failures, f"{plan.label}:\n" + "\n".join(failures)


@OTHER_SIDE
@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_the_mask_folded_into_the_products_matches_float64_emulated(monkeypatch, precision):
    """wgmma.PROJECTION_MASK_FOLD (on since session 50): where a warp's rows all have a mask of 0 or 1
    the normalised projection scales them by it before the products and skips the epilogue's
    multiply; 0/1 masks (with empty rows) and soft ones, whose warps keep the multiply, meet float64;
    off (the earlier kernels), the source has no trace of it."""
    _, widths, params = CASES["staged-output-first-default-bf16"]
    plan = plan_with_switch_on(monkeypatch, "PROJECTION_MASK_FOLD", precision, widths, params, "fold_mask(",
                               "const bool folded = fold_mask(mk, rstd);")
    failures = (emulated_against_float64(plan, SHAPES, 0)
                + emulated_against_float64(plan, SHAPES[2:], 0, soft_mask=True))
    assert not failures, f"{plan.label}:\n" + "\n".join(failures)


@OTHER_SIDE
@pytest.mark.parametrize("case", ["staged-output-first-default-bf16", "normalized-output-staged-fp32-out-fp16",
                                  "mask-early-models-bf16", "normalized-x-incoming-fp16"])
def test_the_statistics_handed_to_the_output_kernel_match_float64_emulated(monkeypatch, case):
    """wgmma.OUTPUT_STATS_FROM_PROJECTION (on since session 50): the projection writes x's rows'
    statistics and the output kernel's gate loads them, a tile ahead into one of two slots, instead
    of taking them from its x: staged and fp32 outputs (the slots after the staging or in its
    place), normalised operands or folds, x in registers or in shared memory, at whole and odd
    tiles; off (the earlier kernels), the source has no trace of it, and a point whose gate is not
    on the normalised input does not hand them over."""
    precision, widths, params = CASES[case]
    plan = plan_with_switch_on(monkeypatch, "OUTPUT_STATS_FROM_PROJECTION", precision, widths, params,
                               "write_row_stats", "fetch_row_stats(xstats_s + ((it + 1) & 1) * 128")
    assert [kernel.args.count("ptr stats") for kernel in plan.kernels] == [1, 1]
    other = TRIMUL.at("bfloat16").plan("wgmma", CASES["normalized-output-gate-on-input-bf16"][2],
                                       CASES["normalized-output-gate-on-input-bf16"][1])
    assert not any("ptr stats" in kernel.args for kernel in other.kernels)
    failures = emulated_against_float64(plan, SHAPES, 0) + emulated_against_float64(plan, SHAPES[-1:], 3)
    assert not failures, f"{plan.label}:\n" + "\n".join(failures)


@OTHER_SIDE
@pytest.mark.parametrize("case", ["staged-output-first-default-bf16", "mask-early-models-bf16",
                                  "sliced-both-kernels-bf16", "staged-output-sliced-fp16"])
def test_the_output_descriptors_made_once_match_float64_emulated(monkeypatch, case):
    """wgmma.OUTPUT_DESCRIPTORS_ONCE (on since session 50): the paired output kernel's weight and bias
    descriptors made once, a pass adding its columns' offset: with the sums and x in registers or in
    shared memory, normalised or folded, whole or sliced columns, at whole and odd tiles; off (the
    earlier kernels), the source has no trace of it."""
    precision, widths, params = CASES[case]
    plan = plan_with_switch_on(monkeypatch, "OUTPUT_DESCRIPTORS_ONCE", precision, widths, params, "wo_n",
                               "wo_n + (operand_step<ZC")
    failures = emulated_against_float64(plan, SHAPES, 0)
    assert not failures, f"{plan.label}:\n" + "\n".join(failures)


def test_the_mask_loaded_a_tile_ahead_takes_float_masks_emulated():
    """p_mask_early keeps a float mask's bits and a byte mask's value in registers of their own:
    a float mask of values other than 0 and 1 must come out as it went in."""
    precision, widths, params = CASES["mask-early-models-bf16"]
    plan = TRIMUL.at(precision).plan("wgmma", params, widths)
    failures = emulated_against_float64(plan, [(3, 7), (2, 12)], 0, soft_mask=True)
    assert not failures, f"{plan.label}:\n" + "\n".join(failures)


def _gpu_case_lists():
    """The GPU test module's sliced and w_registers cases (built as on a GPU)."""
    import test_trimul_mma_gpu as gpu

    return [pytest.param(p.values[0], id=p.id) for p in gpu._sliced_cases() + gpu._w_registers_cases()]


@pytest.mark.slow
@pytest.mark.parametrize("order", [0, 3, 4])
def test_the_gpu_tests_sliced_and_w_registers_cases_emulated(order):
    """Every sliced and w_registers case of the GPU tests, at their shapes, in three thread orders
    (about 15 minutes on two cores)."""
    failures = []
    for param in _gpu_case_lists():
        plan = param.values[0]
        failures += [f"{param.id}: {f}" for f in emulated_against_float64(plan, [(b, n) for b, n in
                                                                            ((1, 1), (3, 1), (1, 7), (3, 7), (1, 37),
                                                                             (3, 37), (1, 64), (3, 64))], order)]
    assert not failures, "\n".join(failures)


#: The cases of an fp32 x rounded by a kernel. x_fp32 (the projection): the tuned entries' point
#: with an fp32 output too (GPU MODE's contract, fp32 in and out), and a narrow one with three
#: pieces a thread a pass (P = 48, two 64-column passes). stats_cast (a sliced point's statistics
#: kernel): both kernels sliced, the output alone sliced with an fp32 output, and both kernels
#: streamed (GPU MODE's contract on the streamed kernels).
X_FP32_CASES = {
    "first-default-fp32-out-bf16": ("bfloat16", {**MODELS, "out_fp32": 1}, CASES["staged-output-first-default-bf16"][2]),
    "narrow-wide-passes-fp16": ("float16", {**SMALL, "P": 48, "H": 32},
                                  {**PAIRED, "p_wn": 64, "x_registers": True, "p_normalized_x": True}),
    "statistics-sliced-both-bf16": ("bfloat16", SMALL, CASES["sliced-both-kernels-bf16"][2]),
    "statistics-sliced-output-fp32-out-fp16": ("float16", {**SMALL, "P": 64, "H": 32, "out_fp32": 1},
                                               CASES["staged-output-sliced-fp16"][2]),
    "statistics-streamed-both-fp32-out-bf16": ("bfloat16", {**SMALL, "P": 192, "H": 64, "gate_normalized": 1,
                                                            "out_fp32": 1}, {**STREAMED, "p_slices": 2}),
}
#: Switches a case turns on (the streamed kernels: off until timed).
X_FP32_SWITCHES = {"statistics-streamed-both-fp32-out-bf16": ("OUTPUT_STREAMED", "PROJECTION_STREAMED")}


#: The projection's own rounding (READ_FP32_X) is off: its cases run with --slow; the statistics
#: kernel's (stats_cast), which sliced points run under autocast, always.
X_FP32_OFF_SWITCH = ("first-default-fp32-out-bf16", "narrow-wide-passes-fp16")


@pytest.mark.parametrize("case", [pytest.param(case, marks=[pytest.mark.slow] if case in X_FP32_OFF_SWITCH else [])
                                  for case in X_FP32_CASES])
def test_an_fp32_x_rounded_by_a_kernel_matches_its_cast_bit_for_bit_emulated(monkeypatch, case):
    """x_fp32 and stats_cast: a call with an fp32 x (under autocast) runs the kernel that rounds x
    itself (the projection, or a sliced point's statistics kernel) and writes the rounded rows the
    other kernels read, instead of a cast before the kernels. Its output must equal, bit for bit,
    the same point's on x cast to the operand type (and so meet the float64 standard as that does),
    with NaN-prefilled outputs, at whole and odd tiles."""
    from pairgen.ops.trimul.strategies import wgmma

    monkeypatch.setattr(wgmma, "READ_FP32_X", True)  # (off by default)
    for switch in X_FP32_SWITCHES.get(case, ()):
        monkeypatch.setattr(wgmma, switch, True)
    precision, widths, params = X_FP32_CASES[case]
    plan = TRIMUL.at(precision).plan("wgmma", params, widths)
    assert all(plan.context[k] for k in ("o_streamed", "p_streamed")) == (case in X_FP32_SWITCHES)
    dtype = torch.float32 if widths.get("out_fp32") else getattr(torch, precision)
    for k, (batch, n) in enumerate(SHAPES):
        gen = generator(100 + k)
        module = module_in_precision(TRIMUL, {w: v for w, v in widths.items() if w != "out_fp32"}, gen, precision, "cpu")
        x, mask = TRIMUL.make_inputs({"B": batch, "N": n, **widths}, gen, "cauchy" if k % 2 else "normal")
        assert x.dtype is torch.float32
        cast, _ = inputs_in_precision((x, mask), precision, "cpu")
        with emulated(0), torch.no_grad():
            variant = emulated_variant(plan)
            reading = wgmma.variant_for_call(TRIMUL, variant, batch, n, dtype is torch.float32, -1, True)
            assert reading.plan.widths["x_fp32"] == 1 and "ptr xh" in reading.plan.kernels[0].args
            expected = torch.full(x.shape, float("nan"), dtype=dtype)
            module._launch(cast, mask, out=expected, variant=variant)
            got = torch.full(x.shape, float("nan"), dtype=dtype)
            module._launch(x, mask, out=got, variant=variant)
        assert not expected.isnan().any(), f"B={batch} N={n}: the cast's call left NaN"
        assert torch.equal(got, expected), f"B={batch} N={n}: {(got - expected).abs().max()}"




#: The streamed output kernel's cases: P = 192 (three 64-k chunks of x) and H = 128 (two of the
#: sums, their statistics gathered across both), more chunks a tile than the ring's two ahead, and
#: H = 64; 32-column passes, so a slice holds three passes' accumulators (two slices of 96 columns)
#: and, with two warpgroups, a block's two take turns on tiles; staged 16-bit rows and an fp32 output.
#: And a wide class's default point (P384 H256) with two output warpgroups: 3 slices of 128 columns.
STREAMED_CASES = {
    "streamed-staged-bf16": ("bfloat16", {**SMALL, "P": 192, "H": 128, "gate_normalized": 1}, STREAMED),
    "streamed-one-group-fp32-out-fp16": ("float16", {**SMALL, "P": 192, "H": 64, "out_fp32": 1},
                                         {**STREAMED, "o_groups": 1}),
    "streamed-wide-two-groups-bf16": ("bfloat16", {**MODELS, "P": 384, "H": 256}, {**WIDE_DEFAULT, "o_groups": 2}),
}


def projection_section(source: str) -> str:
    """A rendered wgmma source's projection kernel, from its banner to the output kernel's."""
    return source.split("// ================================ projection")[1].split("// ================================== output")[0]


@pytest.mark.parametrize("case", list(STREAMED_CASES))
def test_the_streamed_output_kernel_matches_float64_emulated(monkeypatch, case):
    """wgmma.OUTPUT_STREAMED (off: written without a GPU, not yet timed): the sliced output kernel
    streams the triangle sums and x through a ring of 64-k chunks, AHEAD chunks ahead across a
    warpgroup's tiles, and holds its slice's accumulators for a whole tile. Against float64 at odd and whole tiles, several tiles a
    warpgroup, in two thread orders; off, the source has no trace of it, and the other kernels'
    sources are as before (only the output kernel changes)."""
    from pairgen.ops.trimul.strategies import wgmma

    precision, widths, params = STREAMED_CASES[case]
    before_plan = TRIMUL.at(precision).plan("wgmma", params, widths)
    before = codegen.render_plan(before_plan).source
    assert "fetch_x_chunk" not in before
    monkeypatch.setattr(wgmma, "OUTPUT_STREAMED", True)
    plan = TRIMUL.at(precision).plan("wgmma", params, widths)
    source = codegen.render_plan(plan).source
    assert plan.context["o_streamed"] and plan.context["o_slices"] == 2 + (widths["P"] == 384) and "fetch_x_chunk" in source
    if plan.context["o_slices"] == before_plan.context["o_slices"]:  # (the same slices: the same projection)
        assert projection_section(source) == projection_section(before)
    shapes = SHAPES + [(1, 40)] if widths["P"] < 384 else [(1, 8), (2, 7)]  # (N8: one whole, aligned tile)
    failures = emulated_against_float64(plan, shapes, 0) + emulated_against_float64(plan, shapes[-2:], 3)
    assert not failures, f"{plan.label}:\n" + "\n".join(failures)


#: The streamed projection's cases: P = 192 (three 64-k chunks of x) and 4H = 256 in two slices of
#: 128 columns (four 32-column passes a slice, their accumulators held to the tile's end), with the
#: mask as floats and bytes; with the output kernel streamed too; and a wide class's default point
#: (P384 H256) with four projection warpgroups.
PROJECTION_STREAMED_CASES = {
    "streamed-projection-bf16": ("bfloat16", {**SMALL, "P": 192, "H": 64, "outgoing": 1}, {**STREAMED, "p_slices": 2},
                                 ()),
    "streamed-both-soft-mask-fp16": ("float16", {**SMALL, "P": 192, "H": 64, "gate_normalized": 1},
                                     {**STREAMED, "p_slices": 2, "p_groups": 1}, ("OUTPUT_STREAMED",)),
    "streamed-projection-wide-four-groups-bf16": ("bfloat16", {**MODELS, "P": 384, "H": 256},
                                                  {**WIDE_DEFAULT, "p_groups": 4, "p_wn": 64}, ("OUTPUT_STREAMED",)),
}


@pytest.mark.parametrize("case", list(PROJECTION_STREAMED_CASES))
def test_the_streamed_projection_matches_float64_emulated(monkeypatch, case):
    """wgmma.PROJECTION_STREAMED (off: written without a GPU, not yet timed): the sliced projection
    streams x through a ring of 64-k chunks and holds its slice's passes' accumulators for a whole
    tile, then runs the resident kernel's epilogues. Against float64 at odd and whole tiles, several
    tiles a warpgroup, in two thread orders, with a soft mask too; off, the source has no trace of it."""
    from pairgen.ops.trimul.strategies import wgmma

    precision, widths, params, also = PROJECTION_STREAMED_CASES[case]
    assert "fetch_stream_step<0, PJ_RING>" not in codegen.render_plan(TRIMUL.at(precision).plan("wgmma", params, widths)).source
    for switch in ("PROJECTION_STREAMED", *also):
        monkeypatch.setattr(wgmma, switch, True)
    plan = TRIMUL.at(precision).plan("wgmma", params, widths)
    assert plan.context["p_streamed"] and plan.context["p_slices"] > 1
    assert "fetch_stream_step<0, PJ_RING>" in codegen.render_plan(plan).source
    assert plan.context["o_streamed"] == bool(also)
    shapes = SHAPES + [(1, 40)] if widths["P"] < 384 else [(1, 8), (2, 7)]  # (N8: one whole, aligned tile)
    failures = (emulated_against_float64(plan, shapes, 0) + emulated_against_float64(plan, shapes[-2:], 3)
                + emulated_against_float64(plan, shapes[-2:], 0, soft_mask=True))
    assert not failures, f"{plan.label}:\n" + "\n".join(failures)
