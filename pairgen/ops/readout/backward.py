"""The pair readout's gradients in closed form (closed_form.closed_form_gradients): in fp32 for fp32
modules, in the dtype of 16-bit modules and of a 16-bit autocast (LayerNorm statistics in fp32).

  pre_ij = nodes_i Wi^T + nodes_j Wj^T + pair_ij Wp^T + b1   (W1 = [Wi | Wj | Wp] by columns)
  m_ij = silu(pre_ij) W2^T + b2
  pooled_i = max over j with edge_ij of m_ij (0 for a node with no edge)
  out_i = nodes_i + LN(pooled_i)

A training call's forward computes pre, m and pooled this way and keeps them for the backward
(forward_saving, then gradients_from); with the module's recompute_for_backward, the forward is
the kernel and the backward recomputes them from the inputs (gradients). In fp32 node i's first
layer term is computed once per node and broadcast over j; in 16 bits the first layer is rounded
once, as the reference's product over the concatenated rows is (_first_layer says why and how).
Either way the backward takes the split: node i's gradient is a sum over j (node j's over i). The
max passes each channel's gradient to the partners that reach it, shared equally among ties as
torch.amax's backward does. In fp32 that gradient is a sparse
matrix (about one entry in N is nonzero), so the second layer's two gradient products read only
the winners (cuSPARSE on the GPU) instead of multiplying a pair-sized matrix of zeros on CUDA
cores; in 16 bits, which those sparse products do not take, it is a dense matrix for the tensor
cores (on the GPU the 16-bit first layer (first_layer.py, else the concatenated rows) and the max
with its gradient are fused kernels: fused_backward.py, where one more kernel takes the second
layer's input gradient through the SiLU from the winners alone, so the dense matrix feeds only the
weight gradient's product). An isolated node's pooled row is the constant 0, so its gradient stops
there (its LayerNorm affine still gets one). d<name> is the gradient of the loss with respect to <name>.
"""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from .. import closed_form
from ..closed_form import closed_form_gradients
from . import first_layer, fused_backward, pair_grad
from ...module.modes import as_dtype


def gradients(module, nodes: torch.Tensor, pair_feats: torch.Tensor, edge_mask: torch.Tensor,
              params: dict[str, torch.Tensor], grad_out: torch.Tensor, precision: str = "ieee",
              frozen: frozenset = frozenset()) -> dict[str, torch.Tensor]:
    """d(loss)/d(nodes) as "input", d(loss)/d(pair_feats) as "pair_feats", and d(loss)/d(parameter)
    for every name of `params` ("fuse.0.weight", ..., "norm.bias") but the `frozen` ones' products
    ("pair_feats" among them: no gradient for the pair features), given d(loss)/d(out): the
    intermediates recomputed from the inputs, then the chain rule."""
    def compute(n32, w, g, mm):
        return _backward(module, _forward(module, n32, pair_feats, edge_mask, w, mm), w, g, mm, frozen)
    return closed_form_gradients(compute, nodes, params, grad_out, precision)


def forward_saving(module, nodes: torch.Tensor, pair_feats: torch.Tensor, edge_mask: torch.Tensor,
                   params: dict[str, torch.Tensor], precision: str) -> tuple:
    """The forward computed the closed form's way: (out, what gradients_from() needs)."""
    def forward(n32, w, mm):
        state = _forward(module, n32, pair_feats, edge_mask, w, mm)
        out = n32 + state.normed
        state.normed = None
        return out, state
    return closed_form.forward_saving(forward, nodes, params, precision)


def gradients_from(module, saved: closed_form.Saved, grad_out: torch.Tensor,
                   frozen: frozenset = frozenset()) -> dict[str, torch.Tensor]:
    """gradients() from a forward_saving() state, which it consumes: one backward per forward."""
    return closed_form.gradients_from(lambda f, w, g, mm: _backward(module, f, w, g, mm, frozen), saved, grad_out)


def _forward(module, nodes, pair_feats, edge_mask, w, mm) -> SimpleNamespace:
    """The forward's intermediates the chain rule needs, in the dtype `nodes` comes in (the
    computation's), the LayerNorm's in fp32; the pair features' gradient goes back in their dtype."""
    B, N, D = nodes.shape
    P = pair_feats.shape[-1]
    H = w["fuse.0.weight"].shape[0]
    pair = as_dtype(pair_feats, nodes.dtype)
    f = SimpleNamespace(B=B, N=N, D=D, P=P, H=H, nodes=nodes, pair=pair, pair_dtype=pair_feats.dtype,
                        edge_mask=edge_mask)
    f.fused_max = fused_backward.applies(nodes)  # the rows and the max as pairgen's kernels
    f.pre, f.act = _first_layer(nodes, pair, w, mm, f.fused_max)
    f.edge = edge_mask.unsqueeze(-1)
    m = mm.linear(f.act.view(-1, H), w["fuse.2.weight"], w["fuse.2.bias"]).view(B, N, N, D)
    if f.fused_max:  # the max over the edges in one pass over m (fused_backward.py)
        f.m = m
        f.pooled, f.winners = fused_backward.max_pool(m, edge_mask, P)
    else:
        f.masked = m.masked_fill_(~f.edge, float("-inf"))  # masked in place: m itself is not needed again
        pooled = f.masked.amax(dim=2)            # (B, N, D)
        f.isolated = ~edge_mask.any(dim=2)
        f.pooled = pooled.masked_fill(f.isolated.unsqueeze(-1), 0.0)
    # the LayerNorm in fp32 (B x N x D: small), as PyTorch's one kernel each way
    f.pooled32 = as_dtype(f.pooled, torch.float32)
    f.norm = (as_dtype(w["norm.weight"], torch.float32), as_dtype(w["norm.bias"], torch.float32))
    f.normed, f.mean, f.rstd = torch.native_layer_norm(f.pooled32, [D], *f.norm, module.norm.eps)
    return f


def _first_layer(nodes: torch.Tensor, pair: torch.Tensor, w, mm, fused: bool) -> tuple:
    """(pre, act): the first layer's output (B, N, N, H) before and after the SiLU. In fp32 split by
    columns: each node's terms once per node, broadcast over its partners. In 16 bits rounded once,
    as the reference's one product over the concatenated rows is, where a split rounded three times
    moves which partner wins the max (measured on the CPU: an input gradient 4x as far from float64
    as the 16-bit reference's): on the GPU (fused) the split with fp32 sums in one kernel that
    writes act too (first_layer.py), else the concatenated rows (built by pairgen's kernel where
    fused_backward.first_layer_rows takes them) in one product."""
    B, N, D = nodes.shape
    P = pair.shape[-1]
    w1, b1 = w["fuse.0.weight"], w["fuse.0.bias"]
    H = w1.shape[0]
    if nodes.dtype is not torch.float32:
        if fused and first_layer.applies(nodes, pair, H):
            return first_layer.first_layer(nodes, pair, w1, b1)
        rows = fused_backward.first_layer_rows(nodes, pair) if fused else None
        if rows is None:
            rows = torch.cat([nodes.unsqueeze(2).expand(B, N, N, D), nodes.unsqueeze(1).expand(B, N, N, D), pair],
                             dim=-1)
        pre = mm.linear(rows.view(-1, 2 * D + P), w1, b1).view(B, N, N, H)
        return pre, F.silu(pre)
    u = mm(nodes, w1[:, :D].t())             # (B, N, H): node i's term
    v = mm(nodes, w1[:, D:2 * D].t())        # (B, N, H): node j's term
    pre = mm(pair.reshape(-1, P), w1[:, 2 * D:].t()).view(B, N, N, H)
    pre.add_(u.add_(b1).unsqueeze(2)).add_(v.unsqueeze(1))  # in place: no pair-sized temporary
    return pre, F.silu(pre)


def _backward(module, f: SimpleNamespace, w, grad_out, mm, frozen) -> dict[str, torch.Tensor]:
    """The chain rule from d(loss)/d(out) back through _forward's intermediates, which it drops."""
    B, N, D, P, H = f.B, f.N, f.D, f.P, f.H
    w1 = w["fuse.0.weight"]
    wi, wj, wp = w1[:, :D], w1[:, D:2 * D], w1[:, 2 * D:]

    # ---- LayerNorm and the residual ----
    g = grad_out
    grads = {}
    d_pooled, grads["norm.weight"], grads["norm.bias"] = torch.ops.aten.native_layer_norm_backward(
        as_dtype(g, torch.float32), f.pooled32, [D], f.mean, f.rstd, *f.norm, [True, True, True])  # in fp32

    # ---- the max over partners (to the winners, ties sharing), the second layer and the SiLU ----
    w2 = w["fuse.2.weight"]
    if _max_act_grad_applies(f):  # the max's gradient and the SiLU's in one kernel
        d_pre, d_u, d_m, taken = fused_backward.max_act_gradient(
            f.m, f.edge_mask, f.pooled, f.winners, d_pooled, as_dtype(w2, f.pre.dtype).contiguous(), f.pre, P)
        d_pre, d_m = d_pre.view(-1, H), _DenseMaxGradient(d_m, taken)
        f.m = f.pre = None
    else:
        d_m = _max_gradient_of(f, d_pooled)
        d_pre = None
    act_rows = f.act.view(-1, H)
    grads["fuse.2.bias"] = d_m.column_sums
    if "fuse.2.weight" not in frozen:
        grads["fuse.2.weight"] = d_m.transposed_times(act_rows, mm)
    del act_rows
    f.act = None
    if d_pre is None:
        d_pre, d_u = _pre_gradient(f, d_m, w2, mm)
    del d_m
    f.pre = None

    # ---- the first layer: pair rows, then each node's sums over its partners ----
    first_layer = "fuse.0.weight" not in frozen
    d_pre4 = d_pre.view(B, N, N, H)
    d_wp, d_v = _pair_columns_gradients(f, d_pre4, wp, grads, mm, first_layer, "pair_feats" not in frozen)
    if d_u is None:
        d_u = d_pre4.sum(dim=2)              # (B, N, H): node i over its partners j
    grads["fuse.0.bias"] = d_u.sum((0, 1))   # every pair once: node i's sums, summed
    del d_pre, d_pre4
    if first_layer:
        node_rows = f.nodes.reshape(-1, D)
        grads["fuse.0.weight"] = torch.cat([mm(d_u.reshape(-1, H).t(), node_rows),
                                            mm(d_v.reshape(-1, H).t(), node_rows), d_wp], dim=1)
    grads["input"] = g + mm(d_u, wi) + mm(d_v, wj)
    return grads


def _pair_columns_gradients(f: SimpleNamespace, d_pre4: torch.Tensor, wp: torch.Tensor, grads: dict, mm,
                            weight: bool, pair_feats: bool) -> tuple:
    """(d W_p, the first layer's pair columns' weight gradient (None unless `weight`), d_v (B, N, H),
    node j's sum of d_pre over the i that read it); the pair features' gradient d_pre W_p into
    grads where `pair_feats` (pair features that are data want none). With the fused kernels d_v
    comes with one of the products from one pass over d_pre (pair_grad.py)."""
    B, N, _, H = d_pre4.shape
    P = f.P
    d_pre = d_pre4.view(-1, H)
    d_v = None
    if pair_feats:
        if f.fused_max and pair_grad.applies(d_pre4, P):
            d_pair, d_v = pair_grad.pair_gradient(d_pre4, wp)
        else:
            d_pair = mm(d_pre, wp)
        grads["pair_feats"] = d_pair.view(B, N, N, P).to(f.pair_dtype)
    d_wp = None
    if weight:
        if d_v is None and f.fused_max and pair_grad.applies(d_pre4, P, wp=True):
            d_wp, d_v = pair_grad.weight_gradient(d_pre4, f.pair)
        else:
            d_wp = mm(d_pre.t(), f.pair.reshape(-1, P))
    return d_wp, d_pre4.sum(dim=1) if d_v is None else d_v


def _max_gradient_of(f: SimpleNamespace, d_pooled: torch.Tensor):
    """d(loss)/d(m) from d(loss)/d(pooled): the winners' shares (a sparse matrix in fp32, a dense
    one in 16 bits), which _forward's masked m (or the fused max's m) is dropped for."""
    if f.fused_max:  # an isolated node has no winner: its d_pooled goes nowhere
        d_m = _DenseMaxGradient(*fused_backward.max_pool_backward(f.m, f.edge_mask, f.pooled, f.winners, d_pooled,
                                                                  f.P))
        f.m = None
        return d_m
    d_pooled = d_pooled.masked_fill(f.isolated.unsqueeze(-1), 0.0)
    max_gradient = _max_gradient if f.act.dtype is torch.float32 else _dense_max_gradient
    d_m = max_gradient(f.masked, f.pooled, f.edge, d_pooled)
    f.masked = None
    return d_m


def _act_grad_takes(f: SimpleNamespace, d_m_dtype: torch.dtype, *dense: torch.Tensor) -> bool:
    """Whether the act_grad kernels take this fused-max closed form's backward: widths the kernel
    takes, the max's gradient in pre's dtype and the pair-sized operands contiguous."""
    return (fused_backward.act_grad_applies(f.D, f.H) and d_m_dtype is f.pre.dtype and f.pre.is_contiguous()
            and all(t.is_contiguous() for t in dense))


def _max_act_grad_applies(f: SimpleNamespace) -> bool:
    """Whether the max's gradient is made inside act_grad (fused_backward.max_act_gradient)."""
    return fused_backward.MAX_ACT_GRAD_KERNEL and f.fused_max and _act_grad_takes(f, f.m.dtype, f.m)


def _pre_gradient(f: SimpleNamespace, d_m, w2: torch.Tensor, mm) -> tuple:
    """(d(loss)/d(pre) (B*N*N, H), d_u or None): through the second layer and the SiLU. With the
    fused max's dense d_m, one kernel (fused_backward.act_gradient) adds each winner's row of W2
    and applies the SiLU's derivative in pre's storage, and sums node i's rows (d_u) on the way;
    otherwise the product d_m W2 and PyTorch's SiLU backward in its storage (d_u then None)."""
    if f.fused_max and _act_grad_takes(f, d_m.d_m.dtype, d_m.d_m):
        d_pre, d_u = fused_backward.act_gradient(d_m.d_m, as_dtype(w2, f.pre.dtype).contiguous(), f.pre, f.P)
        return d_pre.view(-1, f.H), d_u
    d_act = d_m.times(w2, mm)
    return torch.ops.aten.silu_backward.grad_input(d_act, f.pre.view(-1, f.H), grad_input=d_act), None


class _SparseMaxGradient:
    """d(loss)/d(m) of pooled = max over partners: nonzero only at each (node, channel)'s winning
    partners (one, or the ties), so about one row entry in N. Held sparse, the two products with
    it (the second layer's input gradient and its weight gradient) read only those entries, where
    dense products would multiply N times as many zeros."""

    def __init__(self, by_pair: torch.Tensor, by_channel: torch.Tensor, column_sums: torch.Tensor):
        self.by_pair, self.by_channel, self.column_sums = by_pair, by_channel, column_sums

    def times(self, weight: torch.Tensor, mm) -> torch.Tensor:
        """d_m (B*N*N, D) @ weight (D, K)."""
        return torch.sparse.mm(self.by_pair, weight)

    def transposed_times(self, rows: torch.Tensor, mm) -> torch.Tensor:
        """d_m^T (D, B*N*N) @ rows (B*N*N, K)."""
        return torch.sparse.mm(self.by_channel, rows)


class _DenseMaxGradient:
    """The same gradient as a dense (B*N*N, D) matrix, for the products in 16 bits."""

    def __init__(self, d_m: torch.Tensor, column_sums: torch.Tensor):
        self.d_m, self.column_sums = d_m, column_sums

    def times(self, weight: torch.Tensor, mm) -> torch.Tensor:
        return mm(self.d_m, weight)

    def transposed_times(self, rows: torch.Tensor, mm) -> torch.Tensor:
        return mm(self.d_m.t(), rows)


def _winners_and_shares(masked: torch.Tensor, pooled: torch.Tensor, edge: torch.Tensor,
                        d_pooled: torch.Tensor) -> tuple:
    """(winners (B, N, N, D) bool: the edges whose m equals the max, counts (B, N, D): winners per
    node and channel, share (B, N, D): each winner's part of d_pooled, ties sharing equally)."""
    winners = (masked == pooled.unsqueeze(2)) & edge
    counts = winners.sum(dim=2)
    return winners, counts, d_pooled / counts.clamp_min(1)


def _dense_max_gradient(masked: torch.Tensor, pooled: torch.Tensor, edge: torch.Tensor,
                        d_pooled: torch.Tensor) -> _DenseMaxGradient:
    """_max_gradient's result as a dense matrix in masked's dtype (each winner's share rounded to
    it); the sums over rows from the shares in fp32, as many times as each has winners."""
    winners, counts, share = _winners_and_shares(masked, pooled, edge, d_pooled)
    d_m = torch.where(winners, share.to(masked.dtype).unsqueeze(2), 0.0)
    return _DenseMaxGradient(d_m.view(-1, masked.shape[-1]), (share * counts).sum((0, 1)))


def _max_gradient(masked: torch.Tensor, pooled: torch.Tensor, edge: torch.Tensor,
                  d_pooled: torch.Tensor) -> _SparseMaxGradient:
    """masked (B, N, N, D): m with non-edges at -inf; pooled (B, N, D) its max over dim 2;
    d_pooled its gradient. Each winner (an edge whose m equals the max) gets d_pooled shared
    equally among the ties, as torch.amax's backward gives it: as CSR matrices (B*N*N, D) and
    (D, B*N*N), and the sums over rows (the second layer's bias gradient)."""
    B, N, _, D = masked.shape
    winners, _, share = _winners_and_shares(masked, pooled, edge, d_pooled)
    rows, channels = winners.view(-1, D).nonzero().unbind(1)    # row-major: sorted by pair row
    del winners
    values = share.view(-1, D)[rows // N, channels]             # row (b, i, j) belongs to node (b, i)
    M = B * N * N
    order = torch.argsort(channels, stable=True)
    with warnings.catch_warnings():  # PyTorch's once-per-process note that CSR tensors are beta
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        # built sorted and in range by construction: the invariants need no check
        by_pair = torch.sparse_csr_tensor(_row_starts(rows, M), channels, values, (M, D), check_invariants=False)
        by_channel = torch.sparse_csr_tensor(_row_starts(channels[order], D), rows[order], values[order], (D, M),
                                             check_invariants=False)
    column_sums = torch.zeros(D, dtype=values.dtype, device=values.device).index_add_(0, channels, values)
    return _SparseMaxGradient(by_pair, by_channel, column_sums)


def _row_starts(sorted_rows: torch.Tensor, count: int) -> torch.Tensor:
    """CSR row pointers (count + 1,) of sorted row indices."""
    return torch.searchsorted(sorted_rows, torch.arange(count + 1, device=sorted_rows.device, dtype=sorted_rows.dtype))
