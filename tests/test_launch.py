"""The launch path's argument block, without a GPU: what cuLaunchKernel would read."""
from __future__ import annotations

import ctypes
import threading

from pairgen.launch import _ArgumentBlock


def test_argument_block_slots_hold_each_argument_as_int64_and_pointers_point_at_them():
    block = _ArgumentBlock(4)
    block.write(0x7F00_1234_5670, 0, 37, -1)  # a device pointer, a null pointer, an int, a negative int
    slots = [ctypes.c_int64.from_address(block.pointers[i]).value for i in range(4)]
    assert slots == [0x7F00_1234_5670, 0, 37, -1]
    assert [ctypes.c_int32.from_address(block.pointers[2]).value] == [37], "an int parameter reads the low bytes"
    block.write(1, 2, 3, 4)  # rewritten in place: the pointers stay valid
    assert [ctypes.c_int64.from_address(block.pointers[i]).value for i in range(4)] == [1, 2, 3, 4]
    assert isinstance(block.lock, type(threading.Lock()))


def test_argument_block_refuses_the_wrong_number_of_arguments():
    import struct

    import pytest

    with pytest.raises(struct.error):
        _ArgumentBlock(3).write(1, 2)


def test_launch_config_structures_match_cuda_h():
    """CUlaunchConfig and CUlaunchAttribute as cuda.h (CUDA 12+) lays them out on 64-bit hosts,
    and a programmatic configuration as cuLaunchKernelEx will read it."""
    from pairgen.launch import (PROGRAMMATIC_STREAM_SERIALIZATION, _LaunchAttribute, _LaunchConfig,
                                programmatic_config)

    assert ctypes.sizeof(_LaunchAttribute) == 72 and _LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(_LaunchConfig) == 56
    assert (_LaunchConfig.hStream.offset, _LaunchConfig.attrs.offset, _LaunchConfig.numAttrs.offset) == (32, 40, 48)
    config = programmatic_config(144, 192, 115_000)
    assert (config.gridDimX, config.gridDimY, config.blockDimX, config.sharedMemBytes) == (144, 1, 192, 115_000)
    assert config.numAttrs == 1 and config.attrs[0].id == PROGRAMMATIC_STREAM_SERIALIZATION
    assert int.from_bytes(bytes(config.attrs[0].value)[:4], "little") == 1


def test_a_launch_on_a_thread_with_no_context_makes_the_device_current_and_retries_once(monkeypatch):
    """Autograd runs a backward on a worker thread of its own, where pairgen's launch may be the
    first CUDA call: the driver answers CUDA_ERROR_INVALID_CONTEXT, the device's primary context is
    made current on that thread and the launch retried; any other failure is raised as it was."""
    from types import SimpleNamespace

    import pytest

    from pairgen import launch

    calls = []
    failures = []
    bound = object.__new__(launch.BoundLaunch)
    bound.kernel = SimpleNamespace(_failed=lambda code, *rest: failures.append(code))
    bound.grid, bound.block, bound.smem, bound.mode, bound._config, bound._device_index = 4, 32, 0, "plain", None, 3
    bound._arguments = _ArgumentBlock(2)
    results = iter([launch.CUDA_ERROR_INVALID_CONTEXT, 0, 700])
    bound._launch = lambda stream, pointers, extra: calls.append(("launch", stream)) or next(results)
    monkeypatch.setattr(launch, "_raw_stream", lambda index: 1000 + index)
    device = lambda index: SimpleNamespace(set_current=lambda: calls.append(("current", index)))
    monkeypatch.setattr(launch, "_cuda_core", lambda: SimpleNamespace(Device=device))
    bound(1, 2)
    assert calls == [("launch", 1003), ("current", 3), ("launch", 1003)] and failures == []
    bound(1, 2)  # an illegal address (700) is not a context to fix: raised, not retried
    assert calls[3:] == [("launch", 1003)] and failures == [700]
    with pytest.raises(Exception):
        next(results)
