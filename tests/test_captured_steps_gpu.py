"""GPU: closed-form training calls replayed from captured CUDA graphs (pairgen/module/captured.py).

Each op, in fp32 and bf16, at odd shapes with heavy tails (the triangle update with an empty mask
row): fresh inputs every step, the first step uncaptured, the second captured, later ones
replayed, with the graphs' own output and gradient buffers NaN-filled before a replay (what a
replay does not write shows); every step's output and gradients against float64 autograd by the
standard of their precision. Then what a library's caller relies on: an output or gradient is not
overwritten by a later call; two forwards before their backwards hold two slots and a third runs
uncaptured; a forward dropped without a backward gives its slot back; a second backward through
one call is refused; an optimizer's in-place update is seen; an autocast call matches its
uncaptured twin."""
from __future__ import annotations

import copy
import gc
from dataclasses import replace

import pytest
import torch

from helpers import assert_16_bit_gradients_meet_the_standard, generator
from pairgen.module import captured, dispatch
from pairgen.ops import get_op
from pairgen.spec import SIXTEEN_BIT_TOLERANCE
from pairgen.tuning.check import compare, reference64

pytestmark = pytest.mark.gpu

#: op -> an odd shape (the triangle update gets an empty mask row)
SHAPES = {"contact": {"B": 2, "N": 37, "P": 48, "H": 32},
          "trimul": {"B": 1, "N": 37, "P": 64, "H": 48, "outgoing": 1, "gate_normalized": 1, "bias": 0},
          "readout": {"B": 2, "N": 23, "D": 40, "P": 16, "H": 56}}
FP32_BOUND = 2e-5  # the fp32 gradient standard (relative L2)


def _module(op: str, dtype: torch.dtype, seed: int = 3):
    spec = get_op(op)
    module = spec.make_module(spec.widths_of(SHAPES[op]), generator(seed)).cuda().to(dtype)
    module.backward_mode = "closed_form"
    module.capture_training_steps = True
    # calls no kernel computes (a bf16 readout at these widths) take the closed form too
    module.routing = replace(module.routing, closed_form_min_pairs=0)
    return module


def _inputs(op: str, dtype: torch.dtype, seed: int) -> tuple:
    spec = get_op(op)
    inputs = [t.cuda() for t in spec.make_inputs(SHAPES[op], generator(seed), "cauchy")]
    if op == "trimul":  # a bool mask: a floating one would want its own gradient, which the closed form leaves out
        inputs[1] = inputs[1].bool()
        inputs[1][0, SHAPES[op]["N"] // 2, :] = False
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)


def _step(module, inputs: tuple, g: torch.Tensor) -> tuple:
    """(out, [gradient of each floating input, then of each parameter]) of (out * g).sum()."""
    module.zero_grad(set_to_none=True)
    leaves = [t.clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
    out = module(*leaves)
    (out * g).sum().backward()
    return out.detach(), [t.grad for t in leaves if t.is_floating_point()] + [p.grad for p in module.parameters()]


def _nan_fill_slots(module) -> None:
    for slots in captured.steps_of(module).slots.values():
        for slot in slots:
            slot.out.fill_(float("nan"))
            for g in slot.grads.values():
                g.fill_(float("nan"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", sorted(SHAPES))
def test_captured_steps_meet_the_standard(op, dtype):
    module = _module(op, dtype)
    steps = captured.steps_of(module)
    # the fp32 readout's sparse max gradient is sized by its values: never captured
    capturable = not (op == "readout" and dtype is torch.float32)
    with torch.no_grad():
        out_shape = module(*_inputs(op, dtype, 9)).shape
    for step in range(4):
        inputs = _inputs(op, dtype, 10 + step)
        g = torch.randn(out_shape, generator=generator(20 + step)).cuda().to(dtype)
        if step >= 2:
            _nan_fill_slots(module)
        out, grads = _step(module, inputs, g)
        held = steps.held()
        expected = (1, 1) if step > 0 and capturable else (0, 0)
        assert (steps.captures, held) == expected, f"step {step}: {steps.captures}, {held}"
        tolerance = SIXTEEN_BIT_TOLERANCE if dtype is torch.bfloat16 else module.op.tolerance["float32"]
        result = compare(out, reference64(module, inputs), tolerance)
        assert result.ok, f"step {step}: {result}"
        if dtype is torch.bfloat16:
            assert_16_bit_gradients_meet_the_standard(module, inputs, g, grads)
        else:
            errors = _errors64(module, inputs, g, grads)
            assert max(errors.values()) <= FP32_BOUND, f"step {step}: {errors}"


def _errors64(module, inputs: tuple, g: torch.Tensor, grads: list) -> dict:
    """Relative L2 error of each of `grads` (_step's) against float64 autograd of the reference."""
    reference = module.op.make_reference(module).double()
    leaves = [t.detach().double().requires_grad_() if t.is_floating_point() else t for t in inputs]
    (reference(*leaves) * g.double()).sum().backward()
    exact = [t.grad for t in leaves if t.is_floating_point()] + [p.grad for p in reference.parameters()]
    names = [f"input {k}" for k, t in enumerate(inputs) if t.is_floating_point()] + [n for n, _ in module.named_parameters()]
    assert len(exact) == len(grads) == len(names)
    return {name: ((mine.double() - e).norm() / e.norm()).item() for name, mine, e in zip(names, grads, exact)}


def test_outputs_and_gradients_stay_the_callers():
    """Two forwards hold two slots, a third runs uncaptured; each call's output and gradient are
    its own (unchanged by the later calls) and right (fp32, against float64)."""
    module = _module("contact", torch.float32)
    steps = captured.steps_of(module)
    for seed in (1, 2):  # the first uncaptured, the second captured
        _step(module, _inputs("contact", torch.float32, seed), torch.ones(2, 37, 37, device="cuda"))
    xs = [_inputs("contact", torch.float32, 30 + k)[0].requires_grad_() for k in range(3)]
    gs = [torch.randn(2, 37, 37, generator=generator(40 + k)).cuda() for k in range(3)]
    outs = [module(x) for x in xs]
    assert steps.captures == 2 and [s.busy for s in steps.slots[next(iter(steps.slots))]] == [True, True]
    assert captured.pool_spare_bytes(module) > 0  # the backward's temporaries, held by the graphs
    kept = [o.detach().clone() for o in outs]
    for out, g in reversed(list(zip(outs, gs))):
        (out * g).sum().backward()
    kept_grads = [x.grad.clone() for x in xs]
    _step(module, _inputs("contact", torch.float32, 50), gs[0])  # one more replayed call
    reference = module.op.make_reference(module).double()
    for x, out, keep, g, grad_kept in zip(xs, outs, kept, gs, kept_grads):
        assert torch.equal(out.detach(), keep), "an output overwritten by a later call"
        assert torch.equal(x.grad, grad_kept), "a gradient overwritten by a later call"
        x64 = x.detach().double().requires_grad_()
        ref = reference(x64)
        assert compare(out.detach(), ref.detach(), module.op.tolerance["float32"]).ok
        (ref * g.double()).sum().backward()
        error = ((x.grad.double() - x64.grad).norm() / x64.grad.norm()).item()
        assert error <= FP32_BOUND, error


def test_a_forward_without_backward_gives_its_slot_back_and_a_second_backward_is_refused():
    module = _module("contact", torch.float32)
    steps = captured.steps_of(module)
    g = torch.ones(2, 37, 37, device="cuda")
    for seed in (1, 2):
        _step(module, _inputs("contact", torch.float32, seed), g)
    for seed in (3, 4, 5):  # outputs dropped: no backward ever runs
        x = _inputs("contact", torch.float32, seed)[0].requires_grad_()
        module(x)
    gc.collect()
    assert steps.captures == 1 and not any(s.busy for slots in steps.slots.values() for s in slots)
    x = _inputs("contact", torch.float32, 6)[0].requires_grad_()
    out = module(x)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="consumed by an earlier backward"):
        out.sum().backward()


def test_an_optimizer_step_is_seen_by_the_replay():
    module = _module("contact", torch.float32)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    for seed in range(4):
        inputs = _inputs("contact", torch.float32, seed)
        out, _ = _step(module, inputs, torch.randn(2, 37, 37, generator=generator(seed)).cuda())
        result = compare(out, reference64(module, inputs), module.op.tolerance["float32"])
        assert result.ok, f"step {seed}: {result}"
        optimizer.step()
    assert captured.steps_of(module).captures == 1


def test_an_autocast_call_matches_its_uncaptured_twin():
    module = _module("contact", torch.float32)
    twin = copy.deepcopy(module)
    twin.capture_training_steps = False
    for seed in range(3):
        inputs = _inputs("contact", torch.float32, seed)
        g = torch.randn(2, 37, 37, generator=generator(seed)).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, grads = _step(module, inputs, g)
            out_twin, grads_twin = _step(twin, inputs, g)
        assert out.dtype is out_twin.dtype is torch.bfloat16
        assert torch.allclose(out.float(), out_twin.float(), rtol=1e-2, atol=1e-2)
        for mine, theirs in zip(grads, grads_twin):
            assert mine.dtype is theirs.dtype
            assert ((mine.double() - theirs.double()).norm() / theirs.double().norm()).item() <= 1e-2
    assert captured.steps_of(module).captures == 1 and "_captured_steps" not in twin.__dict__


def test_calls_past_the_ops_captured_size_run_uncaptured():
    """Above Routing.captured_training_max_pairs (B*N*N) a step is bound by the GPU, where the
    captured step's copies would cost more than the host's time they save."""
    module = _module("contact", torch.float32)
    module.capture_training_steps = None  # the op's default: on
    largest = module.routing.captured_training_max_pairs
    side = int(largest ** 0.5)
    at = torch.zeros(1, 1, 1, 48, device="cuda").expand(1, side, side, 48)
    past = torch.zeros(1, 1, 1, 48, device="cuda").expand(1, side + 1, side + 1, 48)
    assert side * side <= largest < (side + 1) ** 2
    assert dispatch.captures_training_step(module, (at,)) and not dispatch.captures_training_step(module, (past,))
