"""The scene-graph pair readout (OPS.md section 3): reference, spec, drop-in module, launch glue."""
from __future__ import annotations

import torch
from torch import nn

from .base import (Cost, DeviceLimits, KernelModule, OpSpec, PackedParameters, Plan, Restriction, Strategy,
                   Tolerance, align, ceil_div, check_float_tensor, random_tensor, randomize_parameters,
                   section_offsets)


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
# j_split: blocks sharing one tile of rows i, each taking every j_split-th tile of partners j
# (small B*N leaves SMs idle otherwise); 3 and 6 fit j-tile counts such as 24/8 and 48/8. The
# restrictions cannot see N, so points with more splits than j tiles at a length stay in the
# space: the kernel runs them correctly (a split without a j tile only takes part in the
# combine), and the tuner finds them slower.
_SPACE = {"tile_i": (1, 2, 4, 8), "tile_j": (8, 16, 32), "threads": (128, 256), "threads_n": (2, 4, 8, 16),
          "tn": (4, 8), "unroll": (2, 4), "weights_smem": (True, False), "j_split": (1, 2, 3, 4, 6, 8)}

#: Parameters added after entries were tuned (and studies recorded), with the value that gives
#: the kernel those entries ran: plan() fills them in where a point leaves them out.
ADDED_PARAMS = {"j_split": 1}

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
    space=dict(_SPACE),
    restrictions=_RESTRICTIONS,
)

#: Node rows per block of the split strategy's prologue kernel (fixed; see split.cu.j2).
PROLOGUE_ROWS = 8
PROLOGUE_THREADS = 128


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _stride(width: int) -> int:
    """A shared-memory row stride >= width with stride % 32 == 4 (see tile_gemm.cuh)."""
    return align(width, 32) + 4


def prologue_blocks(rows: int, H: int) -> int:
    """Blocks of the split prologue: PROLOGUE_ROWS node rows by 4*PROLOGUE_THREADS of 2H columns."""
    return ceil_div(rows, PROLOGUE_ROWS) * ceil_div(2 * H, 4 * PROLOGUE_THREADS)


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


def min_blocks_per_sm(smem_bytes: int, threads: int, limits: DeviceLimits) -> int:
    """The blocks per SM that shared memory and threads allow, capped so a thread keeps at
    least 128 registers: the kernel's __launch_bounds__ minimum (see _pair_max.cuh.j2).
    Computed for the sm_90 limits, so a rendered source does not depend on the GPU it is for."""
    by_smem = limits.smem_per_sm // (smem_bytes + 1024)  # 1 KB per block reserved by the driver
    by_threads = limits.max_threads_per_sm // threads
    by_registers = 65536 // (threads * 128)
    return max(1, min(by_smem, by_threads, by_registers))


class ReadoutSpec(OpSpec):
    name = "readout"
    width_names = ("D", "P", "H")
    strategies = {s.name: s for s in (SPLIT, DIRECT)}
    default_points = (
        # Real widths (D, H multiples of 64): 64 columns per pass, 4 rows i x 16 partners j.
        ("split", {"tile_i": 4, "tile_j": 16, "threads": 256, "threads_n": 8, "tn": 8, "unroll": 4,
                   "weights_smem": False, "j_split": 1}),
        # Seed widths (D = 96): 32 columns per pass.
        ("split", {"tile_i": 2, "tile_j": 16, "threads": 128, "threads_n": 8, "tn": 4, "unroll": 4,
                   "weights_smem": False, "j_split": 1}),
        # Any D, P, H multiple of 8: 8 columns per pass.
        ("split", {"tile_i": 8, "tile_j": 8, "threads": 128, "threads_n": 2, "tn": 4, "unroll": 2,
                   "weights_smem": False, "j_split": 1}),
    )
    presets = {
        "seed": ({"B": 4, "N": 24, "D": 96, "P": 16, "H": 192},),
        "real": ({"B": 8, "N": 64, "D": 128, "P": 32, "H": 256}, {"B": 16, "N": 128, "D": 256, "P": 64, "H": 512}),
    }
    tolerance = {"float32": Tolerance(max_abs=1e-4, rel_l2=1e-5)}

    def plan(self, strategy: str, params: dict, widths: dict) -> Plan:
        params = {**ADDED_PARAMS, **params}
        self.check_point(strategy, params)
        D, P, H = (int(widths[k]) for k in ("D", "P", "H"))
        off = weight_offsets(D, P, H)
        tile_i, tile_j, threads = params["tile_i"], params["tile_j"], params["threads"]
        threads_n, tn = params["threads_n"], params["tn"]
        threads_m = threads // threads_n
        pairs = tile_i * tile_j
        # The main kernel of the split strategy never reads wuvt: it stages from wpt onwards.
        smem_first = off["wpt"] if strategy == "split" else 0
        context = {
            "D": D, "P": P, "H": H, "off": off, "split": _bool(strategy == "split"),
            "smem_first": smem_first, "weights_smem": _bool(params["weights_smem"]),
            "tile_i": tile_i, "tile_j": tile_j, "tile_pairs": pairs, "threads": threads,
            "threads_n": threads_n, "threads_m": threads_m, "tn": tn, "tm": pairs // threads_m,
            "cols": threads_n * tn, "unroll": params["unroll"], "j_split": params["j_split"],
            "p_stride": _stride(P), "h_stride": _stride(H), "d_stride": _stride(D),
            "prologue_rows": PROLOGUE_ROWS, "prologue_threads": PROLOGUE_THREADS,
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

    Scratch (U/V of the split strategy, the partial maxima of a j split) comes from torch's
    stream-aware caching allocator on every call, so a captured CUDA graph never points at memory
    a later, larger call freed. A j split's per-tile arrival counters are owned by the module and
    left zeroed by every launch: two launches of the SAME module on different streams at once
    would share them (as would a graph replay overlapping a call on another stream).
    """

    op = READOUT
    _RUNTIME_STATE = KernelModule._RUNTIME_STATE + ("_counters",)
    #: Counters allocated at least this many at a time (4 KB), so growth is rare.
    MIN_COUNTERS = 1024

    def __init__(self, node_dim: int, pair_dim: int, hidden_dim: int):
        super().__init__(node_dim, pair_dim, hidden_dim)
        self.widths = {"D": int(node_dim), "P": int(pair_dim), "H": int(hidden_dim)}
        l1, l2, ln = self.fuse[0], self.fuse[2], self.norm
        slots = ((l1, "weight"), (l1, "bias"), (l2, "weight"), (l2, "bias"), (ln, "weight"), (ln, "bias"))
        self._weights = PackedParameters(slots, self._pack)
        self._ln_params = ln._parameters  # the validation's dtype and device, without __getattr__
        self._counters = None  # (device index, the live counters, the buffers they replaced)

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
        # The kernels index pairs with 32-bit ints; B*N*N*P >= 2^31 runs the reference.
        B, N = nodes.shape[0], nodes.shape[1]
        return (super().uses_kernel(nodes, pair_feats, edge_mask)
                and B * N * N * self.widths["P"] < 2**31 and B * N * 2 * self.widths["H"] < 2**31)

    def _tile_counters(self, device: torch.device, count: int) -> int:
        """At least `count` zeroed arrival counters on this device, for the j split's "last block
        done" (each launch leaves them zeroed). Grown when a larger grid needs more; the buffer
        replaced is kept, not freed, since a captured CUDA graph may still point at it."""
        index = device.index or 0
        held = self._counters
        if held is not None and held[0] == index and held[1].numel() >= count:
            return held[1].data_ptr()
        if held is None:
            held = (index, torch.empty(0, device=device, dtype=torch.int32), [])
        live, retired = held[1], held[2]
        fresh = torch.zeros(max(count, self.MIN_COUNTERS, 2 * live.numel()), device=device, dtype=torch.int32)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Under capture the zero fill is recorded, not run: this buffer is zeroed only by the
            # graph's replays, so it is the graph's (kept alive here), never the eager calls'.
            self._counters = (held[0], live, retired + [fresh])
        else:
            self._counters = (index, fresh, retired + [live])
        return fresh.data_ptr()

    def _launch(self, nodes, pair_feats, edge_mask, out=None, variant=None):
        nodes, pair_feats = nodes.contiguous(), pair_feats.contiguous()
        if edge_mask.dtype is not torch.bool:
            edge_mask = edge_mask != 0
        edge_mask = edge_mask.contiguous()
        B, N, D = nodes.shape
        if out is None:
            out = torch.empty((B, N, D), device=nodes.device, dtype=torch.float32)
        if out.numel() == 0:
            return out
        variant = variant or self.variant_for(N, nodes.device)
        device = nodes.get_device()
        weights = self._weights.get().data_ptr()
        params = variant.plan.params
        split, j_split = variant.plan.strategy == "split", params["j_split"]
        # One fresh buffer per call for U (with b1) and V of every node, (B*N, 2H), written by the
        # split prologue, then the j split's partial maxima and flags: the caching allocator makes
        # it cheap and stream-safe. `scratch` is held until both launches are enqueued.
        H = self.widths["H"]
        uv_floats = B * N * 2 * H if split else 0
        words = uv_floats + split_scratch_floats(B, N, D, j_split)
        scratch = torch.empty(words, device=nodes.device, dtype=torch.float32) if words else None
        base = scratch.data_ptr() if scratch is not None else 0
        uv, partials = (base if split else 0), (base + 4 * uv_floats if j_split > 1 else 0)
        counters = self._tile_counters(nodes.device, row_tiles(B, N, params["tile_i"])) if j_split > 1 else 0
        if split:
            prologue = variant.kernel(device, name=f"{variant.compiled.kernel_name}_nodes",
                                      threads=PROLOGUE_THREADS, smem_bytes=0)
            prologue(prologue_blocks(B * N, H), PROLOGUE_THREADS, 0, nodes.data_ptr(), weights, uv, B * N)
        variant.launch(device, B, N, nodes.data_ptr(), pair_feats.data_ptr(), edge_mask.data_ptr(),
                       weights, uv, partials, counters, out.data_ptr())
        return out
