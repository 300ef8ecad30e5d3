"""The triangle update's gradients in closed form: exact fp32 (cuBLAS with TF32 off, whatever the
process allows) for fp32 modules; in a 16-bit module's dtype for 16-bit modules, and in the
autocast's dtype under a 16-bit autocast (products on 16-bit tensor cores with fp32 accumulation,
LayerNorm statistics in fp32, as PyTorch's own 16-bit backward does); TF32 products for `tf32`
modules.

A training call's forward computes the op this way and keeps the intermediates the chain rule needs
(forward_saving, then gradients_from); with the module's recompute_for_backward the forward is the
kernel, which keeps nothing, and the backward recomputes them from the input and the weights (the
input LayerNorm, the four projections and gates, the triangle sums, the output LayerNorm, the
output projection and gate: gradients). Either way each product of the backward is one large
matrix product:

  out = o * s,  o = LN_out(z) Wo^T + bo,  s = sigmoid(gate_in Wg^T + bg)
    (the hidden gate placement: out = (LN_out(z) * s) Wo^T + bo, s in hidden width)
  z[b,:,:,h] = A_h B_h^T (outgoing) or A_h^T B_h (incoming), A = pa * sigmoid(ga) * mask, B alike
  [pa ga pb gb] = LN_in(x) W4^T + b4

Layout: the triangle sums want one N x N matrix per channel ("channels first", (B, C, N*N)); the
LayerNorms, the output gate and the input's gradient want one row per pair ("channels last",
(B*N*N, C)). Products between the two let cuBLAS read one operand transposed, so the projections
land channels first and the input projections' gradient channels last without a copy; the two
copies left are z to channels last and its gradient back (none with the fused kernels, whose
output LayerNorm reads and writes across the two layouts). The LayerNorms keep their statistics
and their backward's sums in fp32 whatever the dtype; with PAIRGEN_FUSED_BACKWARD=0 they and the
other elementwise passes are PyTorch's.

Names follow the formulas: d<name> is the gradient of the loss with respect to <name>.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from .. import backward_tuning, closed_form, layer_norm_rows, row_products
from ...module.modes import as_dtype
from ...module.validation import contiguous_aligned
from ..closed_form import channel_sums, closed_form_gradients, column_sums
from ...precision import COMPUTE_DTYPES, HALF_BY_DTYPE
from . import fused_backward, input_backward, output_backward
from .strategies import wgmma

#: The four input projections, in the order their rows are stacked into W4.
_FOUR = ("proj_a", "gate_a", "proj_b", "gate_b")


def gradients(module, x: torch.Tensor, mask: torch.Tensor, params: dict[str, torch.Tensor],
              grad_out: torch.Tensor, precision: str = "ieee", frozen: frozenset = frozenset()) -> dict[str, torch.Tensor]:
    """d(loss)/d(x) as "input", and d(loss)/d(parameter) for every name of `params`
    ("layer_norm_in.weight", ..., "out_gate.bias") but the `frozen` ones (their products are
    skipped), given d(loss)/d(out) = grad_out, computed in `precision`
    (closed_form.closed_form_gradients): the intermediates recomputed from x, then the chain rule."""
    return closed_form_gradients(
        lambda x_in, w, g, mm: _backward(module, _forward(module, x_in, mask, w, mm), w, g, mm, frozen),
        x, params, grad_out, precision)


def forward_saving(module, x: torch.Tensor, mask: torch.Tensor, params: dict[str, torch.Tensor],
                   precision: str) -> tuple[torch.Tensor, closed_form.Saved]:
    """The forward computed the closed form's way, in `precision`: (out, what gradients_from()
    needs). The training path that keeps its intermediates instead of recomputing them."""
    def forward(x_in, w, mm):
        state = _forward(module, x_in, mask, w, mm, keep_operands=True)
        if state.hidden:  # o is the output: the backward does not need it
            out, state.o = state.o, None
            return out.view(x_in.shape), state
        if state.out is not None:  # the projection's own output kernel's
            out, state.out = state.out, None
            return out.view(x_in.shape), state
        if state.output_kernel:  # the backward's kernel remakes zn, o and u: the output takes o's storage
            out = _gated_output(state, state.o)
            state.o = state.u = state.zn = state.mean_out = state.rstd_out = None
            return out.view(x_in.shape), state
        return _gated_output(state, state.o.new_empty(state.o.shape)).view(x_in.shape), state
    return closed_form.forward_saving(forward, x, params, precision)


def forward_only(module, x: torch.Tensor, mask: torch.Tensor, params: dict[str, torch.Tensor],
                 precision: str, out_dtype: "torch.dtype | None" = None) -> torch.Tensor:
    """The forward computed the closed form's way, in `precision`, keeping nothing for a backward
    (fewer passes and a lower peak: the gates are not stored, each intermediate is freed once
    used, the output gate is applied in the output projection's storage). out_dtype fp32 from
    16-bit math: the output gate writes fp32 (no 16-bit output to cast); otherwise the output is in
    the computation's dtype."""
    def forward(x_in, w, mm):
        state = _forward(module, x_in, mask, w, mm, inference=True)
        if state.hidden:
            return state.o.view(x_in.shape)
        o = state.o
        wide = out_dtype is torch.float32 and o.dtype is not torch.float32
        return _gated_output(state, torch.empty(o.shape, device=o.device, dtype=out_dtype) if wide else o).view(x_in.shape)
    return closed_form.forward_only(forward, x, params, precision, cast_input=not _normalises_fp32_input(module, x, precision))


def _normalises_fp32_input(module, x: torch.Tensor, precision: str) -> bool:
    """Whether a forward-only call in 16-bit `precision` takes an fp32 x as it is: the input
    LayerNorm's kernel reads it and writes the normalised rows in 16 bits, where the whole input
    would otherwise be cast first (a pass over x as long as the LayerNorm's). Only where nothing
    else reads x (the output gate on the normalised input)."""
    return (module.gate_on == "normalized" and x.is_contiguous()
            and layer_norm_rows.reads_fp32(x, COMPUTE_DTYPES.get(precision)))


def _gated_output(f: SimpleNamespace, out: torch.Tensor) -> torch.Tensor:
    """out = sigmoid(u) * o, the output gate, into `out` (o's storage or a new tensor)."""
    if f.fused:
        return fused_backward.gated(f.o, f.u, out, f.tuning)
    return torch.mul(torch.sigmoid(f.u), f.o, out=out)


def gradients_from(module, saved: closed_form.Saved, grad_out: torch.Tensor,
                   frozen: frozenset = frozenset()) -> dict[str, torch.Tensor]:
    """gradients() from a forward_saving() state, which it consumes: one backward per forward."""
    return closed_form.gradients_from(lambda state, w, g, mm: _backward(module, state, w, g, mm, frozen), saved, grad_out)


def _channels_last(t: torch.Tensor, B: int, N: int) -> torch.Tensor:
    """(B*C, N, N) channels first -> (B*N*N, C) rows, a copy."""
    C = t.shape[0] // B
    return t.view(B, C, N * N).transpose(1, 2).reshape(B * N * N, C)


def _channels_first(t: torch.Tensor, B: int, N: int) -> torch.Tensor:
    """(B*N*N, C) rows -> (B*C, N, N) channels first, a copy."""
    C = t.shape[-1]
    return t.view(B, N * N, C).transpose(1, 2).reshape(B * C, N, N)


def _forward(module, x, mask, w, mm, keep_operands: bool = False, inference: bool = False) -> SimpleNamespace:
    """The forward's intermediates the chain rule needs, in the layouts it wants. keep_operands:
    keep A and B (two hidden-width tensors) for the backward's triangle products, where a
    backward that follows at once remakes them from the projections (a lower peak: they are not
    held through the output half). inference: no backward follows (forward_only): the
    projections, A, B and the triangle sums are dropped once used, the gates not stored."""
    B, N, _, P = x.shape
    NN = N * N
    H = w["proj_a.weight"].shape[0]
    dtype = w["proj_a.weight"].dtype  # what the closed form computes in (x may be fp32: forward_only)
    f = SimpleNamespace(B=B, N=N, P=P, H=H, NN=NN, bias="proj_a.bias" in w,
                        outgoing=module.direction == "outgoing", gate_normalized=module.gate_on == "normalized",
                        hidden=module.gate_at == "hidden")

    # ---- the input LayerNorm and the four projections, channels first: (B, 4H, N*N) ----
    f.fused = fused_backward.enabled(w["proj_a.weight"])
    f.tuning = backward_tuning.for_call(module, x, dtype)  # the fused kernels' launch shapes (tuned, or the defaults)
    f.eps_in = module.layer_norm_in.eps
    f.fused_ln_in = layer_norm_rows.applies(x, P)
    if f.fused_ln_in:  # a warp per row (PyTorch's kernel reads these short rows at a fraction of the rate)
        f.rows = x.reshape(-1, P).contiguous()
        f.xn, f.mean_in, f.rstd_in = layer_norm_rows.layer_norm(f.rows, w["layer_norm_in.weight"],
                                                                w["layer_norm_in.bias"], f.eps_in)
    else:
        f.rows = x.reshape(-1, P)
        f.xn, f.mean_in, f.rstd_in = torch.native_layer_norm(f.rows, [P], w["layer_norm_in.weight"],
                                                             w["layer_norm_in.bias"], f.eps_in)
    f.xn_cl = f.xn.view(B, NN, P)
    f.w4 = torch.cat([w[f"{name}.weight"] for name in _FOUR])  # (4H, P)
    f.b4 = torch.cat([w[f"{name}.bias"] for name in _FOUR]) if f.bias else None
    # A 16-bit training step on Hopper: A and B from the projection kernel (x read once, the
    # LayerNorm folded, the gates in its epilogue), and in the backward d_proj from its twin, which
    # recomputes the pre-activations: the four hidden-width pre-activations are never made, and A
    # and B are kept instead (two).
    f.precision = HALF_BY_DTYPE.get(dtype)  # the projection kernels compute in it
    f.projection_kernels = (not inference and f.fused and f.precision is not None
                            and wgmma.projection_kernels_apply(module, x, f.precision))
    if f.projection_kernels:
        f.x_operand = contiguous_aligned(as_dtype(x, dtype))  # the kernels read its rows in 16-byte pieces
        f.mask = contiguous_aligned(mask if mask.dtype in (torch.bool, torch.float32) else mask.to(torch.float32))
        f.proj = None
        f.packed = wgmma.pack_given(w, module.widths, f.precision)  # the backward's too
        f.projected = wgmma.run_projection_forward(module, f.x_operand, f.mask, f.precision, f.packed)
        a, b = (t.view(B * H, N, N) for t in f.projected.ab)
    else:
        f.projected = None
        if f.fused:  # bias, sigmoid and the products with the mask in one kernel (fused_backward.py)
            f.proj = mm.channels_first(f.w4, f.xn_cl).view(B, 4, H, NN)
            f.keep = mask.reshape(B, NN).to(dtype).contiguous()
        else:
            f.proj = mm.channels_first(f.w4, f.xn_cl, f.b4).view(B, 4, H, NN)
            f.proj[:, 1].sigmoid_(), f.proj[:, 3].sigmoid_()  # in place: the pre-activations are not needed again
            f.keep = mask.reshape(B, 1, NN).to(dtype)
        a, b = _operands(f, apply=True, store=not inference)
        if inference:
            f.proj = None
    f.z = mm.bmm(a, b.transpose(1, 2)) if f.outgoing else mm.bmm(a.transpose(1, 2), b)  # (B*H, N, N)
    f.operands = (a, b) if keep_operands or f.projection_kernels else None
    del a, b

    # ---- the output LayerNorm, the output projection and gate, one row per pair ----
    f.ln_out = (w["layer_norm_out.weight"], w["layer_norm_out.bias"], module.layer_norm_out.eps)
    # the kernel where it fits (and, where a backward follows, where its backward's fits too)
    f.fused_ln = f.fused and fused_backward.layer_norm_fits(H, dtype.itemsize, f.tuning, backward=not inference)
    f.gate_in = f.xn if f.gate_normalized else f.rows
    # The output side's backward in one kernel where it applies (output_backward.py): it makes zn
    # from z and recomputes o and u, so no forward with a backward to follow keeps them, and where
    # the backward follows at once (the recomputing closed form) the forward stops at z.
    out_weights = [w["out_proj.weight"], w["out_gate.weight"]]
    f.output_kernel = (not inference and not f.hidden and f.fused
                       and output_backward.applies(dtype, P, H, [f.gate_in, *out_weights]))
    f.out = f.zn = f.o = f.u = None
    projected, f.projected = f.projected, None
    if f.output_kernel and (projected is not None or not keep_operands):
        if keep_operands:  # the projection's own output kernel: the LayerNorm, both products and the gate in one pass
            f.out = wgmma.run_output_forward(projected, f.z, f.packed)
        return f
    del projected
    _output_layer_norm(f, inference)
    f.u = mm.linear(f.gate_in, w["out_gate.weight"], w.get("out_gate.bias"))  # the out gate's pre-activation
    if f.hidden:  # the gate on LN_out(z), in hidden width, before the output projection
        f.s = torch.sigmoid(f.u)
        f.u = None
        f.zg = f.zn * f.s
        f.o = mm.linear(f.zg, w["out_proj.weight"], w.get("out_proj.bias")) if keep_operands or inference else None
        return f
    f.o = mm.linear(f.zn, w["out_proj.weight"], w.get("out_proj.bias"))
    return f


def _output_layer_norm(f: SimpleNamespace, inference: bool = False) -> None:
    """zn = LN_out(z) one row per pair and its statistics, from the triangle sums f.z (B*H, N, N)
    channels first (inference: z is dropped once read)."""
    B, N, H, NN = f.B, f.N, f.H, f.NN
    if f.fused_ln:  # read channels first, written one row per pair: no transposing copy
        f.zn, f.mean_out, f.rstd_out = fused_backward.layer_norm_channels_first(f.z.view(B, H, NN), *f.ln_out,
                                                                                 f.tuning)
    else:
        f.z = _channels_last(f.z, B, N)
        f.zn, f.mean_out, f.rstd_out = torch.native_layer_norm(f.z, [H], *f.ln_out)
    if inference:
        f.z = None


def _operands(f: SimpleNamespace, apply: bool = False, store: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B as (B*H, N, N) from the projections (apply: add the bias and take the gates'
    sigmoid in place first, which the forward does once; store False: not in place, for a
    forward that keeps nothing)."""
    B, H, N = f.B, f.H, f.N
    if f.fused:
        a, b = fused_backward.gates(f.proj, f.b4, f.keep, apply, f.tuning, store)
        return a.view(B * H, N, N), b.view(B * H, N, N)
    pa, sa, pb, sb = f.proj.unbind(1)
    return torch.mul(pa, sa).mul_(f.keep).view(B * H, N, N), torch.mul(pb, sb).mul_(f.keep).view(B * H, N, N)


def _output_gate_backward(f: SimpleNamespace, w, g, grads: dict, mm, frozen) -> tuple:
    """out = o * sigmoid(u): the output projection's and gate's gradients into `grads`; returns
    (d(loss)/d(LN_out(z)), d(loss)/d(gate_in)). d_gate = d(loss)/d(u) and d_o = d(loss)/d(o) are
    made in o's and u's storage."""
    if f.fused:
        fused_backward.out_gate(f.o, f.u, g.contiguous(), f.tuning)
        d_gate, d_o = f.o, f.u
    else:
        s = f.u.sigmoid_()
        d_gate = torch.ops.aten.sigmoid_backward.grad_input(f.o.mul_(g), s, grad_input=f.o)
        d_o = s.mul_(g)
        del s
    f.o = f.u = None
    if "out_gate.weight" not in frozen:
        grads["out_gate.weight"] = mm(d_gate.t(), f.gate_in)
    if "out_proj.weight" not in frozen:
        grads["out_proj.weight"] = mm(d_o.t(), f.zn)
    if f.bias:
        grads["out_proj.bias"], grads["out_gate.bias"] = column_sums(d_o), column_sums(d_gate)
    d_gate_in = mm(d_gate, w["out_gate.weight"])  # (B*N*N, P)
    del d_gate
    f.zn = f.gate_in = None
    return mm(d_o, w["out_proj.weight"]), d_gate_in


def _output_side_backward(f: SimpleNamespace, w, g, grads: dict, mm, frozen) -> tuple:
    """The output LayerNorm's, projection's and gate's gradients into `grads` from the one kernel
    (output_backward.py) that makes zn, recomputes o and u and applies their chain rule; returns
    (d(loss)/d(z) (B*H, N, N) channels first, d(loss)/d(gate_in))."""
    B, N, H, NN = f.B, f.N, f.H, f.NN
    out = output_backward.output_side_backward(f.z.view(B, H, NN), f.gate_in, g, f.ln_out, w["out_proj.weight"],
                                               w["out_gate.weight"], w.get("out_proj.bias"), w.get("out_gate.bias"))
    f.z = None
    # each weight's gradient as (d out)^T in: both in one pass where the kernel takes them
    pairs = {name: pair for name, pair in (("out_gate.weight", (out["d_u"], f.gate_in)),
                                           ("out_proj.weight", (out["d_o"], out["zn"]))) if name not in frozen}
    if pairs and row_products.applies(list(pairs.values())):
        grads.update(zip(pairs, row_products.row_products(list(pairs.values()))))
    else:
        grads.update((name, mm(a.t(), b)) for name, (a, b) in pairs.items())
    if f.bias:
        grads["out_proj.bias"], grads["out_gate.bias"] = column_sums(out["d_o"]), column_sums(out["d_u"])
    grads["layer_norm_out.weight"], grads["layer_norm_out.bias"] = out["d_gamma"], out["d_beta"]
    f.gate_in = None
    return out["d_z"].view(B * H, N, N), out["d_gate_in"]


def _hidden_gate_backward(f: SimpleNamespace, w, g, grads: dict, mm, frozen) -> tuple:
    """out = (zn * s) Wo^T + bo, s = sigmoid(u) in hidden width: as _output_gate_backward. The
    gate's gradient d(loss)/d(u) = d_zg * zn * s (1 - s) is made in zn's storage once d_zn is out."""
    if "out_proj.weight" not in frozen:
        grads["out_proj.weight"] = mm(g.t(), f.zg)
    if f.bias:
        grads["out_proj.bias"] = column_sums(g)
    f.zg = None
    d_zg = mm(g, w["out_proj.weight"])  # (B*N*N, H)
    d_zn = torch.mul(d_zg, f.s)
    d_u = torch.ops.aten.sigmoid_backward.grad_input(d_zg.mul_(f.zn), f.s, grad_input=d_zg)
    f.zn = f.s = None
    if "out_gate.weight" not in frozen:
        grads["out_gate.weight"] = mm(d_u.t(), f.gate_in)
    if f.bias:
        grads["out_gate.bias"] = column_sums(d_u)
    f.gate_in = None
    return d_zn, mm(d_u, w["out_gate.weight"])


def _output_side_backward_in_passes(f: SimpleNamespace, w, g, grads: dict, mm, frozen) -> tuple:
    """_output_side_backward as the output gate's backward, products and the LayerNorm's backward in
    passes of their own."""
    B, N, H, NN = f.B, f.N, f.H, f.NN
    if f.hidden:
        d_zn, d_gate_in = _hidden_gate_backward(f, w, g, grads, mm, frozen)
    else:
        d_zn, d_gate_in = _output_gate_backward(f, w, g, grads, mm, frozen)
    ln_out = f.ln_out
    if f.fused_ln:  # d z straight into the channels-first layout the triangle products take
        d_z, grads["layer_norm_out.weight"], grads["layer_norm_out.bias"] = \
            fused_backward.layer_norm_channels_first_backward(d_zn, f.z.view(B, H, NN), f.mean_out, f.rstd_out,
                                                              ln_out[0], ln_out[2], f.tuning)
        d_z = d_z.view(B * H, N, N)
    else:
        d_z, grads["layer_norm_out.weight"], grads["layer_norm_out.bias"] = torch.ops.aten.native_layer_norm_backward(
            d_zn, f.z, [H], f.mean_out, f.rstd_out, *ln_out[:2], [True, True, True])
        d_z = _channels_first(d_z, B, N)
    f.z = None
    return d_z, d_gate_in


def _backward(module, f: SimpleNamespace, w, grad_out, mm, frozen) -> dict[str, torch.Tensor]:
    """The chain rule from d(loss)/d(out) back through _forward's intermediates, which it
    overwrites (the gradients take their storage)."""
    B, P, H, NN = f.B, f.P, f.H, f.NN
    grads = {}
    g = grad_out.reshape(-1, P)

    if f.output_kernel:
        d_z, d_gate_in = _output_side_backward(f, w, g, grads, mm, frozen)
    else:
        d_z, d_gate_in = _output_side_backward_in_passes(f, w, g, grads, mm, frozen)

    # ---- the triangle sums (dA_h, dB_h from dZ_h), then the gates, into proj's own storage ----
    # proj = [pa | sa | pb | sb] becomes d_proj = [d pa | d ga | d pb | d gb] in place, one of a
    # and b at a time: the peak holds one of their gradients, not both beside a new d_proj.
    a, b = f.operands or _operands(f)
    f.operands = None
    if f.outgoing:  # Z = A B^T: dA = dZ B, dB = dZ^T A
        products = ((0, lambda: mm.bmm(d_z, b)), (2, lambda: mm.bmm(d_z.transpose(1, 2), a)))
    else:           # Z = A^T B: dA = B dZ^T, dB = A dZ
        products = ((0, lambda: mm.bmm(b, d_z.transpose(1, 2))), (2, lambda: mm.bmm(a, d_z)))
    if f.projection_kernels:  # the gates' chain rule in the kernel that recomputes the projections
        d_a, d_b = (product() for _, product in products)
        d_z = a = b = products = None
        stats = layer_norm_rows.statistics(f.mean_in, f.rstd_in) if f.fused_ln_in else None  # the forward's, for x
        d_proj = wgmma.run_projection_backward(module, f.x_operand, f.mask, d_a, d_b, f.precision, f.packed, stats)
        del d_a, d_b
        f.x_operand = f.mask = f.packed = None
        return _input_side_backward(f, w, d_proj.view(B, 4 * H, NN), d_gate_in, grads, mm, frozen)
    proj, keep = f.proj, f.keep
    for slot, product in products:  # slot: the value's place in proj, its gate's is slot + 1
        if f.fused:
            fused_backward.gates_grad(product(), proj, keep, slot, f.tuning)
            continue
        d = product().view(B, H, NN).mul_(keep)  # d(loss)/d(a) (or b)
        p, sig = proj[:, slot], proj[:, slot + 1]
        p.mul_(d)                                # d * p
        d.mul_(sig)                              # d(loss)/d(p) = d * sigmoid(g)
        torch.ops.aten.sigmoid_backward.grad_input(p, sig, grad_input=sig)  # d(loss)/d(g) = d p s (1 - s)
        p.copy_(d)
        del d, p, sig
    d_z = a = b = products = None  # the products close over them: rebinding frees the tensors
    d_proj = proj.view(B, 4 * H, NN)
    f.proj = proj = None
    return _input_side_backward(f, w, d_proj, d_gate_in, grads, mm, frozen)


def _input_side_backward(f: SimpleNamespace, w, d_proj: torch.Tensor, d_gate_in: torch.Tensor, grads: dict, mm,
                         frozen) -> dict[str, torch.Tensor]:
    """The input projections' and the input LayerNorm's gradients from d_proj (B, 4H, N*N), into
    `grads` (the out gate's gradient d_gate_in joins before or after the LayerNorm)."""
    B, N, P, H = f.B, f.N, f.P, f.H
    # ---- the input projections and LayerNorm ----
    if any(f"{name}.weight" not in frozen for name in _FOUR):
        # One product for the four weights: their gradients are views of it (a custom operator's
        # are made distinct where it returns them, KernelModule.analytic_gradients).
        d_w4 = mm.summed_over_batch(d_proj, f.xn_cl)
        for name, d_w in zip(_FOUR, d_w4.split(H)):
            grads[f"{name}.weight"] = d_w
    if f.bias:
        for name, d_b in zip(_FOUR, channel_sums(d_proj).split(H)):
            grads[f"{name}.bias"] = d_b
    f.xn = f.xn_cl = None
    gamma = w["layer_norm_in.weight"]
    if input_backward.applies(P, H, f.NN, [d_proj, f.w4, f.rows, d_gate_in, gamma], [f.mean_in, f.rstd_in]):
        d_x, grads["layer_norm_in.weight"], grads["layer_norm_in.bias"] = input_backward.input_side_backward(
            d_proj, f.w4, f.rows, f.mean_in.view(-1), f.rstd_in.view(-1), gamma, d_gate_in, f.gate_normalized)
    else:  # d xn through cuBLAS, then the LayerNorm's backward
        d_x = _input_layer_norm_backward(f, w, mm.channels_last(d_proj, f.w4), d_gate_in, grads)
    grads["input"] = d_x.view(B, N, N, P)
    return grads


def _input_layer_norm_backward(f: SimpleNamespace, w, d_xn: torch.Tensor, d_gate_in: torch.Tensor,
                               grads: dict) -> torch.Tensor:
    """d(loss)/d(x) from d xn (B, N*N, P) (and the input LayerNorm's affine gradients into
    `grads`), the out gate's gradient joining before the LayerNorm (gated on xn) or after it (gated
    on x)."""
    P = f.P
    if f.fused_ln_in:
        d_x, grads["layer_norm_in.weight"], grads["layer_norm_in.bias"] = layer_norm_rows.layer_norm_backward(
            d_xn.view(-1, P), f.rows, f.mean_in, f.rstd_in, w["layer_norm_in.weight"], f.eps_in,
            add_before=d_gate_in if f.gate_normalized else None, add_after=None if f.gate_normalized else d_gate_in,
            blocks_per_sm=f.tuning["row_blocks"])
    else:
        if f.gate_normalized:
            d_xn.view(-1, P).add_(d_gate_in)
        d_x, grads["layer_norm_in.weight"], grads["layer_norm_in.bias"] = torch.ops.aten.native_layer_norm_backward(
            d_xn.view(-1, P), f.rows, [P], f.mean_in, f.rstd_in, w["layer_norm_in.weight"], w["layer_norm_in.bias"],
            [True, True, True])
        if not f.gate_normalized:
            d_x += d_gate_in
    return d_x
