"""mma: symmetric_tiled's tiles on tensor cores (mma.sync) for bf16, fp16, tf32 and tf32x3: layers 1
and 2 as warp products with the weights resident in shared memory, layer 3 folded into layer 2's
epilogue (templates/contact/mma.cu.j2). Its pack and runner are wgmma's too."""
from __future__ import annotations

import functools

from ....spec import (MMA_KINDS, MMA_TILE_RESTRICTIONS, DeviceLimits, Kernel, Plan, Restriction, Strategy,
                      byte_sections, ceil_div, element_bytes, mma_row_bytes, persistent_blocks)
from ...packing import OPERAND_KINDS, Sources, layout

#: torch and what needs it, bound by _import_torch_half() on the first call a strategy runs, so that
#: the spec half (space, restrictions, plans) loads without torch and a call pays no import.
OPERAND_DTYPES = fastcall = None


def _import_torch_half() -> None:
    global OPERAND_DTYPES, fastcall
    from .... import fastcall
    from ....precision import OPERAND_DTYPES

#: x, packed weights, out, then the batches, the length and the tiles as 64-bit ints (mma, wgmma).
TENSOR_CORE_ARGS = ("ptr x", "ptr w", "ptr out", "i64 batches", "i64 length", "i64 num_tiles")


def mma_weight_offsets(P: int, H: int, elem_bytes: int) -> dict[str, int]:
    """Byte offsets of the mma kernel's packed weights (shared with templates/contact/mma.cu.j2),
    each section 16-byte aligned: W1 [H][P] and W2 [H][H] n-major (nn.Linear's layout) in the
    operand type; b1, b2, w3, b3, gamma, beta in fp32."""
    return byte_sections([("w1", H * P * elem_bytes), ("w2", H * H * elem_bytes), ("b1", 4 * H), ("b2", 4 * H),
                          ("w3", 4 * H), ("b3", 4), ("gamma", 4 * P), ("beta", 4 * P)])


def _mma_shape(params: dict, H: int) -> dict:
    """Rows per tile, 16-row fragments per warp (0 where the warps do not split the tile) and
    columns of H per pass of the warps."""
    rows = params["tile_side"] ** 2
    mt = rows // (16 * params["warps_m"]) if rows % (16 * params["warps_m"]) == 0 else 0
    return {"rows": rows, "mt": mt, "nt": params["wn"] // 8, "pass": params["warps_n"] * params["wn"]}


def derive(params: dict, widths: dict, name: str):
    P, H, precision = widths["P"], widths["H"], widths["precision"]
    eb = element_bytes(precision)
    x_row, z_row = mma_row_bytes(P, eb), mma_row_bytes(H, eb)
    shape = _mma_shape(params, H)
    threads = 32 * params["warps_m"] * params["warps_n"]
    # resident W1 and W2, the tile's symmetrised rows and layer 1's output, layer 3's partial sums,
    # and (prefetch) the next tile's raw rows in both orientations
    smem = (H * (x_row + z_row) + shape["rows"] * (x_row + z_row) + params["warps_n"] * shape["rows"] * 4
            + (2 * shape["rows"] * P * eb if params["prefetch"] else 0))
    context = {"P": P, "H": H, "mma_kind": MMA_KINDS[precision], "off": mma_weight_offsets(P, H, eb),
               "tile_side": params["tile_side"], "warps_m": params["warps_m"], "warps_n": params["warps_n"],
               "wn": params["wn"], "prefetch": params["prefetch"], "smem": smem,
               "min_blocks": params["blocks_per_sm"], "mma_shape": shape, "ln_quads": params["ln_quads"]}

    def grid(B, N, sms, resident, _side=params["tile_side"], _per_sm=params["blocks_per_sm"]):
        nb = ceil_div(N, _side)
        tiles = B * nb * (nb + 1) // 2
        return persistent_blocks(tiles, _per_sm, sms, resident), (B, N, tiles)

    return context, (Kernel(name, threads, smem, TENSOR_CORE_ARGS, grid),)


def _mma_layout_ok(plan: Plan, limits: DeviceLimits) -> bool:
    """Whole 16-row fragments per warp, passes that tile H, 16-byte weight rows."""
    shape, w = plan.context["mma_shape"], plan.widths
    return shape["mt"] >= 1 and w["H"] % shape["pass"] == 0 and w["P"] % 8 == 0 and w["H"] % 8 == 0


LN_QUADS_FIT = Restriction(
    "ln_quads splits each row into 16-byte pieces over a quad's 4 lanes: P a multiple of 32 (16-bit) or 16 (fp32)",
    lambda p, _: not p.params["ln_quads"] or (p.widths["P"] * element_bytes(p.precision)) % 64 == 0)


@functools.lru_cache(maxsize=64)
def mma_layout(P: int, H: int, precision: str, sources: Sources):
    """W1, W2 n-major (nn.Linear's own layout) in the operand type, the vectors in fp32, at
    mma_weight_offsets (bytes)."""
    kind = OPERAND_KINDS[precision]
    off = mma_weight_offsets(P, H, 2 if kind in ("bf16", "f16") else 4)
    s = sources
    pieces = [s.copy("mlp.0.weight", kind, off["w1"], H, P), s.copy("mlp.2.weight", kind, off["w2"], H, H),
              s.copy("mlp.0.bias", "f32", off["b1"], H), s.copy("mlp.2.bias", "f32", off["b2"], H),
              s.copy("mlp.4.weight", "f32", off["w3"], H), s.copy("mlp.4.bias", "f32", off["b3"], 1),
              s.copy("layer_norm.weight", "f32", off["gamma"], P), s.copy("layer_norm.bias", "f32", off["beta"], P)]
    return layout(off["total"], pieces, sources.count)


def run(module, variant, weights, x, out) -> None:
    """The tensor-core kernel, on the weights packed for the call in its operand dtype; an fp32
    input under autocast is cast first (the kernel reads x in that dtype)."""
    if OPERAND_DTYPES is None:
        _import_torch_half()
    B, N = x.shape[0], x.shape[1]
    dtype = OPERAND_DTYPES[variant.plan.precision]
    if x.dtype is not dtype:
        x = fastcall.cast(x, dtype)
    P, H = module.widths["P"], module.widths["H"]
    packed = module._packed(mma_layout(P, H, variant.plan.precision, weights.sources), weights)
    (main,) = variant.launches(x.get_device(), B, N)
    main.named(x=x.data_ptr(), w=packed.data_ptr(), out=out.data_ptr())


MMA = Strategy(
    name="mma",
    summary="symmetric tiles on tensor cores: layers 1 and 2 as mma.sync products on resident weights, layer 3 "
            "in layer 2's epilogue",
    # tile_side: pairs per side of a symmetric tile (64 or 256 rows); warps_m x warps_n warps, wn
    # columns of H each per pass; blocks_per_sm: the persistent grid's blocks per SM; prefetch: the
    # next tile's rows copied into shared memory during this tile's products; ln_quads: step 1 with a
    # quad of lanes per pair and 16-byte loads (else a warp per pair).
    space={"tile_side": (8, 16), "warps_m": (1, 2, 4), "warps_n": (1, 2, 4), "wn": (16, 32, 64),
           "blocks_per_sm": (1, 2), "prefetch": (True, False), "ln_quads": (True, False)},
    derive=derive,
    restrictions=(
        Restriction("tiles must split into 16-row fragments per warp, passes must tile H, and P, H be "
                    "multiples of 8", _mma_layout_ok),
        LN_QUADS_FIT,
        *MMA_TILE_RESTRICTIONS,
    ),
    precisions=tuple(MMA_KINDS),
    run=run,
    records=tuple(MMA_KINDS),
)
