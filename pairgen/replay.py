"""Training calls replayed from compiled code (pairgen/native/fastcall.cpp's traces).

A closed-form training call (module/autograd.py's SavedClosedForm) runs a few kernels and PyTorch
operations forward and back, but on the Python path each of them costs tens of µs of host time:
checks, contexts, allocations, ctypes. At the lengths models train on (N <= 512 for the triangle
update) the GPU then waits for the host. So a training call is recorded once, on the Python path:

  - its forward: every kernel launch and every PyTorch operation, in order (a TorchDispatchMode
    sees the operations, launch.RECORDING the launches), each tensor and pointer located in one of
    the call's inputs (the input tensors, then the weights) or in a buffer the call allocated
    ("born"), and which born buffers the backward keeps (those the saved intermediates view);
  - then its backward, the same way, its inputs being the incoming gradient, the forward's inputs
    and the kept buffers.

Later calls whose inputs match the recording (shapes, dtypes, device, contiguity, which of them
want gradients; pairgen's epochs; the autocast dtype they were recorded under, or none) run both
from compiled code (ReplayedClosedForm):
the host then issues the same launches and operations in a fraction of the time.

What cannot be recorded is never replayed: a call whose operations include one outside
OPERATIONS (or a product on fp32 operands, whose cuBLAS mode the Python path sets), or whose
pointers lie anywhere but in its inputs, its born buffers, the module's held buffers or small
integers, is refused at recording and keeps the Python path.
"""
from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import fastcall, launch, native, runtime

aten = torch.ops.aten

#: Step kinds as fastcall.cpp numbers them (StepKind).
LAUNCH, BMM, MM, SUM, COPY, CAT, ZERO, FILL = range(8)

#: Operations that allocate and write nothing.
FACTORIES = frozenset({aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default,
                       aten.empty_strided.default, aten.new_empty_strided.default})
#: Operations that make a view (no memory, no work), besides those torch marks as views.
VIEWS = frozenset({aten._unsafe_view.default, aten.detach.default, aten.alias.default})
#: Operations a replay runs (fastcall.cpp's run_operation), by what each writes and reads:
#: name -> (kind, function(args, kwargs, result) -> (written, [read...], dims, keepdim, value)).
OPERATIONS = {
    aten.bmm.default: (BMM, lambda a, k, r: (r, [a[0], a[1]], (), False, 0.0)),
    aten.mm.default: (MM, lambda a, k, r: (r, [a[0], a[1]], (), False, 0.0)),
    aten.sum.dim_IntList: (SUM, lambda a, k, r: (r, [a[0]], tuple(a[1]), bool(a[2]) if len(a) > 2 else
                                                 bool(k.get("keepdim", False)), 0.0)),
    aten._to_copy.default: (COPY, lambda a, k, r: (r, [a[0]], (), False, 0.0)),
    aten.clone.default: (COPY, lambda a, k, r: (r, [a[0]], (), False, 0.0)),
    aten.copy_.default: (COPY, lambda a, k, r: (a[0], [a[1]], (), False, 0.0)),
    aten.cat.default: (CAT, lambda a, k, r: (r, list(a[0]), (a[1] if len(a) > 1 else k.get("dim", 0),), False, 0.0)),
    aten.zero_.default: (ZERO, lambda a, k, r: (a[0], [], (), False, 0.0)),
    aten.zeros_like.default: (ZERO, lambda a, k, r: (r, [], (), False, 0.0)),
    aten.new_zeros.default: (ZERO, lambda a, k, r: (r, [], (), False, 0.0)),
    aten.zeros.default: (ZERO, lambda a, k, r: (r, [], (), False, 0.0)),
    aten.fill_.Scalar: (FILL, lambda a, k, r: (a[0], [], (), False, float(a[1]))),
}
#: Products whose operands are in these dtypes need no cuBLAS mode (fp32's is the Python path's to set).
PRODUCT_DTYPES = (torch.bfloat16, torch.float16)


class Operation(NamedTuple):
    """A PyTorch operation as a trace records it."""
    kind: int
    written: torch.Tensor
    read: list
    dims: tuple
    keepdim: bool
    value: float


class Refused(Exception):
    """The call cannot be recorded (the reason); it keeps the Python path."""


class _Tracer(TorchDispatchMode):
    """Collects a call's PyTorch operations into `steps` (beside its launches) and keeps every
    tensor the call allocates alive until the trace is built, so that no two of its buffers share
    an address. The first operation it cannot replay is kept in `refused`."""

    def __init__(self, steps: list):
        super().__init__()
        self.steps, self.born, self.refused = steps, [], None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func.is_view or func in VIEWS or self.refused:
            return result
        if func in FACTORIES:
            self.born.append(result)
            return result
        operation = OPERATIONS.get(func)
        if operation is None:
            self.refused = f"the operation {func} is not replayed"
            return result
        kind, operands = operation
        written, read, dims, keepdim, value = operands(args, kwargs, result)
        if kind in (BMM, MM) and written.dtype not in PRODUCT_DTYPES:
            self.refused = f"a product in {written.dtype} (its cuBLAS mode is the Python path's)"
            return result
        if written is result:
            self.born.append(result)
        self.steps.append(Operation(kind, written, read, dims, keepdim, value))
        return result


class Tracing:
    """`with Tracing() as trace:` records this thread's launches and operations in trace.steps."""

    def __init__(self):
        self.steps = []
        self._tracer = _Tracer(self.steps)

    def __enter__(self) -> "Tracing":
        launch.RECORDING[threading.get_ident()] = self.steps
        self._tracer.__enter__()
        return self

    def __exit__(self, *exc):
        self._tracer.__exit__(*exc)
        del launch.RECORDING[threading.get_ident()]

    @property
    def born(self) -> list:
        return self._tracer.born

    @property
    def refused(self) -> "str | None":
        return self._tracer.refused


def storage_extent(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


class Layout:
    """Where a trace's pointers can lie: its inputs' extents (index order), then the born storages
    (by their extents), then the module's held tensors and small integers (constants)."""

    def __init__(self, inputs: list, born: list, held: list):
        self.inputs = [fastcall.extent(t) for t in inputs]
        if any(s < e2 and s2 < e for i, (s, e) in enumerate(self.inputs) for s2, e2 in self.inputs[i + 1:]):
            raise Refused("two inputs overlap: a replay could not tell them apart")
        extents = sorted({storage_extent(t) for t in born})
        if any(later[0] < earlier[1] for earlier, later in zip(extents, extents[1:])):
            raise Refused("two born buffers overlap")
        self.born = extents
        self.held = [fastcall.extent(t) for t in held]
        self.first_use, self.last_use = {}, {}

    def place(self, address: int, step: int, constant_ok: bool = True) -> tuple[int, int]:
        """(buffer, byte offset) of an address inside the inputs or born buffers, noting its use at
        `step`; (-1, value) for a constant."""
        for index, (start, end) in enumerate(self.inputs):
            if start <= address < end:
                return self._used(index, step), address - start
        for k, (start, end) in enumerate(self.born):
            if start <= address < end:
                return self._used(len(self.inputs) + k, step), address - start
        if constant_ok and fastcall.is_constant(address, self.held):
            return -1, address
        raise Refused(f"a pointer ({address:#x}) into nothing the replay can make")

    def _used(self, buffer: int, step: int) -> int:
        """Note a use of `buffer` (an input's or a born one's index) at `step`."""
        self.first_use.setdefault(buffer, step)
        self.last_use[buffer] = max(self.last_use.get(buffer, step), step)
        return buffer

    def tensor(self, t: torch.Tensor, step: int) -> tuple:
        """A tensor as fastcall.cpp's spec: (buffer, byte offset, sizes, strides, dtype)."""
        if t.numel() == 0:
            raise Refused("an empty tensor")
        buffer, offset = self.place(t.data_ptr(), step, constant_ok=False)
        last = t.data_ptr() + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) * t.element_size()
        if self.place(last, step, constant_ok=False)[0] != buffer:
            raise Refused("a tensor spanning two buffers")
        return buffer, offset, tuple(t.shape), tuple(t.stride()), t.dtype

    def born_index(self, t: torch.Tensor) -> int:
        """The index among the born buffers of the one holding t's storage."""
        return self.born.index(storage_extent(t))


def build(device: torch.device, inputs: list, trace: Tracing, outputs: list, held: list, epochs: list,
          requires_grad: "list[int] | None" = None, keep_born: list = (), autocast: "torch.dtype | None" = None,
          consumed: int = 0):
    """The compiled trace of a recorded call (a capsule for fastcall.cpp's run_trace), or raise
    Refused. outputs: tensors (views of the inputs or born buffers) or None; keep_born: tensors
    whose born storages a replay returns too, whole, in one State (after `outputs`), for another
    trace; consumed: the last this-many inputs are such a State's buffers (whole, as bytes), which
    a replay takes and frees after their last use; autocast: the CUDA autocast dtype the call ran
    under (a replay runs under that one only), None for none."""
    if trace.refused:
        raise Refused(trace.refused)
    native_module = native.fastcall()
    if native_module is None:
        raise Refused("the compiled fast path is not built")
    layout = Layout(inputs, trace.born, held)
    # A runner's noted product or copy (fastcall.note_product, note_copy) is seen here as the
    # operation it is.
    entries = [e for e in trace.steps if isinstance(e, Operation) or e[0] not in fastcall.NOTED_OPERATIONS]
    steps = [_step(entry, n, layout) for n, entry in enumerate(entries)]
    end = len(steps)
    output_specs = [None if t is None else layout.tensor(t, end) for t in outputs]
    for t in keep_born:  # whole, as bytes
        k = layout.born_index(t)
        start, stop = layout.born[k]
        output_specs.append((len(inputs) + k, 0, (stop - start,), (1,), torch.uint8))
    born_bytes = [stop - start for start, stop in layout.born]
    viewed = {spec[0] for spec in output_specs if spec is not None}
    _schedule(steps, layout, viewed, range(len(inputs) - consumed, len(inputs)))
    input_specs = [(tuple(t.shape), t.dtype, -1 if requires_grad is None else requires_grad[i])
                   for i, t in enumerate(inputs)]
    index = -1 if device.index is None else device.index
    make_current = functools.partial(launch.make_context_current, index) if device.type == "cuda" else (lambda: None)
    capsule = native_module.build_trace(device.type, index, tuple(input_specs), tuple(born_bytes), tuple(map(tuple, steps)),
                                        tuple(output_specs), tuple(epochs), fastcall.PLAIN_TYPES, make_current,
                                        autocast, len(keep_born), consumed)
    return capsule


def _step(entry: tuple, n: int, layout: Layout) -> list:
    """One recorded entry (a launch, or an operation from _Tracer) as fastcall.cpp's step (a list:
    _schedule appends what it allocates and releases)."""
    if isinstance(entry, Operation):
        kind, written, read, dims, keepdim, value = entry
        tensors = tuple(layout.tensor(t, n) for t in (written, *read))
        return [kind, None, (), tensors, tuple(dims), keepdim, value]
    bound, args = entry
    mode, address = bound.driver_entry()
    kernel = (address, mode, bound.kernel._handle.value, bound.grid, bound.block, bound.smem)
    return [LAUNCH, kernel, tuple(layout.place(int(value), n) for value in args), (), (), False, 0.0]


def _schedule(steps: list, layout: Layout, viewed: set, consumed: range) -> None:
    """Each step's born buffers to allocate before it (first use), and the buffers to release after
    it (last use): born ones, and the consumed inputs', unless an output views the buffer."""
    if not steps:
        raise Refused("a call with no steps")
    n_inputs = len(layout.inputs)
    allocate = [[] for _ in steps]
    release = [[] for _ in steps]
    for k in range(len(layout.born)):
        first = layout.first_use.get(n_inputs + k, len(steps))
        if first < len(steps):
            allocate[first].append(k)
        elif n_inputs + k in viewed:  # an output no step writes (an empty tensor's): made before the first
            allocate[0].append(k)
    for buffer in [*consumed, *range(n_inputs, n_inputs + len(layout.born))]:
        if buffer not in viewed and buffer in layout.last_use:
            release[min(layout.last_use[buffer], len(steps) - 1)].append(buffer)
    for step, made, dropped in zip(steps, allocate, release):
        step += [tuple(made), tuple(dropped)]


def tensors_in(obj, depth: int = 4) -> list:
    """Every tensor reachable from obj through tuples, lists, dicts, namespaces and slots."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth == 0 or obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.dtype, torch.device)):
        return []
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, (tuple, list, set, frozenset)):
        items = obj
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)) and not callable(obj):
        items = vars(obj).values()
    elif hasattr(type(obj), "__slots__"):
        items = [getattr(obj, name, None) for name in type(obj).__slots__]
    else:
        return []
    return [t for item in items for t in tensors_in(item, depth - 1)]


def epochs() -> list:
    """What a recording stays valid for: pairgen's selection epoch (a re-tune, a tuned-store change)."""
    return [(runtime.GENERATION, runtime.GENERATION[0])]
