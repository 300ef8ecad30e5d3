"""The output side of a 16-bit training step's backward in one tensor-core kernel
(templates/trimul/output_backward.cu.j2): from the triangle sums z (channels first), the gate's
input and d(loss)/d(out), the kernel makes zn = LN_out(z), recomputes o and u, and writes zn,
d(loss)/d(o), d(loss)/d(u), d(loss)/d(gate input), d(loss)/d(z) (channels first) and the output
LayerNorm's affine gradients. The closed form otherwise makes zn in the forward, keeps o and u from
it (three pair-sized tensors held through the step), and runs the elementwise gate, two cuBLAS
products and the LayerNorm's backward over them.

On by default (OUTPUT_BACKWARD_KERNEL), where the closed form's fused kernels are
(PAIRGEN_FUSED_BACKWARD): measured on an H100 (docs/performance.md, session 25) it makes a bf16
step 2-4 % faster at N512-N1024.
"""
from __future__ import annotations

import functools

from typing import TYPE_CHECKING

from ... import runtime
from ...precision import MMA_KINDS
from ...spec import align
from ..fused_kernels import FusedTemplate, sm_count, storage_kind

if TYPE_CHECKING:  # annotations only: torch is imported where it is used
    import torch

SIGNATURES = {"": ("ptr z", "ptr gi", "ptr g", "ptr gamma", "ptr beta", "ptr wo", "ptr wg", "ptr bo", "ptr bg",
                   "ptr zn", "ptr d_o", "ptr d_u", "ptr d_gi", "ptr d_z", "ptr affine_parts", "i64 pairs",
                   "i64 plane", "i32 chunks")}
TEMPLATE = FusedTemplate("trimul", "output_backward", lambda context: SIGNATURES)
#: The widest P and H the kernel takes (each product's accumulators in one warpgroup's registers).
MAX_WIDTH = 128
#: Whether 16-bit training steps take the kernel (where `applies`). The tests run both ways.
OUTPUT_BACKWARD_KERNEL = True
#: Warpgroups a block (each works alone on its 64-row tiles; the block shares the resident weights).
#: With the weights read both ways from one copy, three fit an SM's shared memory at P = H = 128,
#: but a thread then has at most 168 registers, and the kernel spills at that width.
GROUPS = 2
#: The most of o's and u's columns one pass makes (the template's PH): both products' accumulators
#: for all of P spill at P = H = 128 beside zn's fragments and d_o's; half of P fits two
#: warpgroups' 255 registers a thread, a quarter comes closer to three warpgroups' 168.
MAX_PASS_COLUMNS = 64
_TILE_ROWS = 64
#: Whether the kernel makes its weights' and tiles' shared-memory descriptors once, each product
#: adding its rows' and k-step's offset, instead of remaking each from the address (about five
#: instructions a product, 48 products a tile, in its SASS). A switch so that a study can time both
#: sides (scripts/switch_study.py --training).
DESCRIPTORS_ONCE = True


def pass_columns(P: int, max_columns: int = MAX_PASS_COLUMNS) -> int:
    """o's and u's columns a pass: the widest multiple of 16 up to max_columns that divides P."""
    return max(c for c in range(16, min(P, max_columns) + 1, 16) if P % c == 0)


@functools.lru_cache(maxsize=64)
def smem_bytes(P: int, H: int, groups: int = GROUPS) -> int:
    """Wo, Wg, and per warpgroup a 64-row tile of the gate's input (later a channel-major tile of
    d z: the larger of the two), a channel-major tile of z and a 64-row tile of d_u (each region
    1024-byte aligned), then gamma, beta, each warp's affine sums and the output's and the gate's
    biases in fp32 (the template's SMEM_BYTES)."""
    wo, wg = align(P * H * 2, 1024), align(P * P * 2, 1024)
    z_tile, rows_tile = align(H * _TILE_ROWS * 2, 1024), align(_TILE_ROWS * P * 2, 1024)
    tiles = max(rows_tile, z_tile) + z_tile + rows_tile
    return wo + wg + groups * tiles + (2 * H + groups * 4 * 2 * H + 2 * P) * 4


@functools.lru_cache(maxsize=64)
def context(kind: str, P: int, H: int, bias: bool, eps: float, groups: int = GROUPS,
            max_pass_columns: int = MAX_PASS_COLUMNS, descriptors_once: bool = False) -> dict:
    """The template's context (hashable: launches are bound per context; cached, since every
    training step launches the kernel: not to be changed)."""
    pass_cols = pass_columns(P, max_pass_columns)
    return {"cols": P, "hidden": H, "bias": bias, "eps": repr(float(eps)), "threads": 128 * groups,
            "smem_bytes": smem_bytes(P, H, groups), "pass_cols": pass_cols, "mma_kind": MMA_KINDS[kind],
            "wgmma_widths": (pass_cols,), "wgmma_rs_widths": (pass_cols,), "wgmma_rs_tb_widths": (H,),
            "wgmma_tb_widths": (P,), "descriptors_once": descriptors_once}


def render(kind: str, P: int, H: int, bias: bool = False, eps: float = 1e-5, **shape):
    """The source at these widths; shape: context's groups and max_pass_columns."""
    return TEMPLATE.render(kind, **context(kind, P, H, bias, eps, **{"descriptors_once": DESCRIPTORS_ONCE, **shape}))


def applies(dtype, P: int, H: int, tensors: list) -> bool:
    """Whether the kernel takes a step in `dtype` at widths P and H whose tensors the closed form's
    fused kernels take (a GPU's: fused_backward.enabled): on (OUTPUT_BACKWARD_KERNEL), 16-bit, on a
    GPU with warpgroup products (sm_90), P and H multiples of 16 up to MAX_WIDTH, and `tensors` (the
    gate's input and the weights) contiguous in that dtype with 16-byte aligned starts."""
    import torch

    if not OUTPUT_BACKWARD_KERNEL or P % 16 or H % 16 or P > MAX_WIDTH or H > MAX_WIDTH:
        return False
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    if runtime.device_info(tensors[0].device.index or 0).capability < (9, 0):
        return False
    return all(t.dtype is dtype and t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)


def output_side_backward(z: torch.Tensor, gate_in: torch.Tensor, g: torch.Tensor, ln_out: tuple, wo: torch.Tensor,
                         wg: torch.Tensor, bo: torch.Tensor | None, bg: torch.Tensor | None) -> dict:
    """For out = (LN_out(z) Wo^T + bo) * sigmoid(gate_in Wg^T + bg), z (B, H, L) channels first and
    gate_in (B*L, P) one row per pair, given g = d(loss)/d(out) and ln_out = (gamma, beta, eps):
    {"zn", "d_o", "d_u", "d_gate_in"} one row per pair, "d_z" (B, H, L) in z's storage (z is
    consumed), "d_gamma" and "d_beta" in fp32 (applies must hold; g is made contiguous in z's
    dtype)."""
    import torch

    B, H, L = z.shape
    M, P = gate_in.shape
    g = g.reshape(M, P)
    if g.dtype is not z.dtype or not g.is_contiguous() or g.data_ptr() % 16:
        g = g.to(z.dtype).contiguous()
    z = z.contiguous()
    gamma, beta, eps = ln_out
    # d z in z's storage: each tile's sums are read before its gradient is written, and nothing reads
    # z after (a pair-sized tensor less at the step's peak)
    out = {"zn": z.new_empty(M, H), "d_o": z.new_empty(M, P), "d_u": z.new_empty(M, P), "d_gate_in": z.new_empty(M, P),
           "d_z": z}
    bias = bo is not None
    tiles = -(-M // _TILE_ROWS)
    blocks = max(1, min(-(-tiles // GROUPS), sm_count(z.device.index)))
    parts = torch.empty(blocks, 2, H, device=z.device, dtype=torch.float32)
    chunks = L % 8 == 0 and z.data_ptr() % 16 == 0
    TEMPLATE.launch(z, "", blocks, z.data_ptr(), gate_in.data_ptr(), g.data_ptr(), gamma.data_ptr(), beta.data_ptr(),
                    wo.data_ptr(), wg.data_ptr(), bo.data_ptr() if bias else 0, bg.data_ptr() if bias else 0,
                    out["zn"].data_ptr(), out["d_o"].data_ptr(), out["d_u"].data_ptr(), out["d_gate_in"].data_ptr(),
                    out["d_z"].data_ptr(), parts.data_ptr(), M, L, int(chunks), smem=smem_bytes(P, H, GROUPS),
                    **context(storage_kind(z.dtype), P, H, bias, eps, GROUPS, MAX_PASS_COLUMNS, DESCRIPTORS_ONCE))
    out["d_gamma"], out["d_beta"] = parts.sum(0)  # views of one reduction
    return out
