"""The contact head's gradients in closed form, computed in fp32 (closed_form.closed_form_gradients).

  xn = LN(x) per pair,  s = (xn + xn^T) / 2 over (i, j),
  h1 = relu(s W1^T + b1),  h2 = relu(h1 W2^T + b2),  out = sigmoid(h2 W3^T + b3)

The backward recomputes xn, s, h1, h2 and out from the input and weights (nothing is kept from the
forward but the input), then applies the chain rule: three products back through the MLP, the
symmetrisation's transpose, the LayerNorm. d<name> is the gradient of the loss with respect to
<name>.
"""
from __future__ import annotations

import torch

from ..closed_form import column_sums, closed_form_gradients


def gradients(module, x: torch.Tensor, params: dict[str, torch.Tensor], grad_out: torch.Tensor,
              precision: str = "ieee", frozen: frozenset = frozenset()) -> dict[str, torch.Tensor]:
    """d(loss)/d(x) as "input", and d(loss)/d(parameter) for every name of `params`
    ("layer_norm.weight", ..., "mlp.4.bias") but the `frozen` ones' products, given
    d(loss)/d(out) = grad_out."""
    return closed_form_gradients(lambda x32, w, g, mm: _gradients(module, x32, w, g, mm, frozen), x, params, grad_out,
                             precision)


def _symmetrised(t: torch.Tensor, B: int, N: int) -> torch.Tensor:
    """(t + t^T) / 2 over the pair's (i, j), rows (B*N*N, C): one pass, into a new tensor (the
    transposed read still walks whole rows of C channels)."""
    pairs = t.view(B, N, N, t.shape[-1])
    return torch.lerp(pairs, pairs.transpose(1, 2), 0.5).view(t.shape)


def _relu_backward_(d: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """d * (h > 0), in place: the gradient through h = relu(.)."""
    return torch.ops.aten.threshold_backward.grad_input(d, h, 0, grad_input=d)


def _gradients(module, x, w, grad_out, mm, frozen):
    B, N, _, P = x.shape
    rows = x.reshape(-1, P)

    # ---- the forward again (PyTorch's fused LayerNorm, which also gives its backward's pieces) ----
    xn, mean, rstd = torch.native_layer_norm(rows, [P], w["layer_norm.weight"], w["layer_norm.bias"],
                                             module.layer_norm.eps)
    s = _symmetrised(xn, B, N)
    del xn
    h1 = mm.linear(s, w["mlp.0.weight"], w["mlp.0.bias"]).relu_()
    h2 = mm.linear(h1, w["mlp.2.weight"], w["mlp.2.bias"]).relu_()
    out = torch.sigmoid(mm.linear(h2, w["mlp.4.weight"], w["mlp.4.bias"]))  # (M, 1)

    # ---- back through the MLP ----
    d_y = torch.ops.aten.sigmoid_backward(grad_out.reshape(-1, 1), out)
    grads = {"mlp.4.bias": d_y.sum(0)}
    if "mlp.4.weight" not in frozen:
        grads["mlp.4.weight"] = mm(d_y.t(), h2)
    d_h2 = _relu_backward_(torch.mul(d_y, w["mlp.4.weight"]), h2)  # the outer product d_y W3
    del d_y, h2
    grads["mlp.2.bias"] = column_sums(d_h2)
    if "mlp.2.weight" not in frozen:
        grads["mlp.2.weight"] = mm(d_h2.t(), h1)
    d_h1 = _relu_backward_(mm(d_h2, w["mlp.2.weight"]), h1)
    del d_h2, h1
    grads["mlp.0.bias"] = column_sums(d_h1)
    if "mlp.0.weight" not in frozen:
        grads["mlp.0.weight"] = mm(d_h1.t(), s)
    del s
    d_s = mm(d_h1, w["mlp.0.weight"])
    del d_h1

    # ---- the symmetrisation and the LayerNorm ----
    d_xn = _symmetrised(d_s, B, N)
    del d_s
    d_x, grads["layer_norm.weight"], grads["layer_norm.bias"] = torch.ops.aten.native_layer_norm_backward(
        d_xn, rows, [P], mean, rstd, w["layer_norm.weight"], w["layer_norm.bias"], [True, True, True])
    grads["input"] = d_x.view(B, N, N, P)
    return grads
