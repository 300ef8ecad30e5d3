"""gemm: large shapes, around a cuBLAS product (templates/readout/gemm.cu.j2): the node prologue, a
hidden kernel writing every pair's hidden layer SiLU(U_i + V_j + W_p p_ij) to scratch, cuBLAS for the
second Linear (TF32 forced off), a pool kernel (masked max, b2, LayerNorm, residual). The second
Linear is most of the work, and cuBLAS runs it near the fp32 peak; the price is the scratch,
B*N*N*(H + D) floats per call (805 MB at B16 N128 D256 H512)."""
from __future__ import annotations

import functools

from ....spec import (DeviceLimits, Kernel, Plan, Restriction, Strategy, align, ceil_div, cuda_bool, flat_tile_grid,
                      padded_stride, smem_fits)
from ...packing import Sources, layout
from ..common import (EXACT_SERVES, PROLOGUE_COLS, PROLOGUE_ROWS, PROLOGUE_THREADS, WIDTHS_VECTORISE, fp32_pack,
                      min_blocks_per_sm, nodes_kernel, weight_offsets)

#: torch and what needs it, bound by _import_torch_half() on the first call a strategy runs, so that
#: the spec half (space, restrictions, plans) loads without torch and a call pays no import.
torch = PACK_SLOTS = cublas_fp32_mode = fp32_matmul = None


def _import_torch_half() -> None:
    global torch, PACK_SLOTS, cublas_fp32_mode, fp32_matmul
    import torch
    from ....module.buffers import PACK_SLOTS
    from ....module.modes import cublas_fp32_mode, fp32_matmul

#: The hidden kernel: pair features, uv, weights, hidden, then B, N, tiles.
HIDDEN_ARGS = ("ptr pair", "ptr uv", "ptr wpack", "ptr hidden", "i32 B", "i32 N", "i32 num_tiles")
#: The pool kernel: messages, mask, nodes, weights, out, then B, N.
POOL_ARGS = ("ptr messages", "ptr mask", "ptr nodes", "ptr wpack", "ptr out", "i32 B", "i32 N")


def hidden_layout(tile: int, tm: int, tn: int, threads: int) -> dict:
    """Thread layout of the hidden kernel: threads_m rows of threads (tm pair rows each) by
    threads_n columns (tn hidden columns each, cn per chunk). Zeros where the numbers do not
    divide (a restriction then rejects the plan)."""
    threads_m = tile // tm if tile % tm == 0 else 0
    threads_n = threads // threads_m if threads_m and threads % threads_m == 0 else 0
    return {"threads_m": threads_m, "threads_n": threads_n, "cn": threads_n * tn}


def hidden_registers(tm: int, tn: int) -> int:
    """Registers a thread of the hidden kernel is granted. An 8x8 micro-tile needs ~168
    (64 accumulators, the next k step's A and W_p float4s in flight: ptxas -v, sm_90): capped at
    128 it spilled 24-104 bytes. Up to 32 accumulators fit 128 without spilling."""
    return 128 if tm * tn <= 32 else 168


def gemm_pool_blocks(nodes: int, pool_nodes: int) -> int:
    """Blocks of the pool kernel for B*N nodes."""
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


def derive(params: dict, w: dict, name: str):
    """Kernels: the hidden kernel (declared first: the restrictions read its block), the node
    prologue, the pool kernel; cuBLAS runs between the hidden and the pool kernels."""
    D, P, H = w["D"], w["P"], w["H"]
    hidden = hidden_layout(params["tile"], params["tm"], params["tn"], params["threads"])
    tile, staged = params["tile"], params["weights_smem"]
    pool_threads = 32 * params["pool_nodes"] * params["pool_warps"]
    pool_smem = gemm_pool_smem(D, params["pool_nodes"], params["pool_warps"])
    context = {"D": D, "P": P, "H": H, "off": weight_offsets(D, P, H), "p_stride": padded_stride(P),
               "tile": tile, "threads": params["threads"], "tm": params["tm"], "tn": params["tn"],
               "unroll": params["unroll"], "weights_smem": cuda_bool(staged), **hidden,
               "prologue_rows": PROLOGUE_ROWS, "prologue_threads": PROLOGUE_THREADS,
               "prologue_cols": PROLOGUE_COLS,
               "pool_nodes": params["pool_nodes"], "pool_warps": params["pool_warps"],
               "pool_threads": pool_threads, "pool_smem": pool_smem, "split_product": params["split_product"]}
    floats = (tile * context["p_stride"]                 # the tile's pair rows
              + (P * hidden["cn"] if staged else 0)      # a [P][cn] chunk of W_p
              + 2 * tile)                                # each pair's uv rows (ints)
    context["min_blocks"] = min_blocks_per_sm(4 * floats, params["threads"], DeviceLimits(),
                                              hidden_registers(params["tm"], params["tn"]))

    def pool_grid(B, N, sms, resident, _nodes=params["pool_nodes"]):
        return gemm_pool_blocks(B * N, _nodes), (B, N)

    return context, (Kernel(f"{name}_hidden", params["threads"], 4 * floats, HIDDEN_ARGS, flat_tile_grid(tile)),
                     nodes_kernel(name, H, PROLOGUE_ROWS),
                     Kernel(f"{name}_pool", pool_threads, pool_smem, POOL_ARGS, pool_grid))


def _hidden_layout_ok(plan: Plan, limits: DeviceLimits) -> bool:
    return plan.context["threads_m"] > 0 and plan.context["threads_n"] > 0


def _hidden_chunks_divide_h(plan: Plan, limits: DeviceLimits) -> bool:
    return plan.context["cn"] > 0 and plan.widths["H"] % plan.context["cn"] == 0


@functools.lru_cache(maxsize=64)
def split_w2t_layout(D: int, H: int, sources: Sources):
    """W2^T split for the tf32x3 product (split_product), (3H, D) fp32: [W2hi^T; W2hi^T; W2lo^T]
    with hi = W2 rounded to TF32 and lo = W2 - hi rounded too, both exact TF32 values. [hi | lo]
    rows of hidden times the first 2H rows give hi W2hi + lo W2hi; hidden's hi half times the last
    H rows adds hi W2lo."""
    block = 4 * H * D
    pieces = [sources.transposed("fuse.2.weight", kind, at, D, H)
              for kind, at in (("tf32_hi", 0), ("tf32_hi", block), ("tf32_lo", 2 * block))]
    return layout(3 * block, pieces, sources.count)


def run(module, variant, weights, nodes, pair_feats, edge_mask, out) -> None:
    """Prologue -> hidden kernel -> fp32 mm -> pool kernel, all on the current stream, on one
    scratch buffer (hidden, messages, uv) from the caching allocator, held until all are enqueued.
    With split_product (tf32x3) hidden rows are [hi | lo] and the mm is two TF32 GEMMs."""
    if torch is None:
        _import_torch_half()
    B, N, D = nodes.shape
    H, pairs = module.widths["H"], B * N * N
    split = variant.plan.params.get("split_product", False)
    hidden_width = 2 * H if split else H
    hidden_kernel, prologue, pool = variant.launches(nodes.get_device(), B, N)
    packed = fp32_pack(module, weights)
    w_ptr = packed.data_ptr()
    at = gemm_scratch_offsets(B, N, D, H, split)
    scratch = torch.empty(at["total"], device=nodes.device, dtype=torch.float32)
    hidden = scratch[at["hidden"]: at["hidden"] + pairs * hidden_width].view(pairs, hidden_width)
    messages = scratch[at["messages"]: at["messages"] + pairs * D].view(pairs, D)
    uv = scratch.data_ptr() + 4 * at["uv"]
    prologue.named(nodes=nodes.data_ptr(), wpack=w_ptr, uv=uv)
    hidden_kernel.named(pair=pair_feats.data_ptr(), uv=uv, wpack=w_ptr, hidden=hidden.data_ptr())
    # messages = hidden W2^T without b2: the pool kernel adds it after the max (gemm.cu.j2 says why).
    if split:
        w2t = module._packed(split_w2t_layout(D, H, weights.sources), weights, PACK_SLOTS[1]).view(torch.float32).view(3 * H, D)
        with cublas_fp32_mode(True):  # every operand an exact TF32 value: the products are exact
            torch.mm(hidden, w2t[: 2 * H], out=messages)
            messages.addmm_(hidden[:, :H], w2t[2 * H:])
    else:
        w2t = packed.view(torch.float32)[module._w2t_at: module._w2t_at + H * D].view(H, D)
        with fp32_matmul():
            torch.mm(hidden, w2t, out=messages)
    pool.named(messages=messages.data_ptr(), mask=edge_mask.data_ptr(), nodes=nodes.data_ptr(), wpack=w_ptr,
               out=out.data_ptr())


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
    derive=derive,
    restrictions=(
        WIDTHS_VECTORISE,
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
    # No records: a replay runs kernels and 16-bit products only (fastcall.note_product), and its product is
    # fp32, in a cuBLAS mode it sets (TF32 off; on for split_product).
    run=run,
)
