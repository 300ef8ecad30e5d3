"""LayerNorm over rows (M, C) on the GPU for the closed forms (templates/common/layer_norm_rows.cu.j2):
a warp per row, the row in registers. PyTorch's LayerNorm kernels read the short rows of a pair
representation (one per pair, tens to hundreds of channels) at a fraction of the memory's rate;
these kernels are several times faster there. Used where the closed forms' fused kernels are on
(PAIRGEN_FUSED_BACKWARD)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .. import config
from .fused_kernels import THREADS, WARP_KERNEL_BLOCKS_PER_SM, FusedTemplate, storage_kind, warp_per_item_blocks

if TYPE_CHECKING:  # annotations only: torch is imported where it is used, so that these sources
    import torch  # render without it (pairgen-tune --status)

SIGNATURES = {"": ("ptr x", "ptr gamma", "ptr beta", "ptr xn", "ptr mean", "ptr rstd", "i64 rows"),
              "grad": ("ptr d_xn", "ptr add_before", "ptr x", "ptr mean", "ptr rstd", "ptr gamma", "ptr add_after",
                       "ptr d_x", "ptr gamma_parts", "ptr beta_parts", "i64 rows")}
#: Widest row taken (a lane holds C / 32 values of each of a few arrays in registers).
MAX_COLS = 1024
TEMPLATE = FusedTemplate("common", "layer_norm_rows", lambda context: SIGNATURES)


def applies(t: torch.Tensor, cols: int) -> bool:
    """Whether these kernels take rows like t of width cols (else PyTorch's LayerNorm)."""
    return t.is_cuda and storage_kind(t.dtype) is not None and cols <= MAX_COLS and config.fused_backward()


def render(kind: str, cols: int, eps: float = 1e-5):
    return TEMPLATE.render(kind, cols=cols, eps=repr(float(eps)))


def layer_norm(rows: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float,
               blocks_per_sm: int = WARP_KERNEL_BLOCKS_PER_SM) -> tuple:
    """LayerNorm over the last dim of rows (M, C) contiguous: (xn (M, C), mean and 1/std (M,) in
    fp32), as torch.native_layer_norm returns them."""
    import torch

    M, C = rows.shape
    xn = torch.empty_like(rows)
    mean = torch.empty(M, device=rows.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    TEMPLATE.launch(rows, "", warp_per_item_blocks(rows, M, blocks_per_sm), rows.data_ptr(), gamma.data_ptr(), beta.data_ptr(), xn.data_ptr(),
                    mean.data_ptr(), rstd.data_ptr(), M, cols=C, eps=repr(float(eps)))
    return xn, mean, rstd


def layer_norm_backward(d_xn: torch.Tensor, rows: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                        gamma: torch.Tensor, eps: float, add_before: torch.Tensor | None = None,
                        add_after: torch.Tensor | None = None,
                        blocks_per_sm: int = WARP_KERNEL_BLOCKS_PER_SM) -> tuple:
    """The backward of layer_norm: (d rows, d gamma, d beta; the affine gradients in fp32 from each
    warp's partial sums), d xn taken as d_xn + add_before, and add_after added to d rows (both
    (M, C) contiguous, optional): the two places a second path's gradient joins."""
    import torch

    M, C = rows.shape
    d_rows = torch.empty_like(rows)
    blocks = warp_per_item_blocks(rows, M, blocks_per_sm)
    parts = torch.empty(2, blocks * (THREADS // 32), C, device=rows.device, dtype=torch.float32)
    TEMPLATE.launch(rows, "grad", blocks, d_xn.data_ptr(), 0 if add_before is None else add_before.data_ptr(),
                    rows.data_ptr(), mean.data_ptr(), rstd.data_ptr(), gamma.data_ptr(),
                    0 if add_after is None else add_after.data_ptr(), d_rows.data_ptr(), parts[0].data_ptr(),
                    parts[1].data_ptr(), M, cols=C, eps=repr(float(eps)))
    return d_rows, parts[0].sum(0), parts[1].sum(0)  # two tensors: gradients may not alias each other

