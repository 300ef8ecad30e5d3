"""The readout spec: the pair-tile ownership the kernels rely on (j splits included), grids and
scratch, restrictions, defaults for every width, the weight layout, the cost model; defaults and
j-split variants compile with NVRTC without spills. The node prologue (split and gemm): its
blocks cover every node row and column once over all of k, and it compiles without spills. The gemm strategy: hidden tiles and pool
warps cover every pair and node once, its scratch, shared memory, defaults, TF32 switched off
around its matmul, tf32x3's split product (TF32 rounding, W2's split); its variants compile
without spills."""
from __future__ import annotations

import itertools
import math
import re

import pytest
import torch

from helpers import compile_plans, compiled_variant, feasible_plans, main_grid
from pairgen import codegen, runtime
from pairgen.module.modes import fp32_matmul
from pairgen.spec import DeviceLimits, kernel_name
from pairgen.ops.readout import (GEMM_SCRATCH_ALIGN, PROLOGUE_COLS, PROLOGUE_THREADS, READOUT, PairReadout,
                                 gemm_scratch_offsets, pair_max_scratch, prologue_blocks, split_scratch_floats,
                                 weight_offsets)
from pack_oracles import split_w2t
from pairgen.ops.packing import tf32_rounded
from pairgen.ops.readout.strategies.gemm import gemm_pool_blocks, gemm_pool_smem, hidden_layout

LIMITS = DeviceLimits()
#: The gemm strategy's default points: the exact first (every preset width), tf32x3's with the
#: product on TF32 tensor cores, the general one (any D, P, H multiple of 8).
GEMM_FIRST, GEMM_SPLIT, GEMM_GENERAL = (params for strategy, params in READOUT.default_points if strategy == "gemm")
PRESET_WIDTHS = [READOUT.widths_of(s) for p in READOUT.presets.values() for s in p]
PAIR_MAX = ("direct", "split")  # the strategies of _pair_max.cuh.j2 (tiles of rows i, j splits)


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


@pytest.mark.parametrize("n", [1, 7, 37, pytest.param(64, marks=pytest.mark.slow)])  # 37: tiles cut at N
@pytest.mark.parametrize("strategy", PAIR_MAX)
def test_each_pair_is_folded_once_into_its_nodes_maximum(n, strategy):
    widths = {"D": 64, "P": 16, "H": 64}
    plans = feasible_plans(READOUT, strategy, widths, LIMITS)
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
            assert main_grid(plan, B, N, 132, 1) == (tiles * j_split, tiles), plan.label
            blocks = [split_of_block(k, j_split) for k in range(tiles * j_split)]
            assert sorted(blocks) == [(t, s) for t in range(tiles) for s in range(j_split)]


def test_fused_grid_is_the_prologue_blocks_then_splits_pair_blocks():
    """One launch holds both of split's grids: the prologue kernel's blocks first (the producers of
    common/block_roles.cuh), then the pair-max kernel's, with split's shape arguments."""
    widths = PRESET_WIDTHS[0]
    point = next(p for s, p in READOUT.default_points if s == "fused")
    for prologue_rows in READOUT.strategies["fused"].space["prologue_rows"]:
        fused = READOUT.plan("fused", dict(point, prologue_rows=prologue_rows), widths)
        split = READOUT.plan("split", dict(point, prologue_rows=prologue_rows), widths)
        assert len(fused.kernels) == 1 and fused.main.mode == "cooperative_or_plain"
        for B, N in [(1, 1), (4, 24), (3, 37), (48, 61)]:
            pair_blocks, pair_tail = split.main.grid(B, N, 132, 2)
            prologue, _ = split.kernels[1].grid(B, N, 132, 2)
            assert prologue == -(-B * N // prologue_rows) * -(-2 * widths["H"] // 128)
            assert fused.main.grid(B, N, 132, 2) == (prologue + pair_blocks, pair_tail)


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
        for strategy, params in (point for point in READOUT.default_points if point[0] in PAIR_MAX):
            plans = [READOUT.plan(strategy, dict(params, j_split=js), widths)
                     for js in READOUT.strategies[strategy].space["j_split"]]
            assert len({(p.smem_bytes, p.context["min_blocks"]) for p in plans}) == 1


def test_points_recorded_before_j_split_mean_one_block_per_tile():
    """Tuned entries and studies from before j_split (and prologue_rows) existed leave them out: they
    plan as j_split = 1 and 8 prologue rows, the kernels they were timed on."""
    old = {"tile_i": 2, "tile_j": 32, "threads": 128, "threads_n": 8, "tn": 4, "unroll": 4, "weights_smem": True}
    plan = READOUT.plan("split", old, PRESET_WIDTHS[0])
    assert plan.params == dict(old, j_split=1, prologue_rows=8) and plan.context["j_split"] == 1
    assert plan.context["prologue_rows"] == 8
    with pytest.raises(ValueError, match="j_split"):
        READOUT.plan("split", dict(old, j_split=5), PRESET_WIDTHS[0])


def test_small_pair_tiles_with_weights_through_the_cache_exist_for_every_j_split():
    """What a j split favours (tiles of 8 or 16 partners, weights read through the cache) is in the
    space and fits at every preset width, for every split count."""
    for widths in PRESET_WIDTHS:
        for strategy in PAIR_MAX:
            # the feasible plans' (tile_j, weights_smem, j_split), of the points that can be one of those asked for
            plans = (READOUT.plan(strategy, point, widths) for point in READOUT.points(strategy)
                     if point["tile_j"] in (8, 16) and not point["weights_smem"])
            feasible = {(p.params["tile_j"], p.params["weights_smem"], p.params["j_split"])
                        for p in plans if not READOUT.infeasible(p, LIMITS)}
            for tile_j in (8, 16):
                for j_split in READOUT.strategies[strategy].space["j_split"]:
                    assert (tile_j, False, j_split) in feasible, (strategy, widths, tile_j, j_split)


def _prologue_constants(prologue_rows: int, D: int, H: int) -> dict:
    """PRO_COLS and PRO_CHUNK as the rendered prologue (_nodes.cuh.j2) defines them."""
    plan = READOUT.plan("split", dict(READOUT.default_points[3][1], prologue_rows=prologue_rows), {"D": D, "P": 8, "H": H})
    source = codegen.render_plan(plan).source
    return {name: int(re.search(rf"constexpr int {name} = (\d+);", source).group(1)) for name in ("PRO_COLS", "PRO_CHUNK")}


def prologue_k_steps(warp: int, D: int, chunk: int) -> list[int]:
    """The k-steps warp `warp` folds, in the kernel's order: its slice [warp*D/4, (warp+1)*D/4) as a
    first chunk, whole chunks, then a tail (FIRST, FULL, TAIL in _nodes.cuh.j2)."""
    k_slice = D // (PROLOGUE_THREADS // 32)
    first = min(k_slice, chunk)
    full, tail = divmod(k_slice - first, chunk)
    starts = [0] + [first + c * chunk for c in range(full)] + ([first + full * chunk] if tail else [])
    sizes = [first] + [chunk] * full + ([tail] if tail else [])
    assert all(size % (4 if k_slice % 4 == 0 else 2 if k_slice % 2 == 0 else 1) == 0 for size in sizes), \
        "every chunk holds whole x vectors"
    return [warp * k_slice + start + s for start, size in zip(starts, sizes) for s in range(size)]


@pytest.mark.parametrize("prologue_rows", [2, 8])
@pytest.mark.parametrize("rows, D, H", [(1, 8, 8), (7, 24, 8), (37, 40, 56), (96, 96, 192), (111, 504, 496),
                                        pytest.param(2048, 256, 512, marks=pytest.mark.slow)])
def test_prologue_blocks_write_every_node_and_column_once_over_all_of_k(rows, D, H, prologue_rows):
    """The prologue's decomposition of blockIdx.x, threadIdx.x (_nodes.cuh.j2), simulated: the 4
    warps of a block fold disjoint k-slices that together are all of D (any D multiple of 8: a
    slice of 2 k-steps at D = 8, chunks and a tail at D = 504); weight loads stay inside their
    [D][2H] rows (lanes past 2H read the last float4); every (row, column) of uv is written once,
    by the thread whose lane holds those columns, and nothing past `rows` or 2H."""
    constants = _prologue_constants(prologue_rows, D, H)
    assert constants["PRO_COLS"] == PROLOGUE_COLS == 4 * 32
    warps, uv_cols = PROLOGUE_THREADS // 32, 2 * H
    col_blocks = -(-uv_cols // PROLOGUE_COLS)
    ks = [prologue_k_steps(w, D, constants["PRO_CHUNK"]) for w in range(warps)]
    assert sorted(k for steps in ks for k in steps) == list(range(D)), "the slices are all of k, once"
    written = []
    for block in range(prologue_blocks(rows, H, prologue_rows)):
        row0 = (block // col_blocks) * prologue_rows
        for t in range(PROLOGUE_THREADS):
            warp, lane = divmod(t, 32)
            col = (block % col_blocks) * PROLOGUE_COLS + 4 * lane
            load_col = col if col < uv_cols else uv_cols - 4
            assert 0 <= load_col and load_col + 4 <= uv_cols
            for r in range(warp, prologue_rows, warps):  # the finish: rows warp, warp + 4, ...
                if row0 + r < rows and col < uv_cols:
                    written += [(row0 + r, col + e) for e in range(4)]
    assert len(written) == len(set(written)) == rows * uv_cols
    assert set(written) == set(itertools.product(range(rows), range(uv_cols)))


def test_prologue_blocks_at_the_seed_shape():
    """B4 N24 D96 H192: 2H = 384 is 3 blocks of 128 columns; 96 rows in 48 or 12 row blocks."""
    assert prologue_blocks(96, 192, 2) == 144 and prologue_blocks(96, 192, 8) == 36
    assert prologue_blocks(1, 8) == 1 and prologue_blocks(9, 496) == 2 * 8


#: Widths for the prologue's compile check: the presets, D = 504 H = 496 (only gemm fits; 126-step
#: slices, a tail), and small ones (slices of 2 and 6 k-steps, 2H below a block's 128 columns).
#: D = 12 (gemm only: no split tile divides it): 3-step slices, x read one float at a time.
PROLOGUE_WIDTHS = PRESET_WIDTHS + [{"D": 504, "P": 8, "H": 496}, {"D": 8, "P": 8, "H": 8}, {"D": 24, "P": 8, "H": 8},
                                   {"D": 40, "P": 16, "H": 56}, {"D": 12, "P": 8, "H": 8}]


def prologue_plans() -> list:
    """gemm (PROLOGUE_ROWS) and split (prologue_rows 2 and 8) at every PROLOGUE_WIDTHS, feasible or not."""
    split, gemm = READOUT.default_points[3][1], GEMM_GENERAL
    plans = [READOUT.plan("gemm", gemm, w) for w in PROLOGUE_WIDTHS]
    return plans + [READOUT.plan("split", dict(split, prologue_rows=rows), w) for w in PROLOGUE_WIDTHS for rows in (2, 8)]


@pytest.mark.slow
def test_prologue_compiles_without_spills_at_every_rows_value():
    """The node prologue of split (prologue_rows 2 and 8) and gemm (PROLOGUE_ROWS) keeps its
    accumulators and a chunk of weight float4s in registers: no spill, no stack."""
    plans = prologue_plans()
    infeasible = [p for p in plans if READOUT.infeasible(p, LIMITS)]
    # split at D = 504: its tiles outgrow shared memory; at D = 12: no column count divides D
    assert {(p.strategy, p.widths["D"]) for p in infeasible} == {("split", 504), ("split", 12)}
    plans = [p for p in plans if p not in infeasible]
    variants = compile_plans(plans)
    for plan in plans:
        nodes = compiled_variant(variants, plan).compiled.kernels[f"{variant_name(plan)}_nodes"]
        assert nodes["spill_bytes"] == 0 and nodes["stack_bytes"] == 0, (plan.label, plan.widths, nodes)


def _prologue_gpu_plans():
    return [pytest.param(p, id="D{D}P{P}H{H}-".format_map(p.widths) + p.label) for p in prologue_plans()
            if not READOUT.infeasible(p, LIMITS)]


@pytest.mark.gpu
@pytest.mark.parametrize("plan", _prologue_gpu_plans())
def test_prologue_alone_matches_float64_and_writes_nothing_past_its_rows(plan):
    """GPU (the CPU suite skips it): the prologue kernel alone, launched as the module launches it,
    against [nodes W_i^T + b1 | nodes W_j^T] in float64, at row counts that leave a row block part
    full (1, 7, 111, 250). uv sits in a NaN-filled buffer one guard row longer: an output it left
    unwritten stays NaN, and the guard row must stay NaN. Then, for widths up to D = 40, the whole
    op against the float64 reference at the odd shapes (the split and gemm strategies' other
    kernels on top of it): slices of 2, 3 and 6 k-steps, 2H below one block of 128 columns."""
    from helpers import ODD_SHAPES, assert_variant_matches_float64, generator

    D, H = plan.widths["D"], plan.widths["H"]
    variant = runtime.build_variant(plan)
    gen = generator(61)
    module = READOUT.make_module(plan.widths, gen).cuda()
    w1, b1 = module.fuse[0].weight.double(), module.fuse[0].bias.double()
    packed = module.packed_weights()  # made per call: held while the kernels read it
    weights = packed.data_ptr()
    for rows in (1, 7, 111, 250):
        nodes = torch.randn((rows, D), generator=gen).cuda()
        buffer = torch.full(((rows + 1) * 2 * H,), float("nan"), device="cuda")
        prologue = next(launch for launch, kernel in zip(variant.launches(0, 1, rows), plan.kernels)
                        if kernel.name.endswith("_nodes"))  # as the module binds it: B*N = rows
        prologue.named(nodes=nodes.data_ptr(), wpack=weights, uv=buffer.data_ptr())
        torch.cuda.synchronize()
        x = nodes.double()
        want = torch.cat([x @ w1[:, :D].T + b1, x @ w1[:, D:2 * D].T], dim=1)
        got = buffer[: rows * 2 * H].view(rows, 2 * H)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=lambda m: f"rows={rows}: {m}")
        assert torch.isnan(buffer[rows * 2 * H:]).all(), f"rows={rows}: wrote past the last row"
    if D <= 40:
        assert_variant_matches_float64(READOUT, plan, variant, ODD_SHAPES)


@pytest.mark.parametrize("widths", [PRESET_WIDTHS[0], PRESET_WIDTHS[-1]] + [
    pytest.param(w, marks=pytest.mark.slow) for w in PRESET_WIDTHS[1:-1]], ids=lambda w: "D{D}P{P}H{H}".format(**w))
def test_every_feasible_pair_max_point_has_a_consistent_layout(widths):
    """Every feasible point of the pair-max strategies: tiles split into the threads' rows, columns
    dividing D and H, shared memory within the limit (the seed's and the largest widths; the others
    with --slow)."""
    for strategy in PAIR_MAX:
        feasible = feasible_plans(READOUT, strategy, widths, LIMITS)
        assert feasible, f"{strategy} has no feasible point at {widths}"
        for plan in feasible:
            c = plan.context
            assert c["tm"] * c["threads_m"] == c["tile_pairs"] and c["threads_m"] % c["tile_i"] == 0
            assert widths["D"] % c["cols"] == 0 and widths["H"] % c["cols"] == 0
            assert plan.smem_bytes <= LIMITS.max_smem_per_block


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


def test_search_space_is_modest():
    """At most 2560 points per j_split value (and split's prologue_rows value: the tile shapes and
    thread layouts; exactly 2560 since threads 192/384 and threads_n 24), before pruning; gemm: at
    most 1000 hidden-kernel points per pool-kernel shape (12 of them). The tuner enumerates every
    point of a study (1.6 s for all strategies at the seed widths, on this session's CPU)."""
    for strategy in PAIR_MAX:
        space = READOUT.strategies[strategy].space
        splits = len(space["j_split"]) * len(space.get("prologue_rows", (8,)))
        assert 100 * splits <= len(list(READOUT.points(strategy))) <= 2560 * splits
    space = READOUT.strategies["gemm"].space
    pool_shapes = len(space["pool_nodes"]) * len(space["pool_warps"])
    assert 100 * pool_shapes <= len(list(READOUT.points("gemm"))) <= 1000 * pool_shapes


@pytest.mark.parametrize("widths", [{"D": 8, "P": 8, "H": 8}, {"D": 24, "P": 40, "H": 56}, {"D": 96, "P": 16, "H": 192},
                                    {"D": 512, "P": 512, "H": 512}, {"D": 248, "P": 8, "H": 232}])
def test_a_default_fits_any_widths_that_are_multiples_of_8(widths):
    plan = READOUT.default_plan(widths, LIMITS)
    assert plan is not None and not READOUT.infeasible(plan, LIMITS)


def test_widths_no_pair_max_kernel_fits_run_the_gemm_strategy():
    """D and H whose only common column count is 8 need 64 thread rows (threads_n = 2 of 128
    threads), whose running maxima and hidden tile outgrow shared memory past ~400 channels. No
    split or direct point fits them; the gemm strategy (8 hidden columns per chunk, no pair tile
    of messages in shared memory) does, so they run a kernel, not the reference."""
    widths = {"D": 504, "P": 8, "H": 496}
    for strategy in PAIR_MAX:
        assert not READOUT.feasible_plans(strategy, widths, LIMITS)
    plan = READOUT.default_plan(widths, LIMITS)
    assert plan.strategy == "gemm" and plan.params == GEMM_GENERAL


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
    assert cost.flops / 51.3e12 * 1e6 == pytest.approx(4355, rel=0.01), "the floor at the H200's measured fp32 rate for this shape"
    assert cost.bytes >= 4 * pairs * 64


#: The __global__ functions of each strategy's source, as the module launches them: the suffixes
#: on the variant's name.
KERNELS = {"direct": ("",), "split": ("", "_nodes"), "fused": ("",), "gemm": ("_nodes", "_hidden", "_pool"),
           "mma": ("", "_nodes"), "wgmma": ("", "_nodes")}


def variant_name(plan) -> str:
    code = "float32" if "float32" in READOUT.strategies[plan.strategy].precisions else plan.precision  # exact stand-ins
    assert plan.kernel_name == kernel_name("readout", plan.strategy, code, plan.params)
    return plan.kernel_name


@pytest.mark.parametrize("widths", [w if k == 0 else pytest.param(w, marks=pytest.mark.slow)  # the first default
                                    for k, w in enumerate(PRESET_WIDTHS)],                     # of each strategy at
                         ids=lambda w: "D{D}P{P}H{H}".format(**w))                              # the others: test_compile
def test_default_variants_compile_without_spills(widths):
    for strategy, params in READOUT.default_points:
        plan = READOUT.plan(strategy, params, widths)
        if READOUT.infeasible(plan, LIMITS):
            continue
        result = runtime.build_variant(plan, "sm_90").compiled
        assert result.spill_bytes == 0 and result.stack_bytes == 0, f"{plan.label}: {result.summary()}"
        assert result.compile_s < 20 or result.from_cache
        launched = KERNELS[strategy][:1] if plan.params.get("one_launch") else KERNELS[strategy]  # prologue inside
        assert set(result.kernels) == {variant_name(plan) + suffix for suffix in launched}, plan.label


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


def test_held_buffers_grow_and_keep_the_buffers_they_replace():
    """The j split's arrival counters and the split/direct scratch: owned by the module (counters
    zeroed), reused while large enough, grown (at least doubled) for a larger call; a replaced
    buffer stays alive for a graph that captured it. On the CPU (device index -1): the logic is
    device-independent, and the capture check applies to CUDA only."""
    module = PairReadout(8, 8, 8)
    cpu = -1  # get_device() of a CPU tensor
    first = module._tile_counters(cpu, 10)
    live = module._counters.live
    assert live.numel() == PairReadout.MIN_COUNTERS and first == live.data_ptr() and not live.any()
    assert module._tile_counters(cpu, PairReadout.MIN_COUNTERS) == first, "large enough: reused"
    grown = module._tile_counters(cpu, PairReadout.MIN_COUNTERS + 1)
    bigger, retired = module._counters.live, module._counters.retired
    assert grown == bigger.data_ptr() != first and bigger.numel() == 2 * PairReadout.MIN_COUNTERS
    assert any(t.data_ptr() == first for t in retired), "the replaced buffer is kept"
    assert not bigger.any()
    scratch = module._split_scratch(cpu, 100)
    assert module._split_scratch(cpu, 60) == scratch, "large enough: reused"
    grown = module._split_scratch(cpu, 150)
    held = module._scratch
    assert grown == held.ptr == held.live.data_ptr() != scratch and held.live.numel() == held.capacity == 200
    assert held.retired[-1].data_ptr() == scratch


# ---- the gemm strategy: prologue, hidden kernel, cuBLAS mm, pool kernel ----------------------

GEMM_WIDTHS = PRESET_WIDTHS + [{"D": 504, "P": 8, "H": 496}, {"D": 24, "P": 40, "H": 56},
                               {"D": 512, "P": 512, "H": 512}]


def _tile_col(tn: int, c: int, threads_n: int) -> int:
    """tile_gemm.cuh's column of slot c of thread tn."""
    return (c // 4) * threads_n * 4 + tn * 4 + c % 4


def hidden_writes(plan, B: int, N: int) -> list[tuple[int, int]]:
    """Every (pair, hidden column) the hidden kernel stores, with its index formulas (gemm.cu.j2):
    block = tile, thread (tm, tn) = (t // threads_n, t % threads_n), rows r*threads_m + tm, chunks
    of cn columns."""
    c, H = plan.context, plan.widths["H"]
    blocks, tiles = main_grid(plan, B, N, 132, 1)
    assert blocks == tiles
    total, writes = B * N * N, []
    for tile in range(tiles):
        for t in range(plan.threads):
            tm, tn = t // c["threads_n"], t % c["threads_n"]
            for r in range(c["tm"]):
                pair = tile * c["tile"] + r * c["threads_m"] + tm
                if pair < total:
                    writes += [(pair, c0 + _tile_col(tn, k, c["threads_n"]))
                               for c0 in range(0, H, c["cn"]) for k in range(c["tn"])]
    return writes


@pytest.mark.parametrize("B, N", [(1, 1), (3, 7), (1, 37), (2, 16)])
def test_gemm_hidden_kernel_writes_every_pair_and_column_once(B, N):
    widths = {"D": 16, "P": 8, "H": 48}
    space = READOUT.strategies["gemm"].space
    plans = [READOUT.plan("gemm", dict(GEMM_GENERAL, tile=tile, threads=threads, tm=tm, tn=tn), widths)
             for tile in space["tile"] for threads in space["threads"] for tm in space["tm"] for tn in space["tn"]]
    plans = [p for p in plans if not READOUT.infeasible(p, LIMITS)]
    micro_tiles = {(p.params["tm"], p.params["tn"]) for p in plans}
    assert micro_tiles == {(1, 4), (2, 4), (4, 4), (8, 4), (1, 8), (2, 8), (4, 8)}, \
        "8x8 micro-tiles need 64 columns per chunk (H = 48 has none)"
    for plan in plans:
        writes = hidden_writes(plan, B, N)
        assert sorted(writes) == [(p, h) for p in range(B * N * N) for h in range(48)], plan.label


@pytest.mark.parametrize("B, N", [(1, 1), (3, 7), (2, 37)])
def test_gemm_hidden_rows_of_u_and_v_are_the_pairs_nodes(B, N):
    """stage_pair_tile: pair p = n*N + j with n = b*N + i reads U from row n and V from row
    n - n % N + j = b*N + j."""
    for b in range(B):
        for i in range(N):
            for j in range(N):
                p = (b * N + i) * N + j
                n, jj = p // N, p - (p // N) * N
                assert (n, n - n % N + jj) == (b * N + i, b * N + j)


@pytest.mark.parametrize("B, N", [(1, 1), (1, 7), (3, 37), (2, 123), (1, 64)])
@pytest.mark.parametrize("pool_nodes, pool_warps", [(1, 1), (4, 2), (8, 4), (2, 4), (1, 2)])
def test_gemm_pool_warps_cover_each_nodes_partners_once(B, N, pool_nodes, pool_warps):
    """Block k, warp w -> node k*pool_nodes + w // pool_warps, share s = w % pool_warps: chunks of
    32 partners 32*s, 32*(s + pool_warps), ... (gemm.cu.j2). Every node of B*N gets each partner
    from exactly one warp; no warp stores outside B*N; the node's first warp stores it."""
    seen, stored = {}, []
    for block in range(gemm_pool_blocks(B * N, pool_nodes)):
        for warp in range(pool_nodes * pool_warps):
            local, s = divmod(warp, pool_warps)
            n = block * pool_nodes + local
            partners = N if n < B * N else 0
            js = [j0 + lane for j0 in range(32 * s, partners, 32 * pool_warps)
                  for lane in range(32) if j0 + lane < partners]
            seen.setdefault(n, []).extend(js)
            i = n % N if (n < B * N and s == 0) else N
            if i < N:
                stored.append(n)
    assert sorted(stored) == list(range(B * N))
    for n in range(B * N):
        assert sorted(seen[n]) == list(range(N)), n
    assert all(not js for n, js in seen.items() if n >= B * N)


def test_gemm_pool_shared_memory():
    """combine_node_warps: (pool_warps - 1) partial rows of D floats per node, one int per warp;
    none with one warp per node. Every point of the space fits, even at D = 512 (over 48 KB the
    launch opts in to more dynamic shared memory, as for every kernel: launch.LoadedKernel)."""
    assert gemm_pool_smem(256, 4, 1) == 0
    assert gemm_pool_smem(256, 4, 2) == 4 * (4 * 1 * 256 + 8)
    assert gemm_pool_smem(96, 1, 4) == 4 * (3 * 96 + 4)
    space = READOUT.strategies["gemm"].space
    worst = max(gemm_pool_smem(512, n, w) for n in space["pool_nodes"] for w in space["pool_warps"])
    assert worst <= LIMITS.max_smem_per_block and max(space["pool_nodes"]) * max(space["pool_warps"]) * 32 <= 1024


def test_gemm_plan_shared_memory_and_launch_bounds():
    """The hidden kernel's shared memory: the pair tile (rows of P_STRIDE), a [P][cn] chunk of W_p
    when staged, two ints per pair; __launch_bounds__ grants 8x8 micro-tiles ~168 registers."""
    w = PRESET_WIDTHS[-1]
    base = dict(GEMM_FIRST)
    plan = READOUT.plan("gemm", base, w)
    stride = plan.context["p_stride"]
    assert stride >= w["P"] and stride % 32 == 4
    assert plan.smem_bytes == 4 * (128 * stride + 2 * 128)
    staged = READOUT.plan("gemm", dict(base, weights_smem=True), w)
    assert staged.smem_bytes - plan.smem_bytes == 4 * w["P"] * plan.context["cn"]
    assert plan.context["cn"] == 64 and plan.context["threads_m"] == 16 and plan.context["threads_n"] == 8
    assert plan.context["min_blocks"] == 3, "65536 registers / (128 threads x 168)"
    assert READOUT.plan("gemm", dict(base, tn=4), w).context["min_blocks"] == 4, "32 accumulators: 128 registers"
    assert plan.context["pool_threads"] == 32 * base["pool_nodes"] * base["pool_warps"]


def test_gemm_restrictions_prune_impossible_points():
    wide = {"D": 512, "P": 512, "H": 512}
    staged = READOUT.plan("gemm", {"tile": 64, "threads": 256, "tm": 8, "tn": 8, "unroll": 2, "weights_smem": True,
                                   "pool_nodes": 1, "pool_warps": 1}, wide)
    assert "shared memory exceeds the per-block limit" in READOUT.infeasible(staged, LIMITS)  # 512 x 256 W_p chunk
    seed = READOUT.plan("gemm", {"tile": 64, "threads": 256, "tm": 8, "tn": 8, "unroll": 2, "weights_smem": False,
                                 "pool_nodes": 1, "pool_warps": 1}, PRESET_WIDTHS[0])
    assert any("must divide H" in r for r in READOUT.infeasible(seed, LIMITS))  # 256 columns, H = 192
    assert hidden_layout(128, 8, 4, 64) == {"threads_m": 16, "threads_n": 4, "cn": 16}
    assert hidden_layout(128, 3, 4, 128)["threads_m"] == 0 and hidden_layout(256, 2, 4, 64)["threads_n"] == 0
    for widths in GEMM_WIDTHS:
        feasible = READOUT.feasible_plans("gemm", widths, LIMITS)
        assert feasible, widths
        for plan in feasible:
            c = plan.context
            assert c["threads_m"] * c["tm"] == c["tile"] and c["threads_m"] * c["threads_n"] == plan.threads
            assert widths["H"] % c["cn"] == 0 and c["tm"] * c["tn"] <= 64
            assert max(plan.smem_bytes, c["pool_smem"]) <= LIMITS.max_smem_per_block and c["pool_threads"] <= 1024


def test_gemm_defaults_are_valid_at_every_preset_width_and_one_fits_any_multiple_of_8():
    """The first gemm default (what complete_point fills new parameters from, and the tuner's
    first gemm trial) at every preset width; the second at any D, P, H multiple of 8 up to 512."""
    first, general = GEMM_FIRST, GEMM_GENERAL
    for widths in PRESET_WIDTHS:
        assert not READOUT.infeasible(READOUT.plan("gemm", first, widths), LIMITS), widths
    for D, P, H in itertools.product((8, 24, 96, 136, 248, 504, 512), repeat=3):
        plan = READOUT.plan("gemm", general, {"D": D, "P": P, "H": H})
        assert not READOUT.infeasible(plan, LIMITS), (D, P, H)


def test_gemm_points_have_no_j_split():
    """j_split belongs to the pair-max strategies: plan() adds it to their old points only."""
    params = GEMM_GENERAL
    assert "j_split" not in READOUT.plan("gemm", params, PRESET_WIDTHS[0]).params
    with pytest.raises(ValueError, match="params"):
        READOUT.plan("gemm", dict(params, j_split=1), PRESET_WIDTHS[0])


def test_gemm_scratch_is_one_buffer_of_hidden_messages_and_uv():
    B, N, D, H = 16, 128, 256, 512
    at = gemm_scratch_offsets(B, N, D, H)
    pairs = B * N * N
    assert at["hidden"] == 0 and at["messages"] >= pairs * H and at["uv"] >= at["messages"] + pairs * D
    assert at["total"] >= at["uv"] + B * N * 2 * H
    assert all(at[k] % GEMM_SCRATCH_ALIGN == 0 for k in at), "256-byte sections"
    assert 4 * (at["uv"] - at["hidden"]) == 805_306_368, "B*N*N*(H + D) floats: the 805 MB the docs quote"
    small = gemm_scratch_offsets(1, 1, 8, 8)
    assert small == {"hidden": 0, "messages": 64, "uv": 128, "total": 192}


def test_split_product_is_tf32x3s_and_doubles_the_hidden_scratch():
    """split_product puts the H -> D product on TF32 tensor cores: only tf32x3 may; the exact
    precisions keep the fp32 product. Its hidden rows are [hi | lo]: 2H floats a pair."""
    large = PRESET_WIDTHS[-1]
    assert GEMM_SPLIT == dict(GEMM_FIRST, split_product=True)
    for precision in ("float32", "tf32"):
        reasons = READOUT.infeasible(READOUT.plan("gemm", GEMM_SPLIT, large, precision), LIMITS)
        assert any("split_product is tf32x3's" in r for r in reasons), precision
    assert not READOUT.infeasible(READOUT.plan("gemm", GEMM_SPLIT, large, "tf32x3"), LIMITS)
    assert READOUT.plan("gemm", {k: v for k, v in GEMM_FIRST.items() if k != "split_product"}, large,
                        "tf32x3").params["split_product"] is False, "entries from before the parameter: exact"
    B, N, D, H = 16, 128, 256, 512
    plain, split = gemm_scratch_offsets(B, N, D, H), gemm_scratch_offsets(B, N, D, H, split_product=True)
    assert split["messages"] - plain["messages"] == B * N * N * H
    assert 4 * (split["uv"] - split["hidden"]) == 1_342_177_280, "the 1342 MB the docs quote"


def _tf32_round_reference(value: float) -> float:
    """value rounded to 10 mantissa bits, to nearest with ties away from zero (cvt.rna.tf32)."""
    if value == 0 or not math.isfinite(value):
        return value
    _, exponent = math.frexp(abs(value))                  # abs(value) = m * 2**exponent, m in [0.5, 1)
    # 11 significant bits (the implicit one and 10); below 2^-126 (subnormal) a fixed step of 2^-136.
    step = 2.0 ** max(exponent - 11, -136)
    return math.copysign(math.floor(abs(value) / step + 0.5) * step, value)  # ties away from zero


def test_tf32_rounding_and_the_split_of_w2():
    """tf32_rounded: nearest with ties away from zero, NaN and infinity kept; split_w2t: [hi; hi; lo]
    of W2^T with hi + lo = W2 to ~2^-22 and both halves exact TF32 values (low 13 bits zero)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4096, generator=gen) * torch.logspace(-30, 30, 4096)
    ties = torch.tensor([1 + 2 ** -11, -(1 + 3 * 2 ** -11), 2 ** -140])  # ties (up and away), a subnormal
    x = torch.cat([x, ties])
    got = tf32_rounded(x)
    assert [float(v) for v in got] == [_tf32_round_reference(float(v)) for v in x]
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), 3.4028235e38])
    rounded = tf32_rounded(special)
    assert torch.isnan(rounded[0]) and rounded[1] == float("inf") and rounded[2] == float("-inf")
    assert rounded[3] == float("inf"), "past the largest TF32 value: infinity, as cvt.rna"
    module = READOUT.make_module(PRESET_WIDTHS[0], gen)
    params = [module.fuse[0].weight, module.fuse[0].bias, module.fuse[2].weight]
    H = PRESET_WIDTHS[0]["H"]
    stacked = split_w2t(params)
    hi, hi_again, lo = stacked[:H], stacked[H: 2 * H], stacked[2 * H:]
    w2t = module.fuse[2].weight.detach().t()
    assert stacked.shape == (3 * H, PRESET_WIDTHS[0]["D"]) and torch.equal(hi, hi_again)
    for half in (hi, lo):
        assert not (half.view(torch.int32) & 0x1FFF).any(), "exact TF32 values"
    error = (hi.double() + lo.double() - w2t.double()).abs().max() / w2t.abs().max()
    assert 0 < error <= 2.0 ** -21


def test_pair_max_scratch():
    w = PRESET_WIDTHS[0]
    D, H = w["D"], w["H"]
    assert pair_max_scratch(4, 24, D, H, 3, with_uv=True) == {
        "uv": 0, "partials": 4 * 24 * 2 * H, "total": 4 * 24 * 2 * H + split_scratch_floats(4, 24, D, 3)}
    assert pair_max_scratch(4, 24, D, H, 1, with_uv=False)["total"] == 0  # direct without a split: none


def test_gemm_variants_compile_without_spills():
    """The gemm defaults at every preset width (and at D=504 P=8 H=496, where only gemm fits), and
    the points the tuner is expected to weigh at the large shape: 8x8 and 8x4 micro-tiles,
    W_p staged or through the cache, 256-pair tiles, four warps per node. Three kernels each."""
    large = PRESET_WIDTHS[-1]
    first, general = GEMM_FIRST, GEMM_GENERAL
    points = [(first, w) for w in PRESET_WIDTHS] + [(general, {"D": 504, "P": 8, "H": 496}), (general, large)]
    points += [(dict(first, weights_smem=True), large), (dict(first, tn=4, threads=256, unroll=4), large),
               (dict(first, tile=256, threads=256, weights_smem=True), large),
               (dict(first, pool_warps=4, pool_nodes=8), large)]
    plans = [READOUT.plan("gemm", params, widths) for params, widths in points]
    # tf32x3's split product ([hi | lo] hidden rows) at the seed and the large shape.
    plans += [READOUT.plan("gemm", GEMM_SPLIT, widths, "tf32x3") for widths in (PRESET_WIDTHS[0], large)]
    assert not [p.label for p in plans if READOUT.infeasible(p, LIMITS)]
    variants = compile_plans(plans)
    for plan in plans:
        result = compiled_variant(variants, plan).compiled
        assert set(result.kernels) == {variant_name(plan) + suffix for suffix in KERNELS["gemm"]}
        assert result.spill_bytes == 0 and result.stack_bytes == 0, f"{plan.label} {plan.widths}: {result.summary()}"


@pytest.fixture
def tf32_state():
    """torch's cuBLAS TF32 setting (torch >= 2.9: the fp32_precision API and the legacy flag, which
    torch keeps consistent), restored after the test: legacy flag off, then the new API's value."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no fp32_precision API (fp32_matmul uses allow_tf32 there)")
    saved = matmul.fp32_precision
    yield matmul
    matmul.allow_tf32 = False
    matmul.fp32_precision = saved


def test_fp32_matmul_switches_tf32_off_inside_and_restores_a_legacy_callers_flag(tf32_state):
    tf32_state.allow_tf32 = True
    with fp32_matmul():
        # What torch's cuBLAS calls read (float32Precision(CUDA, MATMUL)). The legacy getter is not
        # read in here: it raises while the two APIs disagree.
        assert tf32_state.fp32_precision == "ieee"
    assert tf32_state.allow_tf32, "the caller's legacy flag reads as it was"


def test_fp32_matmul_works_for_a_caller_on_the_new_api(tf32_state):
    """torch >= 2.9: once a caller set fp32_precision, reading the legacy allow_tf32 raises (as
    trimul's bmm does); the context manager never reads it."""
    tf32_state.fp32_precision = "tf32"
    with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
        tf32_state.allow_tf32
    with fp32_matmul():
        assert tf32_state.fp32_precision == "ieee"
    assert tf32_state.fp32_precision == "tf32"
    with pytest.raises(RuntimeError, match="boom"), fp32_matmul():
        raise RuntimeError("boom")
    assert tf32_state.fp32_precision == "tf32", "restored when the matmul raises"


def test_fp32_matmul_leaves_an_untouched_setting_untouched(tf32_state):
    tf32_state.fp32_precision = "none"
    with fp32_matmul():
        assert tf32_state.fp32_precision == "ieee"
    assert tf32_state.fp32_precision == "none" and not tf32_state.allow_tf32
