"""The readout spec: the pair-tile ownership the kernels rely on, grids, restrictions, defaults
for every width, the weight layout, the cost model; defaults compile with NVRTC without spills."""
from __future__ import annotations

import itertools

import pytest

from pairgen import runtime
from pairgen.ops.base import DeviceLimits
from pairgen.ops.readout import PROLOGUE_ROWS, PROLOGUE_THREADS, READOUT, prologue_blocks, weight_offsets

LIMITS = DeviceLimits()
PRESET_WIDTHS = [READOUT.widths_of(s) for p in READOUT.presets.values() for s in p]


def owned_pairs(c: dict, n: int):
    """(tile of rows, thread row tm) -> the (i, j) pairs it folds into its running max, computed
    with the kernel's index formulas (_pair_max.cuh.j2), for one batch."""
    ti, tj, threads_m, tm_count = c["tile_i"], c["tile_j"], c["threads_m"], c["tm"]
    owned = {}
    for tile in range(-(-n // ti)):
        i0 = tile * ti
        for tm in range(threads_m):
            pairs = []
            for j0 in range(0, n, tj):
                for r in range(tm_count):
                    m = r * threads_m + tm          # tile_gemm's row of slot r
                    i, j = i0 + m % ti, j0 + m // ti  # the pair staged at row m
                    assert i == i0 + tm % ti, "every pair of a thread row has one node i"
                    assert j == j0 + r * (threads_m // ti) + tm // ti
                    if i < n and j < n:
                        pairs.append((i, j))
            owned[(tile, tm)] = pairs
    return owned


@pytest.mark.parametrize("n", [1, 7, 37, 64])
@pytest.mark.parametrize("strategy", sorted(READOUT.strategies))
def test_each_pair_is_folded_once_into_its_nodes_maximum(n, strategy):
    widths = {"D": 64, "P": 16, "H": 64}
    for plan in READOUT.feasible_plans(strategy, widths, LIMITS)[::7]:
        seen = []
        for (tile, tm), pairs in owned_pairs(plan.context, n).items():
            seen += pairs
        assert sorted(seen) == [(i, j) for i in range(n) for j in range(n)], plan.label


def test_grid_is_one_block_per_tile_of_rows():
    plan = READOUT.plan(*READOUT.default_points[0], PRESET_WIDTHS[-1])
    ti = plan.params["tile_i"]
    for B, N in [(1, 1), (3, 7), (16, 128), (2, 37)]:
        assert plan.grid(B, N, 132, 1) == (B * -(-N // ti), B * -(-N // ti))


@pytest.mark.parametrize("rows, H", [(1, 8), (96, 192), (2048, 512), (37, 24)])
def test_prologue_grid_covers_every_node_and_column(rows, H):
    blocks = prologue_blocks(rows, H)
    col_blocks = -(-2 * H // (4 * PROLOGUE_THREADS))
    covered = set()
    for block in range(blocks):  # the kernel's decomposition of blockIdx.x
        row0 = (block // col_blocks) * PROLOGUE_ROWS
        for t in range(PROLOGUE_THREADS):
            col = ((block % col_blocks) * PROLOGUE_THREADS + t) * 4
            if col < 2 * H:
                covered |= {(row0 + r, col + e) for r in range(PROLOGUE_ROWS) if row0 + r < rows for e in range(4)}
    assert covered == set(itertools.product(range(rows), range(2 * H)))


def test_restrictions_prune_impossible_points():
    widths = PRESET_WIDTHS[-1]  # D256 P64 H512
    big = READOUT.plan("direct", {"tile_i": 8, "tile_j": 32, "threads": 128, "threads_n": 8, "tn": 8, "unroll": 2,
                                  "weights_smem": True}, widths)
    assert "shared memory exceeds the per-block limit" in READOUT.infeasible(big, LIMITS)
    seed_cols = READOUT.plan("split", {"tile_i": 2, "tile_j": 16, "threads": 128, "threads_n": 16, "tn": 4,
                                       "unroll": 2, "weights_smem": False}, PRESET_WIDTHS[0])
    assert any("must divide D and H" in r for r in READOUT.infeasible(seed_cols, LIMITS))  # 64 columns, D = 96
    layout = READOUT.plan("split", {"tile_i": 8, "tile_j": 8, "threads": 256, "threads_n": 2, "tn": 4,
                                    "unroll": 2, "weights_smem": False}, widths)
    assert any("thread layout" in r or "rows that divide" in r for r in READOUT.infeasible(layout, LIMITS))
    for w in PRESET_WIDTHS:
        for strategy in READOUT.strategies:
            feasible = READOUT.feasible_plans(strategy, w, LIMITS)
            assert feasible, f"{strategy} has no feasible point at {w}"
            for plan in feasible:
                c = plan.context
                assert c["tm"] * c["threads_m"] == c["tile_pairs"] and c["threads_m"] % c["tile_i"] == 0
                assert w["D"] % c["cols"] == 0 and w["H"] % c["cols"] == 0
                assert plan.smem_bytes <= LIMITS.max_smem_per_block


def test_search_space_is_modest():
    for strategy in READOUT.strategies:
        assert 100 <= len(list(READOUT.points(strategy))) <= 1000


@pytest.mark.parametrize("widths", [{"D": 8, "P": 8, "H": 8}, {"D": 24, "P": 40, "H": 56}, {"D": 96, "P": 16, "H": 192},
                                    {"D": 512, "P": 512, "H": 512}, {"D": 248, "P": 8, "H": 232}])
def test_a_default_fits_any_widths_that_are_multiples_of_8(widths):
    plan = READOUT.default_plan(widths, LIMITS)
    assert plan is not None and not READOUT.infeasible(plan, LIMITS)


def test_widths_without_a_kernel_are_the_known_gap():
    """D and H whose only common column count is 8 need 64 thread rows (threads_n = 2 of 128
    threads), whose running maxima and hidden tile outgrow shared memory past ~400 channels:
    those widths run the reference (the module falls back when default_plan is None)."""
    assert READOUT.default_plan({"D": 504, "P": 8, "H": 496}, LIMITS) is None


def test_presets_get_the_intended_defaults():
    seed, *real = PRESET_WIDTHS
    assert READOUT.default_plan(seed, LIMITS).params == READOUT.default_points[1][1]
    for w in real:
        assert READOUT.default_plan(w, LIMITS).params == READOUT.default_points[0][1]


def test_weight_offsets_are_aligned_and_disjoint():
    D, P, H = 24, 8, 40
    off = weight_offsets(D, P, H)
    names = ["wuvt", "wpt", "b1", "w2t", "b2", "gamma", "beta"]
    sizes = [D * 2 * H, P * H, H, H * D, D, D, D]
    for k, (name, size) in enumerate(zip(names, sizes)):
        assert off[name] % 4 == 0
        end = off[names[k + 1]] if k + 1 < len(names) else off["total"]
        assert off[name] + size <= end


def test_split_stages_only_what_its_main_kernel_reads():
    w = PRESET_WIDTHS[0]
    params = {"tile_i": 2, "tile_j": 16, "threads": 128, "threads_n": 8, "tn": 4, "unroll": 2, "weights_smem": True}
    split, direct = READOUT.plan("split", params, w), READOUT.plan("direct", params, w)
    off = weight_offsets(w["D"], w["P"], w["H"])
    assert split.context["smem_first"] == off["wpt"] and direct.context["smem_first"] == 0
    node_rows = (params["tile_i"] + params["tile_j"]) * direct.context["d_stride"]
    assert direct.smem_bytes - split.smem_bytes == 4 * (off["wpt"] + node_rows)


def test_cost_model():
    shape = {"B": 16, "N": 128, "D": 256, "P": 64, "H": 512}
    cost = READOUT.cost(shape)
    pairs = 16 * 128 * 128
    assert cost.flops == pytest.approx(pairs * 2 * ((2 * 256 + 64) * 512 + 512 * 256), rel=0.01)
    assert cost.flops / 51.3e12 * 1e6 == pytest.approx(4355, rel=0.01), "MEASURE.md's floor for this shape"
    assert cost.bytes >= 4 * pairs * 64


@pytest.mark.parametrize("widths", PRESET_WIDTHS, ids=lambda w: "D{D}P{P}H{H}".format(**w))
def test_default_variants_compile_without_spills(widths):
    for strategy, params in READOUT.default_points:
        plan = READOUT.plan(strategy, params, widths)
        if READOUT.infeasible(plan, LIMITS):
            continue
        result = runtime.build_variant(plan, "sm_90").compiled
        assert result.spill_bytes == 0 and result.stack_bytes == 0, f"{plan.label}: {result.summary()}"
        assert result.compile_s < 20 or result.from_cache
        source = runtime.render_plan(plan).source
        assert f"{plan.strategy == 'split' and 'pairgen_readout_split_nodes' or 'pairgen_readout_direct'}" in source
