"""KernelModule, the mixin every drop-in module is built on, and TensorCorePrecisions, the
`precision` option of the modules with tensor-core kernels.

KernelModule keeps what a module holds between calls (the variant per length, fast-call
recordings, barrier ints) and runs each call the way `dispatch.route` decides. The pieces
it is built from live beside it: `dispatch` (which path a call runs), `autograd` (the training
paths' autograd Functions), `parameters` (the parameters as each call finds them), `buffers`
(scratch held between calls), `validation` (input checks), `modes` (autocast and cuBLAS modes)."""
from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch

from .. import fastcall, first_use, library, native, runtime
from ..ops import packing
from ..launch import current_raw_stream
from ..precision import (CLOSED_FORM_DTYPES, HALF_BY_DTYPE, HALF_DTYPES, MODULE_OPTIONS, MODULE_PRECISIONS, OUTPUT_DTYPES,
                         lookup)
from ..spec import OpSpec
from . import dispatch, training_replay
from .autograd import ReferenceBackward, SavedClosedForm, distinct_storages
from .captured import frozen_names
from .buffers import PACK_SLOTS, HeldBuffer, grow_held
from .dispatch import (CLOSED_FORM, COMPILED, FP32_KERNEL, KERNEL, KERNEL_TRAINING, REFERENCE, SAVED_CLOSED_FORM, Route,
                       Routing, route)
from .modes import as_dtype, autocast_off, current_autocast
from .parameters import CallWeights


class KernelModule:
    """Mixin for drop-in modules: decides kernel or reference, and keeps the variant choice.

    A subclass provides: `op` (its OpSpec, whose strategies run the calls), `widths`,
    `input_layout`, `reference_forward(*inputs)`, `_launch(*inputs, out=None, variant=None,
    weights=None)`, `_slots` (its ParameterSlots), and validates its inputs before calling
    `_dispatch`; where its dispatch differs from the default, a `routing` (dispatch.Routing) and
    the methods that describe a call (`kernel_precision`, `uses_kernel`, `closed_form_applies`).
    """

    op: OpSpec
    _forced_plan = None  # set by the tuner and the tests to run one specific variant
    _reference_only = False  # set while pairgen.library runs the reference on weights it was given
    _variant_cache: dict | None = None  # (device index, N) -> variant, valid for one runtime generation
    #: Lengths remembered per module: a server meeting every protein's own N must not grow
    #: without bound; past this many the oldest half is forgotten (re-selecting costs a lookup).
    MAX_CACHED_LENGTHS = 256
    #: How a training call (one that autograd records) gets its gradients; see backward_mode.
    BACKWARD_MODES = dispatch.BACKWARD_MODES
    _backward_mode = "auto"
    #: The closed form of an op that can keep its forward's intermediates (saving_forward) keeps
    #: them unless this is True: then the forward is the kernel and the backward recomputes them
    #: from the inputs (the least memory, one forward more). Other ops always recompute.
    recompute_for_backward = False
    #: Whether a closed-form training call whose signature repeats (shapes, dtypes, parameters,
    #: autocast) replays CUDA graphs of its forward and backward captured at its second call
    #: (pairgen/module/captured.py): True, False, or None for the op's default
    #: (Routing.captured_training_steps). The graphs keep their buffers until
    #: release_captured_steps().
    capture_training_steps: "bool | None" = None
    #: The op's dispatch facts and thresholds (pairgen/module/dispatch.py); an instance may
    #: replace it (dataclasses.replace) to move a threshold.
    routing: Routing = Routing()
    #: The inputs, in forward's order: (name, the shape's letters over B, N and the widths, "float"
    #: or "mask"); explain() builds stand-ins of them.
    input_layout: tuple = ()

    # Loaded kernels belong to this process and device: a copy or a pickle (an EMA copy of the
    # model, torch.save) starts without them and loads them on first use.
    _RUNTIME_STATE = ("_variant_cache", "_forced_plan", "_handle", "_barrier", "_kernel_route", *PACK_SLOTS)

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
        for name in ("_fast_calls", "_fast_call_counts", "_training_replays", "_training_record_counts"):
            state.pop(name, None)
        return state

    # ---- fast calls (pairgen/fastcall.py) ----------------------------------------------------
    #: Recorded calls, newest first: (the compiled replay function, its recording, device index).
    _fast_calls: tuple = ()
    #: Recorded training calls, newest first (training_replay.TrainingReplay).
    _training_replays: tuple = ()
    #: Recordings kept per module: a few lengths called in turn all stay fast.
    MAX_FAST_CALLS = 4
    def _records(self, variant) -> bool:
        """Whether a call of this variant can be recorded for replay (its strategy's `records`),
        and its kernels write the output dtype the call returns (a replay casts nothing)."""
        plan = variant.plan
        wanted = self._wanted_output()
        return (plan.precision in self.op.strategies[plan.strategy].records
                and (wanted is None or self.kernel_output_dtype(plan) is wanted))

    def _fast_forward(self, *inputs):
        """The output of a recorded call that matches these inputs, or None: take the Python path.
        Not while torch.compile traces (the operator of pairgen/library.py is what it sees)."""
        if torch.compiler.is_compiling():
            return None
        if self._training_replays and torch.is_grad_enabled():
            out = training_replay.replayed_call(self, inputs)
            if out is not None:
                return out
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
        self.__dict__.pop("_training_replays", None)

    def _launch_recorded(self, inputs: tuple, variant, weights: CallWeights):
        """_launch on `inputs` and `weights`, recorded for replay where the call allows it (see
        fastcall.py): a replay takes the inputs, then the weights' tensors."""
        run = functools.partial(self._launch, *inputs, variant=variant, weights=weights)
        if not self._records(variant):
            return run()
        replayer = native.fastcall()  # the first request starts the compiled module's build
        if (replayer is None or self._reference_only or self.__dict__.get("_state_per_call")
                or torch.cuda.is_current_stream_capturing()):
            return run()
        counts = self.__dict__.setdefault("_fast_call_counts", [0, 0])  # slow calls, recordings
        counts[0] += 1
        if not fastcall.may_record(*counts):
            return run()
        counts[1] += 1
        with fastcall.recording() as (launches, scratch):
            out = run()
        epochs = [(runtime.GENERATION, runtime.GENERATION[0])]
        recorded = fastcall.build((*inputs, *weights.tensors), out, launches, scratch, self._held_for_fast_calls(),
                                  epochs, current_autocast())
        if recorded is not None:
            entry = (replayer.call, recorded, inputs[0].get_device())
            self.__dict__["_fast_calls"] = (entry,) + self._fast_calls[: self.MAX_FAST_CALLS - 1]
        return out

    def _held_for_fast_calls(self) -> list:
        """The tensors the module holds between calls: what a recorded call may point into
        besides its inputs, weights, output and per-call buffers."""
        held = []
        for value in self.__dict__.values():
            if isinstance(value, HeldBuffer):
                held += [value.live, *value.retired]
            elif isinstance(value, tuple):  # e.g. the triangle update's (device, barrier ints)
                held += [v for v in value if isinstance(v, torch.Tensor)]
        return held

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

    def release_captured_steps(self) -> None:
        """Drop this module's captured training steps and the memory they hold (a later call
        captures again where capture_training_steps says so)."""
        self.__dict__.pop("_captured_steps", None)

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
        update: its Routing.closed_form_16_bit_training_min_pairs; at every size where the module
        captures its training steps, capture_training_steps), else the reference
        (docs/performance.md has the measurements)."""
        return self._backward_mode

    @backward_mode.setter
    def backward_mode(self, mode: str) -> None:
        if mode not in self.BACKWARD_MODES:
            raise ValueError(f"backward_mode must be one of {', '.join(map(repr, self.BACKWARD_MODES))}, got {mode!r}")
        self._backward_mode = mode

    def trains_through_reference(self, precision: str, inputs: tuple) -> bool:
        """Whether a training call on `inputs` in `precision` (kernel_precision's name) runs the
        reference (dispatch.trains_through_reference)."""
        return dispatch.trains_through_reference(self, precision, inputs)

    # ---- the output's dtype ----------------------------------------------------------------------
    _output_dtype = None

    @property
    def output_dtype(self) -> "torch.dtype | None":
        """The dtype every call returns. None (the default): the reference's (the input's, or the
        autocast's under a 16-bit autocast). A floating dtype: that one. An fp32 model under
        autocast that wants an fp32 output (a residual stream kept in fp32; GPU MODE's contract:
        fp32 in and out) sets torch.float32: kernels that can (kernel_output_dtype) then write
        fp32 themselves, the rest is cast; a training call casts too (differentiably)."""
        return self._output_dtype

    @output_dtype.setter
    def output_dtype(self, dtype: "torch.dtype | None") -> None:
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"output_dtype must be None (the reference's) or a floating torch.dtype, got {dtype!r}")
        self._output_dtype = dtype
        self.forget_fast_calls()

    def _wanted_output(self) -> "torch.dtype | None":
        """output_dtype, except inside pairgen's operator (pairgen/library.py: its reference and
        its kernel calls), which returns the dtype its fake implementation declares (the
        computation's): the module call torch.compile traced casts its result after. (While it
        traces, the flags are not read: a guard on them would recompile once an operator call has
        set and restored them.)"""
        wanted = self._output_dtype
        if wanted is None or (not torch.compiler.is_compiling()
                              and (self._reference_only or self.__dict__.get("_state_per_call"))):
            return None
        return wanted

    def kernel_output_dtype(self, plan) -> torch.dtype:
        """The dtype a kernel call of `plan` writes: its precision's, or fp32 where output_dtype is
        fp32 and the plan's strategy writes fp32 from that precision (Strategy.fp32_output)."""
        if self._wanted_output() is torch.float32 and plan.precision in self.op.strategies[plan.strategy].fp32_output:
            return torch.float32
        return OUTPUT_DTYPES[plan.precision]

    def _as_output(self, out: torch.Tensor) -> torch.Tensor:
        """out in output_dtype (unchanged where that is None or out's already)."""
        wanted = self._wanted_output()
        return out if wanted is None or out.dtype is wanted else out.to(wanted)

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
                precision: "str | None" = None, batch: int = 1) -> "runtime.Explanation":
        """What this module runs for length n on a GPU in `precision` (a tuned key's dtype or any
        alias of one: "float32", "bfloat16", ...; None: what this module's calls compute in), where
        that came from, its parameters and its measured time (see runtime.explain), and the route
        (dispatch.route) an inference and a training call of `batch` at that length take: in the
        module's dtype, under an autocast to `precision` where that is 16-bit and the module fp32.
        The route selects the variant as a call would (its first-use check is not run). For the
        CPU device, or where torch sees no CUDA GPU, it says so: a call there runs the reference."""
        dtype = self._slots.anchor().dtype
        if precision is None:
            own = HALF_BY_DTYPE.get(dtype)
            precision = own if own is not None else MODULE_PRECISIONS.get(getattr(self, "_precision", "ieee"), "float32")
        precision = lookup(precision).name
        if isinstance(device, int):
            index = device
        else:
            device = torch.device(device or "cuda")
            if device.type != "cuda":
                return self._with_routes(runtime.explain_on_cpu(self.op, n, "a call on CPU tensors"), n, batch,
                                         dtype, "cpu", None)
            index = device.index or 0
        if not torch.cuda.is_available():
            return self._with_routes(runtime.explain_on_cpu(
                self.op, n, "a CPU call: torch sees no CUDA GPU here (`pairgen-tune --explain --gpu SLUG --arch "
                "sm_XY` says what a GPU would run)"), n, batch, dtype, "cpu", None)
        autocast = HALF_DTYPES.get(precision) if dtype is torch.float32 else None
        return self._with_routes(runtime.explain(self.op, precision, self.widths, n, index), n, batch, dtype,
                                 torch.device("cuda", index), autocast)

    def _with_routes(self, explained: "runtime.Explanation", n: int, batch: int, dtype: torch.dtype, device,
                     autocast: "torch.dtype | None") -> "runtime.Explanation":
        """`explained` with the routes of stand-in calls (dispatch.explain_routes)."""
        if self.input_layout:
            with torch.autocast("cuda", dtype=autocast) if autocast is not None else contextlib.nullcontext():
                explained.routes = dispatch.explain_routes(self, batch, n, dtype, device)
        return explained

    def route(self, *inputs: torch.Tensor) -> Route:
        """The path a call on these (validated) inputs would run, and why (dispatch.route); a
        default variant's first-use check is not run."""
        return route(self, inputs, settle=False)

    def _dispatch(self, *inputs: torch.Tensor):
        """Run the call the way dispatch.route decides, its output in output_dtype."""
        return self._as_output(self._run_route(route(self, inputs), inputs))

    def _run_route(self, r: Route, inputs: tuple) -> torch.Tensor:
        path = r.path
        if path == KERNEL:
            return self._launch_recorded(inputs, r.variant, self._slots.weights())
        if path == REFERENCE:
            return self.reference_forward(*inputs)
        if path == KERNEL_TRAINING:
            return ReferenceBackward.apply(self, len(inputs), r.variant, *inputs, *self.parameters())
        if path == SAVED_CLOSED_FORM:
            return SavedClosedForm.run(self, inputs, dispatch.captures_training_step(self, inputs),
                                       training_replay.recorder_for)
        if path == FP32_KERNEL:
            with autocast_off():  # a strategy's own PyTorch products stay fp32
                out = self._launch(*r.inputs, variant=r.variant)
            return as_dtype(out, self._wanted_output() or self.closed_form_output_dtype(inputs[0], current_autocast()))
        if path == CLOSED_FORM:
            return self._closed_form_call(inputs)
        if path == COMPILED:  # torch.compile sees one operator (pairgen/library.py)
            return library.compiled_call(self, self.op.name, inputs)
        raise AssertionError(f"pairgen: no runner for the route {r}")

    def without_kernel_path(self, inputs: tuple, training: bool) -> tuple:
        """What a call no kernel computes in its own dtype (16 bits, autocast) runs, as (path,
        detail): ("fp32 kernel", (its variant, the inputs made fp32)), ("closed form", None) or
        ("reference", None) (pairgen-bench labels its rows from it; dispatch._without_kernel
        decides)."""
        r = dispatch._without_kernel(self, inputs, training)
        if r.path == FP32_KERNEL:
            return FP32_KERNEL, (r.variant, r.inputs)
        return (CLOSED_FORM if r.path in (CLOSED_FORM, SAVED_CLOSED_FORM) else REFERENCE), None

    def _closed_form_call(self, inputs: tuple) -> torch.Tensor:
        """The CLOSED_FORM path's output: the closed form's forward on the module's parameters,
        keeping nothing (a first-use check times it as the rival of a default kernel,
        dispatch.route)."""
        return self.closed_form_forward(inputs, {name: p.detach() for name, p in self.named_parameters()},
                                        keep=False)[0]

    def closed_form_forward(self, inputs: tuple, params: dict, keep: bool = True) -> tuple:
        """The op's forward computed the closed form's way on `inputs` and `params` (by name), in
        the precision backward_precision names under the current autocast: (the output in the
        reference's dtype, what saved_gradients needs: saving_forward's). keep False: for a call
        no backward follows, the op's inference_forward where it has one (None kept)."""
        autocast = current_autocast()
        precision = self.backward_precision(inputs[0], autocast)
        if keep or self.inference_forward is None:
            out, saved = self.saving_forward(self, *inputs, params, precision)
            return as_dtype(out, self.closed_form_output_dtype(inputs[0], autocast)), saved
        # nothing differentiates this output: it may be made in output_dtype at once
        wanted = self._wanted_output()
        out = self.inference_forward(self, *inputs, params, precision, wanted)
        return as_dtype(out, wanted or self.closed_form_output_dtype(inputs[0], autocast)), None

    def closed_form_output_dtype(self, first: torch.Tensor, autocast: "torch.dtype | None") -> torch.dtype:
        """The dtype the reference returns for a call whose first input is `first`, under an
        autocast to `autocast` (None: none): what a closed-form call returns. The autocast dtype
        when there is one (the reference ends in a Linear's output), else the input's; an op whose
        reference ends otherwise says so."""
        return autocast or first.dtype

    def _first_use(self, pending: "first_use.Pending", inputs: tuple, precision: str,
                   weights: "CallWeights | None" = None, reference: "Callable[[], torch.Tensor] | None" = None,
                   rival: str = first_use.REFERENCE_RIVAL):
        """Settle a default variant against the reference on this call's inputs (first_use.py),
        then remember the winner in this module's cache (a variant, or None: the reference).
        weights, reference: a call on other weights than the module's own (the functional form)
        and the reference computed on them; or, with `rival` naming it, what runs instead of a
        losing kernel (dispatch: the closed form)."""
        first = inputs[0]
        winner = pending.settle(lambda: self._launch(*inputs, variant=pending.variant, weights=weights),
                                reference or (lambda: self.reference_forward(*inputs)), first.device, rival)
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
        ordered = [grads.get(key) if key else None for key in self.input_gradients] + [grads.get(name) for name in names]
        return distinct_storages(ordered, (*inputs, *params, grad_out))

    #: The op's forward computed the closed form's way, keeping what its backward needs, as
    #: staticmethods: saving_forward(module, *inputs, params_by_name, precision) -> (out, saved);
    #: saved_gradients(module, saved, grad_out, frozen) -> closed_form's result. None: the op's
    #: training calls run the kernel forward and recompute (recompute_for_backward).
    saving_forward: Callable | None = None
    saved_gradients: Callable | None = None
    #: The closed form's forward keeping nothing (fewer passes, a lower peak), as a staticmethod:
    #: inference_forward(module, *inputs, params_by_name, precision, out_dtype) -> out, in out_dtype
    #: where it can make it so at no cost (None: the computation's). None: the CLOSED_FORM path runs
    #: saving_forward and drops what it kept.
    inference_forward: Callable | None = None

    def closed_form_applies(self, inputs: list) -> bool:
        """Whether closed_form covers this call's inputs (an op narrows it)."""
        return True

    def closed_form_capturable(self, inputs: tuple) -> bool:
        """Whether the closed form's training call on these inputs can be captured as CUDA graphs
        (capture_training_steps): no step of it synchronises or sizes a tensor by its values (an
        op narrows it)."""
        return True

    def _saves_for_backward(self, inputs) -> bool:
        """Whether a training call runs SavedClosedForm (dispatch.saves_for_backward)."""
        return dispatch.saves_for_backward(self, inputs)

    def backward_precision(self, x: torch.Tensor, autocast: "torch.dtype | None") -> str:
        """What the closed form computes in (closed_form.COMPUTE_DTYPES): 16-bit modules in their
        dtype, and calls under a 16-bit autocast in its dtype (16-bit tensor cores, fp32
        accumulation and LayerNorm statistics, as PyTorch's own 16-bit forward and backward: the
        standard they meet is the 16-bit one; computing them in fp32 measured slower than the
        16-bit reference); exact fp32 otherwise, tf32x3 modules included (splitting pair-sized
        operands into TF32 heads and tails in PyTorch cost more than the tensor cores saved: 18.7 ms
        against 13.8 ms for trimul N512 on an H200)."""
        half = HALF_BY_DTYPE.get(autocast or x.dtype)  # autocast's dtype, else a 16-bit module's
        return half if half is not None else "ieee"

    def _run(self, variant, weights: CallWeights, *tensors) -> None:
        """The variant's strategy runs it on `weights` and prepared tensors (inputs..., out)."""
        self.op.strategies[variant.plan.strategy].run(self, variant, weights, *tensors)

    def fp32_layout(self, sources: "packing.Sources"):
        """The op's fp32 kernels' Layout for weights placed as `sources` say (an op defines it)."""
        raise NotImplementedError

    def packed_weights(self) -> torch.Tensor:
        """The parameters as they are now in the fp32 kernels' layout, as floats (a new tensor)."""
        weights = self._slots.weights()
        return packing.pack(self.fp32_layout(weights.sources), list(weights.tensors)).view(torch.float32)

    def _packed(self, layout, weights: CallWeights, slot: str = PACK_SLOTS[0]) -> torch.Tensor:
        """`weights` in a kernel's layout (ops/packing.py), packed by this call into the module's
        buffer `slot` (one of PACK_SLOTS: a call that makes two packs uses two)."""
        tensors = list(weights.tensors)
        return packing.pack(layout, tensors, out=self._pack_buffer(slot, layout.total, tensors[0].device))

    def _pack_buffer(self, slot: str, total: int, device: torch.device) -> torch.Tensor | None:
        """`total` bytes the module holds as `slot` (a HeldBuffer), for the weights packed by a
        call: every call rewrites them before its kernels read them (stream order), so a call
        allocates nothing for its weights and a recorded call replays into the same bytes. None
        (the pack makes a per-call buffer) off the GPU and inside an operator call
        (library.state_per_call), where nothing may outlive the call."""
        if device.type != "cuda" or self.__dict__.get("_state_per_call"):
            return None
        held = self.__dict__.get(slot)
        if held is None or held.index != device.index or held.capacity < total:
            held, ptr = grow_held(held, device.index, total, torch.uint8, zeroed=False)
            self.__dict__[slot] = held
            buffer = held.live if held.ptr == ptr else held.retired[-1]  # under capture: the graph's own
        else:
            buffer = held.live
        return buffer if buffer.numel() == total else buffer[:total]

    def _needs_grad(self, inputs) -> bool:
        return any(t.requires_grad for t in inputs) or any(p.requires_grad for p in self.parameters())



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
        spelling = MODULE_OPTIONS.get(value) if isinstance(value, str) else None
        if spelling is None:
            raise ValueError(f"precision must be one of {tuple(MODULE_PRECISIONS)} (or an alias: "
                             f"{', '.join(repr(a) for a in MODULE_OPTIONS if a not in MODULE_PRECISIONS)}), got {value!r}")
        self._precision = spelling
        self.forget_fast_calls()

    def extra_repr(self) -> str:
        parts = [f"precision={self._precision!r}"] if self._precision != "ieee" else []
        if self._output_dtype is not None:
            parts.append(f"output_dtype={self._output_dtype}")
        return ", ".join(parts)

    def kernel_precision(self, x, *rest) -> str | None:
        """float32 in the module's precision, or autocast's dtype under torch.autocast("cuda");
        bfloat16/float16 in their own; None (the reference) on CPU, for other dtypes, for a 16-bit
        input under an autocast of the other 16-bit dtype, and past 2^31 pairs (32-bit indices)."""
        if not x.is_cuda or x.shape[0] * x.shape[1] * x.shape[1] >= 2**31:
            return None
        autocast = torch.is_autocast_enabled("cuda")
        if x.dtype is torch.float32:
            return HALF_BY_DTYPE.get(torch.get_autocast_dtype("cuda")) if autocast else MODULE_PRECISIONS[self._precision]
        precision = HALF_BY_DTYPE.get(x.dtype)
        if autocast and torch.get_autocast_dtype("cuda") is not x.dtype:
            return None
        return precision
