"""The contact spec: grids cover every pair, restrictions prune what cannot run, cost model."""
from __future__ import annotations

import pytest

from helpers import main_grid
from pairgen.spec import DeviceLimits
from pairgen.ops.contact import CONTACT, weight_offsets


def symmetric_pairs(n, side):
    """The pairs (i, j) that symmetric tiles compute, enumerated like the kernel (row-major
    upper triangle of the block grid, i <= j inside diagonal blocks)."""
    nb = -(-n // side)
    pairs = []
    for bi in range(nb):
        for bj in range(bi, nb):
            for m in range(side * side):
                i, j = bi * side + m // side, bj * side + m % side
                if i < n and j < n and i <= j:
                    pairs.append((i, j))
    return pairs, nb * (nb + 1) // 2


@pytest.mark.parametrize("n", [1, 7, 8, 37, 64, 123])
@pytest.mark.parametrize("side", [4, 8, 16])
def test_symmetric_tiles_cover_each_pair_once(n, side):
    pairs, tiles = symmetric_pairs(n, side)
    assert len(pairs) == len(set(pairs)) == n * (n + 1) // 2
    plan = CONTACT.plan("symmetric_tiled", {"tile_side": side, "threads": 256, "tn": 8, "unroll": 2, "ln_rows": 4,
                                            "weights_smem": False, "blocks_per_sm": 0, "stage_rows": 1}, {"P": 64, "H": 32})
    assert main_grid(plan, 3, n, 132, 4) == (3 * tiles, 3 * tiles)


def test_grids():
    widths = {"P": 64, "H": 32}
    tpp = CONTACT.plan("thread_per_pair", {"threads": 128, "chunk": 4, "weights_smem": False, "symmetric": True}, widths)
    assert main_grid(tpp, 2, 37, 132, 4) == (-(-2 * 37 * 38 // 2 // 128), 2 * 37 * 38 // 2)
    tiled = CONTACT.plan("tiled", {"tile_rows": 64, "threads": 256, "tn": 8, "unroll": 2, "ln_rows": 4,
                                   "weights_smem": False, "blocks_per_sm": 2, "stage_rows": 2}, widths)
    tiles = -(-3 * 123 * 123 // 64)
    assert main_grid(tiled, 3, 123, 132, 4) == (2 * 132, tiles)  # persistent: 2 per SM
    assert main_grid(tiled, 3, 123, 132, 1) == (132, tiles)      # clamped to what is resident
    assert main_grid(tiled, 1, 7, 132, 4) == (1, 1)


def test_restrictions_prune_impossible_points():
    limits = DeviceLimits()
    big = CONTACT.plan("thread_per_pair", {"threads": 256, "chunk": 16, "weights_smem": True, "symmetric": True},
                       {"P": 256, "H": 256})
    assert "shared memory exceeds the per-block limit" in CONTACT.infeasible(big, limits)
    odd = CONTACT.plan("tiled", {"tile_rows": 32, "threads": 64, "tn": 8, "unroll": 1, "ln_rows": 2,
                                 "weights_smem": False, "blocks_per_sm": 0, "stage_rows": 1}, {"P": 64, "H": 24})
    assert any("power of two" in r for r in CONTACT.infeasible(odd, limits))
    feasible = CONTACT.feasible_plans("symmetric_tiled", {"P": 128, "H": 128}, limits)
    assert feasible, "the real widths must have feasible tiled points"
    assert len(feasible) < len(list(CONTACT.points("symmetric_tiled"))), "some points must be pruned"
    for plan in feasible:
        c = plan.context
        assert c["threads_m"] * c["tm"] == c["tile_rows"] and c["threads_m"] * c["threads_n"] == plan.threads
        assert plan.smem_bytes <= limits.max_smem_per_block


def test_defaults_are_feasible_for_the_shapes_we_ship():
    for preset in CONTACT.presets.values():
        for shape in preset:
            plan = CONTACT.default_plan(CONTACT.widths_of(shape), DeviceLimits())
            assert plan is not None and plan.strategy == CONTACT.default_points[0][0]


def test_weight_offsets_are_aligned_and_disjoint():
    off = weight_offsets(64, 24)
    names = ["w1t", "b1", "w2t", "b2", "w3", "b3", "gamma", "beta"]
    sizes = [64 * 24, 24, 24 * 24, 24, 24, 1, 64, 64]
    for k, (name, size) in enumerate(zip(names, sizes)):
        assert off[name] % 4 == 0
        end = off[names[k + 1]] if k + 1 < len(names) else off["total"]
        assert off[name] + size <= end


def test_cost_model():
    cost = CONTACT.cost({"B": 1, "N": 512, "P": 128, "H": 128})
    assert cost.flops == pytest.approx(512 * 512 * (2 * (128 * 128 * 2 + 128) + 1280))
    assert cost.bytes >= 512 * 512 * 128 * 4


def test_staged_rows_take_shared_memory_and_prefetch_needs_a_persistent_grid():
    widths, limits = {"P": 64, "H": 32}, DeviceLimits()
    point = {"tile_rows": 32, "threads": 128, "tn": 4, "unroll": 2, "ln_rows": 2, "weights_smem": True,
             "blocks_per_sm": 0}
    smem = {s: CONTACT.plan("tiled", {**point, "stage_rows": s}, widths).smem_bytes for s in (0, 1, 2)}
    one_tile = 4 * 2 * 32 * 64  # both orientations of 32 rows of 64 floats
    assert smem[1] - smem[0] == one_tile and smem[2] - smem[0] == 2 * one_tile
    prefetch = CONTACT.plan("tiled", {**point, "stage_rows": 2}, widths)
    assert any("persistent" in r for r in CONTACT.infeasible(prefetch, limits))
    persistent = CONTACT.plan("tiled", {**point, "stage_rows": 2, "blocks_per_sm": 2}, widths)
    assert CONTACT.infeasible(persistent, limits) == []
