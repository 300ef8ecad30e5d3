"""The pair readout's gradients in closed form, computed in fp32 (closed_form.closed_form_gradients).

  pre_ij = nodes_i Wi^T + nodes_j Wj^T + pair_ij Wp^T + b1   (W1 = [Wi | Wj | Wp] by columns)
  m_ij = silu(pre_ij) W2^T + b2
  pooled_i = max over j with edge_ij of m_ij (0 for a node with no edge)
  out_i = nodes_i + LN(pooled_i)

The backward recomputes pre, m and pooled from the inputs and weights (nothing is kept from the
forward but its inputs). The max passes each channel's gradient to the partners that reach it,
shared equally among ties as torch.amax's backward does; an isolated node's pooled row is the
constant 0, so its gradient stops there (its LayerNorm affine still gets one). Node i's first
layer term is computed once per node and broadcast over j: its gradient is a sum over j (and
node j's over i). d<name> is the gradient of the loss with respect to <name>.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..closed_form import closed_form_gradients, column_sums, layer_norm_backward, layer_norm_parts


def gradients(module, nodes: torch.Tensor, pair_feats: torch.Tensor, edge_mask: torch.Tensor,
              params: dict[str, torch.Tensor], grad_out: torch.Tensor, precision: str = "ieee",
              frozen: frozenset = frozenset()) -> dict[str, torch.Tensor]:
    """d(loss)/d(nodes) as "input", d(loss)/d(pair_feats) as "pair_feats", and d(loss)/d(parameter)
    for every name of `params` ("fuse.0.weight", ..., "norm.bias") but the `frozen` ones'
    products, given d(loss)/d(out)."""
    pair_dtype = pair_feats.dtype
    grads = closed_form_gradients(lambda n32, w, g, mm: _gradients(module, n32, pair_feats.float(), edge_mask, w, g, mm,
                                                               frozen), nodes, params, grad_out, precision)
    grads["pair_feats"] = grads["pair_feats"].to(pair_dtype)
    return grads


def _gradients(module, nodes, pair, edge_mask, w, grad_out, mm, frozen):
    B, N, D = nodes.shape
    P = pair.shape[-1]
    w1 = w["fuse.0.weight"]
    wi, wj, wp = w1[:, :D], w1[:, D:2 * D], w1[:, 2 * D:]
    H = w1.shape[0]

    # ---- the forward again ----
    u = mm(nodes, wi.t())                     # (B, N, H): node i's term
    v = mm(nodes, wj.t())                     # (B, N, H): node j's term
    pre = mm(pair.reshape(-1, P), wp.t()).view(B, N, N, H)
    pre.add_(u.add_(w["fuse.0.bias"]).unsqueeze(2)).add_(v.unsqueeze(1))  # in place: no pair-sized temporary
    act = F.silu(pre)
    edge = edge_mask.unsqueeze(-1)
    masked = mm.linear(act.view(-1, H), w["fuse.2.weight"], w["fuse.2.bias"]).view(B, N, N, D)
    masked.masked_fill_(~edge, float("-inf"))  # m, masked in place: m itself is not needed again
    pooled = masked.amax(dim=2)              # (B, N, D)
    isolated = ~edge_mask.any(dim=2)
    pooled = pooled.masked_fill(isolated.unsqueeze(-1), 0.0)
    p_hat, rstd = layer_norm_parts(pooled, module.norm.eps)

    # ---- LayerNorm and the residual ----
    g = grad_out
    grads = {"norm.weight": (g * p_hat).sum((0, 1)), "norm.bias": g.sum((0, 1))}
    d_pooled = layer_norm_backward(g * w["norm.weight"], p_hat, rstd)
    d_pooled = d_pooled.masked_fill(isolated.unsqueeze(-1), 0.0)

    # ---- the max over partners: to the winners, ties sharing ----
    winners = (masked == pooled.unsqueeze(2)) & edge
    del masked
    d_m = winners.to(pooled.dtype)
    d_m.div_(winners.sum(dim=2, keepdim=True).clamp_min(1)).mul_(d_pooled.unsqueeze(2))
    d_m = d_m.view(-1, D)
    del winners

    # ---- the second layer and the SiLU ----
    act_rows = act.view(-1, H)
    grads["fuse.2.bias"] = column_sums(d_m)
    if "fuse.2.weight" not in frozen:
        grads["fuse.2.weight"] = mm(d_m.t(), act_rows)
    d_act = mm(d_m, w["fuse.2.weight"])
    del d_m, act, act_rows
    # d_act * silu'(pre), in d_act's storage: PyTorch's fused SiLU backward, one pass
    d_pre = torch.ops.aten.silu_backward.grad_input(d_act, pre.view(-1, H), grad_input=d_act)
    del d_act, pre

    # ---- the first layer: pair rows, then each node's sums over its partners ----
    first_layer = "fuse.0.weight" not in frozen
    d_wp = mm(d_pre.t(), pair.reshape(-1, P)) if first_layer else None
    grads["pair_feats"] = mm(d_pre, wp).view(B, N, N, P)
    d_pre4 = d_pre.view(B, N, N, H)
    d_u = d_pre4.sum(dim=2)                  # (B, N, H): node i over its partners j
    d_v = d_pre4.sum(dim=1)                  # (B, N, H): node j over the i that read it
    grads["fuse.0.bias"] = d_u.sum((0, 1))   # every pair once: node i's sums, summed
    del d_pre, d_pre4
    if first_layer:
        node_rows = nodes.reshape(-1, D)
        grads["fuse.0.weight"] = torch.cat([mm(d_u.reshape(-1, H).t(), node_rows),
                                            mm(d_v.reshape(-1, H).t(), node_rows), d_wp], dim=1)
    grads["input"] = g + mm(d_u, wi) + mm(d_v, wj)
    return grads
