"""wgmma: the mma strategy's three steps for bf16 and fp16 on Hopper (sm_90a) warpgroup products
(templates/trimul/wgmma.cu.j2): operands from cp.async straight into shared memory, each LayerNorm
folded into the epilogue of the product after it. Its weights are folded for each call by a kernel
of their own (templates/trimul/pack_wgmma.cu.j2): each linear layer scaled by the LayerNorm before
it, with the row sums and offsets the epilogues need."""
from __future__ import annotations

import dataclasses
import functools
import weakref

from ....spec import (HALF_PRECISIONS, MMA_KINDS, DeviceLimits, Kernel, Plan, Restriction, Strategy, WGMMA_ON_SM90,
                      align, byte_sections, ceil_div, cuda_bool, element_bytes, smem_fits)
from .... import runtime
from ...fused_kernels import THREADS, FusedTemplate
from ... import packing
from ...packing import MAX_SOURCES, Sources, launch_pack, source_arguments
from ..common import OUTPUT_ARGS, PROJECT_ARGS, gate_columns
from ..packs import parameter_names
from .mma import Projected, _row_statistics, _taken, run_projection, run_three_steps

#: torch and what needs it, bound by _import_torch_half() on the first call a strategy runs, so that
#: the spec half (space, restrictions, plans) loads without torch and a call pays no import.
PACK_SLOTS = None


def _import_torch_half() -> None:
    global PACK_SLOTS
    from ....module.buffers import PACK_SLOTS


#: The rows of a wgmma kernel's tile: one warpgroup's m64 product.
WGMMA_ROWS = 64


def k_padded(width: int) -> int:
    """A K extent padded to whole 16-element k-steps (wgmma.cu.j2's P_PAD, H_PAD)."""
    return align(width, 16)


def wgmma_weight_offsets(P: int, H: int, elem_bytes: int, gate_hidden: bool = False) -> dict[str, int]:
    """Byte offsets of the wgmma kernels' packed weights (shared with templates/trimul/wgmma.cu.j2),
    each section 16-byte aligned: the matrices n-major with k padded to whole k-steps, in the operand
    type, the LayerNorms' gamma folded in (Wp's rows interleaved per channel as the mma strategy's);
    per output column, c1 = the row sum of the folded matrix and c2 = W beta + bias, in fp32. With
    the gate in hidden width Wgate has H rows, and Wout is not folded: the kernel scales
    layer_norm_out(z) itself, with its affine (gz, bz: fp32, H each; empty otherwise)."""
    return dict(_weight_offsets(P, H, elem_bytes, bool(gate_hidden)))


@functools.lru_cache(maxsize=256)
def _weight_offsets(P: int, H: int, elem_bytes: int, gate_hidden: bool) -> dict[str, int]:
    """wgmma_weight_offsets, once per widths (every plan's derive asks: an enumeration of the
    space builds a hundred thousand plans)."""
    gate, nz = (H, 1) if gate_hidden else (P, 0)
    sizes = [("wp", 4 * H * k_padded(P) * elem_bytes), ("wo", P * k_padded(H) * elem_bytes),
             ("wg", gate * k_padded(P) * elem_bytes),
             ("c1p", 16 * H), ("c2p", 16 * H), ("c1o", 4 * P), ("c2o", 4 * P), ("c1g", 4 * gate), ("c2g", 4 * gate),
             ("gz", nz * 4 * H), ("bz", nz * 4 * H)]
    return byte_sections(sizes)


def _wgmma_grid(groups: int, slices: int = 1):
    """Persistent blocks of `groups` warpgroups, each warpgroup taking 64-row tiles in turn: at most
    as many blocks as are resident at once, and no more than the tiles need. With column slices,
    that many blocks per slice (consecutive blocks take the same tiles, each for its slice, so a
    tile's x is read from memory once and from L2 by the others)."""

    def grid(B, N, sms, resident, _groups=groups, _slices=slices):
        tiles = ceil_div(B * N * N, WGMMA_ROWS)
        per_slice = max(1, min(ceil_div(tiles, _groups), max(1, resident) * sms // _slices))
        return _slices * per_slice, (B, N, tiles)

    return grid


#: The row statistics kernel of the sliced wgmma kernels: warps per block (_wgmma_stats.cuh.j2's
#: STATS_WARPS), a pair each, and blocks per SM at most.
STATS_WARPS, STATS_BLOCKS_PER_SM = 8, 8


def _stats_grid(B, N, sms, resident):
    pairs = B * N * N
    return max(1, min(ceil_div(pairs, STATS_WARPS), STATS_BLOCKS_PER_SM * sms)), (B, N, ceil_div(pairs, WGMMA_ROWS))


#: Whether a call with an fp32 x (under autocast) runs the projection that reads it (x_fp32) where
#: the point allows, instead of a cast before the kernels. Off: the projection's added loads and
#: stores each pass cost it more than the cast from N768 on (docs/performance.md, session 41).
READ_FP32_X = False


def reads_fp32_x(params: dict, p_slices: int) -> bool:
    """Whether the projection of a point (its slices resolved) can read an fp32 x itself (x_fp32):
    the one-stage resident projection with x in registers, unsliced."""
    return bool(params["x_registers"]) and not params["w_registers"] and p_slices <= 1


def has_row_statistics(p_slices: int, o_slices: int) -> bool:
    """Whether a point's kernels (their slices resolved) start with the rows' statistics kernel,
    which then also rounds an fp32 x (stats_cast): a sliced kernel reads the statistics."""
    return p_slices > 1 or o_slices > 1


def _rounds_fp32_x(plan: Plan) -> bool:
    """Whether a kernel of `plan` can read an fp32 x and write it rounded (xh) for the others: its
    statistics kernel always where it has one (one pass instead of a cast and the kernel's own
    read), its projection where READ_FP32_X allows."""
    p_slices = plan.context["p_slices"]
    return (has_row_statistics(p_slices, plan.context["o_slices"])
            or (READ_FP32_X and reads_fp32_x(plan.params, p_slices)))


def _with_pointer(args: tuple, name: str) -> tuple:
    """A kernel's arguments with one more pointer (`ptr name`) after its pointers, before the shape
    tail: the rows' statistics (stats) of a sliced kernel, or x_fp32's rounded x (xh, which the
    projection writes for the output kernel)."""
    pointers = tuple(a for a in args if a.startswith("ptr "))
    return (*pointers, f"ptr {name}", *args[len(pointers):])


def _with_stats(args: tuple) -> tuple:
    return _with_pointer(args, "stats")


#: The shared memory a wgmma block may take (Hopper's per-block limit: the strategy is sm_90's).
SMEM_LIMIT = DeviceLimits().max_smem_per_block


def _fewest_slices(units: int, fits) -> int:
    """The fewest slices (a divisor of `units`, the kernel's passes or row blocks) for which
    fits(count) holds, 1 where no count does (a restriction then says so)."""
    return next((count for count in range(1, units + 1) if units % count == 0 and fits(count)), 1)


def _slice_counts(params: dict, w: dict, project_smem, output_smem) -> tuple[int, int]:
    """Each kernel's column slices: the point's own count, or (0) the fewest that fit. Slices are
    the paired kernels' (their staged constants and stores); a sliced projection reads x from shared
    memory, a sliced output kernel gates on the pair width."""
    paired = params["paired_columns"]
    p_passes, o_passes = 4 * w["H"] // params["p_wn"], w["P"] // params["o_wn"]
    in_smem = lambda smem_of: lambda count: smem_of(count) <= SMEM_LIMIT
    if params["w_registers"]:  # slices of Wp's 64-row blocks, the fewest whose fragments fit in registers
        fewest_p = _fewest_w_register_slices(w["P"], w["H"], params["p_groups"])
    else:
        fewest_p = _fewest_slices(p_passes, in_smem(project_smem)) if paired and not params["x_registers"] else 1
    fewest_o = _fewest_slices(o_passes, in_smem(output_smem)) if paired and not w["gate_hidden"] else 1
    return params["p_slices"] or fewest_p, params["o_slices"] or fewest_o


#: Whether the forward's normalised projection (p_normalized_x, 32-column passes) stores each pass's
#: a and b through a pointer made once per tile, a pass adding its channels' offset (otherwise the
#: register-tight kernel remakes the whole address every pass). A switch rather than a tuned
#: parameter because it only ever saves instructions; turning it off changes that kernel's source,
#: which makes its tuned entries stale (its timing: docs/performance.md, sessions 35-36).
PROJECTION_STORE_POINTER = True

#: Whether the rows' LayerNorm statistics taken from A fragments (the projection's x in registers,
#: the output kernel's triangle sums and x) come from tensor-core products, sums and the Gram
#: matrix's diagonal, instead of two passes of unpacks, adds and shuffles: these are the
#: instructions a tile's first pass waits for. Warps with a row whose mean is large against its
#: spread take the two passes. A switch (its off side is the earlier kernels) because turning it
#: changes the tuned kernels' source: their entries go stale (timed: docs/performance.md, session 50).
FRAGMENT_STATS_BY_MMA = True

#: Whether the normalised forward projection puts a 0/1 mask into its products (its rows scaled by
#: the mask in the normalisation and in c2's k-step, every row of Wp halved) where a warp's rows all
#: have such a mask, so that its epilogue saves a multiply an output; other masks keep the multiply.
#: A switch for the same reason as the one above.
PROJECTION_MASK_FOLD = True

#: Whether the projection with x in registers writes each pair's LayerNorm mean and 1/std of x (as
#: the statistics kernel lays them out) for the output kernel, whose gate on the normalised input
#: then loads them instead of taking them again from its x (fragments or tile): the same values
#: where it holds x in registers (the same function of the same fragments), for 8 bytes a pair
#: against about a tenth of the output kernel's instructions a tile. A switch for the same reason.
OUTPUT_STATS_FROM_PROJECTION = True

#: Whether the paired output kernel makes its resident weights' and bias tiles' descriptors once per
#: kernel (a pass adding its columns' offset, a k-step a constant), as the projection does: its SASS
#: remade each product's descriptor from the address, about five uniform instructions a product,
#: some 180 a tile a warp. A switch for the same reason.
OUTPUT_DESCRIPTORS_ONCE = True

#: Whether the resident projection backward makes its lane's addresses of d(loss)/d(a or b) and of
#: d_proj once per tile, a pass adding its channels' offset, instead of remaking each from the rows'
#: batch and offset every pass (some 30 of a pass's 200 instructions in its SASS), as the forward's
#: store pointer does. A switch so that a study can time both sides (scripts/switch_study.py
#: --training).
BACKWARD_POINTERS = True


#: Whether a wide point's sliced output kernel streams its tiles' triangle sums and x through a ring
#: of 64-k chunks (templates/trimul/_wgmma_output_streamed.cuh.j2) instead of holding whole tiles:
#: at P384 H256 a tile of both is 80 KB a warpgroup, which beside a slice of Wout and Wgate left
#: room for one warpgroup, one 64-column slice and no x in flight while it computes. Streamed, each
#: warpgroup holds its slice's accumulators for the tile (up to 128 columns), its chunks land AHEAD
#: steps ahead across its tiles, and the freed shared memory takes wider slices (fewer re-reads of
#: each tile) or more warpgroups. Written without a GPU (emulated against float64); off until timed
#: (docs/performance.md, session 53), so that no tuned entry's source changes.
OUTPUT_STREAMED = False
#: The same for the sliced projection (templates/trimul/_wgmma_projection_streamed.cuh.j2): at P384
#: H256 a whole x tile a warpgroup left room for two beside the slice of Wp; streamed, four fit at
#: the same slices. Off until timed, like OUTPUT_STREAMED.
PROJECTION_STREAMED = False
#: The streamed kernels' ring of chunks a warpgroup (RING - 1 in flight ahead): slices are chosen
#: with the shallowest, then the ring deepens as far as the shared memory left allows (one block an
#: SM either way), to keep more of a warpgroup's next chunks in flight.
STREAM_RING, STREAM_RING_MAX = 3, 6
#: The most columns a streamed slice holds (the output kernel: both products' accumulators, one
#: register each; the projection: its passes').
STREAMED_MAX_COLUMNS = 128
_STREAM_K = 64
_STREAM_CHUNK_BYTES = WGMMA_ROWS * _STREAM_K * 2


def projection_streams(params: dict, w: dict) -> bool:
    """Whether a point's projection is the streamed one (PROJECTION_STREAMED): the paired kernel with
    x in shared memory (sliced: the statistics kernel's x statistics), its constants staged, swizzled
    operands, one x stage, Wp not in registers, P whole 64-k chunks and wider than 128."""
    return (PROJECTION_STREAMED and bool(params["paired_columns"]) and bool(params["consts_smem"])
            and bool(params["swizzle"]) and params["p_stages"] == 1 and not params["x_registers"]
            and not params["w_registers"] and not params["p_normalized_x"]
            and w["P"] % _STREAM_K == 0 and w["P"] > STREAMED_MAX_COLUMNS)


def output_streams(params: dict, w: dict) -> bool:
    """Whether a point's output kernel is the streamed one (OUTPUT_STREAMED): the paired kernel with
    its sums in registers, staged constants, swizzled operands, one x stage, x and its weights not
    normalised in registers, the gate on the pair width, P and H whole 64-k chunks, and P wider than
    one slice holds (so it is sliced, with the statistics kernel's x statistics)."""
    return (OUTPUT_STREAMED and bool(params["paired_columns"]) and bool(params["consts_smem"])
            and bool(params["z_registers"]) and bool(params["swizzle"]) and params["o_stages"] == 1
            and not params["o_x_registers"] and not params["o_normalized"] and not w["gate_hidden"]
            and w["P"] % _STREAM_K == 0 and w["H"] % _STREAM_K == 0 and w["P"] > STREAMED_MAX_COLUMNS)


def _deepest_ring(smem_of) -> int:
    """The deepest ring from STREAM_RING to STREAM_RING_MAX whose kernel fits shared memory
    (smem_of(ring) its bytes); STREAM_RING where none does (the plan is then infeasible)."""
    return max((ring for ring in range(STREAM_RING, STREAM_RING_MAX + 1) if smem_of(ring) <= SMEM_LIMIT),
               default=STREAM_RING)


def stats_to_output(params: dict, w: dict, o_slices: int) -> bool:
    """Whether a point's projection hands x's statistics to its output kernel (see
    OUTPUT_STATS_FROM_PROJECTION): the projection holds x's rows in registers (where it takes them),
    the output kernel its sums (its slots then sit where their transposed tile would), both
    unsliced (a sliced point has its statistics kernel), the gate on the normalised input (the only
    reader)."""
    return (OUTPUT_STATS_FROM_PROJECTION and bool(params["x_registers"])
            and bool(params["z_registers"]) and not params["w_registers"] and params["p_slices"] <= 1
            and o_slices <= 1 and bool(w["gate_normalized"]) and not w["gate_hidden"])


#: A warpgroup's two slots of a tile's x statistics in the output kernel ([mean][64], [1/std][64] fp32
#: each) where the projection hands them over (stats_to_output).
OUTPUT_STATS_SLOTS_BYTES = 2 * 2 * WGMMA_ROWS * 4


def derive(params: dict, w: dict, name: str):
    P, H, precision = w["P"], w["H"], w["precision"]
    eb, hidden = element_bytes(precision), bool(w["gate_hidden"])
    x_tile, z_tile = WGMMA_ROWS * k_padded(P) * eb, WGMMA_ROWS * k_padded(H) * eb
    off = wgmma_weight_offsets(P, H, eb, hidden)
    streamed, p_streamed = output_streams(params, w), projection_streams(params, w)

    def streamed_project_smem(slices: int, ring: int = STREAM_RING) -> int:
        # The streamed projection (projection_streams): as the resident one's, its x tiles replaced
        # by a ring of chunks; a slice past STREAMED_MAX_COLUMNS does not fit (its accumulators).
        columns = 4 * H // slices
        if columns > STREAMED_MAX_COLUMNS:
            return SMEM_LIMIT + 1
        return (align(columns * k_padded(P) * eb, 1024)
                + params["p_groups"] * align(ring * _STREAM_CHUNK_BYTES + 4 * params["p_wn"] // 2 * 24 * eb, 1024)
                + align((off["c1o"] - off["c1p"]) // slices, 1024))

    def project_smem(slices: int, ring: int = STREAM_RING) -> int:
        if p_streamed:
            return streamed_project_smem(slices, ring)
        # Every region 1024-byte aligned (the 128-byte swizzle's atoms). Resident Wp (its slice of
        # the 4H columns); per warpgroup p_stages x tiles and, per warp, the staging of a pass's a,
        # b (p_wn / 2 slots of 24 elements: its 16 rows, padded); the epilogues' constants of the
        # slice, staged once per block; with x normalised in registers, the bias tile of its c2
        # k-step (16 k of the operand type per column). With Wp in registers: the block's p_stages
        # x tiles and their pairs' statistics (three floats a pair).
        if params["w_registers"]:
            return align(params["p_stages"] * x_tile, 1024) + align(3 * WGMMA_ROWS * 4, 1024)
        return (align(4 * H // slices * k_padded(P) * eb, 1024)
                + params["p_groups"] * align(params["p_stages"] * x_tile + 4 * params["p_wn"] // 2 * 24 * eb, 1024)
                + (align((off["c1o"] - off["c1p"]) // slices, 1024) if params["consts_smem"] else 0)
                + (align(4 * H * 16 * eb, 1024) if params["p_normalized_x"] else 0))

    def streamed_output_smem(slices: int, ring: int = STREAM_RING) -> int:
        # The streamed kernel (output_streams): its slice of Wout and Wgate; per warpgroup its ring
        # of the sums' and x's chunks and (16-bit output) each warp's staged rows; the slice's
        # constants. A slice past STREAMED_MAX_COLUMNS does not fit (its accumulators).
        columns = P // slices
        if columns > STREAMED_MAX_COLUMNS:
            return SMEM_LIMIT + 1
        staged_stores = params["o_staged_stores"] and not w["out_fp32"]
        return (align(columns * k_padded(H) * eb, 1024) + align(columns * k_padded(P) * eb, 1024)
                + params["o_groups"] * align(ring * _STREAM_CHUNK_BYTES
                                             + (4 * 16 * 24 * eb if staged_stores else 0), 1024)
                + align(columns * 16, 1024))

    def output_smem(slices: int, ring: int = STREAM_RING) -> int:
        if streamed:
            return streamed_output_smem(slices, ring)
        # Resident Wout and Wgate (their slice of the P output columns; the gate in hidden width is
        # never sliced); per warpgroup o_stages x tiles, the triangle sums as they lie in memory
        # ([H][64]) and (unless they go to registers) in the operand layout with the rows' partial
        # statistics ([4][64] fp32); the epilogues' constants of the slice; with the sums and x
        # normalised in registers, the bias tiles of out's and the gate's c2 (16 k a column each);
        # with a 16-bit output staged, each warp's 16 rows of a 16-column group (rows of 24).
        transposed = 0 if params["z_registers"] else z_tile + 4 * 64 * 4
        staged_stores = params["o_staged_stores"] and not w["out_fp32"]  # (an fp32 output writes whole sectors)
        columns = P // slices
        return (align(columns * k_padded(H) * eb, 1024) + align((gate_columns(w) if hidden else columns) * k_padded(P) * eb, 1024)
                + params["o_groups"] * align(params["o_stages"] * x_tile + align(WGMMA_ROWS * H * eb, 1024) + transposed
                                             + (4 * 16 * 24 * eb if staged_stores else 0)
                                             + (OUTPUT_STATS_SLOTS_BYTES if stats_to_output(params, w, slices) else 0), 1024)
                + (align(columns * 16 if slices > 1 else off["total"] - off["c1o"], 1024) if params["consts_smem"] else 0)
                + (2 * align(P * 16 * eb, 1024) if params["o_normalized"] else 0))

    p_slices, o_slices = _slice_counts(params, w, project_smem, output_smem)
    p_ring = _deepest_ring(lambda ring: project_smem(p_slices, ring)) if p_streamed else STREAM_RING
    o_ring = _deepest_ring(lambda ring: output_smem(o_slices, ring)) if streamed else STREAM_RING
    project_smem, output_smem = project_smem(p_slices, p_ring), output_smem(o_slices, o_ring)
    stats_cast = bool(w["x_fp32"]) and has_row_statistics(p_slices, o_slices)
    x_fp32 = bool(w["x_fp32"]) and reads_fp32_x(params, p_slices) and not stats_cast
    handed_stats = stats_to_output(params, w, o_slices)
    context = {"P": P, "H": H, "gate_normalized": cuda_bool(w["gate_normalized"]), "mma_kind": MMA_KINDS[precision],
               "gate_hidden": hidden, "out_fp32": bool(w["out_fp32"]), "x_fp32": x_fp32, "stats_cast": stats_cast,
               "off": off, "consts_smem": params["consts_smem"],
               "paired_columns": params["paired_columns"], "early_x_fetch": params["early_x_fetch"],
               "x_registers": params["x_registers"], "z_registers": params["z_registers"],
               "w_registers": params["w_registers"], "o_x_registers": params["o_x_registers"],
               "p_mask_early": params["p_mask_early"], "p_normalized_x": params["p_normalized_x"],
               "o_normalized": params["o_normalized"],
               "o_staged_stores": params["o_staged_stores"], "projection_store_pointer": PROJECTION_STORE_POINTER,
               "fragment_stats_by_mma": FRAGMENT_STATS_BY_MMA,
               "projection_mask_fold": PROJECTION_MASK_FOLD, "stats_to_output": handed_stats,
               "output_descriptors_once": OUTPUT_DESCRIPTORS_ONCE,
               "o_unrolled_fetch": params["o_unrolled_fetch"],
               "wgmma_rs_widths": sorted({wn for wn, rs in ((params["p_wn"], params["x_registers"]),
                                                              (WGMMA_ROWS, params["w_registers"]),
                                                              (params["o_wn"], params["z_registers"])) if rs}),
               "wgmma_rs_first_widths": [WGMMA_ROWS] if params["w_registers"] else [],
               "p_groups": params["p_groups"], "p_wn": params["p_wn"], "p_slices": p_slices, "o_slices": o_slices,
               "p_stages": params["p_stages"], "o_stages": params["o_stages"], "swizzle": cuda_bool(params["swizzle"]),
               "o_groups": params["o_groups"], "o_wn": params["o_wn"],
               "o_streamed": streamed, "o_stream_stages": o_ring,
               "p_streamed": p_streamed, "p_stream_stages": p_ring,
               "wgmma_widths": sorted({params["p_wn"], params["o_wn"]}), "p_smem": project_smem, "o_smem": output_smem}
    project_args = _with_stats(PROJECT_ARGS) if p_slices > 1 else _with_pointer(PROJECT_ARGS, "xh") if x_fp32 else PROJECT_ARGS
    if handed_stats:  # written by the projection, read by the output kernel
        project_args = _with_stats(project_args)
    kernels = (Kernel(name, 128 * params["p_groups"], project_smem, project_args,
                      _wgmma_grid(1 if params["w_registers"] else params["p_groups"], p_slices)),
               Kernel(f"{name}_output", 128 * params["o_groups"], output_smem,
                      _with_stats(OUTPUT_ARGS) if o_slices > 1 or handed_stats else OUTPUT_ARGS,
                      _wgmma_grid(params["o_groups"], o_slices)))
    if has_row_statistics(p_slices, o_slices):  # the rows' statistics first (run_three_steps)
        stats_args = ("ptr x", "ptr stats", *(("ptr xh",) if stats_cast else ()), "i32 B", "i32 N", "i32 num_tiles")
        kernels = (Kernel(f"{name}_stats", 32 * STATS_WARPS, 0, stats_args, _stats_grid), *kernels)
    return context, kernels


def _wgmma_columns_divide(plan: Plan, limits: DeviceLimits) -> bool:
    """Whole 16-byte chunks per row, and passes that tile the projection's 4H and the output's P
    columns (and H, the gate's, where it is in hidden width)."""
    P, H, o_wn = plan.widths["P"], plan.widths["H"], plan.params["o_wn"]
    return (P % 8 == 0 and H % 8 == 0 and (4 * H) % plan.params["p_wn"] == 0 and P % o_wn == 0
            and (not plan.widths.get("gate_hidden") or H % o_wn == 0))


def _slices_apply(plan: Plan, limits: DeviceLimits) -> bool:
    """A point's own slice counts (not 0, the fewest that fit) are whole passes of a kernel that
    can be sliced: the paired kernels, a sliced projection with x in shared memory, a sliced output
    kernel with the gate on the pair width (the projection with Wp in registers slices its row
    blocks: its own restriction)."""
    params, w = plan.params, plan.widths
    p_slices, o_slices = params["p_slices"], params["o_slices"]
    p_ok = p_slices <= 1 or params["w_registers"] or (params["paired_columns"] and not params["x_registers"]
                                                      and (4 * w["H"]) % (p_slices * params["p_wn"]) == 0)
    o_ok = o_slices <= 1 or (params["paired_columns"] and not w.get("gate_hidden")
                             and w["P"] % (o_slices * params["o_wn"]) == 0)
    return p_ok and o_ok


def _x_fragments_fit(plan: Plan, limits: DeviceLimits) -> bool:
    """x in registers takes k_padded(P) / 4 registers a thread for its fragments: up to P = 128,
    beside two passes' accumulators (past it, the sliced kernels read x from shared memory)."""
    return not plan.params["x_registers"] or k_padded(plan.widths["P"]) <= 128


def w_registers_fragments(P: int, H: int, p_groups: int, slices: int = 1) -> int:
    """The registers a thread of the projection with Wp in registers holds its fragments in: its
    warpgroup's share of its block's slice of Wp's 64-row blocks (H / 16 of them), k_padded(P) / 4
    each."""
    return H // 16 // (p_groups * slices) * (k_padded(P) // 4)


def _fewest_w_register_slices(P: int, H: int, p_groups: int) -> int:
    """The fewest slices of Wp's row blocks (a divisor of their count per warpgroup) whose fragments
    fit W_REGISTERS_FRAGMENTS_MAX, 1 where none does (the restriction then says so)."""
    blocks = H // 16 // p_groups if H % 16 == 0 and (H // 16) % p_groups == 0 else 0
    return _fewest_slices(blocks, lambda count: w_registers_fragments(P, H, p_groups, count) <= W_REGISTERS_FRAGMENTS_MAX)


#: What a thread of that projection may give its fragments: beside two row blocks' accumulators
#: (64) and the epilogue's ~40, within 255 registers (one block of 2 warpgroups per SM).
W_REGISTERS_FRAGMENTS_MAX = 128


def _w_registers_fit(plan: Plan, limits: DeviceLimits) -> bool:
    """Wp in registers: the warpgroups share their block's slice of Wp's 64-row blocks evenly (H a
    multiple of 16), its fragments fit beside the accumulators (at most 2 warpgroups: 4 leave 128
    registers a thread; a point's slices, or the fewest that fit), two x stages (the block computes
    one tile while the next lands), and not with x in registers. A variant of the paired kernels
    (its epilogue folds the sigmoid's halves as theirs do, with their tanh)."""
    params, P, H = plan.params, plan.widths["P"], plan.widths["H"]
    if not params["w_registers"]:
        return True
    groups = params["p_groups"]
    slices = params["p_slices"] or _fewest_w_register_slices(P, H, groups)
    return (params["paired_columns"] and H % 16 == 0 and (H // 16) % (groups * slices) == 0 and groups <= 2
            and params["p_stages"] == 2 and w_registers_fragments(P, H, groups, slices) <= W_REGISTERS_FRAGMENTS_MAX
            and not params["x_registers"])


def _swizzle_applies(plan: Plan, limits: DeviceLimits) -> bool:
    """The swizzle takes operands whose K is whole 64-element blocks: P (x, the weights on it) or H
    (the triangle sums, Wout); elsewhere the point would repeat the unswizzled one."""
    return not plan.params["swizzle"] or k_padded(plan.widths["P"]) % 64 == 0 or k_padded(plan.widths["H"]) % 64 == 0


def _paired_columns_staged(plan: Plan, limits: DeviceLimits) -> bool:
    """Paired columns reorder the epilogues' constants as they stage them in shared memory."""
    return not plan.params["paired_columns"] or plan.params["consts_smem"]


def _x_registers_paired(plan: Plan, limits: DeviceLimits) -> bool:
    """x in registers is a variant of the paired projection (one x stage, fetched as soon as the
    warps hold their rows, so not with early_x_fetch, which it makes moot)."""
    return not plan.params["x_registers"] or (plan.params["paired_columns"] and plan.params["p_stages"] == 1
                                              and not plan.params["early_x_fetch"])


def _z_registers_paired(plan: Plan, limits: DeviceLimits) -> bool:
    """The triangle sums in registers are a variant of the paired output kernel with the gate on the
    pair width (the hidden gate rewrites the sums in shared memory), for whole 16-channel k-steps."""
    return not plan.params["z_registers"] or (plan.params["paired_columns"] and not plan.widths.get("gate_hidden")
                                              and plan.widths["H"] % 16 == 0)


def _output_x_registers_with_z(plan: Plan, limits: DeviceLimits) -> bool:
    """The output kernel's x in registers is a variant of its sums in registers (z_registers: the
    paired kernel, gate on P), for P up to 128 with one x stage (the tile is free as soon as the
    warps hold their rows). x's fragments sit beside the sums' and two products' accumulators: at
    4 warpgroups (128 registers a thread) it spilled, and at 3 (170) with 128-column passes."""
    params = plan.params
    fits = params["o_groups"] <= 2 or (params["o_groups"] == 3 and params["o_wn"] <= 64)
    return not params["o_x_registers"] or (params["z_registers"] and params["o_stages"] == 1 and fits
                                           and k_padded(plan.widths["P"]) <= 128)


def _mask_early_resident(plan: Plan, limits: DeviceLimits) -> bool:
    """The mask loaded a tile ahead is the resident projection's (Wp in registers loads its own)."""
    return not plan.params["p_mask_early"] or not plan.params["w_registers"]


def _normalized_x_in_registers(plan: Plan, limits: DeviceLimits) -> bool:
    """x normalised in registers is a variant of x in registers (the paired, unsliced projection)."""
    return not plan.params["p_normalized_x"] or (plan.params["x_registers"] and plan.params["p_slices"] <= 1)


def _output_normalized_in_registers(plan: Plan, limits: DeviceLimits) -> bool:
    """The output's operands normalised in registers are a variant of its sums and x in registers
    (o_x_registers), unsliced, with the gate on the pair width."""
    params = plan.params
    return not params["o_normalized"] or (params["o_x_registers"] and params["o_slices"] <= 1
                                          and not plan.widths.get("gate_hidden"))


def _output_staged_with_sums_in_registers(plan: Plan, limits: DeviceLimits) -> bool:
    """The output's staged stores are a variant of the paired output kernel with its sums in
    registers (z_registers: the gate on P)."""
    return not plan.params["o_staged_stores"] or plan.params["z_registers"]


def _early_fetch_has_one_stage(plan: Plan, limits: DeviceLimits) -> bool:
    """The early x fetch is the one-stage projection's (two stages already fetch a tile ahead)."""
    return not plan.params["early_x_fetch"] or plan.params["p_stages"] == 1


def _unrolls(P: int) -> bool:
    """Whether fetch_tile's unrolled copies apply to rows of width P: unpadded (P a multiple of 16),
    their 16-byte chunks and 16 dividing one another."""
    chunks = P // 8
    return P % 16 == 0 and (chunks % 16 == 0 or 16 % chunks == 0)


def _unrolled_fetch_applies(plan: Plan, limits: DeviceLimits) -> bool:
    """The output kernel's unrolled copies change it only where its x rows' chunks unroll (_unrolls)."""
    return not plan.params["o_unrolled_fetch"] or _unrolls(plan.widths["P"])


def _wgmma_accumulators_fit(plan: Plan, limits: DeviceLimits) -> bool:
    """At most 128 fp32 accumulators per thread (the projection holds two passes', the output kernel
    two products'), and at most 64 where a block has 4 warpgroups (65536 registers per SM: 128 per
    thread); the projection's 128 only up to 2 warpgroups (at 3, 170 registers a thread left it
    too few for its epilogue: it spilled); with paired columns, at most 32 in an output kernel of 4
    warpgroups (at 64 it spilled a register)."""
    p, o = plan.params["p_wn"], plan.params["o_wn"]
    o_max_at_4 = 32 if plan.params.get("paired_columns") else 64
    p_max_at_4 = 32 if plan.params.get("x_registers") else 64  # (x's 32 fragment registers: 64 spilled)
    return (p <= (p_max_at_4 if plan.params["p_groups"] == 4 else 64 if plan.params["p_groups"] == 3 else 128)
            and o <= (o_max_at_4 if plan.params["o_groups"] == 4 else 128))


#: The weights the fold kernel reads, each a pointer variable of the template.
FOLD_WEIGHTS = parameter_names(True)
FOLD_TEMPLATE = FusedTemplate("trimul", "pack_wgmma", lambda context: {"": source_arguments()})
OPERAND_ELEMENT_BYTES = 2


@functools.lru_cache(maxsize=64)
def fold_context(P: int, H: int, gate_normalized: bool, gate_hidden: bool, operand: str, sources: Sources) -> dict:
    """The fold kernel's context: widths, the padded k extents, each section's byte offset
    (off_<section>) and where each weight lies (weights: variable name -> (source, offset) or None).
    Cached (every training call packs its weights): callers must not change the dict."""
    offsets = wgmma_weight_offsets(P, H, OPERAND_ELEMENT_BYTES, gate_hidden)
    weights = {name.replace(".", "_"): sources.places.get(name) for name in FOLD_WEIGHTS}
    return {"P": P, "H": H, "G": H if gate_hidden else P, "p_pad": k_padded(P), "h_pad": k_padded(H),
            "operand": operand, "gate_normalized": gate_normalized, "gate_hidden": gate_hidden,
            "weights": tuple(sorted(weights.items())), "max_sources": MAX_SOURCES,
            **{f"off_{name}": offset for name, offset in offsets.items()}}


def render_fold(kind: str, P: int, H: int, operand: str, gate_normalized: bool = True, gate_hidden: bool = False,
                sources: Sources | None = None):
    """The fold kernel's source for weights stored in `kind`, its signature checked (by default
    for the module's own parameters, with biases)."""
    sources = sources or Sources.each_its_own(FOLD_WEIGHTS)
    return FOLD_TEMPLATE.render(kind, **fold_context(P, H, gate_normalized, gate_hidden, operand, sources))


@functools.lru_cache(maxsize=64)
def fold_bytes(P: int, H: int, gate_hidden: bool) -> int:
    """The size of the wgmma kernels' pack."""
    return wgmma_weight_offsets(P, H, OPERAND_ELEMENT_BYTES, gate_hidden)["total"]


def pack_wgmma(tensors: list, sources: Sources, P: int, H: int, gate_normalized: bool, gate_hidden: bool,
               operand: str, out=None):
    """The wgmma kernels' packed bytes in `operand` ("bfloat16"/"float16") from the call's weight
    tensors (all of one storage type, contiguous: packing.readable), on the current stream, into
    `out` (fold_bytes bytes) or a per-call buffer (packing.launch_pack). One warp per output row."""
    found = fold_context(P, H, gate_normalized, gate_hidden, operand, sources)
    rows = 4 * H + P + found["G"]
    return launch_pack(FOLD_TEMPLATE, tensors, found["off_total"], -(-rows // (THREADS // 32)), out=out, **found)


def pack(module, plan, weights):
    """`weights` folded for this call into the module's pack buffer (pack_wgmma), as the caller
    holds them where the fold kernel reads them so (packing.readable), else as fp32 copies (mixed
    dtypes: an fp32 LayerNorm in a bf16 model; strided tensors)."""
    if PACK_SLOTS is None:
        _import_torch_half()
    w = module.widths
    P, H, hidden = w["P"], w["H"], bool(w.get("gate_hidden"))
    tensors = list(weights.tensors)
    if not packing.readable(tensors):
        tensors = [t.detach().float().contiguous() for t in tensors]
    out = module._pack_buffer(PACK_SLOTS[0], fold_bytes(P, H, hidden), tensors[0].device)
    return pack_wgmma(tensors, weights.sources, P, H, bool(w["gate_normalized"]), hidden, plan.precision,
                      out)


#: Paired columns keep a warp's offset into a and b (B*H*N*N elements) in 16-byte units in 32 bits
#: (_wgmma_projection.cuh.j2: paired_row_base); from here on a call runs the same point unpaired (and with x
#: through shared memory), whose stores index in 64 bits.
PAIRED_MAX_AB_ELEMENTS = 2**34


def _unpaired(plan: Plan, B: int, N: int) -> bool:
    """Whether a call of B x N pairs runs `plan` unpaired (its a and b past PAIRED_MAX_AB_ELEMENTS)."""
    return bool(plan.params.get("paired_columns")) and B * plan.widths["H"] * N * N >= PAIRED_MAX_AB_ELEMENTS


def for_call(spec, plan: Plan, B: int, N: int, fp32_output: bool = False, fp32_input: bool = False) -> Plan | None:
    """The plan (of `spec`, the op's) a call of B x N pairs runs instead of `plan`, or None where
    `plan` runs it: unpaired past PAIRED_MAX_AB_ELEMENTS (x, the sums and Wp in registers are
    variants of the paired kernels: they go too), with its output kernel writing fp32 where the call
    wants an fp32 output (fp32_output), and with a kernel reading and rounding an fp32 x where the
    call gives one (fp32_input) and one can (_rounds_fp32_x: the statistics kernel, or the
    projection; else the caller casts x)."""
    unpaired = _unpaired(plan, B, N)
    reads_x = fp32_input and not unpaired and _rounds_fp32_x(plan)
    if not (unpaired or fp32_output or reads_x):
        return None
    params = {**plan.params, "paired_columns": False, "x_registers": False, "z_registers": False, "w_registers": False,
              **REGISTER_VARIANTS_OFF} if unpaired else plan.params
    # The fp32 output and input keep every other parameter: the same arithmetic, so the values
    # round to the 16-bit kernels' bit for bit (docs/ops.md); the LayerNorm statistics' summation
    # order differs between x in registers and x in shared memory, so that point must not change either.
    widths = {**plan.widths, **({"out_fp32": 1} if fp32_output else {}), **({"x_fp32": 1} if reads_x else {})}
    return spec.plan(plan.strategy, params, widths, plan.precision)


#: Per tuned variant, the variants its calls run instead (for_call), by (unpaired, fp32 output):
#: planned once, not on every call (a plan's derive costs more host time than a small call).
_instead: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def variant_for_call(spec, variant, B: int, N: int, fp32_output: bool, device_index: int, fp32_input: bool = False):
    """The variant a call of B x N pairs runs: `variant`, or the one for_call plans instead."""
    key = (_unpaired(variant.plan, B, N), fp32_output, fp32_input and _rounds_fp32_x(variant.plan))
    if key == (False, False, False):
        return variant
    instead = _instead.setdefault(variant, {})
    if key not in instead:
        plan = for_call(spec, variant.plan, B, N, fp32_output, fp32_input)
        instead[key] = variant if plan is None else runtime.variant_of(plan, device_index)
    return instead[key]


def run(module, variant, weights, x, mask, out) -> None:
    """An `out` of 4-byte elements (fp32: the caller wants an fp32 output): the output kernel writes
    fp32; an fp32 x (under autocast): the projection reads it where it can (x_fp32)."""
    variant = variant_for_call(module.op, variant, x.shape[0], x.shape[1], out.element_size() == 4, x.get_device(),
                               x.element_size() == 4)
    packed = pack(module, variant.plan, weights)  # alive until every launch is enqueued
    run_three_steps(module, variant, x, mask, out, packed)


# ---- the projection's backward: a projection kernel with the gates' chain rule as its epilogue ----

#: Its arguments: x, the mask and the pack as the forward's; d(loss)/d(a) and d(loss)/d(b)
#: channel-major (B*H, N*N); d_proj, the four pre-activations' gradients (B, 4, H, N*N).
PROJECT_BACKWARD_ARGS = ("ptr x", "ptr mask", "ptr w", "ptr d_a", "ptr d_b", "ptr d_proj", "i32 B", "i32 N",
                         "i32 num_tiles", "i32 mask_is_float")


#: The variants of the paired kernels with x and the sums in registers, off: a point that leaves
#: those kernels (unpaired, Wp in registers, a backward's projection) leaves them too.
REGISTER_VARIANTS_OFF = {"o_x_registers": False, "p_normalized_x": False, "o_normalized": False, "o_staged_stores": False}

#: The output kernel's unrolled copies, off: the training path's projection kernels (Wp in
#: registers, the resident backward) render beside the output kernel they were built with.
UNROLLED_FETCH_OFF = {"o_unrolled_fetch": False}


def _first_default_point(spec, precision: str) -> dict:
    """The first wgmma default point of `spec` (the op's) in `precision`."""
    return next(params for s, params in spec.at(precision).default_points if s == "wgmma")


def w_registers_point(spec, precision: str) -> dict:
    """The first default point of `spec` (the op's) with the projection's Wp in registers (two
    warpgroups, two x stages)."""
    return {**_first_default_point(spec, precision), "x_registers": False, "w_registers": True, "p_groups": 2, "p_stages": 2,
            "p_mask_early": False, **REGISTER_VARIANTS_OFF, **UNROLLED_FETCH_OFF}


#: Which projection kernel a 16-bit training step's backward recomputes the pre-activations on:
#: "resident" (the forward's kernel with Wp resident in shared memory, paired columns and x in
#: registers, its epilogue the gates' chain rule, d(loss)/d(a) and d(loss)/d(b) read a pass ahead
#: through the warp's staging) where its point is feasible and unsliced, else "w_registers".
#: Measured on an H100 (session 25): 344.7 against 397.2 µs at N512, 1256.2 against 1526.8 at N1024.
#: The tests run both.
BACKWARD_PROJECTION = "resident"
#: The resident backward's warpgroups a block: its chain rule's registers beside x's fragments
#: take more than the 128 a thread that four warpgroups leave with the gradients four passes ahead
#: (64 bytes spilled); two passes ahead, four fit without a spill (untimed: session 53's study line).
RESIDENT_BACKWARD_GROUPS = 3
#: Passes ahead that the resident backward loads d(loss)/d(a) and d(loss)/d(b) (the largest divisor
#: of its passes a tile up to this; a tile's last passes load the next tile's first). The measured
#: best (docs/performance.md); deeper rings cost registers and code for little.
GRADIENT_PASSES_AHEAD = 4


#: Whether the resident backward normalises x in registers as p_normalized_x does (its folds then
#: come from the products; every row of Wp halved): fewer instructions a row in a kernel whose
#: epilogue is its bound (measured faster at N512-N1024: docs/performance.md).
BACKWARD_NORMALIZED_X = True


def _resident_backward_plan(spec, precision: str, widths: dict, normalized_x: bool = False,
                            groups: int = RESIDENT_BACKWARD_GROUPS) -> Plan | None:
    """The first default point (x in registers, paired columns) with `groups` warpgroups, where it is
    feasible at these widths and keeps all of Wp in one block (x normalised in registers where
    `normalized_x`)."""
    point = {**_first_default_point(spec, precision), "p_groups": groups, "o_groups": 1, "o_wn": 16, "o_stages": 1,
             "z_registers": False, **REGISTER_VARIANTS_OFF, **UNROLLED_FETCH_OFF, "p_normalized_x": normalized_x}
    plan = spec.at(precision).plan("wgmma", point, widths)
    if spec.infeasible(plan, DeviceLimits()) or not plan.params["paired_columns"] or plan.context["p_slices"] > 1:
        return None
    return plan


@functools.lru_cache(maxsize=64)
def _backward_plan(spec, precision: str, width_items: tuple, layout: str, passes_ahead: int,
                   normalized_x: bool = False, pointers: bool = False,
                   groups: int = RESIDENT_BACKWARD_GROUPS) -> Plan | None:
    # The swizzle where P allows it. The w_registers backward takes two slices of Wp's row blocks a
    # block where they divide: its chain rule holds d(loss)/d(a) beside both accumulator sets, which
    # with the forward's share of Wp spills (at P = H = 128). The output kernel's parameters are the
    # smallest that fit any P: it is rendered beside the projection but not launched.
    view = spec.at(precision)
    plan = _resident_backward_plan(spec, precision, dict(width_items), normalized_x, groups) if layout == "resident" else None
    if plan is None:
        base = {**w_registers_point(spec, precision), "o_groups": 1, "o_wn": 16, "o_stages": 1, "z_registers": False}
        plans = [view.plan("wgmma", {**base, "swizzle": swizzle, "p_slices": slices}, dict(width_items))
                 for swizzle in (True, False) for slices in (2, 0)]
        plan = next((p for p in plans if not spec.infeasible(p, DeviceLimits())), None)
    if plan is None:
        return None
    name = f"{plan.kernel_name}_backward"
    *stats, project, _output = plan.kernels
    kernels = (Kernel(name, project.threads, project.smem_bytes,
                      _with_stats(PROJECT_BACKWARD_ARGS) if stats else PROJECT_BACKWARD_ARGS, project.grid),)
    if stats:
        kernels = (dataclasses.replace(stats[0], name=f"{name}_stats"), *kernels)
    context = {**plan.context, "projection_backward": True, "gradient_passes_ahead": passes_ahead,
               "backward_pointers": pointers}
    return dataclasses.replace(plan, context=context, kernels=kernels, kernel_name=name)


def backward_plan(spec, precision: str, widths: dict) -> Plan | None:
    """The plan (of `spec`, the op's) whose projection kernel a 16-bit training step's backward
    runs at a module's widths (on the kernel BACKWARD_PROJECTION names), declared with the
    backward's arguments and named apart; None where no such point is feasible."""
    return _backward_plan(spec, precision, tuple(sorted({**widths, "out_fp32": 0}.items())), BACKWARD_PROJECTION,
                          GRADIENT_PASSES_AHEAD, BACKWARD_NORMALIZED_X, BACKWARD_POINTERS, RESIDENT_BACKWARD_GROUPS)


#: (op, precision, the module's widths in its order, arch, the switches backward_plan reads) -> the
#: backward projection's variant: built apart from runtime.variant_of, whose cache keys a plan by its
#: point and widths, which an inference plan of the same point shares; keyed by what a call has at
#: hand, so that a training step's lookup sorts no plan's parameters.
_backward_variants: dict = {}


def _backward_variant(module, x, precision: str):
    arch = runtime.device_info(x.get_device()).arch
    key = (module.op, precision, tuple(module.widths.items()), arch, BACKWARD_PROJECTION, GRADIENT_PASSES_AHEAD,
           BACKWARD_NORMALIZED_X, BACKWARD_POINTERS, RESIDENT_BACKWARD_GROUPS)
    variant = _backward_variants.get(key)
    if variant is None:
        variant = _backward_variants[key] = runtime.build_variant(backward_plan(module.op, precision, module.widths), arch)
    return variant


#: Whether 16-bit training steps take the projection kernels: the forward's a and b from the
#: projection kernel the module's inference runs, d_proj from the backward's (BACKWARD_PROJECTION).
#: The four hidden-width pre-activations are never made, so the step's peak falls by a third
#: (docs/performance.md, session 24).
TRAINING_PROJECTION_KERNELS = True


def projection_kernels_apply(module, x, precision: str) -> bool:
    """Whether run_projection_forward and run_projection_backward take a training call: 16-bit, on
    a GPU with warpgroup products, their points feasible at the module's widths, a and b within the
    paired offsets."""
    if (not TRAINING_PROJECTION_KERNELS or precision not in HALF_PRECISIONS
            or runtime.device_info(x.device.index or 0).capability < (9, 0)):
        return False
    B, N, H = x.shape[0], x.shape[1], module.widths["H"]
    return (B * H * N * N < PAIRED_MAX_AB_ELEMENTS
            and backward_plan(module.op, precision, module.widths) is not None
            and _first_feasible_default(module.op, precision, tuple(sorted(module.widths.items()))) is not None)


def pack_given(w: dict, widths: dict, operand: str):
    """The fold kernel's pack of the weights `w` (parameter name -> tensor; the biases may be
    absent) in a per-call buffer: the weights a closed form computes with, which need not be the
    module's parameters (a compiled graph's inputs, an autocast's casts)."""
    names = tuple(name for name in FOLD_WEIGHTS if name in w)
    tensors = [w[name] for name in names]
    if not packing.readable(tensors):
        tensors = [t.detach().float().contiguous() for t in tensors]
    return pack_wgmma(tensors, _each_its_own(names), widths["P"], widths["H"], bool(widths["gate_normalized"]),
                      bool(widths.get("gate_hidden")), operand)


@functools.lru_cache(maxsize=16)
def _each_its_own(names: tuple) -> Sources:
    return Sources.each_its_own(names)


def forward_projection_variant(module, x, precision: str):
    """The variant whose projection kernel a training step's forward runs: the one the module's
    inference runs for this length where that is a wgmma variant of its own (tuned, or a default
    already built), else the first default point feasible at its widths. Its a and b are what the
    backward's projection kernel recomputes: every wgmma projection computes the same values."""
    chosen = module.variant_for(x.shape[1], x.device, precision)
    chosen = getattr(chosen, "variant", chosen)  # a first_use.Pending: its default variant
    if chosen is not None and chosen.plan.strategy == "wgmma" and not chosen.plan.params.get("w_registers"):
        return chosen
    return runtime.variant_of(_first_feasible_default(module.op, precision, tuple(sorted(module.widths.items()))),
                              x.get_device())


@functools.lru_cache(maxsize=64)
def _first_feasible_default(spec, precision: str, width_items: tuple) -> Plan | None:
    """The first wgmma default point feasible at these widths, as a plan (None: none is)."""
    view = spec.at(precision)
    widths = {**dict(width_items), "out_fp32": 0}
    plans = (view.plan("wgmma", params, widths) for strategy, params in view.default_points if strategy == "wgmma")
    return next((plan for plan in plans if not spec.infeasible(plan, DeviceLimits())), None)


def run_projection_forward(module, x, mask, precision: str, packed) -> Projected:
    """a and b ((2, B*H, N*N), channel-major: the result's `ab`) from x (in the operand type,
    contiguous), the mask (bool or fp32, (B, N, N)) and the weights' pack (pack_given): the
    projection kernel of forward_projection_variant, as the forward's kernels compute them
    (projection_kernels_apply must hold). The result holds the variant's output launch too
    (run_output_forward)."""
    variant = forward_projection_variant(module, x, precision)
    return run_projection(variant, x, mask, packed, module.widths["H"])


def run_output_forward(projected: Projected, z, packed):
    """The output (B*N*N, P) of the variant whose projection made `projected`, from the triangle
    sums z ((B*H, N, N) from its a and b) and x: its output kernel (the output LayerNorm, both
    products and the gate in one pass), as a module's inference computes it."""
    import torch

    (output,) = projected.launches
    x = projected.x
    out = torch.empty((x.shape[0] * x.shape[1] * x.shape[2], x.shape[3]), device=x.device, dtype=x.dtype)
    output.named(x=x.data_ptr(), z=z.data_ptr(), w=packed.data_ptr(), out=out.data_ptr(),
                 **_taken(output, projected.stats))
    return out


def run_projection_backward(module, x, mask, d_a, d_b, precision: str, packed, row_statistics=None):
    """d(loss)/d(the four pre-activations) (B, 4, H, N*N), the closed form's d_proj, from x (in the
    operand type, contiguous), the mask (bool or fp32, (B, N, N)), d(loss)/d(a) and d(loss)/d(b)
    ((B*H, N, N), channel-major) and the weights' pack (pack_given, the forward's): the projections
    and gates recomputed from x as the forward's kernel computes them, the chain rule in the
    epilogue (projection_kernels_apply must hold). row_statistics: x's rows' LayerNorm mean and
    1/std as a (2, B*N*N) fp32 tensor (layer_norm_rows.statistics), which a sliced kernel then
    reads instead of running its statistics kernel."""
    import torch

    variant = _backward_variant(module, x, precision)
    B, N, H = x.shape[0], x.shape[1], module.widths["H"]
    *statistics, launch = variant.launches(x.get_device(), B, N)
    if statistics and row_statistics is not None:
        held_stats, stats = row_statistics, {"stats": row_statistics.data_ptr()}
    else:
        held_stats, stats = _row_statistics(statistics, x, {})
    d_proj = torch.empty((B, 4, H, N * N), device=x.device, dtype=x.dtype)
    launch.named(x=x.data_ptr(), mask=mask.data_ptr(), w=packed.data_ptr(), d_a=d_a.data_ptr(), d_b=d_b.data_ptr(),
                 d_proj=d_proj.data_ptr(), mask_is_float=int(mask.dtype is torch.float32), **stats)
    del held_stats
    return d_proj


WGMMA = Strategy(
    name="wgmma",
    summary="Hopper tensor cores: wgmma projection kernel (LayerNorm folded into its epilogue) -> cuBLAS bmm -> "
            "wgmma output kernel",
    # Per kernel: warpgroups per block (each works alone on 64-row tiles, sharing the block's
    # resident weights) and the columns of one wgmma pass (its n: wn / 2 accumulators per thread);
    # each kernel's x tiles per warpgroup (2: the next one in flight; 1: room for more groups); the
    # operands' layout in shared memory (swizzle: 128-byte swizzle where K is a multiple of 64);
    # whether the epilogues read their per-column constants from shared memory (staged once per
    # block) instead of global memory; whether the epilogues pair their columns (paired_columns: each
    # lane holds two channels' outputs, packed and staged by stmatrix in the projection, and the
    # sigmoid's halves folded into the staged constants, fewer instructions per output); whether a
    # one-stage projection fetches the next tile's x as soon as this tile's last products have read
    # it (early_x_fetch: the load runs under the last epilogue instead of before the next tile);
    # whether each warp of a paired one-stage projection holds its 16 rows of the x tile in
    # registers as the products' A operand (x_registers: loaded and normalised once per tile, the
    # passes then read only Wp from shared memory, and the tile is free for the next fetch at once);
    # whether each warp of the paired output kernel holds its 16 rows of the triangle sums in
    # registers as the out product's A operand (z_registers: ldmatrix.trans from the staging as the
    # sums lie in memory, no transposing pass through shared memory); the slices of each kernel's
    # weight rows (p_slices of the 4H projection columns, o_slices of the P output columns; 0: the
    # fewest whose block fits in shared memory, 1 at P = H = 128): each block keeps one slice
    # resident and takes every tile for those columns, so that wide P and H fit, the rows'
    # LayerNorm statistics then from a kernel of their own; whether the projection holds Wp in
    # registers with its products' operands swapped (w_registers: each warpgroup a share of Wp's
    # 64-row blocks as A, every warpgroup of the block on the same x tile as B, a and b stored
    # from the accumulators: no resident Wp, no staging); whether the output kernel also holds its
    # x rows in registers as the gate product's A operand (o_x_registers, with z_registers); whether
    # the resident projection loads each tile's mask a tile ahead (p_mask_early: the global
    # load's latency under a whole tile instead of under its first pass); whether a projection with
    # x in registers normalises its rows there before the products (p_normalized_x: its epilogue
    # then applies no LayerNorm fold, c2 coming in through one more k-step, the gates' weights
    # halved once per block: about half the epilogue's instructions); whether the output kernel
    # with its sums and x in registers normalises both there likewise (o_normalized); whether that
    # paired output kernel writes 16-bit rows through a per-warp staging, 16 bytes a lane, whole
    # sectors (o_staged_stores), instead of 4 bytes a lane from the accumulators; whether the
    # output kernel copies its x and triangle-sum tiles unrolled, each thread's pieces at constant
    # offsets from its first (o_unrolled_fetch: a piece costs its copy and an address, not a
    # division, a swizzle and 64-bit address arithmetic each).
    space={"p_groups": (1, 2, 3, 4), "p_wn": (32, 64, 128), "p_stages": (1, 2),
           "o_groups": (1, 2, 3, 4), "o_wn": (16, 32, 64, 128), "o_stages": (1, 2), "swizzle": (False, True),
           "consts_smem": (False, True), "paired_columns": (False, True), "early_x_fetch": (False, True),
           "x_registers": (False, True), "z_registers": (False, True),
           "p_slices": (0, 2, 4), "o_slices": (0, 2, 4), "w_registers": (False, True), "o_x_registers": (False, True),
           "p_mask_early": (False, True), "p_normalized_x": (False, True),
           "o_normalized": (False, True), "o_staged_stores": (False, True),
           "o_unrolled_fetch": (False, True)},
    derive=derive,
    restrictions=(WGMMA_ON_SM90,
                  Restriction("rows must be whole 16-byte chunks and passes must tile the columns",
                              _wgmma_columns_divide, on_point=True),
                  Restriction("at most 128 accumulators per thread", _wgmma_accumulators_fit, on_point=True),
                  Restriction("paired columns stage their constants in shared memory (consts_smem)",
                              _paired_columns_staged, on_point=True),
                  Restriction("the early x fetch is for one x stage (p_stages 1)", _early_fetch_has_one_stage,
                              on_point=True),
                  Restriction("the mask loaded a tile ahead is the resident projection's (not with Wp in registers)",
                              _mask_early_resident, on_point=True),
                  Restriction("x in registers is the paired, one-stage projection's", _x_registers_paired,
                              on_point=True),
                  Restriction("x normalised in registers is a variant of x in registers, unsliced",
                              _normalized_x_in_registers, on_point=True),
                  Restriction("the output's operands normalised in registers are a variant of its x in registers, "
                              "unsliced, gate on P", _output_normalized_in_registers, on_point=True),
                  Restriction("the output's staged stores are a variant of its sums in registers",
                              _output_staged_with_sums_in_registers, on_point=True),
                  Restriction("the sums in registers are the paired output kernel's, gate on P, H a multiple of 16",
                              _z_registers_paired, on_point=True),
                  Restriction("column slices are whole passes of the paired kernels (a sliced projection with x in "
                              "shared memory, a sliced output with the gate on P)", _slices_apply, on_point=True),
                  Restriction("x in registers is for P up to 128", _x_fragments_fit, on_point=True),
                  Restriction("the output's x in registers goes with its sums in registers, one x stage, P up to 128, "
                              "at most 3 warpgroups (2 with 128-column passes)",
                              _output_x_registers_with_z, on_point=True),
                  Restriction("Wp in registers: paired columns, H / 16 row blocks shared evenly by at most 2 "
                              f"warpgroups and the slices, their fragments at most {W_REGISTERS_FRAGMENTS_MAX} "
                              "registers a thread, two x stages, not with x in registers", _w_registers_fit,
                              on_point=True),
                  Restriction("the unrolled copies are for unpadded x rows of 16-byte chunks that 16 divides or that "
                              "divide 16",
                              _unrolled_fetch_applies, on_point=True),
                  Restriction("the swizzle applies to no operand (neither P nor H a multiple of 64)", _swizzle_applies,
                              on_point=True),
                  Restriction("shared memory exceeds the per-block limit", smem_fits)),
    precisions=HALF_PRECISIONS,
    records=HALF_PRECISIONS,
    fp32_output=HALF_PRECISIONS,
    run=run,
    groups=(("p_groups", "p_wn", "p_stages", "p_slices", "early_x_fetch", "p_mask_early"),
            ("o_groups", "o_wn", "o_stages", "o_slices", "o_staged_stores", "o_unrolled_fetch")),
)
