"""The scene-graph pair readout (OPS.md section 3): reference, spec, drop-in module, launch glue.

Three strategies:
  direct  one kernel: per pair, the first Linear over [h_i | h_j | p_ij], the second Linear, and a
          running max over j, per tile of rows i (templates/readout/_pair_max.cuh.j2).
  split   the same kernel after a node prologue (U = nodes W_i^T + b1, V = nodes W_j^T), so a pair
          needs only U_i + V_j + W_p p_ij.
  gemm    large shapes: the node prologue, a kernel writing every pair's hidden layer to scratch,
          cuBLAS for the second Linear (TF32 forced off), a pool kernel (masked max, LayerNorm,
          residual). Scratch B*N*N*(H + D) floats per call: 805 MB at B16 N128 D256 H512.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from .base import (Cost, DeviceLimits, KernelModule, OpSpec, PackedParameters, Plan, Restriction, Strategy,
                   Tolerance, align, ceil_div, check_float_tensor, contiguous_aligned, cuda_bool, fp32_matmul,
                   padded_stride, random_tensor, randomize_parameters, section_offsets)


class PairReadoutReference(nn.Module):
    """OPS.md section 3, verbatim."""

    def __init__(self, node_dim, pair_dim, hidden_dim):
        super().__init__()
        self.fuse = nn.Sequential(
            nn.Linear(2 * node_dim + pair_dim, hidden_dim), nn.SiLU(),
            nn.Linear(hidden_dim, node_dim),
        )
        self.norm = nn.LayerNorm(node_dim)

    def forward(self, nodes, pair_feats, edge_mask):  # (B,N,D), (B,N,N,P), (B,N,N) bool
        B, N, D = nodes.shape
        hi = nodes.unsqueeze(2).expand(B, N, N, D)  # node i
        hj = nodes.unsqueeze(1).expand(B, N, N, D)  # node j
        m = self.fuse(torch.cat([hi, hj, pair_feats], dim=-1))
        m = m.masked_fill(~edge_mask.unsqueeze(-1), float("-inf"))
        pooled = m.amax(dim=2)  # max over j
        isolated = ~edge_mask.any(dim=2)  # a node with no valid edge pools to 0
        pooled = pooled.masked_fill(isolated.unsqueeze(-1), 0.0)
        return nodes + self.norm(pooled)  # (B,N,D)


# ---- the spec ------------------------------------------------------------------------------

def weight_offsets(D: int, P: int, H: int) -> dict[str, int]:
    """Packed-weight layout shared with templates/readout/_common.cuh.j2 (16-byte sections).

    wuvt is [D][2H]: row k holds W_i^T[k] then W_j^T[k] (the first Linear's node columns), so
    the node prologue computes U and V as one product, and the direct strategy reads W_i^T and
    W_j^T as two [D][H] matrices of row stride 2H. The sections the main kernel of the split
    strategy needs (wpt onwards) are contiguous, so only they are staged in shared memory.
    """
    sizes = [("wuvt", D * 2 * H), ("wpt", P * H), ("b1", H), ("w2t", H * D), ("b2", D), ("gamma", D), ("beta", D)]
    return section_offsets(sizes)


def _smem_fits(plan: Plan, limits: DeviceLimits) -> bool:
    return plan.smem_bytes <= limits.max_smem_per_block


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
    Restriction("shared memory exceeds the per-block limit", _smem_fits),
)

# threads_n = 2 with tn = 4 (8 columns per pass) is what makes every D, H multiple of 8 feasible.
# threads_n 24 (96 columns per pass, with threads 192 or 384) fits widths that are multiples of
# 96, such as the seed's D = 96: one pass of the W2 product covers all of D. At the seed shape,
# threads 192 with threads_n 24 and j_split 3 ran the main kernel in 12.2 us against 16.5 for the
# best 128-thread point (CUPTI, warm L2, run 33); threads_n 12 (48 columns) ran 23.3.
# j_split: blocks sharing one tile of rows i, each taking every j_split-th tile of partners j
# (small B*N leaves SMs idle otherwise); 3 and 6 fit j-tile counts such as 24/8 and 48/8.
# tile_j 4 with j_split 6 gives the seed (N = 24) 144 blocks of 16 pairs, each with work. The
# restrictions cannot see N, so points with more splits than j tiles at a length stay in the
# space: the kernel runs them correctly (a split without a j tile only takes part in the
# combine), and the tuner finds them slower.
_SPACE = {"tile_i": (1, 2, 4, 8), "tile_j": (4, 8, 16, 32), "threads": (128, 192, 256, 384), "threads_n": (2, 4, 8, 16, 24),
          "tn": (4, 8), "unroll": (2, 4), "weights_smem": (True, False), "j_split": (1, 2, 3, 4, 6, 8)}

#: Parameters added after entries were tuned (and studies recorded), per strategy, with the value
#: that gives the kernel those entries ran: plan() fills them in where a point leaves them out.
ADDED_PARAMS = {"split": {"j_split": 1, "prologue_rows": 8}, "direct": {"j_split": 1}}

DIRECT = Strategy(
    name="direct",
    summary="per pair, the first Linear over [h_i | h_j | p_ij] as three register-tiled products; one launch",
    space=dict(_SPACE),
    restrictions=_RESTRICTIONS,
)

SPLIT = Strategy(
    name="split",
    summary="U = nodes W_i^T + b1, V = nodes W_j^T once per node (a prologue kernel); per pair only "
            "U_i + V_j + W_p p_ij",
    # prologue_rows: node rows per prologue block (of 128 columns, the k loop split across its 4
    # warps: _nodes.cuh.j2). 2 gives the seed (B*N = 96 rows, 2H = 384) 144 blocks, 8 gives it 36,
    # reading the weights from L2 a quarter as often (what matters at B*N = 2048).
    space={**_SPACE, "prologue_rows": (2, 8)},
    restrictions=_RESTRICTIONS,
)

#: Node rows per block of the gemm strategy's prologue kernel (split tunes it; see _nodes.cuh.j2).
#: The gemm strategy runs large B*N, where the prologue is bound by throughput, not latency: each
#: weight float4 a thread loads serves PROLOGUE_ROWS rows (L2 reads of the weights ~ rows / 8).
#: 16 would double the accumulators (64 registers next to 64 of weights in flight) and need 32 KB
#: of partial sums, over the 48 KB static shared memory with D = 512's 32 KB of node rows.
PROLOGUE_ROWS = 8
#: Threads per prologue block: 4 warps, each a quarter of the k loop (D/4 k-steps) for the same
#: 128 columns, lane l taking a float4 of them. The former 64 threads walking all D k-steps each
#: ran 8.9 us at the seed shape (issued IPC 0.22, stalled on weight loads: _nodes.cuh.j2).
PROLOGUE_THREADS = 128
#: Columns of 2H per prologue block: 32 lanes x a float4.
PROLOGUE_COLS = 128


# ---- the gemm strategy ----------------------------------------------------------------------

def hidden_layout(tile: int, tm: int, tn: int, threads: int) -> dict:
    """Thread layout of the gemm strategy's hidden kernel: threads_m rows of threads (tm pair rows
    each) by threads_n columns (tn hidden columns each, cn per chunk). Zeros where the numbers do
    not divide (a restriction then rejects the plan)."""
    threads_m = tile // tm if tile % tm == 0 else 0
    threads_n = threads // threads_m if threads_m and threads % threads_m == 0 else 0
    return {"threads_m": threads_m, "threads_n": threads_n, "cn": threads_n * tn}


def _hidden_layout_ok(plan: Plan, limits: DeviceLimits) -> bool:
    return plan.context["threads_m"] > 0 and plan.context["threads_n"] > 0


def _hidden_chunks_divide_h(plan: Plan, limits: DeviceLimits) -> bool:
    return plan.context["cn"] > 0 and plan.widths["H"] % plan.context["cn"] == 0


def _gemm_smem_fits(plan: Plan, limits: DeviceLimits) -> bool:
    return max(plan.smem_bytes, plan.context["pool_smem"]) <= limits.max_smem_per_block


GEMM = Strategy(
    name="gemm",
    summary="large shapes: the split prologue (U, V per node); a hidden kernel writes SiLU(U_i + V_j + W_p p_ij) "
            "of every pair to a (B*N*N, H) scratch; cuBLAS fp32 mm (TF32 forced off) gives the (B*N*N, D) "
            "messages; a pool kernel takes the masked max over j, adds b2, LayerNorms and adds the residual. "
            "Scratch per call: B*N*N*(H + D) floats (805 MB at B16 N128 D256 H512)",
    # tile: pairs per block of the hidden kernel; tm x tn its micro-tile (tm = 1 makes 8 columns
    # per chunk with 64-pair tiles: any H multiple of 8 at P up to 512); weights_smem: W_p staged
    # per column chunk (else read through the cache). pool_nodes: nodes per block of the pool
    # kernel; pool_warps: warps per node (its partners split between them), for small B*N.
    space={"tile": (64, 128, 256), "threads": (128, 256), "tm": (1, 2, 4, 8), "tn": (4, 8), "unroll": (2, 4),
           "weights_smem": (False, True), "pool_nodes": (1, 2, 4, 8), "pool_warps": (1, 2, 4)},
    restrictions=(
        Restriction("D, P and H must be multiples of 4 (float4 reads)", _widths_vectorise),
        Restriction("tile, threads and micro-tile must form a thread layout (tile/tm rows of threads "
                    "dividing threads)", _hidden_layout_ok),
        Restriction("threads_n * tn (hidden columns per chunk) must divide H", _hidden_chunks_divide_h),
        Restriction("at most 64 accumulators per thread", lambda p, _: p.params["tm"] * p.params["tn"] <= 64),
        Restriction("shared memory exceeds the per-block limit", _gemm_smem_fits),
        Restriction("the pool kernel's block exceeds 1024 threads", lambda p, _: p.context["pool_threads"] <= 1024),
    ),
)


def gemm_hidden_grid(tile: int):
    """One block per tile of consecutive pairs of the flattened B*N*N; work = the tile count."""

    def grid(B, N, sms, resident, _tile=tile):
        tiles = ceil_div(B * N * N, _tile)
        return max(1, tiles), tiles

    return grid


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


def gemm_scratch_offsets(B: int, N: int, D: int, H: int) -> dict[str, int]:
    """The gemm strategy's one scratch buffer, in floats: hidden (B*N*N, H), messages (B*N*N, D),
    uv (B*N, 2H); "total" its length. B*N*N*(H + D) floats dominate: 805 MB at B16 N128 D256 H512."""
    pairs = B * N * N
    offsets, at = {}, 0
    for name, size in (("hidden", pairs * H), ("messages", pairs * D), ("uv", B * N * 2 * H)):
        offsets[name] = at
        at = align(at + size, GEMM_SCRATCH_ALIGN)
    offsets["total"] = at
    return offsets


def prologue_blocks(rows: int, H: int, prologue_rows: int = PROLOGUE_ROWS) -> int:
    """Blocks of the node prologue: prologue_rows node rows by PROLOGUE_COLS of the 2H columns
    (block b: rows from (b // column blocks) * prologue_rows, columns from (b % column blocks) * 128)."""
    return ceil_div(rows, prologue_rows) * ceil_div(2 * H, PROLOGUE_COLS)


def row_tiles(B: int, N: int, tile_i: int) -> int:
    """Tiles of rows i, each owned by j_split blocks (and one arrival counter)."""
    return B * ceil_div(N, tile_i)


def _grid(tile_i: int, j_split: int):
    """j_split consecutive blocks per tile of rows i; work = the tile count (num_tiles)."""

    def grid(B, N, sms, resident, _ti=tile_i, _js=j_split):
        tiles = row_tiles(B, N, _ti)
        return max(1, tiles * _js), tiles

    return grid


def split_scratch_floats(B: int, N: int, D: int, j_split: int) -> int:
    """Global scratch of the j split, in 4-byte words: the partial maxima (B*N*j_split*D floats),
    then one int flag per (node, split) (see _pool.cuh.j2); 0 without a split."""
    return 0 if j_split == 1 else B * N * j_split * (D + 1)


def scratch_offsets(plan: Plan, B: int, N: int) -> dict[str, int]:
    """The per-call scratch of a plan at (B, N), in 4-byte words from its start; "total" its length
    (0: none). gemm: hidden, messages, uv (gemm_scratch_offsets). split and direct: uv (split only,
    B*N*2H), then the j split's partials and flags."""
    D, H = plan.widths["D"], plan.widths["H"]
    if plan.strategy == "gemm":
        return gemm_scratch_offsets(B, N, D, H)
    uv = B * N * 2 * H if plan.strategy == "split" else 0
    return {"uv": 0, "partials": uv, "total": uv + split_scratch_floats(B, N, D, plan.params["j_split"])}


def min_blocks_per_sm(smem_bytes: int, threads: int, limits: DeviceLimits, registers: int = 128) -> int:
    """The blocks per SM that shared memory and threads allow, capped so a thread keeps at
    least `registers` registers: the kernel's __launch_bounds__ minimum (see _pair_max.cuh.j2).
    Computed for the sm_90 limits, so a rendered source does not depend on the GPU it is for."""
    by_smem = limits.smem_per_sm // (smem_bytes + 1024)  # 1 KB per block reserved by the driver
    by_threads = limits.max_threads_per_sm // threads
    by_registers = 65536 // (threads * registers)
    return max(1, min(by_smem, by_threads, by_registers))


def hidden_registers(tm: int, tn: int) -> int:
    """Registers a thread of the gemm hidden kernel is granted. An 8x8 micro-tile needs ~168
    (64 accumulators, the next k step's A and W_p float4s in flight: ptxas -v, sm_90): capped at
    128 it spilled 24-104 bytes. Up to 32 accumulators fit 128 without spilling."""
    return 128 if tm * tn <= 32 else 168


class _HeldBuffer(NamedTuple):
    """A buffer a module keeps between calls on one device (index -1: the CPU), with the buffers
    it replaced (kept alive for captured graphs), its length and its data pointer."""
    index: int
    live: torch.Tensor
    retired: list
    capacity: int
    ptr: int


@dataclass(frozen=True)
class _PairMaxLaunch:
    """A split or direct variant's launch at one (B, N): scratch size and byte offsets (None: not
    used), the arrival counters it needs, and the split prologue bound to its grid."""
    variant: object
    scratch_floats: int
    uv_at: int | None
    partials_at: int | None
    row_tiles: int
    prologue: object  # launch.BoundLaunch, or None (direct)
    main: object  # launch.BoundLaunch of the main kernel
    shape_args: tuple  # its trailing arguments: B, N, tiles


class ReadoutSpec(OpSpec):
    added_params = ADDED_PARAMS
    name = "readout"
    width_names = ("D", "P", "H")
    strategies = {s.name: s for s in (SPLIT, DIRECT, GEMM)}
    default_points = (
        # Real widths (D, H multiples of 64): 64 columns per pass, 4 rows i x 16 partners j.
        ("split", {"tile_i": 4, "tile_j": 16, "threads": 256, "threads_n": 8, "tn": 8, "unroll": 4,
                   "weights_smem": False, "j_split": 1, "prologue_rows": 8}),
        # Widths with D and H multiples of 96 (the seed's): 96 columns per pass, one W2 pass over
        # D = 96; 12.2 against 16.5 us for the next point at the seed shape (run 33).
        ("split", {"tile_i": 4, "tile_j": 8, "threads": 192, "threads_n": 24, "tn": 4, "unroll": 4,
                   "weights_smem": True, "j_split": 3, "prologue_rows": 2}),
        # Seed widths (D = 96): 32 columns per pass.
        ("split", {"tile_i": 2, "tile_j": 16, "threads": 128, "threads_n": 8, "tn": 4, "unroll": 4,
                   "weights_smem": False, "j_split": 1, "prologue_rows": 2}),
        # Any D, P, H multiple of 8: 8 columns per pass.
        ("split", {"tile_i": 8, "tile_j": 8, "threads": 128, "threads_n": 2, "tn": 4, "unroll": 2,
                   "weights_smem": False, "j_split": 1, "prologue_rows": 8}),
        # gemm, for the tuner's defaults (complete_point) and the widths no split point fits: 8x8
        # micro-tiles, 64 hidden columns per chunk (every preset width; unroll 4 spilled 4 bytes at
        # P = 16, where it unrolls the whole k loop); then 8 columns of 64-pair tiles (any D, P, H
        # multiple of 8 up to 512, e.g. D=504 H=496, whose split tiles outgrow shared memory).
        ("gemm", {"tile": 128, "threads": 128, "tm": 8, "tn": 8, "unroll": 2, "weights_smem": False,
                  "pool_nodes": 4, "pool_warps": 2}),
        ("gemm", {"tile": 64, "threads": 128, "tm": 1, "tn": 4, "unroll": 4, "weights_smem": False,
                  "pool_nodes": 4, "pool_warps": 2}),
    )
    presets = {
        "seed": ({"B": 4, "N": 24, "D": 96, "P": 16, "H": 192},),
        "real": ({"B": 8, "N": 64, "D": 128, "P": 32, "H": 256}, {"B": 16, "N": 128, "D": 256, "P": 64, "H": 512}),
    }
    tolerance = {"float32": Tolerance(max_abs=1e-4, rel_l2=1e-5)}

    def plan(self, strategy: str, params: dict, widths: dict) -> Plan:
        params = self.with_added_params(strategy, params)
        self.check_point(strategy, params)
        D, P, H = (int(widths[k]) for k in ("D", "P", "H"))
        if strategy == "gemm":
            return self._plan_gemm(params, D, P, H)
        return self._plan_pair_max(strategy, params, D, P, H)

    def _plan_gemm(self, params: dict, D: int, P: int, H: int) -> Plan:
        """The hidden kernel is the plan's (threads, shared memory, grid); the pool kernel's block
        shape is in the context."""
        layout = hidden_layout(params["tile"], params["tm"], params["tn"], params["threads"])
        tile, staged = params["tile"], params["weights_smem"]
        pool_threads = 32 * params["pool_nodes"] * params["pool_warps"]
        context = {"D": D, "P": P, "H": H, "off": weight_offsets(D, P, H), "p_stride": padded_stride(P),
                   "tile": tile, "threads": params["threads"], "tm": params["tm"], "tn": params["tn"],
                   "unroll": params["unroll"], "weights_smem": cuda_bool(staged), **layout,
                   "prologue_rows": PROLOGUE_ROWS, "prologue_threads": PROLOGUE_THREADS,
                   "prologue_cols": PROLOGUE_COLS,
                   "pool_nodes": params["pool_nodes"], "pool_warps": params["pool_warps"],
                   "pool_threads": pool_threads,
                   "pool_smem": gemm_pool_smem(D, params["pool_nodes"], params["pool_warps"])}
        floats = (tile * context["p_stride"]                 # the tile's pair rows
                  + (P * layout["cn"] if staged else 0)      # a [P][cn] chunk of W_p
                  + 2 * tile)                                # each pair's uv rows (ints)
        context["min_blocks"] = min_blocks_per_sm(4 * floats, params["threads"], DeviceLimits(),
                                                  hidden_registers(params["tm"], params["tn"]))
        return Plan(self.name, "gemm", dict(params), {"D": D, "P": P, "H": H}, context, params["threads"],
                    4 * floats, gemm_hidden_grid(tile))

    def _plan_pair_max(self, strategy: str, params: dict, D: int, P: int, H: int) -> Plan:
        off = weight_offsets(D, P, H)
        tile_i, tile_j, threads = params["tile_i"], params["tile_j"], params["threads"]
        threads_n, tn = params["threads_n"], params["tn"]
        threads_m = threads // threads_n
        pairs = tile_i * tile_j
        # The main kernel of the split strategy never reads wuvt: it stages from wpt onwards.
        smem_first = off["wpt"] if strategy == "split" else 0
        context = {
            "D": D, "P": P, "H": H, "off": off, "split": cuda_bool(strategy == "split"),
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
        if strategy == "direct":
            floats += (tile_i + tile_j) * context["d_stride"]  # node rows i and j
        if params["weights_smem"]:
            floats += off["total"] - smem_first
        # The j split adds no shared memory: its partials go to global scratch, and the "last
        # block" answer travels by __syncthreads_or.
        context["smem_floats"] = floats
        context["min_blocks"] = min_blocks_per_sm(4 * floats, threads, DeviceLimits())
        return Plan(self.name, strategy, dict(params), {"D": D, "P": P, "H": H}, context, threads, 4 * floats,
                    _grid(tile_i, params["j_split"]))

    def cost(self, shape: dict) -> Cost:
        """Bytes and FLOPs of the reference formula (the direct form)."""
        B, N, D, P, H = (shape[k] for k in ("B", "N", "D", "P", "H"))
        pairs = B * N * N
        flops = pairs * (2 * ((2 * D + P) * H + H * D) + 4 * H + 2 * D) + B * N * 10 * D
        weights = (2 * D + P) * H + H + H * D + 3 * D
        return Cost(bytes=4.0 * (pairs * P + 2 * B * N * D + weights) + pairs, flops=float(flops))

    def make_module(self, widths: dict, generator: torch.Generator) -> "PairReadout":
        module = PairReadout(widths["D"], widths["P"], widths["H"])
        randomize_parameters(module, generator)
        with torch.no_grad():  # LayerNorm affine away from (1, 0): randomize_parameters keys on layer_norm
            module.norm.weight.add_(1.0)
        return module

    def make_reference(self, module: "PairReadout") -> PairReadoutReference:
        """A plain reference module holding the same weights (the peers run this)."""
        w = module.widths
        ref = PairReadoutReference(w["D"], w["P"], w["H"])
        ref.load_state_dict(module.state_dict())
        return ref.to(next(module.parameters()).device)

    def make_inputs(self, shape: dict, generator: torch.Generator, distribution: str = "normal") -> tuple:
        B, N, D, P = (shape[k] for k in ("B", "N", "D", "P"))
        nodes = random_tensor((B, N, D), generator, distribution)
        pair_feats = random_tensor((B, N, N, P), generator, distribution)
        return nodes, pair_feats, random_edge_mask(B, N, generator)


def random_edge_mask(B: int, N: int, generator: torch.Generator, density: float = 0.5) -> torch.Tensor:
    """A bool (B, N, N) mask with, in every batch, a fully masked row (an isolated node) and,
    for N > 1, a row with exactly one valid edge; a fully masked column too when N > 2."""
    mask = torch.rand((B, N, N), generator=generator) < density
    mask[:, 0, :] = False  # node 0 is isolated
    if N > 1:
        mask[:, 1, :] = False
        mask[:, 1, N - 1] = True  # node 1 has a single valid edge, to the last node
    if N > 2:
        mask[:, :, N // 2] = False  # no node receives from node N//2
    return mask


READOUT = ReadoutSpec()


# ---- the drop-in module -------------------------------------------------------------------

class PairReadout(KernelModule, PairReadoutReference):
    """Drop-in for PairReadoutReference: same constructor, submodules and state_dict.

    CUDA float32 inputs run the tuned kernel; CPU inputs or other dtypes run the reference.
    `edge_mask` may be bool or floating-point: a float mask is read as `edge_mask != 0`, so 0/1
    masks behave as the reference's bool ones (and a NaN entry counts as an edge).

    Scratch of the split and direct strategies (U/V of every node, a j split's partial maxima)
    and a j split's per-tile arrival counters are held by the module, grown when a larger call
    needs more and never freed while the module lives (a captured CUDA graph may point at them;
    a capture that needs more gets buffers of its own). The gemm strategy's scratch (hidden layers
    and messages, B*N*N*(H + D) floats: 805 MB at B16 N128 D256 H512) comes from torch's
    stream-aware caching allocator on every call instead. The gemm strategy's matmul runs in
    fp32 even where the caller allowed TF32 (fp32_matmul). Two launches of the SAME module on
    different streams at once would share the held buffers (as would a graph replay overlapping
    a call on another stream): use one module per concurrent stream.
    """

    op = READOUT
    _RUNTIME_STATE = KernelModule._RUNTIME_STATE + ("_counters", "_scratch", "_pair_max_configs")
    #: Counters allocated at least this many at a time (4 KB), so growth is rare.
    MIN_COUNTERS = 1024
    #: split: launch the main kernel as a programmatic dependent of the node prologue (sm_90+),
    #: so that its blocks stage their weights while the prologue runs (_pair_max.cuh.j2). False
    #: launches it after the prologue has finished (the tests compare the two). Read when a
    #: (B, N) is first launched: set it on a fresh module, or before its first call.
    programmatic_main = True

    def __init__(self, node_dim: int, pair_dim: int, hidden_dim: int):
        super().__init__(node_dim, pair_dim, hidden_dim)
        self.widths = {"D": int(node_dim), "P": int(pair_dim), "H": int(hidden_dim)}
        l1, l2, ln = self.fuse[0], self.fuse[2], self.norm
        slots = ((l1, "weight"), (l1, "bias"), (l2, "weight"), (l2, "bias"), (ln, "weight"), (ln, "bias"))
        self._weights = PackedParameters(slots, self._pack)
        self._ln_params = ln._parameters  # the validation's dtype and device, without __getattr__
        self._w2t_at = weight_offsets(node_dim, pair_dim, hidden_dim)["w2t"]  # gemm: W2^T's place in the pack
        self._counters = None  # (device index, the live counters, the buffers they replaced)
        self._scratch = None  # the same for the split and direct strategies' scratch
        self._pair_max_configs = None  # (variant id, device, B, N) -> _PairMaxLaunch

    def reference_forward(self, nodes, pair_feats, edge_mask):
        return PairReadoutReference.forward(self, nodes, pair_feats, edge_mask)

    def forward(self, nodes, pair_feats, edge_mask):
        self._validate(nodes, pair_feats, edge_mask)
        if edge_mask.dtype is not torch.bool:
            edge_mask = edge_mask != 0  # the reference's ~edge_mask needs bool; the kernels read bytes
        return self._dispatch(nodes, pair_feats, edge_mask)

    def _validate(self, nodes, pair_feats, edge_mask) -> None:
        D, P = self.widths["D"], self.widths["P"]
        weight = self._ln_params["weight"]
        check_float_tensor("nodes", nodes, 3, weight)
        check_float_tensor("pair_feats", pair_feats, 4, weight)
        B, N = nodes.shape[0], nodes.shape[1]
        # Plain ifs, not expect(): its message would be formatted on every call.
        if nodes.shape[2] != D:
            raise ValueError(f"nodes must have shape (B, N, {D}), got {tuple(nodes.shape)}")
        if pair_feats.shape != (B, N, N, P):
            raise ValueError(f"pair_feats must have shape (B, N, N, {P}) = {(B, N, N, P)} for nodes of shape "
                             f"{tuple(nodes.shape)}, got {tuple(pair_feats.shape)}")
        if not isinstance(edge_mask, torch.Tensor):
            raise ValueError(f"edge_mask must be a torch.Tensor, got {type(edge_mask).__name__}")
        if edge_mask.dtype is not torch.bool and not edge_mask.dtype.is_floating_point:
            raise ValueError(f"edge_mask must be bool or floating-point 0/1, got dtype {edge_mask.dtype}")
        if edge_mask.shape != (B, N, N):
            raise ValueError(f"edge_mask must have shape (B, N, N) = {(B, N, N)}, got {tuple(edge_mask.shape)}")
        if edge_mask.device != nodes.device:
            raise ValueError(f"nodes, pair_feats and edge_mask must be on one device, got {nodes.device}, "
                             f"{pair_feats.device}, {edge_mask.device}")

    def _pack(self, params: list) -> torch.Tensor:
        """[W_i^T | W_j^T] | W_p^T | b1 | W2^T | b2 | gamma | beta, at the offsets of weight_offsets()."""
        w1, b1, w2, b2, gamma, beta = (p.float() for p in params)
        D, P, H = self.widths["D"], self.widths["P"], self.widths["H"]
        off = weight_offsets(D, P, H)
        wuvt = torch.cat([w1[:, :D].t(), w1[:, D:2 * D].t()], dim=1)  # [D][2H]
        packed = torch.zeros(off["total"], device=w1.device, dtype=torch.float32)
        for name, value in (("wuvt", wuvt), ("wpt", w1[:, 2 * D:].t()), ("b1", b1), ("w2t", w2.t()), ("b2", b2),
                            ("gamma", gamma), ("beta", beta)):
            packed[off[name]: off[name] + value.numel()] = value.reshape(-1)
        return packed

    def packed_weights(self) -> torch.Tensor:
        """The weights in the kernels' layout (rebuilt only after a parameter changed)."""
        return self._weights.get()

    def uses_kernel(self, nodes, pair_feats, edge_mask) -> bool:
        # CUDA float32 (validated: one device, one dtype). The kernels index pairs with 32-bit
        # ints; B*N*N*P >= 2^31 runs the reference.
        if not (nodes.is_cuda and nodes.dtype is torch.float32):
            return False
        B, N = nodes.shape[0], nodes.shape[1]
        return B * N * N * self.widths["P"] < 2**31 and B * N * 2 * self.widths["H"] < 2**31

    def _tile_counters(self, index: int, count: int) -> int:
        """At least `count` zeroed arrival counters on device `index`, for the j split's "last
        block done" (each launch leaves them zeroed)."""
        held = self._counters
        if held is not None and held.index == index and count <= held.capacity:
            return held.ptr
        return self._grow("_counters", index, max(count, self.MIN_COUNTERS), torch.int32, zeroed=True)

    def _split_scratch(self, index: int, floats: int) -> int:
        """At least `floats` of scratch on device `index` for a split or direct launch (U/V, the
        j split's partial maxima): held by the module, not allocated per call, since at the seed
        shape the host path is most of a call and a torch.empty was 5.3 of its 34 us (run 33)."""
        held = self._scratch
        if held is not None and held.index == index and floats <= held.capacity:
            return held.ptr
        return self._grow("_scratch", index, floats, torch.float32, zeroed=False)

    def _grow(self, slot: str, index: int, count: int, dtype: torch.dtype, zeroed: bool) -> int:
        """A buffer of at least `count` elements for attribute `slot` (a _HeldBuffer) on device
        `index` (-1: the CPU), at least twice the one it replaces. A buffer replaced is kept, not
        freed, since a captured CUDA graph may still point at it."""
        device = torch.device("cpu") if index < 0 else torch.device("cuda", index)
        held = getattr(self, slot)
        if held is None or held.index != index:  # none yet, or the module moved to another device
            live, retired = None, [] if held is None else held.retired + [held.live]
        else:
            live, retired = held.live, held.retired
        fresh = (torch.zeros if zeroed else torch.empty)(max(count, 2 * (0 if live is None else live.numel())),
                                                         device=device, dtype=dtype)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Under capture a zero fill is recorded, not run: this buffer is zeroed only by the
            # graph's replays, so it is the graph's (kept alive here), never the eager calls'.
            if live is None:
                live = torch.empty(0, device=device, dtype=dtype)
            setattr(self, slot, _HeldBuffer(index, live, retired + [fresh], live.numel(), live.data_ptr()))
        else:
            setattr(self, slot, _HeldBuffer(index, fresh, retired + ([] if live is None else [live]), fresh.numel(),
                                            fresh.data_ptr()))
        return fresh.data_ptr()

    def _launch(self, nodes, pair_feats, edge_mask, out=None, variant=None):
        # Rows on 16-byte boundaries: the kernels read them with float4 loads and cp.async.
        nodes, pair_feats = contiguous_aligned(nodes), contiguous_aligned(pair_feats)
        if edge_mask.dtype is not torch.bool:
            edge_mask = edge_mask != 0
        edge_mask = edge_mask.contiguous()
        B, N, D = nodes.shape
        if out is None:
            out = torch.empty((B, N, D), device=nodes.device, dtype=torch.float32)
        if out.numel() == 0:
            return out
        variant = variant or self.variant_for(N, nodes.device)
        if variant.plan.strategy == "gemm":
            self._launch_gemm(variant, nodes, pair_feats, edge_mask, out)
        else:
            self._launch_pair_max(variant, B, N, nodes, pair_feats, edge_mask, out)
        return out

    @staticmethod
    def _prologue_kernel(variant, device: int):
        """The node prologue (U with b1, and V, of every node: the split and gemm strategies' first launch)."""
        return variant.kernel(device, name=f"{variant.compiled.kernel_name}_nodes", threads=PROLOGUE_THREADS,
                              smem_bytes=0)

    def _prologue(self, variant, device: int, nodes, weights: int, uv: int, rows: int) -> None:
        """U (with b1) and V of every node into uv, (rows, 2H)."""
        blocks = prologue_blocks(rows, self.widths["H"], variant.plan.context["prologue_rows"])
        self._prologue_kernel(variant, device)(blocks, PROLOGUE_THREADS, 0, nodes.data_ptr(), weights, uv, rows)

    def _pair_max_launch(self, variant, device: int, B: int, N: int) -> "_PairMaxLaunch":
        """What a split or direct call at (B, N) needs besides its tensors, worked out once: at the
        seed shape the host path is most of a call (61 us per call against 32 us of GPU work in
        run 26)."""
        key = (id(variant), device, B, N)
        configs = self._pair_max_configs
        if configs is None:
            configs = self._pair_max_configs = {}
        config = configs.get(key)
        if config is None or config.variant is not variant:
            from .. import runtime

            params, split = variant.plan.params, variant.plan.strategy == "split"
            at = scratch_offsets(variant.plan, B, N)
            prologue = None
            if split:
                blocks = prologue_blocks(B * N, self.widths["H"], variant.plan.context["prologue_rows"])
                prologue = self._prologue_kernel(variant, device).bind(blocks, PROLOGUE_THREADS, 0, 4)
            kernel = variant.kernel(device)
            blocks, tiles = variant.plan.grid(B, N, runtime.device_info(device).limits.sm_count, kernel.resident_per_sm)
            programmatic = split and self.programmatic_main and torch.cuda.get_device_capability(device)[0] >= 9
            config = configs[key] = _PairMaxLaunch(
                variant=variant, scratch_floats=at["total"], uv_at=4 * at["uv"] if split else None,
                partials_at=4 * at["partials"] if params["j_split"] > 1 else None,
                row_tiles=row_tiles(B, N, params["tile_i"]), prologue=prologue,
                main=kernel.bind(blocks, variant.plan.threads, variant.plan.smem_bytes, 11, programmatic),
                shape_args=(B, N, tiles))
        return config

    def _launch_pair_max(self, variant, B: int, N: int, nodes, pair_feats, edge_mask, out) -> None:
        device, weights = nodes.get_device(), self._weights.get().data_ptr()
        launch = self._pair_max_launch(variant, device, B, N)
        # Scratch for U (with b1) and V of every node, (B*N, 2H), written by the split prologue,
        # then the j split's partial maxima and flags.
        base = self._split_scratch(device, launch.scratch_floats) if launch.scratch_floats else 0
        uv = base + launch.uv_at if launch.uv_at is not None else 0
        partials = base + launch.partials_at if launch.partials_at is not None else 0
        counters = self._tile_counters(device, launch.row_tiles) if launch.partials_at is not None else 0
        if launch.prologue is not None:
            launch.prologue(nodes.data_ptr(), weights, uv, B * N)
        launch.main(nodes.data_ptr(), pair_feats.data_ptr(), edge_mask.data_ptr(), weights, uv, partials, counters,
                    out.data_ptr(), *launch.shape_args)

    def _launch_gemm(self, variant, nodes, pair_feats, edge_mask, out) -> None:
        """Prologue -> hidden kernel -> fp32 mm -> pool kernel, all on the current stream, on one
        scratch buffer (hidden, messages, uv) from the caching allocator, held until all are enqueued."""
        from .. import runtime

        B, N, D = nodes.shape
        H, plan, context = self.widths["H"], variant.plan, variant.plan.context
        device, pairs = nodes.get_device(), B * N * N
        packed = self._weights.get()
        weights = packed.data_ptr()
        at = gemm_scratch_offsets(B, N, D, H)
        scratch = torch.empty(at["total"], device=nodes.device, dtype=torch.float32)
        hidden = scratch[at["hidden"]: at["hidden"] + pairs * H].view(pairs, H)
        messages = scratch[at["messages"]: at["messages"] + pairs * D].view(pairs, D)
        uv = scratch.data_ptr() + 4 * at["uv"]
        name = variant.compiled.kernel_name
        self._prologue(variant, device, nodes, weights, uv, B * N)
        hidden_kernel = variant.kernel(device, name=f"{name}_hidden")
        blocks, tiles = plan.grid(B, N, runtime.device_info(device).limits.sm_count, hidden_kernel.resident_per_sm)
        hidden_kernel(blocks, plan.threads, plan.smem_bytes, pair_feats.data_ptr(), uv, weights, hidden.data_ptr(),
                      B, N, tiles)
        # messages = hidden W2^T without b2: the pool kernel adds it after the max (gemm.cu.j2 says why).
        w2t = packed[self._w2t_at: self._w2t_at + H * D].view(H, D)
        with fp32_matmul():
            torch.mm(hidden, w2t, out=messages)
        pool_threads, pool_smem = context["pool_threads"], context["pool_smem"]
        pool = variant.kernel(device, name=f"{name}_pool", threads=pool_threads, smem_bytes=pool_smem)
        pool(gemm_pool_blocks(B * N, context["pool_nodes"]), pool_threads, pool_smem, messages.data_ptr(),
             edge_mask.data_ptr(), nodes.data_ptr(), weights, out.data_ptr(), B, N)
