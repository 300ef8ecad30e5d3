"""The triangle update's spec: strategies, search spaces, restrictions, defaults, plans.

Four strategies:
  bmm    a projection kernel writes a, b in (B*H, N, N) layout, cuBLAS bmm forms the triangle sums
         (the transposes that the direction needs are cuBLAS flags, no copies), an output kernel
         reads the bmm result in place. Right for every N; the GEMMs dominate at N >= 256.
  fused  one cooperative kernel: projection, grid-wide barrier, triangle sums + output. For small N,
         where three launches and a cuBLAS call cost more than the work. Its triangle sums read a
         and b from global memory per (pair, channel) (tri_smem=False), or stage them in shared
         memory per row tile (tri_smem=True); both in templates/trimul/_triangle.cuh.j2.
  mma    the bmm strategy's three steps on tensor cores, for the other precisions: bf16, fp16
         (modules in those dtypes, and fp32 modules under autocast), tf32 and tf32x3 (fp32 modules
         with precision="tf32" / "tf32x3"). Projection and output kernels run mma.sync
         (templates/common/mma.cuh.j2); the contraction is cuBLAS in the same precision.
  wgmma  the same three steps for bf16 and fp16 on Hopper (sm_90a) warpgroup products: operands
         from cp.async straight into shared memory, each LayerNorm folded into the epilogue of the
         product after it (templates/trimul/wgmma.cu.j2).
"""
from __future__ import annotations

from ...spec import (HALF_PRECISIONS, MMA_KINDS, SIXTEEN_BIT_TOLERANCE, byte_sections, element_bytes, mma_row_bytes,
                     Cost, DeviceLimits, Kernel, OpSpec, Plan, Restriction, Strategy, Tolerance, align, ceil_div,
                     cuda_bool, flat_tile_grid, padded_stride, persistent_tile_grid, section_offsets,
                     smem_fits, WGMMA_ON_SM90)

#: The projection kernel: x, mask, weights, a, b, then B, N, tiles, and whether the mask is float.
PROJECT_ARGS = ("ptr x", "ptr mask", "ptr w", "ptr ar", "ptr br", "i32 B", "i32 N", "i32 num_tiles", "i32 mask_is_float")
#: The output kernel: x, the triangle sums z, weights, out, then B, N, tiles.
OUTPUT_ARGS = ("ptr x", "ptr z", "ptr w", "ptr out", "i32 B", "i32 N", "i32 num_tiles")
#: The fused kernel: x, mask, weights, a, b, the barrier's ints, out, then B, N, work, mask is float.
FUSED_ARGS = ("ptr x", "ptr mask", "ptr w", "ptr ar", "ptr br", "ptr barrier", "ptr out", "i32 B", "i32 N", "i32 work",
              "i32 mask_is_float")


def gate_columns(w: dict) -> int:
    """The out gate's width: P where it gates the output, H where it gates the normalised
    triangle sums before the output projection (gate_hidden, lucidrains' form)."""
    return w["H"] if w.get("gate_hidden") else w["P"]


def weight_offsets(P: int, H: int, bias: bool, gate: int | None = None) -> dict[str, int]:
    """Float offsets of each section of the packed weights (shared with templates/trimul/_widths.cuh.j2),
    16-byte aligned; bias sections are empty without bias. gate: the out gate's width (P unless
    the gate is in hidden width: gate_columns)."""
    nb, gate = (1 if bias else 0), (P if gate is None else gate)
    sizes = [("ln_in_g", P), ("ln_in_b", P), ("wp", P * 4 * H), ("bp", nb * 4 * H), ("ln_out_g", H), ("ln_out_b", H),
             ("wo", H * P), ("bo", nb * P), ("wg", P * gate), ("bg", nb * gate)]
    return section_offsets(sizes)


O_TN = 4          # output columns per thread in each of the output kernel's two products (fused; bmm tunes o_tn)
LN_ROWS = 4       # LayerNorm rows in flight per warp (the contact head's tuning never moved off 4)
_LANE_PREFERENCE = (8, 16, 4, 32, 2, 1)  # rows per warp: 8 gives one-wavefront reads, full-sector stores


def gemm_layout(tile: int, tm: int, tn: int, threads: int) -> dict:
    """Thread layout of a tile_gemm: THREADS_M x THREADS_N threads, LANES_M rows per warp
    (tile_map.cuh). Zeros where the numbers do not divide (a restriction then rejects the plan)."""
    threads_m = tile // tm if tile % tm == 0 else 0
    threads_n = threads // threads_m if threads_m and threads % threads_m == 0 else 0
    lanes_m = next((lanes for lanes in _LANE_PREFERENCE
                    if threads_m and threads_n and threads_m % lanes == 0 and threads_n % (32 // lanes) == 0), 0)
    return {"threads_m": threads_m, "threads_n": threads_n, "lanes_m": lanes_m, "cn": threads_n * tn}


TRI_KC = 32              # k rows per stage of the staged triangle sums: one stage covers N <= 32 (the seed)
TRI_BUDGET = 96 * 1024   # bytes for its two stage buffers: two blocks per SM (blocks_per_sm 2) still fit


def triangle_staging(o_tile: int, H: int, outgoing: bool) -> dict:
    """Shared-memory layout of the fused strategy's staged triangle sums (_triangle.cuh.j2). A stage
    holds hc channels x TRI_KC k rows of a row tile's a vector and its o_tile b vectors:
      a  [hc][k], rows of a_stride floats (== 4 mod 32: two channels' float4 reads in distinct banks);
      b  [hc][k][t] incoming, [hc][t][k] outgoing: the index that is contiguous in global memory is
         contiguous here too, so copies coalesce on both sides; rows of b_row floats (outgoing
         TRI_KC + 1, odd: a warp's reads of 32 t's hit 32 banks); channels h_stride apart, == o_tile
         (mod 32) when o_tile < 32, where a warp spans two channels, each then in half of the banks.
    hc: the largest multiple of 4 dividing H whose two stage buffers fit TRI_BUDGET (else 4)."""
    b_row = TRI_KC + 1 if outgoing else o_tile
    h_stride = align((o_tile if outgoing else TRI_KC) * b_row, 32) + o_tile % 32
    a_stride = padded_stride(TRI_KC)
    per_channel = a_stride + h_stride
    hc = max((d for d in range(4, H + 1, 4) if H % d == 0 and 2 * 4 * d * per_channel <= TRI_BUDGET), default=4)
    return {"kc": TRI_KC, "hc": hc, "a_stride": a_stride, "b_row": b_row, "h_stride": h_stride,
            "stage_floats": hc * per_channel}


def _shared_context(params: dict, w: dict) -> tuple[dict, int, int]:
    """The context both strategies share (projection and output phases), with the projection's
    and the output's shared-memory bytes."""
    P, H = w["P"], w["H"]
    threads = params["threads"]
    weights_smem = bool(params.get("p_weights_smem", False))
    o_weights_smem = bool(params.get("o_weights_smem", False))
    o_tn = params.get("o_tn", O_TN)
    proj = gemm_layout(params["p_tile"], params["p_tm"], params["p_tn"], threads)
    outp = gemm_layout(params["o_tile"], params["o_tm"], o_tn, threads)
    context = {"P": P, "H": H, "outgoing": cuda_bool(w["outgoing"]), "gate_normalized": cuda_bool(w["gate_normalized"]),
               "bias": cuda_bool(w["bias"]), "off": weight_offsets(P, H, bool(w["bias"]), gate_columns(w)),
               "gate_hidden": bool(w["gate_hidden"]), "unroll": params["unroll"],
               "ln_rows": LN_ROWS, "min_blocks": params.get("min_blocks", params.get("blocks_per_sm", 1)),
               "p_tile": params["p_tile"], "p_tm": params["p_tm"], "p_tn": params["p_tn"],
               "p_threads": threads, "p_a_stride": padded_stride(P), "p_weights_smem": cuda_bool(weights_smem),
               "o_tile": params["o_tile"], "o_tm": params["o_tm"], "o_tn": o_tn, "o_threads": threads,
               "o_z_stride": padded_stride(H), "o_x_stride": padded_stride(P),
               "o_weights_smem": cuda_bool(o_weights_smem)}
    context.update({f"p_{k}": v for k, v in proj.items()})
    context.update({f"o_{k}": v for k, v in outp.items()})
    project_smem = 4 * (params["p_tile"] * padded_stride(P) + (P * proj["cn"] if weights_smem else 0))
    output_smem = 4 * (params["o_tile"] * (padded_stride(H) + padded_stride(P))
                       + ((H + P) * outp["cn"] if o_weights_smem else 0))
    return context, project_smem, output_smem


def _derive_bmm(params: dict, w: dict, name: str):
    context, project_smem, output_smem = _shared_context(params, w)
    threads = params["threads"]
    context.update(output_threads=threads, output_smem=output_smem)
    return context, (Kernel(name, threads, project_smem, PROJECT_ARGS, flat_tile_grid(params["p_tile"])),
                     Kernel(f"{name}_output", threads, output_smem, OUTPUT_ARGS, flat_tile_grid(params["o_tile"])))


def _fused_grid(p_tile: int, o_tile: int, blocks_per_sm: int, row_tiles: bool = False):
    """Persistent and co-resident (the grid barrier needs every block running): at most
    min(blocks_per_sm, resident) per SM, and no more than the larger phase has tiles.
    work = the output phase's tile count: o_tile consecutive pairs of the flattened B*N*N, or with
    row_tiles (staged triangle sums) up to o_tile pairs of one row (b, i), ceil(N / o_tile) per row."""

    def grid(B, N, sms, resident, _p=p_tile, _o=o_tile, _per_sm=blocks_per_sm, _rows=row_tiles):
        pairs = B * N * N
        out_tiles = B * N * ceil_div(N, _o) if _rows else ceil_div(pairs, _o)
        tiles = max(ceil_div(pairs, _p), out_tiles)
        return max(1, min(tiles, min(_per_sm, max(1, resident)) * sms)), (B, N, out_tiles)

    return grid


def _derive_fused(params: dict, w: dict, name: str):
    context, project_smem, output_smem = _shared_context(params, w)
    threads, staged = params["threads"], params["tri_smem"]
    tri = triangle_staging(params["o_tile"], w["H"], bool(w["outgoing"]))
    context.update(threads=threads, output_threads=threads, output_smem=0, tri_smem=cuda_bool(staged),
                   **{f"tri_{k}": v for k, v in tri.items()})
    # One buffer, reused by every phase; staged sums hold the tile's z rows and two stages in it.
    triangle_smem = 4 * (params["o_tile"] * padded_stride(w["H"]) + 2 * tri["stage_floats"]) if staged else 0
    smem = max(project_smem, output_smem, triangle_smem)
    grid = _fused_grid(params["p_tile"], params["o_tile"], params["blocks_per_sm"], row_tiles=staged)
    return context, (Kernel(name, threads, smem, FUSED_ARGS, grid, mode="cooperative"),)


def _layouts_ok(plan: Plan, limits: DeviceLimits) -> bool:
    c = plan.context
    return all(c[f"{k}_threads_m"] and c[f"{k}_threads_n"] and c[f"{k}_lanes_m"] for k in ("p", "o"))


def _columns_divide(plan: Plan, limits: DeviceLimits) -> bool:
    """Column chunks of 4H (projection), of P (output) and, with the gate in hidden width, of H."""
    c = plan.context
    output_widths = (c["P"], c["H"]) if c["gate_hidden"] else (c["P"],)
    return (c["p_cn"] > 0 and (4 * c["H"]) % c["p_cn"] == 0 and c["o_cn"] > 0
            and all(width % c["o_cn"] == 0 for width in output_widths))


def _accumulators_fit(plan: Plan, limits: DeviceLimits) -> bool:
    c = plan.context
    return c["p_tm"] * c["p_tn"] <= 64 and 2 * c["o_tm"] * c["o_tn"] <= 64


def _persistent_blocks_fit(plan: Plan, limits: DeviceLimits) -> bool:
    blocks = plan.params["blocks_per_sm"]
    return blocks * plan.smem_bytes <= limits.smem_per_sm and blocks * plan.threads <= limits.max_threads_per_sm


_COMMON = (
    Restriction("tiles, threads and micro-tiles must form a thread layout (tile_map.cuh)", _layouts_ok),
    Restriction("column chunks must divide 4H (projection) and P (output; H too with the gate in hidden width)",
                _columns_divide),
    Restriction("at most 64 accumulators per thread", _accumulators_fit),
    Restriction("shared memory exceeds the per-block limit", smem_fits),
)

BMM = Strategy(
    name="bmm",
    summary="projection kernel -> (B*H, N, N) a, b -> cuBLAS bmm -> output kernel reading the product in place",
    # One block size for both kernels: it halves the space, and the defaults need no more.
    # min_blocks: the launch bounds' minimum blocks per SM. Unbounded, ptxas gives the 8x8 tiles
    # ~210 registers (one 256-thread block per SM); 2 caps them at 128. unroll: the 32 k-steps
    # of a 128-wide product unrolled 4 deep (a single value, kept as data to widen later).
    # The output kernel's two products ran slower than the projection's. o_weights_smem stages
    # its Wout/Wgate column chunks in shared memory (as p_weights_smem does for the projection):
    # it has not won a tuning yet. o_tn 8 gives each product 4 x 8 micro-tiles, 10.7 multiply-adds
    # per load as in the projection's (8 with o_tn 4).
    space={"p_tile": (64, 128), "p_tm": (4, 8), "p_tn": (4, 8), "p_weights_smem": (False, True),
           "o_tile": (32, 64, 128), "o_tm": (1, 2, 4), "o_tn": (4, 8), "o_weights_smem": (False, True),
           "threads": (128, 256), "unroll": (4,), "min_blocks": (1, 2)},
    derive=_derive_bmm,
    restrictions=_COMMON,
    # Exact fp32 keeps tf32x3's and tf32's promises too: where it is faster (small N), they run it.
    precisions=("float32", "tf32x3", "tf32"),
)

FUSED = Strategy(
    name="fused",
    summary="one cooperative kernel: projection, grid barrier, triangle sums + output (small N)",
    # tri_smem: the output phase's triangle sums from global memory per (pair, channel) (False), or
    # staged in shared memory per row tile (True; stages sized by triangle_staging).
    space={"p_tile": (32, 64), "p_tm": (2, 4), "p_tn": (4, 8), "o_tile": (16, 32, 64), "o_tm": (1, 2, 4),
           "threads": (128, 256), "unroll": (2, 4), "blocks_per_sm": (1, 2), "tri_smem": (False, True)},
    derive=_derive_fused,
    restrictions=_COMMON + (Restriction("persistent blocks must be co-resident on an SM", _persistent_blocks_fit),),
    precisions=("float32", "tf32x3", "tf32"),
)


# ---- tensor cores (mma) -------------------------------------------------------------------------



def mma_weight_offsets(P: int, H: int, bias: bool, elem_bytes: int, gate: int | None = None) -> dict[str, int]:
    """Byte offsets of the mma kernels' packed weights (shared with templates/trimul/mma.cu.j2),
    each section 16-byte aligned: the matrices n-major (nn.Linear's own layout) in the operand
    type, Wp's rows interleaved per channel (4h + {0,1,2,3} = proj_a, gate_a, proj_b, gate_b), the
    vectors fp32; bias sections are empty without bias. gate: the out gate's width (P unless it
    is in hidden width: gate_columns)."""
    nb, gate = (1 if bias else 0), (P if gate is None else gate)
    sizes = [("wp", 4 * H * P * elem_bytes), ("wo", P * H * elem_bytes), ("wg", gate * P * elem_bytes),
             ("ln_in_g", 4 * P), ("ln_in_b", 4 * P), ("bp", nb * 16 * H), ("ln_out_g", 4 * H), ("ln_out_b", 4 * H),
             ("bo", nb * 4 * P), ("bg", nb * 4 * gate)]
    return byte_sections(sizes)


def _mma_kernel_shape(params: dict, prefix: str, columns: int) -> dict:
    """Threads, fragments per warp and staged weight rows of one mma kernel."""
    warps_m, warps_n, wn = params[f"{prefix}_warps_m"], params[f"{prefix}_warps_n"], params[f"{prefix}_wn"]
    tile = params[f"{prefix}_tile"]
    mt = tile // (16 * warps_m) if tile % (16 * warps_m) == 0 else 0
    chunk = columns if params[f"{prefix}_resident"] else warps_n * wn
    return {"threads": 32 * warps_m * warps_n, "mt": mt, "nt": wn // 8, "chunk": chunk,
            "pass_cols": warps_n * wn, "columns": columns}


def _derive_mma(params: dict, w: dict, name: str):
    P, H, precision = w["P"], w["H"], w["precision"]
    eb = element_bytes(precision)
    x_row, z_row = mma_row_bytes(P, eb), mma_row_bytes(H, eb)
    proj, outp = _mma_kernel_shape(params, "p", 4 * H), _mma_kernel_shape(params, "o", P)
    hidden = bool(w["gate_hidden"])
    # with the gate in hidden width, the output kernel's first product's passes tile H
    gate = _mma_kernel_shape(params, "o", H) if hidden else outp
    context = {"P": P, "H": H, "outgoing": cuda_bool(w["outgoing"]), "gate_normalized": cuda_bool(w["gate_normalized"]),
               "bias": cuda_bool(w["bias"]), "mma_kind": MMA_KINDS[precision], "gate_hidden": hidden,
               "off": mma_weight_offsets(P, H, bool(w["bias"]), eb, gate_columns(w)),
               "p_tile": params["p_tile"], "p_warps_m": params["p_warps_m"], "p_warps_n": params["p_warps_n"],
               "p_wn": params["p_wn"], "p_resident": cuda_bool(params["p_resident"]),
               "o_tile": params["o_tile"], "o_warps_m": params["o_warps_m"], "o_warps_n": params["o_warps_n"],
               "o_wn": params["o_wn"], "o_resident": cuda_bool(params["o_resident"]),
               "mma_shapes": {"p": proj, "o": outp, **({"g": gate} if hidden else {})}}
    # weight rows, two x tiles (the next one is fetched while this one computes), and per warp the
    # staging block of its a, b (4 * nt channel rows of mt * 16 + 8 elements)
    staging = (proj["threads"] // 32) * 4 * proj["nt"] * (proj["mt"] * 16 + 8) * eb
    project_smem = (proj["chunk"] + 2 * params["p_tile"]) * x_row + staging
    # weight rows, layer_norm_out(z) as operands, two x tiles, the raw z in fp32 (rows of H + 1)
    output_smem = (outp["chunk"] * z_row + gate["chunk"] * x_row + params["o_tile"] * (z_row + 2 * x_row)
                   + params["o_tile"] * (H + 1) * 4)
    context.update(p_smem=project_smem, o_smem=output_smem)  # the template asserts its own sums equal these
    return context, (Kernel(name, proj["threads"], project_smem, PROJECT_ARGS, persistent_tile_grid(params["p_tile"])),
                     Kernel(f"{name}_output", outp["threads"], output_smem, OUTPUT_ARGS,
                            persistent_tile_grid(params["o_tile"])))


def _mma_layouts_ok(plan: Plan, limits: DeviceLimits) -> bool:
    """Whole 16-row fragments per warp, and passes of warps_n * wn columns that tile the columns."""
    return all(k["mt"] >= 1 and k["columns"] % k["pass_cols"] == 0 and k["threads"] <= 1024
               for k in plan.context["mma_shapes"].values())


def _output_rows_split(plan: Plan, limits: DeviceLimits) -> bool:
    """The output kernel's threads split evenly over its tile's rows (its triangle-sum prefetch)."""
    return plan.context["mma_shapes"]["o"]["threads"] % plan.params["o_tile"] == 0


def _mma_accumulators_fit(plan: Plan, limits: DeviceLimits) -> bool:
    """At most 128 fp32 accumulators per thread (the output kernel holds two products')."""
    p, o = plan.context["mma_shapes"]["p"], plan.context["mma_shapes"]["o"]
    return 4 * p["mt"] * p["nt"] <= 128 and 8 * o["mt"] * o["nt"] <= 128


MMA = Strategy(
    name="mma",
    summary="tensor cores: mma.sync projection kernel -> cuBLAS bmm in the same precision -> mma.sync output kernel",
    # Per kernel: the row tile, the warp grid (warps_m x warps_n), each warp's columns per pass (wn,
    # 8-column fragments in pairs), and whether a block keeps all of its weights in shared memory
    # for every tile it takes (resident; persistent blocks) or stages one pass's columns per tile.
    space={"p_tile": (64, 128, 256), "p_warps_m": (1, 2, 4), "p_warps_n": (1, 2, 4), "p_wn": (16, 32, 64),
           "p_resident": (True, False),
           "o_tile": (32, 64, 128), "o_warps_m": (1, 2, 4), "o_warps_n": (1, 2, 4), "o_wn": (16, 32, 64),
           "o_resident": (True, False)},
    derive=_derive_mma,
    restrictions=(Restriction("tiles must split into 16-row fragments per warp and passes must tile the columns",
                              _mma_layouts_ok),
                  Restriction("at most 128 accumulators per thread", _mma_accumulators_fit),
                  Restriction("the output kernel's threads must be a multiple of its tile", _output_rows_split),
                  Restriction("shared memory exceeds the per-block limit", smem_fits)),
    precisions=tuple(MMA_KINDS),
)


# ---- warpgroup tensor cores (wgmma, sm_90a) -----------------------------------------------------

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
    gate, nz = (H, 1) if gate_hidden else (P, 0)
    sizes = [("wp", 4 * H * k_padded(P) * elem_bytes), ("wo", P * k_padded(H) * elem_bytes),
             ("wg", gate * k_padded(P) * elem_bytes),
             ("c1p", 16 * H), ("c2p", 16 * H), ("c1o", 4 * P), ("c2o", 4 * P), ("c1g", 4 * gate), ("c2g", 4 * gate),
             ("gz", nz * 4 * H), ("bz", nz * 4 * H)]
    return byte_sections(sizes)


def _wgmma_grid(groups: int):
    """Persistent blocks of `groups` warpgroups, each warpgroup taking 64-row tiles in turn: at most
    as many blocks as are resident at once, and no more than the tiles need."""

    def grid(B, N, sms, resident, _groups=groups):
        tiles = ceil_div(B * N * N, WGMMA_ROWS)
        return max(1, min(ceil_div(tiles, _groups), max(1, resident) * sms)), (B, N, tiles)

    return grid


def _derive_wgmma(params: dict, w: dict, name: str):
    P, H, precision = w["P"], w["H"], w["precision"]
    eb = element_bytes(precision)
    x_tile, z_tile = WGMMA_ROWS * k_padded(P) * eb, WGMMA_ROWS * k_padded(H) * eb
    # Every region 1024-byte aligned (the 128-byte swizzle's atoms). Resident Wp; per warpgroup
    # p_stages x tiles and, per warp, the staging of a pass's a, b (p_wn / 2 slots of 24 elements:
    # its 16 rows, padded).
    project_smem = (align(4 * H * k_padded(P) * eb, 1024)
                    + params["p_groups"] * align(params["p_stages"] * x_tile + 4 * params["p_wn"] // 2 * 24 * eb, 1024))
    # Resident Wout and Wgate; per warpgroup o_stages x tiles, the triangle sums as they lie in
    # memory ([H][64]) and in the operand layout, and the rows' partial statistics ([4][64] fp32).
    hidden = bool(w["gate_hidden"])
    output_smem = (align(P * k_padded(H) * eb, 1024) + align(gate_columns(w) * k_padded(P) * eb, 1024)
                   + params["o_groups"] * align(params["o_stages"] * x_tile + align(WGMMA_ROWS * H * eb, 1024)
                                                + z_tile + 4 * 64 * 4, 1024))
    context = {"P": P, "H": H, "gate_normalized": cuda_bool(w["gate_normalized"]), "mma_kind": MMA_KINDS[precision],
               "gate_hidden": hidden, "off": wgmma_weight_offsets(P, H, eb, hidden),
               "p_groups": params["p_groups"], "p_wn": params["p_wn"],
               "p_stages": params["p_stages"], "o_stages": params["o_stages"], "swizzle": cuda_bool(params["swizzle"]),
               "o_groups": params["o_groups"], "o_wn": params["o_wn"],
               "wgmma_widths": sorted({params["p_wn"], params["o_wn"]}), "p_smem": project_smem, "o_smem": output_smem}
    return context, (Kernel(name, 128 * params["p_groups"], project_smem, PROJECT_ARGS, _wgmma_grid(params["p_groups"])),
                     Kernel(f"{name}_output", 128 * params["o_groups"], output_smem, OUTPUT_ARGS,
                            _wgmma_grid(params["o_groups"])))


def _wgmma_columns_divide(plan: Plan, limits: DeviceLimits) -> bool:
    """Whole 16-byte chunks per row, and passes that tile the projection's 4H and the output's P
    columns (and H, the gate's, where it is in hidden width)."""
    P, H, o_wn = plan.widths["P"], plan.widths["H"], plan.params["o_wn"]
    return (P % 8 == 0 and H % 8 == 0 and (4 * H) % plan.params["p_wn"] == 0 and P % o_wn == 0
            and (not plan.widths.get("gate_hidden") or H % o_wn == 0))


def _swizzle_applies(plan: Plan, limits: DeviceLimits) -> bool:
    """The swizzle takes operands whose K is whole 64-element blocks: P (x, the weights on it) or H
    (the triangle sums, Wout); elsewhere the point would repeat the unswizzled one."""
    return not plan.params["swizzle"] or k_padded(plan.widths["P"]) % 64 == 0 or k_padded(plan.widths["H"]) % 64 == 0


def _wgmma_accumulators_fit(plan: Plan, limits: DeviceLimits) -> bool:
    """At most 128 fp32 accumulators per thread (the projection holds two passes', the output kernel
    two products'), and at most 64 where a block has 4 warpgroups (65536 registers per SM: 128 per
    thread)."""
    p, o = plan.params["p_wn"], plan.params["o_wn"]
    return (p <= (64 if plan.params["p_groups"] == 4 else 128)
            and o <= (64 if plan.params["o_groups"] == 4 else 128))


WGMMA = Strategy(
    name="wgmma",
    summary="Hopper tensor cores: wgmma projection kernel (LayerNorm folded into its epilogue) -> cuBLAS bmm -> "
            "wgmma output kernel",
    # Per kernel: warpgroups per block (each works alone on 64-row tiles, sharing the block's
    # resident weights) and the columns of one wgmma pass (its n: wn / 2 accumulators per thread);
    # each kernel's x tiles per warpgroup (2: the next one in flight; 1: room for more groups); the
    # operands' layout in shared memory (swizzle: 128-byte swizzle where K is a multiple of 64).
    space={"p_groups": (1, 2, 3, 4), "p_wn": (32, 64, 128), "p_stages": (1, 2),
           "o_groups": (1, 2, 3, 4), "o_wn": (16, 32, 64, 128), "o_stages": (1, 2), "swizzle": (False, True)},
    derive=_derive_wgmma,
    restrictions=(WGMMA_ON_SM90,
                  Restriction("rows must be whole 16-byte chunks and passes must tile the columns",
                              _wgmma_columns_divide),
                  Restriction("at most 128 accumulators per thread", _wgmma_accumulators_fit),
                  Restriction("the swizzle applies to no operand (neither P nor H a multiple of 64)", _swizzle_applies),
                  Restriction("shared memory exceeds the per-block limit", smem_fits)),
    precisions=HALF_PRECISIONS,
)


def options_of(widths: dict) -> dict:
    """Constructor options from the 0/1 entries of a widths dict (absent: the defaults)."""
    return {"direction": "outgoing" if widths.get("outgoing", 0) else "incoming",
            "gate_on": "normalized" if widths.get("gate_normalized", 0) else "input",
            "bias": bool(widths.get("bias", 1)), "gate_at": "hidden" if widths.get("gate_hidden", 0) else "output"}


class TrimulSpec(OpSpec):
    # Parameters added to a strategy after tuned entries existed, with the value that reproduces what
    # those entries ran, so that an entry without them still plans.
    added_params = {"fused": {"tri_smem": False}, "bmm": {"o_weights_smem": False, "o_tn": O_TN}}
    name = "trimul"
    # The options are compile-time and part of the tuned key, as 0/1 next to the widths.
    width_names = ("P", "H", "outgoing", "gate_normalized", "bias")
    # The out gate in hidden width (lucidrains' placement): named in a key only where it is 1.
    optional_widths = {"gate_hidden": 0}
    strategies = {s.name: s for s in (BMM, FUSED, MMA, WGMMA)}
    default_points = (
        # P a multiple of 64, H of 32 (the real models): 128-column chunks of 4H, 8x8 micro-tiles.
        ("bmm", {"p_tile": 128, "p_tm": 8, "p_tn": 8, "p_weights_smem": False, "o_tile": 64, "o_tm": 4, "o_tn": 4,
                 "o_weights_smem": False, "threads": 256, "unroll": 4, "min_blocks": 1}),
        # Any P, H multiples of 8 up to 256: 32-column chunks of 4H, 8-column chunks of P (64-row
        # output tiles keep P = H = 248 within shared memory).
        ("bmm", {"p_tile": 64, "p_tm": 4, "p_tn": 4, "p_weights_smem": False, "o_tile": 64, "o_tm": 1, "o_tn": 4,
                 "o_weights_smem": False, "threads": 128, "unroll": 4, "min_blocks": 1}),
        # Hopper tensor cores (16-bit, sm_90): 4 warpgroups per SM with one x tile each and swizzled
        # operands (the fastest layout measured at P = H = 128). The others are unswizzled, as they
        # must be where neither P nor H is a multiple of 64; the last has passes small enough for any
        # P a multiple of 16 and H of 8.
        ("wgmma", {"p_groups": 4, "p_stages": 1, "p_wn": 64, "o_groups": 3, "o_wn": 64, "o_stages": 1, "swizzle": True}),
        ("wgmma", {"p_groups": 3, "p_stages": 1, "p_wn": 64, "o_groups": 2, "o_wn": 64, "o_stages": 2, "swizzle": False}),
        ("wgmma", {"p_groups": 2, "p_stages": 1, "p_wn": 32, "o_groups": 2, "o_wn": 16, "o_stages": 1, "swizzle": False}),
        # Tensor cores: weights resident in shared memory where they fit (bf16/fp16 at P = H = 128),
        # else staged per pass; 8 warps per kernel, 64x32 warp tiles in the projection, 32x32 in
        # the output (a block per SM: enough warps to keep loads in flight).
        ("mma", {"p_tile": 128, "p_warps_m": 2, "p_warps_n": 4, "p_wn": 32, "p_resident": True,
                 "o_tile": 64, "o_warps_m": 2, "o_warps_n": 4, "o_wn": 32, "o_resident": True}),
        ("mma", {"p_tile": 128, "p_warps_m": 2, "p_warps_n": 4, "p_wn": 32, "p_resident": False,
                 "o_tile": 64, "o_warps_m": 2, "o_warps_n": 4, "o_wn": 32, "o_resident": False}),
        ("mma", {"p_tile": 64, "p_warps_m": 2, "p_warps_n": 2, "p_wn": 16, "p_resident": False,
                 "o_tile": 32, "o_warps_m": 2, "o_warps_n": 2, "o_wn": 16, "o_resident": False}),
        # Any P, H multiples of 16 and 8: 16-column passes.
        ("mma", {"p_tile": 64, "p_warps_m": 2, "p_warps_n": 1, "p_wn": 16, "p_resident": False,
                 "o_tile": 32, "o_warps_m": 2, "o_warps_n": 1, "o_wn": 16, "o_resident": False}),
    )
    presets = {
        "seed": ({"B": 2, "N": 32, "P": 64, "H": 32, "outgoing": 0, "gate_normalized": 0, "bias": 1},),
        "real": tuple({"B": b, "N": n, "P": 128, "H": 128, "outgoing": 0, "gate_normalized": 0, "bias": 1}
                      for b, n in ((1, 128), (1, 256), (1, 512), (2, 768)))
                + ({"B": 1, "N": 256, "P": 128, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 1},),
        # The form AlphaFold 3, Boltz, Protenix and OpenFold 3 run: both directions, the output gate
        # on the normalised input, no biases.
        "models": tuple({"B": b, "N": n, "P": 128, "H": 128, "outgoing": o, "gate_normalized": 1, "bias": 0}
                        for b, n in ((1, 256), (1, 512)) for o in (1, 0))
                  + ({"B": 2, "N": 768, "P": 128, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 0},),
        # The pair widths of AlphaFold 3-scale trunks and public benchmarks (hidden 128), in that form.
        "wide": tuple({"B": 1, "N": n, "P": p, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 0}
                      for p in (256, 384, 768) for n in (256, 512, 1024)),
        # lucidrains' form: the out gate in hidden width, on the normalised input, biases everywhere.
        "hidden": tuple({"B": 1, "N": n, "P": 128, "H": 128, "outgoing": o, "gate_normalized": 1, "bias": 1,
                         "gate_hidden": 1} for n in (256, 512) for o in (1, 0)),
    }
    tolerance = {"float32": Tolerance(max_abs=1e-4, rel_l2=1e-5), "tf32x3": Tolerance(max_abs=1e-4, rel_l2=1e-5),
                 "tf32": Tolerance(max_abs=float("inf"), rel_l2=5e-3),
                 "bfloat16": SIXTEEN_BIT_TOLERANCE, "float16": SIXTEEN_BIT_TOLERANCE}
    width_defaults = {"outgoing": 0, "gate_normalized": 0, "bias": 1}  # the reference's defaults
    extra_peer_names = ("cuequivariance",)

    def constructor_args(self, widths: dict) -> dict:
        return {"pair_dim": widths["P"], "hidden_dim": widths["H"], **options_of(widths)}

    def cost(self, shape: dict) -> Cost:
        """The reference's FLOPs (projections, triangle sums, output layers) and the bytes that must
        move: the input once, the mask, the output once, the weights."""
        B, N, P, H = (shape[k] for k in ("B", "N", "P", "H"))
        pairs = B * N * N
        flops = 2 * pairs * P * 4 * H + 2 * B * N * N * N * H + 2 * pairs * (H * P + P * P)
        weights = 4 * P * H + H * P + P * P
        return Cost(bytes=4.0 * (2 * pairs * P + weights) + pairs, flops=float(flops))


TRIMUL = TrimulSpec()
