"""GPU: an fp32 output from 16-bit math (output_dtype=torch.float32). The Hopper kernels and the
closed form's output gate write the fp32 values they compute; rounded to 16 bits they must equal
the 16-bit output of the same call bit for bit (the same arithmetic, the rounding moved out of the
kernel), and meet the autocast standard against float64, at odd N with an empty mask row."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import generator, trimul_inputs_with_an_empty_row
from pairgen import native, triangle_multiplicative_update
from pairgen.module.dispatch import CLOSED_FORM, KERNEL
from pairgen.ops.trimul import TRIMUL
from pairgen.ops.trimul.strategies import mma as mma_strategy
from pairgen.spec import AUTOCAST_TOLERANCE, SIXTEEN_BIT_TOLERANCE
from pairgen.tuning.check import compare, reference64

pytestmark = pytest.mark.gpu
MODELS = {"outgoing": 1, "gate_normalized": 1, "bias": 0}


@pytest.fixture
def output_kernels(monkeypatch):
    """The out_fp32 width of every plan whose three steps run (the wgmma kernels' output stores)."""
    seen = []
    run = mma_strategy.run_three_steps

    def spy(module, variant, *rest):
        seen.append(variant.plan.widths.get("out_fp32", 0))
        return run(module, variant, *rest)

    from pairgen.ops.trimul.strategies import wgmma
    monkeypatch.setattr(wgmma, "run_three_steps", spy)
    return seen


def _pair(module, x, mask, autocast):
    """The call's output with output_dtype None, then with torch.float32."""
    outs = []
    for wanted in (None, torch.float32):
        module.output_dtype = wanted
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            outs.append(module(x, mask))
    return outs


@pytest.mark.parametrize("N", [37, 123])
@pytest.mark.parametrize("direction", [1, 0])
def test_the_hopper_kernels_write_fp32_under_autocast(output_kernels, N, direction):
    widths = {"P": 128, "H": 128, **MODELS, "outgoing": direction}
    module = TRIMUL.make_module(widths, generator(3)).cuda()
    x, mask = trimul_inputs_with_an_empty_row(widths, 2, N, seed=N + direction)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        assert module.route(x, mask).path == KERNEL
    narrow, wide = _pair(module, x, mask, autocast=True)
    assert output_kernels == [0, 1], "the second call ran the output kernel that writes fp32"
    assert narrow.dtype == torch.bfloat16 and wide.dtype == torch.float32
    assert torch.equal(wide.to(torch.bfloat16), narrow), "the fp32 output rounds to the 16-bit one"
    result = compare(wide, reference64(module, (x, mask)), AUTOCAST_TOLERANCE)
    assert result.ok, result


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_module_returns_fp32_and_replays_it(output_kernels, dtype):
    """No autocast: a 16-bit module asked for fp32; repeated calls are recorded and replayed with
    the fp32 output (the replay casts nothing: the kernels write it)."""
    if native.fastcall(wait=True) is None:  # built in the background otherwise: the calls would not record
        pytest.skip(f"the compiled fast path: {native.status()}")
    widths = {"P": 128, "H": 128, **MODELS}
    module = TRIMUL.make_module(widths, generator(4)).cuda().to(dtype)
    x, mask = trimul_inputs_with_an_empty_row(widths, 1, 61, seed=5, dtype=dtype)
    narrow, wide = _pair(module, x, mask, autocast=False)
    assert wide.dtype == torch.float32 and torch.equal(wide.to(dtype), narrow)
    with torch.no_grad():
        for _ in range(4):
            again = module(x, mask)
    assert module._fast_calls, "the fp32-output call was recorded"
    assert again.dtype == torch.float32 and torch.equal(again, wide)
    result = compare(wide, reference64(module, (x, mask)), SIXTEEN_BIT_TOLERANCE)
    assert result.ok, result


@pytest.mark.parametrize("P, H, N", [(384, 128, 37), (200, 40, 24)])
def test_the_closed_form_output_gate_writes_fp32(P, H, N):
    """Widths the closed form runs (forced at these small sizes): its output gate writes fp32."""
    widths = {"P": P, "H": H, **MODELS}
    module = TRIMUL.make_module(widths, generator(6)).cuda()
    module.routing = replace(module.routing, fp32_kernel_max_pairs=-1, closed_form_min_pairs=0)
    module.kernel_precision = lambda *call: None  # as at widths no kernel takes
    x, mask = trimul_inputs_with_an_empty_row(widths, 2, N, seed=8)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        assert module.route(x, mask).path == CLOSED_FORM
    narrow, wide = _pair(module, x, mask, autocast=True)
    assert narrow.dtype == torch.bfloat16 and wide.dtype == torch.float32
    assert torch.equal(wide.to(torch.bfloat16), narrow)
    result = compare(wide, reference64(module, (x, mask)), AUTOCAST_TOLERANCE)
    assert result.ok, result


def test_the_function_in_bf16_answers_fp32_from_the_kernels(output_kernels):
    """cuEquivariance's call with precision "bfloat16" on fp32 x: fp32 out, written by the kernels."""
    widths = {"P": 128, "H": 128, **MODELS}
    module = TRIMUL.make_module(widths, generator(9)).cuda()
    x, mask = trimul_inputs_with_an_empty_row(widths, 1, 77, seed=10)
    p = {name: t.detach() for name, t in module.named_parameters()}  # an inference call
    out = triangle_multiplicative_update(
        x, "outgoing", mask, norm_in_weight=p["layer_norm_in.weight"], norm_in_bias=p["layer_norm_in.bias"],
        p_in_weight=torch.cat([p["proj_a.weight"], p["proj_b.weight"]]),
        g_in_weight=torch.cat([p["gate_a.weight"], p["gate_b.weight"]]),
        norm_out_weight=p["layer_norm_out.weight"], norm_out_bias=p["layer_norm_out.bias"],
        p_out_weight=p["out_proj.weight"], g_out_weight=p["out_gate.weight"], precision="bfloat16")
    assert out.dtype == torch.float32
    assert output_kernels == [1]
    result = compare(out, reference64(module, (x, mask)), AUTOCAST_TOLERANCE)
    assert result.ok, result


def test_training_under_autocast_casts_the_output_differentiably():
    """A training call returns fp32 too; the gradient flows back through the cast."""
    widths = {"P": 128, "H": 64, **MODELS}
    module = TRIMUL.make_module(widths, generator(11)).cuda()
    module.output_dtype = torch.float32
    x, mask = trimul_inputs_with_an_empty_row(widths, 1, 45, seed=12)
    x.requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = module(x, mask)
    assert out.dtype == torch.float32
    out.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_a_compiled_module_casts_the_operators_output():
    """Under torch.compile the operator returns what its fake implementation declares (the 16-bit
    output of the module's kernels), and the traced call casts it: fp32, the 16-bit values widened."""
    widths = {"P": 128, "H": 128, **MODELS}
    module = TRIMUL.make_module(widths, generator(13)).cuda().to(torch.bfloat16)
    x, mask = trimul_inputs_with_an_empty_row(widths, 1, 64, seed=14, dtype=torch.bfloat16)
    with torch.no_grad():
        narrow = module(x, mask)
        module.output_dtype = torch.float32
        out = torch.compile(module, fullgraph=True)(x, mask)
    assert out.dtype == torch.float32 and torch.equal(out, narrow.float())
