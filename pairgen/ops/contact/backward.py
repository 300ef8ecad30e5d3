"""The contact head's gradients in closed form, computed in fp32 (closed_form.gradients_in_fp32).

  xn = LN(x) per pair,  s = (xn + xn^T) / 2 over (i, j),
  h1 = relu(s W1^T + b1),  h2 = relu(h1 W2^T + b2),  out = sigmoid(h2 W3^T + b3)

The backward recomputes xn, s, h1, h2 and out from the input and weights (nothing is kept from the
forward but the input), then applies the chain rule: three products back through the MLP, the
symmetrisation's transpose, the LayerNorm. d<name> is the gradient of the loss with respect to
<name>.
"""
from __future__ import annotations

import torch

from ..closed_form import gradients_in_fp32, layer_norm_backward, layer_norm_parts


def gradients(module, x: torch.Tensor, params: dict[str, torch.Tensor], grad_out: torch.Tensor,
              precision: str = "ieee", frozen: frozenset = frozenset()) -> dict[str, torch.Tensor]:
    """d(loss)/d(x) as "input", and d(loss)/d(parameter) for every name of `params`
    ("layer_norm.weight", ..., "mlp.4.bias") but the `frozen` ones' products, given
    d(loss)/d(out) = grad_out."""
    return gradients_in_fp32(lambda x32, w, g, mm: _gradients(module, x32, w, g, mm, frozen), x, params, grad_out,
                             precision)


def _transpose_pairs(t: torch.Tensor, B: int, N: int) -> torch.Tensor:
    """(B*N*N, C) rows of pairs (i, j) -> the rows of pairs (j, i)."""
    C = t.shape[-1]
    return t.view(B, N, N, C).transpose(1, 2).reshape(B * N * N, C)


def _gradients(module, x, w, grad_out, mm, frozen):
    B, N, _, P = x.shape
    rows = x.reshape(-1, P)

    # ---- the forward again (pair-sized tensors made in place where they can be) ----
    x_hat, _ = layer_norm_parts(rows, module.layer_norm.eps)
    s = x_hat.mul_(w["layer_norm.weight"]).add_(w["layer_norm.bias"])  # xn, in the storage of x_hat
    s.add_(_transpose_pairs(s, B, N)).mul_(0.5)  # symmetrised (the transpose is a copy: no aliasing)
    h1 = mm.linear(s, w["mlp.0.weight"], w["mlp.0.bias"]).relu_()
    h2 = mm.linear(h1, w["mlp.2.weight"], w["mlp.2.bias"]).relu_()
    out = torch.sigmoid(mm.linear(h2, w["mlp.4.weight"], w["mlp.4.bias"]))  # (M, 1)

    # ---- back through the MLP ----
    d_y = out.mul_(1 - out).mul_(grad_out.reshape(-1, 1))
    grads = {"mlp.4.bias": d_y.sum(0)}
    if "mlp.4.weight" not in frozen:
        grads["mlp.4.weight"] = mm(d_y.t(), h2)
    d_h2 = mm(d_y, w["mlp.4.weight"]).mul_(h2 > 0)
    del d_y, h2
    grads["mlp.2.bias"] = d_h2.sum(0)
    if "mlp.2.weight" not in frozen:
        grads["mlp.2.weight"] = mm(d_h2.t(), h1)
    d_h1 = mm(d_h2, w["mlp.2.weight"]).mul_(h1 > 0)
    del d_h2, h1
    grads["mlp.0.bias"] = d_h1.sum(0)
    if "mlp.0.weight" not in frozen:
        grads["mlp.0.weight"] = mm(d_h1.t(), s)
    del s
    d_s = mm(d_h1, w["mlp.0.weight"])
    del d_h1

    # ---- the symmetrisation and the LayerNorm (x_hat made again: cheaper than holding it) ----
    d_xn = d_s.add_(_transpose_pairs(d_s, B, N)).mul_(0.5)
    x_hat, rstd = layer_norm_parts(rows, module.layer_norm.eps)
    grads["layer_norm.weight"] = torch.linalg.vecdot(d_xn.t(), x_hat.t())
    grads["layer_norm.bias"] = d_xn.sum(0)
    grads["input"] = layer_norm_backward(d_xn.mul_(w["layer_norm.weight"]), x_hat, rstd).view(B, N, N, P)
    return grads
