"""The triangle update's spec: its widths, presets, tolerances, default points and cost model,
over the strategies of pairgen/ops/trimul/strategies/ (one file each)."""
from __future__ import annotations

from ...spec import SIXTEEN_BIT_TOLERANCE, Cost, OpSpec, Tolerance
from .common import O_TN
from .strategies import BMM, FUSED, MMA, WGMMA


def options_of(widths: dict) -> dict:
    """Constructor options from the 0/1 entries of a widths dict (absent: the defaults)."""
    return {"direction": "outgoing" if widths.get("outgoing", 0) else "incoming",
            "gate_on": "normalized" if widths.get("gate_normalized", 0) else "input",
            "bias": bool(widths.get("bias", 1)), "gate_at": "hidden" if widths.get("gate_hidden", 0) else "output"}


class TrimulSpec(OpSpec):
    # Parameters added to a strategy after tuned entries existed, with the value that reproduces what
    # those entries ran, so that an entry without them still plans.
    added_params = {"fused": {"tri_smem": False}, "bmm": {"o_weights_smem": False, "o_tn": O_TN},
                    "wgmma": {"consts_smem": False, "paired_columns": False,
                              "early_x_fetch": False, "x_registers": False, "z_registers": False,
                              "p_slices": 0, "o_slices": 0, "w_registers": False,
                              "o_x_registers": False, "p_mask_early": False,
                              "p_normalized_x": False, "o_normalized": False,
                              "o_staged_stores": False, "o_unrolled_fetch": False}}
    name = "trimul"
    # The options are compile-time and part of the tuned key, as 0/1 next to the widths.
    width_names = ("P", "H", "outgoing", "gate_normalized", "bias")
    # The out gate in hidden width (lucidrains' placement): named in a key only where it is 1.
    # out_fp32: the output written in fp32 by 16-bit kernels (the wgmma strategy's), for a caller
    # that wants an fp32 output; x_fp32: x read in fp32 by the 16-bit projection (a call under
    # autocast); neither is ever in a tuned key: a call derives them from its tuned plan.
    optional_widths = {"gate_hidden": 0, "out_fp32": 0, "x_fp32": 0}
    strategies = {s.name: s for s in (BMM, FUSED, MMA, WGMMA)}
    default_points = (
        # P a multiple of 64, H of 32 (the real models): 128-column chunks of 4H, 8x8 micro-tiles.
        ("bmm", {"p_tile": 128, "p_tm": 8, "p_tn": 8, "p_weights_smem": False, "o_tile": 64, "o_tm": 4, "o_tn": 4,
                 "o_weights_smem": False, "threads": 256, "unroll": 4, "min_blocks": 1}),
        # Any P, H multiples of 8 up to 256: 32-column chunks of 4H, 8-column chunks of P (64-row
        # output tiles keep P = H = 248 within shared memory).
        ("bmm", {"p_tile": 64, "p_tm": 4, "p_tn": 4, "p_weights_smem": False, "o_tile": 64, "o_tm": 1, "o_tn": 4,
                 "o_weights_smem": False, "threads": 128, "unroll": 4, "min_blocks": 1}),
        # Hopper tensor cores (16-bit, sm_90): 4 warpgroups per SM with one x tile each, each warp's
        # rows of it held in registers as the products' A operand (the next tile fetched as soon as
        # they are) and normalised there, the output kernel's triangle sums and x likewise, swizzled
        # operands, the epilogues' constants in shared memory and their columns paired, each tile's
        # mask loaded a tile ahead, the output's 16-bit rows written through a per-warp staging in
        # whole sectors, its tile copies unrolled (the fastest measured at P = H = 128).
        # The second is the same with the sums in shared memory (the gate in hidden width rewrites
        # them there). The others are unswizzled, as they must be where neither P nor H is a
        # multiple of 64, and read their constants from global memory (less shared memory); the last
        # has passes small enough for any P a multiple of 16 and H of 8.
        ("wgmma", {"p_groups": 4, "p_stages": 1, "p_wn": 32, "o_groups": 3, "o_wn": 64, "o_stages": 1, "swizzle": True,
                   "consts_smem": True, "paired_columns": True, "x_registers": True, "z_registers": True,
                   "p_mask_early": True, "o_x_registers": True, "p_normalized_x": True, "o_normalized": True,
                   "o_staged_stores": True, "o_unrolled_fetch": True}),
        ("wgmma", {"p_groups": 4, "p_stages": 1, "p_wn": 32, "o_groups": 3, "o_wn": 64, "o_stages": 1, "swizzle": True,
                   "consts_smem": True, "paired_columns": True, "x_registers": True, "o_unrolled_fetch": True}),
        # Wide widths (P or H above 128): each block keeps a slice of the weights' columns resident
        # (the fewest slices that fit) and the sums go to registers. The first: wide passes (fewer,
        # larger products a tile), 2 projection warpgroups fetching the next x tile under the last
        # pass, one output warpgroup staging its 16-bit rows and copying its tiles unrolled (the
        # fastest measured at the wide classes it fits); the second the same with 64-column output
        # passes (where 128 do not fit in shared memory); the third narrower passes on 2 warpgroups
        # in each kernel.
        ("wgmma", {"p_groups": 2, "p_stages": 1, "p_wn": 128, "o_groups": 1, "o_wn": 128, "o_stages": 1, "swizzle": True,
                   "consts_smem": True, "paired_columns": True, "z_registers": True, "early_x_fetch": True,
                   "o_staged_stores": True, "o_unrolled_fetch": True}),
        ("wgmma", {"p_groups": 2, "p_stages": 1, "p_wn": 128, "o_groups": 1, "o_wn": 64, "o_stages": 1, "swizzle": True,
                   "consts_smem": True, "paired_columns": True, "z_registers": True, "early_x_fetch": True,
                   "o_staged_stores": True, "o_unrolled_fetch": True}),
        ("wgmma", {"p_groups": 2, "p_stages": 1, "p_wn": 64, "o_groups": 2, "o_wn": 32, "o_stages": 1, "swizzle": True,
                   "consts_smem": True, "paired_columns": True, "z_registers": True}),
        ("wgmma", {"p_groups": 3, "p_stages": 1, "p_wn": 64, "o_groups": 2, "o_wn": 64, "o_stages": 2, "swizzle": False,
                   "consts_smem": False}),
        ("wgmma", {"p_groups": 2, "p_stages": 1, "p_wn": 32, "o_groups": 2, "o_wn": 16, "o_stages": 1, "swizzle": False,
                   "consts_smem": False}),
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
        # Wide pair and hidden widths together, in that form: width classes beyond P = H = 128 that
        # NVIDIA cuEquivariance 0.14 ships prebuilt bf16 kernels for (P / H = 256 / 256, 384 / 256,
        # 384 / 384), outgoing, N512. (Its 512 / 512 is left out: there the mma defaults' output
        # kernel holds a tile of triangle sums per thread in flight and spills; a --shape runs it.)
        "classes": tuple({"B": 1, "N": 512, "P": p, "H": h, "outgoing": 1, "gate_normalized": 1, "bias": 0}
                         for p, h in ((256, 256), (384, 256), (384, 384))),
        # GPU MODE's TriMul benchmark (fp32 in and out: bench --autocast): its seven shapes, outgoing,
        # in the models' form, hidden 128.
        "gpumode": tuple({"B": b, "N": n, "P": p, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 0}
                         for b, n, p in ((2, 256, 128), (1, 768, 128), (2, 256, 384), (1, 512, 128), (1, 1024, 128),
                                         (1, 768, 384), (1, 1024, 384))),
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
