"""mma: the bmm strategy's three steps on tensor cores, for bf16 and fp16 (modules in those dtypes,
and fp32 modules under autocast), tf32 and tf32x3 (fp32 modules with precision="tf32" / "tf32x3").
Projection and output kernels run mma.sync (templates/trimul/mma.cu.j2, templates/common/mma.cuh.j2);
the contraction is cuBLAS in the same precision."""
from __future__ import annotations

import functools

from ....spec import (MMA_KINDS, DeviceLimits, Kernel, Plan, Restriction, Strategy, byte_sections, cuda_bool,
                      element_bytes, mma_row_bytes, persistent_tile_grid, smem_fits)
from ...packing import OPERAND_KINDS, Sources, layout
from ..common import OUTPUT_ARGS, PROJECT_ARGS, gate_columns
from ..packs import FOUR

#: torch and what needs it, bound by _import_torch_half() on the first call a strategy runs, so that
#: the spec half (space, restrictions, plans) loads without torch and a call pays no import.
torch = fastcall = cublas_fp32_mode = HALF_DTYPES = OPERAND_DTYPES = triangle_bmm = triangle_operands = None


def _import_torch_half() -> None:
    global torch, fastcall, cublas_fp32_mode, HALF_DTYPES, OPERAND_DTYPES, triangle_bmm, triangle_operands
    import torch
    from .... import fastcall
    from ....module.modes import cublas_fp32_mode
    from ....precision import HALF_DTYPES, OPERAND_DTYPES
    from ..triangle import triangle_bmm, triangle_operands


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


def derive(params: dict, w: dict, name: str):
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


def _writes_operand_type(plan: Plan, limits: DeviceLimits) -> bool:
    """Its output kernel stores the operand type: an fp32 output (out_fp32) is the wgmma kernels'."""
    return not plan.widths.get("out_fp32")


@functools.lru_cache(maxsize=64)
def mma_layout(P: int, H: int, bias: bool, gate: int, precision: str, sources: Sources):
    """pack_mma_weights's layout (mma_weight_offsets, bytes): the matrices n-major as nn.Linear holds
    them, in the operand type (Wp's rows interleaved per channel: 4h + {0,1,2,3} = proj_a, gate_a,
    proj_b, gate_b of channel h), the LayerNorm affines and biases in fp32."""
    kind = OPERAND_KINDS[precision]
    size = 2 if kind in ("bf16", "f16") else 4
    off = mma_weight_offsets(P, H, bias, size, gate)
    s = sources
    pieces = [s.copy("out_proj.weight", kind, off["wo"], P, H), s.copy("out_gate.weight", kind, off["wg"], gate, P),
              s.copy("layer_norm_in.weight", "f32", off["ln_in_g"], P), s.copy("layer_norm_in.bias", "f32", off["ln_in_b"], P),
              s.copy("layer_norm_out.weight", "f32", off["ln_out_g"], H),
              s.copy("layer_norm_out.bias", "f32", off["ln_out_b"], H)]
    for k, name in enumerate(FOUR):  # row 4h + k of Wp is row h of W_k
        pieces.append(s.piece(f"{name}.weight", kind, off["wp"] + size * k * P, H, P, (P, 1), (4 * P, 1)))
        if bias:
            pieces.append(s.piece(f"{name}.bias", "f32", off["bp"] + 4 * k, H, 1, (1, 0), (4, 0)))
    if bias:
        pieces += [s.copy("out_proj.bias", "f32", off["bo"], P), s.copy("out_gate.bias", "f32", off["bg"], gate)]
    return layout(off["total"], pieces, sources.count)


def pack(module, plan, weights):
    """`weights` packed for this call in the plan's precision (mma_layout)."""
    w = module.widths
    P, H, bias = w["P"], w["H"], bool(w["bias"])
    return module._packed(mma_layout(P, H, bias, gate_columns(w), plan.precision, weights.sources), weights)


def _row_statistics(launches: list, x, rounded: dict):
    """The rows' LayerNorm statistics of x for kernels that read them rather than take them from
    their tiles (the sliced wgmma kernels): `launches` holds the statistics kernel, or nothing
    where no kernel of the variant reads them; it writes x rounded to the operand type too where it
    declares `xh` (rounded: that argument). Returns (the statistics tensor or None, the `stats`
    argument to pass or nothing). The caller holds the tensor until every kernel that reads it is
    enqueued: freed earlier, its memory could go to the triangle sums the bmm writes before the
    output kernel reads the statistics."""
    if not launches:
        return None, {}
    stats, argument = statistics_buffer(x)
    launches[0].named(x=x.data_ptr(), stats=stats.data_ptr(), **_taken(launches[0], rounded))
    return stats, argument


def statistics_buffer(x):
    """An empty (2, B*N*N) fp32 tensor for x's rows' statistics (mean, then 1/std) and the `stats`
    argument that passes it, noted as the call's scratch."""
    if torch is None:
        _import_torch_half()
    stats = torch.empty((2, x.shape[0] * x.shape[1] * x.shape[2]), device=x.device, dtype=torch.float32)
    fastcall.note_scratch(stats)
    return stats, {"stats": stats.data_ptr()}


def _taken(launch, arguments: dict) -> dict:
    """Those of `arguments` the launch's kernel declares."""
    return {name: value for name, value in arguments.items() if name in launch.names}


class Projected:
    """What run_projection leaves: a and b (ab, (2, B*H, copies*N*N)), x in the operand type (its
    pointer), the kernels' remaining launches and the row statistics (`stats`: the argument; the
    tensor held until every kernel that reads it is enqueued)."""

    def __init__(self, ab, x, launches, held_stats, stats):
        self.ab, self.x, self.launches, self.held_stats, self.stats = ab, x, launches, held_stats, stats


def run_projection(variant, x, mask, packed, H: int) -> Projected:
    """The variant's projection kernel (after its statistics kernel, where it has one): a and b
    channel-major from x, the mask and the pack, on the current stream."""
    if torch is None:
        _import_torch_half()
    B, N = x.shape[0], x.shape[1]
    precision = variant.plan.precision
    *statistics, project, output = variant.launches(x.get_device(), B, N)
    copies = 3 if precision == "tf32x3" else 1
    ab = torch.empty((2, B * H, copies * N * N), device=x.device, dtype=OPERAND_DTYPES[precision])
    fastcall.note_scratch(ab)
    rounded, read = {}, x
    if x.dtype is not ab.dtype:  # an fp32 input under autocast: the kernels read x in the operand type,
        # which the first kernel that declares xh writes as it reads x (wgmma's statistics kernel with
        # stats_cast, or its projection with x_fp32); else a cast before the kernels
        writer = next((launch for launch in (*statistics, project) if "xh" in launch.names), None)
        if writer is not None:
            xh = torch.empty(x.shape, device=x.device, dtype=ab.dtype)
            fastcall.note_scratch(xh)
            rounded = {"xh": xh.data_ptr()}
            read = x if writer is project else xh  # the projection reads what the statistics kernel wrote
        else:
            x = read = fastcall.cast(x, ab.dtype)
    held_stats, stats = _row_statistics(statistics, x, rounded)
    if not statistics and "stats" in project.names:  # the projection writes them for the output kernel
        held_stats, stats = statistics_buffer(x)
    project.named(x=read.data_ptr(), mask=mask.data_ptr(), w=packed.data_ptr(), ar=ab[0].data_ptr(),
                  br=ab[1].data_ptr(), mask_is_float=int(mask.dtype is torch.float32), **_taken(project, rounded),
                  **_taken(project, stats))
    return Projected(ab, xh if rounded else x, (output,), held_stats, stats)


def run_three_steps(module, variant, x, mask, out, packed) -> None:
    """Projection kernel (tensor cores) -> cuBLAS bmm in the same precision -> output kernel, on
    the weights `packed` for the call (the mma and wgmma strategies, each with its own pack).
    tf32x3's a and b hold three blocks each along the contracted index (mma.cu.j2), so one TF32
    GEMM over 3N sums hi·hi + hi·lo + lo·hi."""
    B, N = x.shape[0], x.shape[1]
    H, precision = module.widths["H"], variant.plan.precision
    projected = run_projection(variant, x, mask, packed, H)  # its statistics held until the output kernel is enqueued
    ab, (output,) = projected.ab, projected.launches
    copies = 3 if precision == "tf32x3" else 1
    shape = (B * H, N, copies * N) if module._outgoing else (B * H, copies * N, N)
    ar, br = ab[0].view(shape), ab[1].view(shape)
    if precision in HALF_DTYPES:  # fp32 accumulation, output in the operands' dtype
        z = torch.empty((B * H, N, N), device=x.device, dtype=ab.dtype)
        fastcall.note_scratch(z)
        left, right = triangle_operands(ar, br, module._outgoing)
        torch.bmm(left, right, out=z)
        fastcall.note_product(left, right, z)  # a replay runs it between the two kernels
    else:
        with cublas_fp32_mode(tf32=True):
            z = triangle_bmm(ar, br, module._outgoing)
    output.named(x=projected.x.data_ptr(), z=z.data_ptr(), w=packed.data_ptr(), out=out.data_ptr(),
                 **_taken(output, projected.stats))
    del projected


def run(module, variant, weights, x, mask, out) -> None:
    packed = pack(module, variant.plan, weights)  # alive until every launch is enqueued
    run_three_steps(module, variant, x, mask, out, packed)


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
    derive=derive,
    restrictions=(Restriction("tiles must split into 16-row fragments per warp and passes must tile the columns",
                              _mma_layouts_ok),
                  Restriction("at most 128 accumulators per thread", _mma_accumulators_fit),
                  Restriction("the output kernel's threads must be a multiple of its tile", _output_rows_split),
                  Restriction("shared memory exceeds the per-block limit", smem_fits),
                  Restriction("an fp32 output (out_fp32) is the wgmma strategy's", _writes_operand_type)),
    precisions=tuple(MMA_KINDS),
    records=("bfloat16", "float16"),  # in fp32 its product runs in a TF32 mode a replay does not set
    run=run,
)
