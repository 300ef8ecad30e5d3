"""The triangle update's drop-in module: validation, packed weights, the strategies' runners."""
from __future__ import annotations

import torch

from ...modules import (KernelModule, PackedParameters, as_mask, check_float_tensor, check_mask, contiguous_aligned,
                        fp32_matmul)
from .reference import TriangleMultiplicationReference
from .spec import BMM, FUSED, TRIMUL, weight_offsets


def triangle_bmm(ar: torch.Tensor, br: torch.Tensor, outgoing: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """The triangle sums on the (B*H, N, N) layout ar[(b*H + h), r, c] = a[b, r, c, h]:
    incoming out[i, j] = sum_k a[k, i] b[k, j] = (arᵀ·br)[i, j]; outgoing sum_k a[i, k] b[j, k] =
    (ar·brᵀ)[i, j]. The transposed views reach cuBLAS as flags, not copies."""
    if outgoing:
        return torch.bmm(ar, br.transpose(1, 2), out=out)
    return torch.bmm(ar.transpose(1, 2), br, out=out)


def pack_weights(params: dict[str, torch.Tensor], P: int, H: int, bias: bool) -> torch.Tensor:
    """The module's parameters (state_dict names) in the kernels' layout: linear weights k-major
    (transposed), the four projections interleaved per channel: column 4h + {0,1,2,3} of Wp is
    proj_a, gate_a, proj_b, gate_b of channel h, so one thread's float4 holds all four."""
    off = weight_offsets(P, H, bias)
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


def run_bmm(module: "TriangleMultiplication", variant, x, mask, out) -> None:
    """Projection kernel -> cuBLAS bmm (fp32: no TF32 even where the caller allowed it) -> output kernel."""
    B, N = x.shape[0], x.shape[1]
    project, output = variant.launches(x.get_device(), B, N)
    # One allocation for a, b and their product, from torch's stream-aware caching allocator (so a
    # captured CUDA graph never points at memory a later, larger call freed).
    ar, br, z = torch.empty((3, B * module.widths["H"], N, N), device=x.device, dtype=torch.float32).unbind(0)
    x_ptr, w_ptr = x.data_ptr(), module._weights.get().data_ptr()
    project(x_ptr, mask.data_ptr(), w_ptr, ar.data_ptr(), br.data_ptr(), *project.tail,
            int(mask.dtype is torch.float32))
    with fp32_matmul():
        triangle_bmm(ar, br, module._outgoing, out=z)
    output(x_ptr, z.data_ptr(), w_ptr, out.data_ptr(), *output.tail)


def run_fused(module: "TriangleMultiplication", variant, x, mask, out) -> None:
    """One cooperative kernel; its grid barrier's two ints are held by the module."""
    B, N = x.shape[0], x.shape[1]
    (fused,) = variant.launches(x.get_device(), B, N)
    ab = torch.empty((2, B * module.widths["H"] * N * N), device=x.device, dtype=torch.float32)
    fused(x.data_ptr(), mask.data_ptr(), module._weights.get().data_ptr(), ab[0].data_ptr(), ab[1].data_ptr(),
          module._barrier_ints(x.device), out.data_ptr(), *fused.tail, int(mask.dtype is torch.float32))


_PARAM_ORDER = ("layer_norm_in", "proj_a", "gate_a", "proj_b", "gate_b", "layer_norm_out", "out_proj", "out_gate")


class TriangleMultiplication(KernelModule, TriangleMultiplicationReference):
    """Drop-in for TriangleMultiplicationReference: same constructor, submodules and state_dict.

    CUDA float32 input runs the tuned kernels; CPU input or other dtypes run the reference.
    Scratch for a and b comes from torch's stream-aware caching allocator on every call. The fused
    strategy's grid-barrier ints are owned by the module and left zeroed by every launch: two
    launches of the SAME module on different streams at once would share them.
    """

    op = TRIMUL
    runners = {BMM.name: run_bmm, FUSED.name: run_fused}
    _RUNTIME_STATE = KernelModule._RUNTIME_STATE + ("_barrier",)

    def __init__(self, pair_dim: int, hidden_dim: int, direction: str = "incoming", gate_on: str = "input",
                 bias: bool = True):
        super().__init__(pair_dim, hidden_dim, direction=direction, gate_on=gate_on, bias=bias)
        self.widths = {"P": int(pair_dim), "H": int(hidden_dim), "outgoing": int(direction == "outgoing"),
                       "gate_normalized": int(gate_on == "normalized"), "bias": int(bias)}
        self._outgoing = direction == "outgoing"
        self._barrier = None   # fused: (device index, the grid barrier's two ints)
        # Every parameter in state_dict order (no bias slots without bias), packed by pack_weights.
        paths = [(sub, name) for sub in _PARAM_ORDER for name in ("weight", "bias")
                 if getattr(self, sub)._parameters.get(name) is not None]
        self._param_names = tuple(f"{sub}.{name}" for sub, name in paths)
        self._weights = PackedParameters(self, paths, self._pack)

    def reference_forward(self, pair_repr, pair_mask):
        return TriangleMultiplicationReference.forward(self, pair_repr, pair_mask)

    def forward(self, pair_repr, pair_mask):
        """pair_mask: bool, integer (read as != 0) or floating point (multiplied, as the reference
        does: 0/1 keeps or drops a pair; other values scale its a and b)."""
        self._validate(pair_repr, pair_mask)
        return self._dispatch(pair_repr, as_mask(pair_mask))

    def _validate(self, x, mask) -> None:
        # Conditions first, messages only on failure: this runs on every call.
        P = self.widths["P"]
        check_float_tensor("pair_repr", x, 4, self._weights.anchor())
        shape = x.shape
        if shape[1] != shape[2] or shape[3] != P:
            raise ValueError(f"pair_repr must have shape (B, N, N, {P}), got {tuple(shape)}")
        check_mask("pair_mask", mask, shape[:3], x.device)

    def uses_kernel(self, x, mask) -> bool:
        # Pair indices are 32-bit in the kernels: B*N*N >= 2^31 runs the reference.
        return x.is_cuda and x.dtype is torch.float32 and x.shape[0] * x.shape[1] * x.shape[1] < 2**31

    def _pack(self, params: list) -> torch.Tensor:
        return pack_weights(dict(zip(self._param_names, params)), self.widths["P"], self.widths["H"],
                            bool(self.widths["bias"]))

    def packed_weights(self) -> torch.Tensor:
        """The weights in the kernels' layout (rebuilt only after a parameter changed)."""
        return self._weights.get()

    def _launch(self, pair_repr, pair_mask, out=None, variant=None):
        x = contiguous_aligned(pair_repr)
        mask = pair_mask
        if mask.dtype is not torch.bool and mask.dtype is not torch.float32:
            mask = mask.to(torch.float32)  # float16/64 masks: the reference's .to(), off the hot path
        if not mask.is_contiguous():
            mask = mask.contiguous()
        N = x.shape[1]
        if out is None:
            out = torch.empty_like(x)  # x is contiguous CUDA float32 here
        if out.numel() == 0:
            return out
        self._run(variant or self.variant_for(N, x.get_device()), x, mask, out)
        return out

    def _barrier_ints(self, device: torch.device) -> int:
        """The grid barrier's ints on this device, zeroed once: each launch leaves them zeroed."""
        index = device.index or 0
        held = self._barrier
        if held is None or held[0] != index:
            held = self._barrier = (index, torch.zeros(2, device=device, dtype=torch.int32))
        return held[1].data_ptr()
