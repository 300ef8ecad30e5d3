"""The contact head's spec: its widths, presets, tolerances, default points and cost model, over
the strategies of pairgen/ops/contact/strategies/ (one file each)."""
from __future__ import annotations

from ...spec import SIXTEEN_BIT_TOLERANCE, Cost, OpSpec, Tolerance
from .strategies import MMA, SYMMETRIC_TILED, THREAD_PER_PAIR, TILED, WGMMA


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
