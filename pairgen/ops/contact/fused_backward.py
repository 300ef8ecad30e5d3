"""The contact head's closed form on the GPU: its input LayerNorm fused with the symmetrisation
over the pairs i <= j, forward and backward (templates/contact/symmetric_ln.cu.j2).

PyTorch's way (backward.py's fallback) normalises every row, gathers the rows of (i, j) and of
(j, i) and averages them: the normalised rows are read three times and written twice; back, d s is
scattered to both rows before the LayerNorm's backward. Here a warp takes a pair and holds both
rows in registers. On by default where the closed form's fused kernels are
(PAIRGEN_FUSED_BACKWARD); the GPU tests check both ways against the same standard."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .. import layer_norm_rows
from ..fused_kernels import THREADS, WARP_KERNEL_BLOCKS_PER_SM, FusedTemplate, warp_per_item_blocks

if TYPE_CHECKING:  # annotations only: torch is imported where it is used, so that these sources
    import torch  # render without it (pairgen-tune --status)

#: Whether these kernels take rows like t of width cols: the row LayerNorm's conditions (CUDA, a
#: stored dtype, a row that fits in a warp's registers, PAIRGEN_FUSED_BACKWARD not 0).
applies = layer_norm_rows.applies

SIGNATURES = {"": ("ptr x", "ptr ij", "ptr ji", "ptr gamma", "ptr beta", "ptr s", "ptr mean", "ptr rstd", "i64 pairs"),
              "grad": ("ptr d_s", "ptr ij", "ptr ji", "ptr x", "ptr mean", "ptr rstd", "ptr gamma", "ptr d_x",
                       "ptr gamma_parts", "ptr beta_parts", "i64 pairs")}
#: The launch shape a tuned backward entry chooses (pairgen/ops/backward_tuning.py), and the
#: default where there is none: blocks per SM of the warp-per-pair kernels ("row_blocks").
TUNING_SPACE = {"row_blocks": (2, 4, 8, 16)}
TUNING_DEFAULT = {"row_blocks": WARP_KERNEL_BLOCKS_PER_SM}
TEMPLATE = FusedTemplate("contact", "symmetric_ln", lambda context: SIGNATURES)


def render(kind: str, cols: int, eps: float = 1e-5):
    return TEMPLATE.render(kind, cols=cols, eps=repr(float(eps)))


def tuning_sources(kind: str, tuning: dict, widths: dict) -> list:
    """The rendered sources a tuning's kernels run at these widths (see trimul's)."""
    return [render(kind, widths["P"])]


def layer_norm_symmetrised(rows: torch.Tensor, pairs, gamma: torch.Tensor, beta: torch.Tensor,
                           eps: float, tuning: dict = TUNING_DEFAULT) -> tuple:
    """rows (B*N*N, C) contiguous and pairs a backward.UniquePairs: (s (pairs, C), the mean and
    1/std of every row (B*N*N,) in fp32)."""
    import torch

    M, C = rows.shape
    count = pairs.ij.numel()
    s = rows.new_empty(count, C)
    mean = torch.empty(M, device=rows.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    TEMPLATE.launch(rows, "", warp_per_item_blocks(rows, count, tuning["row_blocks"]), rows.data_ptr(), pairs.ij.data_ptr(), pairs.ji.data_ptr(),
                    gamma.data_ptr(), beta.data_ptr(), s.data_ptr(), mean.data_ptr(), rstd.data_ptr(), count,
                    cols=C, eps=repr(float(eps)))
    return s, mean, rstd


def layer_norm_symmetrised_backward(d_s: torch.Tensor, rows: torch.Tensor, pairs, mean: torch.Tensor,
                                    rstd: torch.Tensor, gamma: torch.Tensor, eps: float,
                                    tuning: dict = TUNING_DEFAULT) -> tuple:
    """The backward of layer_norm_symmetrised: (d rows (B*N*N, C), d gamma, d beta; the affine
    gradients in fp32 from each warp's partial sums)."""
    import torch

    M, C = rows.shape
    count = pairs.ij.numel()
    d_rows = torch.empty_like(rows)
    blocks = warp_per_item_blocks(rows, count, tuning["row_blocks"])
    parts = torch.empty(2, blocks * (THREADS // 32), C, device=rows.device, dtype=torch.float32)
    TEMPLATE.launch(rows, "grad", blocks, d_s.data_ptr(), pairs.ij.data_ptr(), pairs.ji.data_ptr(),
                    rows.data_ptr(), mean.data_ptr(), rstd.data_ptr(), gamma.data_ptr(), d_rows.data_ptr(),
                    parts[0].data_ptr(), parts[1].data_ptr(), count, cols=C, eps=repr(float(eps)))
    return (d_rows, *parts.sum(1))  # d gamma and d beta: views of one reduction

