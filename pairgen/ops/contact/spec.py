"""The contact head's spec: strategies, search spaces, restrictions, defaults, plans.

Five strategies:
  thread_per_pair  one thread per pair, layers computed `chunk` outputs at a time in registers.
  tiled            a block computes tile_rows consecutive pairs; the MLP as register-tiled products.
  symmetric_tiled  tiled over blocks (bi <= bj) of the pair grid: each pair computed once, written
                   twice (the output is exactly symmetric).
  mma              symmetric_tiled's tiles on tensor cores (mma.sync) for bf16, fp16, tf32 and tf32x3:
                   layers 1 and 2 as warp products with the weights resident in shared memory,
                   layer 3 folded into layer 2's epilogue (templates/contact/mma.cu.j2).
  wgmma            the same tiles on Hopper's warpgroup products (bf16, fp16; sm_90a): each warpgroup
                   a tile of 64 pairs at a time, layer 3 summed within quads (templates/contact/wgmma.cu.j2).
"""
from __future__ import annotations

from ...spec import (HALF_PRECISIONS, MMA_KINDS, MMA_TILE_RESTRICTIONS, SIXTEEN_BIT_TOLERANCE, WGMMA_ON_SM90, align,
                     byte_sections, element_bytes, mma_row_bytes, Cost, DeviceLimits, Kernel, OpSpec, Plan,
                     Restriction, Strategy, Tolerance, ceil_div, cuda_bool, is_pow2, padded_stride, persistent_blocks,
                     section_offsets, smem_fits)

#: The kernels' arguments: x, packed weights, out, then B, N and the work count as 64-bit ints (each
#: template names them its own way).
THREAD_PER_PAIR_ARGS = ("ptr x", "ptr wpack", "ptr out", "i64 B", "i64 N", "i64 total")
TILED_ARGS = ("ptr x", "ptr wpack", "ptr out", "i64 B64", "i64 N64", "i64 num_tiles64")
TENSOR_CORE_ARGS = ("ptr x", "ptr w", "ptr out", "i64 batches", "i64 length", "i64 num_tiles")


def weight_offsets(P: int, H: int) -> dict[str, int]:
    """Packed-weight layout shared with the templates (16-byte sections)."""
    return section_offsets([("w1t", P * H), ("b1", H), ("w2t", H * H), ("b2", H), ("w3", H), ("b3", 1),
                            ("gamma", P), ("beta", P)])


def _widths_vectorise(plan: Plan, limits: DeviceLimits) -> bool:
    return plan.widths["H"] % 4 == 0 and plan.widths["P"] % 4 == 0


_COMMON = (
    Restriction("P and H must be multiples of 4 (float4 weight reads)", _widths_vectorise),
    Restriction("shared memory exceeds the per-block limit", smem_fits),
)


def _base_context(params: dict, widths: dict) -> tuple[dict, int]:
    """The context every strategy shares, and the bytes of weights staged in shared memory."""
    P, H = widths["P"], widths["H"]
    off = weight_offsets(P, H)
    context = {"P": P, "H": H, "off": off, "weights_smem": cuda_bool(params["weights_smem"])}
    return context, (4 * off["total"] if params["weights_smem"] else 0)


def _derive_thread_per_pair(params: dict, widths: dict, name: str):
    context, weights = _base_context(params, widths)
    P, H, threads = widths["P"], widths["H"], params["threads"]
    context.update(threads=threads, chunk=params["chunk"], symmetric=cuda_bool(params["symmetric"]))

    def grid(B, N, sms, resident, _sym=params["symmetric"], _t=threads):
        work = B * (N * (N + 1) // 2 if _sym else N * N)
        return max(1, ceil_div(work, _t)), (B, N, work)

    return context, (Kernel(name, threads, weights + 4 * (P + H) * threads, THREAD_PER_PAIR_ARGS, grid),)


def _tiled_context(params: dict, widths: dict, rows: int) -> tuple[dict, int]:
    """The tiled strategies' context for `rows` pairs per tile, and their shared memory."""
    context, weights = _base_context(params, widths)
    P, H = widths["P"], widths["H"]
    threads_n = max(1, H // params["tn"])
    threads_m = max(1, params["threads"] // threads_n)
    context.update(tile_rows=rows, threads=params["threads"], tn=params["tn"], threads_n=threads_n,
                   threads_m=threads_m, tm=rows // threads_m, unroll=params["unroll"], ln_rows=params["ln_rows"],
                   a_stride=padded_stride(max(P, H)), stage_rows=params["stage_rows"], ln_lanes=params["ln_lanes"])
    staged = params["stage_rows"] * 2 * rows * P  # both orientations of a tile's rows, per buffer
    return context, weights + 4 * (rows * context["a_stride"] + staged)


def _derive_tiled(params: dict, widths: dict, name: str):
    rows = params["tile_rows"]
    context, smem = _tiled_context(params, widths, rows)

    def grid(B, N, sms, resident, _rows=rows, _per_sm=params["blocks_per_sm"]):
        tiles = ceil_div(B * N * N, _rows)
        return persistent_blocks(tiles, _per_sm, sms, resident), (B, N, tiles)

    return context, (Kernel(name, params["threads"], smem, TILED_ARGS, grid),)


def _derive_symmetric_tiled(params: dict, widths: dict, name: str):
    side = params["tile_side"]
    context, smem = _tiled_context(params, widths, side * side)
    context["tile_side"] = side

    def grid(B, N, sms, resident, _side=side, _per_sm=params["blocks_per_sm"]):
        nb = ceil_div(N, _side)
        tiles = B * nb * (nb + 1) // 2
        return persistent_blocks(tiles, _per_sm, sms, resident), (B, N, tiles)

    return context, (Kernel(name, params["threads"], smem, TILED_ARGS, grid),)


THREAD_PER_PAIR = Strategy(
    name="thread_per_pair",
    summary="one thread per pair, layers computed `chunk` outputs at a time in registers",
    space={"threads": (64, 128, 256), "chunk": (4, 8, 16), "weights_smem": (True, False),
           "symmetric": (True, False)},
    derive=_derive_thread_per_pair,
    restrictions=_COMMON + (
        Restriction("chunk must divide H", lambda p, _: p.widths["H"] % p.params["chunk"] == 0),
    ),
)


def _tile_layout_ok(plan: Plan, limits: DeviceLimits) -> bool:
    c = plan.context
    return c["tm"] >= 1 and c["threads_m"] * c["tm"] == c["tile_rows"] and c["threads_m"] * c["threads_n"] == plan.threads


def _persistent_blocks_fit(plan: Plan, limits: DeviceLimits) -> bool:
    blocks = plan.params["blocks_per_sm"]
    return blocks == 0 or (blocks * plan.smem_bytes <= limits.smem_per_sm
                           and blocks * plan.threads <= limits.max_threads_per_sm)


_TILED_RESTRICTIONS = _COMMON + (
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

_TILED_SPACE = {"threads": (64, 128, 256, 512), "tn": (4, 8), "unroll": (1, 2, 4), "ln_rows": (2, 4, 8),
                "weights_smem": (True, False), "blocks_per_sm": (0, 1, 2, 4),
                "stage_rows": (0, 1, 2), "ln_lanes": (0, 4, 8)}

TILED = Strategy(
    name="tiled",
    summary="a block computes tile_rows consecutive pairs; the MLP as register-tiled matrix products",
    space={"tile_rows": (32, 64, 128), **_TILED_SPACE},
    derive=_derive_tiled,
    restrictions=_TILED_RESTRICTIONS,
)

SYMMETRIC_TILED = Strategy(
    name="symmetric_tiled",
    summary="tiled over blocks (bi <= bj) of the pair grid; each pair computed once, written twice",
    space={"tile_side": (4, 8, 16), **_TILED_SPACE},
    derive=_derive_symmetric_tiled,
    restrictions=_TILED_RESTRICTIONS,
    # Exact fp32 keeps tf32x3's and tf32's promises too: where it is faster (the smallest shapes),
    # they run it. Only this strategy (the fp32 winner at every tuned shape), to keep their searches small.
    precisions=("float32", "tf32x3", "tf32"),
)


# ---- tensor cores (mma) -------------------------------------------------------------------------

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


def _derive_mma(params: dict, widths: dict, name: str):
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


_LN_QUADS_FIT = Restriction(
    "ln_quads splits each row into 16-byte pieces over a quad's 4 lanes: P a multiple of 32 (16-bit) or 16 (fp32)",
    lambda p, _: not p.params["ln_quads"] or (p.widths["P"] * element_bytes(p.precision)) % 64 == 0)

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
    derive=_derive_mma,
    restrictions=(
        Restriction("tiles must split into 16-row fragments per warp, passes must tile H, and P, H be "
                    "multiples of 8", _mma_layout_ok),
        _LN_QUADS_FIT,
        *MMA_TILE_RESTRICTIONS,
    ),
    precisions=tuple(MMA_KINDS),
)


# ---- warpgroup tensor cores (wgmma, sm_90a) -----------------------------------------------------

def _derive_wgmma(params: dict, widths: dict, name: str):
    """One kernel of `groups` warpgroups, persistent; each warpgroup takes the 64-pair tiles
    (tile_side 8) blockIdx.x * groups + group, + gridDim.x * groups, ... Weights as the mma
    strategy packs them (mma_weight_offsets)."""
    P, H, precision = widths["P"], widths["H"], widths["precision"]
    eb = element_bytes(precision)
    groups = params["groups"]
    # Every region 1024-byte aligned (the 128-byte swizzle's atoms): resident W1 and W2; per
    # warpgroup the A tile, layer 1's output (unless z_registers keeps it in registers) and
    # (prefetch) the next tile's raw rows.
    group_bytes = (align(64 * P * eb, 1024) + (0 if params["z_registers"] else align(64 * H * eb, 1024))
                   + (align(2 * 64 * P * eb, 1024) if params["prefetch"] else 0))
    smem = align(H * P * eb, 1024) + align(H * H * eb, 1024) + groups * group_bytes
    context = {"P": P, "H": H, "mma_kind": MMA_KINDS[precision], "off": mma_weight_offsets(P, H, eb),
               "groups": groups, "swizzle": cuda_bool(params["swizzle"]), "prefetch": params["prefetch"],
               "wgmma_widths": [H], "smem": smem, "ln_quads": params["ln_quads"],
               "z_registers": params["z_registers"], "wgmma_rs_widths": [H] if params["z_registers"] else []}

    def grid(B, N, sms, resident, _groups=groups):
        nb = ceil_div(N, 8)
        tiles = B * nb * (nb + 1) // 2
        return max(1, min(ceil_div(tiles, _groups), max(1, resident) * sms)), (B, N, tiles)

    return context, (Kernel(name, 128 * groups, smem, TENSOR_CORE_ARGS, grid),)


def _wgmma_widths_fit(plan: Plan, limits: DeviceLimits) -> bool:
    """K in whole 16-element steps for both layers, and one wgmma (n <= 256) covering H: its H / 2
    accumulators per thread, at most 64 where a block has 2 or more warpgroups (at most 255, 168 and
    128 registers a thread for 2, 3 and 4)."""
    P, H = plan.widths["P"], plan.widths["H"]
    return P % 16 == 0 and H % 16 == 0 and H <= (128 if plan.params["groups"] > 1 else 256)


WGMMA = Strategy(
    name="wgmma",
    summary="Hopper tensor cores: the mma strategy's symmetric tiles as warpgroup products (64 pairs per "
            "warpgroup), weights resident, layer 3 summed in the quads",
    # groups: warpgroups per block (each alone on its tiles, sharing the weights; more of them hide
    # more of each other's phases, in fewer registers: 168 a thread at 3, 128 at 4); swizzle: the
    # 128-byte swizzle where K is a multiple of 64; prefetch: the next tile's raw rows copied
    # during this one's products; ln_quads: as in mma; z_registers: layer 1's output stays in
    # registers as layer 2's A operand (wgmma with A from registers) instead of a shared tile.
    space={"groups": (1, 2, 3, 4), "swizzle": (False, True), "prefetch": (True, False), "ln_quads": (True, False),
           "z_registers": (True, False)},
    derive=_derive_wgmma,
    restrictions=(WGMMA_ON_SM90,
                  Restriction("P and H must be multiples of 16, H at most 256 (128 with two or more warpgroups)",
                              _wgmma_widths_fit),
                  Restriction("the swizzle applies to no operand (neither P nor H a multiple of 64)",
                              lambda p, _: not p.params["swizzle"] or p.widths["P"] % 64 == 0 or p.widths["H"] % 64 == 0),
                  _LN_QUADS_FIT,
                  Restriction("shared memory exceeds the per-block limit", smem_fits)),
    precisions=HALF_PRECISIONS,
)


class ContactSpec(OpSpec):
    # stage_rows and ln_lanes came after the first tuned entries: 0 is the kernel they ran; so does
    # mma's prefetch, False, the tensor-core strategies' ln_quads, False, and wgmma's z_registers, False.
    added_params = {"tiled": {"stage_rows": 0, "ln_lanes": 0}, "symmetric_tiled": {"stage_rows": 0, "ln_lanes": 0},
                    "mma": {"prefetch": False, "ln_quads": False}, "wgmma": {"ln_quads": False, "z_registers": False}}
    name = "contact"
    width_names = ("P", "H")
    strategies = {s.name: s for s in (THREAD_PER_PAIR, TILED, SYMMETRIC_TILED, MMA, WGMMA)}
    # tn=4: with tn=8 the P=128, H=64 build spilled 8 B (NVRTC 13.0, sm_90); every tuned winner so far has tn=4.
    # The first point: the seed's fastest. The second, the earlier default, serves any P % 4 == 0.
    default_points = (
        ("symmetric_tiled", {"tile_side": 4, "threads": 64, "tn": 4, "unroll": 2, "ln_rows": 2,
                             "weights_smem": True, "blocks_per_sm": 0, "stage_rows": 0, "ln_lanes": 4}),
        ("symmetric_tiled", {"tile_side": 8, "threads": 256, "tn": 4, "unroll": 2, "ln_rows": 4,
                             "weights_smem": False, "blocks_per_sm": 2, "stage_rows": 0, "ln_lanes": 0}),
        ("thread_per_pair", {"threads": 128, "chunk": 4, "weights_smem": False, "symmetric": True}),
        # Tensor cores (bf16, fp16, tf32, tf32x3): 64-pair tiles, 8 warps of one 16 x 16 fragment
        # block each (32 columns of H per pass; tf32x3's three products per fragment fit the 128
        # registers two blocks per SM leave, where 2 x 4 fragments spilled), else 4 warps of
        # 16-column passes; one block per SM where fp32 operands (the tf32 kinds) at P = H = 128
        # take 203 KB of shared memory. Each with the next tile's rows prefetched (32 KB more in bf16
        # at P = 128: two blocks per SM fit at H = 64, one at H = 128) and without.
        ("mma", {"tile_side": 8, "warps_m": 4, "warps_n": 2, "wn": 16, "blocks_per_sm": 2, "prefetch": True}),
        ("mma", {"tile_side": 8, "warps_m": 4, "warps_n": 2, "wn": 16, "blocks_per_sm": 2, "prefetch": False}),
        ("mma", {"tile_side": 8, "warps_m": 4, "warps_n": 2, "wn": 16, "blocks_per_sm": 1, "prefetch": True}),
        ("mma", {"tile_side": 8, "warps_m": 4, "warps_n": 1, "wn": 16, "blocks_per_sm": 2, "prefetch": False}),
        ("mma", {"tile_side": 8, "warps_m": 4, "warps_n": 2, "wn": 16, "blocks_per_sm": 1, "prefetch": False}),
        # Hopper (16-bit): two warpgroups sharing the weights, each prefetching its next tile.
        ("wgmma", {"groups": 2, "swizzle": True, "prefetch": True}),
        ("wgmma", {"groups": 1, "swizzle": False, "prefetch": False}),
        # Four warpgroups (512 threads, 128 registers each, no spill at the preset widths), so a
        # tuning run always measures the most warps an SM can hold against the two above.
        ("wgmma", {"groups": 4, "swizzle": True, "prefetch": False, "ln_quads": True}),
        # The same with layer 1's output in registers (no hidden tile: four groups then fit the
        # next tile's rows too at H = 64), and without prefetch (every preset width).
        ("wgmma", {"groups": 4, "swizzle": True, "prefetch": True, "ln_quads": True, "z_registers": True}),
        ("wgmma", {"groups": 4, "swizzle": True, "prefetch": False, "ln_quads": True, "z_registers": True}),
    )
    presets = {
        "seed": ({"B": 4, "N": 64, "P": 64, "H": 32},),
        "real": ({"B": 1, "N": 256, "P": 128, "H": 128}, {"B": 1, "N": 512, "P": 128, "H": 128},
                 {"B": 1, "N": 1024, "P": 128, "H": 64}),
    }
    tolerance = {"float32": Tolerance(max_abs=1e-4, rel_l2=1e-5), "tf32x3": Tolerance(max_abs=1e-4, rel_l2=1e-5),
                 "tf32": Tolerance(max_abs=float("inf"), rel_l2=5e-3),
                 "bfloat16": SIXTEEN_BIT_TOLERANCE, "float16": SIXTEEN_BIT_TOLERANCE}

    def constructor_args(self, widths: dict) -> dict:
        return {"pair_dim": widths["P"], "hidden_dim": widths["H"]}

    def cost(self, shape: dict) -> Cost:
        B, N, P, H = (shape[k] for k in ("B", "N", "P", "H"))
        pairs = B * N * N
        flops = pairs * (2 * (P * H + H * H + H) + 10 * P)
        return Cost(bytes=4.0 * (pairs * P + pairs + P * H + H * H), flops=float(flops))


CONTACT = ContactSpec()
