"""NVRTC on the CPU: every strategy of every op compiles for sm_90 at the widths of the op's
tuning presets (seed and real); compile errors point at the source; the disk cache is keyed by
source and arch."""
from __future__ import annotations

import uuid

import pytest

from helpers import feasible_defaults, sampled_plans, switching_defaults
from pairgen import codegen, compiler, runtime
from pairgen.ops import get_op, op_names

ARCH = "sm_90"


def preset_widths(spec, presets=None) -> list[dict]:
    """Each distinct channel-width set among the op's tuning shapes (of `presets`, default all)."""
    return [dict(items) for items in _points_per_width(spec, presets)]


def _points_per_width(spec, presets=None) -> dict:
    """{widths as a tuple of items: random points per strategy, beside its default points}: two at
    the seed preset's widths, one at the real preset's, none at the other presets' (wider or other
    options of the same kernels, whose default points are compiled; one where a strategy has no
    default that fits): NVRTC time is most of this suite's time."""
    points = {}
    for preset, shapes in spec.presets.items():
        if presets is not None and preset not in presets:
            continue
        for shape in shapes:
            points.setdefault(tuple(spec.widths_of(shape).items()), {"seed": 2, "real": 1}.get(preset, 0))
    return points


def _label(widths: dict) -> str:
    return "".join(f"{k}{v}" for k, v in widths.items())


def _compile_sampled(spec, points_per_width: dict) -> list:
    """(plan, Compiled or the exception) for the sampled points of every strategy at each widths
    (at least one point per strategy, where a strategy has no default that fits)."""
    plans = [p for items, k in points_per_width.items() for s in spec.strategies
             for p in (sampled_plans(spec, s, dict(items), k, seed=7) or sampled_plans(spec, s, dict(items), 1, seed=7))]
    rendered = [codegen.render_plan(p) for p in plans]
    return list(zip(plans, compiler.compile_many([(r.source, r.kernel_name, ARCH) for r in rendered])))


def _assert_compiled(results) -> set:
    """Every result a cubin with sane resources; the (strategy, widths label) pairs seen."""
    seen = set()
    for plan, result in results:
        assert not isinstance(result, Exception), f"{plan.label} {plan.widths}: {result}"
        assert result.cubin[:4] == b"\x7fELF", "a cubin is an ELF file"
        assert result.registers and result.registers <= 255
        assert result.spill_bytes is not None and result.compile_s > 0
        seen.add((plan.strategy, _label(plan.widths)))
    return seen


def _switching_defaults_and_a_sample(spec, widths: dict) -> list:
    """Each strategy's feasible defaults at `widths` that switch a feature as no earlier one does
    (helpers.switching_defaults), then a sampled point."""
    plans = []
    for s in spec.strategies:
        defaults = len(feasible_defaults(spec, s, widths, None))
        sampled = sampled_plans(spec, s, widths, 1, seed=7)  # the feasible defaults, then the sampled point
        plans += switching_defaults(sampled[:defaults]) + sampled[defaults:]
    return plans


def _compile_once(plans) -> dict:
    """{plan label and widths: (plan, Compiled or the exception)}, each distinct source compiled once."""
    unique = {(p.label, _label(p.widths)): p for p in plans}
    rendered = [codegen.render_plan(p) for p in unique.values()]
    results = compiler.compile_many([(r.source, r.kernel_name, ARCH) for r in rendered])
    return {key: (plan, result) for (key, plan), result in zip(unique.items(), results)}


@pytest.mark.parametrize("op", op_names())
def test_every_strategy_compiles_at_the_seed_widths_and_first_defaults_do_not_spill(op):
    """The fast share of the sweeps below, in one compile pass (a plan both need compiles once): at
    the seed preset's widths each strategy's defaults that switch a feature as no earlier one does
    and one sampled point (the sweep compiles every default at every preset width); at the seed and
    real presets' widths the first default of each strategy (the one a module runs where nothing is
    tuned), without spills."""
    spec = get_op(op)
    seed_widths = spec.widths_of(spec.presets["seed"][0])
    switching = _switching_defaults_and_a_sample(spec, seed_widths)
    first = _feasible_defaults(spec, first_per_strategy=True, presets=("seed", "real"))
    compiled = _compile_once(switching + first)
    seen = _assert_compiled(compiled[(p.label, _label(p.widths))] for p in switching)
    assert seen == {(s, _label(seed_widths)) for s in spec.strategies}
    _assert_no_spills_in(compiled[(p.label, _label(p.widths))] for p in first)


@pytest.mark.slow
@pytest.mark.parametrize("op", op_names())
def test_every_strategy_compiles_at_every_preset_width(op):
    spec = get_op(op)
    seen = _assert_compiled(_compile_sampled(spec, _points_per_width(spec)))
    # every strategy at every width (wgmma's wide widths keep slices of its weights resident)
    assert seen == {(s, _label(w)) for s in spec.strategies for w in preset_widths(spec)}


def _feasible_defaults(spec, first_per_strategy: bool, presets=None) -> list:
    """The op's feasible default plans at the widths of its presets (all of them by default): all
    of them, or the first of each strategy (the one a module runs where nothing is tuned; the later
    ones serve other limits)."""
    plans = []
    for widths in preset_widths(spec, presets):
        strategies_seen = set()
        for strategy, params in spec.default_points:
            plan = spec.plan(strategy, params, widths)
            if spec.infeasible(plan, runtime.DeviceLimits()) or (first_per_strategy and strategy in strategies_seen):
                continue  # a later default covers these widths (checked in each op's spec tests)
            strategies_seen.add(strategy)
            plans.append(plan)
    return plans


def _assert_no_spills_in(results) -> None:
    for plan, result in results:
        assert not isinstance(result, Exception), f"{plan.label} {plan.widths}: {result}"
        assert result.spill_bytes == 0 and result.stack_bytes == 0, f"{plan.label} {plan.widths}: {result.summary()}"


def _assert_no_spills(plans) -> None:
    rendered = [codegen.render_plan(p) for p in plans]
    _assert_no_spills_in(zip(plans, compiler.compile_many([(r.source, r.kernel_name, ARCH) for r in rendered])))



@pytest.mark.slow
@pytest.mark.parametrize("op", op_names())
def test_default_variants_do_not_spill(op):
    _assert_no_spills(_feasible_defaults(get_op(op), first_per_strategy=False))


def test_compile_error_shows_the_offending_line():
    source = 'extern "C" __global__ void k(float* x) {\n  x[0] = 1.0f;\n  int y = ;\n}\n'
    with pytest.raises(compiler.CompileError) as info:
        compiler.compile_source(source, "k", ARCH)
    text = str(info.value)
    assert "error" in text and ">>     3 |   int y = ;" in text


def test_compile_errors_come_back_from_the_worker_pool():
    """Each job's error is returned in its place; an error that could not cross the process
    boundary used to break the whole pool (BrokenProcessPool)."""
    good = 'extern "C" __global__ void ok_k(float* x) { x[0] = 2.0f; }\n'
    bad = 'extern "C" __global__ void bad_k(float* x) {\n  int y = ;\n}\n'
    with compiler.compile_pool(2) as pool:
        results = compiler.compile_many([(good, "ok_k", ARCH), (bad, "bad_k", ARCH)], pool)
    assert isinstance(results[0], compiler.Compiled)
    assert isinstance(results[1], compiler.CompileError) and ">>     2 |   int y = ;" in str(results[1])


def test_compile_workers_yield_the_cpu_to_the_process_that_times():
    """The tuner times calls while the pool compiles: its workers run at a lower CPU priority than
    the parent, so a host-bound call does not queue behind them for a core."""
    import os

    with compiler.compile_pool(1) as pool:
        worker = pool.submit(os.nice, 0).result()
    assert worker >= os.nice(0) + compiler.WORKER_NICENESS or worker == 19  # 19: the lowest there is


def test_disk_cache_is_keyed_by_source_and_arch():
    # A source no earlier run can have cached (the cache directory may persist between runs).
    source = f'// {uuid.uuid4()}\nextern "C" __global__ void cached_k(float* x) {{ x[threadIdx.x] *= 2.0f; }}\n'
    first = compiler.compile_source(source, "cached_k", ARCH)
    again = compiler.compile_source(source, "cached_k", ARCH)
    assert not first.from_cache and again.from_cache and again.cubin == first.cubin
    other = compiler.compile_source(source, "cached_k", "sm_80")
    assert not other.from_cache
    assert compiler.cache_key(source, ARCH) != compiler.cache_key(source, "sm_80")


def test_a_compile_that_nvrtc_has_seen_still_reports_its_resources():
    """NVRTC 12.9 on may answer a compile from the driver's compute cache without running ptxas, and
    then the -v report is missing: pairgen turns that cache off (nvrtc_options) where the version
    has it, so the same source compiled again, past pairgen's own cache, reports its kernel again."""
    source = f'// {uuid.uuid4()}\nextern "C" __global__ void seen_k(float* x) {{ x[threadIdx.x] *= 2.0f; }}\n'
    reports = [compiler.compile_source(source, "seen_k", ARCH, use_cache=False).kernels for _ in range(2)]
    assert all(set(report) == {"seen_k"} and report["seen_k"]["registers"] for report in reports)


@pytest.mark.parametrize("version,no_cache", [("12.8", False), ("12.9", True), ("13.0", True), ("12.10", True)])
def test_nvrtc_s_own_cache_is_off_from_the_version_that_has_it(monkeypatch, version, no_cache):
    monkeypatch.setattr(compiler, "nvrtc_version", lambda: version)
    options = compiler.nvrtc_options()
    assert options[:len(compiler.NVRTC_OPTIONS)] == compiler.NVRTC_OPTIONS
    assert ("--no-cache" in options) is no_cache


def _one_wgmma_kernel(touch_before_wait: bool) -> str:
    """A kernel issuing one wgmma product; where asked, it adds to an accumulator before waiting
    for the product, which makes ptxas serialize it (a wait injected before the add)."""
    regs = ", ".join(f"%{i}" for i in range(16))
    accumulators = ", ".join(f'"+f"(d[{i}])' for i in range(16))
    return (f"// {uuid.uuid4()}\n"
            'extern "C" __global__ void one_product(float* out, unsigned long long da, unsigned long long db) {\n'
            "  float d[16];\n  for (int i = 0; i < 16; i++) d[i] = out[i];\n"
            '  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");\n'
            f'  asm volatile("{{ wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {{{regs}}}, %16, %17, 1, 1, 1, 0, 0; }}"\n'
            f'               : {accumulators} : "l"(da), "l"(db));\n'
            '  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");\n'
            + ("  d[0] += 1.0f;\n" if touch_before_wait else "")
            + '  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");\n'
            "  float s = 0;\n  for (int i = 0; i < 16; i++) s += d[i];\n  out[threadIdx.x] = s;\n}\n")


def test_a_compile_says_when_ptxas_serialized_its_wgmma_products():
    """Compiled.wgmma_serialized: ptxas's remark read from its report, and kept in the cache (the
    wgmma tests check their kernels' products from the cached compile)."""
    for touch in (False, True):
        source = _one_wgmma_kernel(touch)
        first = compiler.compile_source(source, "one_product", "sm_90a")
        again = compiler.compile_source(source, "one_product", "sm_90a")
        assert again.from_cache and first.wgmma_serialized is again.wgmma_serialized is touch
        assert ("serialized" in first.summary()) is touch


def test_resources_are_reported_per_kernel_and_the_worst_overall():
    source = ('extern "C" __global__ void light(float* x) { x[threadIdx.x] += 1.0f; }\n'
              'extern "C" __global__ void heavy(float* x, int n) {\n'
              '  float acc[64];\n'
              '  for (int k = 0; k < 64; ++k) acc[k] = x[(threadIdx.x * 7 + k * n) % 4096];\n'
              '  float s = 0.0f;\n'
              '  for (int k = 0; k < 64; ++k) s += acc[(k * n) & 63];\n'  # run-time indices: a stack frame
              '  x[threadIdx.x] = s;\n}\n')
    result = compiler.compile_source(source, "light", ARCH)
    assert set(result.kernels) == {"light", "heavy"}
    light, heavy = result.kernels["light"], result.kernels["heavy"]
    assert heavy["stack_bytes"] > 0 == light["stack_bytes"]
    assert result.stack_bytes == heavy["stack_bytes"], "the worst kernel speaks for the source"
    assert result.registers == max(light["registers"], heavy["registers"])
