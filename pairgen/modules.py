"""Plumbing the drop-in modules share: kernel-or-reference dispatch, the variant choice per
length, packed weights, buffers held between calls, input validation, the autograd bridge."""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable, NamedTuple

import torch

from . import runtime
from .spec import OpSpec


class ReferenceBackward(torch.autograd.Function):
    """Forward through the kernel; backward by recomputing the reference under autograd.
    Gradients are therefore exactly the reference's, at the cost of one recomputation."""

    @staticmethod
    def forward(ctx, module, n_inputs, *tensors):
        ctx.module, ctx.n_inputs = module, n_inputs
        ctx.save_for_backward(*tensors)
        return module._launch(*tensors[:n_inputs])

    @staticmethod
    def backward(ctx, grad_out):
        tensors = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in tensors[: ctx.n_inputs]]
        params = list(tensors[ctx.n_inputs:])
        wanted = [t for t in inputs + params if t.requires_grad]
        with torch.enable_grad():
            out = ctx.module.reference_forward(*inputs)
        grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True))
        return (None, None, *[next(grads) if t.requires_grad else None for t in inputs + params])


_data_ptr = torch.Tensor.data_ptr


class PackedParameters:
    """A module's parameters repacked into a kernel's layout, rebuilt only when one of them
    changed: replaced or moved (data pointer) or updated in place (version counter).

    Holds the submodules' `_parameters` dicts, so a parameter replaced by assignment is seen,
    without nn.Module.__getattr__ on the hot path (2.4 us per submodule lookup, measured)."""

    def __init__(self, slots, pack: Callable[[list], torch.Tensor]):
        self._slots = tuple((module._parameters, name) for module, name in slots)
        self._pack = pack
        self._key = None
        self._packed = None
        self._warned_unversioned = False

    def parameters(self) -> list:
        return [owner[name] for owner, name in self._slots]

    def get(self) -> torch.Tensor:
        params = self.parameters()
        try:
            key = [p._version for p in params]
        except RuntimeError:  # an inference tensor (made under torch.inference_mode) has no version
            key = self._unversioned()
        else:
            key += map(_data_ptr, params)
        if key is None or key != self._key:
            with torch.no_grad():
                self._packed = self._pack([p.detach() for p in params])
            self._key = key
        return self._packed

    def _unversioned(self) -> None:
        """Parameters created under torch.inference_mode (a module built or moved there) carry no
        version counter, so an in-place update cannot be seen: they are repacked on every call,
        which is correct but costs a few small kernels per call. Said once per module."""
        if not self._warned_unversioned:
            self._warned_unversioned = True
            warnings.warn("pairgen: this module's parameters were created under torch.inference_mode, so "
                          "in-place updates to them cannot be detected and its weights are repacked on every "
                          "call; build or move the module outside inference_mode to avoid that cost",
                          stacklevel=4)
        return None

    def __getstate__(self):  # a copy or a pickle repacks on first use
        return {**self.__dict__, "_key": None, "_packed": None}


class HeldBuffer(NamedTuple):
    """A buffer a module keeps between calls on one device (index -1: the CPU), with the buffers
    it replaced (kept alive: a captured CUDA graph may still point at them), its length and its
    data pointer (read once, not per call)."""
    index: int
    live: torch.Tensor
    retired: list
    capacity: int
    ptr: int


def grow_held(held: HeldBuffer | None, index: int, count: int, dtype: torch.dtype, zeroed: bool) -> HeldBuffer:
    """A HeldBuffer of at least `count` elements on device `index` replacing `held`, at least
    twice its size, so growth is rare. Under CUDA-graph capture a zero fill is recorded, not run:
    the new buffer is then zeroed only by the graph's replays, so it is the graph's (kept alive
    in `retired`), and the eager calls keep the buffer they had."""
    device = torch.device("cpu") if index < 0 else torch.device("cuda", index)
    if held is None or held.index != index:  # none yet, or the module moved to another device
        live, retired = None, [] if held is None else held.retired + [held.live]
    else:
        live, retired = held.live, held.retired
    size = max(count, 2 * (0 if live is None else live.numel()))
    fresh = (torch.zeros if zeroed else torch.empty)(size, device=device, dtype=dtype)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        if live is None:
            live = torch.empty(0, device=device, dtype=dtype)
        return HeldBuffer(index, live, retired + [fresh], live.numel(), live.data_ptr())
    return HeldBuffer(index, fresh, retired + ([] if live is None else [live]), fresh.numel(), fresh.data_ptr())


class KernelModule:
    """Mixin for drop-in modules: decides kernel or reference, and keeps the variant choice.

    A subclass provides: `op` (its OpSpec), `runners` (strategy name -> the function that runs a
    variant of that strategy), `widths`, `reference_forward(*inputs)`, `_launch(*inputs, out=None,
    variant=None)`, and validates its inputs before calling `_dispatch`.
    """

    op: OpSpec
    runners: dict[str, Callable] = {}
    _forced_plan = None  # set by the tuner and the tests to run one specific variant
    _variant_cache: dict | None = None  # (device index, N) -> variant, valid for one runtime generation
    #: Lengths remembered per module: a server meeting every protein's own N must not grow
    #: without bound; past this many the oldest half is forgotten (re-selecting costs a lookup).
    MAX_CACHED_LENGTHS = 256

    # Loaded kernels and packed weights belong to this process and device: a copy or a pickle
    # (an EMA copy of the model, torch.save) starts without them and rebuilds them on first use.
    _RUNTIME_STATE = ("_variant_cache", "_forced_plan")

    def __getstate__(self):
        state = dict(self.__dict__)
        for name in self._RUNTIME_STATE:
            if name in state:
                state[name] = None
        return state

    def force_variant(self, variant) -> None:
        """Run `variant` (a runtime.Variant) instead of the tuned choice; None restores it."""
        self._forced_plan = variant

    def uses_kernel(self, *tensors: torch.Tensor) -> bool:
        """CUDA float32 runs a kernel. Callers have validated the inputs first (one device,
        the parameters' dtype), so the first tensor speaks for all of them."""
        first = tensors[0]
        return first.is_cuda and first.dtype is torch.float32

    def variant_for(self, n: int, device: torch.device):
        """The variant for length n on this device (None: run the reference). Cached on the
        module: the host time of a call is what small shapes are made of."""
        if self._forced_plan is not None:
            return self._forced_plan
        cache = self._variant_cache
        if cache is None or cache["generation"] != runtime.generation():
            cache = self._variant_cache = {"generation": runtime.generation()}
        key = (device.index or 0, n)
        variant = cache.get(key, cache)
        if variant is cache:
            if len(cache) > self.MAX_CACHED_LENGTHS:
                for old in [k for k in cache if k != "generation"][: self.MAX_CACHED_LENGTHS // 2]:
                    del cache[old]
            variant = cache[key] = runtime.select(self.op, "float32", self.widths, n, key[0])
        return variant

    def explain(self, n: int, device: torch.device | int | None = None) -> "runtime.Explanation":
        """What this module runs for length n on a GPU, where that came from, its parameters and
        its measured time (see runtime.explain)."""
        index = device if isinstance(device, int) else (torch.device(device or "cuda").index or 0)
        return runtime.explain(self.op, "float32", self.widths, n, index)

    def _dispatch(self, *inputs: torch.Tensor):
        if not self.uses_kernel(*inputs):
            return self.reference_forward(*inputs)
        first = inputs[0]
        variant = self.variant_for(first.shape[1], first.device)
        if variant is None:
            return self.reference_forward(*inputs)  # disabled, or no kernel fits these widths
        if torch.is_grad_enabled() and self._needs_grad(inputs):
            return ReferenceBackward.apply(self, len(inputs), *inputs, *self.parameters())
        return self._launch(*inputs, variant=variant)

    def _run(self, variant, *tensors) -> None:
        """The variant's strategy runs it on prepared tensors (inputs..., out)."""
        self.runners[variant.plan.strategy](self, variant, *tensors)

    def _needs_grad(self, inputs) -> bool:
        return any(t.requires_grad for t in inputs) or any(p.requires_grad for p in self.parameters())


def check_float_tensor(name: str, t, rank: int, param: torch.Tensor) -> None:
    """Type, dtype, rank, and the device of `param` (one of the module's parameters)."""
    if isinstance(t, torch.Tensor) and t.dtype is param.dtype and t.dim() == rank and t.device == param.device:
        return  # the common case, in ~1 us: the checks below only build the message
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dimensions, got shape {tuple(t.shape)}")
    if t.device != param.device:
        raise ValueError(f"{name} is on {t.device} but the module's parameters are on {param.device}")
    if t.dtype != param.dtype:
        raise ValueError(f"{name} has dtype {t.dtype} but the module's parameters are {param.dtype}")


@contextlib.contextmanager
def fp32_matmul():
    """cuBLAS matmuls inside run in fp32 even where the caller allowed TF32; the caller's setting
    is restored after. Through the fp32_precision API where torch has it (2.9+): there, reading the
    legacy allow_tf32 raises once a caller has used the new API, so the legacy flag would break
    such callers; the new API read and written this way leaves a legacy caller's flag as it was."""
    matmul = torch.backends.cuda.matmul
    new_api = hasattr(matmul, "fp32_precision")
    saved = matmul.fp32_precision if new_api else matmul.allow_tf32
    off = "ieee" if new_api else False
    if saved != off:
        setattr(matmul, "fp32_precision" if new_api else "allow_tf32", off)
    try:
        yield
    finally:
        if saved != off:
            setattr(matmul, "fp32_precision" if new_api else "allow_tf32", saved)


def contiguous_aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous with its data on a 16-byte boundary, copied only when it is not: the kernels
    read rows with float4 loads and cp.async, which fault on a view that starts mid-vector (a
    contiguous slice such as x[1:] of a flat tensor, or a narrowed last dimension made contiguous)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()
