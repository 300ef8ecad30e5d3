"""A drop-in module's whole fast-call cycle on the CPU: KernelModule records a call made through a
real BoundLaunch (pairgen/launch.py) whose driver functions are ctypes stand-ins that run a tiny
"kernel" on the CPU (out = x * w[0] + b[0], read and written through the pointers they are given:
the parameters themselves, as the pack kernels read them), then replays later calls from compiled
code with the parameters as inputs, and goes back to the Python path (recording again) when the
parameters' shapes or the call change."""
from __future__ import annotations

import ctypes
import types

import pytest
import torch
from torch import nn

from helpers import CU_LAUNCH_KERNEL
from pairgen import launch
from pairgen.launch import BoundLaunch
from pairgen.module import kernel_module
from pairgen.module.kernel_module import KernelModule
from pairgen.module.parameters import ParameterSlots

pytestmark = pytest.mark.usefixtures("compiled_fast_path")



def _scale_kernel(kernel, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
    """The stand-in kernel: (x, weight, bias, out, count) -> out = x * w[0] + b[0]."""
    x, w, b, out, count = (ctypes.cast(params[k], ctypes.POINTER(ctypes.c_int64))[0] for k in range(5))
    xs = (ctypes.c_float * count).from_address(x)
    w0, b0 = ctypes.c_float.from_address(w).value, ctypes.c_float.from_address(b).value
    outs = (ctypes.c_float * count).from_address(out)
    for i in range(count):
        outs[i] = xs[i] * w0 + b0
    return 0


_KERNEL = CU_LAUNCH_KERNEL(_scale_kernel)


def bound_launch() -> BoundLaunch:
    """A real BoundLaunch on a stand-in LoadedKernel: its driver's plain launch is _KERNEL."""
    driver = types.SimpleNamespace(launch=_KERNEL, cooperative=None, launch_ex=None)
    kernel = types.SimpleNamespace(_driver=driver, _handle=ctypes.c_void_p(0x99), device_index=-1, name="scale",
                                   _failed=lambda code, *_: pytest.fail(f"launch failed: {code}"))
    return BoundLaunch(kernel, grid=1, block=1, smem=0, arg_count=5)


class Scale(KernelModule, nn.Module):
    """out = x * lin.weight[0, 0] + lin.bias[0], computed by the stand-in kernel on CPU float32."""

    # Its one strategy records its float32 calls (the stand-in kernel runs through _launch below).
    op = types.SimpleNamespace(strategies={"scale": types.SimpleNamespace(records=("float32",))})

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1, 1)
        self._slots = ParameterSlots(self, ["lin.weight", "lin.bias"])
        self.python_launches = 0
        # The variant carries the bound launch (a copy of the module drops it, as it drops real ones).
        self.force_variant(types.SimpleNamespace(plan=types.SimpleNamespace(strategy="scale", precision="float32"), bound=bound_launch()))

    def uses_kernel(self, x) -> bool:
        return x.dtype is torch.float32

    def reference_forward(self, x):
        return x * self.lin.weight[0, 0] + self.lin.bias[0]

    def forward(self, x):
        if self._fast_calls:
            out = self._fast_forward(x, *self._slots.weights().tensors)
            if out is not None:
                return out
        return self._dispatch(x)

    def _launch(self, x, out=None, variant=None, weights=None):
        self.python_launches += 1
        out = torch.empty_like(x)
        weight, bias = self._slots.weights().tensors if weights is None else weights.tensors
        variant.bound(x.data_ptr(), weight.data_ptr(), bias.data_ptr(), out.data_ptr(), x.numel())
        return out


@pytest.fixture(autouse=True)
def cpu_streams(monkeypatch):
    """The CPU build of torch has no CUDA streams: stream handles are 0 here."""
    monkeypatch.setattr(launch, "_raw_stream", lambda index: 0)
    monkeypatch.setattr(kernel_module, "current_raw_stream", lambda index: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with torch.no_grad():
        yield


def matches(out, module, x) -> bool:
    """The stand-in computes in double and rounds once; torch rounds the product and the sum."""
    return torch.allclose(out, x * module.lin.weight[0, 0] + module.lin.bias[0], rtol=1e-6, atol=1e-6)


def test_a_recorded_call_is_replayed_in_compiled_code():
    module = Scale()
    x = torch.randn(3, 5)
    assert matches(module(x), module, x)
    assert module.python_launches == 1 and len(module._fast_calls) == 1
    for _ in range(3):
        y = torch.randn(3, 5)
        assert matches(module(y), module, y)
    assert module.python_launches == 1  # every later call was a replay


def test_updates_replay_and_other_calls_go_back_to_python_and_record_again():
    module = Scale()
    x = torch.randn(3, 5)
    module(x)
    module.lin.weight.add_(1.0)  # in place: the replay reads it as it is
    module.lin.bias.data.mul_(-2.0)  # through .data: the same
    assert matches(module(x), module, x) and module.python_launches == 1
    module.lin = nn.Linear(1, 1)  # a submodule swapped in: its parameters are the replay's inputs
    assert matches(module(x), module, x) and module.python_launches == 1
    longer = torch.randn(4, 5)
    module(longer)
    module(longer), module(x)
    assert module.python_launches == 2  # both shapes replay
    assert module(x.double()).dtype is torch.float64  # another dtype: the reference, unrecorded
    assert module.python_launches == 2


def test_recordings_are_bounded_and_dropped_with_the_variant():
    module = Scale()
    for n in range(1, 2 * module.MAX_FAST_CALLS + 1):
        module(torch.randn(n, 3))
    assert len(module._fast_calls) == module.MAX_FAST_CALLS
    module.force_variant(module._forced_plan)
    assert module._fast_calls == ()


def test_a_copy_starts_without_recordings():
    import copy

    module = Scale()
    module(torch.randn(2, 2))
    clone = copy.deepcopy(module)
    assert clone._fast_calls == () and len(module._fast_calls) == 1


def test_the_operators_flags_drop_recordings_and_make_none():
    """pairgen/library.py's flags: the reference on swapped-in weights, and state made per call
    (inside compiled graphs): a replay would skip both."""
    from pairgen import library

    module = Scale()
    x = torch.randn(2, 3)
    module(x)
    with library.state_per_call(module):
        assert module._fast_calls == ()
        assert matches(module(x), module, x) and module.python_launches == 2
        assert module._fast_calls == ()
    with library._reference_only(module):
        assert matches(module(x), module, x) and module.python_launches == 2  # the reference ran
        assert module._fast_calls == ()
