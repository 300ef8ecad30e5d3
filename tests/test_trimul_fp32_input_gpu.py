"""GPU: an fp32 input under autocast. The wgmma projection with x in registers rounds the fp32 rows
itself (x_fp32), and a sliced point's statistics kernel rounds them as it takes their statistics
(stats_cast); the closed form's input LayerNorm normalises them as it reads them (no cast of the
whole input first; more exact than normalising the rounded rows). Each must meet its standard
against float64, at odd N with an empty mask row."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import generator, trimul_inputs_with_an_empty_row
from pairgen.ops import layer_norm_rows
from pairgen.ops.trimul import TRIMUL
from pairgen.spec import AUTOCAST_TOLERANCE, DeviceLimits
from pairgen.tuning.check import compare, reference64

pytestmark = pytest.mark.gpu
MODELS = {"outgoing": 1, "gate_normalized": 1, "bias": 0}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("P, H, N", [(200, 40, 37), (384, 128, 24)])
def test_the_closed_form_normalises_fp32_rows_as_it_reads_them(monkeypatch, dtype, P, H, N):
    """Widths no kernel takes: the closed form, its input LayerNorm on the fp32 rows (spied), the
    output in autocast's dtype within the autocast standard."""
    widths = {"P": P, "H": H, **MODELS}
    module = TRIMUL.make_module(widths, generator(6)).cuda()
    module.routing = replace(module.routing, fp32_kernel_max_pairs=-1, closed_form_min_pairs=0)  # the closed form
    module.kernel_precision = lambda *call: None  # as at widths no kernel takes (P = 200 would fit one)
    x, mask = trimul_inputs_with_an_empty_row(widths, 2, N, seed=7)
    row_dtypes = []
    normalise = layer_norm_rows.layer_norm
    monkeypatch.setattr(layer_norm_rows, "layer_norm",
                        lambda rows, *args: row_dtypes.append(rows.dtype) or normalise(rows, *args))
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        out = module(x, mask)
    assert row_dtypes == [torch.float32], "the input LayerNorm read the fp32 rows, once"
    assert out.dtype == dtype
    result = compare(out, reference64(module, (x, mask)), AUTOCAST_TOLERANCE)
    assert result.ok, result


def assert_fp32_x_as_its_cast(module, variant, x, cast, mask, out_dtype, precision: str) -> None:
    """The variant's call on the fp32 x equals its call on x cast first (`cast`), bit for bit, both
    NaN-prefilled outputs of out_dtype fully written, and meets the 16-bit standard against
    float64 of the rounded x."""
    outs = []
    with torch.no_grad():
        for given in (cast, x):
            out = torch.full(x.shape, float("nan"), device="cuda", dtype=out_dtype)
            module._launch(given, mask, out=out, variant=variant)
            outs.append(out)
    torch.cuda.synchronize()
    assert not outs[0].isnan().any()
    assert torch.equal(outs[1], outs[0]), (outs[1].float() - outs[0].float()).abs().max()
    result = compare(outs[1], reference64(module, (cast, mask)), TRIMUL.tolerance[precision])
    assert result.ok, result


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
@pytest.mark.parametrize("B, N", [(2, 37), (1, 64)])
def test_the_projection_reads_an_fp32_x_as_its_cast_bit_for_bit(monkeypatch, precision, B, N):
    """x_fp32 (the wgmma projection with x in registers): an fp32 x is read and rounded by the
    projection, which writes the rounded rows the output kernel reads. The output must equal, bit for
    bit, the same point's on x cast first, at odd N with an empty mask row, NaN-prefilled, and meet
    the 16-bit standard against float64 of the rounded x; the module under autocast (fp32 in and
    out, GPU MODE's contract) runs it and meets the autocast standard."""
    from pairgen import runtime
    from pairgen.ops.trimul.strategies import wgmma
    from pairgen.tuning.evaluate import module_in_precision

    monkeypatch.setattr(wgmma, "READ_FP32_X", True)  # (off by default)
    widths = {"P": 128, "H": 128, **MODELS}
    plan = TRIMUL.default_plan(widths, DeviceLimits(), precision)
    assert plan.strategy == "wgmma" and wgmma.for_call(TRIMUL, plan, B, N, fp32_input=True) is not None
    variant = runtime.variant_of(plan, 0)
    module = module_in_precision(TRIMUL, widths, generator(8), precision, "cuda")
    x, mask = trimul_inputs_with_an_empty_row(widths, B, N, seed=9)
    cast = x.to(module.out_proj.weight.dtype)
    assert_fp32_x_as_its_cast(module, variant, x, cast, mask, cast.dtype, precision)

    fp32 = TRIMUL.make_module(widths, generator(8)).cuda()
    fp32.output_dtype = torch.float32
    with torch.no_grad(), torch.autocast("cuda", dtype=cast.dtype):
        out = fp32(x, mask)
    assert out.dtype == torch.float32
    result = compare(out, reference64(fp32, (x, mask)), AUTOCAST_TOLERANCE)
    assert result.ok, result


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
@pytest.mark.parametrize("B, N", [(2, 37), (1, 64)])
def test_a_sliced_points_statistics_kernel_rounds_an_fp32_x_as_its_cast_bit_for_bit(precision, B, N):
    """stats_cast (GPU MODE's wide width, P384 H128, whose default point slices both kernels): an fp32
    x is read and rounded by the rows' statistics kernel, which writes the rounded rows the other
    two kernels read. With a 16-bit and an fp32 output, the result must equal, bit for bit, the same
    point's on x cast first, at odd N with an empty mask row, NaN-prefilled, and meet the 16-bit
    standard against float64 of the rounded x."""
    from pairgen import runtime
    from pairgen.ops.trimul.strategies import wgmma
    from pairgen.tuning.evaluate import module_in_precision

    widths = {"P": 384, "H": 128, **MODELS}
    plan = TRIMUL.default_plan(widths, DeviceLimits(), precision)
    assert plan.strategy == "wgmma" and wgmma.has_row_statistics(plan.context["p_slices"], plan.context["o_slices"])
    variant = runtime.variant_of(plan, 0)
    module = module_in_precision(TRIMUL, widths, generator(8), precision, "cuda")
    x, mask = trimul_inputs_with_an_empty_row(widths, B, N, seed=9)
    cast = x.to(module.out_proj.weight.dtype)
    for out_dtype in (cast.dtype, torch.float32):
        rounding = wgmma.variant_for_call(TRIMUL, variant, B, N, out_dtype is torch.float32, 0, True)
        assert "ptr xh" in rounding.plan.kernels[0].args and rounding.plan.kernels[0].name.endswith("_stats")
        assert_fp32_x_as_its_cast(module, variant, x, cast, mask, out_dtype, precision)
