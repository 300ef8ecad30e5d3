"""The contact head's closed form on the GPU: its input LayerNorm fused with the symmetrisation
over the pairs i <= j, forward and backward (templates/contact/symmetric_ln.cu.j2).

PyTorch's way (backward.py's fallback) normalises every row, gathers the rows of (i, j) and of
(j, i) and averages them: the normalised rows are read three times and written twice; back, d s is
scattered to both rows before the LayerNorm's backward. Here a warp takes a pair and holds both
rows in registers. On by default where the closed form's fused kernels are
(PAIRGEN_FUSED_BACKWARD); the GPU tests check both ways against the same standard."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ...precision import MMA_KINDS
from ...spec import align

from ... import runtime
from .. import layer_norm_rows
from ..fused_kernels import THREADS, WARP_KERNEL_BLOCKS_PER_SM, FusedTemplate, sm_count, storage_kind, warp_per_item_blocks

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



# ---- the MLP's forward and backward on tensor cores (templates/contact/mlp_backward.cu.j2) ----

MLP_SIGNATURES = {"": ("ptr s", "ptr ij", "ptr ji", "ptr g", "ptr w1", "ptr w2", "ptr b1", "ptr b2", "ptr w3",
                       "ptr b3", "ptr h1", "ptr h2", "ptr d_y", "ptr d_h2", "ptr d_h1", "ptr d_s", "i64 pairs")}
MLP_TEMPLATE = FusedTemplate("contact", "mlp_backward", lambda context: MLP_SIGNATURES)
#: The widest P and H the kernel takes (its largest product's accumulators in one warpgroup).
MLP_MAX_WIDTH = 128
#: Whether the closed form takes the kernel. Off: on the H200 (session 18) its first launches failed
#: past 48 KB of shared memory (the opt-in since added, not yet run) and one gradient (mlp.2.weight,
#: P48 H32) missed the 16-bit standard by 5 %; untimed. Tests turn it on.
MLP_KERNEL = False


def mlp_smem(P: int, H: int) -> int:
    """The kernel's shared memory: W1, W2, W2^T, W1^T and a 64-row tile of s per warpgroup, each
    region 1024-byte aligned (mlp_backward.cu.j2's SMEM_BYTES)."""
    w1, w2 = align(H * P * 2, 1024), align(H * H * 2, 1024)
    return 2 * w1 + 2 * w2 + (THREADS // 128) * align(64 * P * 2, 1024)


def mlp_context(kind: str, P: int, H: int) -> dict:
    """The template's context (hashable: launches are bound per context)."""
    return {"cols": P, "hidden": H, "smem_bytes": mlp_smem(P, H), "mma_kind": MMA_KINDS[kind], "wgmma_widths": (H,),
            "wgmma_rs_widths": tuple(sorted({H, P}))}


def render_mlp(kind: str, P: int, H: int):
    return MLP_TEMPLATE.render(kind, **mlp_context(kind, P, H))


def mlp_applies(s: torch.Tensor, weights: list, P: int, H: int) -> bool:
    """Whether the MLP kernel takes this call: 16-bit rows s on a GPU with warpgroup products
    (sm_90), the closed form's fused kernels on, P and H multiples of 16 up to MLP_MAX_WIDTH, and
    the weights contiguous in s's dtype with 16-byte aligned rows."""
    import torch

    if not MLP_KERNEL or s.dtype not in (torch.bfloat16, torch.float16) or not applies(s, P):
        return False
    if P % 16 or H % 16 or P > MLP_MAX_WIDTH or H > MLP_MAX_WIDTH:
        return False
    if runtime.device_info(s.device.index or 0).capability < (9, 0):
        return False
    return all(w.dtype is s.dtype and w.is_contiguous() and w.data_ptr() % 16 == 0 for w in weights)


def mlp_forward_backward(s: torch.Tensor, pairs, grad_out: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                         b1: torch.Tensor, b2: torch.Tensor, w3: torch.Tensor, b3: torch.Tensor) -> dict:
    """The MLP on the symmetrised rows s (pairs, P) and its backward from d(loss)/d(out) grad_out
    (B*N*N values) for the pairs of `pairs` (a backward.UniquePairs): {"h1", "h2", "d_y", "d_h2",
    "d_h1", "d_s"}, as the closed form computes them (mlp_applies must hold)."""
    U, P = s.shape
    H = w1.shape[0]
    new = lambda cols: s.new_empty(U, cols)  # noqa: E731
    out = {"h1": new(H), "h2": new(H), "d_y": new(1), "d_h2": new(H), "d_h1": new(H), "d_s": new(P)}
    g = grad_out.reshape(-1)
    if g.dtype is not s.dtype or not g.is_contiguous():
        g = g.to(s.dtype).contiguous()
    tiles = -(-U // 64)
    blocks = max(1, min(-(-tiles // (THREADS // 128)), sm_count(s.device.index)))
    tensors = (s, pairs.ij, pairs.ji, g, w1, w2, b1, b2, w3, b3, *out.values())
    MLP_TEMPLATE.launch(s, "", blocks, *(t.data_ptr() for t in tensors), U, smem=mlp_smem(P, H),
                        **mlp_context(storage_kind(s.dtype), P, H))
    return out
