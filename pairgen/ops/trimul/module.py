"""The triangle update's drop-in module: validation, packed weights, the strategies' runners."""
from __future__ import annotations

import torch

from ...module.dispatch import Routing
from ...module.kernel_module import KernelModule, TensorCorePrecisions
from ...module.modes import cublas_fp32_mode, fp32_matmul
from ...module.validation import as_mask, check_float_tensor, check_mask, contiguous_aligned
from ...module.weights import PackedParameters
from ...precision import HALF_DTYPES, OPERAND_DTYPES, OUTPUT_DTYPES
from ... import fastcall
from . import backward, given_weights
from .reference import TriangleMultiplicationReference
from .spec import BMM, FUSED, MMA, TRIMUL, WGMMA, k_padded, mma_weight_offsets, weight_offsets, wgmma_weight_offsets

_FOUR = ("proj_a", "gate_a", "proj_b", "gate_b")


def triangle_operands(ar: torch.Tensor, br: torch.Tensor, outgoing: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The triangle sums as one batched product left @ right on the (B*H, N, N) layout
    ar[(b*H + h), r, c] = a[b, r, c, h]: incoming out[i, j] = sum_k a[k, i] b[k, j] = (arᵀ·br)[i, j];
    outgoing sum_k a[i, k] b[j, k] = (ar·brᵀ)[i, j]. The transposed views reach cuBLAS as flags,
    not copies."""
    return (ar, br.transpose(1, 2)) if outgoing else (ar.transpose(1, 2), br)


def triangle_bmm(ar: torch.Tensor, br: torch.Tensor, outgoing: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """The triangle sums (triangle_operands' product)."""
    return torch.bmm(*triangle_operands(ar, br, outgoing), out=out)


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


#: Strategy -> (parameters by state_dict name, the module's widths, operand dtype) -> packed bytes.
TENSOR_CORE_PACKERS = {
    MMA.name: lambda params, w, dtype: pack_mma_weights(params, w["P"], w["H"], bool(w["bias"]), dtype),
    WGMMA.name: lambda params, w, dtype: pack_wgmma_weights(params, w["P"], w["H"], bool(w["bias"]),
                                                            bool(w["gate_normalized"]), dtype,
                                                            bool(w.get("gate_hidden"))),
}


def run_mma(module: "TriangleMultiplication", variant, x, mask, out) -> None:
    """Projection kernel (tensor cores) -> cuBLAS bmm in the same precision -> output kernel; the
    mma and wgmma strategies alike, each with its own packed weights.
    tf32x3's a and b hold three blocks each along the contracted index (mma.cu.j2), so one TF32
    GEMM over 3N sums hi·hi + hi·lo + lo·hi."""
    B, N = x.shape[0], x.shape[1]
    H, precision = module.widths["H"], variant.plan.precision
    project, output = variant.launches(x.get_device(), B, N)
    copies = 3 if precision == "tf32x3" else 1
    ab = torch.empty((2, B * H, copies * N * N), device=x.device, dtype=OPERAND_DTYPES[precision])
    fastcall.note_scratch(ab)
    given = module.__dict__.get("_given_pack")  # weights packed for this call (run_with_packed_weights)
    w_ptr = (given if given is not None else module._tensor_core_weights(variant.plan.strategy, precision).get()).data_ptr()
    if x.dtype is not ab.dtype:
        x = x.to(ab.dtype)  # an fp32 input under autocast: the kernels read x in the operand type
    x_ptr = x.data_ptr()
    project.named(x=x_ptr, mask=mask.data_ptr(), w=w_ptr, ar=ab[0].data_ptr(), br=ab[1].data_ptr(),
                  mask_is_float=int(mask.dtype is torch.float32))
    shape = (B * H, N, copies * N) if module._outgoing else (B * H, copies * N, N)
    ar, br = ab[0].view(shape), ab[1].view(shape)
    if precision in HALF_DTYPES:  # fp32 accumulation, output in the operands' dtype
        z = torch.empty((B * H, N, N), device=x.device, dtype=ab.dtype)
        fastcall.note_scratch(z)
        left, right = triangle_operands(ar, br, module._outgoing)
        torch.bmm(left, right, out=z)
        fastcall.note_product(left, right, z)  # a replay runs it between the two kernels
    else:
        with cublas_fp32_mode(tf32=True):
            z = triangle_bmm(ar, br, module._outgoing)
    output.named(x=x_ptr, z=z.data_ptr(), w=w_ptr, out=out.data_ptr())


def run_bmm(module: "TriangleMultiplication", variant, x, mask, out) -> None:
    """Projection kernel -> cuBLAS bmm (fp32: no TF32 even where the caller allowed it) -> output kernel."""
    B, N = x.shape[0], x.shape[1]
    project, output = variant.launches(x.get_device(), B, N)
    # One allocation for a, b and their product, from torch's stream-aware caching allocator (so a
    # captured CUDA graph never points at memory a later, larger call freed).
    ar, br, z = torch.empty((3, B * module.widths["H"], N, N), device=x.device, dtype=torch.float32).unbind(0)
    x_ptr, w_ptr = x.data_ptr(), module._weights.get().data_ptr()
    project.named(x=x_ptr, mask=mask.data_ptr(), w=w_ptr, ar=ar.data_ptr(), br=br.data_ptr(),
                  mask_is_float=int(mask.dtype is torch.float32))
    with fp32_matmul():
        triangle_bmm(ar, br, module._outgoing, out=z)
    output.named(x=x_ptr, z=z.data_ptr(), w=w_ptr, out=out.data_ptr())


def run_fused(module: "TriangleMultiplication", variant, x, mask, out) -> None:
    """One cooperative kernel; its grid barrier's two ints are held by the module."""
    B, N = x.shape[0], x.shape[1]
    (fused,) = variant.launches(x.get_device(), B, N)
    ab = torch.empty((2, B * module.widths["H"] * N * N), device=x.device, dtype=torch.float32)
    fastcall.note_scratch(ab)
    fused.named(x=x.data_ptr(), mask=mask.data_ptr(), w=module._weights.get().data_ptr(), ar=ab[0].data_ptr(),
                br=ab[1].data_ptr(), barrier=module._barrier_ints(x.device), out=out.data_ptr(),
                mask_is_float=int(mask.dtype is torch.float32))


_PARAM_ORDER = ("layer_norm_in", "proj_a", "gate_a", "proj_b", "gate_b", "layer_norm_out", "out_proj", "out_gate")


class TriangleMultiplication(TensorCorePrecisions, KernelModule, TriangleMultiplicationReference):
    """Drop-in for TriangleMultiplicationReference: same constructor, submodules and state_dict.

    CUDA input runs the tuned kernels: float32 in `precision` ("ieee", the default: exact fp32 on
    FMA units; "tf32x3": fp32-accurate on tensor cores; "tf32": TF32-accurate, for callers who
    opted into TF32), bfloat16 and float16 on tensor cores with fp32 accumulation and fp32
    LayerNorm statistics, and float32 under torch.autocast("cuda") in the autocast dtype (the
    weights cast once per parameter version). CPU input and other dtypes run the reference.
    Scratch for a and b comes from torch's stream-aware caching allocator on every call. The fused
    strategy's grid-barrier ints are owned by the module and left zeroed by every launch: two
    launches of the SAME module on different streams at once would share them.
    """

    op = TRIMUL
    runners = {BMM.name: run_bmm, FUSED.name: run_fused, MMA.name: run_mma, WGMMA.name: run_mma}
    fast_call_strategies = frozenset({FUSED.name})
    # The tensor-core strategies run a cuBLAS product between their kernels: replayed (noted) in
    # 16 bits; in fp32 its TF32 mode is set around it, which a replay does not do.
    fast_call_16_bit_strategies = frozenset({MMA.name, WGMMA.name})

    def __init__(self, pair_dim: int, hidden_dim: int, direction: str = "incoming", gate_on: str = "input",
                 bias: bool = True, precision: str = "ieee", *, gate_at: str = "output"):
        super().__init__(pair_dim, hidden_dim, direction=direction, gate_on=gate_on, bias=bias, gate_at=gate_at)
        self.precision = precision
        self.widths = {"P": int(pair_dim), "H": int(hidden_dim), "outgoing": int(direction == "outgoing"),
                       "gate_normalized": int(gate_on == "normalized"), "bias": int(bias)}
        if gate_at == "hidden":  # only then (an optional width): the output placement's keys stay as tuned
            self.widths["gate_hidden"] = 1
        self._outgoing = direction == "outgoing"
        # Every parameter in state_dict order (no bias slots without bias), packed by pack_weights.
        paths = [(sub, name) for sub in _PARAM_ORDER for name in ("weight", "bias")
                 if getattr(self, sub)._parameters.get(name) is not None]
        self._param_names = tuple(f"{sub}.{name}" for sub, name in paths)
        self._weights = PackedParameters(self, paths, self._pack)

    #: "auto" trains a 16-bit call through the closed form from 2^17 pairs (B * N * N), with the
    #: fused backward kernels only: below, a training step is bound by the host's time to issue its
    #: kernels, and without the fused kernels PyTorch's elementwise passes make the closed form slower
    #: than the reference. Calls no kernel computes run the reference.
    routing = Routing(closed_form_16_bit_training_min_pairs=2**17, closed_form_16_bit_training_needs_fused_kernels=True)
    input_layout = (("pair_repr", "BNNP", "float"), ("pair_mask", "BNN", "mask"))

    def run_on_given_weights(self, x, mask, variant, weights: dict):
        """A validated call (mask as as_mask gives it) of a wgmma variant on `weights` in the
        AlphaFold 3 layout (given_weights.WEIGHT_NAMES) instead of the module's own parameters: they
        are packed for this call on the GPU, so no packed copy is kept and weights made anew on
        every call cost one pack launch. Recorded for replay as the module's own calls are, the
        weights being inputs of the recording (the caller tries the replay: _fast_forward(x, mask,
        *weights present))."""
        inputs = (x, mask, *(w for w in weights.values() if w is not None))

        def run():
            self.__dict__["_given_pack"] = given_weights.pack(weights, variant.plan.precision)
            try:
                return self._launch(x, mask, variant=variant)
            finally:
                del self.__dict__["_given_pack"]
        return self._launch_recorded(inputs, variant, run)

    def _tensor_core_weights(self, strategy: str, precision: str) -> PackedParameters:
        """The mma or wgmma kernels' packed weights in this precision's operand dtype, rebuilt only
        after a parameter changed (an fp32 module under autocast casts them once per parameter version)."""
        dtype = OPERAND_DTYPES[precision]
        packer, widths = TENSOR_CORE_PACKERS[strategy], self.widths
        return self._packed_for((strategy, dtype),
                                lambda params: packer(dict(zip(self._param_names, params)), widths, dtype))

    closed_form = staticmethod(backward.gradients)
    saving_forward = staticmethod(backward.forward_saving)
    saved_gradients = staticmethod(backward.gradients_from)
    input_gradients = ("input", None)

    def closed_form_applies(self, inputs: list) -> bool:
        """A floating mask that wants its own gradient recomputes the reference, and so does the
        hidden gate placement for now: its closed form is tested on the CPU only, not yet measured
        or checked on a GPU."""
        return not inputs[1].requires_grad and self.gate_at == "output"

    def backward_precision(self, x, autocast: "torch.dtype | None") -> str:
        """As every op's (KernelModule.backward_precision), but `tf32` modules with TF32 products
        (their promise is TF32's accuracy)."""
        if not autocast and x.dtype is torch.float32 and self._precision == "tf32":
            return "tf32"
        return super().backward_precision(x, autocast)

    def reference_forward(self, pair_repr, pair_mask):
        return TriangleMultiplicationReference.forward(self, pair_repr, pair_mask)

    def forward(self, pair_repr, pair_mask):
        """pair_mask: bool, integer (read as != 0) or floating point (multiplied, as the reference
        does: 0/1 keeps or drops a pair; other values scale its a and b)."""
        if self._fast_calls:  # a call like a recent one, replayed in compiled code (pairgen/fastcall.py)
            out = self._fast_forward(pair_repr, pair_mask)
            if out is not None:
                return out
        self._validate(pair_repr, pair_mask)
        return self._dispatch(pair_repr, as_mask(pair_mask))

    def _validate(self, x, mask) -> None:
        if torch.compiler.is_compiling():
            return  # traced: the operator's fake implementation takes the shapes (pairgen/library.py)
        # Conditions first, messages only on failure: this runs on every call.
        P = self.widths["P"]
        check_float_tensor("pair_repr", x, 4, self._weights.anchor())
        shape = x.shape
        if shape[1] != shape[2] or shape[3] != P:
            raise ValueError(f"pair_repr must have shape (B, N, N, {P}), got {tuple(shape)}")
        check_mask("pair_mask", mask, shape[:3], x.device)

    def uses_kernel(self, x, mask) -> bool:
        return self.kernel_precision(x, mask) is not None

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
        if variant is None:
            variant = self.variant_for(N, x.get_device(), self.kernel_precision(x, mask))
        if out is None:
            dtype = OUTPUT_DTYPES[variant.plan.precision]  # x is contiguous CUDA here
            out = torch.empty_like(x) if x.dtype is dtype else torch.empty(x.shape, device=x.device, dtype=dtype)
        if out.numel() == 0:
            return out
        self._run(variant, x, mask, out)
        return out

