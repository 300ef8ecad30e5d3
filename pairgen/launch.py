"""Loading cubins (cuda.core) and launching kernels on torch's current stream.

The launch itself goes straight to the driver's cuLaunchKernel through ctypes, with the
argument block built once per kernel and only its values rewritten per call: small calls are
host-bound, and cuda.core's generic `launch` (argument conversion, LaunchConfig, Stream objects)
costs far more host time than this one foreign call.

Every launch is a BoundLaunch: grid, block and shared memory fixed, converted once, for a kernel
launched at one (B, N) again and again, so a call converts nothing.
"""
from __future__ import annotations

import ctypes
import functools
import operator
import struct
import threading

import torch

from .compiler import Compiled


class LaunchError(RuntimeError):
    """A kernel launch was refused by the driver."""


try:  # the current stream's handle as an int, without torch.cuda.current_stream()'s host cost
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:  # pragma: no cover - older or newer torch without the private binding
    def _raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream

#: thread id -> the launches a fast-call recording (pairgen/fastcall.py) is collecting on it:
#: (BoundLaunch, its arguments) in launch order. Empty unless a recording is under way, so a
#: launch pays one dict truth test for it.
RECORDING: dict[int, list] = {}

def note_launch(bound, args: tuple) -> None:
    """A launch of `bound` with `args`, kept where this thread is recording (RECORDING)."""
    recorded = RECORDING.get(threading.get_ident())
    if recorded is not None:
        recorded.append((bound, args))


#: The current stream of a device as a raw handle (what the driver's launch takes).
current_raw_stream = _raw_stream

_current_device_set: set[int] = set()
_driver_lock = threading.Lock()
_driver = None


def _cuda_core():
    import cuda.core as cc

    return cc


def make_context_current(index: int) -> None:
    """Make the device's primary context (the one torch uses) current on this thread."""
    _cuda_core().Device(index).set_current()


def _ensure_device(index: int) -> None:
    if index not in _current_device_set:
        torch.cuda.init()
        make_context_current(index)
        _current_device_set.add(index)


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute (cuda.h, CUDA 12+): an id, padding to 8 bytes, a 64-byte value union."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h, CUDA 12+), the first argument of cuLaunchKernelEx."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


#: CUresult of a driver call on a thread with no (or a destroyed) context current.
CUDA_ERROR_INVALID_CONTEXT = 201

#: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: the kernel may start before the one
#: before it in the stream has finished (it waits with griddepcontrol.wait: common/pdl.cuh).
PROGRAMMATIC_STREAM_SERIALIZATION = 6


def programmatic_config(grid: int, block: int, smem: int) -> _LaunchConfig:
    """A launch configuration with programmatic stream serialization allowed; the stream is set
    per launch. The attribute array is kept on the config (ctypes holds the pointer only)."""
    attrs = (_LaunchAttribute * 1)()
    attrs[0].id = PROGRAMMATIC_STREAM_SERIALIZATION
    attrs[0].value = (1).to_bytes(4, "little")  # programmaticStreamSerializationAllowed = 1
    config = _LaunchConfig(grid, 1, 1, block, 1, 1, smem, None, attrs, 1)
    config._attrs = attrs
    return config


class _Driver:
    """cuLaunchKernel, cuLaunchCooperativeKernel and cuLaunchKernelEx from libcuda (the library
    torch loaded).

    Opened as a PyDLL, so the GIL is held during the call: filling a kernel's shared argument
    block and launching it is one step that another Python thread cannot interleave."""

    _LAUNCH_ARGS = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, ctypes.c_void_p]

    def __init__(self):
        lib = ctypes.PyDLL("libcuda.so.1")
        self.launch = lib.cuLaunchKernel
        self.launch.argtypes = self._LAUNCH_ARGS + [ctypes.c_void_p]  # ..., kernelParams, extra
        self.launch.restype = ctypes.c_int
        self.cooperative = lib.cuLaunchCooperativeKernel
        self.cooperative.argtypes = self._LAUNCH_ARGS  # ..., hStream, kernelParams
        self.cooperative.restype = ctypes.c_int
        self.launch_ex = lib.cuLaunchKernelEx  # config, f, kernelParams, extra
        self.launch_ex.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self.launch_ex.restype = ctypes.c_int


def _get_driver() -> _Driver:
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
    return _driver


def _error_text(code: int) -> str:
    from cuda.bindings import driver

    try:
        err = driver.CUresult(code)
        _, text = driver.cuGetErrorString(err)
        return f"{err.name}: {text.decode() if text else ''}"
    except Exception:  # an unknown code: say the number
        return f"CUresult {code}"


def _static_smem(function) -> int:
    """The function's static shared arrays (__shared__ declarations), in bytes."""
    from cuda.bindings import driver

    err, nbytes = driver.cuFuncGetAttribute(driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                                            function)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise LaunchError(f"cannot read the static shared memory of a kernel: {err}")
    return nbytes


def _allow_dynamic_smem(function, nbytes: int) -> None:
    """Blocks may use more than 48 KB of shared memory, static and dynamic together, only after
    this opt-in (without it a launch fails with "invalid argument")."""
    from cuda.bindings import driver

    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    (err,) = driver.cuFuncSetAttribute(function, attr, nbytes)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise LaunchError(f"cannot allow {nbytes} B of dynamic shared memory: {err}")


def _function_of(kernel, device_index: int):
    """The CUfunction of a cuda.core kernel in the device's primary context. A thread with no
    context current yet (autograd's backward thread, where a kernel may be loaded on first use) has
    the primary context made current first, as a launch there does (BoundLaunch)."""
    from cuda.bindings import driver

    handle = kernel.handle
    if isinstance(handle, driver.CUkernel):
        err, function = driver.cuKernelGetFunction(handle)
        if err == driver.CUresult.CUDA_ERROR_INVALID_CONTEXT:
            make_context_current(device_index)
            err, function = driver.cuKernelGetFunction(handle)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise LaunchError(f"cuKernelGetFunction failed: {err}")
        return function
    return handle


class LoadedKernel:
    """One __global__ function of a compiled cubin, loaded on one device; launched through the
    BoundLaunch its bind() makes. Arguments are Python ints: pointers (tensor.data_ptr()) and
    integers (the driver reads each parameter's own size from its 8-byte slot)."""

    def __init__(self, compiled: Compiled, device_index: int, smem_bytes: int, threads: int,
                 name: str | None = None):
        _ensure_device(device_index)
        self.device_index = device_index
        self.compiled = compiled
        self.name = name or compiled.kernel_name
        self.kernel = _cuda_core().ObjectCode.from_cubin(compiled.cubin).get_kernel(self.name)
        self._function = _function_of(self.kernel, device_index)
        self._handle = ctypes.c_void_p(int(self._function))
        # The 48 KB default counts static and dynamic shared memory together: a kernel with static
        # arrays (the node prologue inside fused) needs the opt-in below 48 KB of dynamic memory.
        self._smem_allowed = smem_bytes
        if smem_bytes and smem_bytes + _static_smem(self._function) > 48 * 1024:
            _allow_dynamic_smem(self._function, smem_bytes)
        self._driver = _get_driver()
        self.threads = threads
        # Blocks of this shape that fit on one SM (registers included): persistent grids clamp to it.
        self.resident_per_sm = self.kernel.occupancy.max_active_blocks_per_multiprocessor(threads, smem_bytes)

    def bind(self, grid: int, block: int, smem: int, arg_count: int, mode: str = "plain",
             tail: tuple = (), names: tuple = ()) -> "BoundLaunch":
        """This kernel at a fixed grid, block and shared memory, with its own argument block
        (mode, names: see BoundLaunch). A launch that asks for more dynamic shared memory than the
        kernel was loaded with (a fused template's launch gives its own) opts in to it first."""
        if smem > self._smem_allowed and smem + _static_smem(self._function) > 48 * 1024:
            _allow_dynamic_smem(self._function, smem)
            self._smem_allowed = smem
        return BoundLaunch(self, grid, block, smem, arg_count, mode, tail, names)

    def _failed(self, code: int, grid: int, block: int, smem: int):
        raise LaunchError(f"launch of {self.name} (grid {grid}, block {block}, {smem} B shared) "
                          f"failed: {_error_text(code)}")


class _ArgumentBlock:
    """cuLaunchKernel's kernelParams: `count` 8-byte slots and the array of pointers to them.
    Each argument is a Python int written as a little-endian int64 (the driver reads each
    parameter's own size from the low bytes of its slot). Writing and launching happen under
    `lock`: between two Python calls another thread could rewrite the slots."""

    def __init__(self, count: int):
        self.count = count
        self.write = functools.partial(struct.Struct(f"<{count}q").pack_into, bytearray(8 * count), 0)
        values = (ctypes.c_int64 * count).from_buffer(self.write.args[0])
        base = ctypes.addressof(values)
        self.pointers = (ctypes.c_void_p * count)(*[base + 8 * i for i in range(count)])
        self._values = values  # keeps the buffer exported (and so alive and unmoved)
        self.lock = threading.Lock()


#: BoundLaunch modes as pairgen/native/fastcall.cpp numbers them.
FASTCALL_MODES = {"plain": 0, "cooperative": 1, "programmatic": 2}


def _picker(positions: list):
    """A function taking a sequence to the tuple of its items at `positions`."""
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    return lambda sequence: tuple(sequence[p] for p in positions)


def arrange(names: tuple, tail: tuple, values: dict, kernel_name: str) -> list:
    """The positional arguments of a kernel declared with `names`: each name's value from `values`,
    the names not in it filled from `tail` in order. A name not declared, one left without a value,
    or a tail value left over is a TypeError naming the kernel."""
    unknown = set(values) - set(names)
    if unknown:
        raise TypeError(f"{kernel_name}: no argument named {', '.join(sorted(unknown))} (it takes {', '.join(names)})")
    rest = iter(tail)
    ordered = []
    for name in names:
        if name in values:
            ordered.append(values[name])
            continue
        value = next(rest, None)
        if value is None:
            raise TypeError(f"{kernel_name}: no value for its argument {name!r} (given {', '.join(values)}; "
                            f"shape tail {tail})")
        ordered.append(value)
    if next(rest, None) is not None:
        raise TypeError(f"{kernel_name}: shape tail {tail} longer than its arguments left after {', '.join(values)}")
    return ordered


class BoundLaunch:
    """A LoadedKernel at one grid, block and dynamic shared memory: `launch(*args)` writes the
    arguments and launches on torch's current stream. Built once per (variant, device, B, N) by
    runtime.Variant.launches; `tail` holds the trailing shape arguments the kernel's grid function
    gave for that shape (B, N, tiles, ...), which the caller passes after its pointers.
    `names` are the arguments' names as the plan declares them (spec.Kernel.names, checked against
    the template's signature): `launch.named(x=..., out=...)` binds by them.

    mode "programmatic" launches through cuLaunchKernelEx with programmatic stream serialization:
    the kernel may start while the one before it in the stream is still running, and must wait
    for it with pdl_wait() (common/pdl.cuh) before reading what it wrote. "cooperative" launches
    with every block resident at once (kernels with a grid-wide barrier)."""

    __slots__ = ("kernel", "grid", "block", "smem", "mode", "tail", "names", "_orders", "_arguments", "_launch",
                 "_config", "_device_index")

    def __init__(self, kernel: LoadedKernel, grid: int, block: int, smem: int, arg_count: int,
                 mode: str = "plain", tail: tuple = (), names: tuple = ()):
        self.kernel, self.grid, self.block, self.smem = kernel, grid, block, smem
        self.mode, self.tail, self.names = mode, tail, names
        self._orders = {}  # the names a call gives, in its order -> how to arrange them (named())
        self._arguments = _ArgumentBlock(arg_count)
        self._device_index = kernel.device_index
        self._config = None
        dims = [ctypes.c_uint(v) for v in (grid, 1, 1, block, 1, 1, smem)]  # converted once, not per call
        if mode == "programmatic":
            self._config = programmatic_config(grid, block, smem)
            self._launch = functools.partial(kernel._driver.launch_ex, ctypes.byref(self._config), kernel._handle)
        elif mode == "cooperative":
            self._launch = functools.partial(kernel._driver.cooperative, kernel._handle, *dims)
        else:
            self._launch = functools.partial(kernel._driver.launch, kernel._handle, *dims)

    def __call__(self, *args: int) -> None:
        if RECORDING:
            note_launch(self, args)
        arguments = self._arguments
        with arguments.lock:
            arguments.write(*args)
            code = self._launch_written()
            if code == CUDA_ERROR_INVALID_CONTEXT:
                # A thread with no context current yet: autograd's backward runs on a worker thread of
                # its own, where nothing may have touched CUDA before pairgen's first launch. The
                # device's primary context is made current there (once per thread) and the launch
                # retried; checking before every launch would cost each call its host time.
                make_context_current(self._device_index)
                code = self._launch_written()
        if code:
            self.kernel._failed(code, self.grid, self.block, self.smem)

    def named(self, **values: int) -> None:
        """Launch with each argument given by its declared name; those not given are the shape
        tail's, in order (the names after the pointers: B, N, tiles, ...). The arrangement is
        worked out once per set of names given (a call site) and kept, as C-level item picks."""
        given = tuple(values)
        pick = self._orders.get(given)
        if pick is None:
            positions = arrange(self.names, tuple(range(len(given), len(given) + len(self.tail))),
                                dict(zip(given, range(len(given)))), self.kernel.name)
            pick = self._orders[given] = _picker(positions)
        self(*pick((*values.values(), *self.tail)))

    def driver_entry(self) -> tuple[int, int]:
        """(fastcall.cpp's mode number, the address of the driver function this launch calls)."""
        driver = self.kernel._driver
        function = {"plain": driver.launch, "cooperative": driver.cooperative,
                    "programmatic": driver.launch_ex}[self.mode]
        return FASTCALL_MODES[self.mode], ctypes.cast(function, ctypes.c_void_p).value

    def _launch_written(self) -> int:
        """Launch with the arguments already written (under their lock); the driver's result code."""
        arguments = self._arguments
        if self._config is not None:
            self._config.hStream = _raw_stream(self._device_index)
            return self._launch(arguments.pointers, None)
        if self.mode == "cooperative":
            return self._launch(_raw_stream(self._device_index), arguments.pointers)
        return self._launch(_raw_stream(self._device_index), arguments.pointers, None)
