"""Training calls of the closed form replayed as CUDA graphs (a module's capture_training_steps).

A closed-form training call (autograd.SavedClosedForm) issues tens of kernels and PyTorch
operations forward and more back. At the lengths heads train on, the host takes longer to issue
them than the GPU to run them, so the step waits on the host. A call whose signature repeats (the
inputs' shapes, dtypes and device, the parameters' storage, the autocast, the gradients wanted) is
captured the second time it comes as two CUDA graphs, its forward and its backward, on buffers of
their own (a Slot), and every later such call replays them: the host then copies the inputs in,
replays the forward, copies the output out; back, copies the incoming gradient in, replays the
backward and copies the gradients out. The copies keep a caller's tensors its own: nothing a call
returns is overwritten by the next.

A slot holds its forward's intermediates from one call's forward to its backward, so a signature
keeps up to MAX_SLOTS slots for forwards whose backward has not run yet; a call past them runs
the closed form as it is. Which calls may capture at all is dispatch's decision
(dispatch.captures_training_step). The graphs read the parameters
where they are (an optimizer's in-place update is seen; a parameter moved or replaced changes the
signature). A slot's memory stays allocated while its module keeps it (release_captured_steps()
frees it); a module keeps at most MAX_SIGNATURES signatures, the least recently used dropped.
"""
from __future__ import annotations

import collections
import warnings

import torch

from .. import config
from .modes import current_autocast

#: Signatures a module keeps captured slots for; past this the least recently used is dropped.
MAX_SIGNATURES = 4
#: Slots per signature: forwards of one signature whose backward has not run yet (two heads of one
#: shape, gradient accumulation over calls made before one backward).
MAX_SLOTS = 2
#: A signature is captured the time it comes after this many calls that ran it uncaptured (the
#: first warms the kernels' compiles and the closed form's caches; a length seen once is not
#: worth a capture).
UNCAPTURED_CALLS = 1
#: Captures one module makes at most: a module that meets ever new signatures (a new length every
#: call) stops capturing rather than pay a capture per call.
MAX_CAPTURES = 16
#: Signatures counted uncaptured at most; past this the count starts again (a module meeting a
#: new length every call keeps no growing record).
MAX_SEEN = 256

CONSUMED = ("this call's saved intermediates were consumed by an earlier backward (a second backward through "
            "the same call, retain_graph=True, needs module.recompute_for_backward = True)")


class Slot:
    """One call signature's forward and backward, captured as CUDA graphs on buffers of their own:
    the static inputs and incoming gradient the graphs read, the output and gradients they write."""

    def __init__(self, module, inputs: tuple, names: tuple, params: tuple, frozen: frozenset):
        self.busy = False
        self.inputs = tuple(None if t is None else t.detach().clone() for t in inputs)
        weights = dict(zip(names, (p.detach() for p in params)))
        device = next(t for t in inputs if t is not None).device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.no_grad(), torch.cuda.stream(side):
            # Warm-up on the capturing stream: its cuBLAS handle and workspace, and whatever the
            # closed form builds on first use, exist before the capture.
            out, saved = module.closed_form_forward(self.inputs, weights)
            self.grad_out = torch.zeros_like(out)
            module.saved_gradients(module, saved, self.grad_out, frozen)
            del out, saved
            self.pool = torch.cuda.graph_pool_handle()
            self.forward_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.forward_graph, pool=self.pool, stream=side, capture_error_mode="thread_local"):
                self.out, saved = module.closed_form_forward(self.inputs, weights)
            # The saved weights (cast under an autocast inside the forward graph) stay referenced:
            # the backward graph reads them where the forward graph wrote them.
            self.saved_weights = saved.weights
            self.backward_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.backward_graph, pool=self.pool, stream=side,
                                  capture_error_mode="thread_local"):
                self.grads = module.saved_gradients(module, saved, self.grad_out, frozen)
        torch.cuda.current_stream(device).wait_stream(side)

    def forward(self, inputs: tuple) -> torch.Tensor:
        """The captured forward on `inputs`: the output, a tensor of the caller's own."""
        for static, t in zip(self.inputs, inputs):
            if static is not None:
                static.copy_(t)
        self.forward_graph.replay()
        return self.out.clone()

    def backward(self, grad_out: torch.Tensor, keys: list) -> list:
        """The captured backward from d(loss)/d(out) = grad_out: the gradients named by `keys`
        (None: none wanted there), tensors of the caller's own."""
        self.grad_out.copy_(grad_out)
        self.backward_graph.replay()
        sources = [None if key is None else self.grads.get(key) for key in keys]
        present = [t for t in sources if t is not None]
        copies = [torch.empty_like(t) for t in present]
        if copies:
            torch._foreach_copy_(copies, present)  # one launch for them all
        it = iter(copies)
        return [None if t is None else next(it) for t in sources]


class Lease:
    """A slot held from a forward to its backward; given back when the backward has run, or when
    the call's autograd node goes without one (the output dropped, no backward)."""

    def __init__(self, slot: Slot):
        self.slot = slot
        slot.busy = True

    def release(self) -> None:
        if self.slot is not None:
            self.slot.busy = False
            self.slot = None

    __del__ = release


class CapturedSteps:
    """A module's captured slots by call signature (least recently used first), and how often each
    signature has come uncaptured."""

    def __init__(self):
        self.slots: collections.OrderedDict = collections.OrderedDict()
        self.seen: collections.Counter = collections.Counter()
        self.captures = 0
        self.failed: set = set()

    def slot_for(self, module, inputs: tuple, names: tuple, params: tuple) -> "Slot | None":
        """A free slot for this call, captured now if its signature has come often enough; None:
        the call runs uncaptured."""
        key = signature(module, inputs, params)
        if key in self.failed:
            return None
        slots = self.slots.get(key)
        if slots is not None:
            self.slots.move_to_end(key)
            free = next((s for s in slots if not s.busy), None)
            if free is not None or len(slots) >= MAX_SLOTS:
                return free
        if self.captures >= MAX_CAPTURES:
            return None
        if slots is None and self.seen[key] < UNCAPTURED_CALLS:
            if len(self.seen) >= MAX_SEEN:
                self.seen.clear()
            self.seen[key] += 1
            return None
        return self._capture(key, module, inputs, names, params)

    def held(self) -> int:
        """The slots captured and kept."""
        return sum(len(slots) for slots in self.slots.values())

    def _capture(self, key, module, inputs, names, params) -> "Slot | None":
        self.captures += 1
        # what the backward skips follows every tensor's requires_grad, which the signature holds
        frozen = unwanted_gradients(module, [t is not None and t.requires_grad for t in inputs], names,
                                    [p.requires_grad for p in params])
        try:
            slot = Slot(module, inputs, names, params, frozen)
        except Exception as error:  # a closed form that cannot be captured runs as it is
            self.failed.add(key)
            warnings.warn(f"pairgen: {type(module).__name__}'s training step could not be captured as a CUDA graph "
                          f"({type(error).__name__}: {error}); it runs uncaptured", RuntimeWarning, stacklevel=4)
            return None
        self.seen.pop(key, None)
        self.slots.setdefault(key, []).append(slot)
        self.slots.move_to_end(key)
        while len(self.slots) > MAX_SIGNATURES:
            self.slots.popitem(last=False)
        return slot


def frozen_names(names, wanted: "list[bool] | None") -> frozenset:
    """The parameter names whose gradient is not wanted (None: every one is)."""
    return frozenset() if wanted is None else frozenset(name for name, w in zip(names, wanted) if not w)


def unwanted_gradients(module, input_needs, names, wanted) -> frozenset:
    """What a closed form's backward may skip (its `frozen`): the parameters whose gradient is not
    wanted (frozen_names) and the keys of the inputs' gradients not needed (pair features that are
    data, not a model's output, need none: their product is skipped)."""
    return frozen_names(names, wanted) | {key for key, need in zip(module.input_gradients, input_needs)
                                          if key and not need}


def signature(module, inputs: tuple, params: tuple) -> tuple:
    """What a captured call depends on beyond the values of its inputs and parameters."""
    autocast = current_autocast()
    return (tuple(None if t is None else (tuple(t.shape), t.dtype, t.device, t.is_contiguous(), t.requires_grad)
                  for t in inputs),
            tuple((p.data_ptr(), p.dtype, tuple(p.shape), p.requires_grad) for p in params),
            autocast, module.backward_precision(inputs[0], autocast), config.fused_backward())


def steps_of(module) -> CapturedSteps:
    steps = module.__dict__.get("_captured_steps")
    if steps is None:
        steps = module.__dict__["_captured_steps"] = CapturedSteps()
    return steps


def pool_spare_bytes(module) -> int:
    """Bytes the module's captured slots keep in their graphs' memory pools beyond the tensors
    alive there: memory a replay uses for its temporaries that torch.cuda.memory_allocated does
    not count, and that nothing else can use while the slots live."""
    pools = {tuple(slot.pool) for slots in steps_of(module).slots.values() for slot in slots}
    return sum(segment["total_size"] - segment["allocated_size"] for segment in torch.cuda.memory_snapshot()
               if tuple(segment.get("segment_pool_id", ())) in pools)
