"""The pair readout's spec: its widths, presets, tolerances, default points and cost model, over
the strategies of pairgen/ops/readout/strategies/ (one file each)."""
from __future__ import annotations

from ...spec import SIXTEEN_BIT_TOLERANCE, Cost, OpSpec, Tolerance
from .strategies import DIRECT, FUSED, GEMM, MMA, SPLIT, WGMMA


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
