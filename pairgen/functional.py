"""`pairgen.triangle_multiplicative_update`: the triangle update as a function, with the arguments
of cuEquivariance's function of that name, so a model that calls it can call pairgen by changing
the import.

Its form is the one AlphaFold 3, Boltz and Protenix use: LayerNorm, then fused input projections
`p_in` and `g_in` of width 2H (the first H channels are a, the last H are b), a = p·sigmoid(g)·mask,
the triangle sums, LayerNorm, `p_out`, and the output gated by `g_out` of the normalised input.
That is `TriangleMultiplication(P, H, direction, gate_on="normalized")` with proj_a = p_in[:H],
proj_b = p_in[H:], gate_a = g_in[:H], gate_b = g_in[H:], out_proj = p_out, out_gate = g_out.

How a call runs:
- without gradients (inference), on a module built once per set of weights and kept (up to
  MAX_MODULES): its parameters share the caller's weight tensors' memory (no copy); a weight
  updated in place (its version moves) or replaced builds a fresh one. CUDA input runs the tuned
  kernels, CPU input the reference.
- with gradients wanted (an input or a weight requires grad, grad mode on): the reference
  computation in PyTorch on the caller's tensors, so gradients reach them.
- eps other than 1e-5 (the kernels' LayerNorm epsilon): the PyTorch computation.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F

from .modules import current_autocast, graphless_gradients

#: Weight sets whose modules are kept (least recently used first out).
MAX_MODULES = 16
KERNEL_EPS = 1e-5
#: cuEquivariance's `precision` -> pairgen's for fp32 inputs (None: exact fp32, pairgen's default).
_PRECISIONS = {None: "ieee", "default": "ieee", "none": "ieee", "ieee": "ieee", "tf32x3": "tf32x3", "tf32": "tf32"}
_WEIGHT_NAMES = ("norm_in_weight", "norm_in_bias", "p_in_weight", "p_in_bias", "g_in_weight", "g_in_bias",
                 "norm_out_weight", "norm_out_bias", "p_out_weight", "p_out_bias", "g_out_weight", "g_out_bias")

_modules: OrderedDict = OrderedDict()


def triangle_multiplicative_update(x: torch.Tensor, direction: str = "outgoing", mask: torch.Tensor | None = None,
                                   norm_in_weight=None, norm_in_bias=None, p_in_weight=None, p_in_bias=None,
                                   g_in_weight=None, g_in_bias=None, norm_out_weight=None, norm_out_bias=None,
                                   p_out_weight=None, p_out_bias=None, g_out_weight=None, g_out_bias=None,
                                   eps: float = 1e-5, precision: str | None = None) -> torch.Tensor:
    """x: (B, N, N, P) or (N, N, P); mask: (B, N, N) or (N, N), bool, integer or float, or None (every
    pair kept); p_in_weight, g_in_weight: (2H, P); p_out_weight: (P, H); g_out_weight: (P, P);
    LayerNorm weights default to ones and biases to zeros; the Linear biases are optional.
    precision: None (exact fp32 for fp32 input), "ieee", "tf32x3" or "tf32" (pairgen's precisions;
    bf16/fp16 inputs compute in their own dtype). Returns the update, shaped like x."""
    weights = dict(zip(_WEIGHT_NAMES, (norm_in_weight, norm_in_bias, p_in_weight, p_in_bias, g_in_weight, g_in_bias,
                                       norm_out_weight, norm_out_bias, p_out_weight, p_out_bias, g_out_weight,
                                       g_out_bias)))
    _check(x, direction, mask, weights, precision)
    batched = x.dim() == 4
    if not batched:
        x = x.unsqueeze(0)
        mask = mask.unsqueeze(0) if mask is not None else None
    weights = _complete(weights, x)
    tensors = [x, *(w for w in weights.values() if w is not None)] + ([mask] if mask is not None else [])
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    # The PyTorch path for gradients where the closed form does not apply: a floating mask that
    # wants one, and under torch.compile (it traces the definition; the autograd.Function below
    # would have it trace a Python backward).
    if eps != KERNEL_EPS or (wants_grad and ((mask is not None and mask.requires_grad)
                                             or torch.compiler.is_compiling())):
        out = reference(x, direction, mask, weights, eps)
    else:
        if mask is None:
            mask = torch.ones(x.shape[:3], dtype=torch.bool, device=x.device)
        module = _module_for(weights, direction, _PRECISIONS[precision], x)
        if wants_grad:  # the closed form, its gradients mapped onto the caller's tensors
            names = [n for n, w in weights.items() if w is not None]
            out = _ClosedFormForCaller.apply(module, names, current_autocast(), x, mask, *(weights[n] for n in names))
        else:
            out = module(x, mask)
    return out if batched else out.squeeze(0)


class _ClosedFormForCaller(torch.autograd.Function):
    """A call with gradients wanted, through the module whose parameters are views of the
    caller's weights: as the module trains (KernelModule's SavedClosedForm), the forward computed
    the closed form's way with its intermediates kept for the backward; or, with the module's
    recompute_for_backward, its kernel forward without autograd and a backward that recomputes
    them (pairgen/ops/trimul/backward.py). The gradients are mapped back onto the caller's tensors
    in their fused layout (af3_gradients)."""

    @staticmethod
    def forward(ctx, module, names, autocast, x, mask, *weights):
        ctx.module, ctx.names, ctx.autocast, ctx.saved = module, names, autocast, None
        if module._saves_for_backward([x, mask]):
            params = {path: p.detach() for path, p in module.named_parameters()}
            out, ctx.saved = module.closed_form_forward((x, mask), params)
            return out
        ctx.save_for_backward(x, mask)
        return module(x, mask)

    @staticmethod
    def backward(ctx, grad_out):
        module = ctx.module
        with torch.no_grad():
            if ctx.saved is not None:
                by_name = module.saved_gradients(module, ctx.saved, grad_out.detach())  # parameter paths and "input"
            else:
                x, mask = ctx.saved_tensors
                named = list(module.named_parameters())
                grads = module.analytic_gradients([x, mask], [p.detach() for _, p in named], grad_out.detach(),
                                                  autocast=ctx.autocast)
                by_name = {"input": grads[0], **{path: g for (path, _), g in zip(named, grads[2:])}}
        caller = af3_gradients(by_name, ctx.names)
        wanted = ctx.needs_input_grad[5:]
        grads = [by_name["input"] if ctx.needs_input_grad[3] else None,
                 *(caller[name] if want else None for name, want in zip(ctx.names, wanted))]
        grad_x, *weights = graphless_gradients(grad_out, grads)
        return (None, None, None, grad_x, None, *weights)


def af3_gradients(grads: dict, names: list[str]) -> dict:
    """The gradients of the caller's AlphaFold 3-layout weights `names` from those of the
    TriangleMultiplication's parameters (dotted paths) that af3_parameters made from them: a fused
    2H-row weight's gradient is its a rows' then its b rows'."""
    fused = {"p_in": ("proj_a", "proj_b"), "g_in": ("gate_a", "gate_b")}
    single = {"norm_in": "layer_norm_in", "norm_out": "layer_norm_out", "p_out": "out_proj", "g_out": "out_gate"}
    out = {}
    for name in names:
        part, kind = name.rsplit("_", 1)
        if part in fused:
            out[name] = torch.cat([grads[f"{half}.{kind}"] for half in fused[part]])
        else:
            out[name] = grads[f"{single[part]}.{kind}"]
    return out


def reference(x, direction: str, mask, weights: dict, eps: float = 1e-5) -> torch.Tensor:
    """The definition, in PyTorch (differentiable in every tensor): the path for gradients."""
    P = x.shape[-1]
    H = weights["p_in_weight"].shape[0] // 2
    xn = F.layer_norm(x, (P,), weights["norm_in_weight"], weights["norm_in_bias"], eps)
    ab = F.linear(xn, weights["p_in_weight"], weights["p_in_bias"]) * torch.sigmoid(
        F.linear(xn, weights["g_in_weight"], weights["g_in_bias"]))
    if mask is not None:
        ab = ab * mask.unsqueeze(-1).to(ab.dtype)
    a, b = ab[..., :H], ab[..., H:]
    z = torch.einsum("bikh,bjkh->bijh", a, b) if direction == "outgoing" else torch.einsum("bkih,bkjh->bijh", a, b)
    z = F.layer_norm(z, (H,), weights["norm_out_weight"], weights["norm_out_bias"], eps)
    return F.linear(z, weights["p_out_weight"], weights["p_out_bias"]) * torch.sigmoid(
        F.linear(xn, weights["g_out_weight"], weights["g_out_bias"]))


def _check(x, direction, mask, weights: dict, precision) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() not in (3, 4) or not x.is_floating_point():
        raise ValueError("x must be a floating-point tensor of shape (B, N, N, P) or (N, N, P), got "
                         + (f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__))
    if direction not in ("outgoing", "incoming"):
        raise ValueError(f"direction must be 'outgoing' or 'incoming', got {direction!r}")
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(p for p in _PRECISIONS if p)} or None, got {precision!r} "
                         "(bf16/fp16 inputs compute in their own dtype)")
    P = x.shape[-1]
    missing = [n for n in ("p_in_weight", "g_in_weight", "p_out_weight", "g_out_weight") if weights[n] is None]
    if missing:
        raise ValueError(f"pairgen's triangle_multiplicative_update needs the projection weights; missing: {missing}")
    two_h = weights["p_in_weight"].shape[0]
    expected = {"p_in_weight": (two_h, P), "g_in_weight": (two_h, P), "p_out_weight": (P, two_h // 2),
                "g_out_weight": (P, P), "norm_in_weight": (P,), "norm_in_bias": (P,), "p_in_bias": (two_h,),
                "g_in_bias": (two_h,), "norm_out_weight": (two_h // 2,), "norm_out_bias": (two_h // 2,),
                "p_out_bias": (P,), "g_out_bias": (P,)}
    for name, shape in expected.items():
        w = weights[name]
        if w is not None and tuple(w.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} for x with P={P} and p_in_weight's 2H={two_h}, "
                             f"got {tuple(w.shape)}")
    if two_h % 2:
        raise ValueError(f"p_in_weight's rows must be 2H (a's H, then b's), got {two_h}")
    if mask is not None and tuple(mask.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"mask must have shape {tuple(x.shape[:-1])}, got {tuple(mask.shape)}")


def _complete(weights: dict, x) -> dict:
    """LayerNorm weights and biases that were not given, as the identity affine (ones, zeros)."""
    P, H = x.shape[-1], weights["p_in_weight"].shape[0] // 2
    like = weights["p_in_weight"]
    full = dict(weights)
    for name, size, fill in (("norm_in_weight", P, 1.0), ("norm_in_bias", P, 0.0), ("norm_out_weight", H, 1.0),
                             ("norm_out_bias", H, 0.0)):
        if full[name] is None:
            full[name] = torch.full((size,), fill, dtype=like.dtype, device=like.device)
    return full


def _key(weights: dict, direction: str, precision: str, x) -> tuple:
    """Identity, memory and version of every weight: an in-place update or another tensor is
    another key, so a kept module never serves stale weights."""
    parts = tuple((id(w), w.data_ptr(), _version_of(w)) if w is not None else None for w in weights.values())
    return direction, precision, x.dtype, x.device, parts


def _version_of(t: torch.Tensor) -> int:
    """The tensor's version counter; an inference tensor has none (-1: only its identity and memory
    key the kept module, so an in-place update made under inference_mode is not seen)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _module_for(weights: dict, direction: str, precision: str, x):
    key = _key(weights, direction, precision, x)
    module = _modules.get(key)
    if module is not None:
        _modules.move_to_end(key)
        return module
    module = _build(weights, direction, precision, x)
    _modules[key] = module
    while len(_modules) > MAX_MODULES:
        _modules.popitem(last=False)
    return module


def _build(weights: dict, direction: str, precision: str, x):
    """A TriangleMultiplication whose parameters are views of the caller's weights (no copy)."""
    P, H = x.shape[-1], weights["p_in_weight"].shape[0] // 2
    bias = any(weights[n] is not None for n in ("p_in_bias", "g_in_bias", "p_out_bias", "g_out_bias"))
    values = af3_parameters(weights, bias, lambda t: torch.nn.Parameter(t.detach(), requires_grad=False))
    return assign_parameters(empty_trimul(P, H, direction, bias, precision), values)


def empty_trimul(P: int, H: int, direction: str, bias: bool, precision: str = "ieee", gate_at: str = "output"):
    """A TriangleMultiplication (gate on the normalised input) with no storage: every parameter is
    assigned next (assign_parameters), so nothing is initialised at random."""
    from .ops.trimul import TriangleMultiplication

    with torch.device("meta"):
        return TriangleMultiplication(P, H, direction=direction, gate_on="normalized", bias=bias, precision=precision,
                                      gate_at=gate_at)


def assign_parameters(module: torch.nn.Module, values: dict) -> torch.nn.Module:
    """Parameters by dotted path; a Parameter is taken as it is (shared), a tensor is wrapped."""
    for path, value in values.items():
        sub, name = path.rsplit(".", 1)
        param = value if isinstance(value, torch.nn.Parameter) else torch.nn.Parameter(value, requires_grad=True)
        setattr(module.get_submodule(sub), name, param)
    return module


def af3_parameters(w: dict, bias: bool, take) -> dict:
    """A TriangleMultiplication's parameters (dotted paths) from the AlphaFold 3 / cuEquivariance
    layout `w` (norm_in_weight, norm_in_bias, p_in_weight with 2H rows: a's, then b's, p_in_bias,
    g_in_*, norm_out_*, p_out_*, g_out_*), each through take(tensor) -> Parameter (a copy, or a
    view that shares memory). With bias, a bias left out while others are given is zeros."""
    H = w["p_in_weight"].shape[0] // 2
    like = w["p_in_weight"]

    def bias_of(name: str, rows=slice(None)):
        t = w[name]
        if t is None:
            t = torch.zeros(w[name.replace("_bias", "_weight")].shape[0], dtype=like.dtype, device=like.device)
        return t[rows]

    values = {"layer_norm_in.weight": w["norm_in_weight"], "layer_norm_in.bias": w["norm_in_bias"],
              "layer_norm_out.weight": w["norm_out_weight"], "layer_norm_out.bias": w["norm_out_bias"],
              "out_proj.weight": w["p_out_weight"], "out_gate.weight": w["g_out_weight"]}
    for half, rows in (("a", slice(0, H)), ("b", slice(H, 2 * H))):
        values[f"proj_{half}.weight"] = w["p_in_weight"][rows]
        values[f"gate_{half}.weight"] = w["g_in_weight"][rows]
        if bias:
            values[f"proj_{half}.bias"] = bias_of("p_in_bias", rows)
            values[f"gate_{half}.bias"] = bias_of("g_in_bias", rows)
    if bias:
        values["out_proj.bias"], values["out_gate.bias"] = bias_of("p_out_bias"), bias_of("g_out_bias")
    return {path: take(t) for path, t in values.items()}
