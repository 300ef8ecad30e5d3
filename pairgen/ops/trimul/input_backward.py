"""The input side of a 16-bit training step's backward in one tensor-core kernel
(templates/trimul/input_backward.cu.j2): from d_proj, the gradient of the four projections'
pre-activations (channels first), the kernel makes d xn = d_proj^T W4 tile by tile, joins the output
gate's gradient, and runs the input LayerNorm's backward on it: d x and the LayerNorm's affine
gradients. The closed form otherwise writes d xn from cuBLAS's product and reads it back in the
LayerNorm's backward kernel (two pair-sized passes more).

Off by default (INPUT_BACKWARD_KERNEL): on an H100 it takes as long as cuBLAS's product and the
LayerNorm's backward kernel together (docs/performance.md, session 32), so a step gains nothing
yet. Its tile's LayerNorm backward runs between the tile's products with two warps a scheduler
(W4^T takes half the registers), and the SM's memory traffic waits for it; what would let it win
is named there.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ... import runtime
from ...precision import MMA_KINDS
from ..fused_kernels import FusedTemplate, sm_count, storage_kind

if TYPE_CHECKING:  # annotations only: torch is imported where it is used
    import torch

SIGNATURES = {"": ("ptr d_proj", "ptr w4", "ptr x", "ptr joined", "ptr mean", "ptr rstd", "ptr gamma", "ptr d_x",
                   "ptr affine_parts", "i64 plane", "i64 tiles")}
TEMPLATE = FusedTemplate("trimul", "input_backward", lambda context: SIGNATURES)
#: Whether 16-bit training steps take the kernel (where `applies`); off: see the module's note. The
#: tests turn it on.
INPUT_BACKWARD_KERNEL = False
#: Pairs a tile (the product's n).
TILE = 64
#: d_proj's channels a ring stage holds (fewer where 4H has fewer than two such chunks: 64, which
#: every H that is a multiple of 16 divides).
CHUNK_K = 64
#: Ring stages: chunks are fetched STAGES - 2 ahead of their product (one product stays in flight),
#: fewer than a tile's chunks, so that a tile's rows, fetched with its first step's prefetch, land
#: before its epilogue.
STAGES = 6
#: The widths the kernel takes: P in warpgroups of 64 channels; 4H in at least two chunks, and W4^T's
#: fragments (H registers a thread) beside the accumulators.
WIDTHS_P = (64, 128)
MIN_H, MAX_H = 32, 128


def chunk_k(H: int) -> int:
    K = 4 * H
    return CHUNK_K if K % CHUNK_K == 0 and K // CHUNK_K >= 2 else 64


def stages(H: int) -> int:
    return min(STAGES, 4 * H // chunk_k(H) + 1)


def smem_bytes(P: int, H: int) -> int:
    """The ring, x's and the joined gradient's padded rows, the tile's statistics, each warp's sums
    per pair and the block's (the template's SMEM_BYTES)."""
    warps = P // 64 * 4
    return (stages(H) * chunk_k(H) * TILE * 2 + 2 * TILE * (2 * P + 16)
            + (2 * TILE + warps * 2 * TILE + 2 * TILE) * 4)


def context(kind: str, P: int, H: int, join_before: bool) -> dict:
    """The template's context (hashable: launches are bound per context)."""
    return {"cols": P, "hidden": H, "join_before": join_before, "threads": 2 * P, "stages": stages(H),
            "chunk_k": chunk_k(H), "smem_bytes": smem_bytes(P, H), "mma_kind": MMA_KINDS[kind],
            "wgmma_widths": (), "wgmma_rs_tb_widths": (TILE,)}


def render(kind: str, P: int, H: int, join_before: bool = True):
    """The source at these widths."""
    return TEMPLATE.render(kind, **context(kind, P, H, join_before))


def applies(P: int, H: int, plane: int, tensors: list, stats: list) -> bool:
    """Whether the kernel takes a step at widths P and H over planes of `plane` pairs: on
    (INPUT_BACKWARD_KERNEL, checked first: a training step asks every time), `tensors` (d_proj, W4,
    the rows, the joined gradient, gamma) of one 16-bit dtype and `stats` (mean, 1/std) fp32 with a
    value a row, all contiguous with 16-byte aligned starts, on a GPU with warpgroup products
    (sm_90); P in WIDTHS_P, H a multiple of 16 in [MIN_H, MAX_H], whole 16-byte pieces of d_proj's
    rows (plane % 8 == 0)."""
    import torch

    if not INPUT_BACKWARD_KERNEL or P not in WIDTHS_P or H % 16 or not MIN_H <= H <= MAX_H or plane % 8:
        return False
    dtype, rows = tensors[0].dtype, tensors[2].shape[0]
    if dtype not in (torch.bfloat16, torch.float16) or any(t.dtype is not dtype for t in tensors):
        return False
    if any(t.dtype is not torch.float32 or t.numel() != rows for t in stats):
        return False
    if runtime.device_info(tensors[0].device.index or 0).capability < (9, 0):
        return False
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (*tensors, *stats))


def input_side_backward(d_proj: torch.Tensor, w4: torch.Tensor, rows: torch.Tensor, mean: torch.Tensor,
                        rstd: torch.Tensor, gamma: torch.Tensor, joined: torch.Tensor, join_before: bool) -> tuple:
    """For xn = LN_in(rows) (rows (B*L, P), its mean and 1/std (B*L,) fp32) feeding the projections
    proj = xn W4^T, given d_proj (B, 4H, L) channels first and the output gate's gradient `joined`
    (B*L, P) on xn (join_before) or on the rows: (d rows (B*L, P), d gamma, d beta in fp32). All of
    one 16-bit dtype but the statistics; applies must hold."""
    import torch

    B, K, L = d_proj.shape
    P = rows.shape[1]
    tiles = B * -(-L // TILE)
    blocks = max(1, min(tiles, sm_count(rows.device.index)))
    d_rows = torch.empty_like(rows)
    parts = torch.empty(blocks, 2, P, device=rows.device, dtype=torch.float32)
    TEMPLATE.launch(rows, "", blocks, d_proj.data_ptr(), w4.data_ptr(), rows.data_ptr(), joined.data_ptr(),
                    mean.data_ptr(), rstd.data_ptr(), gamma.data_ptr(), d_rows.data_ptr(), parts.data_ptr(), L, tiles,
                    smem=smem_bytes(P, K // 4), **context(storage_kind(rows.dtype), P, K // 4, join_before))
    d_gamma, d_beta = parts.sum(0)  # views of one reduction
    return d_rows, d_gamma, d_beta
