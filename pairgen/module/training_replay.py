"""Closed-form training calls recorded once and replayed from compiled code (pairgen/replay.py says
how a call is recorded and what is refused): a drop-in module's (SavedClosedForm), and pairgen's
function's on the caller's weights (functional.ClosedFormForCaller).

The first calls of a signature run on the Python path, recorded (a Recorder rides along: the
forward's trace when the forward ends, the backward's when it ends); the replay made of both is
kept on the module, and later calls whose inputs match it run ReplayedClosedForm: the forward's
trace, then, when autograd asks, the backward's. A module setting that changes how a
training call runs drops the replays (forget_fast_calls) or, for the plain attributes, refuses
them (SETTINGS).
"""
from __future__ import annotations

import torch

from .. import fastcall, native, replay
from ..launch import current_raw_stream
from .autograd import graphless_gradients, recomputed_gradients, saved_tensor_hooks_active
from .captured import CONSUMED
from .modes import current_autocast

#: Replays kept per module: a few lengths trained in turn all stay fast.
MAX_REPLAYS = 4

#: The module attributes a training call's route and closed form read besides its inputs: a replay
#: recorded under other values is not used.
SETTINGS = ("_backward_mode", "recompute_for_backward", "capture_training_steps", "_reference_only",
            "_output_dtype", "_precision")


def settings(module) -> tuple:
    d = module.__dict__
    return (*(getattr(module, name) for name in SETTINGS), d.get("_backward_tuning"), d.get("_state_per_call"))


class TrainingReplay:
    """One recorded training call: its forward's and backward's traces."""

    __slots__ = ("forward", "backward", "n_inputs", "settings", "device_index", "autocast")

    def __init__(self, forward, backward, n_inputs: int, settings_: tuple, device_index: int,
                 autocast: "torch.dtype | None"):
        self.forward, self.backward, self.n_inputs = forward, backward, n_inputs
        self.settings, self.device_index, self.autocast = settings_, device_index, autocast

    def stream(self) -> int:
        return current_raw_stream(self.device_index) if self.device_index >= 0 else 0


def replayed_call(module, tensors: tuple):
    """The module's training call on tensors (its inputs, then its weights) from a replay that
    matches them, or None: take the Python path."""
    if saved_tensor_hooks_active():  # checkpointing: the Python path saves through the hooks
        return None
    now = None
    run_trace = native.fastcall().run_trace
    for entry in module._training_replays:
        if now is None:
            now = settings(module)
        if entry.settings != now:
            continue
        result = run_trace(entry.forward, entry.stream(), *tensors)
        if result is not None:
            return ReplayedClosedForm.apply(entry, module, result, *tensors)
    return None


class ReplayedClosedForm(torch.autograd.Function):
    """A recorded training call replayed from compiled code: `result` is the
    forward's trace's (the output, and a State of the buffers the backward reads), run before this
    Function (replayed_call); the backward runs the backward's trace, which consumes the State."""

    @staticmethod
    def forward(ctx, entry, module, result, *tensors):
        ctx.entry, ctx.module, ctx.tensors = entry, module, tensors
        ctx.kept = result[1:]  # (the State,), or () where the backward reads nothing the forward made
        # as the forward ran, for a backward that recomputes
        ctx.autocast = (entry.autocast is not None, entry.autocast or torch.get_autocast_dtype("cuda"))
        return result[0]

    @staticmethod
    def backward(ctx, grad_out):
        skipped = 3  # entry, module, result
        kept, ctx.kept = ctx.kept, None
        if kept is None:
            raise RuntimeError(CONSUMED)
        with torch.no_grad():
            grads = backward_outputs(ctx.entry, grad_out.detach(), ctx.tensors, kept)
        if grads is None:  # pairgen's state changed since the forward (a re-tune): from the inputs
            grads = recomputed_gradients(ctx.module, ctx.tensors, ctx.entry.n_inputs, grad_out, ctx.autocast)
        needs = ctx.needs_input_grad[skipped:]
        grads = [g if need else None for g, need in zip(grads, needs)]
        return (None,) * skipped + tuple(graphless_gradients(grad_out, grads))


def backward_outputs(entry: TrainingReplay, grad_out: torch.Tensor, tensors: tuple, kept: tuple):
    """The gradients of a replayed call's inputs and weights (None for those it makes none of), or
    None where its backward's trace does not take this incoming gradient even made contiguous.
    kept: (the State the forward's trace returned,) or (), which the backward's trace consumes."""
    run_trace = native.fastcall().run_trace
    stream = entry.stream()
    grads = run_trace(entry.backward, stream, grad_out, *tensors, *kept)
    if grads is None:  # an expanded or misaligned incoming gradient (out.sum().backward())
        grads = run_trace(entry.backward, stream, grad_out.clone(memory_format=torch.contiguous_format),
                          *tensors, *kept)
    return grads


class Recorder:
    """Records one closed-form training call, forward then backward, and gives the module the
    replay (a drop-in module's SavedClosedForm call, or a call of pairgen's function on the
    caller's weights: functional.ClosedFormForCaller)."""

    def __init__(self, module, tensors: tuple, n_inputs: int, gradients_of, names: tuple = ()):
        """tensors: what a replay takes (the call's inputs, then its weights, by `names` where they
        are a module's parameters), which the backward gives gradients of: gradients_of(what the
        backward's run returns) -> one per tensor."""
        self.module, self.n_inputs, self.inputs, self.gradients_of = module, n_inputs, tensors, gradients_of
        self.names = names
        self.requires_grad = [int(t.requires_grad) for t in tensors]
        self.autocast = current_autocast()
        self.forward_trace = self.kept = None

    def forward(self, run):
        """run() -> (out, saved), traced; the forward's trace built from it (None: refused)."""
        with replay.Tracing() as trace:
            out, saved = run()
        try:
            self.kept = _born_storages(trace, [out, *replay.tensors_in(saved)])
            self.forward_trace = replay.build(out.device, list(self.inputs), trace, [out], self._held(),
                                              replay.epochs(), self.requires_grad, self.kept, self.autocast)
        except replay.Refused as refused:
            self.forward_trace = None
            self.module.__dict__["_training_replay_refused"] = str(refused)
        return out, saved

    def backward(self, run, grad_out: torch.Tensor, wanted: list):
        """run() -> the backward's result (gradients_of maps it), traced; the replay made where both
        traces could be and exactly the gradients the tensors' requires_grad asks for are wanted
        (`wanted`, one per tensor): a replay makes those."""
        if self.forward_trace is None or [int(w) for w in wanted] != self.requires_grad:
            return run()
        with replay.Tracing() as trace:
            result = run()
        module = self.module
        outputs = [g if w else None for g, w in zip(self.gradients_of(result), wanted)]
        kept = [torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()) for t in self.kept]
        try:
            # The backward runs without autocast whatever the caller's (autograd's worker thread has its own).
            backward = replay.build(grad_out.device, [grad_out, *self.inputs, *kept], trace, outputs, self._held(),
                                    replay.epochs(), autocast=current_autocast(), consumed=len(kept))
        except replay.Refused as refused:
            module.__dict__["_training_replay_refused"] = str(refused)
            return result
        device = grad_out.device
        entry = TrainingReplay(self.forward_trace, backward, self.n_inputs, settings(module),
                               -1 if device.type != "cuda" else device.index, self.autocast)
        module.__dict__["_training_replays"] = (entry,) + module._training_replays[: MAX_REPLAYS - 1]
        return result

    def _held(self) -> list:
        return self.module._held_for_fast_calls()


def _born_storages(trace: "replay.Tracing", tensors: list) -> list:
    """One tensor per distinct storage, among `tensors`, that the traced call allocated."""
    born = {replay.storage_extent(t) for t in trace.born}
    seen, kept = set(), []
    for t in tensors:
        extent = replay.storage_extent(t)
        if extent in born and extent not in seen:
            seen.add(extent)
            kept.append(t)
    return kept


def replays(module, first: torch.Tensor) -> bool:
    """Whether the module's training calls like one on `first` are recorded and replayed (after the
    first of a signature): on CUDA, the compiled module built, and none of the module's recordings
    refused (an op, or an option of one, whose closed form a trace cannot take)."""
    return first.is_cuda and native.fastcall() is not None and "_training_replay_refused" not in module.__dict__


def recorder_for(module, inputs: tuple, names: tuple, params: tuple) -> "Recorder | None":
    """A Recorder for this SavedClosedForm call where it may be recorded (_may_record), the call
    returns what the closed form makes (no output_dtype cast after it) and the module's weights are
    these parameters, which the replay takes in its own order."""
    slots = module.__dict__.get("_slots")
    if slots is None or module._wanted_output() is not None:
        return None
    by_name = dict(zip(names, params))
    weights = slots.weights().tensors
    if len(by_name) != len(weights) or any(by_name.get(n) is not w for n, w in zip(slots.names, weights)):
        return None
    if not _may_record(module, inputs[0]):
        return None
    def gradients_of(grads: dict) -> list:
        return [grads[key] if key else None for key in module.input_gradients] + [grads.get(n) for n in slots.names]
    return Recorder(module, (*inputs, *weights), len(inputs), gradients_of, slots.names)


def caller_recorder(module, inputs: tuple, weights: tuple) -> "Recorder | None":
    """A Recorder for a call of pairgen's function on the caller's weights (the module's parameters
    are views of them): its backward's run returns the gradients of inputs then weights, in order.
    Not at a kept module's first call: a caller whose weights are new tensors on every call (a
    LayerNorm affine left out is made per call) gets a new module every call, which would record
    every time and never replay."""
    if "_training_record_counts" not in module.__dict__:
        module.__dict__["_training_record_counts"] = [1, 0]
        return None
    if not _may_record(module, inputs[0]):
        return None
    return Recorder(module, (*inputs, *weights), len(inputs), list)


def _may_record(module, first: torch.Tensor) -> bool:
    """Whether this slow call of the module (its first input `first`) may record: the compiled
    module built, no torch.compile tracing or stream capture, no refused recording before (what a
    trace cannot take is in the op's computation, and tracing costs a call host time), and backing
    off where recordings keep going stale (fastcall.may_record); counted."""
    if (native.fastcall() is None or torch.compiler.is_compiling()
            or (first.is_cuda and torch.cuda.is_current_stream_capturing())
            or "_training_replay_refused" in module.__dict__):
        return False
    counts = module.__dict__.setdefault("_training_record_counts", [0, 0])  # slow calls, recordings
    counts[0] += 1
    if not fastcall.may_record(*counts):
        return False
    counts[1] += 1
    return True
