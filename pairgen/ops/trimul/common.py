"""What the triangle update's strategies share (no torch): the kernels' argument lists, the fp32
kernels' weight offsets, and the FMA strategies' (bmm, fused) thread layouts, triangle-sum staging,
template context and restrictions."""
from __future__ import annotations

from ...spec import DeviceLimits, Plan, Restriction, align, cuda_bool, padded_stride, section_offsets, smem_fits

#: The projection kernel: x, mask, weights, a, b, then B, N, tiles, and whether the mask is float.
PROJECT_ARGS = ("ptr x", "ptr mask", "ptr w", "ptr ar", "ptr br", "i32 B", "i32 N", "i32 num_tiles", "i32 mask_is_float")
#: The output kernel: x, the triangle sums z, weights, out, then B, N, tiles.
OUTPUT_ARGS = ("ptr x", "ptr z", "ptr w", "ptr out", "i32 B", "i32 N", "i32 num_tiles")


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


def fma_context(params: dict, w: dict) -> tuple[dict, int, int]:
    """The context the FMA strategies (bmm, fused) share (projection and output phases), with the projection's
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


#: The restrictions the FMA strategies (bmm, fused) share.
FMA_RESTRICTIONS = (
    Restriction("tiles, threads and micro-tiles must form a thread layout (tile_map.cuh)", _layouts_ok),
    Restriction("column chunks must divide 4H (projection) and P (output; H too with the gate in hidden width)",
                _columns_divide),
    Restriction("at most 64 accumulators per thread", _accumulators_fit),
    Restriction("shared memory exceeds the per-block limit", smem_fits),
)
