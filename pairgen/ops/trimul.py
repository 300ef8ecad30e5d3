"""The triangle multiplicative update (OPS.md section 1): reference with its options, spec,
drop-in module, launch glue.

Two strategies:
  bmm    a projection kernel writes a, b in (B*H, N, N) layout, cuBLAS bmm forms the triangle sums
         (the transposes that the direction needs are cuBLAS flags, no copies), an output kernel
         reads the bmm result in place. Right for every N; the GEMMs dominate at N >= 256.
  fused  one cooperative kernel: projection, grid-wide barrier, triangle sums + output. For small N,
         where three launches and a cuBLAS call cost more than the work. Its triangle sums read a
         and b from global memory per (pair, channel) (tri_smem=False), or stage them in shared
         memory per row tile (tri_smem=True); both in templates/trimul/_triangle.cuh.j2.
"""
from __future__ import annotations

import torch
from torch import nn

from .base import (Cost, DeviceLimits, KernelModule, OpSpec, PackedParameters, Plan, Restriction, Strategy,
                   Tolerance, align, ceil_div, check_float_tensor, contiguous_aligned, cuda_bool, fp32_matmul,
                   padded_stride, random_tensor, randomize_parameters, section_offsets)

DIRECTIONS = ("incoming", "outgoing")
GATE_INPUTS = ("input", "normalized")


class TriangleMultiplicationReference(nn.Module):
    """OPS.md section 1, with its three options; the defaults are the listing verbatim."""

    def __init__(self, pair_dim, hidden_dim, direction="incoming", gate_on="input", bias=True):
        super().__init__()
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if gate_on not in GATE_INPUTS:
            raise ValueError(f"gate_on must be one of {GATE_INPUTS}, got {gate_on!r}")
        if not isinstance(bias, bool):
            raise ValueError(f"bias must be True or False, got {bias!r}")
        self.direction, self.gate_on = direction, gate_on
        self.layer_norm_in = nn.LayerNorm(pair_dim)
        self.proj_a = nn.Linear(pair_dim, hidden_dim, bias=bias)
        self.gate_a = nn.Linear(pair_dim, hidden_dim, bias=bias)
        self.proj_b = nn.Linear(pair_dim, hidden_dim, bias=bias)
        self.gate_b = nn.Linear(pair_dim, hidden_dim, bias=bias)
        self.layer_norm_out = nn.LayerNorm(hidden_dim)
        self.out_proj = nn.Linear(hidden_dim, pair_dim, bias=bias)
        self.out_gate = nn.Linear(pair_dim, pair_dim, bias=bias)

    def forward(self, pair_repr, pair_mask):  # (B,N,N,P), (B,N,N) float 0/1 or bool
        x = self.layer_norm_in(pair_repr)
        mask = pair_mask.unsqueeze(-1).to(x.dtype)
        a = self.proj_a(x) * torch.sigmoid(self.gate_a(x)) * mask
        b = self.proj_b(x) * torch.sigmoid(self.gate_b(x)) * mask
        if self.direction == "incoming":
            out = torch.einsum("bkih,bkjh->bijh", a, b)  # sum over the FIRST index
        else:
            out = torch.einsum("bikh,bjkh->bijh", a, b)
        out = self.out_proj(self.layer_norm_out(out))
        gate_input = x if self.gate_on == "normalized" else pair_repr  # default: the RAW input
        return out * torch.sigmoid(self.out_gate(gate_input))


def triangle_bmm(ar: torch.Tensor, br: torch.Tensor, outgoing: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """The triangle sums on the (B*H, N, N) layout ar[(b*H + h), r, c] = a[b, r, c, h]:
    incoming out[i, j] = sum_k a[k, i] b[k, j] = (arᵀ·br)[i, j]; outgoing sum_k a[i, k] b[j, k] =
    (ar·brᵀ)[i, j]. The transposed views reach cuBLAS as flags, not copies."""
    if outgoing:
        return torch.bmm(ar, br.transpose(1, 2), out=out)
    return torch.bmm(ar.transpose(1, 2), br, out=out)


# ---- the packed weights (shared with templates/trimul/_widths.cuh.j2) -----------------------------

def weight_offsets(P: int, H: int, bias: bool) -> dict[str, int]:
    """Float offsets of each section, 16-byte aligned; bias sections are empty without bias."""
    nb = 1 if bias else 0
    sizes = [("ln_in_g", P), ("ln_in_b", P), ("wp", P * 4 * H), ("bp", nb * 4 * H), ("ln_out_g", H), ("ln_out_b", H),
             ("wo", H * P), ("bo", nb * P), ("wg", P * P), ("bg", nb * P)]
    return section_offsets(sizes)


def pack_weights(params: dict[str, torch.Tensor], P: int, H: int, bias: bool) -> torch.Tensor:
    """The module's parameters (state_dict names) in the kernels' layout: linear weights k-major
    (transposed), the four projections interleaved per channel: column 4h + {0,1,2,3} of Wp is
    proj_a, gate_a, proj_b, gate_b of channel h, so one thread's float4 holds all four."""
    off = weight_offsets(P, H, bias)
    f = {name: p.detach().to(torch.float32) for name, p in params.items()}
    four = ("proj_a", "gate_a", "proj_b", "gate_b")
    sections = {
        "ln_in_g": f["layer_norm_in.weight"], "ln_in_b": f["layer_norm_in.bias"],
        "wp": torch.stack([f[f"{n}.weight"].t() for n in four], dim=-1),  # (P, H, 4)
        "ln_out_g": f["layer_norm_out.weight"], "ln_out_b": f["layer_norm_out.bias"],
        "wo": f["out_proj.weight"].t(), "wg": f["out_gate.weight"].t(),
    }
    if bias:
        sections.update(bp=torch.stack([f[f"{n}.bias"] for n in four], dim=-1), bo=f["out_proj.bias"],
                        bg=f["out_gate.bias"])
    device = next(iter(f.values())).device
    packed = torch.zeros(off["total"], device=device, dtype=torch.float32)
    for name, value in sections.items():
        packed[off[name]: off[name] + value.numel()] = value.reshape(-1)
    return packed


# ---- the spec ------------------------------------------------------------------------------

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


def _layouts_ok(plan: Plan, limits: DeviceLimits) -> bool:
    c = plan.context
    return all(c[f"{k}_threads_m"] and c[f"{k}_threads_n"] and c[f"{k}_lanes_m"] for k in ("p", "o"))


def _columns_divide(plan: Plan, limits: DeviceLimits) -> bool:
    c = plan.context
    return c["p_cn"] > 0 and (4 * c["H"]) % c["p_cn"] == 0 and c["o_cn"] > 0 and c["P"] % c["o_cn"] == 0


def _accumulators_fit(plan: Plan, limits: DeviceLimits) -> bool:
    c = plan.context
    return c["p_tm"] * c["p_tn"] <= 64 and 2 * c["o_tm"] * c["o_tn"] <= 64


def _smem_fits(plan: Plan, limits: DeviceLimits) -> bool:
    return max(plan.smem_bytes, plan.context["output_smem"]) <= limits.max_smem_per_block


def _persistent_blocks_fit(plan: Plan, limits: DeviceLimits) -> bool:
    blocks = plan.params["blocks_per_sm"]
    return blocks * plan.smem_bytes <= limits.smem_per_sm and blocks * plan.threads <= limits.max_threads_per_sm


_COMMON = (
    Restriction("tiles, threads and micro-tiles must form a thread layout (tile_map.cuh)", _layouts_ok),
    Restriction("column chunks must divide 4H (projection) and P (output)", _columns_divide),
    Restriction("at most 64 accumulators per thread", _accumulators_fit),
    Restriction("shared memory exceeds the per-block limit", _smem_fits),
)

BMM = Strategy(
    name="bmm",
    summary="projection kernel -> (B*H, N, N) a, b -> cuBLAS bmm -> output kernel reading the product in place",
    # One block size for both kernels: it halves the space, and the defaults need no more.
    # min_blocks: the launch bounds' minimum blocks per SM. Unbounded, ptxas gives the 8x8 tiles
    # ~210 registers (one 256-thread block per SM); 2 caps them at 128. unroll: the 32 k-steps
    # of a 128-wide product unrolled 4 deep (a single value, kept as data to widen later).
    # The output kernel ran its two products at 21 TFLOP/s against the projection's 35 (run 19,
    # N512: 796 us for 17.2 GFLOP). o_weights_smem stages its Wout/Wgate column chunks in shared
    # memory (as p_weights_smem does for the projection): no gain in run 19's tuning. o_tn 8 gives
    # each product 4 x 8 micro-tiles, 10.7 multiply-adds per load as in the projection's (8 with o_tn 4).
    space={"p_tile": (64, 128), "p_tm": (4, 8), "p_tn": (4, 8), "p_weights_smem": (False, True),
           "o_tile": (32, 64, 128), "o_tm": (1, 2, 4), "o_tn": (4, 8), "o_weights_smem": (False, True),
           "threads": (128, 256), "unroll": (4,), "min_blocks": (1, 2)},
    restrictions=_COMMON,
)

FUSED = Strategy(
    name="fused",
    summary="one cooperative kernel: projection, grid barrier, triangle sums + output (small N)",
    # tri_smem: the output phase's triangle sums from global memory per (pair, channel) (False), or
    # staged in shared memory per row tile (True; stages sized by triangle_staging).
    space={"p_tile": (32, 64), "p_tm": (2, 4), "p_tn": (4, 8), "o_tile": (16, 32, 64), "o_tm": (1, 2, 4),
           "threads": (128, 256), "unroll": (2, 4), "blocks_per_sm": (1, 2), "tri_smem": (False, True)},
    restrictions=_COMMON + (Restriction("persistent blocks must be co-resident on an SM", _persistent_blocks_fit),),
)

# Parameters added to a strategy after tuned entries existed, with the value that reproduces what those
# entries ran, so that an entry without them still plans (check_tuned_entries builds stale entries too).
_ADDED_PARAMS = {"fused": {"tri_smem": False}, "bmm": {"o_weights_smem": False, "o_tn": O_TN}}


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


class TrimulSpec(OpSpec):
    added_params = _ADDED_PARAMS
    name = "trimul"
    # The options are compile-time and part of the tuned key, as 0/1 next to the widths.
    width_names = ("P", "H", "outgoing", "gate_normalized", "bias")
    strategies = {s.name: s for s in (BMM, FUSED)}
    default_points = (
        # P a multiple of 64, H of 32 (the real models): 128-column chunks of 4H, 8x8 micro-tiles.
        ("bmm", {"p_tile": 128, "p_tm": 8, "p_tn": 8, "p_weights_smem": False, "o_tile": 64, "o_tm": 4, "o_tn": 4,
                 "o_weights_smem": False, "threads": 256, "unroll": 4, "min_blocks": 1}),
        # Any P, H multiples of 8 up to 256: 32-column chunks of 4H, 8-column chunks of P (64-row
        # output tiles keep P = H = 248 within shared memory).
        ("bmm", {"p_tile": 64, "p_tm": 4, "p_tn": 4, "p_weights_smem": False, "o_tile": 64, "o_tm": 1, "o_tn": 4,
                 "o_weights_smem": False, "threads": 128, "unroll": 4, "min_blocks": 1}),
    )
    presets = {
        "seed": ({"B": 2, "N": 32, "P": 64, "H": 32, "outgoing": 0, "gate_normalized": 0, "bias": 1},),
        "real": tuple({"B": b, "N": n, "P": 128, "H": 128, "outgoing": 0, "gate_normalized": 0, "bias": 1}
                      for b, n in ((1, 128), (1, 256), (1, 512), (2, 768)))
                + ({"B": 1, "N": 256, "P": 128, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 1},),
    }
    tolerance = {"float32": Tolerance(max_abs=1e-4, rel_l2=1e-5)}
    width_defaults = {"outgoing": 0, "gate_normalized": 0, "bias": 1}  # the OPS.md reference
    extra_peer_names = ("cuequivariance",)

    def extra_peer(self, name: str, module, inputs: tuple):
        """cuEquivariance's fused triangle update in its fp32 mode (precision="ieee"), on the
        module's weights. It gates the output on the normalised input, so it computes this
        module's function for gate_on="normalized"; for gate_on="input" it is timed as the
        nearest equivalent (same shapes and work)."""
        if name != "cuequivariance":
            return super().extra_peer(name, module, inputs)
        try:
            from cuequivariance_torch import triangle_multiplicative_update
        except Exception as exc:  # not installed, or its CUDA libraries do not load here
            return f"cuequivariance_torch is not importable ({type(exc).__name__}: {exc})"
        x, mask = inputs
        m = module
        bias = m.widths["bias"]
        cat = lambda first, second: torch.cat([first, second]) if first is not None else None  # noqa: E731
        weights = dict(
            norm_in_weight=m.layer_norm_in.weight, norm_in_bias=m.layer_norm_in.bias,
            p_in_weight=cat(m.proj_a.weight, m.proj_b.weight), g_in_weight=cat(m.gate_a.weight, m.gate_b.weight),
            p_in_bias=cat(m.proj_a.bias, m.proj_b.bias) if bias else None,
            g_in_bias=cat(m.gate_a.bias, m.gate_b.bias) if bias else None,
            norm_out_weight=m.layer_norm_out.weight, norm_out_bias=m.layer_norm_out.bias,
            p_out_weight=m.out_proj.weight, p_out_bias=m.out_proj.bias if bias else None,
            g_out_weight=m.out_gate.weight, g_out_bias=m.out_gate.bias if bias else None)
        weights = {k: (v.detach() if v is not None else None) for k, v in weights.items()}
        direction = "outgoing" if m.widths["outgoing"] else "incoming"
        float_mask = mask.to(x.dtype)
        return lambda: triangle_multiplicative_update(x, direction, mask=float_mask, eps=1e-5,
                                                      precision="ieee", **weights)

    def plan(self, strategy: str, params: dict, widths: dict) -> Plan:
        params = self.with_added_params(strategy, params)
        self.check_point(strategy, params)
        w = {name: int(widths[name]) for name in self.width_names}
        P, H = w["P"], w["H"]
        fused = strategy == "fused"
        p_threads = o_threads = params["threads"]
        weights_smem = bool(params.get("p_weights_smem", False))
        proj = gemm_layout(params["p_tile"], params["p_tm"], params["p_tn"], p_threads)
        o_tn = params.get("o_tn", O_TN)
        outp = gemm_layout(params["o_tile"], params["o_tm"], o_tn, o_threads)
        context = {"P": P, "H": H, "outgoing": cuda_bool(w["outgoing"]), "gate_normalized": cuda_bool(w["gate_normalized"]),
                   "bias": cuda_bool(w["bias"]), "off": weight_offsets(P, H, bool(w["bias"])), "unroll": params["unroll"],
                   "ln_rows": LN_ROWS, "min_blocks": params.get("min_blocks", params.get("blocks_per_sm", 1)),
                   "p_tile": params["p_tile"], "p_tm": params["p_tm"], "p_tn": params["p_tn"],
                   "p_threads": p_threads, "p_a_stride": padded_stride(P), "p_weights_smem": cuda_bool(weights_smem),
                   "o_tile": params["o_tile"], "o_tm": params["o_tm"], "o_tn": o_tn, "o_threads": o_threads,
                   "o_z_stride": padded_stride(H), "o_x_stride": padded_stride(P)}
        context.update({f"p_{k}": v for k, v in proj.items()})
        context.update({f"o_{k}": v for k, v in outp.items()})
        project_smem = 4 * (params["p_tile"] * padded_stride(P) + (P * proj["cn"] if weights_smem else 0))
        o_weights_smem = bool(params.get("o_weights_smem", False))
        context["o_weights_smem"] = cuda_bool(o_weights_smem)
        output_smem = 4 * (params["o_tile"] * (padded_stride(H) + padded_stride(P)) + ((H + P) * outp["cn"] if o_weights_smem else 0))
        if fused:
            staged = params["tri_smem"]
            tri = triangle_staging(params["o_tile"], H, bool(w["outgoing"]))
            context.update(threads=p_threads, output_threads=o_threads, output_smem=0, tri_smem=cuda_bool(staged),
                           **{f"tri_{k}": v for k, v in tri.items()})
            # One buffer, reused by every phase; staged sums hold the tile's z rows and two stages in it.
            triangle_smem = 4 * (params["o_tile"] * padded_stride(H) + 2 * tri["stage_floats"]) if staged else 0
            smem = max(project_smem, output_smem, triangle_smem)
            grid = _fused_grid(params["p_tile"], params["o_tile"], params["blocks_per_sm"], row_tiles=staged)
        else:
            context.update(output_threads=o_threads, output_smem=output_smem)
            smem = project_smem
            grid = _tile_grid(params["p_tile"])
        return Plan(self.name, strategy, dict(params), w, context, p_threads, smem, grid)

    def cost(self, shape: dict) -> Cost:
        """The reference's FLOPs (projections, triangle sums, output layers) and the bytes that must
        move: the input once, the mask, the output once, the weights."""
        B, N, P, H = (shape[k] for k in ("B", "N", "P", "H"))
        pairs = B * N * N
        flops = 2 * pairs * P * 4 * H + 2 * B * N * N * N * H + 2 * pairs * (H * P + P * P)
        weights = 4 * P * H + H * P + P * P
        return Cost(bytes=4.0 * (2 * pairs * P + weights) + pairs, flops=float(flops))

    def make_module(self, widths: dict, generator: torch.Generator) -> "TriangleMultiplication":
        module = TriangleMultiplication(widths["P"], widths["H"], **options_of(widths))
        randomize_parameters(module, generator)
        return module

    def make_reference(self, module: "TriangleMultiplication") -> TriangleMultiplicationReference:
        """A plain reference module holding the same weights (the peers run this)."""
        ref = TriangleMultiplicationReference(module.widths["P"], module.widths["H"], **options_of(module.widths))
        ref.load_state_dict(module.state_dict())
        return ref.to(next(module.parameters()).device)

    def make_inputs(self, shape: dict, generator: torch.Generator, distribution: str = "normal") -> tuple:
        B, N, P = shape["B"], shape["N"], shape["P"]
        return random_tensor((B, N, N, P), generator, distribution), random_mask(B, N, generator)


def options_of(widths: dict) -> dict:
    """Constructor options from the 0/1 entries of a widths dict (absent: the defaults)."""
    return {"direction": "outgoing" if widths.get("outgoing", 0) else "incoming",
            "gate_on": "normalized" if widths.get("gate_normalized", 0) else "input",
            "bias": bool(widths.get("bias", 1))}


def random_mask(B: int, N: int, generator: torch.Generator, keep: float = 0.8) -> torch.Tensor:
    """A random, non-symmetric bool mask with one fully masked row and one fully masked (other)
    column per batch when N > 1: masked rows and columns zero whole triangle sums."""
    mask = torch.rand((B, N, N), generator=generator) < keep
    if N > 1:
        row = int(torch.randint(N, (1,), generator=generator))
        col = (row + 1 + int(torch.randint(N - 1, (1,), generator=generator))) % N
        mask[:, row, :] = False
        mask[:, :, col] = False
    return mask


def _tile_grid(tile: int):
    """One block per row tile of the B*N*N pairs."""

    def grid(B, N, sms, resident, _tile=tile):
        tiles = ceil_div(B * N * N, _tile)
        return max(1, tiles), tiles

    return grid


def _fused_grid(p_tile: int, o_tile: int, blocks_per_sm: int, row_tiles: bool = False):
    """Persistent and co-resident (the grid barrier needs every block running): at most
    min(blocks_per_sm, resident) per SM, and no more than the larger phase has tiles.
    work = the output phase's tile count: o_tile consecutive pairs of the flattened B*N*N, or with
    row_tiles (staged triangle sums) up to o_tile pairs of one row (b, i), ceil(N / o_tile) per row."""

    def grid(B, N, sms, resident, _p=p_tile, _o=o_tile, _per_sm=blocks_per_sm, _rows=row_tiles):
        pairs = B * N * N
        out_tiles = B * N * ceil_div(N, _o) if _rows else ceil_div(pairs, _o)
        tiles = max(ceil_div(pairs, _p), out_tiles)
        return max(1, min(tiles, min(_per_sm, max(1, resident)) * sms)), out_tiles

    return grid


TRIMUL = TrimulSpec()


# ---- the drop-in module -------------------------------------------------------------------

_PARAM_ORDER = ("layer_norm_in", "proj_a", "gate_a", "proj_b", "gate_b", "layer_norm_out", "out_proj", "out_gate")


class TriangleMultiplication(KernelModule, TriangleMultiplicationReference):
    """Drop-in for TriangleMultiplicationReference: same constructor, submodules and state_dict.

    CUDA float32 input runs the tuned kernels; CPU input or other dtypes run the reference.
    Scratch for a and b comes from torch's stream-aware caching allocator on every call (so a
    captured CUDA graph never points at memory a later, larger call freed). The fused
    strategy's grid-barrier ints are owned by the module and left zeroed by every launch: two
    launches of the SAME module on different streams at once would share them.
    """

    op = TRIMUL
    _RUNTIME_STATE = KernelModule._RUNTIME_STATE + ("_barrier", "_launches")

    def __init__(self, pair_dim: int, hidden_dim: int, direction: str = "incoming", gate_on: str = "input",
                 bias: bool = True):
        super().__init__(pair_dim, hidden_dim, direction=direction, gate_on=gate_on, bias=bias)
        self.widths = {"P": int(pair_dim), "H": int(hidden_dim), "outgoing": int(direction == "outgoing"),
                       "gate_normalized": int(gate_on == "normalized"), "bias": int(bias)}
        self._outgoing = direction == "outgoing"
        self._barrier = None   # fused: (device index, the grid barrier's two ints)
        self._launches = None  # (variant, device, B, N) -> kernels and grids, computed once
        # Every parameter in state_dict order (no bias slots without bias), packed by pack_weights.
        slots = [(getattr(self, sub), name) for sub in _PARAM_ORDER for name in ("weight", "bias")
                 if getattr(self, sub)._parameters.get(name) is not None]
        self._param_names = tuple(f"{sub}.{name}" for sub in _PARAM_ORDER for name in ("weight", "bias")
                                  if getattr(self, sub)._parameters.get(name) is not None)
        self._weights = PackedParameters(slots, self._pack)
        self._ln_params = self.layer_norm_in._parameters  # the validation's dtype and device, without __getattr__

    def reference_forward(self, pair_repr, pair_mask):
        return TriangleMultiplicationReference.forward(self, pair_repr, pair_mask)

    def forward(self, pair_repr, pair_mask):
        self._validate(pair_repr, pair_mask)
        return self._dispatch(pair_repr, pair_mask)

    def _validate(self, x, mask) -> None:
        # Conditions first, messages only on failure: this runs on every call.
        P = self.widths["P"]
        check_float_tensor("pair_repr", x, 4, self._ln_params["weight"])
        shape = x.shape
        if shape[1] != shape[2] or shape[3] != P:
            raise ValueError(f"pair_repr must have shape (B, N, N, {P}), got {tuple(shape)}")
        if not isinstance(mask, torch.Tensor):
            raise ValueError(f"pair_mask must be a torch.Tensor, got {type(mask).__name__}")
        if mask.shape != shape[:3]:
            raise ValueError(f"pair_mask must have shape (B, N, N) = {tuple(shape[:3])}, got {tuple(mask.shape)}")
        if mask.dtype.is_complex:
            raise ValueError(f"pair_mask must be bool or a float 0/1 tensor, got dtype {mask.dtype}")
        if mask.device != x.device:
            raise ValueError(f"pair_mask is on {mask.device} but pair_repr is on {x.device}")

    def uses_kernel(self, x, mask) -> bool:
        # Pair indices are 32-bit in the kernels: B*N*N >= 2^31 runs the reference.
        return super().uses_kernel(x) and x.shape[0] * x.shape[1] * x.shape[1] < 2**31

    def _pack(self, params: list) -> torch.Tensor:
        return pack_weights(dict(zip(self._param_names, params)), self.widths["P"], self.widths["H"],
                            bool(self.widths["bias"]))

    def packed_weights(self) -> torch.Tensor:
        """The weights in the kernels' layout (rebuilt only after a parameter changed)."""
        return self._weights.get()

    def _launch(self, pair_repr, pair_mask, out=None, variant=None):
        x = contiguous_aligned(pair_repr)
        mask = pair_mask
        if mask.dtype is not torch.bool and mask.dtype is not torch.float32:
            mask = mask.to(torch.float32)  # other dtypes: the reference's .to(), off the hot path
        if not mask.is_contiguous():
            mask = mask.contiguous()
        B, N = x.shape[0], x.shape[1]
        if out is None:
            out = torch.empty(x.shape, device=x.device, dtype=torch.float32)
        if out.numel() == 0:
            return out
        variant = variant or self.variant_for(N, x.device)
        device = x.get_device()
        launches = self._launches
        if launches is None:
            launches = self._launches = {}
        key = (variant, device, B, N)
        how = launches.get(key)
        if how is None:
            how = launches[key] = self._prepare(variant, device, B, N)
        mask_is_float = 1 if mask.dtype is torch.float32 else 0
        if variant.plan.strategy == "fused":
            self._launch_fused(how, x, mask, mask_is_float, out, B, N)
        else:
            self._launch_bmm(how, x, mask, mask_is_float, out, B, N)
        return out

    def _prepare(self, variant, device: int, B: int, N: int) -> tuple:
        """Kernels and grids for (variant, device, B, N), once."""
        from .. import runtime

        plan, context = variant.plan, variant.plan.context
        sms = runtime.device_info(device).limits.sm_count
        main = variant.kernel(device)
        blocks, work = plan.grid(B, N, sms, main.resident_per_sm)
        if plan.strategy == "fused":
            return main, blocks, plan.threads, plan.smem_bytes, work
        output = variant.kernel(device, name=f"{variant.rendered.kernel_name}_output",
                                threads=context["output_threads"], smem_bytes=context["output_smem"])
        o_tiles = ceil_div(B * N * N, context["o_tile"])
        return (main, blocks, plan.threads, plan.smem_bytes, work,
                output, o_tiles, context["output_threads"], context["output_smem"])

    def _launch_bmm(self, how, x, mask, mask_is_float, out, B, N) -> None:
        project, blocks, threads, smem, work, output, o_tiles, o_threads, o_smem = how
        H = self.widths["H"]
        # One allocation for a, b and their product, from torch's stream-aware caching allocator.
        ar, br, z = torch.empty((3, B * H, N, N), device=x.device, dtype=torch.float32).unbind(0)
        x_ptr, w_ptr = x.data_ptr(), self._weights.get().data_ptr()
        project(blocks, threads, smem, x_ptr, mask.data_ptr(), w_ptr, ar.data_ptr(), br.data_ptr(), B, N, work,
                mask_is_float)
        with fp32_matmul():  # fp32 means fp32: no TF32 in the bmm even where the caller allowed it
            triangle_bmm(ar, br, self._outgoing, out=z)
        output(o_tiles, o_threads, o_smem, x_ptr, z.data_ptr(), w_ptr, out.data_ptr(), B, N, o_tiles)

    def _barrier_ints(self, device: torch.device) -> int:
        """The grid barrier's ints on this device, zeroed once: each launch leaves them zeroed."""
        index = device.index or 0
        held = self._barrier
        if held is None or held[0] != index:
            held = self._barrier = (index, torch.zeros(2, device=device, dtype=torch.int32))
        return held[1].data_ptr()

    def _launch_fused(self, how, x, mask, mask_is_float, out, B, N) -> None:
        kernel, blocks, threads, smem, work = how
        ab = torch.empty((2, B * self.widths["H"] * N * N), device=x.device, dtype=torch.float32)
        kernel.cooperative(blocks, threads, smem, x.data_ptr(), mask.data_ptr(), self._weights.get().data_ptr(),
                           ab[0].data_ptr(), ab[1].data_ptr(), self._barrier_ints(x.device), out.data_ptr(),
                           B, N, work, mask_is_float)
