"""The pair readout's spec: strategies, search spaces, restrictions, defaults, plans.

Five strategies:
  direct  one kernel: per pair, the first Linear over [h_i | h_j | p_ij], the second Linear, and a
          running max over j, per tile of rows i (templates/readout/_pair_max.cuh.j2).
  split   the same kernel after a node prologue (U = nodes W_i^T + b1, V = nodes W_j^T), so a pair
          needs only U_i + V_j + W_p p_ij.
  gemm    large shapes: the node prologue, a kernel writing every pair's hidden layer to scratch,
          cuBLAS for the second Linear (TF32 forced off), a pool kernel (masked max, LayerNorm,
          residual). Scratch B*N*N*(H + D) floats per call: 805 MB at B16 N128 D256 H512.
  fused   split in one cooperative launch: the first blocks are the node prologue's, the others
          split's pair blocks, which wait for them (two launches of the kernel where the grid
          cannot be resident at once) (templates/readout/fused.cu.j2).
  mma     tensor cores (bf16, fp16, tf32, tf32x3): split's node prologue, then per step of pairs
          the W_p product and the second layer as mma.sync products on resident weights, the
          masked max in the second one's epilogue (templates/readout/mma.cu.j2).
"""
from __future__ import annotations

from ...spec import (HALF_PRECISIONS, MMA_KINDS, MMA_TILE_RESTRICTIONS, SIXTEEN_BIT_TOLERANCE, WGMMA_ON_SM90,
                     Cost, DeviceLimits, Kernel, OpSpec, Plan, Restriction, Strategy, Tolerance, align, byte_sections,
                     ceil_div, cuda_bool, element_bytes, flat_tile_grid, mma_row_bytes, padded_stride,
                     persistent_blocks, section_offsets, smem_fits)
from ...precision import FP32_PRECISIONS

#: The pair-max kernel (split, direct): nodes, pair features, mask, weights, uv, scratch, counters,
#: out, then B, N, row tiles.
PAIR_MAX_ARGS = ("ptr nodes", "ptr pair", "ptr mask", "ptr wpack", "ptr uv", "ptr scratch", "ptr counters", "ptr out",
                 "i32 B", "i32 N", "i32 num_tiles")
#: The fused strategy's kernel: the pair-max pointers, the producers' counter (common/block_roles.cuh),
#: then B, N, row tiles and the phase (0: prologue and pair blocks; 1: prologue only; 2: pairs only).
FUSED_ARGS = (*PAIR_MAX_ARGS[:8], "ptr done", "i32 B", "i32 N", "i32 num_tiles", "i32 phase")
#: The node prologue: nodes, weights, uv, then the node rows B*N.
NODES_ARGS = ("ptr nodes", "ptr wpack", "ptr uv", "i32 rows")
#: The gemm strategy's hidden kernel: pair features, uv, weights, hidden, then B, N, tiles.
HIDDEN_ARGS = ("ptr pair", "ptr uv", "ptr wpack", "ptr hidden", "i32 B", "i32 N", "i32 num_tiles")
#: Its pool kernel: messages, mask, nodes, weights, out, then B, N.
POOL_ARGS = ("ptr messages", "ptr mask", "ptr nodes", "ptr wpack", "ptr out", "i32 B", "i32 N")


def weight_offsets(D: int, P: int, H: int) -> dict[str, int]:
    """Packed-weight layout shared with templates/readout/_common.cuh.j2 (16-byte sections).

    wuvt is [D][2H]: row k holds W_i^T[k] then W_j^T[k] (the first Linear's node columns), so
    the node prologue computes U and V as one product, and the direct strategy reads W_i^T and
    W_j^T as two [D][H] matrices of row stride 2H. The sections the main kernel of the split
    strategy needs (wpt onwards) are contiguous, so only they are staged in shared memory.
    """
    sizes = [("wuvt", D * 2 * H), ("wpt", P * H), ("b1", H), ("w2t", H * D), ("b2", D), ("gamma", D), ("beta", D)]
    return section_offsets(sizes)


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


def prologue_blocks(rows: int, H: int, prologue_rows: int = PROLOGUE_ROWS) -> int:
    """Blocks of the node prologue: prologue_rows node rows by PROLOGUE_COLS of the 2H columns
    (block b: rows from (b // column blocks) * prologue_rows, columns from (b % column blocks) * 128)."""
    return ceil_div(rows, prologue_rows) * ceil_div(2 * H, PROLOGUE_COLS)


def _nodes_kernel(name: str, H: int, prologue_rows: int) -> Kernel:
    """The node prologue (U with b1, and V, of every node): the split and gemm strategies' first launch."""

    def grid(B, N, sms, resident, _H=H, _rows=prologue_rows):
        return prologue_blocks(B * N, _H, _rows), (B * N,)

    return Kernel(f"{name}_nodes", PROLOGUE_THREADS, 0, NODES_ARGS, grid)


def min_blocks_per_sm(smem_bytes: int, threads: int, limits: DeviceLimits, registers: int = 128) -> int:
    """The blocks per SM that shared memory and threads allow, capped so a thread keeps at
    least `registers` registers: the kernel's __launch_bounds__ minimum (see _pair_max.cuh.j2).
    Computed for the sm_90 limits, so a rendered source does not depend on the GPU it is for."""
    by_smem = limits.smem_per_sm // (smem_bytes + 1024)  # 1 KB per block reserved by the driver
    by_threads = limits.max_threads_per_sm // threads
    by_registers = 65536 // (threads * registers)
    return max(1, min(by_smem, by_threads, by_registers))


#: The exact fp32 strategies keep tf32x3's and tf32's promises too: where they are faster (small
#: shapes), or where no tensor-core tile fits (W_p and W2 resident), those precisions run them.
EXACT_SERVES = FP32_PRECISIONS  # ("float32", "tf32x3", "tf32")


# ---- split and direct ---------------------------------------------------------------------------

def row_tiles(B: int, N: int, tile_i: int) -> int:
    """Tiles of rows i, each owned by j_split blocks (and one arrival counter)."""
    return B * ceil_div(N, tile_i)


def _pair_max_grid(tile_i: int, j_split: int):
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


def _pair_max_context(params: dict, w: dict, split: bool) -> tuple[dict, int]:
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


def _derive_direct(params: dict, w: dict, name: str):
    context, smem = _pair_max_context(params, w, split=False)
    grid = _pair_max_grid(params["tile_i"], params["j_split"])
    return context, (Kernel(name, params["threads"], smem, PAIR_MAX_ARGS, grid),)


def _derive_split(params: dict, w: dict, name: str):
    """The pair-max kernel (declared first: the restrictions read its block) runs after the node
    prologue, as its programmatic dependent: it stages its weights while the prologue runs."""
    context, smem = _pair_max_context(params, w, split=True)
    grid = _pair_max_grid(params["tile_i"], params["j_split"])
    return context, (Kernel(name, params["threads"], smem, PAIR_MAX_ARGS, grid, mode="programmatic"),
                     _nodes_kernel(name, w["H"], params["prologue_rows"]))


def _fused_grid(H: int, prologue_rows: int, tile_i: int, j_split: int):
    """The node prologue's blocks (as split's prologue kernel), then split's pair blocks."""
    pair_blocks = _pair_max_grid(tile_i, j_split)

    def grid(B, N, sms, resident, _H=H, _rows=prologue_rows):
        blocks, tail = pair_blocks(B, N, sms, resident)
        return prologue_blocks(B * N, _H, _rows) + blocks, tail

    return grid


def _derive_fused(params: dict, w: dict, name: str):
    """split's node prologue and pair-max kernel in one launch (fused.cu.j2)."""
    context, smem = _pair_max_context(params, w, split=True)
    context = {**context, "fused": True, "nodes_inline": True}
    grid = _fused_grid(w["H"], params["prologue_rows"], params["tile_i"], params["j_split"])
    return context, (Kernel(name, params["threads"], smem, FUSED_ARGS, grid, mode="cooperative_or_plain"),)


def _columns_divide_widths(plan: Plan, limits: DeviceLimits) -> bool:
    cols = plan.context["cols"]
    return plan.widths["D"] % cols == 0 and plan.widths["H"] % cols == 0


def _thread_layout_ok(plan: Plan, limits: DeviceLimits) -> bool:
    c = plan.context
    return (plan.threads % c["threads_n"] == 0 and c["threads_m"] % c["tile_i"] == 0
            and c["tm"] >= 1 and c["tm"] * c["threads_m"] == c["tile_pairs"])


def _widths_vectorise(plan: Plan, limits: DeviceLimits) -> bool:
    return all(plan.widths[k] % 4 == 0 for k in ("D", "P", "H"))


_RESTRICTIONS = (
    Restriction("D, P and H must be multiples of 4 (float4 reads)", _widths_vectorise),
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
_SPACE = {"tile_i": (1, 2, 4, 8), "tile_j": (4, 8, 16, 32), "threads": (128, 192, 256, 384), "threads_n": (2, 4, 8, 16, 24),
          "tn": (4, 8), "unroll": (2, 4), "weights_smem": (True, False), "j_split": (1, 2, 3, 4, 6, 8)}

DIRECT = Strategy(
    name="direct",
    summary="per pair, the first Linear over [h_i | h_j | p_ij] as three register-tiled products; one launch",
    space=dict(_SPACE),
    derive=_derive_direct,
    restrictions=_RESTRICTIONS,
    precisions=EXACT_SERVES,
)

SPLIT = Strategy(
    name="split",
    summary="U = nodes W_i^T + b1, V = nodes W_j^T once per node (a prologue kernel); per pair only "
            "U_i + V_j + W_p p_ij",
    # prologue_rows: node rows per prologue block (of 128 columns, the k loop split across its 4
    # warps: _nodes.cuh.j2). 2 gives the seed (B*N = 96 rows, 2H = 384) 144 blocks, 8 gives it 36,
    # reading the weights from L2 a quarter as often (what matters at B*N = 2048).
    space={**_SPACE, "prologue_rows": (2, 8)},
    derive=_derive_split,
    restrictions=_RESTRICTIONS,
    precisions=EXACT_SERVES,
)


def _prologue_fits_beside(plan: Plan, limits: DeviceLimits) -> bool:
    """node_products' static arrays (prologue_rows node rows of D floats, 4 warps' partial sums of
    32 float4 per row: _nodes.cuh.j2) beside the kernel's dynamic shared memory."""
    static = plan.params["prologue_rows"] * (4 * plan.widths["D"] + 4 * 32 * 16)
    return plan.smem_bytes + static <= limits.max_smem_per_block


FUSED = Strategy(
    name="fused",
    summary="split in one launch: the first blocks compute U and V as the prologue's blocks would, "
            "the others run split's per-pair work once they are done",
    # split's space, prologue_rows included. Why one launch: a second costs the host time per
    # call, and the seed's repeated calls are bound by host time.
    space=dict(SPLIT.space), derive=_derive_fused,
    restrictions=_RESTRICTIONS + (
        Restriction("the prologue's 128 threads must fit in the block", lambda p, _: p.threads >= PROLOGUE_THREADS),
        Restriction("the prologue's static shared arrays must fit beside the block's", _prologue_fits_beside),),
    precisions=EXACT_SERVES,
)


# ---- gemm ---------------------------------------------------------------------------------------

def hidden_layout(tile: int, tm: int, tn: int, threads: int) -> dict:
    """Thread layout of the gemm strategy's hidden kernel: threads_m rows of threads (tm pair rows
    each) by threads_n columns (tn hidden columns each, cn per chunk). Zeros where the numbers do
    not divide (a restriction then rejects the plan)."""
    threads_m = tile // tm if tile % tm == 0 else 0
    threads_n = threads // threads_m if threads_m and threads % threads_m == 0 else 0
    return {"threads_m": threads_m, "threads_n": threads_n, "cn": threads_n * tn}


def hidden_registers(tm: int, tn: int) -> int:
    """Registers a thread of the gemm hidden kernel is granted. An 8x8 micro-tile needs ~168
    (64 accumulators, the next k step's A and W_p float4s in flight: ptxas -v, sm_90): capped at
    128 it spilled 24-104 bytes. Up to 32 accumulators fit 128 without spilling."""
    return 128 if tm * tn <= 32 else 168


def gemm_pool_blocks(nodes: int, pool_nodes: int) -> int:
    """Blocks of the gemm strategy's pool kernel for B*N nodes."""
    return max(1, ceil_div(nodes, pool_nodes))


def gemm_pool_smem(D: int, pool_nodes: int, pool_warps: int) -> int:
    """Bytes of the pool kernel's shared memory: the partial rows of every warp of a node but its
    first, and one any-edge int per warp (gemm.cu.j2's combine_node_warps); none with one warp."""
    if pool_warps == 1:
        return 0
    return 4 * (pool_nodes * (pool_warps - 1) * D + align(pool_nodes * pool_warps))


#: Sections of the gemm scratch start on 256-byte boundaries (cuBLAS reads and writes two of them).
GEMM_SCRATCH_ALIGN = 64


def gemm_scratch_offsets(B: int, N: int, D: int, H: int, split_product: bool = False) -> dict[str, int]:
    """The gemm strategy's one scratch buffer, in floats: hidden (B*N*N, H; with split_product
    (B*N*N, 2H), each row [hi | lo]), messages (B*N*N, D), uv (B*N, 2H); "total" its length.
    B*N*N*(H + D) floats dominate: 805 MB at B16 N128 D256 H512 (1342 MB split)."""
    pairs = B * N * N
    offsets, at = {}, 0
    hidden_width = 2 * H if split_product else H
    for name, size in (("hidden", pairs * hidden_width), ("messages", pairs * D), ("uv", B * N * 2 * H)):
        offsets[name] = at
        at = align(at + size, GEMM_SCRATCH_ALIGN)
    offsets["total"] = at
    return offsets


def _derive_gemm(params: dict, w: dict, name: str):
    """Kernels: the hidden kernel (declared first: the restrictions read its block), the node
    prologue, the pool kernel; cuBLAS runs between the hidden and the pool kernels."""
    D, P, H = w["D"], w["P"], w["H"]
    layout = hidden_layout(params["tile"], params["tm"], params["tn"], params["threads"])
    tile, staged = params["tile"], params["weights_smem"]
    pool_threads = 32 * params["pool_nodes"] * params["pool_warps"]
    pool_smem = gemm_pool_smem(D, params["pool_nodes"], params["pool_warps"])
    context = {"D": D, "P": P, "H": H, "off": weight_offsets(D, P, H), "p_stride": padded_stride(P),
               "tile": tile, "threads": params["threads"], "tm": params["tm"], "tn": params["tn"],
               "unroll": params["unroll"], "weights_smem": cuda_bool(staged), **layout,
               "prologue_rows": PROLOGUE_ROWS, "prologue_threads": PROLOGUE_THREADS,
               "prologue_cols": PROLOGUE_COLS,
               "pool_nodes": params["pool_nodes"], "pool_warps": params["pool_warps"],
               "pool_threads": pool_threads, "pool_smem": pool_smem, "split_product": params["split_product"]}
    floats = (tile * context["p_stride"]                 # the tile's pair rows
              + (P * layout["cn"] if staged else 0)      # a [P][cn] chunk of W_p
              + 2 * tile)                                # each pair's uv rows (ints)
    context["min_blocks"] = min_blocks_per_sm(4 * floats, params["threads"], DeviceLimits(),
                                              hidden_registers(params["tm"], params["tn"]))

    def pool_grid(B, N, sms, resident, _nodes=params["pool_nodes"]):
        return gemm_pool_blocks(B * N, _nodes), (B, N)

    return context, (Kernel(f"{name}_hidden", params["threads"], 4 * floats, HIDDEN_ARGS, flat_tile_grid(tile)),
                     _nodes_kernel(name, H, PROLOGUE_ROWS),
                     Kernel(f"{name}_pool", pool_threads, pool_smem, POOL_ARGS, pool_grid))


def _hidden_layout_ok(plan: Plan, limits: DeviceLimits) -> bool:
    return plan.context["threads_m"] > 0 and plan.context["threads_n"] > 0


def _hidden_chunks_divide_h(plan: Plan, limits: DeviceLimits) -> bool:
    return plan.context["cn"] > 0 and plan.widths["H"] % plan.context["cn"] == 0


GEMM = Strategy(
    name="gemm",
    summary="large shapes: the split prologue (U, V per node); a hidden kernel writes SiLU(U_i + V_j + W_p p_ij) "
            "of every pair to a (B*N*N, H) scratch; cuBLAS fp32 mm (TF32 forced off) gives the (B*N*N, D) "
            "messages; a pool kernel takes the masked max over j, adds b2, LayerNorms and adds the residual. "
            "Scratch per call: B*N*N*(H + D) floats (805 MB at B16 N128 D256 H512). tf32x3 with split_product: "
            "the hidden rows as [hi | lo] TF32 parts and the product as two TF32 GEMMs (hi.W2hi + lo.W2hi, then "
            "+ hi.W2lo) instead of the exact fp32 one",
    # tile: pairs per block of the hidden kernel; tm x tn its micro-tile (tm = 1 makes 8 columns
    # per chunk with 64-pair tiles: any H multiple of 8 at P up to 512); weights_smem: W_p staged
    # per column chunk (else read through the cache). pool_nodes: nodes per block of the pool
    # kernel; pool_warps: warps per node (its partners split between them), for small B*N.
    # split_product (tf32x3 only): hidden written as TF32 [hi | lo] and the H -> D product on
    # TF32 tensor cores, three products of split operands (see gemm.cu.j2).
    space={"tile": (64, 128, 256), "threads": (128, 256), "tm": (1, 2, 4, 8), "tn": (4, 8), "unroll": (2, 4),
           "weights_smem": (False, True), "pool_nodes": (1, 2, 4, 8), "pool_warps": (1, 2, 4),
           "split_product": (False, True)},
    derive=_derive_gemm,
    restrictions=(
        Restriction("D, P and H must be multiples of 4 (float4 reads)", _widths_vectorise),
        Restriction("tile, threads and micro-tile must form a thread layout (tile/tm rows of threads "
                    "dividing threads)", _hidden_layout_ok),
        Restriction("threads_n * tn (hidden columns per chunk) must divide H", _hidden_chunks_divide_h),
        Restriction("at most 64 accumulators per thread", lambda p, _: p.params["tm"] * p.params["tn"] <= 64),
        Restriction("shared memory exceeds the per-block limit", smem_fits),
        Restriction("the pool kernel's block exceeds 1024 threads", lambda p, _: p.context["pool_threads"] <= 1024),
        Restriction("split_product is tf32x3's (split operands on TF32 tensor cores); the exact precisions "
                    "keep the fp32 product", lambda p, _: not p.params["split_product"] or p.precision == "tf32x3"),
    ),
    precisions=EXACT_SERVES,
)


# ---- tensor cores (mma) -------------------------------------------------------------------------

#: The mma kernel: nodes, pair features, mask, weights, uv, out, then B, N, row tiles.
MMA_ARGS = ("ptr nodes", "ptr pair", "ptr mask", "ptr wpack", "ptr uv", "ptr out", "i32 B", "i32 N", "i32 num_tiles")
#: With one_launch: those pointers, the grid barrier's ints, then B, N, row tiles and the phase.
MMA_ONE_LAUNCH_ARGS = (*MMA_ARGS[:6], "ptr grid_bar", "i32 B", "i32 N", "i32 num_tiles", "i32 phase")


def mma_weight_offsets(D: int, P: int, H: int, elem_bytes: int) -> dict[str, int]:
    """Byte offsets of the mma strategy's packed weights (shared with templates/readout/mma.cu.j2):
    the fp32 pack of weight_offsets() (the node prologue's [W_i^T | W_j^T] and b1, b2, gamma and
    beta), then W_p [H][P] and W2 [D][H] n-major (nn.Linear's layout) in the operand type, each
    section 16-byte aligned; "total" in bytes."""
    fp32_bytes = 4 * weight_offsets(D, P, H)["total"]
    operands = byte_sections([("wp", H * P * elem_bytes), ("w2", D * H * elem_bytes)])
    return {"wp": fp32_bytes + operands["wp"], "w2": fp32_bytes + operands["w2"], "total": fp32_bytes + operands["total"]}


def _mma_shape(params: dict, D: int) -> dict:
    """Pairs per step, 16-row fragments per warp (0 where the warps do not split the step), the
    columns one pass of the warps covers, and the 8-column fragments a warp holds at once: a pass's
    (resident), or a chunk's and its DW = D / warps_n message columns' (streamed)."""
    rows = params["tile_i"] * params["tile_j"]
    mt = rows // (16 * params["warps_m"]) if rows % (16 * params["warps_m"]) == 0 else 0
    nt = params["wn"] // 8
    held = nt if params["resident"] else nt + D // params["warps_n"] // 8
    return {"rows": rows, "mt": mt, "nt": held, "pass": params["warps_n"] * params["wn"]}


def _derive_mma(params: dict, w: dict, name: str):
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
                     _nodes_kernel(name, H, params["prologue_rows"]))


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
    derive=_derive_mma,
    restrictions=(
        Restriction("steps must split into 16-row fragments per warp, and passes tile H and D", _mma_layout_ok),
        Restriction("P and H rows must be whole 16-byte pieces in the operand type, D a multiple of 4",
                    _mma_rows_whole),
        Restriction("two stages only stream (resident weights are copied once)",
                    lambda p, _: p.params["stages"] == 1 or not p.params["resident"]),
        Restriction("one launch needs the prologue's 128 threads and its static shared arrays in the block",
                    lambda p, limits: not p.params["one_launch"]
                    or (p.threads >= PROLOGUE_THREADS and _prologue_fits_beside(p, limits))),
        *MMA_TILE_RESTRICTIONS,  # resident W_p and W2: wide D and H outgrow shared memory
        # tf32x3 splits each fragment into two: with 80 accumulators (64 of them messages) its
        # streamed kernel took 255 registers and spilled (ptxas, sm_80).
        Restriction("tf32x3 streams with at most 64 accumulators per thread",
                    lambda p, _: p.params["resident"] or p.precision != "tf32x3"
                    or 4 * p.context["mma_shape"]["mt"] * p.context["mma_shape"]["nt"] <= 64),
    ),
    precisions=tuple(MMA_KINDS),
)


# ---- warpgroup tensor cores (wgmma, sm_90a) -----------------------------------------------------

def _derive_wgmma(params: dict, w: dict, name: str):
    """mma's node prologue, then one kernel of `groups` warpgroups walking steps of 64 * groups pairs,
    the weights streamed in chunks of hc hidden columns through two stages (wgmma.cu.j2)."""
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
                     _nodes_kernel(name, H, params["prologue_rows"]))


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
    derive=_derive_wgmma,
    restrictions=(WGMMA_ON_SM90,
                  Restriction("P and D must be multiples of 16, D at most 256, and hc must divide H", _wgmma_shapes_fit),
                  # D 256 with hc 128 (192 accumulators a thread) took 255 registers and spilled.
                  Restriction("at most 160 accumulators per thread (D / 2 + hc / 2)",
                              lambda p, _: p.widths["D"] // 2 + p.params["hc"] // 2 <= 160),
                  Restriction("shared memory exceeds the per-block limit", smem_fits)),
    precisions=HALF_PRECISIONS,
)


class ReadoutSpec(OpSpec):
    #: Parameters added after entries were tuned (and studies recorded), per strategy, with the value
    #: that gives the kernel those entries ran: plan() fills them in where a point leaves them out.
    added_params = {"split": {"j_split": 1, "prologue_rows": 8}, "direct": {"j_split": 1}, "mma": {"stages": 1, "one_launch": False},
                    "gemm": {"split_product": False}}
    name = "readout"
    width_names = ("D", "P", "H")
    strategies = {s.name: s for s in (SPLIT, DIRECT, FUSED, GEMM, MMA, WGMMA)}
    default_points = (
        # Real widths (D, H multiples of 64): 64 columns per pass, 4 rows i x 16 partners j.
        ("split", {"tile_i": 4, "tile_j": 16, "threads": 256, "threads_n": 8, "tn": 8, "unroll": 4,
                   "weights_smem": False, "j_split": 1, "prologue_rows": 8}),
        # Widths with D and H multiples of 96 (the seed's): 96 columns per pass, one W2 pass over
        # D = 96 (faster than the next point at the seed shape).
        ("split", {"tile_i": 4, "tile_j": 8, "threads": 192, "threads_n": 24, "tn": 4, "unroll": 4,
                   "weights_smem": True, "j_split": 3, "prologue_rows": 2}),
        # Seed widths (D = 96): 32 columns per pass.
        ("split", {"tile_i": 2, "tile_j": 16, "threads": 128, "threads_n": 8, "tn": 4, "unroll": 4,
                   "weights_smem": False, "j_split": 1, "prologue_rows": 2}),
        # Any D, P, H multiple of 8: 8 columns per pass.
        ("split", {"tile_i": 8, "tile_j": 8, "threads": 128, "threads_n": 2, "tn": 4, "unroll": 2,
                   "weights_smem": False, "j_split": 1, "prologue_rows": 8}),
        # One node i per block with all its partners in one tile of 32 (N <= 32), 8-row prologue
        # blocks: at the seed 96 pair blocks and 36 prologue blocks, 132 in all, one per SM of an
        # H200 (a pair block's staged weights, 121 KB, leave room for no second block); the
        # fastest split point at the seed, and fused is the same grids in one launch.
        ("split", {"tile_i": 1, "tile_j": 32, "threads": 192, "threads_n": 24, "tn": 4, "unroll": 4,
                   "weights_smem": True, "j_split": 1, "prologue_rows": 8}),
        ("fused", {"tile_i": 1, "tile_j": 32, "threads": 192, "threads_n": 24, "tn": 4, "unroll": 4,
                   "weights_smem": True, "j_split": 1, "prologue_rows": 8}),
        # gemm, for the tuner's defaults (complete_point) and the widths no split point fits: 8x8
        # micro-tiles, 64 hidden columns per chunk (every preset width; unroll 4 spilled 4 bytes at
        # P = 16, where it unrolls the whole k loop); then 8 columns of 64-pair tiles (any D, P, H
        # multiple of 8 up to 512, e.g. D=504 H=496, whose split tiles outgrow shared memory).
        # Tensor cores (bf16, fp16, tf32, tf32x3), W_p and W2 resident where they fit:
        # D, H multiples of 64 with 64-pair steps of 8 warps; the seed's (96, 192) with 32-pair
        # steps of 4 warps and 32 columns per pass; any D, H multiple of 16; 32-pair steps where
        # fp32 operands (the tf32 kinds) at D 128, H 256 outgrow 64-pair ones.
        ("mma", {"tile_i": 4, "tile_j": 16, "warps_m": 4, "warps_n": 2, "wn": 32, "blocks_per_sm": 1,
                 "prologue_rows": 8, "resident": True}),
        ("mma", {"tile_i": 2, "tile_j": 16, "warps_m": 2, "warps_n": 2, "wn": 16, "blocks_per_sm": 2,
                 "prologue_rows": 2, "resident": True}),
        ("mma", {"tile_i": 4, "tile_j": 16, "warps_m": 4, "warps_n": 1, "wn": 16, "blocks_per_sm": 1,
                 "prologue_rows": 8, "resident": True}),
        ("mma", {"tile_i": 2, "tile_j": 16, "warps_m": 2, "warps_n": 1, "wn": 16, "blocks_per_sm": 1,
                 "prologue_rows": 8, "resident": True}),
        # Streamed weights (widths they outgrow, D 256 H 512): 64 pairs per step, chunks of 64 hidden
        # columns; each warp holds 128 of D's columns in registers (64 accumulators).
        ("mma", {"tile_i": 4, "tile_j": 16, "warps_m": 4, "warps_n": 2, "wn": 32, "blocks_per_sm": 1,
                 "prologue_rows": 8, "resident": False}),
        # Small shapes (the seed: B*N = 96 nodes), two stages: 96 blocks of 32-pair steps, 6
        # chunks of 32 hidden columns whose copies overlap the products (one stage waited for
        # each in turn: 6 round trips per step, the seed's tuned point).
        ("mma", {"tile_i": 1, "tile_j": 32, "warps_m": 2, "warps_n": 2, "wn": 16, "blocks_per_sm": 2,
                 "prologue_rows": 2, "resident": False, "stages": 2}),
        # ... in one launch: the prologue's 36 blocks of 8 node rows inside 36 of the 96 blocks.
        ("mma", {"tile_i": 1, "tile_j": 32, "warps_m": 2, "warps_n": 2, "wn": 16, "blocks_per_sm": 2,
                 "prologue_rows": 8, "resident": False, "stages": 2, "one_launch": True}),
        # Two stages: the H200's tuned 64-pair layout of one stage (two blocks per SM), with two
        # (one block per SM, 137 KB at D256 H512 in bf16). 128 pairs per step would halve the
        # chunks' L2 traffic, but over 16 warps (128 registers each) it spilled 138 bytes.
        ("mma", {"tile_i": 4, "tile_j": 16, "warps_m": 2, "warps_n": 4, "wn": 16, "blocks_per_sm": 1,
                 "prologue_rows": 2, "resident": False, "stages": 2}),
        # tf32x3's (its split fragments double the operands' registers): 32 pairs, 64 columns per warp.
        ("mma", {"tile_i": 2, "tile_j": 16, "warps_m": 2, "warps_n": 4, "wn": 16, "blocks_per_sm": 1,
                 "prologue_rows": 8, "resident": False}),
        # 128 pairs per step (8 nodes x 16 partners) in one stage over 16 warps (117 KB and 128
        # registers at D256 H512 in bf16, no spill): each streamed chunk serves twice the pairs of
        # the 64-pair steps, half the chunks' L2 traffic (the large shape's profile: the barriers
        # around the chunk copies are its next stall).
        ("mma", {"tile_i": 8, "tile_j": 16, "warps_m": 4, "warps_n": 4, "wn": 16, "blocks_per_sm": 1,
                 "prologue_rows": 2, "resident": False, "stages": 1}),
        # Hopper (16-bit, D <= 256): two warpgroups of 64 pairs sharing chunks of 64 hidden columns
        # (each chunk's L2 read serves 128 pairs, twice mma's 64).
        ("wgmma", {"groups": 2, "hc": 64, "tile_i": 4, "prologue_rows": 8}),
        ("gemm", {"tile": 128, "threads": 128, "tm": 8, "tn": 8, "unroll": 2, "weights_smem": False,
                  "pool_nodes": 4, "pool_warps": 2, "split_product": False}),
        # tf32x3's: the same with the H -> D product on TF32 tensor cores (the exact point stays
        # the other precisions'; the restriction rejects this one there).
        ("gemm", {"tile": 128, "threads": 128, "tm": 8, "tn": 8, "unroll": 2, "weights_smem": False,
                  "pool_nodes": 4, "pool_warps": 2, "split_product": True}),
        ("gemm", {"tile": 64, "threads": 128, "tm": 1, "tn": 4, "unroll": 4, "weights_smem": False,
                  "pool_nodes": 4, "pool_warps": 2, "split_product": False}),
    )
    presets = {
        "seed": ({"B": 4, "N": 24, "D": 96, "P": 16, "H": 192},),
        "real": ({"B": 8, "N": 64, "D": 128, "P": 32, "H": 256}, {"B": 16, "N": 128, "D": 256, "P": 64, "H": 512}),
    }
    tolerance = {"float32": Tolerance(max_abs=1e-4, rel_l2=1e-5), "tf32x3": Tolerance(max_abs=1e-4, rel_l2=1e-5),
                 "tf32": Tolerance(max_abs=float("inf"), rel_l2=5e-3),
                 "bfloat16": SIXTEEN_BIT_TOLERANCE, "float16": SIXTEEN_BIT_TOLERANCE}

    def constructor_args(self, widths: dict) -> dict:
        return {"node_dim": widths["D"], "pair_dim": widths["P"], "hidden_dim": widths["H"]}

    def cost(self, shape: dict) -> Cost:
        """Bytes and FLOPs of the reference formula (the direct form)."""
        B, N, D, P, H = (shape[k] for k in ("B", "N", "D", "P", "H"))
        pairs = B * N * N
        flops = pairs * (2 * ((2 * D + P) * H + H * D) + 4 * H + 2 * D) + B * N * 10 * D
        weights = (2 * D + P) * H + H + H * D + 3 * D
        return Cost(bytes=4.0 * (pairs * P + 2 * B * N * D + weights) + pairs, flops=float(flops))


READOUT = ReadoutSpec()
