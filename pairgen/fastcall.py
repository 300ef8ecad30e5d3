"""Fast calls: a module call recorded once, replayed from compiled code (pairgen/native/fastcall.cpp).

At the seed shapes a module call is bound by its host path (Python checks, dispatch, allocation
and a ctypes driver call take longer than the GPU work). So a kernel call
made the ordinary way is recorded: every launch with its arguments, each argument classified as
  - the data of one of the call's inputs (the weights are inputs too: a module passes its
    parameters, the functional form the caller's tensors),
  - an address inside the output, or inside a per-call buffer a runner noted (note_scratch; the
    weights packed for the call are one),
  - a constant: a small integer (shapes, flags) or an address inside a tensor the module holds
    (held scratch, barrier ints),
and an argument that is none of these (a buffer made and dropped during the call, an input copied
to make it contiguous) means the call is not recorded. The recording holds what makes it valid:
the inputs' shapes and dtypes, pairgen's epoch counter (a re-tune or a tuned-store change). fastcall.cpp checks all of it per call and returns None when anything
differs; the module then takes its Python path, which records again.
"""
from __future__ import annotations

import contextlib
import threading

import torch

from . import launch, native

#: Per-call buffers are carved from one allocation, each at this alignment (the caching
#: allocator's own granularity is 512 bytes; the kernels need 16).
SCRATCH_ALIGNMENT = 256

#: Arguments below this are integers (shapes, counts, flags): device and host addresses on a
#: 64-bit Linux process lie far above it.
SMALL_INTEGERS = 2**32

#: A module records freely for its first this-many slow calls, then at most one slow call in
#: RECORD_EVERY: recording costs about a Python call's host time, and a module whose calls keep
#: failing to replay (their inputs changing shape, dtype or contiguity every time, or pairgen's
#: selection epoch moving) must not pay it on every call.
FREE_RECORDINGS = 8
RECORD_EVERY = 8


def may_record(slow_calls: int, recordings: int) -> bool:
    """Whether a module that has made `slow_calls` calls on the Python path (this one included)
    and `recordings` recordings records this call."""
    return recordings < FREE_RECORDINGS or recordings * RECORD_EVERY <= slow_calls


#: thread id -> the per-call buffers noted during a recording on it.
_NOTED: dict[int, list] = {}


def note_scratch(tensor: torch.Tensor) -> None:
    """A runner's per-call buffer (scratch made for this call and dropped after it): a recorded
    call allocates one of the same size on every replay. No-op outside a recording."""
    if _NOTED:
        noted = _NOTED.get(threading.get_ident())
        if noted is not None:
            noted.append(tensor)


def note_product(left: torch.Tensor, right: torch.Tensor, out: torch.Tensor) -> None:
    """A runner's batched product out = left @ right (torch.bmm, on 16-bit operands: no cuBLAS mode
    to set), between its kernels: a replay runs it in compiled code, in launch order, on the
    same views of its inputs, output and per-call buffers. No-op outside a recording."""
    _note(PRODUCT, (left, right, out))


def note_copy(source: torch.Tensor, out: torch.Tensor) -> None:
    """A runner's out.copy_(source) between or after its kernels (under autocast: an fp32 input cast
    to the kernels' 16-bit operand type, a 16-bit result widened into the fp32 output): a replay
    runs it in compiled code, in launch order, on the same views. No-op outside a recording."""
    _note(COPY, (source, out))


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype` (a runner's fp32 input cast to its kernels' 16-bit operand type under autocast),
    in a per-call buffer, both noted: a recorded call's replay casts its new input the same way."""
    out = torch.empty(t.shape, device=t.device, dtype=dtype)
    note_scratch(out)
    out.copy_(t)
    note_copy(t, out)
    return out


def _note(mode: int, tensors: tuple) -> None:
    """A PyTorch operation of a runner's, in this thread's recording (if any) among its launches."""
    if launch.RECORDING:
        recorded = launch.RECORDING.get(threading.get_ident())
        if recorded is not None:
            recorded.append((mode, tensors))


#: Tensor subclasses a replay takes as inputs like plain tensors: parameters (a module's own, or a
#: model's passed to pairgen's function as they are).
PLAIN_TYPES: tuple = (torch.nn.Parameter,)

#: The modes fastcall.cpp runs a noted product and a noted copy in (its kernels' modes are
#: launch.FASTCALL_MODES).
PRODUCT, COPY = 3, 4
#: What a recording holds besides launches: the noted operations' modes.
NOTED_OPERATIONS = (PRODUCT, COPY)


@contextlib.contextmanager
def recording():
    """Collect this thread's launches and noted buffers: yields (launches, scratch) lists."""
    ident = threading.get_ident()
    launches, scratch = [], []
    launch.RECORDING[ident], _NOTED[ident] = launches, scratch
    try:
        yield launches, scratch
    finally:
        del launch.RECORDING[ident], _NOTED[ident]


def extent(t: torch.Tensor) -> tuple[int, int]:
    """(first byte, one past the last) of a contiguous tensor's data."""
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def is_constant(value: int, held: list) -> bool:
    """Whether an argument a recording keeps as it is: a small integer (shapes, counts, flags) or an
    address inside a tensor the module holds (held: their extents)."""
    return -SMALL_INTEGERS < value < SMALL_INTEGERS or any(start <= value < end for start, end in held)


def _scratch_layout(scratch: list) -> tuple[list, int]:
    """[(start, end, offset in the replay's buffer)] per noted buffer, and the total bytes."""
    layout, total = [], 0
    for t in scratch:
        start, end = extent(t)
        layout.append((start, end, total))
        total = -(-(total + end - start) // SCRATCH_ALIGNMENT) * SCRATCH_ALIGNMENT
    return layout, total


def classify(value: int, inputs: dict, out: tuple, scratch: list, held: list) -> tuple[int, int] | None:
    """One argument as fastcall.cpp's (source, value), or None: an address of nothing the replay
    can reproduce."""
    if value in inputs:
        return 1, inputs[value]
    if out[0] <= value < out[1]:
        return 2, value - out[0]
    for start, end, offset in scratch:
        if start <= value < end:
            return 3, offset + value - start
    if is_constant(value, held):
        return 0, value
    return None


def build(inputs: tuple, out: torch.Tensor, launches: list, scratch: list, held: list, epochs: list,
          autocast: "torch.dtype | None" = None):
    """The compiled recording of one call, or None where it cannot be replayed.
    held: the tensors the module holds; epochs: [(one-element list, its value)]; autocast: the
    CUDA autocast dtype the call ran under (a replay runs under that one only), None for none."""
    native_module = native.fastcall()
    if native_module is None or not launches:
        return None
    input_data = {t.data_ptr(): index for index, t in enumerate(inputs)}
    if len(input_data) != len(inputs):  # two inputs at one address: a replay could not tell them apart
        return None
    scratch_layout, scratch_bytes = _scratch_layout(scratch)
    extents = sorted((start, end) for start, end, _ in scratch_layout)
    if any(later[0] < earlier[1] for earlier, later in zip(extents, extents[1:])):
        return None  # a noted buffer freed during the call and its memory noted again: addresses would be ambiguous
    out_extent = extent(out)
    held_extents = [extent(t) for t in held]
    specs = []
    for bound, args in launches:
        if bound in NOTED_OPERATIONS:
            spec = _operation_spec(bound, args, input_data, out_extent, scratch_layout)
            if spec is None:
                return None
            specs.append(spec)
            continue
        slots = []
        for value in args:
            slot = classify(int(value), input_data, out_extent, scratch_layout, held_extents)
            if slot is None:
                return None
            slots.append(slot)
        mode, address = bound.driver_entry()
        specs.append((address, mode, bound.kernel._handle.value, bound.grid, bound.block, bound.smem, tuple(slots), ()))
    device = out.device
    return native_module.build(device.type, -1 if device.index is None else device.index, tuple((tuple(t.shape), t.dtype) for t in inputs),
                               (tuple(out.shape), out.dtype), scratch_bytes, tuple(epochs),
                               tuple(specs), PLAIN_TYPES, autocast)


def _operation_spec(mode: int, tensors: tuple, input_data: dict, out_extent: tuple, scratch_layout: list):
    """A noted product or copy as fastcall.cpp takes it: its tensors' data as slots (each an input,
    in the output or in a per-call buffer: never a constant), with their sizes and strides, then the
    dtypes (a product's one, its operands' and output's; a copy's source's and destination's); None
    where one lies elsewhere."""
    slots, geometry = [], []
    for t in tensors:
        slot = classify(t.data_ptr(), input_data, out_extent, scratch_layout, [])
        if slot is None or slot[0] == 0:
            return None
        slots.append(slot)
        geometry += [tuple(t.shape), tuple(t.stride())]
    dtypes = (tensors[2].dtype,) if mode == PRODUCT else (tensors[0].dtype, tensors[1].dtype)
    return 0, mode, 0, 0, 0, 0, tuple(slots), (*geometry, *dtypes)

