"""wgmma: the mma strategy on Hopper's warpgroup tensor cores (sm_90a), bf16 and fp16, for the widths
whose W_p and W2 outgrow shared memory (templates/readout/wgmma.cu.j2): mma's node prologue, packed
weights, arguments and runner; then warpgroups of 64 pairs sharing chunks of W_p and W2 streamed
through two stages, the messages' accumulators in registers, the max in shared memory."""
from __future__ import annotations

from ....spec import (HALF_PRECISIONS, MMA_KINDS, WGMMA_ON_SM90, DeviceLimits, Kernel, Plan, Restriction, Strategy,
                      align, element_bytes, padded_stride, persistent_blocks, smem_fits)
from ..common import PROLOGUE_COLS, PROLOGUE_THREADS, nodes_kernel, row_tiles, weight_offsets
from .mma import MMA_ARGS, mma_weight_offsets, run


def derive(params: dict, w: dict, name: str):
    """mma's node prologue, then one kernel of `groups` warpgroups walking steps of 64 * groups pairs,
    the weights streamed in chunks of hc hidden columns through two stages."""
    D, P, H, precision = w["D"], w["P"], w["H"], w["precision"]
    eb = element_bytes(precision)
    groups, hc = params["groups"], params["hc"]
    slots, rows = 32 * groups, 64 * groups
    d_stride = padded_stride(D)
    # two stages of a W_p chunk and a W2 chunk; per warpgroup its pair rows and hidden chunk (each
    # region 1024-byte aligned); the running maxima, validity, any-edge flags
    smem = (2 * (align(hc * P * eb, 1024) + align(D * hc * eb, 1024))
            + groups * (align(64 * P * eb, 1024) + align(64 * hc * eb, 1024)) + 4 * (slots * d_stride + rows + slots))
    context = {"D": D, "P": P, "H": H, "off": weight_offsets(D, P, H), "mma_off": mma_weight_offsets(D, P, H, eb),
               "mma_kind": MMA_KINDS[precision], "node_t": "elem_t", "node_half": True, "groups": groups, "hc": hc,
               "tile_i": params["tile_i"], "d_stride": d_stride, "smem": smem, "wgmma_widths": sorted({hc, D}),
               "prologue_rows": params["prologue_rows"], "prologue_threads": PROLOGUE_THREADS,
               "prologue_cols": PROLOGUE_COLS}

    def grid(B, N, sms, resident, _ti=params["tile_i"]):
        tiles = row_tiles(B, N, _ti)
        return persistent_blocks(tiles, 1, sms, resident), (B, N, tiles)

    return context, (Kernel(name, 128 * groups, smem, MMA_ARGS, grid, mode="programmatic"),
                     nodes_kernel(name, H, params["prologue_rows"]))


def _wgmma_shapes_fit(plan: Plan, limits: DeviceLimits) -> bool:
    """Whole 16-element k-steps, chunks that tile H, one wgmma of n = D (D / 2 accumulators a thread)."""
    w, hc = plan.widths, plan.params["hc"]
    return w["P"] % 16 == 0 and w["D"] % 16 == 0 and w["D"] <= 256 and w["H"] % hc == 0


WGMMA = Strategy(
    name="wgmma",
    summary="Hopper tensor cores: the node prologue, then warpgroups of 64 pairs sharing chunks of W_p and W2 "
            "streamed through two stages; the messages' accumulators in registers, the max in shared memory",
    # groups: warpgroups per block (each chunk copied once serves 64 * groups pairs); hc: hidden
    # columns per chunk; tile_i: rows i per tile (dividing 8: a thread's two rows share a node);
    # prologue_rows as split's.
    space={"groups": (1, 2), "hc": (32, 64, 128), "tile_i": (1, 2, 4, 8), "prologue_rows": (2, 8)},
    derive=derive,
    restrictions=(WGMMA_ON_SM90,
                  Restriction("P and D must be multiples of 16, D at most 256, and hc must divide H", _wgmma_shapes_fit),
                  # D 256 with hc 128 (192 accumulators a thread) took 255 registers and spilled.
                  Restriction("at most 160 accumulators per thread (D / 2 + hc / 2)",
                              lambda p, _: p.widths["D"] // 2 + p.params["hc"] // 2 <= 160),
                  Restriction("shared memory exceeds the per-block limit", smem_fits)),
    precisions=HALF_PRECISIONS,
    records=HALF_PRECISIONS,
    run=run,  # mma's: the same packed weights, pointers and node prologue
)
