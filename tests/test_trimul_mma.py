"""The triangle update's tensor-core strategy (mma) on the CPU: a default for every precision at the
presets' widths, the kernels compiling for sm_90 and sm_80 (mma.sync's first architecture), the
shared-memory contract the templates assert, the packed weights' layout, precision views, the
module's precision option and the tuning CLI's --precision."""
from __future__ import annotations

import argparse
import random

import pytest
import torch

from helpers import feasible_defaults, switching_defaults
from pairgen import codegen, compiler
from pairgen.ops.trimul import TRIMUL, TriangleMultiplication, TriangleMultiplicationReference
from pairgen.ops.trimul import packs
from pack_oracles import host_pack
from pairgen.spec import MMA_KINDS
from pairgen.ops.trimul.strategies.mma import mma_layout, mma_weight_offsets
from pairgen.spec import DeviceLimits, kernel_name
from pairgen.tuning.cli import add_selection_args, selected_shapes

PRECISIONS = tuple(MMA_KINDS)
SEED = {"P": 64, "H": 32, "outgoing": 0, "gate_normalized": 0, "bias": 1}
MODEL = {"P": 128, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 0}


def test_every_precision_has_a_default_at_every_preset_width():
    """16-bit precisions run tensor cores (wgmma on sm_90, else mma); tf32x3 and tf32 may also run
    exact fp32 (bmm, fused), which keeps their accuracy promise, and do by default until a tuning
    finds mma faster."""
    for shapes in TRIMUL.presets.values():
        for shape in shapes:
            for precision in PRECISIONS:
                plan = TRIMUL.default_plan(TRIMUL.widths_of(shape), DeviceLimits(), precision)
                assert plan is not None and plan.precision == precision
                assert plan.strategy in ("mma", "wgmma") or precision in ("tf32x3", "tf32")
                on_ampere = TRIMUL.default_plan(TRIMUL.widths_of(shape), DeviceLimits(arch="sm_80"), precision)
                assert on_ampere.strategy != "wgmma"


def test_widths_the_tensor_cores_cannot_tile_fall_back_to_the_reference():
    """Passes of 16 output columns: P must be a multiple of 16 (else no plan: the reference runs)."""
    assert TRIMUL.default_plan({**SEED, "P": 40, "H": 24}, DeviceLimits(), "bfloat16") is None
    assert TRIMUL.default_plan({**SEED, "P": 48, "H": 24}, DeviceLimits(), "bfloat16") is not None


def test_precision_is_part_of_the_plan_and_the_source():
    bf16 = TRIMUL.default_plan(MODEL, DeviceLimits(), "bfloat16")
    fp16 = TRIMUL.plan(bf16.strategy, bf16.params, MODEL, "float16")
    assert "[bfloat16]" in bf16.label and "[float16]" in fp16.label
    assert codegen.render_plan(bf16).source != codegen.render_plan(fp16).source
    with pytest.raises(ValueError, match="does not compute in"):
        TRIMUL.plan(bf16.strategy, bf16.params, MODEL, "float32")
    with pytest.raises(ValueError, match="does not compute in"):
        TRIMUL.plan("bmm", TRIMUL.default_points[0][1], MODEL, "bfloat16")


def test_precision_views_filter_strategies_and_defaults():
    view = TRIMUL.at("bfloat16")
    assert list(view.strategies) == ["mma", "wgmma"] and all(s in view.strategies for s, _ in view.default_points)
    assert view.plan(*view.default_points[0], MODEL).precision == "bfloat16"
    assert set(TRIMUL.at("float32").strategies) == {"bmm", "fused"}
    assert set(TRIMUL.at("tf32x3").strategies) == {"bmm", "fused", "mma"}
    assert TRIMUL.precisions[0] == "float32" and set(TRIMUL.precisions) == {"float32", *PRECISIONS}
    from pairgen.ops import get_op

    assert set(get_op("readout").at("bfloat16").strategies) == {"mma", "wgmma"}
    with pytest.raises(ValueError, match="no kernels in 'float8'"):
        get_op("readout").at("float8")


def _plans_to_compile(every_width: bool, every_default: bool):
    """A sampled point per precision, at both widths (every_width) or at each in turn, after the
    feasible defaults there: all of them (every_default), or those that switch a feature as no
    earlier one does (helpers.switching_defaults: the others differ in tile and warp counts alone)."""
    plans = []
    for k, precision in enumerate(PRECISIONS):
        for widths in (SEED, MODEL) if every_width else ((SEED, MODEL)[k % 2],):
            view = TRIMUL.at(precision)
            defaults = len(feasible_defaults(view, "mma", widths, precision))
            sampled = view.sample_plans("mma", widths, 1, random.Random(f"{precision}{widths['P']}"))
            plans += sampled if every_default else switching_defaults(sampled[:defaults]) + sampled[defaults:]
    return plans


@pytest.fixture(scope="module", params=["sm_90", pytest.param("sm_90-every-default", marks=pytest.mark.slow),
                                        pytest.param("sm_80", marks=pytest.mark.slow)])
def compiled_mma(request):
    """(plan, arch, Compiled or the exception) for each sampled plan on the architecture."""
    arch = request.param.split("-")[0]
    plans = _plans_to_compile(every_width=arch == "sm_80", every_default=request.param != "sm_90")
    cases = [(plan, arch) for plan in plans]
    jobs = []
    for plan, arch in cases:
        rendered = codegen.render_plan(plan)
        jobs.append((rendered.source, rendered.kernel_name, arch))
    with compiler.compile_pool(2) as pool:
        results = compiler.compile_many(jobs, pool)
    return [(plan, arch, result) for (plan, arch), result in zip(cases, results)]


def test_every_precision_compiles(compiled_mma):
    seen, arch = set(), compiled_mma[0][1]
    for plan, arch, result in compiled_mma:
        assert not isinstance(result, Exception), f"{plan.label} {plan.widths} {arch}: {result}"
        assert set(result.kernels) == variant_kernels(plan)
        assert result.registers <= 255
        seen.add((plan.precision, arch))
    assert seen == {(p, arch) for p in PRECISIONS}


def test_default_points_do_not_spill_in_16_bit_precisions():
    for precision in ("bfloat16", "float16"):
        for widths in (SEED, MODEL):
            plan = TRIMUL.default_plan(widths, DeviceLimits(), precision)
            rendered = codegen.render_plan(plan)
            result = compiler.compile_source(rendered.source, rendered.kernel_name, "sm_90")
            assert result.spill_bytes == 0, f"{plan.label}: {result.summary()}"


def test_a_plan_whose_shared_memory_disagrees_with_its_template_does_not_build():
    """The templates assert that the bytes they lay out are the bytes the plan declares (and the
    launch reserves): a formula that drifts on one side is a build error, not a memory fault."""
    plan = TRIMUL.default_plan(MODEL, DeviceLimits(), "bfloat16")
    plan.context = {**plan.context, "p_smem": plan.context["p_smem"] - 16}
    rendered = codegen.render_template(plan.op, plan.strategy, plan.params, plan.widths, plan.context, plan.precision)
    with pytest.raises(compiler.CompileError, match="projection shared memory differs"):
        compiler.compile_source(rendered.source, rendered.kernel_name, "sm_90", use_cache=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_weights_hold_the_parameters_in_the_kernels_layout(dtype, bias):
    P, H = 48, 24
    module = TriangleMultiplication(P, H, bias=bias)
    for p in module.parameters():
        torch.nn.init.normal_(p)
    params = dict(module.named_parameters())
    precision = "bfloat16" if dtype is torch.bfloat16 else "tf32x3"
    packed = host_pack(module, mma_layout(P, H, bias, P, precision, module._slots.sources))
    off = mma_weight_offsets(P, H, bias, torch.empty(0, dtype=dtype).element_size())
    assert packed.dtype is torch.uint8 and packed.numel() == off["total"]

    def matrix(name, rows, cols):
        n = rows * cols * torch.empty(0, dtype=dtype).element_size()
        return packed[off[name]: off[name] + n].view(dtype).reshape(rows, cols)

    def vector(name, size):
        return packed[off[name]: off[name] + 4 * size].view(torch.float32)

    wp = matrix("wp", 4 * H, P).reshape(H, 4, P)
    for j, name in enumerate(("proj_a", "gate_a", "proj_b", "gate_b")):
        assert torch.equal(wp[:, j], params[f"{name}.weight"].detach().to(dtype))
        if bias:
            assert torch.equal(vector("bp", 4 * H).reshape(H, 4)[:, j], params[f"{name}.bias"].detach())
    assert torch.equal(matrix("wo", P, H), params["out_proj.weight"].detach().to(dtype))
    assert torch.equal(matrix("wg", P, P), params["out_gate.weight"].detach().to(dtype))
    assert torch.equal(vector("ln_out_g", H), params["layer_norm_out.weight"].detach())
    assert torch.equal(vector("ln_in_b", P), params["layer_norm_in.bias"].detach())
    assert all(off[k] % 16 == 0 for k in off)


def test_precision_option_is_validated_and_leaves_the_state_dict_alone():
    module = TriangleMultiplication(64, 32, precision="tf32x3")
    assert module.precision == "tf32x3" and "precision='tf32x3'" in repr(module)
    module.precision = "ieee"
    assert "precision" not in repr(module)
    with pytest.raises(ValueError, match="precision must be one of"):
        module.precision = "fp8"
    with pytest.raises(ValueError, match="precision must be one of"):
        TriangleMultiplication(64, 32, precision="high")
    reference = TriangleMultiplicationReference(64, 32)
    assert list(module.state_dict()) == list(reference.state_dict())


def test_cpu_calls_run_the_reference_in_every_dtype_and_under_autocast():
    gen = torch.Generator().manual_seed(3)
    module = TRIMUL.make_module(SEED, gen)
    reference = TRIMUL.make_reference(module)
    x, mask = TRIMUL.make_inputs({"B": 1, "N": 5, **SEED}, gen)
    assert module.kernel_precision(x, mask) is None
    with torch.no_grad():
        assert torch.equal(module(x, mask), reference(x, mask))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(module(x, mask), reference(x, mask))
        half, ref_half = module.to(torch.bfloat16), reference.to(torch.bfloat16)
        assert torch.equal(half(x.bfloat16(), mask), ref_half(x.bfloat16(), mask))


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_selection_args(parser)
    return parser, parser.parse_args(argv)


def test_cli_precision_selects_views():
    parser, args = _parse(["--precision", "bfloat16", "--preset", "models"])
    work = selected_shapes(args, parser)
    assert work and {(spec.name, spec.precision) for spec, _ in work} == {("trimul", "bfloat16")}
    assert all(shape["bias"] == 0 and shape["gate_normalized"] == 1 for _, shape in work)
    parser, args = _parse(["--op", "trimul", "--precision", "tf32x3", "--precision", "float32", "--preset", "seed"])
    assert [spec.precision for spec, _ in selected_shapes(args, parser)] == ["tf32x3", "float32"]
    parser, args = _parse(["--op", "readout", "--precision", "bfloat16"])
    assert {(spec.name, spec.precision) for spec, _ in selected_shapes(args, parser)} == {("readout", "bfloat16")}


def test_one_point_in_two_precisions_builds_two_variants():
    """The variant cache is keyed by precision too: a float16 call once ran the bfloat16 kernels
    built for the same point, and answered in bfloat16."""
    from pairgen import runtime

    bf16 = TRIMUL.default_plan(SEED, DeviceLimits(), "bfloat16")
    fp16 = TRIMUL.plan(bf16.strategy, bf16.params, SEED, "float16")
    assert runtime._by_plan(bf16, "sm_90").plan.precision == "bfloat16"
    assert runtime._by_plan(fp16, "sm_90").plan.precision == "float16"


def test_every_precision_has_an_output_dtype_and_an_operand_dtype():
    from pairgen.precision import OPERAND_DTYPES, OUTPUT_DTYPES

    assert set(OUTPUT_DTYPES) == set(TRIMUL.precisions)
    assert set(OPERAND_DTYPES) == set(MMA_KINDS)
    assert OUTPUT_DTYPES["bfloat16"] is torch.bfloat16 and OUTPUT_DTYPES["tf32x3"] is torch.float32


def variant_kernels(plan) -> set:
    """The two kernels, named after the variant (a profile tells the points apart)."""
    name = kernel_name("trimul", "mma", plan.precision, plan.params)
    assert name.startswith("pairgen_trimul_mma_") and all(f"{k}{int(v)}" in name for k, v in plan.params.items())
    return {name, f"{name}_output"}
