"""Loading cubins (cuda.core) and launching kernels on torch's current stream.

The launch itself goes straight to the driver's cuLaunchKernel through ctypes, with the
argument block built once per kernel and only its values rewritten per call. At the contact
head's seed shape the module call is host-bound: cuda.core's generic `launch` (argument
conversion, LaunchConfig, Stream objects) cost ~15 us of the 44.7 us host path per call on the
H200 machine; this path is one foreign call.
"""
from __future__ import annotations

import ctypes
import threading

import torch

from .compiler import Compiled


class LaunchError(RuntimeError):
    """A kernel launch was refused by the driver."""


try:  # the current stream's handle as an int: 4.4 us through torch.cuda.current_stream() there
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:  # pragma: no cover - older or newer torch without the private binding
    def _raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream

_current_device_set: set[int] = set()
_driver_lock = threading.Lock()
_driver = None


def _cuda_core():
    import cuda.core as cc

    return cc


def _ensure_device(index: int) -> None:
    if index not in _current_device_set:
        torch.cuda.init()
        _cuda_core().Device(index).set_current()  # the primary context, shared with torch
        _current_device_set.add(index)


class _Driver:
    """cuLaunchKernel and cuLaunchCooperativeKernel from libcuda (the library torch loaded).

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


def _allow_dynamic_smem(function, nbytes: int) -> None:
    """Blocks may use more than 48 KB of dynamic shared memory only after this opt-in."""
    from cuda.bindings import driver

    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    (err,) = driver.cuFuncSetAttribute(function, attr, nbytes)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise LaunchError(f"cannot allow {nbytes} B of dynamic shared memory: {err}")


def _function_of(kernel):
    """The CUfunction of a cuda.core kernel in the current (primary) context."""
    from cuda.bindings import driver

    handle = kernel.handle
    if isinstance(handle, driver.CUkernel):
        err, function = driver.cuKernelGetFunction(handle)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise LaunchError(f"cuKernelGetFunction failed: {err}")
        return function
    return handle


class LoadedKernel:
    """One __global__ function of a compiled cubin, loaded on one device, launched on
    torch.cuda.current_stream(). Arguments are Python ints: pointers (tensor.data_ptr()) and
    32-bit integers (the driver reads each parameter's own size from its 8-byte slot)."""

    def __init__(self, compiled: Compiled, device_index: int, smem_bytes: int, threads: int,
                 name: str | None = None):
        _ensure_device(device_index)
        self.device_index = device_index
        self.compiled = compiled
        self.name = name or compiled.kernel_name
        self.kernel = _cuda_core().ObjectCode.from_cubin(compiled.cubin).get_kernel(self.name)
        self._function = _function_of(self.kernel)
        self._handle = ctypes.c_void_p(int(self._function))
        if smem_bytes > 48 * 1024:
            _allow_dynamic_smem(self._function, smem_bytes)
        self._driver = _get_driver()
        self._slots = None  # the argument block: values, and the array of pointers to them
        self.set_block(threads, smem_bytes)

    def set_block(self, threads: int, smem_bytes: int) -> None:
        """Record the block shape, and how many such blocks fit on one SM (registers included)."""
        self.threads = threads
        self.resident_per_sm = self.kernel.occupancy.max_active_blocks_per_multiprocessor(threads, smem_bytes)

    def _arguments(self, args: tuple):
        slots = self._slots
        if slots is None or len(slots[0]) != len(args):
            values = (ctypes.c_uint64 * len(args))()
            base, size = ctypes.addressof(values), ctypes.sizeof(ctypes.c_uint64)
            pointers = (ctypes.c_void_p * len(args))(*[base + i * size for i in range(len(args))])
            slots = self._slots = (values, pointers)
        slots[0][:] = args
        return slots[1]

    def __call__(self, grid: int, block: int, smem: int, *args: int) -> None:
        stream = _raw_stream(self.device_index)
        code = self._driver.launch(self._handle, grid, 1, 1, block, 1, 1, smem, stream,
                                   self._arguments(args), None)
        if code:
            self._failed(code, grid, block, smem)

    def cooperative(self, grid: int, block: int, smem: int, *args: int) -> None:
        """A launch whose blocks are all resident at once (for kernels with a grid-wide barrier)."""
        stream = _raw_stream(self.device_index)
        code = self._driver.cooperative(self._handle, grid, 1, 1, block, 1, 1, smem, stream,
                                        self._arguments(args))
        if code:
            self._failed(code, grid, block, smem)

    def _failed(self, code: int, grid: int, block: int, smem: int):
        raise LaunchError(f"launch of {self.name} (grid {grid}, block {block}, {smem} B shared) "
                          f"failed: {_error_text(code)}")
