"""Which path a drop-in module's call runs, decided in one place.

`route(module, inputs)` returns a `Route`: the path (PATHS), why, and what the path needs (the
kernel precision and variant). `KernelModule._dispatch` runs the route it returns;
`KernelModule.explain(n)` prints the routes of an inference and a training call of that length.
A call like a recent kernel call never gets here: the op's forward replays it first
(`KernelModule._fast_forward`, path FAST_REPLAY).

The decision, in order:

1. torch.compile is tracing: the module's torch.library operator (COMPILED).
2. The operators' functional path (`_reference_only`): the reference.
3. No kernel computes the call in its own dtype (`module.kernel_precision` is None: CPU tensors,
   float64, an autocast of the other 16-bit dtype, past 32-bit indices): `_without_kernel` below.
4. A training call (grad mode on, an input or a parameter requires a gradient) that the
   backward mode trains in PyTorch (`trains_through_reference`): the reference.
5. The module's variant for (device, N, precision) (`module._choice_for`, cached per module). A
   default variant not yet timed is timed now (`module._first_use`) against what runs without
   it: the closed form for a 16-bit forward `_without_kernel` sends there, else the reference.
   None (PAIRGEN_DISABLE, no kernel fits the widths, the kernel measured slower): a 16-bit
   call goes to `_without_kernel`, an fp32 one to the reference.
6. A training call: SAVED_CLOSED_FORM where the op keeps its forward's intermediates
   (`saves_for_backward`), else KERNEL_TRAINING (the kernel forward; a backward in closed form
   where it applies, else the reference recomputed). An inference call: KERNEL.

`_without_kernel` (calls no kernel computes in their dtype): the reference on the CPU, for a
dtype no closed form takes, and under PAIRGEN_DISABLE; for a forward, the op's exact fp32 kernel
on the inputs made fp32 up to `Routing.fp32_kernel_max_pairs`, else its closed form from
`Routing.closed_form_min_pairs`; for a training call the closed form where the backward mode
takes it and the intermediates can be kept; the reference otherwise.

What varies by op is data (`Routing`, a class attribute of each drop-in module) and a few
methods that describe a call rather than choose a path: `kernel_precision` / `uses_kernel` (which
kernel precision serves these inputs), `closed_form_applies` (whether the closed form covers
them), `saving_forward` (whether the op can keep its forward's intermediates)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import config, first_use
from ..precision import CLOSED_FORM_DTYPES, HALF_BY_DTYPE, HALF_DTYPES
from . import training_replay
from .autograd import saved_tensor_hooks_active
from .modes import as_dtype, current_autocast

# ---- the paths ---------------------------------------------------------------------------------

FAST_REPLAY = "fast replay"              # a call like a recorded one, replayed in compiled code (before dispatch)
TRAINING_REPLAY = "its forward and backward replayed in compiled code"  # training_replay.py, after a recorded call
KERNEL = "kernel forward"                # the tuned kernels, recorded for fast replay where the strategy allows
KERNEL_TRAINING = "kernel forward, closed-form backward"  # ReferenceBackward: closed form, else the reference recomputed
SAVED_CLOSED_FORM = "saved closed form"  # SavedClosedForm: the closed form's forward, its intermediates kept
CLOSED_FORM = "closed form"              # the closed form's forward (cuBLAS products, fused row kernels)
FP32_KERNEL = "fp32 kernel"              # the exact fp32 kernels on the inputs made fp32
FIRST_USE = "first-use check"            # a default variant, timed against the reference on this call
REFERENCE = "reference"                  # the PyTorch reference module
COMPILED = "compiled operator"           # torch.ops.pairgen.<op>, what torch.compile traces
PATHS = (FAST_REPLAY, KERNEL, KERNEL_TRAINING, SAVED_CLOSED_FORM, CLOSED_FORM, FP32_KERNEL, FIRST_USE, REFERENCE,
         COMPILED)


class Route(NamedTuple):
    """Which path a call runs (one of PATHS), why, and what the path runs: the kernel precision (a
    tuned key's dtype) and the variant of a kernel path (a first_use.Pending for FIRST_USE), the
    inputs made fp32 for FP32_KERNEL."""
    path: str
    reason: str
    precision: "str | None" = None
    variant: object = None
    inputs: "tuple | None" = None

    def __str__(self) -> str:
        variant = self.variant
        if type(variant) is first_use.Pending:
            variant = variant.variant
        plan = getattr(variant, "plan", None)
        what = ", ".join(x for x in (self.precision, getattr(plan, "label", None)) if x)
        return f"{self.path}{f' [{what}]' if what else ''}: {self.reason}"


# ---- the op's facts, and the thresholds, as data ------------------------------------------------

#: How a training call gets its gradients (KernelModule.backward_mode): "auto" takes the closed
#: form for fp32 calls (the faster for every op) and, for 16-bit calls and autocast, where
#: Routing.closed_form_16_bit_training_min_pairs says; "closed_form" always where the op has one;
#: "reference" trains in PyTorch.
BACKWARD_MODES = ("auto", "closed_form", "reference")


@dataclass(frozen=True)
class Routing:
    """An op's dispatch facts and thresholds, in pairs (B*N*N) of one call. The defaults: an op
    whose 16-bit calls without a kernel run the reference, and whose 16-bit training runs in
    PyTorch under "auto"."""
    #: A forward no kernel computes in its own dtype (16 bits, autocast) runs the op's exact fp32
    #: kernel on the inputs made fp32 up to this many pairs (-1: never).
    fp32_kernel_max_pairs: int = -1
    #: Calls no kernel computes may run the op's closed form on the GPU: a forward from this many
    #: pairs, a training call where the backward mode takes the closed form. None: never.
    closed_form_min_pairs: "int | None" = None
    #: "auto" trains a 16-bit call (or one under autocast) through the closed form from this many
    #: pairs (None: never), and only with the fused backward kernels (PAIRGEN_FUSED_BACKWARD) where
    #: the next field says so.
    closed_form_16_bit_training_min_pairs: "int | None" = None
    closed_form_16_bit_training_needs_fused_kernels: bool = True
    #: Whether a closed-form training call whose signature repeats replays CUDA graphs of its
    #: forward and backward (pairgen/module/captured.py) unless the module's
    #: capture_training_steps says otherwise: on for ops a model holds once (heads), whose steps
    #: wait on the host; off where a model holds many (each capture keeps its memory).
    captured_training_steps: bool = False
    #: Up to this many pairs: above, a step is bound by the GPU, and the captured step's copies
    #: (the inputs in, the gradients out) cost more than the host's time it saves.
    captured_training_max_pairs: int = 2**18


def pairs(first: torch.Tensor) -> int:
    """B*N*N of a call whose first input is (B, N, N, ...) or (B, N, ...)."""
    shape = first.shape
    return shape[0] * shape[1] * shape[1]


# ---- the decision --------------------------------------------------------------------------------

_COMPILING = Route(COMPILED, "torch.compile is tracing: the module's torch.library operator (pairgen/library.py)")
_REFERENCE_ONLY = Route(REFERENCE, "the operator's functional path: the reference on the weights it was given")
_NOT_SERVED = Route(REFERENCE, "CPU tensors, or a dtype that neither a kernel nor the closed form computes in")
_DISABLED = Route(REFERENCE, "PAIRGEN_DISABLE is set")
_NO_VARIANT = Route(REFERENCE, "no kernel for this length: PAIRGEN_DISABLE, no kernel fits these widths, or the "
                               "reference measured faster (module.explain(n) says which)")
_MODE_REFERENCE = Route(REFERENCE, "backward_mode 'reference' trains in PyTorch")
_AUTO_16_BIT_REFERENCE = Route(REFERENCE, "backward_mode 'auto' trains this 16-bit call in PyTorch: the op's "
                                          "16-bit closed form does not pay at this size (Routing)")
_NO_CLOSED_FORM = Route(REFERENCE, "no kernel computes this dtype, and the op's closed form does not run "
                                   "without one for this call (Routing.closed_form_min_pairs, closed_form_applies)")
_NOT_KEPT = Route(REFERENCE, "no kernel computes this dtype, and the closed form cannot keep its intermediates "
                             "here (recompute_for_backward, saved-tensor hooks)")
_FORWARD_REFERENCE = Route(REFERENCE, "no kernel computes this dtype, and neither the fp32 kernel nor the closed "
                                      "form pays at this size (Routing)")
_CLOSED_FORM = Route(CLOSED_FORM, "no kernel runs this call (none computes this dtype, none fits these widths, or "
                                  "the closed form measured faster); the closed form pays from this size (Routing)")
_SAVED_WITHOUT_KERNEL = Route(SAVED_CLOSED_FORM, "no kernel computes this dtype; the backward mode takes the closed "
                                                 "form, its forward keeping the intermediates")
_KERNEL = "the module's variant for this length and precision"
_KERNEL_TRAINING = ("a training call: the kernel forward; the backward in closed form where it applies, else the "
                    "reference recomputed under autograd")
_SAVED = "a training call: the closed form's forward keeps its intermediates for the backward"
_FIRST_USE = "a default variant, timed against the reference on this call before either runs"
_FP32_KERNEL = "no kernel computes this dtype; the exact fp32 kernel on the inputs made fp32 pays at this size"


def route(module, inputs: tuple, settle: bool = True) -> Route:
    """The path this call of `module` on `inputs` (validated) runs. settle: time a default
    variant's first use now (the call is about to run; False: report FIRST_USE instead)."""
    if torch.compiler.is_compiling():
        return _COMPILING
    if module._reference_only:
        return _REFERENCE_ONLY
    precision = module.kernel_precision(*inputs)
    training = torch.is_grad_enabled() and module._needs_grad(inputs)
    if precision is None:
        return _without_kernel(module, inputs, training)
    if training and trains_through_reference(module, precision, inputs):
        return _MODE_REFERENCE if module._backward_mode == "reference" else _AUTO_16_BIT_REFERENCE
    first = inputs[0]
    variant = module._choice_for(first.shape[1], first.get_device(), precision)
    if type(variant) is first_use.Pending:
        if not settle:
            return Route(FIRST_USE, _FIRST_USE, precision, variant)
        closed_form = None if training else closed_form_instead(module, inputs, precision)
        if closed_form is not None:
            variant = module._first_use(variant, inputs, precision, reference=closed_form, rival="the closed form")
        else:
            variant = module._first_use(variant, inputs, precision)
    if variant is None:
        if precision in HALF_DTYPES:  # no 16-bit kernel fits, or it lost: the fp32 kernel or closed form where they pay
            return _without_kernel(module, inputs, training)
        return _NO_VARIANT
    if training:
        if saves_for_backward(module, inputs):
            return Route(SAVED_CLOSED_FORM, _SAVED, precision, variant)
        return Route(KERNEL_TRAINING, _KERNEL_TRAINING, precision, variant)
    # The route of the module's last kernel call, kept: building a Route costs 0.3 µs of host time
    # and a repeated call's is the same.
    last = module.__dict__.get("_kernel_route")
    if last is not None and last[3] is variant and last[2] == precision:
        return last
    last = module.__dict__["_kernel_route"] = Route(KERNEL, _KERNEL, precision, variant)
    return last


def closed_form_instead(module, inputs: tuple, precision: str):
    """The op's closed form on `inputs`, as a call, where an inference forward in `precision`
    runs it when that precision's kernel is missing or loses (16 bits, from the size Routing
    names): the rival a 16-bit kernel has to beat, at its first use and in the tuner. None where
    the reference runs instead."""
    if precision in HALF_DTYPES and _without_kernel(module, inputs, False).path == CLOSED_FORM:
        return lambda: module._closed_form_call(inputs)
    return None


def _without_kernel(module, inputs: tuple, training: bool) -> Route:
    """A call no kernel computes in its own dtype (16 bits, autocast). The fp32 kernel only for a
    variant that has passed its first-use check: that check times the fp32 reference, which a
    16-bit module cannot run."""
    first = inputs[0]
    if not (first.is_cuda and first.dtype in CLOSED_FORM_DTYPES):
        return _NOT_SERVED
    if config.disabled():
        return _DISABLED
    routing, mode = module.routing, module._backward_mode
    if not training and mode != "reference" and pairs(first) <= routing.fp32_kernel_max_pairs:
        wide = tuple(as_dtype(t, torch.float32) if t.is_floating_point() else t for t in inputs)
        if module.uses_kernel(*wide):
            variant = module._choice_for(first.shape[1], first.get_device(), "float32")
            if variant is not None and type(variant) is not first_use.Pending:
                return Route(FP32_KERNEL, _FP32_KERNEL, "float32", variant, wide)
    if routing.closed_form_min_pairs is None or not module.closed_form_applies(inputs):
        return _NO_CLOSED_FORM
    if training:
        precision = HALF_BY_DTYPE.get(current_autocast() or first.dtype, "float32")
        if trains_through_reference(module, precision, inputs):
            return _MODE_REFERENCE if mode == "reference" else _AUTO_16_BIT_REFERENCE
        return _SAVED_WITHOUT_KERNEL if saves_for_backward(module, inputs) else _NOT_KEPT
    if mode != "reference" and pairs(first) >= routing.closed_form_min_pairs:
        return _CLOSED_FORM
    return _MODE_REFERENCE if mode == "reference" else _FORWARD_REFERENCE


def trains_through_reference(module, precision: str, inputs: tuple) -> bool:
    """Whether a training call on `inputs` in `precision` (kernel_precision's name) runs the
    reference, as the module's backward_mode says (BACKWARD_MODES)."""
    mode = module._backward_mode
    if mode == "auto" and precision in HALF_DTYPES:
        routing = module.routing
        least = routing.closed_form_16_bit_training_min_pairs
        if least is None or (routing.closed_form_16_bit_training_needs_fused_kernels and not config.fused_backward()):
            return True
        # A step replayed from CUDA graphs, or from compiled code, no longer waits on the host's
        # issue of its operations, which is what the threshold weighs: the closed form at every size.
        return (pairs(inputs[0]) < least and not captures_training_step(module, inputs)
                and not training_replay.replays(module, inputs[0]))
    return mode == "reference"


def captures_training_step(module, inputs: tuple) -> bool:
    """Whether a closed-form training call (SavedClosedForm) may replay captured CUDA graphs
    (pairgen/module/captured.py): the module says so (capture_training_steps, else its Routing),
    on CUDA, at most Routing.captured_training_max_pairs pairs, the op can
    (closed_form_capturable), and not inside a capture of the caller's own."""
    wanted = module.capture_training_steps
    if wanted is None:
        wanted = module.routing.captured_training_steps
    first = inputs[0]
    return (bool(wanted) and first.is_cuda and pairs(first) <= module.routing.captured_training_max_pairs
            and not torch.cuda.is_current_stream_capturing() and module.closed_form_capturable(inputs))


def saves_for_backward(module, inputs) -> bool:
    """Whether a training call runs SavedClosedForm (the caller has ruled the reference out).
    Not while saved-tensor hooks are active (non-reentrant activation checkpointing,
    torch.autograd.graph.save_on_cpu): they manage only what save_for_backward saves, and the
    kept intermediates would escape them (checkpointing would free nothing); the recomputing
    path saves just the inputs, through the hooks."""
    return (module.saving_forward is not None and not module.recompute_for_backward
            and inputs[0].dtype in CLOSED_FORM_DTYPES and module.closed_form_applies(inputs)
            and not saved_tensor_hooks_active())


# ---- explain: the routes of stand-in calls --------------------------------------------------------

def stand_in(shape: tuple, dtype: torch.dtype, device, requires_grad: bool = False) -> torch.Tensor:
    """A tensor of this shape, dtype and device holding one element (expanded): what the route
    reads of an input (shape, dtype, device, requires_grad) without its memory."""
    one = torch.zeros((), dtype=dtype, device=device, requires_grad=requires_grad)
    return one.expand(shape)


def stand_in_inputs(module, batch: int, n: int, dtype: torch.dtype, device, training: bool) -> tuple:
    """Inputs of a call of `module` at (batch, n): each of `module.input_layout` (name, the shape's
    letters over B, N and the module's widths, "float" or "mask") as a stand_in."""
    sizes = {"B": batch, "N": n, **module.widths}
    return tuple(stand_in(tuple(sizes[letter] for letter in letters), dtype if kind == "float" else torch.bool,
                          device, training and kind == "float")
                 for _, letters, kind in module.input_layout)


#: The training paths whose backward is the closed form (where it covers the call).
CLOSED_FORM_BACKWARD_PATHS = (KERNEL_TRAINING, SAVED_CLOSED_FORM, CLOSED_FORM)


def _backward_kernels(module, inputs: tuple, n: int) -> "str | None":
    """The fused backward kernels a closed-form training call on these inputs runs, with their
    launch shapes and where those came from (pairgen/ops/backward_tuning.py); None where the call
    runs none (the op has none, the closed form does not cover it, PAIRGEN_FUSED_BACKWARD=0)."""
    from ..ops import backward_tuning
    from ..ops.fused_kernels import storage_kind
    from ..runtime import device_info

    x = inputs[0]
    kind = storage_kind(current_autocast() or x.dtype)
    if (module.op.name not in backward_tuning.OPS or not x.is_cuda or kind is None or not config.fused_backward()
            or not module.closed_form_applies(inputs)):
        return None
    return backward_tuning.describe(module.op.name, kind, module.widths, n, device_info(x.device.index or 0))


def explain_routes(module, batch: int, n: int, dtype: torch.dtype, device) -> tuple:
    """(label, Route) of an inference call and a training call of `module` at (batch, n) in
    `dtype` on `device`, decided as a call would be (a default variant's first use not timed)."""
    routes = []
    for label, training in (("inference", False), ("training", True)):
        inputs = stand_in_inputs(module, batch, n, dtype, device, training)
        with torch.set_grad_enabled(training):
            r = route(module, inputs, settle=False)
        if r.path == KERNEL and module._records(r.variant):
            r = r._replace(reason=r.reason + "; a repeated call like it: " + FAST_REPLAY)
        elif r.path == SAVED_CLOSED_FORM and training_replay.replays(module, inputs[0]):
            r = r._replace(reason=r.reason + "; a repeated call like it: " + TRAINING_REPLAY)
        if training and r.path in CLOSED_FORM_BACKWARD_PATHS:
            backward = _backward_kernels(module, inputs, n)
            if backward:
                r = r._replace(reason=f"{r.reason}; backward: {backward}")
        routes.append((f"{label} call B={batch} N={n} {str(dtype).removeprefix('torch.')}", r))
    return tuple(routes)
