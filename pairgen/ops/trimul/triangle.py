"""The triangle sums as one batched product on the (B*H, N, N) layout of a and b that the
projection kernels write (the bmm, mma and wgmma strategies, the closed-form backward)."""
from __future__ import annotations

import torch


def triangle_operands(ar: torch.Tensor, br: torch.Tensor, outgoing: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The triangle sums as one batched product left @ right on the (B*H, N, N) layout
    ar[(b*H + h), r, c] = a[b, r, c, h]: incoming out[i, j] = sum_k a[k, i] b[k, j] = (arᵀ·br)[i, j];
    outgoing sum_k a[i, k] b[j, k] = (ar·brᵀ)[i, j]. The transposed views reach cuBLAS as flags,
    not copies."""
    return (ar, br.transpose(1, 2)) if outgoing else (ar.transpose(1, 2), br)


def triangle_bmm(ar: torch.Tensor, br: torch.Tensor, outgoing: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """The triangle sums (triangle_operands' product)."""
    return torch.bmm(*triangle_operands(ar, br, outgoing), out=out)
