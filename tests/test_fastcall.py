"""Recorded calls (pairgen/fastcall.py) replayed by the compiled module (pairgen/native/fastcall.cpp),
on the CPU: the driver's launch functions are replaced by ctypes stand-ins that record what they
were given, so the argument blocks, the launch configurations and every reason a replay must
refuse are checked without a GPU."""
from __future__ import annotations

import ctypes
import types

import pytest
import torch

from helpers import CU_LAUNCH_KERNEL, cuda_autocast
from pairgen import fastcall, native
from pairgen.launch import FASTCALL_MODES, _LaunchConfig



pytestmark = pytest.mark.usefixtures("compiled_fast_path")

EX = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                      ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)


@pytest.fixture(autouse=True)
def no_grad():
    """Inference calls, as a replay serves (the parameters want gradients: autograd would record)."""
    with torch.no_grad():
        yield


class Driver:
    """Stand-ins for cuLaunchKernel and cuLaunchKernelEx: each call's kernel, dimensions, stream
    and argument values (read as int64 slots) are kept in `calls`; `codes` are returned in turn."""

    def __init__(self, arg_count: int, codes=()):
        self.calls, self.codes, self.arg_count = [], list(codes), arg_count
        self.plain = CU_LAUNCH_KERNEL(self._plain)
        self.ex = EX(self._ex)

    def _values(self, params):
        return [ctypes.cast(params[k], ctypes.POINTER(ctypes.c_int64))[0] for k in range(self.arg_count)]

    def _plain(self, kernel, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self.calls.append({"kernel": kernel, "dims": (gx, gy, gz, bx, by, bz, smem), "stream": stream,
                           "args": self._values(params)})
        return self.codes.pop(0) if self.codes else 0

    def _ex(self, config, kernel, params, extra):
        c = config.contents
        attribute = c.attrs[0]
        self.calls.append({"kernel": kernel, "dims": (c.gridDimX, c.gridDimY, c.gridDimZ, c.blockDimX, c.blockDimY,
                                                      c.blockDimZ, c.sharedMemBytes),
                           "stream": c.hStream, "attribute": (c.numAttrs, attribute.id, attribute.value[0]),
                           "args": self._values(params)})
        return self.codes.pop(0) if self.codes else 0

    def address(self, mode: str) -> int:
        return ctypes.cast(self.ex if mode == "programmatic" else self.plain, ctypes.c_void_p).value


def bound(driver: Driver, mode="plain", kernel=0x1234, grid=7, block=128, smem=4096):
    """What fastcall.build reads of a BoundLaunch."""
    return types.SimpleNamespace(driver_entry=lambda: (FASTCALL_MODES[mode], driver.address(mode)),
                                 kernel=types.SimpleNamespace(_handle=ctypes.c_void_p(kernel)),
                                 grid=grid, block=block, smem=smem)


class Packed:
    """A tensor the module holds (its address a constant of the recording), made from a layer."""

    def __init__(self, module: torch.nn.Module):
        self._owners = (module._parameters, module._parameters)
        self._names = ("weight", "bias")
        self._params = [module.weight, module.bias]
        self._key = [p._version for p in self._params]
        self._packed = torch.cat([module.weight.detach().reshape(-1), module.bias.detach()])


def record(driver, x, mask, layer, mode="plain", epoch=None, extra_constant=None):
    """A recorded call of one kernel (x, mask, packed weights, a noted scratch, out, 5, 1)."""
    out = torch.empty(x.shape[:3])
    scratch = torch.empty(1000)
    pack = Packed(layer)
    args = [x.data_ptr(), mask.data_ptr(), pack._packed.data_ptr(), scratch.data_ptr() + 8, out.data_ptr() + 4, 5, 1]
    if extra_constant is not None:
        args.append(extra_constant)
    epochs = [(epoch, epoch[0])] if epoch is not None else []
    recorded = fastcall.build((x, mask), out, [(bound(driver, mode), tuple(args))], [scratch], [pack._packed], epochs)
    return recorded, pack


def inputs():
    return torch.randn(2, 5, 5, 8), torch.ones(2, 5, 5, dtype=torch.bool)


def test_replay_writes_every_argument_and_allocates_the_output():
    driver, layer = Driver(7), torch.nn.Linear(3, 2)
    x, mask = inputs()
    recorded, pack = record(driver, x, mask, layer)
    assert recorded is not None
    x2, mask2 = inputs()
    out = native.fastcall().call(recorded, 0xABC, x2, mask2)
    assert out.shape == (2, 5, 5) and out.dtype is torch.float32 and out.device == x2.device
    (call,) = driver.calls
    assert call["kernel"] == 0x1234 and call["dims"] == (7, 1, 1, 128, 1, 1, 4096) and call["stream"] == 0xABC
    x_ptr, mask_ptr, weights, scratch, out_ptr, five, one = call["args"]
    assert (x_ptr, mask_ptr, weights, five, one) == (x2.data_ptr(), mask2.data_ptr(), pack._packed.data_ptr(), 5, 1)
    assert out_ptr == out.data_ptr() + 4  # an address inside the output keeps its offset
    assert scratch % 16 == 8  # inside a fresh per-call buffer, at the recorded offset
    assert scratch not in (x_ptr, mask_ptr, weights, out_ptr)


def test_programmatic_launch_sets_the_stream_serialization_attribute():
    driver, layer = Driver(7), torch.nn.Linear(3, 2)
    x, mask = inputs()
    recorded, _ = record(driver, x, mask, layer, mode="programmatic")
    native.fastcall().call(recorded, 0x55, x, mask)
    (call,) = driver.calls
    assert call["attribute"] == (1, 6, 1) and call["stream"] == 0x55 and call["dims"] == (7, 1, 1, 128, 1, 1, 4096)


@pytest.mark.parametrize("change", ["shape", "dtype", "strides", "count", "subclass", "device-like"])
def test_inputs_unlike_the_recording_take_the_python_path(change):
    driver, layer = Driver(7), torch.nn.Linear(3, 2)
    x, mask = inputs()
    recorded, _ = record(driver, x, mask, layer)
    args = {"shape": (torch.randn(2, 6, 6, 8), torch.ones(2, 6, 6, dtype=torch.bool)),
            "dtype": (x.double(), mask),
            "strides": (torch.randn(2, 5, 8, 5).transpose(2, 3), mask),
            "count": (x,),
            "subclass": (x.as_subclass(OtherTensor), mask),
            "device-like": ("not a tensor", mask)}[change]
    assert native.fastcall().call(recorded, 0, *args) is None
    assert driver.calls == []


class OtherTensor(torch.Tensor):
    """A tensor subclass: its __torch_function__ may mean anything, so a replay does not take it."""


def test_parameters_are_taken_as_plain_tensors():
    """A model passes its weights to pairgen's function as they are: nn.Parameter inputs replay."""
    driver, layer = Driver(7), torch.nn.Linear(3, 2)
    x, mask = inputs()
    recorded, _ = record(driver, x, mask, layer)
    assert native.fastcall().call(recorded, 0, torch.nn.Parameter(x, requires_grad=False), mask) is not None


def test_misaligned_input_takes_the_python_path():
    driver, layer = Driver(7), torch.nn.Linear(3, 2)
    x, mask = inputs()
    recorded, _ = record(driver, x, mask, layer)
    storage = torch.randn(2 * 5 * 5 * 8 + 1)
    assert native.fastcall().call(recorded, 0, storage[1:].view(2, 5, 5, 8), mask) is None


def test_autograd_and_epochs_take_the_python_path():
    driver, layer = Driver(7), torch.nn.Linear(3, 2)
    epoch = [3]
    x, mask = inputs()
    recorded, _ = record(driver, x, mask, layer, epoch=epoch)
    assert native.fastcall().call(recorded, 0, x, mask) is not None
    epoch[0] += 1
    assert native.fastcall().call(recorded, 0, x, mask) is None
    epoch[0] -= 1
    with torch.enable_grad():
        assert native.fastcall().call(recorded, 0, x, mask) is not None  # nothing wants gradients
        assert native.fastcall().call(recorded, 0, x.requires_grad_(), mask) is None  # an input (a weight) does


def test_launch_failures():
    layer = torch.nn.Linear(3, 2)
    x, mask = inputs()
    driver = Driver(7, codes=[201])  # no context current on this thread: the Python path sets it
    recorded, _ = record(driver, x, mask, layer)
    assert native.fastcall().call(recorded, 0, x, mask) is None
    driver.codes = [700]
    with pytest.raises(RuntimeError, match="CUresult 700"):
        native.fastcall().call(recorded, 0, x, mask)


def test_unknown_addresses_are_not_recorded():
    driver, layer = Driver(8), torch.nn.Linear(3, 2)
    x, mask = inputs()
    # An address of something made and dropped during the call: a replay could not reproduce it.
    # Written as a value, since where a real CPU block lands depends on the allocator (the GPU
    # host's Python put a 1 MiB tensor below 4 GiB, where small integers live); device memory is
    # mapped above 4 GiB.
    stray_address = 0x7F12_3456_7000
    recorded, _ = record(driver, x, mask, layer, extra_constant=stray_address)
    assert recorded is None


def test_recording_backs_off_when_recordings_keep_going_stale():
    every_call = [fastcall.may_record(slow, recorded)
                  for slow, recorded in ((k, min(k - 1, fastcall.FREE_RECORDINGS)) for k in range(1, 10))]
    assert all(every_call[: fastcall.FREE_RECORDINGS])  # the first slow calls all record
    recorded = 0
    for slow in range(1, 1001):  # a module none of whose recordings is ever replayed
        if fastcall.may_record(slow, recorded):
            recorded += 1
    assert recorded <= 1000 // fastcall.RECORD_EVERY + 1 and recorded >= 1000 // fastcall.RECORD_EVERY - 1


def test_classify():
    inputs_at, out, scratch, held = {1 << 40: 0}, (1 << 41, (1 << 41) + 64), [((1 << 42), (1 << 42) + 32, 256)], \
        [((1 << 43), (1 << 43) + 16)]
    assert fastcall.classify(1 << 40, inputs_at, out, scratch, held) == (1, 0)
    assert fastcall.classify((1 << 41) + 8, inputs_at, out, scratch, held) == (2, 8)
    assert fastcall.classify((1 << 41) + 64, inputs_at, out, scratch, held) is None  # one past the output
    assert fastcall.classify((1 << 42) + 4, inputs_at, out, scratch, held) == (3, 260)
    assert fastcall.classify((1 << 43) + 4, inputs_at, out, scratch, held) == (0, (1 << 43) + 4)
    assert fastcall.classify(-1, inputs_at, out, scratch, held) == (0, -1)
    assert fastcall.classify(1 << 44, inputs_at, out, scratch, held) is None


def test_inputs_sharing_an_address_are_not_recorded():
    driver, layer = Driver(7), torch.nn.Linear(3, 2)
    x, _ = inputs()
    out, pack = torch.empty(2, 5, 5), Packed(layer)
    args = (x.data_ptr(), x.data_ptr(), pack._packed.data_ptr(), out.data_ptr(), 5, 1, 0)
    assert fastcall.build((x, x), out, [(bound(driver), args)], [], [pack._packed], []) is None



def test_a_noted_product_is_replayed_between_the_kernels():
    """A runner's batched product between two launches (the 16-bit triangle update's bmm) runs in
    the replay, in order, on views of the new inputs, into the new output; a product on anything
    the replay cannot reproduce is not recorded."""
    driver = Driver(2)
    left, right = torch.randn(3, 4, 6), torch.randn(3, 5, 6)
    out = torch.empty(3, 4, 5)
    kernel = (bound(driver), (left.data_ptr(), out.data_ptr()))
    product = (fastcall.PRODUCT, (left, right.transpose(1, 2), out))
    recorded = fastcall.build((left, right), out, [kernel, product, kernel], [], [], [])
    assert recorded is not None
    left2, right2 = torch.randn(3, 4, 6), torch.randn(3, 5, 6)
    replayed = native.fastcall().call(recorded, 0, left2, right2)
    torch.testing.assert_close(replayed, torch.bmm(left2, right2.transpose(1, 2)))
    assert [call["args"] for call in driver.calls] == [[left2.data_ptr(), replayed.data_ptr()]] * 2
    stray = torch.randn(3, 6, 5)  # made during the call and dropped: no replay can find it
    assert fastcall.build((left, right), out, [kernel, (fastcall.PRODUCT, (left, stray, out))], [], [], []) is None


def test_note_product_is_collected_only_while_recording():
    a, b, out = torch.randn(2, 3, 4), torch.randn(2, 4, 5), torch.empty(2, 3, 5)
    fastcall.note_product(a, b, out)  # outside a recording: nothing to collect, nothing raised
    with fastcall.recording() as (launches, _):
        fastcall.note_product(a, b, out)
    assert launches == [(fastcall.PRODUCT, (a, b, out))]


def test_a_noted_copy_casts_the_new_input_before_the_kernel_that_reads_it():
    """An fp32 input cast to 16 bits into a per-call buffer (the triangle update under autocast) is
    cast again by each replay, from the new input, into the replay's own buffer, which the kernel
    after it is given; a copy into a buffer nobody noted is not recorded."""
    seen = []

    class Reading(Driver):  # keeps the bytes its kernel's first argument points at, when launched
        def _plain(self, kernel, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            code = super()._plain(kernel, gx, gy, gz, bx, by, bz, smem, stream, params, extra)
            seen.append(ctypes.string_at(self.calls[-1]["args"][0], x.numel() * 2))
            return code

    driver = Reading(2)
    x = torch.randn(2, 5, 5, 8)
    half = torch.empty(x.shape, dtype=torch.bfloat16)
    out = torch.empty(2, 5, 5, dtype=torch.bfloat16)
    launches = [(fastcall.COPY, (x, half)), (bound(driver), (half.data_ptr(), out.data_ptr()))]
    recorded = fastcall.build((x,), out, launches, [half], [], [])
    assert recorded is not None
    x2 = torch.randn(2, 5, 5, 8)
    native.fastcall().call(recorded, 0, x2)
    (call,) = driver.calls
    assert call["args"][0] not in (x2.data_ptr(), half.data_ptr())  # the replay's own buffer
    cast = torch.frombuffer(bytearray(seen[0]), dtype=torch.bfloat16).view(x.shape)
    assert torch.equal(cast, x2.to(torch.bfloat16))
    stray = torch.empty(x.shape, dtype=torch.bfloat16)  # made during the call and not noted
    assert fastcall.build((x,), out, [(fastcall.COPY, (x, stray)), launches[1]], [half], [], []) is None


def test_a_call_recorded_under_autocast_replays_under_that_autocast_only():
    """The autocast a call ran under decides its casts and its kernels' precision: a recording
    replays under the same CUDA autocast dtype, and a recording made without one never under one."""
    driver, layer = Driver(7), torch.nn.Linear(3, 2)
    x, mask = inputs()
    out, scratch, pack = torch.empty(x.shape[:3]), torch.empty(1000), Packed(layer)
    args = (x.data_ptr(), mask.data_ptr(), pack._packed.data_ptr(), scratch.data_ptr(), out.data_ptr(), 5, 1)
    launches = [(bound(driver), args)]
    under = fastcall.build((x, mask), out, launches, [scratch], [pack._packed], [], torch.bfloat16)
    plain = fastcall.build((x, mask), out, launches, [scratch], [pack._packed], [])
    replay = native.fastcall().call
    assert replay(under, 0, x, mask) is None and replay(plain, 0, x, mask) is not None
    with cuda_autocast(torch.bfloat16):
        assert replay(under, 0, x, mask) is not None and replay(plain, 0, x, mask) is None
    with cuda_autocast(torch.float16):
        assert replay(under, 0, x, mask) is None
