"""The contact head's gradients in closed form (closed_form.closed_form_gradients): in fp32 for fp32
modules, in the dtype of 16-bit modules and of a 16-bit autocast (LayerNorm statistics in fp32).

  xn = LN(x) per pair,  s = (xn + xn^T) / 2 over (i, j),
  h1 = relu(s W1^T + b1),  h2 = relu(h1 W2^T + b2),  out = sigmoid(h2 W3^T + b3)

s is symmetric in (i, j), so h1, h2 and out are too: the MLP runs on the pairs i <= j only (about
half of them; its products are most of the time). Its backward sees each such pair once, with
d(loss)/d(out) of both (i, j) and (j, i): g_u = g_ij + g_ji (g_ii on the diagonal), and gives
d(loss)/d(s_u) back to xn_ij and xn_ji halved (whole on the diagonal, where s_ii = xn_ii).

A training call's forward computes xn, s, h1, h2 and out this way and keeps them for the backward
(forward_saving, then gradients_from); with the module's recompute_for_backward, the forward is
the kernel and the backward recomputes them from the input (gradients). Then the chain rule:
three products back through the MLP, the symmetrisation's transpose, the LayerNorm. d<name> is
the gradient of the loss with respect to <name>.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from .. import backward_tuning, closed_form
from ..closed_form import column_sums, closed_form_gradients
from . import fused_backward


def gradients(module, x: torch.Tensor, params: dict[str, torch.Tensor], grad_out: torch.Tensor,
              precision: str = "ieee", frozen: frozenset = frozenset()) -> dict[str, torch.Tensor]:
    """d(loss)/d(x) as "input", and d(loss)/d(parameter) for every name of `params`
    ("layer_norm.weight", ..., "mlp.4.bias") but the `frozen` ones' products, given
    d(loss)/d(out) = grad_out: the intermediates recomputed from x, then the chain rule."""
    return closed_form_gradients(
        lambda x32, w, g, mm: _backward(module, _forward(module, x32, w, mm, mlp_kernel=True), w, g, mm, frozen),
        x, params, grad_out, precision)


def forward_saving(module, x: torch.Tensor, params: dict[str, torch.Tensor], precision: str) -> tuple:
    """The forward computed the closed form's way: (out, what gradients_from() needs)."""
    def forward(x32, w, mm):
        f = _forward(module, x32, w, mm)
        return _to_both_rows(f.out_unique, f.pairs, f.B * f.N * f.N).view(f.B, f.N, f.N), f
    return closed_form.forward_saving(forward, x, params, precision)


def gradients_from(module, saved: closed_form.Saved, grad_out: torch.Tensor,
                   frozen: frozenset = frozenset()) -> dict[str, torch.Tensor]:
    """gradients() from a forward_saving() state, which it consumes: one backward per forward."""
    return closed_form.gradients_from(lambda f, w, g, mm: _backward(module, f, w, g, mm, frozen), saved, grad_out)


class UniquePairs(SimpleNamespace):
    """The pairs i <= j of B planes of N x N as rows of the (B*N*N, C) pair tensors: `ij` and `ji`
    (int64, the row of (i, j) and of (j, i)), `off` (1.0 where i != j, else 0.0) and `share`
    (0.5 where i != j, else 1.0: each of the two rows' part of a pair's gradient)."""


@functools.lru_cache(maxsize=8)  # a few lengths at a time (bounded: every protein has its own N)
def unique_pairs(B: int, N: int, device: torch.device) -> UniquePairs:
    i, j = torch.triu_indices(N, N, device=device)
    plane = (torch.arange(B, device=device) * (N * N)).view(B, 1)
    off = (i != j).to(torch.float32).repeat(B)
    return UniquePairs(ij=(plane + i * N + j).view(-1), ji=(plane + j * N + i).view(-1),
                       off=off, share=1.0 - 0.5 * off)


def _symmetrised_unique(xn: torch.Tensor, pairs: UniquePairs) -> torch.Tensor:
    """s_u = (xn_ij + xn_ji) / 2 for the pairs u = (i <= j), rows (pairs, C)."""
    return xn.index_select(0, pairs.ij).lerp_(xn.index_select(0, pairs.ji), 0.5)


def _to_both_rows(values: torch.Tensor, pairs: UniquePairs, rows: int) -> torch.Tensor:
    """(rows, C) with each pair's row of `values` at both (i, j) and (j, i)."""
    out = values.new_empty(rows, values.shape[1])
    return out.index_copy_(0, pairs.ij, values).index_copy_(0, pairs.ji, values)


def _relu_backward_(d: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """d * (h > 0), in place: the gradient through h = relu(.)."""
    return torch.ops.aten.threshold_backward.grad_input(d, h, 0, grad_input=d)


#: The MLP's weights as the MLP kernel takes them, in its argument order (w1, w2, b1, b2, w3, b3).
_MLP_WEIGHTS = ("mlp.0.weight", "mlp.2.weight", "mlp.0.bias", "mlp.2.bias", "mlp.4.weight", "mlp.4.bias")


def _forward(module, x, w, mm, mlp_kernel: bool = False) -> SimpleNamespace:
    """The forward's intermediates the chain rule needs. mlp_kernel: where the MLP kernel applies
    (fused_backward.mlp_applies), only the symmetrised rows; the backward then runs the MLP's
    forward and backward in one kernel (f.mlp_kernel)."""
    B, N, _, P = x.shape
    f = SimpleNamespace(B=B, N=N, P=P, eps=module.layer_norm.eps, pairs=unique_pairs(B, N, x.device))
    f.fused_ln = fused_backward.applies(x, P)
    f.tuning = backward_tuning.for_call(module, x)  # the fused kernels' launch shape (tuned, or the default)
    if f.fused_ln:  # a warp per pair, both rows read once (fused_backward.py)
        f.rows = x.reshape(-1, P).contiguous()
        f.s, f.mean, f.rstd = fused_backward.layer_norm_symmetrised(f.rows, f.pairs, w["layer_norm.weight"],
                                                                    w["layer_norm.bias"], f.eps, f.tuning)
    else:  # PyTorch's fused LayerNorm, which also gives its backward's pieces
        f.rows = x.reshape(-1, P)
        xn, f.mean, f.rstd = torch.native_layer_norm(f.rows, [P], w["layer_norm.weight"], w["layer_norm.bias"], f.eps)
        f.s = _symmetrised_unique(xn, f.pairs)
        del xn
    f.mlp_kernel = (mlp_kernel and f.fused_ln
                    and fused_backward.mlp_applies(f.s, [w[name] for name in _MLP_WEIGHTS], P, w["mlp.0.weight"].shape[0]))
    if f.mlp_kernel:
        return f
    f.h1 = mm.linear(f.s, w["mlp.0.weight"], w["mlp.0.bias"]).relu_()
    f.h2 = mm.linear(f.h1, w["mlp.2.weight"], w["mlp.2.bias"]).relu_()
    f.out_unique = torch.sigmoid(mm.linear(f.h2, w["mlp.4.weight"], w["mlp.4.bias"]))  # (pairs, 1)
    return f


def _backward(module, f: SimpleNamespace, w, grad_out, mm, frozen) -> dict[str, torch.Tensor]:
    """The chain rule from d(loss)/d(out) back through _forward's intermediates, which it drops."""
    # ---- back through the MLP, once per pair i <= j ----
    if f.mlp_kernel:
        return _backward_from_mlp_kernel(f, w, grad_out, mm, frozen)
    d_y, grads = _output_layer_gradients(grad_out, f)
    f.out_unique = None
    if "mlp.4.weight" not in frozen:
        grads["mlp.4.weight"] = mm(d_y.t(), f.h2)
    d_h2 = _relu_backward_(torch.mul(d_y, w["mlp.4.weight"]), f.h2)  # the outer product d_y W3
    del d_y
    f.h2 = None
    grads["mlp.2.bias"] = column_sums(d_h2)
    if "mlp.2.weight" not in frozen:
        grads["mlp.2.weight"] = mm(d_h2.t(), f.h1)
    d_h1 = _relu_backward_(mm(d_h2, w["mlp.2.weight"]), f.h1)
    del d_h2
    f.h1 = None
    grads["mlp.0.bias"] = column_sums(d_h1)
    if "mlp.0.weight" not in frozen:
        grads["mlp.0.weight"] = mm(d_h1.t(), f.s)
    f.s = None
    d_s = mm(d_h1, w["mlp.0.weight"])
    del d_h1

    return _layer_norm_backward(f, w, d_s, grads)


def _output_layer_gradients(grad_out: torch.Tensor, f: SimpleNamespace) -> tuple:
    """(d(loss)/d(y) in the compute dtype, {"mlp.4.bias": ...}) for the pairs i <= j, y the last
    layer's argument. g_ij + g_ji and the sigmoid's backward are taken in fp32 and d_y rounded once:
    in 16 bits a pair's d_y would take two roundings of a value twice a row's, which the bias's
    gradient (a sum over every pair, with cancellations) shows (docs/performance.md, session 21)."""
    g = grad_out.reshape(-1)
    g_unique = g.index_select(0, f.pairs.ij).float().addcmul_(g.index_select(0, f.pairs.ji), f.pairs.off)
    d_y = torch.ops.aten.sigmoid_backward(g_unique.view(-1, 1), f.out_unique.float())
    return d_y.to(f.out_unique.dtype), {"mlp.4.bias": d_y.sum(0).to(f.out_unique.dtype)}


def _backward_from_mlp_kernel(f: SimpleNamespace, w, grad_out, mm, frozen) -> dict[str, torch.Tensor]:
    """_backward's chain rule with the MLP's forward and backward from one kernel
    (fused_backward.mlp_forward_backward): the weights' products and the LayerNorm's backward."""
    k = fused_backward.mlp_forward_backward(f.s, f.pairs, grad_out, *(w[name] for name in _MLP_WEIGHTS))
    grads = {"mlp.4.bias": k["d_y"].sum(0), "mlp.2.bias": column_sums(k["d_h2"]), "mlp.0.bias": column_sums(k["d_h1"])}
    for name, d_out, inputs in (("mlp.4.weight", "d_y", "h2"), ("mlp.2.weight", "d_h2", "h1"),
                                ("mlp.0.weight", "d_h1", None)):
        if name not in frozen:
            grads[name] = mm(k[d_out].t(), f.s if inputs is None else k[inputs])
    f.s = None
    return _layer_norm_backward(f, w, k["d_s"], grads)


def _layer_norm_backward(f: SimpleNamespace, w, d_s: torch.Tensor, grads: dict) -> dict[str, torch.Tensor]:
    """The symmetrisation's and the LayerNorm's backward from d(loss)/d(s), into `grads`."""
    B, N, P = f.B, f.N, f.P
    if f.fused_ln:
        d_x, grads["layer_norm.weight"], grads["layer_norm.bias"] = fused_backward.layer_norm_symmetrised_backward(
            d_s, f.rows, f.pairs, f.mean, f.rstd, w["layer_norm.weight"], f.eps, f.tuning)
    else:
        d_xn = _to_both_rows(d_s.mul_(f.pairs.share.view(-1, 1)), f.pairs, B * N * N)
        del d_s
        d_x, grads["layer_norm.weight"], grads["layer_norm.bias"] = torch.ops.aten.native_layer_norm_backward(
            d_xn, f.rows, [P], f.mean, f.rstd, w["layer_norm.weight"], w["layer_norm.bias"], [True, True, True])
    grads["input"] = d_x.view(B, N, N, P)
    return grads
