"""`pairgen.adapt(module)`: a pairgen TriangleMultiplication that computes what another project's
triangle-update module computes, built from its weights.

Recognised by their parameter names (the projects' own classes, or anything laid out the same way):

| form | parameters | gate | biases | weights |
| --- | --- | --- | --- | --- |
| AlphaFold 2 / OpenFold | `linear_a_p`, `linear_a_g`, `linear_b_p`, `linear_b_g`, `linear_g`, `linear_z`, `layer_norm_in`, `layer_norm_out` | on the normalised input | as the source has them | shared: the pairgen module holds the source's own `Parameter` objects (training either trains both) |
| AlphaFold 3 / Boltz | `norm_in`, `p_in`, `g_in` (fused, 2H rows: a's H, then b's), `norm_out`, `p_out`, `g_out` | on the normalised input | as the source has them | copied: pairgen keeps a and b apart, so the fused rows are split into new tensors |

The direction comes from the source (`_outgoing`, else its class name containing "Outgoing" or
"Incoming"), or from `direction=`. The LayerNorms must use eps 1e-5 (the kernels').
"""
from __future__ import annotations

import torch
from torch import nn

_OPENFOLD = ("linear_a_p", "linear_a_g", "linear_b_p", "linear_b_g", "linear_g", "linear_z", "layer_norm_in",
             "layer_norm_out")
_AF3 = ("norm_in", "p_in", "g_in", "norm_out", "p_out", "g_out")
_KERNEL_EPS = 1e-5


def adapt(source: nn.Module, direction: str | None = None):
    """A pairgen `TriangleMultiplication` (gate on the normalised input) equal in function to
    `source`, on its device and in its dtype. Raises ValueError for a module it does not recognise."""
    if all(hasattr(source, name) for name in _OPENFOLD):
        return _from_openfold(source, direction or _direction_of(source))
    if all(hasattr(source, name) for name in _AF3):
        return _from_af3(source, direction or _direction_of(source))
    raise ValueError(f"pairgen.adapt does not recognise {type(source).__name__}: expected the parameters of the "
                     f"OpenFold form {_OPENFOLD} or of the AlphaFold 3 / Boltz form {_AF3}")


def _direction_of(source: nn.Module) -> str:
    if isinstance(getattr(source, "_outgoing", None), bool):
        return "outgoing" if source._outgoing else "incoming"
    name = type(source).__name__.lower()
    for direction in ("outgoing", "incoming"):
        if direction in name:
            return direction
    raise ValueError(f"cannot tell the direction of {type(source).__name__} (no `_outgoing`, no 'Outgoing' or "
                     "'Incoming' in its class name): pass direction='outgoing' or 'incoming'")


def _check_eps(*norms: nn.LayerNorm) -> None:
    for norm in norms:
        if abs(norm.eps - _KERNEL_EPS) > 1e-12:
            raise ValueError(f"pairgen's kernels use LayerNorm eps {_KERNEL_EPS}; the source's is {norm.eps}")


def _empty_module(P: int, H: int, direction: str, bias: bool):
    """A TriangleMultiplication with no storage (every parameter is assigned next)."""
    from .ops.trimul import TriangleMultiplication

    with torch.device("meta"):
        return TriangleMultiplication(P, H, direction=direction, gate_on="normalized", bias=bias)


def _assign(module: nn.Module, values: dict) -> nn.Module:
    """Parameters by dotted path; a Parameter is taken as it is (shared), a tensor is wrapped."""
    for path, value in values.items():
        sub, name = path.rsplit(".", 1)
        param = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=True)
        setattr(module.get_submodule(sub), name, param)
    return module


def _from_openfold(source: nn.Module, direction: str):
    s = source
    _check_eps(s.layer_norm_in, s.layer_norm_out)
    P, H = s.linear_a_p.weight.shape[1], s.linear_a_p.weight.shape[0]
    pairs = {"proj_a": s.linear_a_p, "gate_a": s.linear_a_g, "proj_b": s.linear_b_p, "gate_b": s.linear_b_g,
             "out_proj": s.linear_z, "out_gate": s.linear_g}
    biases = [linear.bias is not None for linear in pairs.values()]
    if any(biases) and not all(biases):
        raise ValueError("pairgen's module has biases on all six projections or on none; the source has them on "
                         + ", ".join(name for name, b in zip(pairs, biases) if b))
    values = {"layer_norm_in.weight": s.layer_norm_in.weight, "layer_norm_in.bias": s.layer_norm_in.bias,
              "layer_norm_out.weight": s.layer_norm_out.weight, "layer_norm_out.bias": s.layer_norm_out.bias}
    for ours, linear in pairs.items():
        values[f"{ours}.weight"] = linear.weight
        if all(biases):
            values[f"{ours}.bias"] = linear.bias
    return _assign(_empty_module(P, H, direction, all(biases)), values)


def _from_af3(source: nn.Module, direction: str):
    s = source
    _check_eps(s.norm_in, s.norm_out)
    two_h, P = s.p_in.weight.shape
    H = two_h // 2
    linears = (s.p_in, s.g_in, s.p_out, s.g_out)
    bias = any(linear.bias is not None for linear in linears)

    def copy(t, rows=slice(None)):
        return t.detach()[rows].clone()

    def bias_of(linear, rows=slice(None)):
        return copy(linear.bias, rows) if linear.bias is not None else \
            torch.zeros(linear.weight.shape[0], dtype=linear.weight.dtype, device=linear.weight.device)[rows]

    values = {"layer_norm_in.weight": copy(s.norm_in.weight), "layer_norm_in.bias": copy(s.norm_in.bias),
              "layer_norm_out.weight": copy(s.norm_out.weight), "layer_norm_out.bias": copy(s.norm_out.bias),
              "out_proj.weight": copy(s.p_out.weight), "out_gate.weight": copy(s.g_out.weight)}
    for half, rows in (("a", slice(0, H)), ("b", slice(H, two_h))):
        values[f"proj_{half}.weight"] = copy(s.p_in.weight, rows)
        values[f"gate_{half}.weight"] = copy(s.g_in.weight, rows)
        if bias:
            values[f"proj_{half}.bias"] = bias_of(s.p_in, rows)
            values[f"gate_{half}.bias"] = bias_of(s.g_in, rows)
    if bias:
        values["out_proj.bias"], values["out_gate.bias"] = bias_of(s.p_out), bias_of(s.g_out)
    return _assign(_empty_module(P, H, direction, bias), values)
