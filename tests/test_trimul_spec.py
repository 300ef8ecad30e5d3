"""The trimul spec: defaults for every width, grids, restrictions, packed-weight offsets, the cost
model, and every kernel of the rendered sources compiling with NVRTC without spills."""
from __future__ import annotations


import pytest

from helpers import sampled_plans
from pairgen import codegen, compiler, runtime
from pairgen.ops.base import DeviceLimits
from pairgen.ops.trimul import TRIMUL, weight_offsets

ARCH = "sm_90"
DEFAULT_OPTIONS = {"outgoing": 0, "gate_normalized": 0, "bias": 1}
OTHER_OPTIONS = {"outgoing": 1, "gate_normalized": 1, "bias": 0}


def widths(P, H, options=DEFAULT_OPTIONS):
    return {"P": P, "H": H, **options}


def test_a_default_fits_every_width_multiple_of_8_up_to_256():
    missing = [(P, H) for P in range(16, 257, 8) for H in range(16, 257, 8)
               if TRIMUL.default_plan(widths(P, H), DeviceLimits()) is None]
    assert not missing


def test_presets_carry_the_options_and_the_first_default_fits_them():
    for shapes in TRIMUL.presets.values():
        for shape in shapes:
            assert set(TRIMUL.widths_of(shape)) == set(TRIMUL.width_names)
            plan = TRIMUL.default_plan(TRIMUL.widths_of(shape), DeviceLimits())
            assert plan.params == TRIMUL.default_points[0][1]
    assert {"B": 1, "N": 256, "P": 128, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 1} in TRIMUL.presets["real"]


def test_search_spaces_are_modest_and_pruned():
    for name in TRIMUL.strategies:
        points = list(TRIMUL.points(name))
        assert len(points) <= 600
        feasible = TRIMUL.feasible_plans(name, widths(40, 24), DeviceLimits())
        assert 0 < len(feasible) < len(points)
        for plan in TRIMUL.feasible_plans(name, widths(128, 128), DeviceLimits()):
            c = plan.context
            assert c["p_threads_m"] * c["p_tm"] == c["p_tile"] and c["p_threads_m"] * c["p_threads_n"] == plan.threads
            assert (4 * 128) % c["p_cn"] == 0 and 128 % c["o_cn"] == 0
            assert max(plan.smem_bytes, c["output_smem"]) <= DeviceLimits().max_smem_per_block


def test_restrictions_name_what_is_wrong():
    big = TRIMUL.plan("bmm", {"p_tile": 128, "p_tm": 4, "p_tn": 8, "p_weights_smem": True, "o_tile": 128, "o_tm": 4,
                              "threads": 128, "unroll": 4, "min_blocks": 1}, widths(256, 256))
    assert "shared memory exceeds the per-block limit" in TRIMUL.infeasible(big, DeviceLimits())
    odd = TRIMUL.plan("bmm", TRIMUL.default_points[0][1], widths(40, 24))
    assert any("column chunks" in r for r in TRIMUL.infeasible(odd, DeviceLimits()))
    crowded = TRIMUL.plan("fused", {"p_tile": 64, "p_tm": 2, "p_tn": 8, "o_tile": 64, "o_tm": 1, "threads": 256,
                                    "unroll": 4, "blocks_per_sm": 2}, widths(256, 256))
    assert any("co-resident" in r for r in TRIMUL.infeasible(crowded, DeviceLimits()))


def test_grids():
    bmm = TRIMUL.plan("bmm", TRIMUL.default_points[0][1], widths(128, 128))
    assert bmm.grid(3, 37, 132, 1) == (-(-3 * 37 * 37 // 128),) * 2
    assert bmm.grid(1, 1, 132, 1) == (1, 1)
    fused = TRIMUL.plan("fused", {"p_tile": 32, "p_tm": 2, "p_tn": 4, "o_tile": 16, "o_tm": 1, "threads": 128,
                                  "unroll": 4, "blocks_per_sm": 2}, widths(64, 32))
    pairs = 2 * 32 * 32
    assert fused.grid(2, 32, 132, 4) == (pairs // 16, pairs // 16)       # fewer tiles than resident slots
    assert fused.grid(8, 64, 132, 4) == (2 * 132, 8 * 64 * 64 // 16)    # persistent: 2 per SM
    assert fused.grid(8, 64, 132, 1) == (132, 8 * 64 * 64 // 16)        # clamped to what is resident
    assert fused.grid(1, 1, 132, 1) == (1, 1)


@pytest.mark.parametrize("bias", [True, False])
def test_weight_offsets_are_aligned_and_disjoint(bias):
    P, H = 40, 24
    off = weight_offsets(P, H, bias)
    nb = 1 if bias else 0
    names = ["ln_in_g", "ln_in_b", "wp", "bp", "ln_out_g", "ln_out_b", "wo", "bo", "wg", "bg"]
    sizes = [P, P, P * 4 * H, nb * 4 * H, H, H, H * P, nb * P, P * P, nb * P]
    for k, (name, size) in enumerate(zip(names, sizes)):
        assert off[name] % 4 == 0
        end = off[names[k + 1]] if k + 1 < len(names) else off["total"]
        assert off[name] + size <= end
    assert (off["bp"] == off["ln_out_g"]) == (not bias)


def test_cost_model_matches_the_flop_counts_of_the_issue():
    cost = TRIMUL.cost({"B": 1, "N": 512, "P": 128, "H": 128, **DEFAULT_OPTIONS})
    projections, bmm, output = 2 * 512 ** 2 * 128 * 512, 2 * 512 ** 3 * 128, 2 * 512 ** 2 * 2 * 128 * 128
    assert cost.flops == pytest.approx(projections + bmm + output)
    assert cost.flops / 51.3e12 * 1e6 == pytest.approx(1674, rel=0.01)  # MEASURE.md's floor
    assert cost.bytes >= 2 * 512 ** 2 * 128 * 4


def test_template_hash_covers_the_partials():
    names = codegen._referenced(codegen.template_name("trimul", "fused"))
    assert {"trimul/_widths.cuh.j2", "trimul/_project.cuh.j2", "trimul/_output.cuh.j2", "common/grid_barrier.cuh",
            "common/tile_map.cuh", "common/tile_gemm.cuh"} <= names


def _compile_all_kernels(plan):
    """Every __global__ of the source with its spill and stack bytes (Compiled reports each)."""
    rendered = runtime.render_plan(plan)
    compiled = compiler.compile_source(rendered.source, rendered.kernel_name, ARCH)
    return rendered, {name: (k["stack_bytes"], k["spill_bytes"]) for name, k in compiled.kernels.items()}


WIDTH_CASES = [(16, 16), (40, 24), (64, 32), (128, 128), (256, 256)]


@pytest.mark.parametrize("options", [DEFAULT_OPTIONS, OTHER_OPTIONS], ids=["default", "out-norm-nobias"])
@pytest.mark.parametrize("P, H", WIDTH_CASES, ids=[f"P{p}H{h}" for p, h in WIDTH_CASES])
def test_the_default_compiles_without_spills_in_either_kernel(P, H, options):
    plan = TRIMUL.default_plan(widths(P, H, options), DeviceLimits())
    rendered, stats = _compile_all_kernels(plan)
    name = rendered.kernel_name
    assert set(stats) == {name, f"{name}_output"}
    assert all(v == (0, 0) for v in stats.values()), f"{plan.label} {plan.widths}: {stats}"
    assert f"{name}_output(" in rendered.source


@pytest.mark.parametrize("options", [DEFAULT_OPTIONS, OTHER_OPTIONS], ids=["default", "out-norm-nobias"])
def test_sampled_points_of_every_strategy_compile(options):
    plans = [p for s in TRIMUL.strategies for w in ((64, 32), (40, 24), (128, 128))
             for p in sampled_plans(TRIMUL, s, widths(*w, options), 1, seed=3)]
    rendered = [runtime.render_plan(p) for p in plans]
    results = compiler.compile_many([(r.source, r.kernel_name, ARCH) for r in rendered])
    for plan, result in zip(plans, results):
        assert not isinstance(result, Exception), f"{plan.label} {plan.widths}: {result}"
        assert result.compile_s < 20, f"{plan.label}: {result.summary()}"
