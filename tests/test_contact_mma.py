"""CPU: the contact head's tensor-core strategies (mma: bf16, fp16, tf32, tf32x3; wgmma: bf16, fp16
on sm_90a): plans and restrictions, the packed weights' layout, every precision's default compiling
without spills for sm_90 and sm_80 (wgmma: sm_90a), the module's precision option. Its accuracy runs on the GPU
(tests/test_contact_mma_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_tensor_core_defaults_compile, feasible_defaults, generator, sampled_plans
from pairgen import codegen, compiler
from pairgen.ops import get_op
from pairgen.ops.contact.strategies import mma as contact_mma
from pack_oracles import host_pack
from pairgen.ops.contact.strategies.mma import mma_weight_offsets
from pairgen.spec import HALF_PRECISIONS, MMA_KINDS, DeviceLimits

CONTACT = get_op("contact")
WIDTHS = [{"P": 64, "H": 32}, {"P": 128, "H": 128}, {"P": 128, "H": 64}, {"P": 48, "H": 24}]


@pytest.mark.parametrize("precision", list(MMA_KINDS))
def test_every_preset_width_has_an_mma_default_in_every_precision(precision):
    limits = DeviceLimits()
    for shapes in CONTACT.presets.values():
        for shape in shapes:
            widths = CONTACT.widths_of(shape)
            mma = feasible_defaults(CONTACT, "mma", widths, precision, limits)
            assert mma and mma[0].precision == precision
            default = CONTACT.default_plan(widths, limits, precision)
            # 16 bits: the tensor cores; the tf32 kinds: the exact kernel first (it keeps their promise)
            assert default.strategy == ("mma" if precision in HALF_PRECISIONS else "symmetric_tiled")


@pytest.mark.parametrize("precision", ["tf32x3", "tf32"])
def test_the_exact_kernel_stands_in_for_the_tf32_kinds_unchanged(precision):
    """The exact strategy offered to tf32x3 and tf32 runs the fp32 kernel's code: the rendered
    sources differ only in the header's precision line (so its fp32 GPU tests cover it)."""
    point = next(params for strategy, params in CONTACT.default_points if strategy == "symmetric_tiled")
    exact, stand_in = (codegen.render_plan(CONTACT.plan("symmetric_tiled", point, {"P": 64, "H": 32}, p))
                       for p in ("float32", precision))
    assert stand_in.kernel_name == exact.kernel_name
    assert [line for line in stand_in.source.splitlines() if line != f"// precision {precision}"] \
        == exact.source.splitlines()
    assert stand_in.source != exact.source  # the header names the precision


def test_restrictions_name_what_is_wrong():
    w = {"P": 64, "H": 32}
    wide_pass = CONTACT.plan("mma", {"tile_side": 8, "warps_m": 1, "warps_n": 4, "wn": 16, "blocks_per_sm": 1}, w,
                             "bfloat16")  # 64 columns per pass over H = 32
    assert any("passes must tile H" in why for why in CONTACT.infeasible(wide_pass, DeviceLimits()))
    many = CONTACT.plan("mma", {"tile_side": 16, "warps_m": 1, "warps_n": 1, "wn": 64, "blocks_per_sm": 1},
                        {"P": 64, "H": 64}, "bfloat16")  # 16 fragments x 8 of 4 accumulators
    assert any("accumulators" in why for why in CONTACT.infeasible(many, DeviceLimits()))
    # fp32 operands at P = H = 128 take 203 KB: two blocks per SM do not fit
    two = CONTACT.plan("mma", {"tile_side": 8, "warps_m": 4, "warps_n": 2, "wn": 16, "blocks_per_sm": 2},
                       {"P": 128, "H": 128}, "tf32x3")
    assert any("co-resident" in why for why in CONTACT.infeasible(two, DeviceLimits()))
    assert feasible_defaults(CONTACT, "mma", {"P": 128, "H": 128}, "tf32x3")[0].params["blocks_per_sm"] == 1
    # ln_quads: a row in 16-byte pieces over a quad, 64 bytes a round: P = 48 in bf16 (96 bytes) cannot,
    # in fp32 (192 bytes) it can; without ln_quads both can
    point = {"tile_side": 8, "warps_m": 4, "warps_n": 2, "wn": 16, "blocks_per_sm": 1, "prefetch": False}
    for precision, fits in (("bfloat16", False), ("tf32x3", True)):
        quads = CONTACT.plan("mma", {**point, "ln_quads": True}, {"P": 48, "H": 32}, precision)
        assert any("ln_quads" in why for why in CONTACT.infeasible(quads, DeviceLimits())) is not fits
        warp = CONTACT.plan("mma", {**point, "ln_quads": False}, {"P": 48, "H": 32}, precision)
        assert not any("ln_quads" in why for why in CONTACT.infeasible(warp, DeviceLimits()))


def test_packed_weights_layout():
    gen = generator(3)
    module = CONTACT.make_module({"P": 48, "H": 24}, gen)
    params = [module.mlp[0].weight, module.mlp[0].bias, module.mlp[2].weight, module.mlp[2].bias,
              module.mlp[4].weight, module.mlp[4].bias, module.layer_norm.weight, module.layer_norm.bias]
    for dtype in (torch.bfloat16, torch.float32):
        precision = "bfloat16" if dtype is torch.bfloat16 else "tf32x3"
        packed = host_pack(module, contact_mma.mma_layout(48, 24, precision, module._slots.sources))
        off = mma_weight_offsets(48, 24, torch.empty(0, dtype=dtype).element_size())
        assert packed.numel() == off["total"] and all(v % 16 == 0 for v in off.values())

        def section(name, n, kind):
            size = torch.empty(0, dtype=kind).element_size()
            return packed[off[name]: off[name] + n * size].view(kind)

        torch.testing.assert_close(section("w1", 24 * 48, dtype).view(24, 48), params[0].detach().to(dtype))
        torch.testing.assert_close(section("w2", 24 * 24, dtype).view(24, 24), params[2].detach().to(dtype))
        torch.testing.assert_close(section("w3", 24, torch.float32), params[4].detach().reshape(-1))
        torch.testing.assert_close(section("b3", 1, torch.float32), params[5].detach())
        torch.testing.assert_close(section("beta", 48, torch.float32), params[7].detach())


@pytest.mark.parametrize("arch, every_pair", [("sm_90", False), pytest.param("sm_90", True, marks=pytest.mark.slow),
                                              pytest.param("sm_80", True, marks=pytest.mark.slow)])
def test_defaults_compile_without_spills_and_samples_compile(arch, every_pair):
    assert_tensor_core_defaults_compile(CONTACT, "mma", WIDTHS, arch, min_defaults=12 if every_pair else 6, every_pair=every_pair)


def test_wgmma_runs_only_on_sm90_at_widths_of_whole_k_steps():
    params = dict(next(p for s, p in CONTACT.default_points if s == "wgmma"))
    plan = CONTACT.plan("wgmma", params, {"P": 128, "H": 64}, "bfloat16")
    assert not CONTACT.infeasible(plan, DeviceLimits(arch="sm_90"))
    assert any("sm_90" in why for why in CONTACT.infeasible(plan, DeviceLimits(arch="sm_100")))
    odd = CONTACT.plan("wgmma", params, {"P": 48, "H": 24}, "bfloat16")
    assert any("multiples of 16" in why for why in CONTACT.infeasible(odd, DeviceLimits(arch="sm_90")))
    assert "tf32x3" not in CONTACT.strategies["wgmma"].precisions


@pytest.mark.parametrize("every_pair", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_wgmma_defaults_compile_for_sm90a_without_spills(every_pair):
    """The first and last feasible wgmma defaults and one sampled point compile (for sm_90a: the
    template says it is arch-specific), the defaults without spills: per 16-bit precision and preset
    width (every_pair), or at every width in bf16 and the first in fp16."""
    plans, lasts = [], []
    for precision in HALF_PRECISIONS:
        for w, widths in enumerate(WIDTHS[:3]):
            if not every_pair and precision != "bfloat16" and w:
                continue
            defaults = feasible_defaults(CONTACT, "wgmma", widths, precision)
            # the first, and the last: four warpgroups at 128 registers a thread, layer 1's output in registers
            plans += [(plan, True) for plan in (defaults[0], defaults[-1])]
            lasts.append(defaults[-1])
            if every_pair or w == 0:
                plans += [(plan, False) for plan in sampled_plans(CONTACT.at(precision), "wgmma", widths, 1, seed=3)[-1:]]
    assert len([p for p, default in plans if default]) == (12 if every_pair else 8)
    assert all(plan.params["groups"] == 4 and plan.params["z_registers"] for plan in lasts)
    rendered = [codegen.render_plan(plan) for plan, _ in plans]
    results = compiler.compile_many([(r.source, r.kernel_name, compiler.target_for(r.source, "sm_90")) for r in rendered])
    for (plan, default), result in zip(plans, results):
        assert not isinstance(result, Exception), f"{plan.label} {plan.widths}: {result}"
        if default:
            assert (result.spill_bytes, result.stack_bytes) == (0, 0), f"{plan.label}: {result.summary()}"


def test_the_quads_step_compiles_in_16_bits_and_tf32x3():
    """ln_quads' step 1 (16-byte pieces: 8 elements in 16 bits, 4 in fp32) compiles for a 16-bit and an fp32 kind."""
    plans = [CONTACT.plan("mma", {**next(p for s, p in CONTACT.default_points if s == "mma"), "ln_quads": True,
                                  "blocks_per_sm": 1, "prefetch": False}, {"P": 128, "H": 128}, precision)
             for precision in ("bfloat16", "tf32x3")]
    assert all(not CONTACT.infeasible(plan, DeviceLimits(arch="sm_90")) for plan in plans)
    rendered = [codegen.render_plan(plan) for plan in plans]
    assert all("symmetrised_rows_quads(x" in r.source for r in rendered)
    for plan, result in zip(plans, compiler.compile_many([(r.source, r.kernel_name, "sm_90") for r in rendered])):
        assert not isinstance(result, Exception), f"{plan.label}: {result}"


def test_the_precision_option():
    module = CONTACT.make_module({"P": 64, "H": 32}, generator(4))
    assert module.precision == "ieee" and "precision" not in repr(module)
    module.precision = "tf32x3"
    assert "precision='tf32x3'" in repr(module)
    with pytest.raises(ValueError, match="precision must be one of"):
        module.precision = "fp8"
    x = torch.randn(1, 5, 5, 64)
    assert module.kernel_precision(x) is None  # on the CPU: the reference
    with torch.no_grad():
        torch.testing.assert_close(module(x), CONTACT.make_reference(module)(x))
