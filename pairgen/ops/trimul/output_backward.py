"""The output gate's backward of a 16-bit training step in one tensor-core kernel
(templates/trimul/output_backward.cu.j2): from zn = LN_out(z), the gate's input and d(loss)/d(out),
the kernel recomputes o and u and writes d(loss)/d(o), d(loss)/d(u), d(loss)/d(zn) and
d(loss)/d(gate input). The closed form otherwise keeps o and u from the forward (two pair-sized
tensors held through the step), runs the elementwise gate over them and two cuBLAS products.

Off by default (OUTPUT_BACKWARD_KERNEL): checked on the CPU emulator, not yet run on a GPU.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ... import runtime
from ...precision import MMA_KINDS
from ...spec import align
from ..fused_kernels import THREADS, FusedTemplate, sm_count, storage_kind

if TYPE_CHECKING:  # annotations only: torch is imported where it is used
    import torch

SIGNATURES = {"": ("ptr zn", "ptr gi", "ptr g", "ptr wo", "ptr wg", "ptr bo", "ptr bg", "ptr d_o", "ptr d_u",
                   "ptr d_zn", "ptr d_gi", "i64 pairs")}
TEMPLATE = FusedTemplate("trimul", "output_backward", lambda context: SIGNATURES)
#: The widest P and H the kernel takes (each product's accumulators in one warpgroup's registers).
MAX_WIDTH = 128
#: Whether 16-bit training steps take the kernel (where output_backward_applies). Off until timed on
#: a GPU against the passes it replaces (docs/performance.md, session 25).
OUTPUT_BACKWARD_KERNEL = False


def smem_bytes(P: int, H: int) -> int:
    """Wo, Wg, Wo^T, Wg^T and a 64-row tile of zn and of the gate's input per warpgroup, each region
    1024-byte aligned (the template's SMEM_BYTES)."""
    wo, wg = align(P * H * 2, 1024), align(P * P * 2, 1024)
    return 2 * wo + 2 * wg + (THREADS // 128) * (align(64 * H * 2, 1024) + align(64 * P * 2, 1024))


def context(kind: str, P: int, H: int, bias: bool) -> dict:
    """The template's context (hashable: launches are bound per context)."""
    return {"cols": P, "hidden": H, "bias": bias, "smem_bytes": smem_bytes(P, H), "mma_kind": MMA_KINDS[kind],
            "wgmma_widths": (P,), "wgmma_rs_widths": tuple(sorted({P, H}))}


def render(kind: str, P: int, H: int, bias: bool = False):
    return TEMPLATE.render(kind, **context(kind, P, H, bias))


def applies(dtype, P: int, H: int, tensors: list) -> bool:
    """Whether the kernel takes a step in `dtype` at widths P and H whose tensors the closed form's
    fused kernels take (a GPU's: fused_backward.enabled): on (OUTPUT_BACKWARD_KERNEL), 16-bit, a GPU
    with warpgroup products (sm_90), P and H multiples of 16 up to MAX_WIDTH, and `tensors` (the
    gate's input and the weights) contiguous in that dtype with 16-byte aligned starts (zn, which
    the LayerNorm kernel makes, always is)."""
    import torch

    if not OUTPUT_BACKWARD_KERNEL or dtype not in (torch.bfloat16, torch.float16):
        return False
    if P % 16 or H % 16 or P > MAX_WIDTH or H > MAX_WIDTH:
        return False
    if runtime.device_info(tensors[0].device.index or 0).capability < (9, 0):
        return False
    return all(t.dtype is dtype and t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)


def output_gate_backward(zn: torch.Tensor, gate_in: torch.Tensor, g: torch.Tensor, wo: torch.Tensor, wg: torch.Tensor,
                         bo: torch.Tensor | None, bg: torch.Tensor | None) -> tuple:
    """(d_o, d_u, d_zn, d_gate_in) for out = (zn Wo^T + bo) * sigmoid(gate_in Wg^T + bg), one row per
    pair, given g = d(loss)/d(out) (applies must hold; g is made contiguous in zn's dtype)."""
    M, H = zn.shape
    P = gate_in.shape[-1]
    g = g.reshape(M, P)
    if g.dtype is not zn.dtype or not g.is_contiguous() or g.data_ptr() % 16:
        g = g.to(zn.dtype).contiguous()
    d_o, d_u, d_gi = (zn.new_empty(M, P) for _ in range(3))
    d_zn = zn.new_empty(M, H)
    bias = bo is not None
    tiles = -(-M // 64)
    blocks = max(1, min(-(-tiles // (THREADS // 128)), sm_count(zn.device.index)))
    TEMPLATE.launch(zn, "", blocks, zn.data_ptr(), gate_in.data_ptr(), g.data_ptr(), wo.data_ptr(), wg.data_ptr(),
                    bo.data_ptr() if bias else 0, bg.data_ptr() if bias else 0, d_o.data_ptr(), d_u.data_ptr(),
                    d_zn.data_ptr(), d_gi.data_ptr(), M, smem=smem_bytes(P, H),
                    **context(storage_kind(zn.dtype), P, H, bias))
    return d_o, d_u, d_zn, d_gi
