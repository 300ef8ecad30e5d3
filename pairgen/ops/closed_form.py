"""Pieces the ops' closed-form backwards share (pairgen/ops/<op>/backward.py): each backward
recomputes its forward's intermediates from the input and weights, then applies the chain rule."""
from __future__ import annotations

import torch

from ..modules import cublas_fp32_mode


def layer_norm_parts(t: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(t normalised over the last dim, 1/std): what the LayerNorm backward reuses."""
    centred = t - t.mean(-1, keepdim=True)
    rstd = torch.rsqrt(centred.square().mean(-1, keepdim=True) + eps)
    return centred * rstd, rstd


def layer_norm_backward(d_hat: torch.Tensor, t_hat: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """d(loss)/d(t) from d(loss)/d(t_hat), t_hat = (t - mean) * rstd over the last dim."""
    return rstd * (d_hat - d_hat.mean(-1, keepdim=True) - t_hat * (d_hat * t_hat).mean(-1, keepdim=True))


def linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows @ weight^T (+ bias), as nn.Linear, in one cuBLAS call."""
    return rows @ weight.t() if bias is None else torch.addmm(bias, rows, weight.t())


def gradients_in_fp32(compute, x: torch.Tensor, params: dict[str, torch.Tensor], grad_out: torch.Tensor,
                      tf32: bool, *extra) -> dict[str, torch.Tensor]:
    """compute(x, params, grad_out, *extra) -> {"input": d x, name: d param}, run in fp32 without
    autograd, each gradient returned in the dtype of what it is the gradient of. tf32=True lets the
    products use TF32 (16-bit and autocast calls: their gradient standard leaves room for TF32's
    10-bit mantissa, a bf16 product keeps 7), else exact fp32 whatever the caller allowed."""
    with torch.no_grad(), cublas_fp32_mode(tf32):
        grads = compute(x.float(), {name: p.float() for name, p in params.items()}, grad_out.float(), *extra)
    grads["input"] = grads["input"].to(x.dtype)
    for name, p in params.items():
        if name in grads:  # a frozen parameter's is not computed
            grads[name] = grads[name].to(p.dtype)
    return grads
