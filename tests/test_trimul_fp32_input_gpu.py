"""GPU: an fp32 input under autocast. The closed form's input LayerNorm normalises the fp32 rows as
it reads them (no cast of the whole input first; more exact than normalising the rounded rows): its
output must meet the autocast standard against float64, at odd N with an empty mask row."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import generator, trimul_inputs_with_an_empty_row
from pairgen.ops import layer_norm_rows
from pairgen.ops.trimul import TRIMUL
from pairgen.spec import AUTOCAST_TOLERANCE
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
