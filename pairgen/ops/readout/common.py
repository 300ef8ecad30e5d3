"""What the pair readout's strategies share (no torch): the fp32 pack (its offsets, its making for a
call); the node prologue (U = nodes W_i^T + b1, V = nodes W_j^T: a kernel of its own before split's,
gemm's and the tensor-core strategies' main kernels, or blocks inside one kernel: fused, mma's
one_launch); and the pair-max kernel (templates/readout/_pair_max.cuh.j2) that direct, split and
fused run: its arguments, grid, scratch, context, space, restrictions and launch."""
from __future__ import annotations

from ...precision import FP32_PRECISIONS
from ...spec import (DeviceLimits, Kernel, Plan, Restriction, align, ceil_div, cuda_bool, padded_stride,
                     section_offsets, smem_fits)


def weight_offsets(D: int, P: int, H: int) -> dict[str, int]:
    """Packed-weight layout shared with templates/readout/_common.cuh.j2 (16-byte sections).

    wuvt is [D][2H]: row k holds W_i^T[k] then W_j^T[k] (the first Linear's node columns), so
    the node prologue computes U and V as one product, and the direct strategy reads W_i^T and
    W_j^T as two [D][H] matrices of row stride 2H. The sections the main kernel of the split
    strategy needs (wpt onwards) are contiguous, so only they are staged in shared memory.
    """
    sizes = [("wuvt", D * 2 * H), ("wpt", P * H), ("b1", H), ("w2t", H * D), ("b2", D), ("gamma", D), ("beta", D)]
    return section_offsets(sizes)


#: The exact fp32 strategies keep tf32x3's and tf32's promises too: where they are faster (small
#: shapes), or where no tensor-core tile fits (W_p and W2 resident), those precisions run them.
EXACT_SERVES = FP32_PRECISIONS  # ("float32", "tf32x3", "tf32")


def min_blocks_per_sm(smem_bytes: int, threads: int, limits: DeviceLimits, registers: int = 128) -> int:
    """The blocks per SM that shared memory and threads allow, capped so a thread keeps at
    least `registers` registers: the kernel's __launch_bounds__ minimum (see _pair_max.cuh.j2).
    Computed for the sm_90 limits, so a rendered source does not depend on the GPU it is for."""
    by_smem = limits.smem_per_sm // (smem_bytes + 1024)  # 1 KB per block reserved by the driver
    by_threads = limits.max_threads_per_sm // threads
    by_registers = 65536 // (threads * registers)
    return max(1, min(by_smem, by_threads, by_registers))


def fp32_pack(module, weights):
    """`weights` packed for this call for the fp32 kernels (every strategy but the tensor-core ones)."""
    return module._packed(module.fp32_layout(weights.sources), weights)


def row_tiles(B: int, N: int, tile_i: int) -> int:
    """Tiles of rows i, each owned by j_split blocks (and one arrival counter)."""
    return B * ceil_div(N, tile_i)


def _widths_vectorise(plan: Plan, limits: DeviceLimits) -> bool:
    return all(plan.widths[k] % 4 == 0 for k in ("D", "P", "H"))


#: The fp32 kernels (pair-max, gemm's) read node rows, pair rows and weights as float4s.
WIDTHS_VECTORISE = Restriction("D, P and H must be multiples of 4 (float4 reads)", _widths_vectorise)


# ---- the node prologue --------------------------------------------------------------------------

#: Node rows per block of the gemm strategy's prologue kernel (split tunes it; see _nodes.cuh.j2).
#: The gemm strategy runs large B*N, where the prologue is bound by throughput, not latency: each
#: weight float4 a thread loads serves PROLOGUE_ROWS rows (L2 reads of the weights ~ rows / 8).
#: 16 would double the accumulators (64 registers next to 64 of weights in flight) and need 32 KB
#: of partial sums, over the 48 KB static shared memory with D = 512's 32 KB of node rows.
PROLOGUE_ROWS = 8
#: Threads per prologue block: 4 warps, each a quarter of the k loop (D/4 k-steps) for the same
#: 128 columns, lane l taking a float4 of them (64 threads walking all D k-steps each stalled on
#: weight loads: _nodes.cuh.j2).
PROLOGUE_THREADS = 128
#: Columns of 2H per prologue block: 32 lanes x a float4.
PROLOGUE_COLS = 128

#: The node prologue: nodes, weights, uv, then the node rows B*N.
NODES_ARGS = ("ptr nodes", "ptr wpack", "ptr uv", "i32 rows")


def prologue_blocks(rows: int, H: int, prologue_rows: int = PROLOGUE_ROWS) -> int:
    """Blocks of the node prologue: prologue_rows node rows by PROLOGUE_COLS of the 2H columns
    (block b: rows from (b // column blocks) * prologue_rows, columns from (b % column blocks) * 128)."""
    return ceil_div(rows, prologue_rows) * ceil_div(2 * H, PROLOGUE_COLS)


def nodes_kernel(name: str, H: int, prologue_rows: int) -> Kernel:
    """The node prologue (U with b1, and V, of every node) as a launch of its own."""

    def grid(B, N, sms, resident, _H=H, _rows=prologue_rows):
        return prologue_blocks(B * N, _H, _rows), (B * N,)

    return Kernel(f"{name}_nodes", PROLOGUE_THREADS, 0, NODES_ARGS, grid)


def prologue_fits_beside(plan: Plan, limits: DeviceLimits) -> bool:
    """node_products' static arrays (prologue_rows node rows of D floats, 4 warps' partial sums of
    32 float4 per row: _nodes.cuh.j2) beside the kernel's dynamic shared memory."""
    static = plan.params["prologue_rows"] * (4 * plan.widths["D"] + 4 * 32 * 16)
    return plan.smem_bytes + static <= limits.max_smem_per_block


def launch_with_prologue_inside(module, main, pointers: dict, barrier: str, device) -> None:
    """A kernel that runs the node prologue itself, then waits for all of it (fused: its prologue
    blocks, common/block_roles.cuh; mma's one_launch: a grid-wide barrier): one cooperative launch
    (phase 0) where its grid is resident at once, else the same kernel twice, plainly: phase 1 the
    prologue, phase 2 the pairs. Its arguments: the pointers (by name), the module's two ints its
    wait counts on as the argument `barrier` names (zeroed once; each launch leaves them as the next
    one needs them: fused's counter at 0, the barrier's count at 0 and its sense flipped), the shape
    tail, the phase."""
    ints = module._barrier_ints(device)
    for phase in ((0,) if main.mode == "cooperative" else (1, 2)):
        main.named(**pointers, **{barrier: ints}, phase=phase)


# ---- the pair-max kernel (direct, split, fused) -------------------------------------------------

#: The pair-max kernel (split, direct): nodes, pair features, mask, weights, uv, scratch, counters,
#: out, then B, N, row tiles.
PAIR_MAX_ARGS = ("ptr nodes", "ptr pair", "ptr mask", "ptr wpack", "ptr uv", "ptr scratch", "ptr counters", "ptr out",
                 "i32 B", "i32 N", "i32 num_tiles")


def pair_max_grid(tile_i: int, j_split: int):
    """j_split consecutive blocks per tile of rows i."""

    def grid(B, N, sms, resident, _ti=tile_i, _js=j_split):
        tiles = row_tiles(B, N, _ti)
        return max(1, tiles * _js), (B, N, tiles)

    return grid


def split_scratch_floats(B: int, N: int, D: int, j_split: int) -> int:
    """Global scratch of the j split, in 4-byte words: the partial maxima (B*N*j_split*D floats),
    then one int flag per (node, split) (see _pool.cuh.j2); 0 without a split."""
    return 0 if j_split == 1 else B * N * j_split * (D + 1)


def pair_max_scratch(B: int, N: int, D: int, H: int, j_split: int, with_uv: bool) -> dict[str, int]:
    """The split and direct strategies' scratch at (B, N), in 4-byte words from its start: uv
    (split only: U, V of every node, B*N*2H), then the j split's partials and flags; "total" its length."""
    uv = B * N * 2 * H if with_uv else 0
    return {"uv": 0, "partials": uv, "total": uv + split_scratch_floats(B, N, D, j_split)}


def pair_max_context(params: dict, w: dict, split: bool) -> tuple[dict, int]:
    """The pair-max kernel's context and its shared-memory bytes."""
    D, P, H = w["D"], w["P"], w["H"]
    off = weight_offsets(D, P, H)
    tile_i, tile_j, threads = params["tile_i"], params["tile_j"], params["threads"]
    threads_n, tn = params["threads_n"], params["tn"]
    threads_m = threads // threads_n
    pairs = tile_i * tile_j
    # The main kernel of the split strategy never reads wuvt: it stages from wpt onwards.
    smem_first = off["wpt"] if split else 0
    context = {
        "D": D, "P": P, "H": H, "off": off, "split": cuda_bool(split),
        "smem_first": smem_first, "weights_smem": cuda_bool(params["weights_smem"]),
        "tile_i": tile_i, "tile_j": tile_j, "tile_pairs": pairs, "threads": threads,
        "threads_n": threads_n, "threads_m": threads_m, "tn": tn, "tm": pairs // threads_m,
        "cols": threads_n * tn, "unroll": params["unroll"], "j_split": params["j_split"],
        "p_stride": padded_stride(P), "h_stride": padded_stride(H), "d_stride": padded_stride(D),
        "prologue_rows": params.get("prologue_rows", PROLOGUE_ROWS), "prologue_threads": PROLOGUE_THREADS,
        "prologue_cols": PROLOGUE_COLS,
    }
    floats = (pairs * context["p_stride"]            # pair features of the tile
              + pairs * context["h_stride"]          # hidden activations of the tile
              + threads_m * context["d_stride"]      # running max, one row per thread row
              + align(pairs) + align(threads_m))     # pair validity, per-row "any valid edge"
    if not split:
        floats += (tile_i + tile_j) * context["d_stride"]  # node rows i and j
    if params["weights_smem"]:
        floats += off["total"] - smem_first
    # The j split adds no shared memory: its partials go to global scratch, and the "last
    # block" answer travels by __syncthreads_or.
    context["smem_floats"] = floats
    context["min_blocks"] = min_blocks_per_sm(4 * floats, threads, DeviceLimits())
    return context, 4 * floats


def _columns_divide_widths(plan: Plan, limits: DeviceLimits) -> bool:
    cols = plan.context["cols"]
    return plan.widths["D"] % cols == 0 and plan.widths["H"] % cols == 0


def _thread_layout_ok(plan: Plan, limits: DeviceLimits) -> bool:
    c = plan.context
    return (plan.threads % c["threads_n"] == 0 and c["threads_m"] % c["tile_i"] == 0
            and c["tm"] >= 1 and c["tm"] * c["threads_m"] == c["tile_pairs"])


#: The restrictions of every pair-max kernel.
PAIR_MAX_RESTRICTIONS = (
    WIDTHS_VECTORISE,
    Restriction("threads_n * tn (columns per pass) must divide D and H", _columns_divide_widths),
    Restriction("threads must split into threads_n columns and rows that divide the pair tile, "
                "with tile_i dividing the rows (a thread's pairs share one node i)", _thread_layout_ok),
    Restriction("at most 64 accumulators per thread", lambda p, _: p.context["tm"] * p.params["tn"] <= 64),
    Restriction("shared memory exceeds the per-block limit", smem_fits),
)

# threads_n = 2 with tn = 4 (8 columns per pass) is what makes every D, H multiple of 8 feasible.
# threads_n 24 (96 columns per pass, with threads 192 or 384) fits widths that are multiples of
# 96, such as the seed's D = 96: one pass of the W2 product covers all of D (the fastest main
# kernel measured at the seed shape).
# j_split: blocks sharing one tile of rows i, each taking every j_split-th tile of partners j
# (small B*N leaves SMs idle otherwise); 3 and 6 fit j-tile counts such as 24/8 and 48/8.
# tile_j 4 with j_split 6 gives the seed (N = 24) 144 blocks of 16 pairs, each with work. The
# restrictions cannot see N, so points with more splits than j tiles at a length stay in the
# space: the kernel runs them correctly (a split without a j tile only takes part in the
# combine), and the tuner finds them slower.
PAIR_MAX_SPACE = {"tile_i": (1, 2, 4, 8), "tile_j": (4, 8, 16, 32), "threads": (128, 192, 256, 384),
                  "threads_n": (2, 4, 8, 16, 24), "tn": (4, 8), "unroll": (2, 4), "weights_smem": (True, False),
                  "j_split": (1, 2, 3, 4, 6, 8)}


def pair_max_buffers(module, variant, main, B: int, N: int, D: int, with_uv: bool) -> tuple:
    """(uv, partials, counters) pointers of a pair-max launch: scratch for U (with b1) and V of
    every node, (B*N, 2H), written by the node prologue, then the j split's partial maxima and
    flags; one arrival counter per tile of rows i (the main kernel's last shape argument)."""
    device = main.kernel.device_index
    j_split = variant.plan.params["j_split"]
    at = pair_max_scratch(B, N, D, module.widths["H"], j_split, with_uv)
    base = module._split_scratch(device, at["total"]) if at["total"] else 0
    uv = base + 4 * at["uv"] if with_uv else 0
    partials = base + 4 * at["partials"] if j_split > 1 else 0
    counters = module._tile_counters(device, main.tail[2]) if j_split > 1 else 0
    return uv, partials, counters


def run_pair_max(module, variant, weights, nodes, pair_feats, edge_mask, out, with_uv: bool) -> None:
    """The pair-max kernel on the fp32 pack, after the node prologue's launch where it reads U
    and V (with_uv: split) rather than computing the node products per pair (direct)."""
    B, N, D = nodes.shape
    packed = fp32_pack(module, weights)  # alive until every launch is enqueued
    wpack = packed.data_ptr()
    launches = variant.launches(nodes.get_device(), B, N, programmatic=module.programmatic_main)
    main = launches[0]
    uv, partials, counters = pair_max_buffers(module, variant, main, B, N, D, with_uv)
    if with_uv:
        prologue = launches[1]
        prologue.named(nodes=nodes.data_ptr(), wpack=wpack, uv=uv)
    main.named(nodes=nodes.data_ptr(), pair=pair_feats.data_ptr(), mask=edge_mask.data_ptr(), wpack=wpack, uv=uv,
               scratch=partials, counters=counters, out=out.data_ptr())
