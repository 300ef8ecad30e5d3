"""Rendering: every strategy renders, the header names what was rendered, StrictUndefined, hashes."""
from __future__ import annotations

import re

import jinja2
import pytest

from helpers import REAL_WIDTHS, SEED_WIDTHS, sampled_plans
from pairgen import codegen
from pairgen.ops import get_op, op_names, render
from pairgen.ops.contact import CONTACT


@pytest.mark.parametrize("strategy", sorted(CONTACT.strategies))
def test_every_strategy_renders_with_a_header(strategy):
    for widths in (SEED_WIDTHS, *REAL_WIDTHS):
        for plan in sampled_plans(CONTACT, strategy, widths, 2):
            r = render("contact", strategy, plan.params, widths)
            first = r.source.splitlines()[:3]
            assert first[0].startswith(f"// pairgen: template contact/{strategy}.cu.j2")
            assert f"strategy {strategy}" in first[0]
            for key, value in plan.params.items():
                assert f'"{key}": {str(value).lower() if isinstance(value, bool) else value}' in first[1]
            assert 'extern "C" __global__' in r.source and r.kernel_name in r.source
            assert "{{" not in r.source and "{%" not in r.source


def test_missing_template_variable_is_an_error():
    plan = CONTACT.plan(*CONTACT.default_points[0], SEED_WIDTHS)
    context = dict(plan.context)
    del context["ln_rows"]
    with pytest.raises(jinja2.UndefinedError):
        codegen.render_template("contact", plan.strategy, plan.params, plan.widths, context)


def test_template_hash_covers_included_files():
    names = codegen._referenced(codegen.template_name("contact", "symmetric_tiled"))
    assert {"contact/symmetric_tiled.cu.j2", "contact/tiled.cu.j2", "common/tile_gemm.cuh",
            "common/layernorm.cuh", "common/pairgen.cuh", "contact/_weights.cuh.j2"} <= names
    hashes = {s: codegen.template_hash("contact", s) for s in CONTACT.strategies}
    assert len(set(hashes.values())) == len(hashes)
    assert all(len(h) == 64 for h in hashes.values())


def test_unknown_points_are_rejected():
    with pytest.raises(ValueError, match="unknown strategy"):
        CONTACT.plan("nope", {}, SEED_WIDTHS)
    params = dict(CONTACT.default_points[0][1], threads=96)
    with pytest.raises(ValueError, match="threads=96 not in"):
        CONTACT.plan("symmetric_tiled", params, SEED_WIDTHS)


def _seed_widths(spec) -> dict:
    first = next(iter(spec.presets.values()))[0]
    return spec.widths_of(first)


def test_multi_kernel_sources_define_no_global_named_smem():
    """A module-scope symbol named SMEM collides with the name the CUDA linker gives static shared
    memory: in a module whose other kernel has static shared arrays (the readout's node prologue
    beside its tensor-core kernel), the driver relocated those arrays by the symbol's value and the
    prologue wrote outside shared memory (an illegal address on the H200). Every default point, in
    every precision its strategy serves, at the op's seed widths (rendering needs no feasibility)."""
    checked = 0
    for spec in map(get_op, op_names()):
        for strategy_name, params in spec.default_points:
            for precision in spec.strategies[strategy_name].precisions:
                source = codegen.render_plan(spec.plan(strategy_name, params, _seed_widths(spec), precision)).source
                if source.count("__global__") < 2:
                    continue
                checked += 1
                assert not re.search(r"^\s*(static\s+)?(constexpr|const)\s+\w+\s+SMEM\s*=", source, re.M), \
                    f"{spec.name} {strategy_name}[{precision}]: a module-scope SMEM"
    assert checked >= 10
