"""Loading cubins and launching kernels on torch's current stream, through cuda.core."""
from __future__ import annotations

import torch

from .compiler import Compiled


class LaunchError(RuntimeError):
    """A kernel launch was refused by the driver."""


_streams: dict[int, object] = {}

try:  # the current stream's handle as an int: 4.4 us through torch.cuda.current_stream() there
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:  # pragma: no cover - older or newer torch without the private binding
    def _raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream
_configs: dict[tuple, object] = {}
_current_device_set: set[int] = set()


def _cuda_core():
    import cuda.core as cc

    return cc


def _ensure_device(index: int) -> None:
    if index not in _current_device_set:
        torch.cuda.init()
        _cuda_core().Device(index).set_current()  # the primary context, shared with torch
        _current_device_set.add(index)


def _stream_for(handle: int):
    stream = _streams.get(handle)
    if stream is None:
        stream = _cuda_core().Stream.from_handle(handle)
        _streams[handle] = stream
    return stream


def _config(grid: int, block: int, smem: int):
    key = (grid, block, smem)
    cfg = _configs.get(key)
    if cfg is None:
        cfg = _cuda_core().LaunchConfig(grid=grid, block=block, shmem_size=smem)
        _configs[key] = cfg
    return cfg


def _allow_dynamic_smem(kernel, nbytes: int, device_index: int) -> None:
    """Blocks may use more than 48 KB of dynamic shared memory only after this opt-in."""
    from cuda.bindings import driver

    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    handle = kernel.handle
    if isinstance(handle, driver.CUkernel):
        (err,) = driver.cuKernelSetAttribute(attr, nbytes, handle, device_index)
    else:
        (err,) = driver.cuFuncSetAttribute(handle, attr, nbytes)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise LaunchError(f"cannot allow {nbytes} B of dynamic shared memory: {err}")


class LoadedKernel:
    """A compiled kernel loaded on one device, launched on torch.cuda.current_stream()."""

    def __init__(self, compiled: Compiled, device_index: int, smem_bytes: int, threads: int):
        _ensure_device(device_index)
        cc = _cuda_core()
        self.device_index = device_index
        self.compiled = compiled
        self.kernel = cc.ObjectCode.from_cubin(compiled.cubin).get_kernel(compiled.kernel_name)
        if smem_bytes > 48 * 1024:
            _allow_dynamic_smem(self.kernel, smem_bytes, device_index)
        self._launch = cc.launch
        self.set_block(threads, smem_bytes)

    def set_block(self, threads: int, smem_bytes: int) -> None:
        """Record the block shape, and how many such blocks fit on one SM (registers included)."""
        self.threads = threads
        self.resident_per_sm = self.kernel.occupancy.max_active_blocks_per_multiprocessor(threads, smem_bytes)

    def __call__(self, grid: int, block: int, smem: int, *args) -> None:
        stream = _stream_for(_raw_stream(self.device_index))
        try:
            self._launch(stream, _config(grid, block, smem), self.kernel, *args)
        except Exception as exc:  # the driver's error, with what was launched
            raise LaunchError(f"launch of {self.compiled.kernel_name} (grid {grid}, block {block}, "
                              f"{smem} B shared) failed: {exc}") from exc
