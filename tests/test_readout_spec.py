"""The readout spec: the pair-tile ownership the kernels rely on (j splits included), grids and
scratch, restrictions, defaults for every width, the weight layout, the cost model; defaults and
j-split variants compile with NVRTC without spills."""
from __future__ import annotations

import itertools

import pytest
import torch

from helpers import compile_plans, compiled_variant
from pairgen import runtime
from pairgen.ops.base import DeviceLimits
from pairgen.ops.readout import (PROLOGUE_ROWS, PROLOGUE_THREADS, READOUT, PairReadout, prologue_blocks,
                                 split_scratch_floats, weight_offsets)

LIMITS = DeviceLimits()
PRESET_WIDTHS = [READOUT.widths_of(s) for p in READOUT.presets.values() for s in p]


def split_of_block(block: int, j_split: int) -> tuple[int, int]:
    """The kernel's (tile, split) of blockIdx.x (_pair_max.cuh.j2)."""
    return block // j_split, block % j_split


def j_tiles_of_split(split: int, j_split: int, tile_j: int, n: int) -> list[int]:
    """The first partner j0 of each j tile that split `split` walks (the kernel's j0 loop)."""
    return list(range(split * tile_j, n, j_split * tile_j))


def owned_pairs(c: dict, n: int):
    """(tile of rows, split, thread row tm) -> the (i, j) pairs it folds into its running max,
    computed with the kernel's index formulas (_pair_max.cuh.j2), for one batch."""
    ti, tj, threads_m, tm_count, js = c["tile_i"], c["tile_j"], c["threads_m"], c["tm"], c["j_split"]
    owned = {}
    for block in range(-(-n // ti) * js):
        tile, split = split_of_block(block, js)
        i0 = tile * ti
        for tm in range(threads_m):
            pairs = []
            for j0 in j_tiles_of_split(split, js, tj, n):
                for r in range(tm_count):
                    m = r * threads_m + tm          # tile_gemm's row of slot r
                    i, j = i0 + m % ti, j0 + m // ti  # the pair staged at row m
                    assert i == i0 + tm % ti, "every pair of a thread row has one node i"
                    assert j == j0 + r * (threads_m // ti) + tm // ti
                    if i < n and j < n:
                        pairs.append((i, j))
            owned[(tile, split, tm)] = pairs
    return owned


@pytest.mark.parametrize("n", [1, 7, 37, 64])
@pytest.mark.parametrize("strategy", sorted(READOUT.strategies))
def test_each_pair_is_folded_once_into_its_nodes_maximum(n, strategy):
    widths = {"D": 64, "P": 16, "H": 64}
    plans = READOUT.feasible_plans(strategy, widths, LIMITS)
    assert {p.params["j_split"] for p in plans[::7]} == set(READOUT.strategies[strategy].space["j_split"])
    for plan in plans[::7]:
        seen = []
        for (tile, split, tm), pairs in owned_pairs(plan.context, n).items():
            seen += pairs
        assert sorted(seen) == [(i, j) for i in range(n) for j in range(n)], plan.label


@pytest.mark.parametrize("n, tile_j, j_split", [(24, 8, 3), (37, 8, 3), (37, 16, 4), (1, 8, 8), (123, 32, 6)])
def test_j_tiles_are_dealt_round_robin_over_the_splits(n, tile_j, j_split):
    """Every j tile goes to exactly one split; shares differ by at most one tile, so the longest is
    ceil(N / (TILE_J * J_SPLIT)) tiles; splits past the last j tile get none (and still combine)."""
    shares = [j_tiles_of_split(s, j_split, tile_j, n) for s in range(j_split)]
    assert sorted(j0 for share in shares for j0 in share) == list(range(0, n, tile_j))
    lengths = [len(share) for share in shares]
    assert max(lengths) == -(-n // (tile_j * j_split)) and max(lengths) - min(lengths) <= 1
    assert lengths.count(0) == max(0, j_split - -(-n // tile_j))


def test_grid_is_j_split_blocks_per_tile_of_rows():
    widths = PRESET_WIDTHS[-1]
    point = READOUT.default_points[0][1]
    for j_split in READOUT.strategies["split"].space["j_split"]:
        plan = READOUT.plan("split", dict(point, j_split=j_split), widths)
        ti = plan.params["tile_i"]
        for B, N in [(1, 1), (3, 7), (16, 128), (2, 37)]:
            tiles = B * -(-N // ti)
            assert plan.grid(B, N, 132, 1) == (tiles * j_split, tiles), plan.label
            blocks = [split_of_block(k, j_split) for k in range(tiles * j_split)]
            assert sorted(blocks) == [(t, s) for t in range(tiles) for s in range(j_split)]


@pytest.mark.parametrize("B, N, D, j_split", [(4, 24, 96, 1), (4, 24, 96, 3), (1, 1, 8, 8), (16, 128, 256, 2)])
def test_split_scratch_holds_partials_then_flags(B, N, D, j_split):
    """_pool.cuh.j2: B*N*J_SPLIT partial rows of D floats, then one int flag per (node, split);
    nothing without a split (J_SPLIT == 1 takes no scratch and no counters)."""
    expected = 0 if j_split == 1 else B * N * j_split * D + B * N * j_split
    assert split_scratch_floats(B, N, D, j_split) == expected
    assert (B * N * j_split * D) % 4 == 0, "the flags start 16-byte aligned (D % 4 == 0)"


def test_j_split_adds_no_shared_memory():
    """The partials go to global scratch and the "last block" answer travels by __syncthreads_or:
    shared memory and the __launch_bounds__ minimum do not depend on j_split."""
    for widths in PRESET_WIDTHS:
        for strategy, params in READOUT.default_points:
            plans = [READOUT.plan(strategy, dict(params, j_split=js), widths)
                     for js in READOUT.strategies[strategy].space["j_split"]]
            assert len({(p.smem_bytes, p.context["min_blocks"]) for p in plans}) == 1


def test_points_recorded_before_j_split_mean_one_block_per_tile():
    """Tuned entries and studies from before j_split existed leave it out: they plan as j_split = 1,
    the kernel they were timed on."""
    old = {"tile_i": 2, "tile_j": 32, "threads": 128, "threads_n": 8, "tn": 4, "unroll": 4, "weights_smem": True}
    plan = READOUT.plan("split", old, PRESET_WIDTHS[0])
    assert plan.params == dict(old, j_split=1) and plan.context["j_split"] == 1
    with pytest.raises(ValueError, match="j_split"):
        READOUT.plan("split", dict(old, j_split=5), PRESET_WIDTHS[0])


def test_small_pair_tiles_with_weights_through_the_cache_exist_for_every_j_split():
    """What a j split favours (tiles of 8 or 16 partners, weights read through the cache) is in the
    space and fits at every preset width, for every split count."""
    for widths in PRESET_WIDTHS:
        for strategy in READOUT.strategies:
            feasible = {(p.params["tile_j"], p.params["weights_smem"], p.params["j_split"])
                        for p in READOUT.feasible_plans(strategy, widths, LIMITS)}
            for tile_j in (8, 16):
                for j_split in READOUT.strategies[strategy].space["j_split"]:
                    assert (tile_j, False, j_split) in feasible, (strategy, widths, tile_j, j_split)


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
    """At most 1000 points per j_split value (the tile shapes and thread layouts), before pruning."""
    for strategy in READOUT.strategies:
        splits = len(READOUT.strategies[strategy].space["j_split"])
        assert 100 * splits <= len(list(READOUT.points(strategy))) <= 1000 * splits


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


# Seed widths: the j-split points the tuner is expected to favour there (tiles of 8 or 16
# partners, weights through the cache or staged), and one point per real width.
J_SPLIT_COMPILE_POINTS = [
    ("split", {"tile_i": 2, "tile_j": 8, "threads": 128, "threads_n": 8, "tn": 4, "unroll": 4, "weights_smem": False,
               "j_split": 3}, PRESET_WIDTHS[0]),
    ("split", {"tile_i": 2, "tile_j": 8, "threads": 128, "threads_n": 8, "tn": 4, "unroll": 4, "weights_smem": True,
               "j_split": 3}, PRESET_WIDTHS[0]),
    ("split", {"tile_i": 4, "tile_j": 16, "threads": 128, "threads_n": 8, "tn": 4, "unroll": 2, "weights_smem": False,
               "j_split": 2}, PRESET_WIDTHS[0]),
    ("direct", {"tile_i": 2, "tile_j": 8, "threads": 128, "threads_n": 8, "tn": 4, "unroll": 4, "weights_smem": False,
                "j_split": 8}, PRESET_WIDTHS[0]),
    ("split", {"tile_i": 4, "tile_j": 16, "threads": 256, "threads_n": 8, "tn": 8, "unroll": 4, "weights_smem": False,
               "j_split": 4}, PRESET_WIDTHS[1]),
    ("split", {"tile_i": 4, "tile_j": 16, "threads": 256, "threads_n": 8, "tn": 8, "unroll": 4, "weights_smem": False,
               "j_split": 2}, PRESET_WIDTHS[2]),
]


def test_j_split_variants_compile_without_spills():
    plans = [READOUT.plan(strategy, params, widths) for strategy, params, widths in J_SPLIT_COMPILE_POINTS]
    assert not [READOUT.infeasible(p, LIMITS) for p in plans if READOUT.infeasible(p, LIMITS)]
    variants = compile_plans(plans)
    for plan in plans:
        result = compiled_variant(variants, plan).compiled
        assert result.spill_bytes == 0 and result.stack_bytes == 0, f"{plan.label} {plan.widths}: {result.summary()}"


def test_tile_counters_grow_and_keep_the_buffers_they_replace():
    """The j split's arrival counters: zeroed, owned by the module, reused while large enough, grown
    (at least doubled) for a larger grid; a replaced buffer stays alive for a graph that captured it."""
    module = PairReadout(8, 8, 8)
    cpu = torch.device("cpu")
    first = module._tile_counters(cpu, 10)
    index, live, retired = module._counters
    assert live.numel() == PairReadout.MIN_COUNTERS and first == live.data_ptr() and not live.any()
    assert module._tile_counters(cpu, PairReadout.MIN_COUNTERS) == first, "large enough: reused"
    grown = module._tile_counters(cpu, PairReadout.MIN_COUNTERS + 1)
    _, bigger, retired = module._counters
    assert grown == bigger.data_ptr() != first and bigger.numel() == 2 * PairReadout.MIN_COUNTERS
    assert any(t.data_ptr() == first for t in retired), "the replaced buffer is kept"
    assert not bigger.any()
