"""The pair readout's drop-in module: validation, the scratch it holds, then the strategy of the
call's variant runs it (pairgen/ops/readout/strategies/)."""
from __future__ import annotations

import torch

from ...module.buffers import HeldBuffer, grow_held
from ...module.dispatch import Routing
from ...module.kernel_module import KernelModule, TensorCorePrecisions
from ...module.modes import current_autocast
from ...precision import HALF_PRECISIONS
from ...module.validation import check_float_tensor, check_mask, contiguous_aligned
from ...module.parameters import CallWeights, ParameterSlots
from . import backward, packs
from .common import weight_offsets
from .reference import PairReadoutReference
from .spec import READOUT


class PairReadout(TensorCorePrecisions, KernelModule, PairReadoutReference):
    """Drop-in for PairReadoutReference: same constructor, submodules and state_dict.

    CUDA input runs the tuned kernels: float32 in `precision` ("ieee", the default: exact fp32;
    "tf32x3": fp32-accurate on tensor cores; "tf32"), bfloat16 and float16 on tensor cores with
    fp32 accumulation, fp32 LayerNorm statistics and the max in fp32, float32 under
    torch.autocast("cuda") in the autocast dtype. CPU inputs or other dtypes run the reference.
    `edge_mask` may be bool, integer or floating point, read as `edge_mask != 0`, so 0/1 masks
    behave as the reference's bool ones (and a NaN entry counts as an edge). N = 0 returns an
    empty (B, 0, D) on every device.

    Scratch of the split and direct strategies (U/V of every node, a j split's partial maxima)
    and a j split's per-tile arrival counters are held by the module, grown when a larger call
    needs more and never freed while the module lives (a captured CUDA graph may point at them;
    a capture that needs more gets buffers of its own). The gemm strategy's scratch (hidden layers
    and messages, B*N*N*(H + D) floats: 805 MB at B16 N128 D256 H512) comes from torch's
    stream-aware caching allocator on every call instead. The gemm strategy's matmul runs in
    fp32 even where the caller allowed TF32 (fp32_matmul). Two launches of the SAME module on
    different streams at once would share the held buffers (as would a graph replay overlapping
    a call on another stream): use one module per concurrent stream.
    """

    op = READOUT
    _RUNTIME_STATE = KernelModule._RUNTIME_STATE + ("_counters", "_scratch")
    #: Counters allocated at least this many at a time (4 KB), so growth is rare.
    MIN_COUNTERS = 1024
    #: split: launch the main kernel as a programmatic dependent of the node prologue (sm_90+),
    #: so that its blocks stage their weights while the prologue runs (_pair_max.cuh.j2). False
    #: launches it after the prologue has finished (the tests compare the two).
    programmatic_main = True

    def __init__(self, node_dim: int, pair_dim: int, hidden_dim: int, precision: str = "ieee"):
        super().__init__(node_dim, pair_dim, hidden_dim)
        self.precision = precision
        self.widths = {"D": int(node_dim), "P": int(pair_dim), "H": int(hidden_dim)}
        self._slots = ParameterSlots(self, [name for name, _ in self.named_parameters()])
        self._w2t_at = weight_offsets(node_dim, pair_dim, hidden_dim)["w2t"]  # gemm: W2^T's place in the fp32 pack
        self._counters: HeldBuffer | None = None  # the j split's arrival counters
        self._scratch: HeldBuffer | None = None   # the split and direct strategies' scratch

    closed_form = staticmethod(backward.gradients)
    saving_forward = staticmethod(backward.forward_saving)
    saved_gradients = staticmethod(backward.gradients_from)
    input_gradients = ("input", "pair_feats", None)
    #: Up to 2^15 pairs (B*N*N) a 16-bit (or autocast) forward no kernel serves runs the fp32
    #: kernels on the inputs made fp32: faster than the 16-bit reference up to there, slower beyond.
    #: The closed form never runs without a kernel. "auto" trains a 16-bit call through the closed
    #: form from 2^18 pairs, below through the reference: there the step is bound by the host's
    #: time to issue its operations, which the closed form has more of (docs/performance.md).
    #: It pays there without the fused backward kernels too (PAIRGEN_FUSED_BACKWARD=0: PyTorch's
    #: passes), so "auto" does not ask for them.
    routing = Routing(fp32_kernel_max_pairs=2**15, closed_form_16_bit_training_min_pairs=2**18,
                      closed_form_16_bit_training_needs_fused_kernels=False, captured_training_steps=True)
    input_layout = (("nodes", "BND", "float"), ("pair_feats", "BNNP", "float"), ("edge_mask", "BNN", "mask"))

    def closed_form_output_dtype(self, first, autocast):
        """The reference ends in nodes + LayerNorm(...), and autocast runs LayerNorm in fp32."""
        return torch.promote_types(first.dtype, torch.float32) if autocast else first.dtype

    def closed_form_applies(self, inputs: list) -> bool:
        """The closed form takes a bool edge mask (the reference's own type)."""
        return inputs[2].dtype is torch.bool

    def closed_form_capturable(self, inputs: tuple) -> bool:
        """Only the 16-bit closed form is captured (capture_training_steps): the fp32 one holds the
        max's gradient in sparse matrices whose sizes depend on the values, which a CUDA graph
        cannot replay."""
        return self.backward_precision(inputs[0], current_autocast()) in HALF_PRECISIONS

    def reference_forward(self, nodes, pair_feats, edge_mask):
        return PairReadoutReference.forward(self, nodes, pair_feats, edge_mask)

    def forward(self, nodes, pair_feats, edge_mask):
        """edge_mask: bool, integer or floating point, read as edge_mask != 0 (the reference's
        ~edge_mask needs bool; the kernels read bytes)."""
        if self._fast_calls or self._training_replays:  # a call like a recent one, replayed in compiled code
            out = self._fast_forward(nodes, pair_feats, edge_mask, *self._slots.weights().tensors)
            if out is not None:
                return out
        self._validate(nodes, pair_feats, edge_mask)
        if edge_mask.dtype is not torch.bool:
            edge_mask = edge_mask != 0
        if nodes.shape[1] == 0:
            return nodes.clone()  # no nodes: nothing to pool (the reference's max over no partners would raise)
        return self._dispatch(nodes, pair_feats, edge_mask)

    def _validate(self, nodes, pair_feats, edge_mask) -> None:
        if torch.compiler.is_compiling():
            return  # traced: the operator's fake implementation takes the shapes (pairgen/library.py)
        D, P = self.widths["D"], self.widths["P"]
        weight = self._slots.anchor()
        check_float_tensor("nodes", nodes, 3, weight)
        check_float_tensor("pair_feats", pair_feats, 4, weight)
        B, N = nodes.shape[0], nodes.shape[1]
        # Plain ifs: a message is formatted only on failure.
        if nodes.shape[2] != D:
            raise ValueError(f"nodes must have shape (B, N, {D}), got {tuple(nodes.shape)}")
        if pair_feats.shape != (B, N, N, P):
            raise ValueError(f"pair_feats must have shape (B, N, N, {P}) = {(B, N, N, P)} for nodes of shape "
                             f"{tuple(nodes.shape)}, got {tuple(pair_feats.shape)}")
        check_mask("edge_mask", edge_mask, (B, N, N), nodes.device)

    def fp32_layout(self, sources):
        w = self.widths
        return packs.fp32_layout(w["D"], w["P"], w["H"], sources)

    def uses_kernel(self, nodes, pair_feats, edge_mask) -> bool:
        # CUDA float32 (validated: one device, one dtype), within the kernels' 32-bit indices.
        return nodes.is_cuda and nodes.dtype is torch.float32 and self._within_int32(nodes)

    def _within_int32(self, nodes) -> bool:
        """The kernels index pairs with 32-bit ints: B*N*N*P >= 2^31 runs the reference."""
        B, N = nodes.shape[0], nodes.shape[1]
        return B * N * N * self.widths["P"] < 2**31 and B * N * 2 * self.widths["H"] < 2**31

    def kernel_precision(self, nodes, *rest) -> str | None:
        """As the other tensor-core modules' (TensorCorePrecisions), within the kernels' 32-bit
        indices (which count pair channels too)."""
        return TensorCorePrecisions.kernel_precision(self, nodes, *rest) if self._within_int32(nodes) else None

    def _tile_counters(self, index: int, count: int) -> int:
        """At least `count` zeroed arrival counters on device `index`, for the j split's "last
        block done" (each launch leaves them zeroed)."""
        if self.__dict__.get("_state_per_call"):
            return self._call_buffer(index, count, torch.int32, zeroed=True)
        held = self._counters
        if held is not None and held.index == index and count <= held.capacity:
            return held.ptr
        self._counters, ptr = grow_held(held, index, max(count, self.MIN_COUNTERS), torch.int32, zeroed=True)
        return ptr

    def _split_scratch(self, index: int, floats: int) -> int:
        """At least `floats` of scratch on device `index` for a split or direct launch (U/V, the
        j split's partial maxima): held by the module, not allocated per call, since at the seed
        shape the host path is most of a call and an allocation a noticeable part of it."""
        if self.__dict__.get("_state_per_call"):
            return self._call_buffer(index, floats, torch.float32, zeroed=False)
        held = self._scratch
        if held is not None and held.index == index and floats <= held.capacity:
            return held.ptr
        self._scratch, ptr = grow_held(held, index, floats, torch.float32, zeroed=False)
        return ptr

    def _launch(self, nodes, pair_feats, edge_mask, out=None, variant=None, weights: CallWeights | None = None):
        # Rows on 16-byte boundaries: the kernels read them with float4 loads and cp.async.
        nodes, pair_feats = contiguous_aligned(nodes), contiguous_aligned(pair_feats)
        if edge_mask.dtype is not torch.bool:
            edge_mask = edge_mask != 0
        edge_mask = edge_mask.contiguous()
        B, N, D = nodes.shape
        if out is None:
            out = torch.empty_like(nodes)  # contiguous CUDA, the reference's dtype (autocast: fp32 in, fp32 out)
        if out.numel() == 0:
            return out
        if variant is None:
            variant = self.variant_for(N, nodes.get_device(), self.kernel_precision(nodes, pair_feats, edge_mask))
        self._run(variant, self._slots.weights() if weights is None else weights, nodes, pair_feats, edge_mask, out)
        return out
