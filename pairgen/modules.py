"""Plumbing the drop-in modules share: kernel-or-reference dispatch, the variant choice per
length, packed weights, buffers held between calls, input validation, the autograd bridge."""
from __future__ import annotations

import contextlib
import functools
import operator
import warnings
from typing import Callable, NamedTuple

import torch
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook, register_module_parameter_registration_hook
from torch.nn.utils import parametrize

from . import config, fastcall, first_use, library, native, runtime
from .launch import current_raw_stream
from .spec import OpSpec


#: The precisions whose modules hold their parameters, and take their inputs, in a 16-bit dtype.
HALF_PRECISION_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
HALF_DTYPE_NAMES = {dtype: name for name, dtype in HALF_PRECISION_DTYPES.items()}


#: Input dtypes the closed-form backwards take (each computes in the dtype its module's
#: backward_precision names and casts the gradients back).
CLOSED_FORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: precision= of an fp32 module -> the tuned key's dtype its kernels compute in.
FP32_PRECISIONS = {"ieee": "float32", "tf32x3": "tf32x3", "tf32": "tf32"}
#: Precision -> the dtype of the tensor-core kernels' operands (packed weights, staged inputs).
OPERAND_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "tf32": torch.float32,
                  "tf32x3": torch.float32}
#: Precision -> the output's dtype: the 16-bit precisions answer in their dtype (under autocast
#: too, as the references do), the fp32 ones in fp32.
OUTPUT_DTYPES = {"float32": torch.float32, "tf32x3": torch.float32, "tf32": torch.float32,
                 "bfloat16": torch.bfloat16, "float16": torch.float16}


def frozen_names(names: list[str], wanted: "list[bool] | None") -> frozenset:
    """The parameter names whose gradient is not wanted (None: every one is)."""
    return frozenset() if wanted is None else frozenset(name for name, w in zip(names, wanted) if not w)


class ReferenceBackward(torch.autograd.Function):
    """Forward through the kernel; backward through the module's closed-form gradients where it
    has them for this call (`analytic_gradients`), else by recomputing the reference under
    autograd (the reference's own gradients, at the cost of one recomputation)."""

    @staticmethod
    def forward(ctx, module, n_inputs, variant, *tensors):
        ctx.module, ctx.n_inputs = module, n_inputs
        # The recomputation runs under the forward's autocast, so its dtypes are the forward's.
        ctx.autocast = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        ctx.save_for_backward(*tensors)
        return module._launch(*tensors[:n_inputs], variant=variant)

    @staticmethod
    def backward(ctx, grad_out):
        tensors = ctx.saved_tensors
        enabled, dtype = ctx.autocast
        # Under create_graph (grad mode on here) the gradients must themselves be differentiable in
        # the saved tensors: the closed form computes without autograd, so the reference's
        # autograd answers, on the saved tensors as they are (not detached) and building a graph.
        create_graph = torch.is_grad_enabled()
        if create_graph:
            inputs = list(tensors[: ctx.n_inputs])
        else:
            inputs = [t.detach().requires_grad_(t.requires_grad) for t in tensors[: ctx.n_inputs]]
        params = list(tensors[ctx.n_inputs:])
        wanted = [t for t in inputs + params if t.requires_grad]
        analytic = None if create_graph else ctx.module.analytic_gradients(
            inputs, params, grad_out, autocast=dtype if enabled else None, wanted=[p.requires_grad for p in params])
        if analytic is not None:
            return (None, None, None, *[g if t.requires_grad else None for t, g in zip(inputs + params, analytic)])
        with torch.enable_grad(), torch.autocast("cuda", dtype=dtype, enabled=enabled):
            out = ctx.module.reference_forward(*inputs)
        grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True, create_graph=create_graph))
        return (None, None, None, *[next(grads) if t.requires_grad else None for t in inputs + params])


def _saved_tensor_hooks_active() -> bool:
    """Whether torch.autograd.graph.saved_tensors_hooks (or a user of them: non-reentrant
    torch.utils.checkpoint, save_on_cpu) is active. PyTorch has no public query; without the
    private one this answers False."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is not None


def current_autocast() -> "torch.dtype | None":
    """The dtype of the CUDA autocast in effect, or None."""
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None


def autocast_off():
    """A context with the CUDA autocast off (a null context where none is on)."""
    return torch.autocast("cuda", enabled=False) if torch.is_autocast_enabled("cuda") else contextlib.nullcontext()


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype; t itself when it is already (Tensor.to costs a dispatch even with nothing to do)."""
    return t if t.dtype is dtype else t.to(dtype)


SECOND_DERIVATIVE_REFUSED = (
    "pairgen: a second derivative (create_graph=True) through kept intermediates is not supported: their "
    "gradients are computed without an autograd graph. Set the module's recompute_for_backward = True to "
    "differentiate through the reference's autograd instead.")


class _RefuseSecondDerivative(torch.autograd.Function):
    """Identity on gradients computed without a graph, tied to the incoming gradient so that the
    graph a create_graph=True backward builds reaches the caller's tensors; differentiating it
    raises SECOND_DERIVATIVE_REFUSED (not PyTorch's 'appears to not have been used in the graph',
    nor a silent zero)."""

    @staticmethod
    def forward(ctx, grad_out, *grads):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(SECOND_DERIVATIVE_REFUSED)


def graphless_gradients(grad_out: torch.Tensor, grads: list) -> list:
    """`grads` as a backward returns them: unchanged in a plain backward; under create_graph=True
    (grad mode on during the backward), tied to `grad_out` through a node that refuses to be
    differentiated."""
    present = [i for i, g in enumerate(grads) if g is not None]
    if not (torch.is_grad_enabled() and present):
        return grads
    # An incoming gradient with no graph of its own (d(out.sum())/d(out)) still gets a refusing
    # node: the gradients depend on the inputs, and differentiating them must not pass for zero.
    tie = grad_out if grad_out.requires_grad else grad_out.detach().requires_grad_()
    tied = _RefuseSecondDerivative.apply(tie, *(grads[i] for i in present))
    out = list(grads)
    for i, g in zip(present, tied):
        out[i] = g
    return out


class SavedClosedForm(torch.autograd.Function):
    """Forward computed the closed form's way (the op's saving_forward), its intermediates kept
    for the backward, which consumes them (saved_gradients): no kernel forward and no
    recomputation, at the memory of the saved intermediates."""

    @classmethod
    def run(cls, module, inputs: tuple) -> torch.Tensor:
        """The module's training call on `inputs` through this function (its parameters walked
        once: a walk costs a call tens of µs of host time)."""
        named = list(module.named_parameters())
        return cls.apply(module, len(inputs), tuple(name for name, _ in named), *inputs, *(p for _, p in named))

    @staticmethod
    def forward(ctx, module, n_inputs, names, *tensors):
        ctx.module, ctx.n_inputs, ctx.names = module, n_inputs, names
        out, ctx.saved = module.closed_form_forward(tensors[:n_inputs], dict(zip(names, tensors[n_inputs:])))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        skipped = 3  # module, n_inputs, names
        wanted = ctx.needs_input_grad[skipped + ctx.n_inputs:]
        with torch.no_grad():
            grads = ctx.module.saved_gradients(ctx.module, ctx.saved, grad_out.detach(), frozen_names(ctx.names, wanted))
        needs = ctx.needs_input_grad[skipped: skipped + ctx.n_inputs]
        inputs = [grads[key] if key and need else None for key, need in zip(ctx.module.input_gradients, needs)]
        params = [grads.get(name) if want else None for name, want in zip(ctx.names, wanted)]
        return (None,) * skipped + tuple(graphless_gradients(grad_out, [*inputs, *params]))


# ---- packed weights that always follow the module's parameters -------------------------------
#
# The kernels read a packed copy of the parameters. A copy must never go stale, whatever the user
# does to the module between calls:
#   * in-place updates through autograd-visible ops (optimizer steps, `with no_grad: p.mul_()`,
#     load_state_dict): the parameter's version counter moves;
#   * in-place updates through `p.data` (the classic EMA `e.data.mul_(0.9).add_(p.data, ...)`): no
#     version counter moves, so the parameters a module packs are watched: reading or assigning
#     their `.data` bumps a process-wide epoch;
#   * a replaced parameter or submodule (`m.mlp[0] = nn.Linear(...)`) or a parametrization
#     (`weight_norm`): module and parameter registrations bump a structure epoch, and the
#     parameters are found again from the module by their paths (repacked if they are others).
# A parametrized (or hook-computed, the old torch.nn.utils.weight_norm) weight is computed and
# repacked on every call, as its forward would compute it.

_VERSION = operator.attrgetter("_version")
_STRUCTURE_EPOCH = [0]  # module and parameter registrations: a pack made before re-resolves its parameters
_DATA_EPOCH = [0]       # .data of a watched parameter read or assigned: a pack made before is rebuilt


def _bump_structure(*_args) -> None:
    _STRUCTURE_EPOCH[0] += 1


class WatchedParameter(nn.Parameter):
    """An nn.Parameter whose `.data`, read or assigned, bumps the data epoch: an in-place update
    through `.data` moves no version counter, so it would otherwise be invisible. Packed parameters
    are switched to this class in place (same object: optimizers and user references still hold
    it); a pickle brings back a plain Parameter, which is watched again on first use."""

    @property
    def data(self):
        _DATA_EPOCH[0] += 1
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value):
        _DATA_EPOCH[0] += 1
        torch.Tensor.data.__set__(self, value)


fastcall.PLAIN_TYPES = (nn.Parameter, WatchedParameter)  # a replay takes both as plain tensors


def _watch(param) -> None:
    if type(param) is nn.Parameter:  # other subclasses (DTensor parameters, ...) keep their class
        param.__class__ = WatchedParameter


_parameter_new = nn.Parameter.__new__


def _new_parameter(cls, data=None, requires_grad=True):
    """nn.Parameter(p) of a watched p makes a plain alias of it, as it does of any Parameter:
    torch's own check accepts only Tensor and Parameter data as they are, and would reject the
    subclass (register_parametrization, weight tying and other code wrap existing parameters)."""
    if type(data) is WatchedParameter:
        return torch.Tensor._make_subclass(cls, data, requires_grad)
    return _parameter_new(cls, data, requires_grad)


if not getattr(nn.Parameter.__new__, "_pairgen", False):
    _new_parameter._pairgen = True
    nn.Parameter.__new__ = staticmethod(_new_parameter)


_module_hooks = register_module_module_registration_hook(_bump_structure)
_parameter_hooks = register_module_parameter_registration_hook(_bump_structure)


class PackedParameters:
    """A module's parameters repacked into a kernel's layout, rebuilt only when one of them may
    have changed (see the comment above). `paths` names each parameter as (submodule path, name),
    e.g. ("mlp.0", "weight"); `pack(list of tensors)` builds the kernels' buffer."""

    def __init__(self, root: nn.Module, paths, pack: Callable[[list], torch.Tensor]):
        self._root = root
        self._paths = tuple(paths)
        self._pack = pack
        self._reset()
        self._warned = set()

    def _reset(self) -> None:
        self._epoch = None   # the structure epoch the slots were resolved at
        self._data_epoch = None  # the data epoch of the last pack
        self._slots = ()     # (owner dict, name) per parameter; owner None: computed every call
        self._params = []    # the parameter objects resolved
        self._owners, self._names = (), ()  # the slots' owner dicts and names, for get()'s check
        self._key = None     # their versions when last packed
        self._packed = None

    def _resolve(self) -> None:
        slots, params = [], []
        for path, name in self._paths:
            sub = self._root.get_submodule(path) if path else self._root
            param = sub._parameters.get(name)
            if param is None or parametrize.is_parametrized(sub, name):
                slots.append((sub, name, None))  # computed: a parametrization or a weight_norm hook
                params.append(None)
                self._warn_once("computed", f"pairgen: {path}.{name} is computed (a parametrization or a "
                                "weight-norm hook), so this module's weights are repacked on every call")
            else:
                _watch(param)
                slots.append((sub._parameters, name, param))
                params.append(param)
        if len(params) != len(self._params) or not all(map(operator.is_, params, self._params)):
            self._key = None  # other parameters than the last pack's: repack (a registration elsewhere is not)
        self._slots, self._params = tuple(slots), params
        # The per-call check runs over parallel tuples with C-level map() (a little faster than a
        # Python loop over the slots). Its cost is mostly the version reads, dearer for the watched
        # subclass than for a plain Parameter.
        self._owners = tuple(owner for owner, _, _ in slots)
        self._names = tuple(name for _, name, _ in slots)
        self._computed = any(p is None for p in params)
        self._epoch = _STRUCTURE_EPOCH[0]

    def anchor(self) -> torch.Tensor:
        """One parameter of the module as it is now: input validation compares dtype and device with it."""
        if self._epoch != _STRUCTURE_EPOCH[0]:
            self._resolve()
        first = self._params[0]
        return first if first is not None else self._value(self._slots[0])

    def parameters(self) -> list:
        """The tensors packed now (a computed weight as its module computes it)."""
        if self._epoch != _STRUCTURE_EPOCH[0]:
            self._resolve()
        return [self._value(slot) for slot in self._slots]

    @staticmethod
    def _value(slot) -> torch.Tensor:
        owner, name, param = slot
        if param is not None:
            return param
        for hook in list(owner._forward_pre_hooks.values()):  # the old weight_norm computes in a hook
            hook(owner, ())
        return getattr(owner, name)

    def get(self) -> torch.Tensor:
        if self._root.__dict__.get("_state_per_call"):
            # Held by the module until the operator's call ends (library.state_per_call): callers
            # keep only its data pointer, and a pack freed before its kernel is enqueued could be
            # handed to a later allocation of the same call.
            pack = self.fresh()
            self._root.__dict__.setdefault("_call_buffers", []).append(pack)
            return pack
        if self._epoch != _STRUCTURE_EPOCH[0]:
            self._resolve()
        if self._data_epoch != _DATA_EPOCH[0]:
            self._key, self._data_epoch = None, _DATA_EPOCH[0]  # some .data was touched: repack
        if self._computed:
            key = None
        elif not all(map(operator.is_, map(operator.getitem, self._owners, self._names), self._params)):
            self._resolve()  # replaced without a registration (e.g. .to() overwriting parameters)
            return self.get()
        else:
            try:
                key = list(map(_VERSION, self._params))
            except RuntimeError:  # an inference tensor (made under torch.inference_mode) has no version
                key = self._unversioned()
        if key is None or key != self._key:
            with torch.no_grad():
                self._packed = self._pack([p.detach() for p in self.parameters()])
            self._key = key
        return self._packed

    def fresh(self) -> torch.Tensor:
        """A pack for this call alone, kept nowhere. Inside a compiled graph (the operators of
        pairgen/library.py), a pack the module kept would be allocated from a CUDA graph's memory
        pool and outlive the graph's call (which torch.compile's CUDA graphs refuse), and a replay
        would read the pack of the recording, not the parameters as an optimizer step left them."""
        if self._epoch != _STRUCTURE_EPOCH[0]:
            self._resolve()
        with torch.no_grad():
            return self._pack([p.detach() for p in self.parameters()])

    def _unversioned(self) -> None:
        """Parameters created under torch.inference_mode (a module built or moved there) carry no
        version counter, so an in-place update cannot be seen: they are repacked on every call,
        which is correct but costs a few small kernels per call. Said once per module."""
        self._warn_once("unversioned", "pairgen: this module's parameters were created under torch.inference_mode, "
                        "so in-place updates to them cannot be detected and its weights are repacked on every "
                        "call; build or move the module outside inference_mode to avoid that cost")
        return None

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(message, stacklevel=5)

    def __getstate__(self):  # a copy or a pickle resolves and repacks on first use
        state = dict(self.__dict__)
        state.update(_epoch=None, _data_epoch=None, _slots=(), _params=[], _owners=(), _names=(), _key=None,
                     _packed=None)
        return state


class HeldBuffer(NamedTuple):
    """A buffer a module keeps between calls on one device (index -1: the CPU), with the buffers
    it replaced (kept alive: a captured CUDA graph may still point at them), its length and its
    data pointer (read once, not per call)."""
    index: int
    live: torch.Tensor
    retired: list
    capacity: int
    ptr: int


def grow_held(held: HeldBuffer | None, index: int, count: int, dtype: torch.dtype,
              zeroed: bool) -> tuple[HeldBuffer, int]:
    """A buffer of at least `count` elements on device `index` for this call: (what the module
    holds from now on, the pointer this call uses). The new buffer is at least twice the one it
    replaces, so growth is rare. Under CUDA-graph capture a zero fill is recorded, not run: the new
    buffer is then zeroed only by the graph's replays, so it is the graph's (kept alive in
    `retired`, its pointer used by the captured launch), and the eager calls keep the one they had."""
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
        return HeldBuffer(index, live, retired + [fresh], live.numel(), live.data_ptr()), fresh.data_ptr()
    return (HeldBuffer(index, fresh, retired + ([] if live is None else [live]), fresh.numel(), fresh.data_ptr()),
            fresh.data_ptr())


class KernelModule:
    """Mixin for drop-in modules: decides kernel or reference, and keeps the variant choice.

    A subclass provides: `op` (its OpSpec), `runners` (strategy name -> the function that runs a
    variant of that strategy), `widths`, `reference_forward(*inputs)`, `_launch(*inputs, out=None,
    variant=None)`, and validates its inputs before calling `_dispatch`.
    """

    op: OpSpec
    runners: dict[str, Callable] = {}
    _forced_plan = None  # set by the tuner and the tests to run one specific variant
    _reference_only = False  # set while pairgen.library runs the reference on weights it was given
    _variant_cache: dict | None = None  # (device index, N) -> variant, valid for one runtime generation
    #: Lengths remembered per module: a server meeting every protein's own N must not grow
    #: without bound; past this many the oldest half is forgotten (re-selecting costs a lookup).
    MAX_CACHED_LENGTHS = 256
    #: How a training call (one that autograd records) gets its gradients; see backward_mode.
    BACKWARD_MODES = ("auto", "closed_form", "reference")
    _backward_mode = "auto"
    #: The closed form of an op that can keep its forward's intermediates (saving_forward) keeps
    #: them unless this is True: then the forward is the kernel and the backward recomputes them
    #: from the inputs (the least memory, one forward more). Other ops always recompute.
    recompute_for_backward = False
    #: Calls no kernel computes (a dtype or an autocast the op has no kernels in) may run the op's
    #: closed form on the GPU (cuBLAS products, fused row kernels) instead of the reference, where
    #: this is True and the closed form applies: a forward where closed_form_pays says so, a
    #: training call where the backward_mode takes the closed form (trains_through_reference).
    closed_form_without_kernel = False

    # Loaded kernels and packed weights belong to this process and device: a copy or a pickle
    # (an EMA copy of the model, torch.save) starts without them and rebuilds them on first use.
    _RUNTIME_STATE = ("_variant_cache", "_forced_plan", "_handle", "_extra_packs", "_barrier")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # The int that names this module to its torch.library operator (pairgen/library.py),
        # registered here and not while torch.compile traces: a tracer does not keep side effects.
        self._handle = library.register(self)

    def __getstate__(self):
        state = dict(self.__dict__)
        for name in self._RUNTIME_STATE:
            if name in state:
                state[name] = None
        state.pop("_fast_calls", None)
        state.pop("_fast_call_counts", None)
        return state

    # ---- fast calls (pairgen/fastcall.py) ----------------------------------------------------
    #: Recorded calls, newest first: (the compiled replay function, its recording, device index).
    _fast_calls: tuple = ()
    #: Recordings kept per module: a few lengths called in turn all stay fast.
    MAX_FAST_CALLS = 4
    #: Strategies whose runners launch only pairgen kernels, on the inputs, the output, tensors
    #: the module holds and per-call buffers they note (fastcall.note_scratch): their calls can
    #: be recorded. A runner that runs PyTorch operations between its kernels is not listed.
    fast_call_strategies: frozenset = frozenset()
    #: Strategies whose calls can be recorded in bfloat16/float16 only.
    fast_call_16_bit_strategies: frozenset = frozenset()

    def _records(self, variant) -> bool:
        """Whether a call of this variant can be recorded for replay."""
        strategy = variant.plan.strategy
        return strategy in self.fast_call_strategies or (
            strategy in self.fast_call_16_bit_strategies and variant.plan.precision in HALF_PRECISION_DTYPES)

    def _fast_forward(self, *inputs):
        """The output of a recorded call that matches these inputs, or None: take the Python path.
        Not while torch.compile traces (the operator of pairgen/library.py is what it sees)."""
        if torch.compiler.is_compiling():
            return None
        stream_index = stream = None  # the current stream fetched once per device, not per recording tried
        for replay, recorded, index in self._fast_calls:
            if index != stream_index:
                stream_index, stream = index, current_raw_stream(index)
            out = replay(recorded, stream, *inputs)
            if out is not None:
                return out
        return None

    def forget_fast_calls(self) -> None:
        """Drop the recordings (the variant, the precision or the call's mode changed)."""
        self.__dict__.pop("_fast_calls", None)

    def _launch_recorded(self, inputs: tuple, variant, run: "Callable[[], torch.Tensor] | None" = None):
        """_launch (or `run`, a call of the variant on `inputs` by other means), recorded for
        replay where the call allows it (see fastcall.py)."""
        if run is None:
            run = functools.partial(self._launch, *inputs, variant=variant)
        if not self._records(variant):
            return run()
        replayer = native.fastcall()  # the first request starts the compiled module's build
        if (replayer is None or self._reference_only or self.__dict__.get("_state_per_call")
                or torch.is_autocast_enabled("cuda") or torch.cuda.is_current_stream_capturing()):
            return run()
        counts = self.__dict__.setdefault("_fast_call_counts", [0, 0])  # slow calls, recordings
        counts[0] += 1
        if not fastcall.may_record(*counts):
            return run()
        counts[1] += 1
        with fastcall.recording() as (launches, scratch):
            out = run()
        packs, held = self._held_for_fast_calls()
        epochs = [(counter, counter[0]) for counter in (_STRUCTURE_EPOCH, _DATA_EPOCH, runtime.GENERATION)]
        recorded = fastcall.build(inputs, out, launches, scratch, packs, held, epochs)
        if recorded is not None:
            entry = (replayer.call, recorded, inputs[0].get_device())
            self.__dict__["_fast_calls"] = (entry,) + self._fast_calls[: self.MAX_FAST_CALLS - 1]
        return out

    def _packed_for(self, key, pack: Callable[[list], torch.Tensor]) -> "PackedParameters":
        """Another packing of the module's weights (a tensor-core layout in an operand dtype), kept
        per key beside the fp32 one and, as it, rebuilt only after a parameter changed. `pack`
        takes the parameters in the order of the fp32 pack's paths."""
        packs = self.__dict__.get("_extra_packs")
        if packs is None:
            packs = self.__dict__["_extra_packs"] = {}
        packed = packs.get(key)
        if packed is None:
            packed = packs[key] = PackedParameters(self, self._weights._paths, pack)
        return packed

    def _held_for_fast_calls(self) -> tuple[list, list]:
        """(the module's PackedParameters, the other tensors it holds between calls): what a
        recorded call may point into besides its inputs and output."""
        packs, held = [], []
        for value in self.__dict__.values():
            if isinstance(value, PackedParameters):
                packs.append(value)
            elif isinstance(value, HeldBuffer):
                held += [value.live, *value.retired]
            elif isinstance(value, dict):  # the tensor-core packs (_packed_for)
                packs += [v for v in value.values() if isinstance(v, PackedParameters)]
            elif isinstance(value, tuple):  # e.g. the triangle update's (device, barrier ints)
                held += [v for v in value if isinstance(v, torch.Tensor)]
        return packs, held

    def __setstate__(self, state):
        super().__setstate__(state)
        self._handle = library.register(self)  # a copy is another module, with its own handle

    def _barrier_ints(self, device: torch.device) -> int:
        """The grid barrier's ints on this device (common/grid_barrier.cuh; the readout's fused
        strategy counts its prologue blocks in the first, common/block_roles.cuh), zeroed once: each
        launch leaves them as the next one needs them (the counts at 0, the barrier's sense flipped),
        so no launch needs a memset. Two launches of the same module on different streams at once
        would share them."""
        index = device.index or 0
        if self.__dict__.get("_state_per_call"):  # inside an operator call (library.state_per_call)
            return self._call_buffer(index, 2, torch.int32, zeroed=True)
        held = self.__dict__.get("_barrier")  # (device index, the two ints), made on first use
        if held is None or held[0] != index:
            held = self._barrier = (index, torch.zeros(2, device=device, dtype=torch.int32))
        return held[1].data_ptr()

    def _call_buffer(self, index: int, count: int, dtype: torch.dtype, zeroed: bool) -> int:
        """A buffer for one operator call (library.state_per_call): kept until that call ends, so
        no later allocation of the call reuses it before its kernel is enqueued, then dropped."""
        device = torch.device("cpu") if index < 0 else torch.device("cuda", index)
        buffer = (torch.zeros if zeroed else torch.empty)(count, device=device, dtype=dtype)
        self.__dict__.setdefault("_call_buffers", []).append(buffer)
        return buffer.data_ptr()

    @property
    def backward_mode(self) -> str:
        """How a call that autograd records gets its gradients:
        "closed_form": the op's closed-form gradients (backward_precision says in what): the
        forward computed the closed form's way with its intermediates kept for the backward where
        the op can (saving_forward), else, or with recompute_for_backward, the kernel forward and a
        backward that recomputes them from the inputs (the least memory);
        "reference": the reference module in PyTorch, forward and backward, in the call's dtype
        (autograd saves the reference's intermediates), exactly what pairgen replaces;
        "auto" (the default): the closed form for fp32 calls, where it is the faster of the two
        for every op; for 16-bit calls and autocast, the closed form where the op computes it in
        16 bits with fused kernels and the call is large enough for that to pay (the triangle
        update: fast_16_bit_closed_form), else the reference (docs/performance.md has the
        measurements)."""
        return self._backward_mode

    @backward_mode.setter
    def backward_mode(self, mode: str) -> None:
        if mode not in self.BACKWARD_MODES:
            raise ValueError(f"backward_mode must be one of {', '.join(map(repr, self.BACKWARD_MODES))}, got {mode!r}")
        self._backward_mode = mode

    def trains_through_reference(self, precision: str, inputs: tuple) -> bool:
        """Whether a training call on `inputs` in `precision` (kernel_precision's name) runs the
        reference."""
        mode = self._backward_mode
        if mode == "auto" and precision in ("bfloat16", "float16"):
            return not self.fast_16_bit_closed_form(inputs)
        return mode == "reference"

    def fast_16_bit_closed_form(self, inputs: tuple) -> bool:
        """Whether this op's closed form in 16 bits beats PyTorch's 16-bit backward on these inputs
        ("auto" takes it then). None does by default; an op with fused 16-bit backward kernels
        says where."""
        return False

    def force_variant(self, variant) -> None:
        """Run `variant` (a runtime.Variant) instead of the tuned choice; None restores it."""
        self._forced_plan = variant
        self.forget_fast_calls()

    def uses_kernel(self, *tensors: torch.Tensor) -> bool:
        """CUDA float32 runs a kernel. Callers have validated the inputs first (one device,
        the parameters' dtype), so the first tensor speaks for all of them."""
        first = tensors[0]
        return first.is_cuda and first.dtype is torch.float32

    def kernel_precision(self, *tensors: torch.Tensor) -> str | None:
        """The precision a kernel would compute this call in (a tuned key's dtype), or None: run
        the reference. Exact fp32 unless the op says otherwise; under torch.autocast the reference
        (an op with low-precision kernels overrides this), whose dtypes autocast decides."""
        if torch.is_autocast_enabled("cuda"):
            return None
        return "float32" if self.uses_kernel(*tensors) else None

    def variant_for(self, n: int, device: "torch.device | int", precision: str = "float32"):
        """The variant for length n on this device (a torch.device or a CUDA index; None: run the
        reference). A default variant whose first-use check has not run yet is returned as is."""
        choice = self._choice_for(n, device, precision)
        return choice.winner if type(choice) is first_use.Pending else choice

    def _choice_for(self, n: int, device: "torch.device | int", precision: str):
        """variant_for, or a first_use.Pending. Cached on the module: the host time of a call is
        what small shapes are made of."""
        if self._forced_plan is not None:
            return self._forced_plan
        cache = self._variant_cache
        generation = runtime.generation()
        if cache is None or cache["generation"] != generation:
            cache = self._variant_cache = {"generation": generation}
        key = (device if type(device) is int else device.index or 0, n, precision)
        variant = cache.get(key, cache)
        if variant is cache:
            if len(cache) > self.MAX_CACHED_LENGTHS:
                for old in [k for k in cache if k != "generation"][: self.MAX_CACHED_LENGTHS // 2]:
                    del cache[old]
            variant = cache[key] = runtime.select(self.op, precision, self.widths, n, key[0])
        return variant

    def explain(self, n: int, device: torch.device | int | None = None,
                precision: str = "float32") -> "runtime.Explanation":
        """What this module runs for length n on a GPU in `precision` (a tuned key's dtype: "float32",
        "bfloat16", ...), where that came from, its parameters and its measured time (see runtime.explain).
        For the CPU device, or where torch sees no CUDA GPU, it says so: a call there runs the reference."""
        if isinstance(device, int):
            index = device
        else:
            device = torch.device(device or "cuda")
            if device.type != "cuda":
                return runtime.explain_on_cpu(self.op, n, "a call on CPU tensors")
            index = device.index or 0
        if not torch.cuda.is_available():
            return runtime.explain_on_cpu(self.op, n, "a CPU call: torch sees no CUDA GPU here (`pairgen-tune "
                                                      "--explain --gpu SLUG --arch sm_XY` says what a GPU would run)")
        return runtime.explain(self.op, precision, self.widths, n, index)

    def _dispatch(self, *inputs: torch.Tensor):
        if torch.compiler.is_compiling():  # torch.compile sees one operator (pairgen/library.py)
            return library.compiled_call(self, self.op.name, inputs)
        if self._reference_only:  # the operators' functional path: the reference on swapped-in weights
            return self.reference_forward(*inputs)
        precision = self.kernel_precision(*inputs)
        if precision is None:
            return self._without_kernel(inputs)
        training = torch.is_grad_enabled() and self._needs_grad(inputs)
        if training and self.trains_through_reference(precision, inputs):
            return self.reference_forward(*inputs)
        first = inputs[0]
        variant = self._choice_for(first.shape[1], first.get_device(), precision)
        if type(variant) is first_use.Pending:
            variant = self._first_use(variant, inputs, precision)
        if variant is None:
            if precision in HALF_PRECISION_DTYPES:  # no 16-bit kernel fits these widths: a call no kernel
                return self._without_kernel(inputs)  # computes in its dtype (the fp32 kernel where it pays)
            return self.reference_forward(*inputs)  # disabled, or no kernel fits these widths
        if training:
            if self._saves_for_backward(inputs):
                return SavedClosedForm.run(self, inputs)
            return ReferenceBackward.apply(self, len(inputs), variant, *inputs, *self.parameters())
        return self._launch_recorded(inputs, variant)

    def _without_kernel(self, inputs: tuple):
        """A call no kernel computes in its own dtype, run as without_kernel_path says."""
        training = torch.is_grad_enabled() and self._needs_grad(inputs)
        path, fp32_call = self.without_kernel_path(inputs, training)
        if path == "fp32 kernel":
            variant, wide = fp32_call
            with autocast_off():  # a strategy's own PyTorch products stay fp32
                out = self._launch(*wide, variant=variant)
            return as_dtype(out, self.closed_form_output_dtype(inputs[0], current_autocast()))
        if path == "reference":
            return self.reference_forward(*inputs)
        if training:
            return SavedClosedForm.run(self, inputs)
        return self.closed_form_forward(inputs, {name: p.detach() for name, p in self.named_parameters()})[0]

    def without_kernel_path(self, inputs: tuple, training: bool) -> tuple:
        """What a call no kernel computes in its own dtype (16 bits, autocast) runs, as (path,
        detail): ("fp32 kernel", (its variant, the inputs made fp32)) for a forward where
        fp32_kernel_pays and a variant that has passed its first-use check serves them (that check
        times the fp32 reference, which a 16-bit module cannot run); ("closed form", None) where
        closed_form_without_kernel allows it and the call takes it (a forward: closed_form_pays; a
        training call: not trains_through_reference, and the intermediates can be kept);
        ("reference", None) otherwise, and always under PAIRGEN_DISABLE."""
        first = inputs[0]
        if not (first.is_cuda and first.dtype in CLOSED_FORM_DTYPES) or config.disabled():
            return "reference", None
        if not training and self._backward_mode != "reference" and self.fp32_kernel_pays(inputs):
            wide = tuple(as_dtype(t, torch.float32) if t.is_floating_point() else t for t in inputs)
            if self.uses_kernel(*wide):
                variant = self._choice_for(first.shape[1], first.get_device(), "float32")
                if variant is not None and type(variant) is not first_use.Pending:
                    return "fp32 kernel", (variant, wide)
        if not (self.closed_form_without_kernel and self.closed_form_applies(inputs)):
            return "reference", None
        if training:
            precision = HALF_DTYPE_NAMES.get(current_autocast() or first.dtype, "float32")
            takes = not self.trains_through_reference(precision, inputs) and self._saves_for_backward(inputs)
        else:
            takes = self._backward_mode != "reference" and self.closed_form_pays(inputs)
        return ("closed form" if takes else "reference"), None

    def fp32_kernel_pays(self, inputs: tuple) -> bool:
        """Whether a forward no kernel computes in its own dtype (16 bits, autocast) is faster
        through the op's exact fp32 kernel on the inputs made fp32 (weights packed in fp32, as
        always) than through the reference in that dtype; the op says where. Its result is exact
        fp32 of the rounded inputs, in the reference's dtype."""
        return False

    def closed_form_forward(self, inputs: tuple, params: dict) -> tuple:
        """The op's forward computed the closed form's way (saving_forward) on `inputs` and
        `params` (by name), in the precision backward_precision names under the current autocast:
        (the output in the reference's dtype, what saved_gradients needs)."""
        autocast = current_autocast()
        out, saved = self.saving_forward(self, *inputs, params, self.backward_precision(inputs[0], autocast))
        return as_dtype(out, self.closed_form_output_dtype(inputs[0], autocast)), saved

    def closed_form_pays(self, inputs: tuple) -> bool:
        """Whether a forward no kernel computes is faster through the closed form than through the
        reference (an op with closed_form_without_kernel says where: small calls are bound by the
        host's time per PyTorch operation, and the closed form issues more of them)."""
        return False

    def closed_form_output_dtype(self, first: torch.Tensor, autocast: "torch.dtype | None") -> torch.dtype:
        """The dtype the reference returns for a call whose first input is `first`, under an
        autocast to `autocast` (None: none): what a closed-form call returns. The autocast dtype
        when there is one (the reference ends in a Linear's output), else the input's; an op whose
        reference ends otherwise says so."""
        return autocast or first.dtype

    def _first_use(self, pending: "first_use.Pending", inputs: tuple, precision: str):
        """Settle a default variant against the reference on this call's inputs (first_use.py),
        then remember the winner in this module's cache (a variant, or None: the reference)."""
        first = inputs[0]
        winner = pending.settle(lambda: self._launch(*inputs, variant=pending.variant),
                                lambda: self.reference_forward(*inputs), first.device)
        if pending.settled:
            self._variant_cache[(first.get_device(), first.shape[1], precision)] = winner
        return winner

    #: The op's closed-form gradients (pairgen/ops/<op>/backward.py), as a staticmethod:
    #: gradients(module, *inputs, params_by_name, grad_out, precision=, frozen=) -> {key: gradient};
    #: None: no closed form, the backward recomputes the reference.
    closed_form: Callable | None = None
    #: Per input, the key of its gradient in closed_form's result (None: it gets none, a mask).
    input_gradients: tuple = ("input",)

    def analytic_gradients(self, inputs: list, params: list, grad_out: torch.Tensor,
                           autocast: "torch.dtype | None" = None, wanted: "list[bool] | None" = None) -> list | None:
        """Gradients of every input and parameter, in order (None for those that get none), in
        closed form; None where the op has no closed form for this call (the reference is then
        recomputed under autograd). autocast: the dtype of the torch.autocast the forward ran
        under (None: none). wanted: per parameter, whether its gradient is wanted (None: all
        are); the others' products are skipped."""
        first = inputs[0]
        if self.closed_form is None or first.dtype not in CLOSED_FORM_DTYPES or not self.closed_form_applies(inputs):
            return None
        names = [name for name, _ in self.named_parameters()]
        grads = self.closed_form(self, *inputs, dict(zip(names, params)), grad_out,
                                 precision=self.backward_precision(first, autocast), frozen=frozen_names(names, wanted))
        return [grads[key] if key else None for key in self.input_gradients] + [grads.get(name) for name in names]

    #: The op's forward computed the closed form's way, keeping what its backward needs, as
    #: staticmethods: saving_forward(module, *inputs, params_by_name, precision) -> (out, saved);
    #: saved_gradients(module, saved, grad_out, frozen) -> closed_form's result. None: the op's
    #: training calls run the kernel forward and recompute (recompute_for_backward).
    saving_forward: Callable | None = None
    saved_gradients: Callable | None = None

    def closed_form_applies(self, inputs: list) -> bool:
        """Whether closed_form covers this call's inputs (an op narrows it)."""
        return True

    def _saves_for_backward(self, inputs) -> bool:
        """Whether a training call runs SavedClosedForm (the caller has ruled the reference out).
        Not while saved-tensor hooks are active (non-reentrant activation checkpointing,
        torch.autograd.graph.save_on_cpu): they manage only what save_for_backward saves, and the
        kept intermediates would escape them (checkpointing would free nothing); the recomputing
        path saves just the inputs, through the hooks."""
        return (self.saving_forward is not None and not self.recompute_for_backward
                and inputs[0].dtype in CLOSED_FORM_DTYPES and self.closed_form_applies(inputs)
                and not _saved_tensor_hooks_active())

    def backward_precision(self, x: torch.Tensor, autocast: "torch.dtype | None") -> str:
        """What the closed form computes in (closed_form.COMPUTE_DTYPES): 16-bit modules in their
        dtype, and calls under a 16-bit autocast in its dtype (16-bit tensor cores, fp32
        accumulation and LayerNorm statistics, as PyTorch's own 16-bit forward and backward: the
        standard they meet is the 16-bit one; computing them in fp32 measured slower than the
        16-bit reference); exact fp32 otherwise, tf32x3 modules included (splitting pair-sized
        operands into TF32 heads and tails in PyTorch cost more than the tensor cores saved)."""
        half = HALF_DTYPE_NAMES.get(autocast or x.dtype)  # autocast's dtype, else a 16-bit module's
        return half if half is not None else "ieee"

    def _run(self, variant, *tensors) -> None:
        """The variant's strategy runs it on prepared tensors (inputs..., out)."""
        self.runners[variant.plan.strategy](self, variant, *tensors)

    def _needs_grad(self, inputs) -> bool:
        return any(t.requires_grad for t in inputs) or any(p.requires_grad for p in self.parameters())


def check_float_tensor(name: str, t, rank: int, param: torch.Tensor) -> None:
    """Type, dtype, rank, and the device of `param` (one of the module's parameters)."""
    if isinstance(t, torch.Tensor) and t.dtype is param.dtype and t.dim() == rank and t.device == param.device:
        return  # the common case, cheap: the checks below only build the message
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


def check_mask(name: str, mask, shape: tuple, device: torch.device) -> None:
    """Every op takes the same masks: bool, integer or floating point, of the given shape, on the
    inputs' device. An integer mask is read as mask != 0 (see as_mask)."""
    if isinstance(mask, torch.Tensor) and mask.shape == shape and mask.device == device and not mask.dtype.is_complex:
        return  # the common case; the checks below build the message
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != shape:
        raise ValueError(f"{name} must have shape (B, N, N) = {tuple(shape)}, got {tuple(mask.shape)}")
    if mask.dtype.is_complex:
        raise ValueError(f"{name} must be bool, integer or floating point, got dtype {mask.dtype}")
    raise ValueError(f"{name} is on {mask.device} but the inputs are on {device}")


def as_mask(mask: torch.Tensor) -> torch.Tensor:
    """An integer mask as bool (mask != 0), so 0/1 or 0/255 masks of any integer type mean keep or
    drop in every op, on the kernel path and the reference path alike; bool and floating-point
    masks as they are (each op says how it reads a floating-point one)."""
    if mask.dtype is torch.bool or mask.dtype.is_floating_point:
        return mask
    return mask != 0


@contextlib.contextmanager
def cublas_fp32_mode(tf32: bool):
    """cuBLAS fp32 matmuls inside run in exact fp32 (tf32=False), even where the caller allowed TF32,
    or on TF32 tensor cores (tf32=True: the tf32 and tf32x3 precisions' GEMMs, whose operands the
    kernels have rounded to TF32 already); the caller's setting is restored after. Through the
    fp32_precision API where torch has it (2.9+): there, reading the legacy allow_tf32 raises once a
    caller has used the new API, so the legacy flag would break such callers; the new API read and
    written this way leaves a legacy caller's flag as it was."""
    matmul = torch.backends.cuda.matmul
    new_api = hasattr(matmul, "fp32_precision")
    saved = matmul.fp32_precision if new_api else matmul.allow_tf32
    wanted = ("tf32" if tf32 else "ieee") if new_api else tf32
    if saved != wanted:
        setattr(matmul, "fp32_precision" if new_api else "allow_tf32", wanted)
    try:
        yield
    finally:
        if saved != wanted:
            setattr(matmul, "fp32_precision" if new_api else "allow_tf32", saved)


def fp32_matmul():
    """cuBLAS fp32 matmuls inside run in exact fp32 (see cublas_fp32_mode)."""
    return cublas_fp32_mode(False)


def contiguous_aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous with its data on a 16-byte boundary, copied only when it is not: the kernels
    read rows with float4 loads and cp.async, which fault on a view that starts mid-vector (a
    contiguous slice such as x[1:] of a flat tensor, or a narrowed last dimension made contiguous)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


class TensorCorePrecisions:
    """For a KernelModule with tensor-core kernels: `precision` ("ieee": exact fp32, the default;
    "tf32x3"; "tf32") says what its fp32 calls compute in; 16-bit modules compute in their dtype,
    fp32 ones under torch.autocast in autocast's. Mixed in before KernelModule."""

    _precision = "ieee"

    @property
    def precision(self) -> str:
        """What an fp32 call computes in: "ieee" (exact fp32), "tf32x3" or "tf32" (docs/ops.md)."""
        return self._precision

    @precision.setter
    def precision(self, value: str) -> None:
        if value not in FP32_PRECISIONS:
            raise ValueError(f"precision must be one of {tuple(FP32_PRECISIONS)}, got {value!r}")
        self._precision = value
        self.forget_fast_calls()

    def extra_repr(self) -> str:
        return "" if self._precision == "ieee" else f"precision={self._precision!r}"

    def kernel_precision(self, x, *rest) -> str | None:
        """float32 in the module's precision, or autocast's dtype under torch.autocast("cuda");
        bfloat16/float16 in their own; None (the reference) on CPU, for other dtypes, for a 16-bit
        input under an autocast of the other 16-bit dtype, and past 2^31 pairs (32-bit indices)."""
        if not x.is_cuda or x.shape[0] * x.shape[1] * x.shape[1] >= 2**31:
            return None
        autocast = torch.is_autocast_enabled("cuda")
        if x.dtype is torch.float32:
            return HALF_DTYPE_NAMES.get(torch.get_autocast_dtype("cuda")) if autocast else FP32_PRECISIONS[self._precision]
        precision = HALF_DTYPE_NAMES.get(x.dtype)
        if autocast and torch.get_autocast_dtype("cuda") is not x.dtype:
            return None
        return precision
