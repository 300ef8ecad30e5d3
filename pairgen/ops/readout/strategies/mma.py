"""mma: tensor cores (bf16, fp16, tf32, tf32x3; templates/readout/mma.cu.j2): split's node prologue
(fp32 U, V), then per step of tile_i x tile_j pairs the W_p product and the second layer as
mma.sync products on resident weights (or chunks of H streamed per step), the masked max in the
second product's epilogue. one_launch runs the prologue inside the kernel, before a grid-wide
barrier, as fused does."""
from __future__ import annotations

import functools

from ....spec import (HALF_PRECISIONS, MMA_KINDS, MMA_TILE_RESTRICTIONS, DeviceLimits, Kernel, Plan, Restriction,
                      Strategy, align, byte_sections, element_bytes, mma_row_bytes, padded_stride, persistent_blocks)
from ...packing import OPERAND_KINDS, Sources, layout
from ..common import (PROLOGUE_COLS, PROLOGUE_THREADS, launch_with_prologue_inside, nodes_kernel, prologue_fits_beside,
                      row_tiles, weight_offsets)
from ..packs import fp32_pieces

#: torch and what needs it, bound by _import_torch_half() on the first call a strategy runs, so that
#: the spec half (space, restrictions, plans) loads without torch and a call pays no import.
torch = OPERAND_DTYPES = fastcall = None


def _import_torch_half() -> None:
    global torch, OPERAND_DTYPES, fastcall
    import torch
    from .... import fastcall
    from ....precision import OPERAND_DTYPES

#: The tensor-core kernels (mma, wgmma): nodes, pair features, mask, weights, uv, out, then B, N,
#: row tiles.
MMA_ARGS = ("ptr nodes", "ptr pair", "ptr mask", "ptr wpack", "ptr uv", "ptr out", "i32 B", "i32 N", "i32 num_tiles")
#: With one_launch: those pointers, the grid barrier's ints, then B, N, row tiles and the phase.
MMA_ONE_LAUNCH_ARGS = (*MMA_ARGS[:6], "ptr grid_bar", "i32 B", "i32 N", "i32 num_tiles", "i32 phase")


def mma_weight_offsets(D: int, P: int, H: int, elem_bytes: int) -> dict[str, int]:
    """Byte offsets of the tensor-core kernels' packed weights (shared with templates/readout/mma.cu.j2
    and wgmma.cu.j2): the fp32 pack of weight_offsets() (the node prologue's [W_i^T | W_j^T] and b1,
    b2, gamma and beta), then W_p [H][P] and W2 [D][H] n-major (nn.Linear's layout) in the operand
    type, each section 16-byte aligned; "total" in bytes."""
    fp32_bytes = 4 * weight_offsets(D, P, H)["total"]
    operands = byte_sections([("wp", H * P * elem_bytes), ("w2", D * H * elem_bytes)])
    return {"wp": fp32_bytes + operands["wp"], "w2": fp32_bytes + operands["w2"], "total": fp32_bytes + operands["total"]}


@functools.lru_cache(maxsize=64)
def mma_layout(D: int, P: int, H: int, precision: str, sources: Sources):
    """The fp32 pack (the node prologue's [W_i^T | W_j^T], b1, b2, gamma, beta), then W_p [H][P] and
    W2 [D][H], nn.Linear's own layout, in the operand type, at mma_weight_offsets (bytes)."""
    kind = OPERAND_KINDS[precision]
    off = mma_weight_offsets(D, P, H, 2 if kind in ("bf16", "f16") else 4)
    pieces, _ = fp32_pieces(D, P, H, sources)
    pieces += [sources.piece("fuse.0.weight", kind, off["wp"], H, P, (2 * D + P, 1), (P, 1), offset=2 * D),
               sources.copy("fuse.2.weight", kind, off["w2"], D, H)]
    return layout(off["total"], pieces, sources.count)


def _mma_shape(params: dict, D: int) -> dict:
    """Pairs per step, 16-row fragments per warp (0 where the warps do not split the step), the
    columns one pass of the warps covers, and the 8-column fragments a warp holds at once: a pass's
    (resident), or a chunk's and its DW = D / warps_n message columns' (streamed)."""
    rows = params["tile_i"] * params["tile_j"]
    mt = rows // (16 * params["warps_m"]) if rows % (16 * params["warps_m"]) == 0 else 0
    nt = params["wn"] // 8
    held = nt if params["resident"] else nt + D // params["warps_n"] // 8
    return {"rows": rows, "mt": mt, "nt": held, "pass": params["warps_n"] * params["wn"]}


def derive(params: dict, w: dict, name: str):
    """The main kernel (declared first: the restrictions read its block), a programmatic dependent
    of the node prologue (fp32 U and V; 16-bit node rows are widened as they load); one_launch:
    the main kernel alone, the prologue inside it before a grid-wide barrier."""
    D, P, H, precision = w["D"], w["P"], w["H"], w["precision"]
    eb = element_bytes(precision)
    half = precision in HALF_PRECISIONS
    shape = _mma_shape(params, D)
    resident = params["resident"]
    x_row, d_stride = mma_row_bytes(P, eb), padded_stride(D)
    z_row = mma_row_bytes(H if resident else shape["pass"], eb)  # W2 and hidden rows: all of H, or a chunk
    wp_rows = H if resident else shape["pass"]
    threads = 32 * params["warps_m"] * params["warps_n"]
    slots = 8 * params["warps_m"]
    # per stage W_p and W2 (resident, or a chunk of each) and a step's pair rows; the step's hidden
    # rows, the running maxima, validity, any-edge flags
    smem = (params["stages"] * (wp_rows * x_row + D * z_row + shape["rows"] * x_row) + shape["rows"] * z_row
            + 4 * (slots * d_stride + align(shape["rows"]) + align(slots)))
    context = {"D": D, "P": P, "H": H, "off": weight_offsets(D, P, H), "mma_off": mma_weight_offsets(D, P, H, eb),
               "mma_kind": MMA_KINDS[precision], "node_t": "elem_t" if half else "float", "node_half": half,
               "tile_i": params["tile_i"], "tile_j": params["tile_j"], "warps_m": params["warps_m"],
               "warps_n": params["warps_n"], "wn": params["wn"], "resident": resident, "stages": params["stages"],
               "one_launch": params["one_launch"], "nodes_inline": params["one_launch"], "d_stride": d_stride,
               "smem": smem,
               "min_blocks": params["blocks_per_sm"], "mma_shape": shape,
               "prologue_rows": params["prologue_rows"], "prologue_threads": PROLOGUE_THREADS,
               "prologue_cols": PROLOGUE_COLS}

    def grid(B, N, sms, resident, _ti=params["tile_i"], _per_sm=params["blocks_per_sm"]):
        tiles = row_tiles(B, N, _ti)
        return persistent_blocks(tiles, _per_sm, sms, resident), (B, N, tiles)

    if params["one_launch"]:
        return context, (Kernel(name, threads, smem, MMA_ONE_LAUNCH_ARGS, grid, mode="cooperative_or_plain"),)
    return context, (Kernel(name, threads, smem, MMA_ARGS, grid, mode="programmatic"),
                     nodes_kernel(name, H, params["prologue_rows"]))


def _mma_layout_ok(plan: Plan, limits: DeviceLimits) -> bool:
    """Whole fragments per warp; passes that tile H, and D (resident) or an even number of message
    fragments per warp (streamed: D / warps_n columns)."""
    shape, w, warps_n = plan.context["mma_shape"], plan.widths, plan.params["warps_n"]
    d_ok = w["D"] % shape["pass"] == 0 if plan.params["resident"] else w["D"] % (16 * warps_n) == 0
    return shape["mt"] >= 1 and w["H"] % shape["pass"] == 0 and d_ok


def _mma_rows_whole(plan: Plan, limits: DeviceLimits) -> bool:
    """Operand rows of whole 16-byte pieces (cp.async), node rows of whole 4-element loads."""
    eb = element_bytes(plan.precision)
    w = plan.widths
    return (w["P"] * eb) % 16 == 0 and (w["H"] * eb) % 16 == 0 and w["D"] % 4 == 0


def run(module, variant, weights, nodes, pair_feats, edge_mask, out) -> None:
    """The node prologue (fp32 U, V into the held scratch), then the tensor-core kernel as its
    programmatic dependent (one_launch: the kernel alone, the prologue inside it), on the weights
    packed for the call in the operand dtype (mma_layout; the wgmma strategy's too). Under autocast
    (fp32 inputs, a 16-bit kernel) the inputs are cast first and the 16-bit result widened into
    `out`, the reference's dtype there."""
    if torch is None:
        _import_torch_half()
    B, N, D = nodes.shape
    H = module.widths["H"]
    dtype = OPERAND_DTYPES[variant.plan.precision]
    target = out
    if nodes.dtype is not dtype:  # every step noted: a recorded call's replay casts and widens too
        nodes, pair_feats = fastcall.cast(nodes, dtype), fastcall.cast(pair_feats, dtype)
        out = torch.empty_like(nodes)
        fastcall.note_scratch(out)
    device = nodes.get_device()
    P = module.widths["P"]
    packed = module._packed(mma_layout(D, P, H, variant.plan.precision, weights.sources), weights)
    launches = variant.launches(device, B, N, programmatic=module.programmatic_main)
    main = launches[0]
    uv = module._split_scratch(device, B * N * 2 * H)
    pointers = dict(nodes=nodes.data_ptr(), pair=pair_feats.data_ptr(), mask=edge_mask.data_ptr(),
                    wpack=packed.data_ptr(), uv=uv, out=out.data_ptr())
    if variant.plan.params.get("one_launch"):
        launch_with_prologue_inside(module, main, pointers, "grid_bar", nodes.device)
    else:
        prologue = launches[1]
        prologue.named(nodes=nodes.data_ptr(), wpack=packed.data_ptr(), uv=uv)
        main.named(**pointers)
    if out is not target:
        target.copy_(out)
        fastcall.note_copy(out, target)


MMA = Strategy(
    name="mma",
    summary="tensor cores: the node prologue (U, V), then per step of tile_i x tile_j pairs the first layer's "
            "W_p product and the second layer as mma.sync products, on resident weights or (resident=False) "
            "chunks of H streamed per step with the messages' accumulators in registers; the masked max in "
            "the second product's epilogue",
    # tile_i rows i (dividing 8: a thread's fragment rows share a node) by tile_j partners per step;
    # warps_m x warps_n warps, wn columns each per pass; blocks_per_sm: the persistent grid's
    # blocks per SM; prologue_rows as the split strategy's; resident: W_p and W2 whole in shared
    # memory, else streamed in chunks of warps_n * wn hidden columns (widths they outgrow); stages:
    # 2 streams through two buffers (the next chunk's copy overlaps this one's products); one_launch:
    # the node prologue inside the kernel (as the fused strategy's), one launch instead of two.
    space={"tile_i": (1, 2, 4, 8), "tile_j": (8, 16, 32, 64), "warps_m": (1, 2, 4), "warps_n": (1, 2, 4),
           "wn": (16, 32, 64), "blocks_per_sm": (1, 2), "prologue_rows": (2, 8), "resident": (True, False),
           "stages": (1, 2), "one_launch": (True, False)},
    derive=derive,
    restrictions=(
        Restriction("steps must split into 16-row fragments per warp, and passes tile H and D", _mma_layout_ok),
        Restriction("P and H rows must be whole 16-byte pieces in the operand type, D a multiple of 4",
                    _mma_rows_whole),
        Restriction("two stages only stream (resident weights are copied once)",
                    lambda p, _: p.params["stages"] == 1 or not p.params["resident"]),
        Restriction("one launch needs the prologue's 128 threads and its static shared arrays in the block",
                    lambda p, limits: not p.params["one_launch"]
                    or (p.threads >= PROLOGUE_THREADS and prologue_fits_beside(p, limits))),
        *MMA_TILE_RESTRICTIONS,  # resident W_p and W2: wide D and H outgrow shared memory
        # tf32x3 splits each fragment into two: with 80 accumulators (64 of them messages) its
        # streamed kernel took 255 registers and spilled (ptxas, sm_80).
        Restriction("tf32x3 streams with at most 64 accumulators per thread",
                    lambda p, _: p.params["resident"] or p.precision != "tf32x3"
                    or 4 * p.context["mma_shape"]["mt"] * p.context["mma_shape"]["nt"] <= 64),
    ),
    precisions=tuple(MMA_KINDS),
    # Recorded in every precision: its casts under autocast happen only in calls that are never
    # recorded (KernelModule._launch_recorded takes the Python path under autocast).
    records=tuple(MMA_KINDS),
    run=run,
)
