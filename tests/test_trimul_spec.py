"""The trimul spec: defaults for every width, grids, restrictions, packed-weight offsets, the cost
model, and every kernel of the rendered sources compiling with NVRTC without spills."""
from __future__ import annotations


import pytest

from helpers import sampled_plans, main_grid
from pairgen import codegen, compiler
from pairgen.spec import DeviceLimits
from pairgen.ops.trimul import TRI_BUDGET, TRI_KC, TRIMUL, triangle_staging, weight_offsets

ARCH = "sm_90"
DEFAULT_OPTIONS = {"outgoing": 0, "gate_normalized": 0, "bias": 1}
OTHER_OPTIONS = {"outgoing": 1, "gate_normalized": 1, "bias": 0}
# The fused point tuned for the seed shape before tri_smem existed (its tuning on the H200, 2026-11-29).
SEED_FUSED = {"p_tile": 32, "p_tm": 2, "p_tn": 4, "o_tile": 16, "o_tm": 1, "threads": 256, "unroll": 4,
              "blocks_per_sm": 1}


def widths(P, H, options=DEFAULT_OPTIONS):
    return {"P": P, "H": H, **options}


def test_a_default_fits_every_width_multiple_of_8_up_to_256():
    missing = [(P, H) for P in range(16, 257, 8) for H in range(16, 257, 8)
               if TRIMUL.default_plan(widths(P, H), DeviceLimits()) is None]
    assert not missing


def test_presets_carry_the_options_and_the_first_default_fits_them():
    for name in ("seed", "real"):
        shapes = TRIMUL.presets[name]
        for shape in shapes:
            assert set(TRIMUL.widths_of(shape)) == set(TRIMUL.width_names)
            plan = TRIMUL.default_plan(TRIMUL.widths_of(shape), DeviceLimits())
            assert plan.params == TRIMUL.default_points[0][1]
    assert {"B": 1, "N": 256, "P": 128, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 1} in TRIMUL.presets["real"]


# 576 points each before o_weights_smem and o_tn (bmm, x4) and tri_smem (fused, x2); the tuner's 64 trials
# sample either way, and a re-tune starts from the old winner with each value of the new parameter.
MAX_POINTS = {"bmm": 2400, "fused": 1200}


def test_search_spaces_are_modest_and_pruned():
    for name in TRIMUL.at("float32").strategies:  # the mma strategy: tests/test_trimul_mma.py
        points = list(TRIMUL.points(name))
        assert len(points) <= MAX_POINTS[name]
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
    assert main_grid(bmm, 3, 37, 132, 1) == (-(-3 * 37 * 37 // 128),) * 2
    assert main_grid(bmm, 1, 1, 132, 1) == (1, 1)
    fused = TRIMUL.plan("fused", {"p_tile": 32, "p_tm": 2, "p_tn": 4, "o_tile": 16, "o_tm": 1, "threads": 128,
                                  "unroll": 4, "blocks_per_sm": 2}, widths(64, 32))
    pairs = 2 * 32 * 32
    assert main_grid(fused, 2, 32, 132, 4) == (pairs // 16, pairs // 16)       # fewer tiles than resident slots
    assert main_grid(fused, 8, 64, 132, 4) == (2 * 132, 8 * 64 * 64 // 16)    # persistent: 2 per SM
    assert main_grid(fused, 8, 64, 132, 1) == (132, 8 * 64 * 64 // 16)        # clamped to what is resident
    assert main_grid(fused, 1, 1, 132, 1) == (1, 1)
    # Staged triangle sums: row tiles, ceil(N / o_tile) per (b, i).
    staged = TRIMUL.plan("fused", {**SEED_FUSED, "tri_smem": True}, widths(64, 32))
    assert main_grid(staged, 2, 32, 132, 1) == (2 * 32 * 2, 2 * 32 * 2)          # the seed: as many tiles as flat ones
    assert main_grid(staged, 3, 37, 132, 1) == (132, 3 * 37 * 3)                # 37 = 16 + 16 + 5 per row
    assert main_grid(staged, 1, 7, 132, 1) == (7, 7)                            # 7 rows of 7 (flat: 4 tiles of 16)
    assert main_grid(staged, 1, 1, 132, 1) == (1, 1)


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
    assert cost.flops / 51.3e12 * 1e6 == pytest.approx(1674, rel=0.01)  # the floor at the H200's measured fp32 rate
    assert cost.bytes >= 2 * 512 ** 2 * 128 * 4


def test_template_hash_covers_the_partials():
    names = codegen._referenced(codegen.template_name("trimul", "fused"))
    assert {"trimul/_widths.cuh.j2", "trimul/_project.cuh.j2", "trimul/_output.cuh.j2", "trimul/_triangle.cuh.j2",
            "common/grid_barrier.cuh", "common/tile_map.cuh", "common/tile_gemm.cuh"} <= names
    assert "trimul/_triangle.cuh.j2" not in codegen._referenced(codegen.template_name("trimul", "bmm"))


# ---- the fused strategy's staged triangle sums (tri_smem) -------------------------------------------

def _warp_banks(addresses) -> bool:
    """Whether a warp's 4-byte shared-memory reads of these word addresses take one wavefront:
    lanes reading the same word share it; different words must sit in different banks."""
    words = set(addresses)
    return len({a % 32 for a in words}) == len(words)


@pytest.mark.parametrize("outgoing", [False, True], ids=["incoming", "outgoing"])
@pytest.mark.parametrize("o_tile", [16, 32, 64])
def test_staged_layout_fits_and_its_warp_reads_are_conflict_free(o_tile, outgoing):
    for H in range(16, 257, 8):
        tri = triangle_staging(o_tile, H, outgoing)
        hc, a_stride, h_stride, b_row = tri["hc"], tri["a_stride"], tri["h_stride"], tri["b_row"]
        per_channel = a_stride + h_stride
        assert H % hc == 0 and hc % 4 == 0 and tri["stage_floats"] == hc * per_channel
        assert 2 * 4 * tri["stage_floats"] <= TRI_BUDGET or hc == 4
        larger = [d for d in range(hc + 4, H + 1, 4) if H % d == 0 and 2 * 4 * d * per_channel <= TRI_BUDGET]
        assert not larger, f"H={H}: hc={hc} but {larger} fit"
        assert a_stride >= TRI_KC and a_stride % 4 == 0 and h_stride % 4 == 0  # float4 reads of a
        assert h_stride >= (o_tile * b_row if outgoing else TRI_KC * b_row)
        k_step, t_step = (1, b_row) if outgoing else (b_row, 1)
        for warp_first in range(0, min(o_tile * hc, 256), 32):  # the sums' reads, warp by warp (_triangle.cuh.j2)
            lanes = [(e % o_tile, e // o_tile) for e in range(warp_first, warp_first + 32) if e < o_tile * hc]
            for k in (0, 1, TRI_KC - 1):
                assert _warp_banks([hc_ * h_stride + t * t_step + k * k_step for t, hc_ in lanes]), (H, k)
            quads = {(hc_ * a_stride // 4) % 8 for _, hc_ in lanes}  # float4 reads of a: one bank quad per channel
            assert len(quads) == len({hc_ for _, hc_ in lanes})


def test_staged_plans_hold_the_z_rows_and_two_stages_in_shared_memory():
    glob = TRIMUL.plan("fused", {**SEED_FUSED, "tri_smem": False}, widths(64, 32))
    staged = TRIMUL.plan("fused", {**SEED_FUSED, "tri_smem": True}, widths(64, 32))
    assert glob.smem_bytes == 4 * 32 * 68  # the projection tile, as before tri_smem existed
    tri = triangle_staging(16, 32, False)
    assert tri["hc"] == 16 and staged.smem_bytes == 4 * (16 * 36 + 2 * tri["stage_floats"]) == 74496
    for options in (DEFAULT_OPTIONS, OTHER_OPTIONS):
        for P, H in WIDTH_CASES:
            for plan in TRIMUL.feasible_plans("fused", widths(P, H, options), DeviceLimits()):
                c = plan.context
                output_area = 4 * c["o_tile"] * (c["o_z_stride"] + c["o_x_stride"])
                assert plan.smem_bytes >= max(4 * c["p_tile"] * c["p_a_stride"], output_area)
                if plan.params["tri_smem"]:
                    assert plan.smem_bytes >= 4 * (c["o_tile"] * c["o_z_stride"] + 2 * c["tri_stage_floats"])
                    assert c["tri_stage_floats"] == triangle_staging(c["o_tile"], H, bool(options["outgoing"]))["stage_floats"]


def test_staged_shared_memory_prunes_points_the_global_path_fits():
    point = {"p_tile": 64, "p_tm": 4, "p_tn": 4, "o_tile": 64, "o_tm": 1, "threads": 256, "unroll": 4,
             "blocks_per_sm": 2}
    glob = TRIMUL.plan("fused", {**point, "tri_smem": False}, widths(16, 256))
    staged = TRIMUL.plan("fused", {**point, "tri_smem": True}, widths(16, 256))
    assert not TRIMUL.infeasible(glob, DeviceLimits())
    assert staged.smem_bytes > glob.smem_bytes
    assert TRIMUL.infeasible(staged, DeviceLimits()) == ["persistent blocks must be co-resident on an SM"]
    tiny = DeviceLimits(max_smem_per_block=48 * 1024, smem_per_sm=228 * 1024)
    seed = TRIMUL.plan("fused", {**SEED_FUSED, "tri_smem": True}, widths(64, 32))
    assert "shared memory exceeds the per-block limit" in TRIMUL.infeasible(seed, tiny)


def test_a_fused_entry_tuned_before_tri_smem_plans_as_the_global_path():
    legacy = TRIMUL.plan("fused", SEED_FUSED, widths(64, 32))
    explicit = TRIMUL.plan("fused", {**SEED_FUSED, "tri_smem": False}, widths(64, 32))
    assert legacy.params == explicit.params and legacy.context == explicit.context
    assert legacy.smem_bytes == explicit.smem_bytes and main_grid(legacy, 2, 32, 132, 1) == main_grid(explicit, 2, 32, 132, 1)
    with pytest.raises(ValueError, match="params"):
        TRIMUL.plan("fused", {**SEED_FUSED, "tri_smem": True, "unknown": 1}, widths(64, 32))
    with pytest.raises(ValueError, match="tri_smem"):
        TRIMUL.plan("fused", {**SEED_FUSED, "tri_smem": 2}, widths(64, 32))


def _compile_all_kernels(plan):
    """Every __global__ of the source with its spill and stack bytes (Compiled reports each)."""
    rendered = codegen.render_plan(plan)
    compiled = compiler.compile_source(rendered.source, rendered.kernel_name, ARCH)
    return rendered, {name: (k["stack_bytes"], k["spill_bytes"]) for name, k in compiled.kernels.items()}


WIDTH_CASES = [(16, 16), (40, 24), (64, 32), (128, 128), (256, 256)]


@pytest.mark.parametrize("options", [DEFAULT_OPTIONS, pytest.param(OTHER_OPTIONS, marks=pytest.mark.slow)],
                         ids=["default", "out-norm-nobias"])
@pytest.mark.parametrize("P, H", [pytest.param(p, h, id=f"P{p}H{h}", marks=[pytest.mark.slow] if p > 128 else [])
                                  for p, h in WIDTH_CASES])  # wider than the real preset's: with the sweep (--slow)
def test_the_default_compiles_without_spills_in_either_kernel(P, H, options):
    plan = TRIMUL.default_plan(widths(P, H, options), DeviceLimits())
    rendered, stats = _compile_all_kernels(plan)
    name = rendered.kernel_name
    assert set(stats) == {name, f"{name}_output"}
    assert all(v == (0, 0) for v in stats.values()), f"{plan.label} {plan.widths}: {stats}"
    assert f"{name}_output(" in rendered.source


#: The staged triangle path's output tiles at widths whose channel chunks differ: the seed's (hc 16
#: of 32 at o_tile 16, and o_tile 32), not a power of two (hc 12 of 24, o_tile 64 alone fits) and
#: large (hc 4 of 128 at o_tile 64); every tile at every width with --slow.
STAGED_TILES = {(64, 32): (16, 32), (40, 24): (64,), (128, 128): (64,)}


def _staged_plans(options, every_tile: bool) -> list:
    """The first feasible staged plan of each output tile (STAGED_TILES', or all of them) at STAGED_TILES' widths."""
    plans = []
    for (P, H), tiles in STAGED_TILES.items():
        feasible = [p for p in TRIMUL.feasible_plans("fused", widths(P, H, options), DeviceLimits()) if p.params["tri_smem"]]
        firsts = {}
        for plan in feasible:
            firsts.setdefault(plan.params["o_tile"], plan)
        plans += [plan for o_tile, plan in firsts.items() if every_tile or o_tile in tiles]
    return plans


@pytest.mark.parametrize("options, every_tile", [(DEFAULT_OPTIONS, False),
                                                 pytest.param(DEFAULT_OPTIONS, True, marks=pytest.mark.slow),
                                                 pytest.param(OTHER_OPTIONS, True, marks=pytest.mark.slow)],
                         ids=["default", "default-every-tile", "out-norm-nobias"])
def test_staged_triangle_sums_compile_without_spills(options, every_tile):
    plans = _staged_plans(options, every_tile)
    seed = TRIMUL.plan("fused", {**SEED_FUSED, "tri_smem": True}, widths(64, 32, options))
    plans.append(seed)
    rendered = [codegen.render_plan(p) for p in plans]
    results = compiler.compile_many([(r.source, r.kernel_name, ARCH) for r in rendered])
    for plan, rend, result in zip(plans, rendered, results):
        assert not isinstance(result, Exception), f"{plan.label} {plan.widths}: {result}"
        assert (result.spill_bytes, result.stack_bytes) == (0, 0), f"{plan.label} {plan.widths}: {result.summary()}"
        assert "cp.async.ca.shared.global" in rend.source
        assert "__ldg(ar" not in rend.source and "__ldg(br" not in rend.source  # written by the same launch
    assert {p.params["o_tile"] for p in plans} == {16, 32, 64}


@pytest.mark.parametrize("options, with_defaults, sizes", [
    (DEFAULT_OPTIONS, False, ((40, 24),)),
    pytest.param(DEFAULT_OPTIONS, True, ((40, 24), (128, 128)), marks=pytest.mark.slow),
    pytest.param(OTHER_OPTIONS, True, ((40, 24), (128, 128)), marks=pytest.mark.slow)],
    ids=["default", "default-and-defaults", "out-norm-nobias"])
def test_sampled_points_of_every_strategy_compile(options, with_defaults, sizes):
    """A sampled point of every strategy, with its feasible defaults before it (with_defaults): in
    the fast share the sampled points alone at odd widths, the defaults compiling in
    test_compile.py (each strategy's first, at the seed's and P = H = 128) and
    test_the_default_compiles_without_spills_in_either_kernel, the tensor-core strategies' samples
    at P = H = 128 in their own files; with --slow also every strategy's at P = H = 128."""
    plans = [p for s in TRIMUL.strategies for w in sizes  # the seed's (64, 32): test_compile.py
             for p in sampled_plans(TRIMUL, s, widths(*w, options), 1, seed=3)[0 if with_defaults else -1:]]
    rendered = [codegen.render_plan(p) for p in plans]
    results = compiler.compile_many([(r.source, r.kernel_name, ARCH) for r in rendered])
    for plan, result in zip(plans, results):
        assert not isinstance(result, Exception), f"{plan.label} {plan.widths}: {result}"
        assert result.compile_s < 20, f"{plan.label}: {result.summary()}"


def test_output_weights_in_shared_memory_add_one_chunk_of_both_weights():
    widths = {"P": 128, "H": 128, "outgoing": 0, "gate_normalized": 0, "bias": 1}
    point = dict(TRIMUL.default_points[0][1])
    cached = TRIMUL.plan("bmm", {**point, "o_weights_smem": False}, widths)
    staged = TRIMUL.plan("bmm", {**point, "o_weights_smem": True}, widths)
    cn = staged.context["o_cn"]
    assert staged.context["output_smem"] - cached.context["output_smem"] == 4 * (128 + 128) * cn
    assert staged.context["o_weights_smem"] == "true" and cached.context["o_weights_smem"] == "false"
    assert not TRIMUL.infeasible(staged, DeviceLimits())
    old_entry = {k: v for k, v in point.items() if k != "o_weights_smem"}  # tuned before the parameter existed
    assert TRIMUL.plan("bmm", old_entry, widths).context["o_weights_smem"] == "false"


# ---- the out gate in hidden width (gate_hidden) ---------------------------------------------------

HIDDEN = {"gate_hidden": 1}


def test_gate_hidden_is_an_optional_width_that_output_keys_never_name():
    """A key names gate_hidden only where it is 1, so the output placement's keys (and plans, and
    rendered sources) are what they were before the option existed."""
    shape = {"B": 1, "N": 64, **widths(64, 32)}
    assert TRIMUL.widths_of(shape) == widths(64, 32)
    assert TRIMUL.widths_of({**shape, "gate_hidden": 0}) == widths(64, 32)
    assert TRIMUL.widths_of({**shape, **HIDDEN}) == {**widths(64, 32), **HIDDEN}
    output = TRIMUL.default_plan(widths(64, 32), DeviceLimits())
    hidden = TRIMUL.default_plan({**widths(64, 32), **HIDDEN}, DeviceLimits())
    assert "gate_hidden" not in output.widths and "gate_hidden" not in codegen.render_plan(output).source
    # the hidden placement's code renders only into its own sources
    assert "OT_GW_STRIDE" not in codegen.render_plan(output).source
    assert "OT_GW_STRIDE" in codegen.render_plan(hidden).source and '"gate_hidden": 1' in codegen.render_plan(hidden).source


def test_gate_hidden_runs_in_every_strategy():
    """Defaults as for the output placement: bmm in fp32 (and tf32x3, tf32: exact fp32 keeps their
    promises), wgmma in 16 bits on sm_90, mma in 16 bits elsewhere; every strategy has plans."""
    for options in (DEFAULT_OPTIONS, OTHER_OPTIONS):
        w = {**widths(128, 128, options), **HIDDEN}
        plan = TRIMUL.default_plan(w, DeviceLimits())
        assert plan.strategy == "bmm" and plan.widths["gate_hidden"] == 1
        assert TRIMUL.default_plan(w, DeviceLimits(), "tf32x3").strategy == "bmm"
        for precision in ("bfloat16", "float16"):
            assert TRIMUL.default_plan(w, DeviceLimits(), precision).strategy == "wgmma"
            assert TRIMUL.default_plan(w, DeviceLimits(arch="sm_80"), precision).strategy == "mma"
        for strategy in TRIMUL.strategies:
            precision = TRIMUL.strategies[strategy].precisions[0]
            # feasible_plans(...) is not empty: its first feasible point, without planning every other
            assert any(not TRIMUL.infeasible(TRIMUL.plan(strategy, point, w, precision), DeviceLimits())
                       for point in TRIMUL.points(strategy)), strategy
        assert TRIMUL.default_plan(w, DeviceLimits(), "tf32").strategy == "bmm"  # exact fp32 keeps tf32's promise
        tf32_mma = [TRIMUL.plan(s, pt, w, "tf32") for s, pt in TRIMUL.default_points if s == "mma"]
        assert any(not TRIMUL.infeasible(p, DeviceLimits()) for p in tf32_mma)


def test_gate_hidden_mma_layout_and_shared_memory():
    """The gate's product passes tile H (a pass width dividing P but not H is refused), its weight
    rows (H of them resident, else one pass) replace the output placement's P in shared memory."""
    from pairgen.spec import mma_row_bytes
    from pairgen.ops.trimul.strategies.mma import mma_weight_offsets

    point = next(p for s, p in TRIMUL.default_points if s == "mma" and p["o_resident"])
    out_plan = TRIMUL.plan("mma", point, widths(128, 64), "bfloat16")
    hidden = TRIMUL.plan("mma", point, {**widths(128, 64), **HIDDEN}, "bfloat16")
    x_row = mma_row_bytes(128, 2)
    assert out_plan.context["o_smem"] - hidden.context["o_smem"] == (128 - 64) * x_row
    off = mma_weight_offsets(128, 64, True, 2, 64)
    assert off["ln_in_g"] - off["wg"] >= 64 * 128 * 2 and mma_weight_offsets(128, 64, True, 2) != off
    staged = {**point, "o_resident": False, "o_warps_n": 4, "o_wn": 32}  # passes of 128 columns: P, not H = 96
    refused = TRIMUL.plan("mma", staged, {**widths(128, 96), **HIDDEN}, "bfloat16")
    assert any("passes must tile the columns" in why for why in TRIMUL.infeasible(refused, DeviceLimits()))


def test_gate_hidden_packs_its_gate_in_hidden_width_and_chunks_divide_h():
    off = weight_offsets(64, 32, True, 32)
    assert off["bg"] - off["wg"] == 64 * 32 and off["total"] - off["bg"] == 32
    assert weight_offsets(64, 32, True) == weight_offsets(64, 32, True, 64)  # the output placement's, as before
    # a chunk width that divides P = 96 but not H = 40: the output placement takes it, the hidden one not
    wide_chunks = [p for p in TRIMUL.feasible_plans("bmm", widths(96, 40), DeviceLimits()) if 40 % p.context["o_cn"]]
    assert wide_chunks
    for plan in wide_chunks[::7]:
        hidden = TRIMUL.plan("bmm", plan.params, {**widths(96, 40), **HIDDEN})
        assert any("H too with the gate in hidden width" in why for why in TRIMUL.infeasible(hidden, DeviceLimits()))
    for plan in TRIMUL.feasible_plans("bmm", {**widths(96, 40), **HIDDEN}, DeviceLimits()):
        assert 40 % plan.context["o_cn"] == 0 and 96 % plan.context["o_cn"] == 0


@pytest.mark.parametrize("options, sizes", [
    (DEFAULT_OPTIONS, ((64, 32),)),
    pytest.param(DEFAULT_OPTIONS, ((40, 24),), marks=pytest.mark.slow),
    pytest.param(OTHER_OPTIONS, ((64, 32), (40, 24)), marks=pytest.mark.slow)], ids=["default", "odd", "out-norm-nobias"])
def test_gate_hidden_compiles_without_spills(options, sizes):
    """The default, its output weights staged in shared memory, the staged triangle sums, sampled
    points of bmm and fused, mma's default and a sampled point in bf16 and tf32x3, and wgmma's in
    bf16, at widths where H < P and (with --slow) where H is not a power of two, whose default
    alone compiles in the fast share (P = H = 128, the hidden preset's widths, compiles in
    test_compile.py); the defaults without spills."""
    plans = [] if len(sizes) > 1 or sizes[0] != (64, 32) else [TRIMUL.default_plan({**widths(40, 24, options), **HIDDEN},
                                                                                  DeviceLimits())]
    for P, H in sizes:
        w = {**widths(P, H, options), **HIDDEN}
        default = TRIMUL.default_plan(w, DeviceLimits())
        plans.append(default)
        staged = TRIMUL.plan("bmm", {**default.params, "o_weights_smem": True}, w)
        if not TRIMUL.infeasible(staged, DeviceLimits()):
            plans.append(staged)
        plans += [p for p in TRIMUL.feasible_plans("fused", w, DeviceLimits()) if p.params["tri_smem"]][:1]
        plans += [p for s in ("bmm", "fused") for p in sampled_plans(TRIMUL, s, w, 1, seed=4)[-1:]]
        for precision in ("bfloat16", "tf32x3"):  # mma: 16-bit operands, and fp32 ones split in three
            view = TRIMUL.at(precision)
            # (H = 24 fits no pass of 16 or more columns: those widths run the reference in 16 bits)
            default = view.default_plan(w, DeviceLimits(arch="sm_80"))  # mma's default
            plans += ([default] if default else []) + sampled_plans(view, "mma", w, 1, seed=4)[-1:]
            if precision == "bfloat16":  # wgmma: its default and a sampled point
                default = view.default_plan(w, DeviceLimits())
                plans += ([default] if default else []) + sampled_plans(view, "wgmma", w, 1, seed=4)[-1:]
    assert any(p.params.get("o_weights_smem") for p in plans)
    if (64, 32) in sizes:  # (H = 24 fits no tensor-core pass)
        assert {p.params.get("o_resident") for p in plans if p.strategy == "mma"} == {True, False}
        assert any(p.strategy == "wgmma" for p in plans)
    rendered = [codegen.render_plan(p) for p in plans]
    results = compiler.compile_many([(r.source, r.kernel_name, ARCH) for r in rendered])
    defaults = {id(p) for p in plans if p.params in [q for _, q in TRIMUL.default_points]}
    assert defaults
    for plan, rend, result in zip(plans, rendered, results):
        assert not isinstance(result, Exception), f"{plan.label} {plan.widths}: {result}"
        assert "sigmoid(out_gate(g))" in rend.source
        if id(plan) in defaults:  # sampled points may spill as the output placement's do (the tuner times them)
            assert (result.spill_bytes, result.stack_bytes) == (0, 0), f"{plan.label} {plan.widths}: {result.summary()}"
