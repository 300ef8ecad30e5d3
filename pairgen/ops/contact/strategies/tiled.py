"""tiled: a block computes tile_rows consecutive pairs, the MLP as register-tiled products
(templates/contact/tiled.cu.j2). Its context, restrictions and space are symmetric_tiled's too."""
from __future__ import annotations

from ....spec import DeviceLimits, Kernel, Plan, Restriction, Strategy, ceil_div, is_pow2, padded_stride, persistent_blocks
from ..common import FP32_RESTRICTIONS, base_context, run_single_kernel

#: x, packed weights, out, then B, N and the tiles as 64-bit ints (tiled and symmetric_tiled).
TILED_ARGS = ("ptr x", "ptr wpack", "ptr out", "i64 B64", "i64 N64", "i64 num_tiles64")


def tiled_context(params: dict, widths: dict, rows: int) -> tuple[dict, int]:
    """The tiled strategies' context for `rows` pairs per tile, and their shared memory."""
    context, weights = base_context(params, widths)
    P, H = widths["P"], widths["H"]
    threads_n = max(1, H // params["tn"])
    threads_m = max(1, params["threads"] // threads_n)
    context.update(tile_rows=rows, threads=params["threads"], tn=params["tn"], threads_n=threads_n,
                   threads_m=threads_m, tm=rows // threads_m, unroll=params["unroll"], ln_rows=params["ln_rows"],
                   a_stride=padded_stride(max(P, H)), stage_rows=params["stage_rows"], ln_lanes=params["ln_lanes"])
    staged = params["stage_rows"] * 2 * rows * P  # both orientations of a tile's rows, per buffer
    return context, weights + 4 * (rows * context["a_stride"] + staged)


def derive(params: dict, widths: dict, name: str):
    rows = params["tile_rows"]
    context, smem = tiled_context(params, widths, rows)

    def grid(B, N, sms, resident, _rows=rows, _per_sm=params["blocks_per_sm"]):
        tiles = ceil_div(B * N * N, _rows)
        return persistent_blocks(tiles, _per_sm, sms, resident), (B, N, tiles)

    return context, (Kernel(name, params["threads"], smem, TILED_ARGS, grid),)


def _tile_layout_ok(plan: Plan, limits: DeviceLimits) -> bool:
    c = plan.context
    return c["tm"] >= 1 and c["threads_m"] * c["tm"] == c["tile_rows"] and c["threads_m"] * c["threads_n"] == plan.threads


def _persistent_blocks_fit(plan: Plan, limits: DeviceLimits) -> bool:
    blocks = plan.params["blocks_per_sm"]
    return blocks == 0 or (blocks * plan.smem_bytes <= limits.smem_per_sm
                           and blocks * plan.threads <= limits.max_threads_per_sm)


TILED_RESTRICTIONS = FP32_RESTRICTIONS + (
    Restriction("tn must divide H", lambda p, _: p.widths["H"] % p.params["tn"] == 0),
    Restriction("H/tn must be a power of two <= 32 (a row's lanes sum by shuffles)",
                lambda p, _: is_pow2(p.context["threads_n"]) and p.context["threads_n"] <= 32),
    Restriction("threads must split into H/tn columns and rows that divide the tile", _tile_layout_ok),
    Restriction("at most 64 accumulators per thread", lambda p, _: p.context["tm"] * p.params["tn"] <= 64),
    Restriction("persistent blocks must be co-resident on an SM", _persistent_blocks_fit),
    Restriction("stage_rows=2 prefetches the next tile: only a persistent grid (blocks_per_sm > 0) has one",
                lambda p, _: p.params["stage_rows"] < 2 or p.params["blocks_per_sm"] > 0),
    Restriction("staged rows are normalised from shared memory: ln_rows is unused, so only ln_rows=2 is tried",
                lambda p, _: p.params["stage_rows"] == 0 or p.params["ln_rows"] == 2),
    # Not tied to ln_rows (unused with ln_lanes > 0): a re-tune's restart from an older winner sets
    # ln_lanes alone, and must stay feasible.
    Restriction("ln_lanes > 0 loads rows itself: only with stage_rows=0",
                lambda p, _: p.params["ln_lanes"] == 0 or p.params["stage_rows"] == 0),
    Restriction("ln_lanes must split P into float4s, at most 8 per lane and row",
                lambda p, _: p.params["ln_lanes"] == 0 or (p.widths["P"] % (4 * p.params["ln_lanes"]) == 0
                                                           and p.widths["P"] // (4 * p.params["ln_lanes"]) <= 8)),
)

TILED_SPACE = {"threads": (64, 128, 256, 512), "tn": (4, 8), "unroll": (1, 2, 4), "ln_rows": (2, 4, 8),
                "weights_smem": (True, False), "blocks_per_sm": (0, 1, 2, 4),
                "stage_rows": (0, 1, 2), "ln_lanes": (0, 4, 8)}

TILED = Strategy(
    name="tiled",
    summary="a block computes tile_rows consecutive pairs; the MLP as register-tiled matrix products",
    space={"tile_rows": (32, 64, 128), **TILED_SPACE},
    derive=derive,
    restrictions=TILED_RESTRICTIONS,
    run=run_single_kernel,
    records=("float32",),
)
