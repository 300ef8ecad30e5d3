"""Peers scripts/bench.py times beside the triangle update: cuEquivariance's fused kernel."""
from __future__ import annotations

import torch

from ...precision import PRECISIONS


#: A float32 module's precision= -> cuEquivariance's mode for its fp32 inputs. Its 0.13 modes are
#: None/default, ieee, bfloat16, mxfp8: no 3xTF32, so tf32x3 (fp32-accurate) is compared with its
#: ieee mode, the one of the same accuracy; tf32 with its default (TF32 where PyTorch allows it).
_FP32_MODES = {p.spelling: p.cuequivariance_fp32 for p in PRECISIONS if p.module_option}


def af3_weights(m, cat) -> dict:
    """The module's weights in the AlphaFold 3 layout (fused p_in, g_in), concatenated by `cat`."""
    bias = m.widths["bias"]
    return dict(
        norm_in_weight=m.layer_norm_in.weight, norm_in_bias=m.layer_norm_in.bias,
        p_in_weight=cat(m.proj_a.weight, m.proj_b.weight), g_in_weight=cat(m.gate_a.weight, m.gate_b.weight),
        p_in_bias=cat(m.proj_a.bias, m.proj_b.bias) if bias else None,
        g_in_bias=cat(m.gate_a.bias, m.gate_b.bias) if bias else None,
        norm_out_weight=m.layer_norm_out.weight, norm_out_bias=m.layer_norm_out.bias,
        p_out_weight=m.out_proj.weight, p_out_bias=m.out_proj.bias if bias else None,
        g_out_weight=m.out_gate.weight, g_out_bias=m.out_gate.bias if bias else None)


def cat(first, second):
    return torch.cat([first, second]) if first is not None else None


def cuequivariance_peer(name: str, module, inputs: tuple, train: bool = False):
    """cuEquivariance's fused triangle update on the module's weights and inputs, in their dtype:
    a bfloat16/float16 module's in its own low-precision path (its fast one), a float32 module's in
    the mode of the module's precision= ("ieee" by default, "tf32x3", "tf32"). It gates the output on the normalised input, so it computes this
    module's function for gate_on="normalized"; for gate_on="input" it is timed as the
    nearest equivalent (same shapes and work). A string says why it cannot run here. train: its
    weights (copies of the module's, in its layouts) want gradients."""
    try:
        from cuequivariance_torch import triangle_multiplicative_update
    except Exception as exc:  # not installed, or its CUDA libraries do not load here
        return f"cuequivariance_torch is not importable ({type(exc).__name__}: {exc})"
    x, mask = inputs
    m = module
    weights = af3_weights(m, cat)
    # Its own leaves, in the fused layouts it takes (as a model built for it holds them): for
    # training, they want gradients, and no concatenation is redone per step.
    weights = {k: (v.detach().clone().requires_grad_(train) if v is not None else None) for k, v in weights.items()}
    direction = "outgoing" if m.widths["outgoing"] else "incoming"
    float_mask = mask.to(x.dtype)
    mode = {"precision": _FP32_MODES[m.precision]} if x.dtype is torch.float32 and _FP32_MODES[m.precision] else {}
    return lambda: triangle_multiplicative_update(x, direction, mask=float_mask, eps=1e-5, **mode, **weights)
