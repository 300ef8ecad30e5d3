"""The triangle update's drop-in module: validation, then the strategy of the call's variant runs it
(pairgen/ops/trimul/strategies/)."""
from __future__ import annotations

import torch

from ...module.dispatch import Routing
from ...module.kernel_module import KernelModule, TensorCorePrecisions
from ...module.validation import as_mask, check_float_tensor, check_mask, contiguous_aligned
from ...module.parameters import CallWeights, ParameterSlots
from . import backward, packs
from .common import gate_columns
from .reference import TriangleMultiplicationReference
from .spec import TRIMUL


class TriangleMultiplication(TensorCorePrecisions, KernelModule, TriangleMultiplicationReference):
    """Drop-in for TriangleMultiplicationReference: same constructor, submodules and state_dict.

    CUDA input runs the tuned kernels: float32 in `precision` ("ieee", the default: exact fp32 on
    FMA units; "tf32x3": fp32-accurate on tensor cores; "tf32": TF32-accurate, for callers who
    opted into TF32), bfloat16 and float16 on tensor cores with fp32 accumulation and fp32
    LayerNorm statistics, and float32 under torch.autocast("cuda") in the autocast dtype (the
    weights cast as each call packs them). CPU input and other dtypes run the reference.
    output_dtype (KernelModule.output_dtype): None returns the reference's dtype; torch.float32
    returns fp32 from every call, which the Hopper kernels and the closed form's output gate write
    themselves from their 16-bit math (an fp32 model under autocast: no bf16 output and cast).
    Scratch for a and b comes from torch's stream-aware caching allocator on every call. The fused
    strategy's grid-barrier ints are owned by the module and left zeroed by every launch: two
    launches of the SAME module on different streams at once would share them.
    """

    op = TRIMUL

    def __init__(self, pair_dim: int, hidden_dim: int, direction: str = "incoming", gate_on: str = "input",
                 bias: bool = True, precision: str = "ieee", *, gate_at: str = "output",
                 output_dtype: "torch.dtype | None" = None):
        super().__init__(pair_dim, hidden_dim, direction=direction, gate_on=gate_on, bias=bias, gate_at=gate_at)
        self.precision = precision
        self.output_dtype = output_dtype
        self.widths = {"P": int(pair_dim), "H": int(hidden_dim), "outgoing": int(direction == "outgoing"),
                       "gate_normalized": int(gate_on == "normalized"), "bias": int(bias)}
        if gate_at == "hidden":  # only then (an optional width): the output placement's keys stay as tuned
            self.widths["gate_hidden"] = 1
        self._outgoing = direction == "outgoing"
        self._slots = ParameterSlots(self, packs.parameter_names(bias))

    #: "auto" trains a 16-bit call through the closed form from 2^17 pairs (B * N * N), with the
    #: fused backward kernels only: below, a training step is bound by the host's time to issue its
    #: kernels, and without the fused kernels PyTorch's elementwise passes make the closed form slower
    #: than the reference. A 16-bit forward no kernel runs (the widths fit none, or the default
    #: kernel of an untuned shape measured slower) takes the closed form's forward from the same size:
    #: cuBLAS products and the fused row kernels, about twice the reference's speed at pair widths
    #: 384-768 (docs/performance.md).
    routing = Routing(closed_form_16_bit_training_min_pairs=2**17, closed_form_16_bit_training_needs_fused_kernels=True,
                      closed_form_min_pairs=2**17)
    input_layout = (("pair_repr", "BNNP", "float"), ("pair_mask", "BNN", "mask"))

    closed_form = staticmethod(backward.gradients)
    saving_forward = staticmethod(backward.forward_saving)
    saved_gradients = staticmethod(backward.gradients_from)
    inference_forward = staticmethod(backward.forward_only)
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
        if self._fast_calls or self._training_replays:  # a call like a recent one, replayed in compiled code
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
        return packs.fp32_layout(w["P"], w["H"], bool(w["bias"]), gate_columns(w), sources)

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
            dtype = self.kernel_output_dtype(variant.plan)  # x is contiguous CUDA here
            out = torch.empty_like(x) if x.dtype is dtype else torch.empty(x.shape, device=x.device, dtype=dtype)
        if out.numel() == 0:
            return out
        self._run(variant, self._slots.weights() if weights is None else weights, x, mask, out)
        return out

