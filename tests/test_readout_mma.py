"""CPU: the readout's tensor-core strategy (mma: bf16, fp16, tf32, tf32x3): plans and restrictions,
the packed weights' layout, defaults compiling without spills for sm_90 and sm_80, the exact
strategies standing in for the tf32 kinds, the module's precision option. Its accuracy runs on the
GPU (tests/test_readout_mma_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_tensor_core_defaults_compile, feasible_defaults, feasible_plans, generator
from pairgen import codegen
from pairgen.ops import get_op
from pack_oracles import host_pack
from pairgen.ops.readout.common import weight_offsets
from pairgen.ops.readout.strategies.mma import mma_layout, mma_weight_offsets
from pairgen.spec import HALF_PRECISIONS, MMA_KINDS, DeviceLimits

READOUT = get_op("readout")
SEED, REAL, LARGE = ({**shape} for shapes in READOUT.presets.values() for shape in shapes)
WIDTHS = [{"D": 96, "P": 16, "H": 192}, {"D": 128, "P": 32, "H": 256}, {"D": 48, "P": 24, "H": 80},
          {"D": 256, "P": 64, "H": 512}]


@pytest.mark.parametrize("precision", list(MMA_KINDS))
def test_defaults_per_precision(precision):
    """Every precision has an mma default at every preset width (16 bits: the default itself; the
    tf32 kinds: after the exact split kernel, which keeps their promise): resident weights at the
    seed's and B8 N64's, streamed ones at D256 H512 (W2 alone would take 266 KB resident)."""
    limits = DeviceLimits()
    for shape in (SEED, REAL, LARGE):
        widths = READOUT.widths_of(shape)
        mma = feasible_defaults(READOUT, "mma", widths, precision, limits)
        assert mma and mma[0].precision == precision
        assert mma[0].params["resident"] == (shape is not LARGE)
        default = READOUT.default_plan(widths, limits, precision)
        assert default.strategy == ("mma" if precision in HALF_PRECISIONS else "split")


def test_restrictions_name_what_is_wrong():
    w = {"D": 96, "P": 16, "H": 192}
    point = {"tile_i": 2, "tile_j": 16, "warps_m": 2, "warps_n": 2, "wn": 32, "blocks_per_sm": 1, "prologue_rows": 2,
             "resident": True}
    wide_pass = READOUT.plan("mma", point, w, "bfloat16")  # 64 columns per pass over D = 96
    assert any("passes tile H and D" in why for why in READOUT.infeasible(wide_pass, DeviceLimits()))
    ragged = READOUT.plan("mma", {**point, "warps_m": 4, "wn": 16}, w, "bfloat16")  # 32 pairs over 4 warps
    assert any("16-row fragments" in why for why in READOUT.infeasible(ragged, DeviceLimits()))
    odd_p = READOUT.plan("mma", {**point, "wn": 16}, {"D": 96, "P": 12, "H": 192}, "bfloat16")  # 24-byte rows
    assert any("16-byte pieces" in why for why in READOUT.infeasible(odd_p, DeviceLimits()))
    assert not any("16-byte pieces" in why
                   for why in READOUT.infeasible(READOUT.plan("mma", {**point, "wn": 16}, {"D": 96, "P": 12, "H": 192},
                                                              "tf32x3"), DeviceLimits()))
    large = READOUT.plan("mma", {**point, "wn": 16}, READOUT.widths_of(LARGE), "bfloat16")
    assert any("shared memory" in why for why in READOUT.infeasible(large, DeviceLimits()))
    streamed = READOUT.plan("mma", {**point, "wn": 16, "resident": False}, READOUT.widths_of(LARGE), "bfloat16")
    assert not READOUT.infeasible(streamed, DeviceLimits())
    # streamed: D / warps_n message columns per warp must be whole pairs of 8-column fragments
    odd_d = READOUT.plan("mma", {**point, "wn": 16, "resident": False}, {"D": 72, "P": 16, "H": 192}, "bfloat16")
    assert any("passes tile H and D" in why for why in READOUT.infeasible(odd_d, DeviceLimits()))
    many = READOUT.plan("mma", {**point, "warps_n": 1, "wn": 64, "resident": False}, READOUT.widths_of(LARGE),
                        "bfloat16")  # 8 + 32 fragments held per warp
    assert any("accumulators" in why for why in READOUT.infeasible(many, DeviceLimits()))


def test_packed_weights_layout():
    gen = generator(3)
    D, P, H = 24, 16, 40
    module = READOUT.make_module({"D": D, "P": P, "H": H}, gen)
    params = [module.fuse[0].weight, module.fuse[0].bias, module.fuse[2].weight, module.fuse[2].bias,
              module.norm.weight, module.norm.bias]
    fp32 = module.packed_weights()
    for dtype in (torch.bfloat16, torch.float32):
        precision = "bfloat16" if dtype is torch.bfloat16 else "tf32x3"
        packed = host_pack(module, mma_layout(D, P, H, precision, module._slots.sources))
        off = mma_weight_offsets(D, P, H, torch.empty(0, dtype=dtype).element_size())
        assert packed.numel() == off["total"] and all(v % 16 == 0 for v in off.values())
        assert off["wp"] == 4 * weight_offsets(D, P, H)["total"]
        torch.testing.assert_close(packed[: off["wp"]].view(torch.float32), fp32)
        size = torch.empty(0, dtype=dtype).element_size()
        wp = packed[off["wp"]: off["wp"] + H * P * size].view(dtype).view(H, P)
        w2 = packed[off["w2"]: off["w2"] + D * H * size].view(dtype).view(D, H)
        torch.testing.assert_close(wp, params[0].detach()[:, 2 * D:].to(dtype))
        torch.testing.assert_close(w2, params[2].detach().to(dtype))


@pytest.mark.parametrize("arch, every_pair", [("sm_90", False), pytest.param("sm_90", True, marks=pytest.mark.slow),
                                              pytest.param("sm_80", True, marks=pytest.mark.slow)])
def test_defaults_compile_without_spills_and_samples_compile(arch, every_pair):
    assert_tensor_core_defaults_compile(READOUT, "mma", WIDTHS, arch, min_defaults=12 if every_pair else 7, every_pair=every_pair)


@pytest.mark.parametrize("precision", ["tf32x3", "tf32"])
def test_the_exact_kernels_stand_in_for_the_tf32_kinds_unchanged(precision):
    """The exact strategies offered to tf32x3 and tf32 run the fp32 kernels' code: the rendered
    sources differ only in the header's precision line."""
    for strategy, point in READOUT.default_points:
        if "float32" not in READOUT.strategies[strategy].precisions:  # the tensor-core ones
            continue
        exact, stand_in = (codegen.render_plan(READOUT.plan(strategy, point, WIDTHS[1], p))
                           for p in ("float32", precision))
        assert [line for line in stand_in.source.splitlines() if line != f"// precision {precision}"] \
            == exact.source.splitlines()
        assert stand_in.source != exact.source


def test_the_precision_option():
    module = READOUT.make_module({"D": 24, "P": 16, "H": 40}, generator(4))
    assert module.precision == "ieee" and "precision" not in repr(module)
    assert set(module.state_dict()) == set(READOUT.make_reference(module).state_dict())
    module.precision = "tf32x3"
    assert "precision='tf32x3'" in repr(module)
    with pytest.raises(ValueError, match="precision must be one of"):
        module.precision = "fp8"
    inputs = READOUT.make_inputs({"B": 2, "N": 5, "D": 24, "P": 16, "H": 40}, generator(5))
    assert module.kernel_precision(*inputs) is None  # on the CPU: the reference
    with torch.no_grad():
        torch.testing.assert_close(module(*inputs), READOUT.make_reference(module)(*inputs))


def _mma_ownership(c: dict, n: int, grid: int, tiles: int):
    """The mma kernel's index formulas (templates/readout/mma.cu.j2), for one batch: {(node, slot):
    pairs folded into that running-max row slot}, {slot: columns per owning thread}, tiles visited."""
    ti, tj, wm_count, wn_count = c["tile_i"], c["tile_j"], c["warps_m"], c["warps_n"]
    mt, nt = c["mma_shape"]["mt"], c["wn"] // 8
    rows, step_pass, d = ti * tj, wn_count * nt * 8, c["D"]
    dw = d // wn_count  # streamed: each warp's message columns
    folded, columns, visited = {}, {}, []
    for block in range(grid):
        for tile in range(block, tiles, grid):  # the persistent loop
            visited.append(tile)
            i0 = tile * ti
            for warp in range(wm_count * wn_count):
                wm, wn = warp % wm_count, warp // wm_count
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    slot = wm * 8 + g
                    if c["resident"]:
                        cols = [n0 + k * 8 + 2 * t + e for n0 in range(wn * nt * 8, d, step_pass) for k in range(nt)
                                for e in (0, 1)]
                    else:
                        cols = [wn * dw + k * 8 + 2 * t + e for k in range(dw // 8) for e in (0, 1)]
                    if tile == 0:
                        columns.setdefault(slot, []).append(cols)
                    for j0 in range(0, n, tj):
                        for mi in range(mt):
                            for h2 in (0, 1):
                                m = wm * mt * 16 + mi * 16 + g + 8 * h2
                                assert m < rows
                                i, j = i0 + m % ti, j0 + m // ti
                                assert i == i0 + slot % ti, "a thread's rows share the node of its slot"
                                if i < n and j < n and wn == 0 and t == 0:  # one owner per row and slot
                                    folded.setdefault((i, slot), []).append(j)
    return folded, columns, visited


@pytest.mark.parametrize("n", [1, 7, 37, 64])
def test_every_pair_reaches_its_nodes_pooled_slots_once_and_every_column_has_one_owner(n):
    """Pooling (_pool.cuh.j2) takes node ii's slots s = ii, ii + TILE_I, ... < THREADS_M: over them,
    each partner j of the node is folded exactly once; each slot's D columns are split between the
    threads that share it without overlap; the persistent grid visits every tile once."""
    for widths in WIDTHS:
        plans = feasible_plans(READOUT.at("bfloat16"), "mma", widths)
        assert plans
        for plan in plans[:: max(1, len(plans) // 12)]:
            c = {**plan.context, "warps_m": plan.params["warps_m"], "warps_n": plan.params["warps_n"]}
            tiles = -(-n // plan.params["tile_i"])
            grid, shape = plan.kernels[0].grid(1, n, 132, plan.params["blocks_per_sm"])
            assert shape == (1, n, tiles)
            folded, columns, visited = _mma_ownership(c, n, grid, tiles)
            assert sorted(visited) == list(range(tiles)), plan.label
            slots = 8 * plan.params["warps_m"]
            for i in range(n):
                ii = i % plan.params["tile_i"]
                partners = [j for s in range(ii, slots, plan.params["tile_i"]) for j in folded.get((i, s), [])]
                assert sorted(partners) == list(range(n)), (plan.label, i)
            for slot, owners in columns.items():
                flat = [col for cols in owners for col in cols]
                assert sorted(flat) == list(range(widths["D"])), (plan.label, slot)
