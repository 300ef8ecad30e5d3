"""The triangle update's gradients in closed form, computed in fp32: exact fp32 (cuBLAS with TF32
off, whatever the process allows) for fp32 modules; TF32 products for 16-bit modules and autocast.

The forward kernels keep no intermediates, so the backward recomputes what it needs from the
input and the weights (the input LayerNorm, the four projections and gates, the triangle sums, the
output LayerNorm, the output projection and gate) and then applies the chain rule by hand. Compared
with recomputing the reference under autograd, nothing is kept between the forward and the backward
but the input and mask (the autograd graph of the reference saves about a dozen tensors of the
pair's size), and each product of the backward is one large matrix product:

  out = o * s,  o = LN_out(z) Wo^T + bo,  s = sigmoid(gate_in Wg^T + bg)
  z[b,:,:,h] = A_h B_h^T (outgoing) or A_h^T B_h (incoming), A = pa * sigmoid(ga) * mask, B alike
  [pa ga pb gb] = LN_in(x) W4^T + b4

Names follow the formulas: d<name> is the gradient of the loss with respect to <name>.
"""
from __future__ import annotations

import torch

from ..closed_form import gradients_in_fp32, layer_norm_backward, layer_norm_parts

#: The four input projections, in the order their rows are stacked into W4.
_FOUR = ("proj_a", "gate_a", "proj_b", "gate_b")


def _channels_first(t: torch.Tensor, B: int, N: int, H: int) -> torch.Tensor:
    """(B*N*N, H) -> (B*H, N, N): one N x N matrix per (batch, channel) for batched products."""
    return t.view(B, N, N, H).permute(0, 3, 1, 2).reshape(B * H, N, N)


def _channels_last(t: torch.Tensor, B: int, N: int, H: int) -> torch.Tensor:
    """(B*H, N, N) -> (B*N*N, H)."""
    return t.view(B, H, N, N).permute(0, 2, 3, 1).reshape(B * N * N, H)


def gradients(module, x: torch.Tensor, mask: torch.Tensor, params: dict[str, torch.Tensor],
              grad_out: torch.Tensor, precision: str = "ieee", frozen: frozenset = frozenset()) -> dict[str, torch.Tensor]:
    """d(loss)/d(x) as "input", and d(loss)/d(parameter) for every name of `params`
    ("layer_norm_in.weight", ..., "out_gate.bias") but the `frozen` ones (their products are
    skipped), given d(loss)/d(out) = grad_out; in fp32, the products in `precision`
    (closed_form.gradients_in_fp32)."""
    return gradients_in_fp32(lambda x32, w, g, mm: _gradients(module, x32, mask, w, g, mm, frozen), x, params,
                             grad_out, precision)


def _gradients(module, x, mask, w, grad_out, mm, frozen):
    B, N, _, P = x.shape
    H = w["proj_a.weight"].shape[0]
    bias = "proj_a.bias" in w
    outgoing = module.direction == "outgoing"
    normalized_gate = module.gate_on == "normalized"
    rows = x.reshape(-1, P)
    g = grad_out.reshape(-1, P)

    def normalized_input():  # LN_in(x): recomputed where needed rather than kept (a pair-sized tensor)
        return x_hat * w["layer_norm_in.weight"] + w["layer_norm_in.bias"]

    def channels_first_operands():  # A and B as (B*H, N, N), from proj = [pa | sa | pb | sb]
        return (_channels_first(torch.mul(pa, sa).mul_(keep), B, N, H),
                _channels_first(torch.mul(pb, sb).mul_(keep), B, N, H))

    # ---- the forward again: projections and gates, the triangle sums, the output LayerNorm ----
    x_hat, rstd_in = layer_norm_parts(rows, module.layer_norm_in.eps)
    xn = normalized_input()
    w4 = torch.cat([w[f"{name}.weight"] for name in _FOUR])  # (4H, P)
    proj = mm.linear(xn, w4, torch.cat([w[f"{name}.bias"] for name in _FOUR]) if bias else None)
    pa, ga, pb, gb = proj.split(H, dim=-1)
    sa, sb = ga.sigmoid_(), gb.sigmoid_()  # in place: the gates' pre-activations are not needed again
    keep = mask.reshape(-1, 1).to(x.dtype)
    a_cf, b_cf = channels_first_operands()
    z_cf = mm.bmm(a_cf, b_cf.transpose(1, 2)) if outgoing else mm.bmm(a_cf.transpose(1, 2), b_cf)
    del a_cf, b_cf  # made again for the backward's products: cheaper than holding them meanwhile
    z_hat, rstd_out = layer_norm_parts(_channels_last(z_cf, B, N, H), module.layer_norm_out.eps)
    del z_cf

    # ---- the output gate: s = sigmoid(gate_in Wg^T + bg), out = o * s ----
    gate_in = xn if normalized_gate else rows
    s = torch.sigmoid(mm.linear(gate_in, w["out_gate.weight"], w.get("out_gate.bias")))
    zn = z_hat * w["layer_norm_out.weight"] + w["layer_norm_out.bias"]
    d_gate = mm.linear(zn, w["out_proj.weight"], w.get("out_proj.bias"))  # o, then d(loss)/d(gate) in place
    d_gate.mul_(g).mul_(s).mul_(1 - s)
    d_o = s.mul_(g)  # d(loss)/d(o), in the storage of s
    del s
    grads = {}
    if "out_gate.weight" not in frozen:
        grads["out_gate.weight"] = mm(d_gate.t(), gate_in)
    if bias:
        grads["out_proj.bias"], grads["out_gate.bias"] = d_o.sum(0), d_gate.sum(0)
    d_gate_in = mm(d_gate, w["out_gate.weight"])
    del d_gate, gate_in, xn

    # ---- the output projection and LayerNorm ----
    if "out_proj.weight" not in frozen:
        grads["out_proj.weight"] = mm(d_o.t(), zn)
    del zn
    d_zn = mm(d_o, w["out_proj.weight"])
    del d_o
    grads["layer_norm_out.weight"] = torch.linalg.vecdot(d_zn.t(), z_hat.t())
    grads["layer_norm_out.bias"] = d_zn.sum(0)
    d_z = layer_norm_backward(d_zn.mul_(w["layer_norm_out.weight"]), z_hat, rstd_out)
    del d_zn, z_hat

    # ---- the triangle sums (dA_h, dB_h from dZ_h), then the gates, into proj's own storage ----
    # proj = [pa | sa | pb | sb] becomes d_proj = [d pa | d ga | d pb | d gb] in place, one of a
    # and b at a time: the peak holds one of their gradients, not both beside a new d_proj.
    dz_cf = _channels_first(d_z, B, N, H)
    del d_z
    a_cf, b_cf = channels_first_operands()
    if outgoing:  # Z = A B^T: dA = dZ B, dB = dZ^T A
        products = ((lambda: mm.bmm(dz_cf, b_cf), pa, sa), (lambda: mm.bmm(dz_cf.transpose(1, 2), a_cf), pb, sb))
    else:         # Z = A^T B: dA = B dZ^T, dB = A dZ
        products = ((lambda: mm.bmm(b_cf, dz_cf.transpose(1, 2)), pa, sa), (lambda: mm.bmm(a_cf, dz_cf), pb, sb))
    for product, p, sig in products:
        d = _channels_last(product(), B, N, H).mul_(keep)  # d(loss)/d(a) (or b)
        d.mul_(sig)                                        # d(loss)/d(p) = d * sigmoid(g)
        sig.neg_().add_(1).mul_(d).mul_(p)                 # d(loss)/d(g) = d * p * s * (1 - s)
        p.copy_(d)
        del d
    del dz_cf, a_cf, b_cf, products, p, sig, pa, ga, pb, gb, sa, sb
    d_proj = proj

    # ---- the input projections and LayerNorm ----
    if any(f"{name}.weight" not in frozen for name in _FOUR):
        d_w4 = mm(d_proj.t(), normalized_input())
        for k, name in enumerate(_FOUR):
            grads[f"{name}.weight"] = d_w4[k * H:(k + 1) * H]
    if bias:
        d_b4 = d_proj.sum(0)
        for k, name in enumerate(_FOUR):
            grads[f"{name}.bias"] = d_b4[k * H:(k + 1) * H]
    d_xn = mm(d_proj, w4)
    del d_proj, proj
    if normalized_gate:
        d_xn += d_gate_in
    grads["layer_norm_in.weight"] = torch.linalg.vecdot(d_xn.t(), x_hat.t())
    grads["layer_norm_in.bias"] = d_xn.sum(0)
    d_x = layer_norm_backward(d_xn.mul_(w["layer_norm_in.weight"]), x_hat, rstd_in)
    if not normalized_gate:
        d_x += d_gate_in
    grads["input"] = d_x.view(B, N, N, P)
    return grads
