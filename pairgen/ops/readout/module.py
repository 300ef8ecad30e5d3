"""The pair readout's drop-in module: validation, held scratch, the strategies' runners."""
from __future__ import annotations

import torch

from ...module.buffers import HeldBuffer, grow_held
from ...module.dispatch import Routing
from ...module.kernel_module import PACK_SLOTS, KernelModule, TensorCorePrecisions
from ...module.modes import cublas_fp32_mode, fp32_matmul
from ...module.validation import check_float_tensor, check_mask, contiguous_aligned
from ...module.parameters import CallWeights, ParameterSlots
from ...precision import OPERAND_DTYPES
from . import backward, packs
from .reference import PairReadoutReference
from .spec import DIRECT, FUSED, GEMM, MMA, READOUT, SPLIT, WGMMA, gemm_scratch_offsets, pair_max_scratch, weight_offsets


def _pair_max_buffers(module: "PairReadout", variant, main, B: int, N: int, D: int, with_uv: bool) -> tuple:
    """(uv, partials, counters) pointers of a pair-max launch: scratch for U (with b1) and V of
    every node, (B*N, 2H), written by the split prologue, then the j split's partial maxima and
    flags; one arrival counter per tile of rows i (the main kernel's last shape argument)."""
    device = main.kernel.device_index
    j_split = variant.plan.params["j_split"]
    at = pair_max_scratch(B, N, D, module.widths["H"], j_split, with_uv)
    base = module._split_scratch(device, at["total"]) if at["total"] else 0
    uv = base + 4 * at["uv"] if with_uv else 0
    partials = base + 4 * at["partials"] if j_split > 1 else 0
    counters = module._tile_counters(device, main.tail[2]) if j_split > 1 else 0
    return uv, partials, counters


def fp32_pack(module: "PairReadout", weights: CallWeights) -> torch.Tensor:
    """`weights` packed for this call for the fp32 kernels."""
    return module._packed(module.fp32_layout(weights.sources), weights)


def _run_pair_max(module: "PairReadout", variant, weights: CallWeights, nodes, pair_feats, edge_mask, out,
                  with_uv: bool) -> None:
    """split (node prologue, then the pair-max kernel) and direct (the pair-max kernel alone)."""
    B, N, D = nodes.shape
    packed = fp32_pack(module, weights)
    weights = packed.data_ptr()
    launches = variant.launches(nodes.get_device(), B, N, programmatic=module.programmatic_main)
    main = launches[0]
    uv, partials, counters = _pair_max_buffers(module, variant, main, B, N, D, with_uv)
    if with_uv:
        prologue = launches[1]
        prologue.named(nodes=nodes.data_ptr(), wpack=weights, uv=uv)
    main.named(nodes=nodes.data_ptr(), pair=pair_feats.data_ptr(), mask=edge_mask.data_ptr(), wpack=weights, uv=uv,
               scratch=partials, counters=counters, out=out.data_ptr())


def _launch_with_prologue_inside(module: "PairReadout", main, pointers: dict, barrier: str,
                                 device: torch.device) -> None:
    """A kernel that runs the node prologue itself, then waits for all of it (fused: its prologue
    blocks, common/block_roles.cuh; mma's one_launch: a grid-wide barrier): one cooperative launch
    (phase 0) where its grid is resident at once, else the same kernel twice, plainly: phase 1 the
    prologue, phase 2 the pairs. Its arguments: the pointers (by name), the module's two ints its
    wait counts on as the argument `barrier` names (zeroed once; each launch leaves them as the next
    one needs them: fused's counter at 0, the barrier's count at 0 and its sense flipped), the shape
    tail, the phase."""
    ints = module._barrier_ints(device)
    for phase in ((0,) if main.mode == "cooperative" else (1, 2)):
        main.named(**pointers, **{barrier: ints}, phase=phase)


def run_fused(module: "PairReadout", variant, weights: CallWeights, nodes, pair_feats, edge_mask, out) -> None:
    """split's buffers and arguments, the prologue's blocks in the same launch (_launch_with_prologue_inside)."""
    B, N, D = nodes.shape
    (main,) = variant.launches(nodes.get_device(), B, N)
    uv, partials, counters = _pair_max_buffers(module, variant, main, B, N, D, with_uv=True)
    packed = fp32_pack(module, weights)
    pointers = dict(nodes=nodes.data_ptr(), pair=pair_feats.data_ptr(), mask=edge_mask.data_ptr(),
                    wpack=packed.data_ptr(), uv=uv, scratch=partials, counters=counters,
                    out=out.data_ptr())
    _launch_with_prologue_inside(module, main, pointers, "done", nodes.device)


def run_split(module, variant, weights, nodes, pair_feats, edge_mask, out) -> None:
    _run_pair_max(module, variant, weights, nodes, pair_feats, edge_mask, out, with_uv=True)


def run_direct(module, variant, weights, nodes, pair_feats, edge_mask, out) -> None:
    _run_pair_max(module, variant, weights, nodes, pair_feats, edge_mask, out, with_uv=False)


def run_gemm(module: "PairReadout", variant, weights: CallWeights, nodes, pair_feats, edge_mask, out) -> None:
    """Prologue -> hidden kernel -> fp32 mm -> pool kernel, all on the current stream, on one
    scratch buffer (hidden, messages, uv) from the caching allocator, held until all are enqueued.
    With split_product (tf32x3) hidden rows are [hi | lo] and the mm is two TF32 GEMMs."""
    B, N, D = nodes.shape
    H, pairs = module.widths["H"], B * N * N
    split = variant.plan.params.get("split_product", False)
    hidden_width = 2 * H if split else H
    hidden_kernel, prologue, pool = variant.launches(nodes.get_device(), B, N)
    packed = fp32_pack(module, weights)
    w_ptr = packed.data_ptr()
    at = gemm_scratch_offsets(B, N, D, H, split)
    scratch = torch.empty(at["total"], device=nodes.device, dtype=torch.float32)
    hidden = scratch[at["hidden"]: at["hidden"] + pairs * hidden_width].view(pairs, hidden_width)
    messages = scratch[at["messages"]: at["messages"] + pairs * D].view(pairs, D)
    uv = scratch.data_ptr() + 4 * at["uv"]
    prologue.named(nodes=nodes.data_ptr(), wpack=w_ptr, uv=uv)
    hidden_kernel.named(pair=pair_feats.data_ptr(), uv=uv, wpack=w_ptr, hidden=hidden.data_ptr())
    # messages = hidden W2^T without b2: the pool kernel adds it after the max (gemm.cu.j2 says why).
    if split:
        w2t = module._packed(packs.split_w2t_layout(D, H, weights.sources), weights, PACK_SLOTS[1]).view(torch.float32).view(3 * H, D)
        with cublas_fp32_mode(True):  # every operand an exact TF32 value: the products are exact
            torch.mm(hidden, w2t[: 2 * H], out=messages)
            messages.addmm_(hidden[:, :H], w2t[2 * H:])
    else:
        w2t = packed.view(torch.float32)[module._w2t_at: module._w2t_at + H * D].view(H, D)
        with fp32_matmul():
            torch.mm(hidden, w2t, out=messages)
    pool.named(messages=messages.data_ptr(), mask=edge_mask.data_ptr(), nodes=nodes.data_ptr(), wpack=w_ptr,
               out=out.data_ptr())


def run_mma(module: "PairReadout", variant, weights: CallWeights, nodes, pair_feats, edge_mask, out) -> None:
    """The node prologue (fp32 U, V into the held scratch), then the tensor-core kernel as its
    programmatic dependent (one_launch: the kernel alone, the prologue inside it), on the weights
    packed for the call in the operand dtype. Under autocast (fp32 inputs, a 16-bit
    kernel) the inputs are cast first and the 16-bit result widened into `out`, the reference's
    dtype there."""
    B, N, D = nodes.shape
    H = module.widths["H"]
    dtype = OPERAND_DTYPES[variant.plan.precision]
    target = out
    if nodes.dtype is not dtype:
        nodes, pair_feats = nodes.to(dtype), pair_feats.to(dtype)
        out = torch.empty_like(nodes)
    device = nodes.get_device()
    P = module.widths["P"]
    packed = module._packed(packs.mma_layout(D, P, H, variant.plan.precision, weights.sources), weights)
    launches = variant.launches(device, B, N, programmatic=module.programmatic_main)
    main = launches[0]
    uv = module._split_scratch(device, B * N * 2 * H)
    pointers = dict(nodes=nodes.data_ptr(), pair=pair_feats.data_ptr(), mask=edge_mask.data_ptr(),
                    wpack=packed.data_ptr(), uv=uv, out=out.data_ptr())
    if variant.plan.params.get("one_launch"):
        _launch_with_prologue_inside(module, main, pointers, "grid_bar", nodes.device)
    else:
        prologue = launches[1]
        prologue.named(nodes=nodes.data_ptr(), wpack=packed.data_ptr(), uv=uv)
        main.named(**pointers)
    if out is not target:
        target.copy_(out)


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
    runners = {SPLIT.name: run_split, DIRECT.name: run_direct, FUSED.name: run_fused, GEMM.name: run_gemm,
               MMA.name: run_mma, WGMMA.name: run_mma}  # wgmma: mma's packed weights, arguments and prologue
    # gemm runs a cuBLAS product between its kernels; mma's casts (autocast) happen only in calls
    # that are never recorded (_launch_recorded takes the Python path under autocast).
    fast_call_strategies = frozenset({SPLIT.name, DIRECT.name, FUSED.name, MMA.name, WGMMA.name})
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
    #: The closed form never runs without a kernel (16-bit modules run the reference): it computes
    #: the readout in fp32 (its sparse max gradient has no 16-bit path), and for bf16 it measured
    #: slower than the bf16 reference.
    routing = Routing(fp32_kernel_max_pairs=2**15)
    input_layout = (("nodes", "BND", "float"), ("pair_feats", "BNNP", "float"), ("edge_mask", "BNN", "mask"))

    def closed_form_output_dtype(self, first, autocast):
        """The reference ends in nodes + LayerNorm(...), and autocast runs LayerNorm in fp32."""
        return torch.promote_types(first.dtype, torch.float32) if autocast else first.dtype

    def backward_precision(self, x, autocast) -> str:
        """fp32 arithmetic with TF32 products for 16-bit and autocast calls (the sparse max
        gradient's products have no 16-bit path); exact fp32 otherwise."""
        return "tf32" if autocast or x.dtype is not torch.float32 else "ieee"

    def closed_form_applies(self, inputs: list) -> bool:
        """The closed form takes a bool edge mask (the reference's own type)."""
        return inputs[2].dtype is torch.bool

    def reference_forward(self, nodes, pair_feats, edge_mask):
        return PairReadoutReference.forward(self, nodes, pair_feats, edge_mask)

    def forward(self, nodes, pair_feats, edge_mask):
        """edge_mask: bool, integer or floating point, read as edge_mask != 0 (the reference's
        ~edge_mask needs bool; the kernels read bytes)."""
        if self._fast_calls:  # a call like a recent one, replayed in compiled code (pairgen/fastcall.py)
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
