"""The one launch path's contract and caches, on the CPU: a plan's declared kernels against the
rendered signatures, and caches that stay bounded over many lengths."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from pairgen import codegen, runtime
from pairgen.ops import get_op, op_names
from pairgen.ops.contact import CONTACT, ContactHead
from pairgen.ops.trimul import TRIMUL
from pairgen.spec import DeviceLimits, Kernel


def _default_plans():
    for name in op_names():
        spec = get_op(name)
        for shape in spec.presets["seed"]:
            for strategy, params in spec.default_points:
                plan = spec.plan(strategy, params, spec.widths_of(shape))
                if not spec.infeasible(plan, DeviceLimits()):
                    yield plan


@pytest.mark.parametrize("plan", list(_default_plans()), ids=lambda p: f"{p.op}-{p.label}")
def test_every_declared_kernel_matches_its_rendered_signature(plan):
    rendered = codegen.render_plan(plan)  # raises ContractError on a mismatch
    found = codegen.named_signatures(rendered.source)
    for kernel in plan.kernels:
        assert found[kernel.name] == kernel.args
        assert codegen.signatures(rendered.source)[kernel.name] == kernel.kinds


def test_a_plan_that_disagrees_with_its_template_is_a_clear_error():
    plan = CONTACT.default_plan({"P": 64, "H": 32}, DeviceLimits())
    main = plan.main
    wrong_kind = dataclasses.replace(plan, kernels=(dataclasses.replace(main, args=main.args[:-1] + ("i32 num_tiles64",)),))
    with pytest.raises(codegen.ContractError, match=r"kernel pairgen_contact_symmetric_tiled_f32_\w+ takes "
                                                    r"\(ptr x, ptr wpack, ptr out, i64 B64, i64 N64, i64 num_tiles64\) "
                                                    r"in the source but the plan declares \(.*, i64 N64, i32 num_tiles64\)"):
        codegen.render_plan(wrong_kind)
    one_short = dataclasses.replace(plan, kernels=(dataclasses.replace(main, args=main.args[:-1]),))
    with pytest.raises(codegen.ContractError, match="templates|contact/symmetric_tiled.cu.j2"):
        codegen.render_plan(one_short)
    extra = Kernel(f"{main.name}_output", 64, 0, ("ptr out",), main.grid)
    with pytest.raises(codegen.ContractError, match=r"declares kernel pairgen_contact_symmetric_tiled_f32_\w+_output, "
                                                    r"which the rendered source does not define"):
        codegen.render_plan(dataclasses.replace(plan, kernels=(main, extra)))


def test_two_pointers_of_one_kind_declared_in_each_others_place_are_rejected():
    """Kinds alone would pass: the names say which pointer is which."""
    for plan in (CONTACT.default_plan({"P": 64, "H": 32}, DeviceLimits()),
                 TRIMUL.plan(*next((s, p) for s, p in TRIMUL.default_points if s == "bmm"),
                             {"P": 64, "H": 32, "outgoing": 0, "gate_normalized": 0, "bias": 1})):
        main = plan.main
        args = list(main.args)
        first, second = [i for i, a in enumerate(args) if a.startswith("ptr ")][1:3]  # e.g. the weights and out
        args[first], args[second] = args[second], args[first]
        swapped = dataclasses.replace(plan, kernels=(dataclasses.replace(main, args=tuple(args)), *plan.kernels[1:]))
        assert [a.split()[0] for a in args] == list(main.kinds)  # the same kinds, in the same order
        with pytest.raises(codegen.ContractError, match=f"kernel {main.name} takes"):
            codegen.render_plan(swapped)


def test_signature_kinds_and_names():
    source = '''extern "C" __global__ void __launch_bounds__(128, 2)
k(const float* __restrict__ x, const void* m, int* c, int B, i64 N, long long T) {}
extern "C" __global__ void k2(float* out) {}'''
    assert codegen.signatures(source) == {"k": ("ptr", "ptr", "ptr", "i32", "i64", "i64"), "k2": ("ptr",)}
    assert codegen.named_signatures(source) == {"k": ("ptr x", "ptr m", "ptr c", "i32 B", "i64 N", "i64 T"),
                                                "k2": ("ptr out",)}


def test_kernel_declarations_reject_unknown_kinds_and_modes():
    with pytest.raises(ValueError, match="kind name"):
        Kernel("k", 32, 0, ("float x",), lambda *a: (1, ()))
    with pytest.raises(ValueError, match="kind name"):
        Kernel("k", 32, 0, ("ptr",), lambda *a: (1, ()))  # a kind without its name
    with pytest.raises(ValueError, match="mode"):
        Kernel("k", 32, 0, ("ptr x",), lambda *a: (1, ()), mode="eventually")


class _FakeKernel:
    resident_per_sm = 2

    def bind(self, *args):
        return args


def test_caches_stay_bounded_over_a_thousand_lengths(monkeypatch):
    """A server meets every protein's own N: the module's variant cache, the runtime's selections
    and a variant's bound launches must not grow with the number of distinct lengths."""
    plan = CONTACT.default_plan({"P": 64, "H": 32}, DeviceLimits())
    variant = runtime.Variant(plan, rendered=None, compiled=None)
    monkeypatch.setattr(runtime.Variant, "kernel", lambda self, index, name=None: _FakeKernel())
    info = runtime.DeviceInfo(0, "Test GPU", "test-gpu", "sm_90", DeviceLimits())
    monkeypatch.setattr(runtime, "device_info", lambda index=0: info)
    monkeypatch.setattr(runtime, "_by_plan", lambda plan, arch: variant)
    monkeypatch.setattr(runtime, "choose", lambda *a: runtime.Choice(plan, "default"))
    runtime.clear_caches()
    module = ContactHead(64, 32)
    device = torch.device("cuda", 0)
    for n in range(1, 1001):
        assert module.variant_for(n, device) is variant
        variant.launches(0, 1, n)
    assert len(module._variant_cache) <= module.MAX_CACHED_LENGTHS + 1
    assert len(runtime._selected) <= 11  # keyed by N bucket: 1, 2, 4, ..., 1024
    assert len(variant._bound) <= runtime.Variant.MAX_BOUND_SHAPES
    assert module.variant_for(1000, device) is variant and variant.launches(0, 1, 1000)  # still served
    runtime.clear_caches()


def test_a_switch_that_changes_a_plans_kernels_gets_its_own_build(monkeypatch):
    """_by_plan keys a build by the plan's context too: the same point and widths derived with a
    strategy's switch flipped (here the streamed output kernel) is another kernel, never served the
    build of the first."""
    from pairgen.ops.trimul.strategies import wgmma

    monkeypatch.setattr(runtime, "_variants", {})
    monkeypatch.setattr(runtime, "build_variant", lambda plan, arch: SimpleNamespace(plan=plan))
    widths = {"P": 384, "H": 256, "outgoing": 1, "gate_normalized": 1, "bias": 0}
    params = TRIMUL.default_plan(widths, DeviceLimits(), "bfloat16").params
    whole = TRIMUL.at("bfloat16").plan("wgmma", params, widths)
    monkeypatch.setattr(wgmma, "OUTPUT_STREAMED", True)
    streamed = TRIMUL.at("bfloat16").plan("wgmma", params, widths)
    assert streamed.context["o_streamed"] and not whole.context["o_streamed"]
    assert runtime._by_plan(whole, "sm_90").plan is whole
    assert runtime._by_plan(streamed, "sm_90").plan is streamed
    assert runtime._by_plan(whole, "sm_90").plan is whole  # (each from its own entry)
