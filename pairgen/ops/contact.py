"""The pair contact head (OPS.md section 2): reference, spec, drop-in module, launch glue."""
from __future__ import annotations

import torch
from torch import nn

from .base import (Cost, DeviceLimits, KernelModule, OpSpec, Plan, Restriction, Strategy, Tolerance,
                   PackedParameters, ceil_div, check_float_tensor, contiguous_aligned, cuda_bool, is_pow2,
                   padded_stride, randomize_parameters, random_tensor, section_offsets)


class ContactHeadReference(nn.Module):
    """OPS.md section 2, verbatim."""

    def __init__(self, pair_dim, hidden_dim):
        super().__init__()
        self.layer_norm = nn.LayerNorm(pair_dim)
        self.mlp = nn.Sequential(
            nn.Linear(pair_dim, hidden_dim), nn.ReLU(),
            nn.Linear(hidden_dim, hidden_dim), nn.ReLU(),
            nn.Linear(hidden_dim, 1),
        )

    def forward(self, pair_repr):  # (B,N,N,P)
        x = self.layer_norm(pair_repr)  # each (i,j) normalised on its own ...
        x = (x + x.permute(0, 2, 1, 3)) / 2.0  # ... then symmetrised
        return torch.sigmoid(self.mlp(x).squeeze(-1))  # (B,N,N) probabilities


# ---- the spec ------------------------------------------------------------------------------

def weight_offsets(P: int, H: int) -> dict[str, int]:
    """Packed-weight layout shared with templates/contact/_weights.cuh.j2 (16-byte sections)."""
    return section_offsets([("w1t", P * H), ("b1", H), ("w2t", H * H), ("b2", H), ("w3", H), ("b3", 1),
                            ("gamma", P), ("beta", P)])


def _weights_bytes(plan: Plan) -> int:
    return 4 * plan.context["off"]["total"] if plan.params["weights_smem"] else 0


def _smem_fits(plan: Plan, limits: DeviceLimits) -> bool:
    return plan.smem_bytes <= limits.max_smem_per_block


def _widths_vectorise(plan: Plan, limits: DeviceLimits) -> bool:
    return plan.widths["H"] % 4 == 0 and plan.widths["P"] % 4 == 0


_COMMON = (
    Restriction("P and H must be multiples of 4 (float4 weight reads)", _widths_vectorise),
    Restriction("shared memory exceeds the per-block limit", _smem_fits),
)

THREAD_PER_PAIR = Strategy(
    name="thread_per_pair",
    summary="one thread per pair, layers computed `chunk` outputs at a time in registers",
    space={"threads": (64, 128, 256), "chunk": (4, 8, 16), "weights_smem": (True, False),
           "symmetric": (True, False)},
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
    restrictions=_TILED_RESTRICTIONS,
)

SYMMETRIC_TILED = Strategy(
    name="symmetric_tiled",
    summary="tiled over blocks (bi <= bj) of the pair grid; each pair computed once, written twice",
    space={"tile_side": (4, 8, 16), **_TILED_SPACE},
    restrictions=_TILED_RESTRICTIONS,
)


def _grid_tiles(num_tiles: int, blocks_per_sm: int, sms: int, resident_per_sm: int) -> int:
    """Persistent grid (blocks_per_sm per SM, looping over tiles), or one block per tile (0).
    A persistent grid is clamped to the blocks that can be resident at once (registers decide
    that only after compilation): a block that waits for a slot would run its tiles last."""
    if not blocks_per_sm:
        return max(1, num_tiles)
    return max(1, min(num_tiles, min(blocks_per_sm, max(1, resident_per_sm)) * sms))


class ContactSpec(OpSpec):
    # stage_rows and ln_lanes came after the first tuned entries: 0 is the kernel they ran.
    added_params = {"tiled": {"stage_rows": 0, "ln_lanes": 0}, "symmetric_tiled": {"stage_rows": 0, "ln_lanes": 0}}
    name = "contact"
    width_names = ("P", "H")
    strategies = {s.name: s for s in (THREAD_PER_PAIR, TILED, SYMMETRIC_TILED)}
    # tn=4: with tn=8 the P=128, H=64 build spilled 8 B (NVRTC 13.0, sm_90); every tuned winner so far has tn=4.
    # The first point: the seed's fastest in run 23 (6.7 us of kernel, CUPTI; ln_lanes 4 took the
    # seed's tiled winner from 10.8 to 8.4 us). The second, the earlier default, serves any P % 4 == 0.
    default_points = (
        ("symmetric_tiled", {"tile_side": 4, "threads": 64, "tn": 4, "unroll": 2, "ln_rows": 2,
                             "weights_smem": True, "blocks_per_sm": 0, "stage_rows": 0, "ln_lanes": 4}),
        ("symmetric_tiled", {"tile_side": 8, "threads": 256, "tn": 4, "unroll": 2, "ln_rows": 4,
                             "weights_smem": False, "blocks_per_sm": 2, "stage_rows": 0, "ln_lanes": 0}),
        ("thread_per_pair", {"threads": 128, "chunk": 4, "weights_smem": False, "symmetric": True}),
    )
    presets = {
        "seed": ({"B": 4, "N": 64, "P": 64, "H": 32},),
        "real": ({"B": 1, "N": 256, "P": 128, "H": 128}, {"B": 1, "N": 512, "P": 128, "H": 128},
                 {"B": 1, "N": 1024, "P": 128, "H": 64}),
    }
    tolerance = {"float32": Tolerance(max_abs=1e-4, rel_l2=1e-5)}

    def plan(self, strategy: str, params: dict, widths: dict) -> Plan:
        params = self.with_added_params(strategy, params)
        self.check_point(strategy, params)
        P, H = int(widths["P"]), int(widths["H"])
        off = weight_offsets(P, H)
        context = {"P": P, "H": H, "off": off, "weights_smem": cuda_bool(params["weights_smem"])}
        weights = 4 * off["total"] if params["weights_smem"] else 0
        if strategy == "thread_per_pair":
            context.update(threads=params["threads"], chunk=params["chunk"], symmetric=cuda_bool(params["symmetric"]))
            smem = weights + 4 * (P + H) * params["threads"]

            def grid(B, N, sms, resident, _sym=params["symmetric"], _t=params["threads"]):
                work = B * (N * (N + 1) // 2 if _sym else N * N)
                return max(1, ceil_div(work, _t)), work
        else:
            rows = params["tile_side"] ** 2 if strategy == "symmetric_tiled" else params["tile_rows"]
            threads_n = max(1, H // params["tn"])
            threads_m = max(1, params["threads"] // threads_n)
            context.update(tile_rows=rows, threads=params["threads"], tn=params["tn"], threads_n=threads_n,
                           threads_m=threads_m, tm=rows // threads_m, unroll=params["unroll"], ln_rows=params["ln_rows"],
                           a_stride=padded_stride(max(P, H)), stage_rows=params["stage_rows"],
                           ln_lanes=params["ln_lanes"])
            if strategy == "symmetric_tiled":
                context["tile_side"] = params["tile_side"]
            staged = params["stage_rows"] * 2 * rows * P  # both orientations of a tile's rows, per buffer
            smem = weights + 4 * (rows * context["a_stride"] + staged)

            def grid(B, N, sms, resident, _strategy=strategy, _rows=rows, _side=params.get("tile_side"),
                     _per_sm=params["blocks_per_sm"]):
                if _strategy == "symmetric_tiled":
                    nb = ceil_div(N, _side)
                    tiles = B * nb * (nb + 1) // 2
                else:
                    tiles = ceil_div(B * N * N, _rows)
                return _grid_tiles(tiles, _per_sm, sms, resident), tiles
        return Plan(self.name, strategy, dict(params), {"P": P, "H": H}, context, params["threads"], smem, grid)

    def cost(self, shape: dict) -> Cost:
        B, N, P, H = (shape[k] for k in ("B", "N", "P", "H"))
        pairs = B * N * N
        flops = pairs * (2 * (P * H + H * H + H) + 10 * P)
        return Cost(bytes=4.0 * (pairs * P + pairs + P * H + H * H), flops=float(flops))

    def make_module(self, widths: dict, generator: torch.Generator) -> "ContactHead":
        module = ContactHead(widths["P"], widths["H"])
        randomize_parameters(module, generator)
        return module

    def make_reference(self, module: "ContactHead") -> ContactHeadReference:
        """A plain reference module holding the same weights (the peers run this)."""
        ref = ContactHeadReference(module.widths["P"], module.widths["H"])
        ref.load_state_dict(module.state_dict())
        return ref.to(next(module.parameters()).device)

    def make_inputs(self, shape: dict, generator: torch.Generator, distribution: str = "normal") -> tuple:
        return (random_tensor((shape["B"], shape["N"], shape["N"], shape["P"]), generator, distribution),)


CONTACT = ContactSpec()


# ---- the drop-in module -------------------------------------------------------------------

class ContactHead(KernelModule, ContactHeadReference):
    """Drop-in for ContactHeadReference: same constructor, submodules and state_dict.

    CUDA float32 input runs the tuned kernel; CPU input or other dtypes run the reference.
    """

    op = CONTACT

    def __init__(self, pair_dim: int, hidden_dim: int):
        super().__init__(pair_dim, hidden_dim)
        self.widths = {"P": int(pair_dim), "H": int(hidden_dim)}
        ln, l1, l2, l3 = self.layer_norm, self.mlp[0], self.mlp[2], self.mlp[4]
        slots = ((l1, "weight"), (l1, "bias"), (l2, "weight"), (l2, "bias"), (l3, "weight"), (l3, "bias"),
                 (ln, "weight"), (ln, "bias"))
        self._weights = PackedParameters(slots, self._pack)
        self._ln_params = ln._parameters  # the validation's dtype and device, without __getattr__

    def reference_forward(self, pair_repr):
        return ContactHeadReference.forward(self, pair_repr)

    def forward(self, pair_repr):
        self._validate(pair_repr)
        return self._dispatch(pair_repr)

    def _validate(self, x) -> None:
        P = self.widths["P"]
        check_float_tensor("pair_repr", x, 4, self._ln_params["weight"])
        shape = x.shape
        if shape[1] != shape[2] or shape[3] != P:  # not expect(): its message would be built every call
            raise ValueError(f"pair_repr must have shape (B, N, N, {P}), got {tuple(shape)}")

    def _pack(self, params: list) -> torch.Tensor:
        """W1ᵀ | b1 | W2ᵀ | b2 | w3 | b3 | gamma | beta, at the offsets of weight_offsets()."""
        w1, b1, w2, b2, w3, b3, gamma, beta = (p.float() for p in params)
        off = weight_offsets(self.widths["P"], self.widths["H"])
        packed = torch.zeros(off["total"], device=w1.device, dtype=torch.float32)
        for name, value in (("w1t", w1.t()), ("b1", b1), ("w2t", w2.t()), ("b2", b2), ("w3", w3),
                            ("b3", b3), ("gamma", gamma), ("beta", beta)):
            packed[off[name]: off[name] + value.numel()] = value.reshape(-1)
        return packed

    def packed_weights(self) -> torch.Tensor:
        """The weights in the kernels' layout (rebuilt only after a parameter changed)."""
        return self._weights.get()

    def uses_kernel(self, x) -> bool:
        # The kernels index pairs with 32-bit ints; B*N*N >= 2^31 (over 1 TB at P=128) runs the reference.
        return super().uses_kernel(x) and x.shape[0] * x.shape[1] * x.shape[1] < 2**31

    def _launch(self, pair_repr, out=None, variant=None):
        x = contiguous_aligned(pair_repr)
        B, N = x.shape[0], x.shape[1]
        if out is None:
            out = torch.empty((B, N, N), device=x.device, dtype=torch.float32)
        if out.numel() == 0:
            return out
        variant = variant or self.variant_for(N, x.device)
        variant.launch(x.get_device(), B, N, x.data_ptr(), self._weights.get().data_ptr(), out.data_ptr())
        return out
