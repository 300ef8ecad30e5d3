"""wgmma: the mma strategy's symmetric tiles on Hopper's warpgroup products (bf16, fp16; sm_90a):
each warpgroup a tile of 64 pairs at a time, layer 3 summed within quads
(templates/contact/wgmma.cu.j2). It takes mma's pack and arguments, and runs as mma does."""
from __future__ import annotations

from ....spec import (HALF_PRECISIONS, MMA_KINDS, WGMMA_ON_SM90, DeviceLimits, Kernel, Plan, Restriction, Strategy,
                      align, ceil_div, cuda_bool, element_bytes, smem_fits)
from .mma import LN_QUADS_FIT, TENSOR_CORE_ARGS, mma_weight_offsets, run


def derive(params: dict, widths: dict, name: str):
    """One kernel of `groups` warpgroups, persistent; each warpgroup takes the 64-pair tiles
    (tile_side 8) blockIdx.x * groups + group, + gridDim.x * groups, ... Weights as the mma
    strategy packs them (mma_weight_offsets)."""
    P, H, precision = widths["P"], widths["H"], widths["precision"]
    eb = element_bytes(precision)
    groups = params["groups"]
    # Every region 1024-byte aligned (the 128-byte swizzle's atoms): resident W1 and W2; per
    # warpgroup the A tile, layer 1's output (unless z_registers keeps it in registers) and
    # (prefetch) the next tile's raw rows.
    group_bytes = (align(64 * P * eb, 1024) + (0 if params["z_registers"] else align(64 * H * eb, 1024))
                   + (align(2 * 64 * P * eb, 1024) if params["prefetch"] else 0))
    smem = align(H * P * eb, 1024) + align(H * H * eb, 1024) + groups * group_bytes
    context = {"P": P, "H": H, "mma_kind": MMA_KINDS[precision], "off": mma_weight_offsets(P, H, eb),
               "groups": groups, "swizzle": cuda_bool(params["swizzle"]), "prefetch": params["prefetch"],
               "wgmma_widths": [H], "smem": smem, "ln_quads": params["ln_quads"],
               "z_registers": params["z_registers"], "wgmma_rs_widths": [H] if params["z_registers"] else []}

    def grid(B, N, sms, resident, _groups=groups):
        nb = ceil_div(N, 8)
        tiles = B * nb * (nb + 1) // 2
        return max(1, min(ceil_div(tiles, _groups), max(1, resident) * sms)), (B, N, tiles)

    return context, (Kernel(name, 128 * groups, smem, TENSOR_CORE_ARGS, grid),)


def _wgmma_widths_fit(plan: Plan, limits: DeviceLimits) -> bool:
    """K in whole 16-element steps for both layers, and one wgmma (n <= 256) covering H: its H / 2
    accumulators per thread, at most 64 where a block has 2 or more warpgroups (at most 255, 168 and
    128 registers a thread for 2, 3 and 4)."""
    P, H = plan.widths["P"], plan.widths["H"]
    return P % 16 == 0 and H % 16 == 0 and H <= (128 if plan.params["groups"] > 1 else 256)


WGMMA = Strategy(
    name="wgmma",
    summary="Hopper tensor cores: the mma strategy's symmetric tiles as warpgroup products (64 pairs per "
            "warpgroup), weights resident, layer 3 summed in the quads",
    # groups: warpgroups per block (each alone on its tiles, sharing the weights; more of them hide
    # more of each other's phases, in fewer registers: 168 a thread at 3, 128 at 4); swizzle: the
    # 128-byte swizzle where K is a multiple of 64; prefetch: the next tile's raw rows copied
    # during this one's products; ln_quads: as in mma; z_registers: layer 1's output stays in
    # registers as layer 2's A operand (wgmma with A from registers) instead of a shared tile.
    space={"groups": (1, 2, 3, 4), "swizzle": (False, True), "prefetch": (True, False), "ln_quads": (True, False),
           "z_registers": (True, False)},
    derive=derive,
    restrictions=(WGMMA_ON_SM90,
                  Restriction("P and H must be multiples of 16, H at most 256 (128 with two or more warpgroups)",
                              _wgmma_widths_fit),
                  Restriction("the swizzle applies to no operand (neither P nor H a multiple of 64)",
                              lambda p, _: not p.params["swizzle"] or p.widths["P"] % 64 == 0 or p.widths["H"] % 64 == 0),
                  LN_QUADS_FIT,
                  Restriction("shared memory exceeds the per-block limit", smem_fits)),
    precisions=HALF_PRECISIONS,
    run=run,
    records=HALF_PRECISIONS,
)
