"""The contact head's drop-in module: validation, then the strategy of the call's variant runs it
(pairgen/ops/contact/strategies/)."""
from __future__ import annotations

import torch

from ...module.dispatch import Routing
from ...module.kernel_module import KernelModule, TensorCorePrecisions
from ...module.validation import check_float_tensor, contiguous_aligned
from ...module.parameters import CallWeights, ParameterSlots
from . import backward, packs
from .reference import ContactHeadReference
from .spec import CONTACT


class ContactHead(TensorCorePrecisions, KernelModule, ContactHeadReference):
    """Drop-in for ContactHeadReference: same constructor (and `precision`), submodules and state_dict.

    CUDA input runs the tuned kernels: float32 in `precision` ("ieee", the default: exact fp32;
    "tf32x3": fp32-accurate on tensor cores; "tf32"), bfloat16 and float16 on tensor cores with
    fp32 accumulation and fp32 LayerNorm statistics, float32 under torch.autocast("cuda") in the
    autocast dtype. CPU input and other dtypes run the reference.
    """

    op = CONTACT

    def __init__(self, pair_dim: int, hidden_dim: int, precision: str = "ieee"):
        super().__init__(pair_dim, hidden_dim)
        self.precision = precision
        self.widths = {"P": int(pair_dim), "H": int(hidden_dim)}
        self._slots = ParameterSlots(self, [name for name, _ in self.named_parameters()])

    closed_form = staticmethod(backward.gradients)
    saving_forward = staticmethod(backward.forward_saving)
    saved_gradients = staticmethod(backward.gradients_from)
    #: A 16-bit forward that no tensor-core kernel serves (an autocast of the other 16-bit dtype)
    #: runs the closed form from 2^17 pairs (B*N*N), below it the fp32 kernel on the input made fp32
    #: (below, the closed form is bound by the host's time per PyTorch operation). "auto" trains a
    #: 16-bit call through the closed form (with the fused backward kernels) above 2^18 pairs; up to
    #: there the step is bound by the host, and the reference's is as fast (docs/performance.md).
    #: Training calls up to 3 * 2^18 pairs (N768 won, N1024 lost) replay captured CUDA graphs from
    #: their second call (pairgen/module/captured.py), which takes the host's time away: there
    #: "auto" takes the closed form at every size.
    routing = Routing(fp32_kernel_max_pairs=2**17 - 1, closed_form_min_pairs=2**17,
                      closed_form_16_bit_training_min_pairs=2**18 + 1, captured_training_steps=True,
                      captured_training_max_pairs=3 * 2**18)
    input_layout = (("pair_repr", "BNNP", "float"),)

    def reference_forward(self, pair_repr):
        return ContactHeadReference.forward(self, pair_repr)

    def forward(self, pair_repr):
        if self._fast_calls or self._training_replays:  # a call like a recent one, replayed in compiled code
            out = self._fast_forward(pair_repr, *self._slots.weights().tensors)
            if out is not None:
                return out
        self._validate(pair_repr)
        return self._dispatch(pair_repr)

    def _validate(self, x) -> None:
        if torch.compiler.is_compiling():
            return  # traced: the operator's fake implementation takes the shapes (pairgen/library.py)
        P = self.widths["P"]
        check_float_tensor("pair_repr", x, 4, self._slots.anchor())
        shape = x.shape
        if shape[1] != shape[2] or shape[3] != P:  # a plain if: the message is built only on failure
            raise ValueError(f"pair_repr must have shape (B, N, N, {P}), got {tuple(shape)}")

    def fp32_layout(self, sources):
        return packs.fp32_layout(self.widths["P"], self.widths["H"], sources)

    def uses_kernel(self, x) -> bool:
        # The kernels index pairs with 32-bit ints; B*N*N >= 2^31 (over 1 TB at P=128) runs the reference.
        return x.is_cuda and x.dtype is torch.float32 and x.shape[0] * x.shape[1] * x.shape[1] < 2**31

    def _launch(self, pair_repr, out=None, variant=None, weights: CallWeights | None = None):
        x = contiguous_aligned(pair_repr)
        B, N = x.shape[0], x.shape[1]
        if variant is None:
            variant = self.variant_for(N, x.get_device(), self.kernel_precision(x))
        if out is None:
            out = x.new_empty((B, N, N), dtype=self.kernel_output_dtype(variant.plan))
        if out.numel() == 0:
            return out
        self._run(variant, self._slots.weights() if weights is None else weights, x, out)
        return out
