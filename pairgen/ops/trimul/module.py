"""The triangle update's drop-in module: validation and the strategies' runners."""
from __future__ import annotations

import torch

from ...module.dispatch import Routing
from ...module.kernel_module import PACK_SLOTS, KernelModule, TensorCorePrecisions
from ...module.modes import cublas_fp32_mode, fp32_matmul
from ...module.validation import as_mask, check_float_tensor, check_mask, contiguous_aligned
from ...module.parameters import CallWeights, ParameterSlots
from ...precision import HALF_DTYPES, OPERAND_DTYPES, OUTPUT_DTYPES
from ... import fastcall
from .. import packing
from . import backward, packs
from .reference import TriangleMultiplicationReference
from .spec import BMM, FUSED, MMA, TRIMUL, WGMMA

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


def tensor_core_pack(module: "TriangleMultiplication", plan, weights: CallWeights) -> torch.Tensor:
    """`weights` packed for this call for the mma or wgmma kernels in the plan's precision."""
    w = module.widths
    P, H, bias, hidden = w["P"], w["H"], bool(w["bias"]), bool(w.get("gate_hidden"))
    if plan.strategy == MMA.name:
        return module._packed(packs.mma_layout(P, H, bias, H if hidden else P, plan.precision, weights.sources),
                              weights)
    tensors = list(weights.tensors)
    if not packing.readable(tensors):  # mixed dtypes (an fp32 LayerNorm in a bf16 model), strided: read as fp32
        tensors = [t.detach().float().contiguous() for t in tensors]
    out = module._pack_buffer(PACK_SLOTS[0], packs.fold_bytes(P, H, hidden), tensors[0].device)
    return packs.pack_wgmma(tensors, weights.sources, P, H, bool(w["gate_normalized"]), hidden, plan.precision, out)


def run_mma(module: "TriangleMultiplication", variant, weights: CallWeights, x, mask, out) -> None:
    """Weights packed for the call -> projection kernel (tensor cores) -> cuBLAS bmm in the same
    precision -> output kernel; the mma and wgmma strategies alike, each with its own pack.
    tf32x3's a and b hold three blocks each along the contracted index (mma.cu.j2), so one TF32
    GEMM over 3N sums hi·hi + hi·lo + lo·hi."""
    B, N = x.shape[0], x.shape[1]
    H, precision = module.widths["H"], variant.plan.precision
    project, output = variant.launches(x.get_device(), B, N)
    copies = 3 if precision == "tf32x3" else 1
    ab = torch.empty((2, B * H, copies * N * N), device=x.device, dtype=OPERAND_DTYPES[precision])
    fastcall.note_scratch(ab)
    packed = tensor_core_pack(module, variant.plan, weights)  # alive until every launch is enqueued
    w_ptr = packed.data_ptr()
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


def fp32_pack(module: "TriangleMultiplication", weights: CallWeights) -> torch.Tensor:
    """`weights` packed for this call for the fp32 kernels."""
    return module._packed(module.fp32_layout(weights.sources), weights)


def run_bmm(module: "TriangleMultiplication", variant, weights: CallWeights, x, mask, out) -> None:
    """Projection kernel -> cuBLAS bmm (fp32: no TF32 even where the caller allowed it) -> output kernel."""
    B, N = x.shape[0], x.shape[1]
    project, output = variant.launches(x.get_device(), B, N)
    # One allocation for a, b and their product, from torch's stream-aware caching allocator (so a
    # captured CUDA graph never points at memory a later, larger call freed).
    ar, br, z = torch.empty((3, B * module.widths["H"], N, N), device=x.device, dtype=torch.float32).unbind(0)
    packed = fp32_pack(module, weights)  # alive until every launch is enqueued
    x_ptr, w_ptr = x.data_ptr(), packed.data_ptr()
    project.named(x=x_ptr, mask=mask.data_ptr(), w=w_ptr, ar=ar.data_ptr(), br=br.data_ptr(),
                  mask_is_float=int(mask.dtype is torch.float32))
    with fp32_matmul():
        triangle_bmm(ar, br, module._outgoing, out=z)
    output.named(x=x_ptr, z=z.data_ptr(), w=w_ptr, out=out.data_ptr())


def run_fused(module: "TriangleMultiplication", variant, weights: CallWeights, x, mask, out) -> None:
    """One cooperative kernel; its grid barrier's two ints are held by the module."""
    B, N = x.shape[0], x.shape[1]
    (fused,) = variant.launches(x.get_device(), B, N)
    ab = torch.empty((2, B * module.widths["H"] * N * N), device=x.device, dtype=torch.float32)
    fastcall.note_scratch(ab)
    packed = fp32_pack(module, weights)  # alive until the launch is enqueued
    fused.named(x=x.data_ptr(), mask=mask.data_ptr(), w=packed.data_ptr(), ar=ab[0].data_ptr(),
                br=ab[1].data_ptr(), barrier=module._barrier_ints(x.device), out=out.data_ptr(),
                mask_is_float=int(mask.dtype is torch.float32))


class TriangleMultiplication(TensorCorePrecisions, KernelModule, TriangleMultiplicationReference):
    """Drop-in for TriangleMultiplicationReference: same constructor, submodules and state_dict.

    CUDA input runs the tuned kernels: float32 in `precision` ("ieee", the default: exact fp32 on
    FMA units; "tf32x3": fp32-accurate on tensor cores; "tf32": TF32-accurate, for callers who
    opted into TF32), bfloat16 and float16 on tensor cores with fp32 accumulation and fp32
    LayerNorm statistics, and float32 under torch.autocast("cuda") in the autocast dtype (the
    weights cast as each call packs them). CPU input and other dtypes run the reference.
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
        self._slots = ParameterSlots(self, packs.parameter_names(bias))

    #: "auto" trains a 16-bit call through the closed form from 2^17 pairs (B * N * N), with the
    #: fused backward kernels only: below, a training step is bound by the host's time to issue its
    #: kernels, and without the fused kernels PyTorch's elementwise passes make the closed form slower
    #: than the reference. Calls no kernel computes run the reference.
    routing = Routing(closed_form_16_bit_training_min_pairs=2**17, closed_form_16_bit_training_needs_fused_kernels=True)
    input_layout = (("pair_repr", "BNNP", "float"), ("pair_mask", "BNN", "mask"))

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
            out = self._fast_forward(pair_repr, pair_mask, *self._slots.weights().tensors)
            if out is not None:
                return out
        self._validate(pair_repr, pair_mask)
        return self._dispatch(pair_repr, as_mask(pair_mask))

    def _validate(self, x, mask) -> None:
        if torch.compiler.is_compiling():
            return  # traced: the operator's fake implementation takes the shapes (pairgen/library.py)
        # Conditions first, messages only on failure: this runs on every call.
        P = self.widths["P"]
        check_float_tensor("pair_repr", x, 4, self._slots.anchor())
        shape = x.shape
        if shape[1] != shape[2] or shape[3] != P:
            raise ValueError(f"pair_repr must have shape (B, N, N, {P}), got {tuple(shape)}")
        check_mask("pair_mask", mask, shape[:3], x.device)

    def fp32_layout(self, sources):
        w = self.widths
        gate = w["H"] if w.get("gate_hidden") else w["P"]
        return packs.fp32_layout(w["P"], w["H"], bool(w["bias"]), gate, sources)

    def uses_kernel(self, x, mask) -> bool:
        return self.kernel_precision(x, mask) is not None

    def _launch(self, pair_repr, pair_mask, out=None, variant=None, weights: CallWeights | None = None):
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
        self._run(variant, self._slots.weights() if weights is None else weights, x, mask, out)
        return out

