"""NVRTC on the CPU: every contact strategy compiles for sm_90 at the seed widths and at
P=H=128; compile errors point at the source; the disk cache is keyed by source and arch."""
from __future__ import annotations

import pytest

from helpers import SEED_WIDTHS, sampled_plans
from pairgen import compiler, runtime
from pairgen.ops.contact import CONTACT

ARCH = "sm_90"
WIDTHS = (SEED_WIDTHS, {"P": 128, "H": 128})


@pytest.fixture(scope="module")
def compiled():
    plans = [p for w in WIDTHS for s in CONTACT.strategies for p in sampled_plans(CONTACT, s, w, 2, seed=7)]
    rendered = [runtime.render_plan(p) for p in plans]
    return list(zip(plans, compiler.compile_many([(r.source, r.kernel_name, ARCH) for r in rendered])))


def test_every_strategy_compiles_at_seed_and_real_widths(compiled):
    seen = set()
    for plan, result in compiled:
        assert not isinstance(result, Exception), f"{plan.label} {plan.widths}: {result}"
        assert result.cubin[:4] == b"\x7fELF", "a cubin is an ELF file"
        assert result.registers and result.registers <= 255
        assert result.spill_bytes is not None and result.compile_s > 0
        seen.add((plan.strategy, plan.widths["P"]))
    assert seen == {(s, w["P"]) for s in CONTACT.strategies for w in WIDTHS}


@pytest.mark.parametrize("widths", WIDTHS, ids=lambda w: f"P{w['P']}H{w['H']}")
def test_default_variants_do_not_spill(widths):
    for strategy, params in CONTACT.default_points:
        result = runtime.build_variant(CONTACT.plan(strategy, params, widths), ARCH).compiled
        assert result.spill_bytes == 0 and result.stack_bytes == 0, f"{strategy}: {result.summary()}"


def test_compile_error_shows_the_offending_line():
    source = 'extern "C" __global__ void k(float* x) {\n  x[0] = 1.0f;\n  int y = ;\n}\n'
    with pytest.raises(compiler.CompileError) as info:
        compiler.compile_source(source, "k", ARCH)
    text = str(info.value)
    assert "error" in text and ">>     3 |   int y = ;" in text


def test_disk_cache_is_keyed_by_source_and_arch():
    source = 'extern "C" __global__ void cached_k(float* x) { x[threadIdx.x] *= 2.0f; }\n'
    first = compiler.compile_source(source, "cached_k", ARCH)
    again = compiler.compile_source(source, "cached_k", ARCH)
    assert not first.from_cache and again.from_cache and again.cubin == first.cubin
    other = compiler.compile_source(source, "cached_k", "sm_80")
    assert not other.from_cache
    assert compiler.cache_key(source, ARCH) != compiler.cache_key(source, "sm_80")
