"""The input side of a 16-bit training step's backward in one tensor-core kernel
(templates/trimul/input_backward.cu.j2): from d(loss)/d(the four projections) d_proj (channels
first), W4 and x with the forward's row statistics, the kernel makes d(loss)/d(xn) = d_proj^T W4 in
registers, adds the output gate's d(loss)/d(gate input), and runs the input LayerNorm's backward:
d(loss)/d(x) and the LayerNorm's affine gradients. The closed form otherwise writes d_xn with a
cuBLAS product and reads it back in the row LayerNorm's backward.

Off by default (INPUT_BACKWARD_KERNEL; PAIRGEN_SIDE_KERNELS=1 turns it on): checked on the CPU
emulator, not yet run on a GPU.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ... import config
from ...precision import MMA_KINDS
from ...spec import DeviceLimits, align
from ..fused_kernels import THREADS, FusedTemplate, sm_count, storage_kind
from .output_backward import warpgroup_kernels_take

if TYPE_CHECKING:  # annotations only: torch is imported where it is used
    import torch

SIGNATURES = {"": ("ptr d_proj", "ptr w4", "ptr x", "ptr mean", "ptr rstd", "ptr gamma", "ptr d_gi", "ptr d_x",
                   "ptr affine_parts", "i64 pairs", "i64 plane", "i32 vectors")}
TEMPLATE = FusedTemplate("trimul", "input_backward", lambda context: SIGNATURES)
#: The widest P the kernel takes (the product's accumulators in one warpgroup's registers).
MAX_WIDTH = 128
#: Whether 16-bit training steps take the kernel (where `applies`): None follows PAIRGEN_SIDE_KERNELS
#: (off unless set to 1) until a GPU has timed it against the product and the LayerNorm backward it
#: replaces (docs/performance.md, session 25).
INPUT_BACKWARD_KERNEL = None
#: d_proj's chunks in flight per warpgroup (the template's STAGES), and the channels of one.
STAGES = 4
_CHUNK_CHANNELS = 64
_GROUPS = THREADS // 128
_TILE_ROWS = 64


def smem_bytes(P: int, channels: int) -> int:
    """W4^T (1024-byte aligned), each warpgroup's ring of d_proj chunks, then gamma and each warp's
    affine sums in fp32 (the template's SMEM_BYTES)."""
    chunk = _CHUNK_CHANNELS * (_TILE_ROWS + 8) * 2
    return align(P * channels * 2, 1024) + _GROUPS * STAGES * chunk + (P + _GROUPS * 4 * 2 * P) * 4


def context(kind: str, P: int, channels: int, gate_normalized: bool) -> dict:
    """The template's context (hashable: launches are bound per context)."""
    return {"cols": P, "channels": channels, "gate_normalized": gate_normalized, "stages": STAGES,
            "smem_bytes": smem_bytes(P, channels), "mma_kind": MMA_KINDS[kind], "wgmma_widths": (),
            "wgmma_rs_widths": (P,)}


def render(kind: str, P: int, channels: int, gate_normalized: bool = True):
    return TEMPLATE.render(kind, **context(kind, P, channels, gate_normalized))


def _switched_on() -> bool:
    return INPUT_BACKWARD_KERNEL if INPUT_BACKWARD_KERNEL is not None else config.side_kernels()


def applies(dtype, P: int, channels: int, tensors: list) -> bool:
    """Whether the kernel takes a step in `dtype` at pair width P with `channels` (4H) projection
    channels: on (INPUT_BACKWARD_KERNEL, else PAIRGEN_SIDE_KERNELS), P a multiple of 16 up to
    MAX_WIDTH, the channels whole chunks, W4^T resident within a block's shared memory (4H up to 512
    at P = 128), and warpgroup_kernels_take(dtype, tensors) (x's rows, W4, the gate's gradient)."""
    if not _switched_on() or P % 16 or P > MAX_WIDTH or channels % _CHUNK_CHANNELS:
        return False
    return warpgroup_kernels_take(dtype, tensors) and smem_bytes(P, channels) <= DeviceLimits().max_smem_per_block


def input_side_backward(d_proj: torch.Tensor, w4: torch.Tensor, rows: torch.Tensor, mean: torch.Tensor,
                        rstd: torch.Tensor, gamma: torch.Tensor, d_gate_in: torch.Tensor,
                        gate_normalized: bool) -> tuple:
    """(d rows (B*L, P), d gamma, d beta in fp32) of rows -> LN_in -> xn, xn -> d_proj^T W4 with
    d(loss)/d(the gate input) d_gate_in added to d xn (gate_normalized) or to d rows (gate on the
    raw rows); d_proj (B, 4H, L) channels first, mean and rstd the forward's row statistics (fp32)
    (applies must hold)."""
    import torch

    B, channels, L = d_proj.shape
    M, P = rows.shape
    d_proj = d_proj.contiguous()
    d_x = torch.empty_like(rows)
    tiles = -(-M // _TILE_ROWS)
    blocks = max(1, min(-(-tiles // _GROUPS), sm_count(rows.device.index)))
    parts = torch.empty(blocks, 2, P, device=rows.device, dtype=torch.float32)
    vectors = L % 8 == 0 and d_proj.data_ptr() % 16 == 0
    TEMPLATE.launch(rows, "", blocks, d_proj.data_ptr(), w4.data_ptr(), rows.data_ptr(), mean.data_ptr(),
                    rstd.data_ptr(), gamma.data_ptr(), d_gate_in.data_ptr(), d_x.data_ptr(), parts.data_ptr(), M, L,
                    int(vectors), smem=smem_bytes(P, channels),
                    **context(storage_kind(rows.dtype), P, channels, gate_normalized))
    return (d_x, *parts.sum(0))  # d gamma and d beta: views of one reduction
