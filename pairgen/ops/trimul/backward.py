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

Layout: the triangle sums want one N x N matrix per channel ("channels first", (B, C, N*N)), while
the input, the upstream gradient and the input's gradient hold channels last ((B, N*N, C)). Every
product between the two layouts lets cuBLAS read one operand transposed, so the projections land
channels first and the input's gradient channels last without a copy; the one transposition left
is the upstream gradient's. Between the products, every elementwise pass runs over contiguous
memory, and the input LayerNorm and its backward are PyTorch's fused kernels.

Names follow the formulas: d<name> is the gradient of the loss with respect to <name>.
"""
from __future__ import annotations

import torch

from ..closed_form import channel_sums, gradients_in_fp32

#: The four input projections, in the order their rows are stacked into W4.
_FOUR = ("proj_a", "gate_a", "proj_b", "gate_b")


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
    NN = N * N
    H = w["proj_a.weight"].shape[0]
    bias = "proj_a.bias" in w
    outgoing = module.direction == "outgoing"
    gate_inputs = "normalized" if module.gate_on == "normalized" else "raw"
    grads = {}

    # ---- the input LayerNorm and the four projections, channels first: (B, 4H, N*N) ----
    rows = x.reshape(-1, P)
    xn, mean_in, rstd_in = torch.native_layer_norm(rows, [P], w["layer_norm_in.weight"], w["layer_norm_in.bias"],
                                                   module.layer_norm_in.eps)
    xn_cl = xn.view(B, NN, P)
    w4 = torch.cat([w[f"{name}.weight"] for name in _FOUR])  # (4H, P)
    b4 = torch.cat([w[f"{name}.bias"] for name in _FOUR]) if bias else None
    proj = mm.channels_first(w4, xn_cl, b4).view(B, 4, H, NN)
    pa, sa, pb, sb = proj.unbind(1)
    sa.sigmoid_(), sb.sigmoid_()  # in place: the gates' pre-activations are not needed again
    keep = mask.reshape(B, 1, NN).to(x.dtype)

    def operands():  # A and B as (B*H, N, N); made again for the backward: cheaper than holding them
        return (torch.mul(pa, sa).mul_(keep).view(B * H, N, N), torch.mul(pb, sb).mul_(keep).view(B * H, N, N))

    a, b = operands()
    z = (mm.bmm(a, b.transpose(1, 2)) if outgoing else mm.bmm(a.transpose(1, 2), b)).view(B, H, NN)
    del a, b

    # ---- the output LayerNorm over the channels (dim 1 here), the output projection and gate ----
    var, mean = torch.var_mean(z, dim=1, correction=0, keepdim=True)
    rstd_out = var.add_(module.layer_norm_out.eps).rsqrt_()
    z_hat = z.sub_(mean).mul_(rstd_out)
    del var, mean
    gamma, beta = w["layer_norm_out.weight"].view(1, H, 1), w["layer_norm_out.bias"].view(1, H, 1)
    zn = torch.addcmul(beta, z_hat, gamma)
    gate_in = xn_cl if gate_inputs == "normalized" else x.view(B, NN, P)
    s = mm.channels_first(w["out_gate.weight"], gate_in, w.get("out_gate.bias")).sigmoid_()
    o = mm.channels_first(w["out_proj.weight"], zn.transpose(1, 2), w.get("out_proj.bias"))
    g = grad_out.reshape(B, NN, P).transpose(1, 2).contiguous()  # the one transposition: (B, P, N*N)

    # ---- out = o * s: d_gate = d(loss)/d(gate pre-activation), d_o = d(loss)/d(o), in place ----
    d_gate = torch.ops.aten.sigmoid_backward.grad_input(o.mul_(g), s, grad_input=o)
    d_o = s.mul_(g)
    del g, o, s
    if "out_gate.weight" not in frozen:
        grads["out_gate.weight"] = mm.summed_over_batch(d_gate, gate_in)
    if "out_proj.weight" not in frozen:
        grads["out_proj.weight"] = mm.summed_over_batch(d_o, zn.transpose(1, 2))
    if bias:
        grads["out_proj.bias"], grads["out_gate.bias"] = channel_sums(d_o), channel_sums(d_gate)
    d_gate_in = mm.channels_last(d_gate, w["out_gate.weight"])  # (B, N*N, P)
    del d_gate, zn
    d_zn = mm.channels_first(w["out_proj.weight"].t(), d_o.transpose(1, 2))  # (B, H, N*N)
    del d_o

    # ---- the output LayerNorm's backward, over dim 1 ----
    grads["layer_norm_out.bias"] = channel_sums(d_zn)
    t = torch.mul(d_zn, z_hat)
    grads["layer_norm_out.weight"] = channel_sums(t)
    d_hat = d_zn.mul_(gamma)
    mean_d_hat_z_hat = t.mul_(gamma).mean(1, keepdim=True)
    del t
    d_z = d_hat.sub_(d_hat.mean(1, keepdim=True)).addcmul_(z_hat, mean_d_hat_z_hat, value=-1).mul_(rstd_out)
    del d_hat, z_hat, mean_d_hat_z_hat
    d_z = d_z.view(B * H, N, N)

    # ---- the triangle sums (dA_h, dB_h from dZ_h), then the gates, into proj's own storage ----
    # proj = [pa | sa | pb | sb] becomes d_proj = [d pa | d ga | d pb | d gb] in place, one of a
    # and b at a time: the peak holds one of their gradients, not both beside a new d_proj.
    a, b = operands()
    if outgoing:  # Z = A B^T: dA = dZ B, dB = dZ^T A
        products = ((lambda: mm.bmm(d_z, b), pa, sa), (lambda: mm.bmm(d_z.transpose(1, 2), a), pb, sb))
    else:         # Z = A^T B: dA = B dZ^T, dB = A dZ
        products = ((lambda: mm.bmm(b, d_z.transpose(1, 2)), pa, sa), (lambda: mm.bmm(a, d_z), pb, sb))
    for product, p, sig in products:
        d = product().view(B, H, NN).mul_(keep)   # d(loss)/d(a) (or b)
        d.mul_(sig)                               # d(loss)/d(p) = d * sigmoid(g)
        sig.neg_().add_(1).mul_(d).mul_(p)        # d(loss)/d(g) = d * p * s * (1 - s)
        p.copy_(d)
        del d
    del d_z, a, b, products, p, sig, pa, pb, sa, sb
    d_proj = proj.view(B, 4 * H, NN)

    # ---- the input projections and LayerNorm ----
    if any(f"{name}.weight" not in frozen for name in _FOUR):
        # One product for the four weights, then a copy of each (weight-sized): gradients that
        # are views of one tensor would alias each other, which custom operators may not return.
        d_w4 = mm.summed_over_batch(d_proj, xn_cl)
        for name, d_w in zip(_FOUR, d_w4.split(H)):
            grads[f"{name}.weight"] = d_w.clone()
    if bias:
        for name, d_b in zip(_FOUR, channel_sums(d_proj).split(H)):
            grads[f"{name}.bias"] = d_b.clone()
    d_xn = mm.channels_last(d_proj, w4)  # (B, N*N, P)
    del d_proj, proj, xn, xn_cl
    if gate_inputs == "normalized":
        d_xn += d_gate_in
    d_x, grads["layer_norm_in.weight"], grads["layer_norm_in.bias"] = torch.ops.aten.native_layer_norm_backward(
        d_xn.view(-1, P), rows, [P], mean_in, rstd_in, w["layer_norm_in.weight"], w["layer_norm_in.bias"],
        [True, True, True])
    if gate_inputs == "raw":
        d_x += d_gate_in.view(-1, P)
    grads["input"] = d_x.view(B, N, N, P)
    return grads
