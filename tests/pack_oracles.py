"""The weight packs as the modules made them with PyTorch before packs were made per call on the
GPU (pairgen/ops/packing.py): written independently of the Layouts, they are the oracle the
layouts and the pack kernels are checked against, byte for byte."""
from __future__ import annotations

import torch

from pairgen.ops.contact.common import weight_offsets as contact_offsets
from pairgen.ops.contact.strategies.mma import mma_weight_offsets as contact_mma_offsets
from pairgen.ops.readout.common import weight_offsets as readout_offsets
from pairgen.ops.readout.strategies.mma import mma_weight_offsets as readout_mma_offsets
from pairgen.ops.trimul.common import weight_offsets
from pairgen.ops.trimul.strategies.mma import mma_weight_offsets
from pairgen.ops.trimul.strategies.wgmma import k_padded, wgmma_weight_offsets

_FOUR = ("proj_a", "gate_a", "proj_b", "gate_b")



def pack_weights(params: dict[str, torch.Tensor], P: int, H: int, bias: bool) -> torch.Tensor:
    """The module's parameters (state_dict names) in the kernels' layout: linear weights k-major
    (transposed), the four projections interleaved per channel: column 4h + {0,1,2,3} of Wp is
    proj_a, gate_a, proj_b, gate_b of channel h, so one thread's float4 holds all four. The out
    gate's width (P, or H in the hidden placement) is read from its weight."""
    off = weight_offsets(P, H, bias, params["out_gate.weight"].shape[0])
    f = {name: p.detach().to(torch.float32) for name, p in params.items()}
    four = ("proj_a", "gate_a", "proj_b", "gate_b")
    sections = {
        "ln_in_g": f["layer_norm_in.weight"], "ln_in_b": f["layer_norm_in.bias"],
        "wp": torch.stack([f[f"{n}.weight"].t() for n in four], dim=-1),  # (P, H, 4)
        "ln_out_g": f["layer_norm_out.weight"], "ln_out_b": f["layer_norm_out.bias"],
        "wo": f["out_proj.weight"].t(), "wg": f["out_gate.weight"].t(),
    }
    if bias:
        sections.update(bp=torch.stack([f[f"{n}.bias"] for n in four], dim=-1), bo=f["out_proj.bias"],
                        bg=f["out_gate.bias"])
    device = next(iter(f.values())).device
    packed = torch.zeros(off["total"], device=device, dtype=torch.float32)
    for name, value in sections.items():
        packed[off[name]: off[name] + value.numel()] = value.reshape(-1)
    return packed


def pack_mma_weights(params: dict[str, torch.Tensor], P: int, H: int, bias: bool, dtype: torch.dtype) -> torch.Tensor:
    """The parameters in the mma kernels' layout (mma_weight_offsets), as bytes: the matrices in
    `dtype`, n-major as nn.Linear holds them (Wp's rows interleaved per channel: 4h + {0,1,2,3} =
    proj_a, gate_a, proj_b, gate_b of channel h), the LayerNorm affines and biases in fp32. A cast
    to a 16-bit dtype rounds to nearest, as autocast's own casts do."""
    off = mma_weight_offsets(P, H, bias, torch.empty(0, dtype=dtype).element_size(), params["out_gate.weight"].shape[0])
    f = {name: p.detach() for name, p in params.items()}
    matrices = {"wp": torch.stack([f[f"{n}.weight"] for n in _FOUR], dim=1).reshape(4 * H, P),
                "wo": f["out_proj.weight"], "wg": f["out_gate.weight"]}
    vectors = {"ln_in_g": f["layer_norm_in.weight"], "ln_in_b": f["layer_norm_in.bias"],
               "ln_out_g": f["layer_norm_out.weight"], "ln_out_b": f["layer_norm_out.bias"]}
    if bias:
        vectors.update(bp=torch.stack([f[f"{n}.bias"] for n in _FOUR], dim=1).reshape(-1), bo=f["out_proj.bias"],
                       bg=f["out_gate.bias"])
    device = next(iter(f.values())).device
    packed = torch.zeros(off["total"], device=device, dtype=torch.uint8)
    for name, value in [*((n, m.to(dtype)) for n, m in matrices.items()),
                        *((n, v.to(torch.float32)) for n, v in vectors.items())]:
        raw = value.contiguous().reshape(-1).view(torch.uint8)
        packed[off[name]: off[name] + raw.numel()] = raw
    return packed


def _folded(weight: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, bias, dtype: torch.dtype,
            k_pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A linear layer after a LayerNorm, as the wgmma kernels compute it: LN(x) W^T + bias =
    rstd (x (gamma o W)^T - mean c1) + c2. Returns gamma o W rounded to `dtype` with k zero-padded to
    k_pad, c1 = its row sums taken from the ROUNDED values (so that the mean's share cancels as it
    would after normalising), and c2 = W beta + bias; c1 and c2 in fp32, summed in float64."""
    w64 = weight.detach().double()
    folded = (w64 * gamma.detach().double()).to(dtype)
    c1 = folded.double().sum(dim=1)
    c2 = w64 @ beta.detach().double() + (bias.detach().double() if bias is not None else 0.0)
    padded = torch.nn.functional.pad(folded, (0, k_pad - folded.shape[1]))
    return padded, c1.float(), c2.float()


def pack_wgmma_weights(params: dict[str, torch.Tensor], P: int, H: int, bias: bool, gate_normalized: bool,
                       dtype: torch.dtype, gate_hidden: bool = False) -> torch.Tensor:
    """The parameters in the wgmma kernels' layout (wgmma_weight_offsets), as bytes: each linear
    layer folded with the LayerNorm before it (_folded): Wp (rows interleaved per channel as
    pack_mma_weights's) with layer_norm_in, Wout with layer_norm_out, Wgate with layer_norm_in when
    the gate reads the normalised input (else Wgate as it is: c1 = 0, c2 = its bias). With the
    gate in hidden width the kernel forms layer_norm_out(z) * gate itself: Wout as it is (c1 = 0,
    c2 = its bias) and layer_norm_out's affine (gz, bz)."""
    off = wgmma_weight_offsets(P, H, torch.empty(0, dtype=dtype).element_size(), gate_hidden)
    f = {name: p.detach() for name, p in params.items()}
    b = (lambda name: f[name]) if bias else (lambda name: None)
    ln_in = (f["layer_norm_in.weight"], f["layer_norm_in.bias"])
    wp = torch.stack([f[f"{n}.weight"] for n in _FOUR], dim=1).reshape(4 * H, P)
    bp = torch.stack([f[f"{n}.bias"] for n in _FOUR], dim=1).reshape(-1) if bias else None
    sections = dict(zip(("wp", "c1p", "c2p"), _folded(wp, *ln_in, bp, dtype, k_padded(P))))
    wo = f["out_proj.weight"]
    if gate_hidden:
        zero_p = torch.zeros(P, device=wo.device, dtype=torch.float32)
        sections.update(wo=torch.nn.functional.pad(wo.to(dtype), (0, k_padded(H) - H)), c1o=zero_p,
                        c2o=f["out_proj.bias"].float() if bias else zero_p,
                        gz=f["layer_norm_out.weight"].float(), bz=f["layer_norm_out.bias"].float())
    else:
        sections.update(zip(("wo", "c1o", "c2o"), _folded(wo, f["layer_norm_out.weight"], f["layer_norm_out.bias"],
                                                          b("out_proj.bias"), dtype, k_padded(H))))
    wg = f["out_gate.weight"]
    if gate_normalized:
        sections.update(zip(("wg", "c1g", "c2g"), _folded(wg, *ln_in, b("out_gate.bias"), dtype, k_padded(P))))
    else:
        zero = torch.zeros(wg.shape[0], device=wg.device, dtype=torch.float32)
        sections.update(wg=torch.nn.functional.pad(wg.to(dtype), (0, k_padded(P) - P)), c1g=zero,
                        c2g=f["out_gate.bias"].float() if bias else zero)
    packed = torch.zeros(off["total"], device=wp.device, dtype=torch.uint8)
    for name, value in sections.items():
        raw = value.contiguous().reshape(-1).view(torch.uint8)
        packed[off[name]: off[name] + raw.numel()] = raw
    return packed


def contact_mma_pack(params: list, P: int, H: int, dtype: torch.dtype) -> torch.Tensor:
    """W1, b1, W2, b2, w3, b3, gamma, beta in the mma kernel's layout (mma_weight_offsets), as bytes:
    W1, W2 n-major (nn.Linear's own layout) in `dtype` (rounded to nearest, as autocast's casts),
    the vectors in fp32."""
    w1, b1, w2, b2, w3, b3, gamma, beta = (p.detach() for p in params)
    off = contact_mma_offsets(P, H, torch.empty(0, dtype=dtype).element_size())
    packed = torch.zeros(off["total"], device=w1.device, dtype=torch.uint8)
    for name, value in (("w1", w1.to(dtype)), ("w2", w2.to(dtype)), ("b1", b1.float()), ("b2", b2.float()),
                        ("w3", w3.float()), ("b3", b3.float()), ("gamma", gamma.float()), ("beta", beta.float())):
        raw = value.contiguous().reshape(-1).view(torch.uint8)
        packed[off[name]: off[name] + raw.numel()] = raw
    return packed



def contact_fp32_pack(params: list, P: int, H: int) -> torch.Tensor:
    """W1ᵀ | b1 | W2ᵀ | b2 | w3 | b3 | gamma | beta (mlp.0, mlp.2, mlp.4, layer_norm: weight, bias each)."""
    w1, b1, w2, b2, w3, b3, gamma, beta = (p.detach().float() for p in params)
    off = contact_offsets(P, H)
    packed = torch.zeros(off["total"], device=w1.device, dtype=torch.float32)
    for name, value in (("w1t", w1.t()), ("b1", b1), ("w2t", w2.t()), ("b2", b2), ("w3", w3),
                        ("b3", b3), ("gamma", gamma), ("beta", beta)):
        packed[off[name]: off[name] + value.numel()] = value.reshape(-1)
    return packed


def readout_fp32_pack(params: list, D: int, P: int, H: int) -> torch.Tensor:
    """[W_i^T | W_j^T] | W_p^T | b1 | W2^T | b2 | gamma | beta (fuse.0, fuse.2, norm: weight, bias each)."""
    w1, b1, w2, b2, gamma, beta = (p.detach().float() for p in params)
    off = readout_offsets(D, P, H)
    wuvt = torch.cat([w1[:, :D].t(), w1[:, D:2 * D].t()], dim=1)  # [D][2H]
    packed = torch.zeros(off["total"], device=w1.device, dtype=torch.float32)
    for name, value in (("wuvt", wuvt), ("wpt", w1[:, 2 * D:].t()), ("b1", b1), ("w2t", w2.t()), ("b2", b2),
                        ("gamma", gamma), ("beta", beta)):
        packed[off[name]: off[name] + value.numel()] = value.reshape(-1)
    return packed


def readout_mma_pack(fp32_pack: torch.Tensor, params: list, D: int, P: int, H: int, dtype: torch.dtype) -> torch.Tensor:
    """The mma kernels' weights (mma_weight_offsets), as bytes: the fp32 pack (the node prologue's
    [W_i^T | W_j^T], b1, b2, gamma, beta), then W_p [H][P] and W2 [D][H], nn.Linear's own layout,
    in `dtype` (rounded to nearest, as autocast's casts)."""
    w1, w2 = params[0].detach(), params[2].detach()
    off = readout_mma_offsets(D, P, H, torch.empty(0, dtype=dtype).element_size())
    packed = torch.zeros(off["total"], device=w1.device, dtype=torch.uint8)
    packed[: 4 * fp32_pack.numel()] = fp32_pack.reshape(-1).view(torch.uint8)
    for name, value in (("wp", w1[:, 2 * D:].to(dtype)), ("w2", w2.to(dtype))):
        raw = value.contiguous().reshape(-1).view(torch.uint8)
        packed[off[name]: off[name] + raw.numel()] = raw
    return packed


def split_w2t(params: list) -> torch.Tensor:
    """W2^T split for the tf32x3 product (gemm's split_product), (3H, D): [W2hi^T; W2hi^T; W2lo^T]
    with hi = W2 rounded to TF32 (to nearest, ties away from zero, as the kernels' cvt.rna) and
    lo = W2 - hi rounded too, both exact TF32 values. [hi | lo] rows of hidden times the first 2H
    rows give hi W2hi + lo W2hi; hidden's hi half times the last H rows adds hi W2lo."""
    w2t = params[2].detach().t().contiguous().float()
    hi = tf32_rounded(w2t)
    lo = tf32_rounded(w2t - hi)
    return torch.cat([hi, hi, lo])


def tf32_rounded(x: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to TF32 (10 mantissa bits), to nearest with ties away from zero; NaN and
    infinity stay as they are."""
    bits = x.view(torch.int32)
    rounded = ((bits + 0x1000) & -0x2000).view(torch.float32)  # -0x2000: the int32 of 0xffffe000
    return torch.where(torch.isfinite(x), rounded, x)


def host_pack(module, layout) -> torch.Tensor:
    """pairgen's own pack of the module's parameters in `layout`, made with PyTorch (packing.pack_on_host)."""
    from pairgen.ops.packing import pack_on_host

    return pack_on_host(layout, list(module._slots.weights().tensors))
