"""Training calls replayed from compiled code (pairgen/replay.py, pairgen/module/training_replay.py),
on the CPU: a bf16 triangle update in the models' form with every kernel on the emulator (its
driver stand-in is what the compiled replay launches), recorded on the Python path and replayed,
must give the Python path's output and gradients bit for bit; what cannot be replayed (other
inputs, another requires_grad pattern, a changed setting or epoch, operations outside the
replayed set, pointers into nothing the replay makes) takes the Python path."""
from __future__ import annotations

import contextlib
import ctypes
import types
from unittest import mock

import pytest
import torch

from helpers import CU_LAUNCH_KERNEL, cuda_autocast, generator
from pairgen import launch, native, replay, runtime
from pairgen.launch import FASTCALL_MODES
from pairgen.module import training_replay
from pairgen.module.autograd import SavedClosedForm

pytestmark = pytest.mark.usefixtures("compiled_fast_path")

WIDTHS = {"P": 128, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 0}


@contextlib.contextmanager
def gpu_path_emulated():
    """The kernels on the emulator, and the closed form choosing as it does for CUDA tensors (its
    fused row kernels and training projections): the path a GPU training call records."""
    from emulator import emulated
    from pairgen.ops.trimul import fused_backward

    with contextlib.ExitStack() as stack:
        stack.enter_context(emulated())
        stack.enter_context(mock.patch.object(fused_backward, "enabled", lambda t: True))
        stack.enter_context(mock.patch.object(torch.Tensor, "is_cuda", property(lambda self: True)))
        stack.enter_context(mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False))
        yield


def _module_and_inputs(seed: int, N: int):
    from pairgen.ops.trimul import TRIMUL

    gen = generator(seed)
    module = TRIMUL.make_module(WIDTHS, gen).bfloat16()
    x, mask = TRIMUL.make_inputs({"B": 1, "N": N, **WIDTHS}, gen, "cauchy")
    mask[0, 3] = False  # a row with no pair
    x = x.bfloat16().requires_grad_()
    return module, x, mask, torch.randn(x.shape, generator=gen).bfloat16()


def _step(module, x, mask, g, replayed: bool) -> list:
    """One training call and backward: (the output, x's gradient, every parameter's), or None where
    `replayed` asked for a replay and none matched."""
    module.zero_grad(set_to_none=True)
    x.grad = None
    if replayed:
        out = training_replay.replayed_call(module, (x, mask, *module._slots.weights().tensors))
        if out is None:
            return None
    else:
        out = SavedClosedForm.run(module, (x, mask), False, training_replay.recorder_for)
    out.backward(g)
    return [out.detach().clone(), x.grad.clone(), *(p.grad.clone() for p in module.parameters())]


def test_a_replayed_training_step_is_the_python_paths_bit_for_bit():
    module, x, mask, g = _module_and_inputs(5, 19)
    with gpu_path_emulated():
        python = _step(module, x, mask, g, replayed=False)
        assert len(module._training_replays) == 1, "the Python path's call was not recorded"
        calls = []
        module.saving_forward = lambda *a: calls.append(1) or type(module).saving_forward(*a)
        first, second = (_step(module, x, mask, g, replayed=True) for _ in range(2))
    assert calls == [], "a replayed call ran the Python forward"
    names = ["output", "x", *(n for n, _ in module.named_parameters())]
    for replayed in (first, second):
        assert [n for n, a, b in zip(names, python, replayed) if not torch.equal(a, b)] == []


def test_other_inputs_patterns_settings_and_epochs_are_not_replayed():
    module, x, mask, g = _module_and_inputs(6, 11)
    with gpu_path_emulated():
        _step(module, x, mask, g, replayed=False)
        weights = module._slots.weights().tensors
        assert training_replay.replayed_call(module, (x[:, :9, :9].contiguous(), mask[:, :9, :9], *weights)) is None
        assert training_replay.replayed_call(module, (x.detach(), mask, *weights)) is None  # x wants no gradient now
        module.recompute_for_backward = True
        assert training_replay.replayed_call(module, (x, mask, *weights)) is None
        module.recompute_for_backward = False
        runtime.GENERATION[0] += 1  # a re-tune, a tuned-store change
        assert training_replay.replayed_call(module, (x, mask, *weights)) is None
        _step(module, x, mask, g, replayed=False)  # recorded again under the new epoch
        assert len(module._training_replays) == 2
        assert _step(module, x, mask, g, replayed=True) is not None
        module.precision = module.precision  # a setting with a setter drops the replays
        assert module._training_replays == ()


def test_an_expanded_incoming_gradient_and_a_second_backward():
    module, x, mask, g = _module_and_inputs(7, 13)
    with gpu_path_emulated():
        python = _step(module, x, mask, g, replayed=False)
        x.grad = None
        module.zero_grad(set_to_none=True)
        out = training_replay.replayed_call(module, (x, mask, *module._slots.weights().tensors))
        (out.float().sum() * 0 + (out * g).sum()).backward(retain_graph=True)  # the incoming gradient is g itself
        assert torch.equal(x.grad, python[1])
        with pytest.raises(RuntimeError, match="consumed by an earlier backward"):
            out.sum().backward()
        # An expanded incoming gradient (out.sum()'s) is made contiguous for the trace.
        x.grad = None
        out = training_replay.replayed_call(module, (x, mask, *module._slots.weights().tensors))
        out.sum().backward()
        x2 = x.detach().clone().requires_grad_()
        module.zero_grad(set_to_none=True)
        SavedClosedForm.run(module, (x2, mask), False, None).sum().backward()
        assert torch.equal(x.grad, x2.grad)


def test_operations_outside_the_replayed_set_and_fp32_products_are_refused():
    a = torch.randn(4, 4)
    with replay.Tracing() as trace:
        torch.sigmoid(a)
    assert "sigmoid" in trace.refused
    with replay.Tracing() as trace:
        a @ a
    assert "float32" in trace.refused
    elsewhere = torch.randn(4, 4).bfloat16()  # neither an input nor made by the call
    with replay.Tracing() as trace:
        b = a.bfloat16()
        c = (b @ elsewhere).sum(0)
    assert trace.refused is None and [s.kind for s in trace.steps] == [replay.COPY, replay.MM, replay.SUM]
    with pytest.raises(replay.Refused, match="a pointer"):
        replay.build(a.device, [a], trace, [c], held=[], epochs=[])
    replay.build(a.device, [a, elsewhere], trace, [c], held=[], epochs=[])  # as an input it is found
    with pytest.raises(replay.Refused, match="overlap"):
        replay.Layout([a, a[1:]], [], [])


def _double(kernel, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
    """The stand-in kernel (src, dst, count): dst[i] = 2 src[i], float32."""
    src, dst, count = (ctypes.cast(params[k], ctypes.POINTER(ctypes.c_int64))[0] for k in range(3))
    ins, outs = (ctypes.c_float * count).from_address(src), (ctypes.c_float * count).from_address(dst)
    for i in range(count):
        outs[i] = 2 * ins[i]
    return 0


_DOUBLE = CU_LAUNCH_KERNEL(_double)


class Doubling:
    """What a trace reads of a BoundLaunch, launching _DOUBLE (recorded like one: launch.note_launch)."""
    kernel = types.SimpleNamespace(_handle=ctypes.c_void_p(0x77))
    grid, block, smem = 1, 1, 0
    launches = 0

    def driver_entry(self):
        return FASTCALL_MODES["plain"], ctypes.cast(_DOUBLE, ctypes.c_void_p).value

    def __call__(self, *args):
        launch.note_launch(self, args)
        values = [ctypes.c_int64(a) for a in args]
        pointers = (ctypes.c_void_p * 3)(*[ctypes.addressof(v) for v in values])
        Doubling.launches += 1
        _DOUBLE(None, 1, 1, 1, 1, 1, 1, 0, None, pointers, None)


def test_a_trace_replays_launches_between_operations_on_new_inputs():
    """A stand-in kernel between PyTorch operations, recorded, then replayed on other inputs of the
    same shape: the same result as the call made again; inputs of another shape are refused."""
    kernel = Doubling()

    def call(x):
        y = x.to(torch.float64).to(torch.float32)  # operations writing born buffers
        out = torch.empty_like(y)
        kernel(y.data_ptr(), out.data_ptr(), y.numel())
        return out.sum(0, keepdim=True)

    x = torch.randn(64)
    with replay.Tracing() as trace:
        expected = call(x)
    capsule = replay.build(x.device, [x], trace, [expected], held=[], epochs=replay.epochs())
    run_trace = native.fastcall().run_trace
    x2 = torch.randn(64)
    before = Doubling.launches
    (out,) = run_trace(capsule, 0, x2)
    assert Doubling.launches == before  # the replay launched through the driver entry, not Python
    assert torch.equal(out, call(x2)) and out.shape == (1,) and torch.equal(expected, call(x))
    assert run_trace(capsule, 0, torch.randn(65)) is None


def test_a_backward_whose_epoch_moved_since_its_forward_recomputes_from_the_inputs():
    module, x, mask, g = _module_and_inputs(8, 11)
    with gpu_path_emulated():
        python = _step(module, x, mask, g, replayed=False)
        module.zero_grad(set_to_none=True)
        x.grad = None
        out = training_replay.replayed_call(module, (x, mask, *module._slots.weights().tensors))
        runtime.GENERATION[0] += 1  # a re-tune between the forward and its backward
        out.backward(g)
    recomputed = [x.grad, *(p.grad for p in module.parameters())]
    for mine, theirs in zip(recomputed, python[1:]):
        assert ((mine.double() - theirs.double()).norm() / theirs.double().norm()).item() <= 1e-2


def test_a_trace_runs_under_the_autocast_it_was_recorded_under_only():
    x = torch.randn(8)
    with replay.Tracing() as trace:
        y = x.bfloat16()
    run_trace = native.fastcall().run_trace
    plain = replay.build(x.device, [x], trace, [y], held=[], epochs=[])
    under_bf16 = replay.build(x.device, [x], trace, [y], held=[], epochs=[], autocast=torch.bfloat16)
    assert run_trace(plain, 0, x) is not None and run_trace(under_bf16, 0, x) is None
    with cuda_autocast(torch.bfloat16):
        assert run_trace(plain, 0, x) is None
        (out,) = run_trace(under_bf16, 0, x)
        assert torch.equal(out, y)
    with cuda_autocast(torch.float16):
        assert run_trace(under_bf16, 0, x) is None


def test_the_16_bit_size_threshold_is_waived_where_training_calls_are_replayed(monkeypatch):
    """Below Routing.closed_form_16_bit_training_min_pairs a 16-bit training call ran the reference
    because the closed form's host time made it no faster; replayed calls pay none of it."""
    from pairgen import config
    from pairgen.module import dispatch

    module, x, mask, _ = _module_and_inputs(9, 11)
    monkeypatch.setattr(config, "fused_backward", lambda: True)
    assert dispatch.trains_through_reference(module, "bfloat16", (x, mask))  # on the CPU: nothing replays
    with mock.patch.object(torch.Tensor, "is_cuda", property(lambda self: True)):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        assert training_replay.replays(module, x)
        assert not dispatch.trains_through_reference(module, "bfloat16", (x, mask))
        module.__dict__["_training_replay_refused"] = "an operation a trace cannot take"
        assert not training_replay.replays(module, x)
        assert dispatch.trains_through_reference(module, "bfloat16", (x, mask))


def test_a_state_passes_a_forwards_buffers_to_its_backward_which_consumes_them():
    """A trace's kept buffers come back in one State; the trace that reads them takes them out of
    it (freeing each after its last use), so a second run on the same State is refused."""
    x = torch.randn(16)
    with replay.Tracing() as forward:
        y = x.double()      # kept for the "backward"
        out = y.float()
    keep = replay.build(x.device, [x], forward, [out], held=[], epochs=[], keep_born=[y])
    kept_bytes = torch.empty(0, dtype=torch.uint8).set_(y.untyped_storage())
    with replay.Tracing() as backward:
        grad = y.sum(0, keepdim=True)
    take = replay.build(x.device, [x, kept_bytes], backward, [grad], held=[], epochs=[], consumed=1)
    run_trace = native.fastcall().run_trace
    x2 = torch.randn(16)
    out2, state = run_trace(keep, 0, x2)
    assert torch.equal(out2, x2) and type(state).__name__ == "PyCapsule"
    assert run_trace(take, 0, torch.randn(3), state) is None  # refused before taking anything
    (grad2,) = run_trace(take, 0, x2, state)
    assert torch.equal(grad2, x2.double().sum(0, keepdim=True))
    assert run_trace(take, 0, x2, state) is None, "a consumed State is not run again"


def test_pairgens_function_trains_replayed_on_the_callers_weights_bit_for_bit():
    """pairgen.triangle_multiplicative_update with the caller's weights wanting gradients (Boltz's,
    OpenFold 3's and Protenix's call): recorded at the second call on the same weights (a first
    call's module may be one made for that call alone), replayed at the next, the output and every
    gradient (the fused 2H-row weights' too) those of the Python path."""
    import pairgen
    from pairgen import functional
    from test_functional import weights as caller_weights

    gen = generator(10)
    w = {k: v.requires_grad_() for k, v in caller_weights(gen, bias=False, dtype=torch.bfloat16, P=128, H=128).items()}
    x = torch.randn(1, 13, 13, 128, generator=gen).bfloat16().requires_grad_()
    mask = torch.rand(1, 13, 13, generator=gen) > 0.2
    g = torch.randn(x.shape, generator=gen).bfloat16()

    def step() -> list:
        for t in (x, *w.values()):
            t.grad = None
        out = pairgen.triangle_multiplicative_update(x, "outgoing", mask, **w)
        out.backward(g)
        return [out.detach().clone(), x.grad.clone(), *(t.grad.clone() for t in w.values())]

    with gpu_path_emulated():
        python = step()
        module = list(functional._modules.values())[-1]  # the one this call built (the newest)
        assert module._training_replays == ()
        assert all(torch.equal(a, b) for a, b in zip(step(), python))
        assert len(module._training_replays) == 1, module.__dict__.get("_training_replay_refused")
        forwards = []
        module.saving_forward = lambda *a: forwards.append(1) or type(module).saving_forward(*a)
        replayed = step()
    assert forwards == [], "the second call ran the Python path"
    names = ["output", "x", *w]
    assert [n for n, a, b in zip(names, python, replayed) if not torch.equal(a, b)] == []


def test_an_fp32_module_under_a_bf16_autocast_is_replayed_bit_for_bit():
    """An fp32 triangle update under a bf16 autocast, as the models (and the README's training
    example) train: its weights cast and its gradients cast back inside the traces. (The widths
    of the other tests here: their emulated kernels are built already.)"""
    from pairgen.ops.trimul import TRIMUL

    widths = WIDTHS
    gen = generator(14)
    module = TRIMUL.make_module(widths, gen)
    x, mask = TRIMUL.make_inputs({"B": 2, "N": 9, **widths}, gen, "cauchy")
    x.requires_grad_()
    g = torch.randn(x.shape, generator=gen).bfloat16()
    with gpu_path_emulated(), cuda_autocast(torch.bfloat16):
        python = _step(module, x, mask, g, replayed=False)
        assert len(module._training_replays) == 1, module.__dict__.get("_training_replay_refused")
        replayed = _step(module, x, mask, g, replayed=True)
    assert python[0].dtype is torch.bfloat16 and python[2].dtype is torch.float32
    names = ["output", "x", *(n for n, _ in module.named_parameters())]
    assert [n for n, a, b in zip(names, python, replayed) if not torch.equal(a, b)] == []


def test_a_caller_whose_weights_are_new_every_call_records_nothing():
    """LayerNorm affines left out are made per call, so each call gets a module of its own: none
    records (a recording per call would only add its cost)."""
    import pairgen
    from pairgen import functional
    from test_functional import weights as caller_weights

    gen = generator(15)
    w = caller_weights(gen, bias=False, dtype=torch.bfloat16, P=128, H=128)
    for name in ("norm_in_bias", "norm_out_bias"):
        del w[name]
    w = {k: v.requires_grad_() for k, v in w.items()}
    x = torch.randn(1, 7, 7, 128, generator=gen).bfloat16().requires_grad_()
    mask = torch.ones(1, 7, 7, dtype=torch.bool)
    recorded = []
    real = training_replay.Recorder.__init__
    before = set(map(id, functional._modules.values()))
    with gpu_path_emulated(), mock.patch.object(training_replay.Recorder, "__init__",
                                                lambda self, *a: recorded.append(1) or real(self, *a)):
        for _ in range(3):
            pairgen.triangle_multiplicative_update(x, "outgoing", mask, **w).sum().backward()
    made = [m for m in functional._modules.values() if id(m) not in before]
    assert len(made) == 3, "a module per call"
    assert recorded == [] and not any(m._training_replays for m in made)


def test_a_module_whose_recording_was_refused_records_no_more():
    module, x, mask, g = _module_and_inputs(16, 9)
    module.__dict__["_training_replay_refused"] = "an operation a trace cannot take"
    with gpu_path_emulated():
        _step(module, x, mask, g, replayed=False)
    assert module._training_replays == () and "_training_record_counts" not in module.__dict__
