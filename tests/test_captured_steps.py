"""CPU: the bookkeeping of captured training steps (pairgen/module/captured.py) with the capture
itself stood in for (CUDA graphs need a GPU; tests/test_captured_steps_gpu.py runs the real ones):
when a signature is captured, how many slots it holds, which signatures a module keeps, a capture
that fails, and which calls may capture at all."""
from __future__ import annotations

import gc

import pytest
import torch

from pairgen import ContactHead, TriangleMultiplication
from pairgen.module import captured, dispatch


class FakeSlot:
    made = 0

    def __init__(self, module, inputs, names, params, frozen):
        FakeSlot.made += 1
        self.busy, self.frozen = False, frozen


@pytest.fixture
def fake_slots(monkeypatch):
    FakeSlot.made = 0
    monkeypatch.setattr(captured, "Slot", FakeSlot)


def _call(steps, module, n: int = 5, input_grad: bool = False):
    x = torch.zeros(1, n, n, 8, requires_grad=input_grad)
    named = list(module.named_parameters())
    return steps.slot_for(module, (x,), tuple(k for k, _ in named), tuple(p for _, p in named))


def test_a_signature_is_captured_at_its_second_call_and_holds_at_most_max_slots(fake_slots):
    module, steps = ContactHead(8, 4), captured.CapturedSteps()
    assert _call(steps, module) is None and FakeSlot.made == 0  # the first call runs uncaptured
    first = _call(steps, module)
    assert isinstance(first, FakeSlot) and FakeSlot.made == 1
    assert _call(steps, module) is first  # free again: replayed, not captured anew
    leases = [captured.Lease(first)]
    second = _call(steps, module)
    assert second is not first and FakeSlot.made == 2  # the first is held by a forward
    leases.append(captured.Lease(second))
    assert _call(steps, module) is None and FakeSlot.made == captured.MAX_SLOTS == 2  # both held: uncaptured
    leases[0].release()
    assert _call(steps, module) is first
    del leases[1]  # a forward's node dropped without a backward
    gc.collect()
    assert not second.busy


def test_the_least_recently_used_signature_is_dropped(fake_slots):
    module, steps = ContactHead(8, 4), captured.CapturedSteps()
    lengths = range(3, 3 + captured.MAX_SIGNATURES + 1)
    for n in lengths:
        _call(steps, module, n)
        _call(steps, module, n)
    assert len(steps.slots) == captured.MAX_SIGNATURES
    kept = {key[0][0][0][1] for key in steps.slots}
    assert kept == set(lengths[1:])


def test_a_module_stops_capturing_after_max_captures(fake_slots):
    module, steps = ContactHead(8, 4), captured.CapturedSteps()
    for n in range(3, 3 + captured.MAX_CAPTURES + 3):
        _call(steps, module, n)
        _call(steps, module, n)
    assert FakeSlot.made == captured.MAX_CAPTURES


def test_frozen_parameters_are_part_of_the_signature(fake_slots):
    module, steps = ContactHead(8, 4), captured.CapturedSteps()
    _call(steps, module), _call(steps, module)
    module.layer_norm.weight.requires_grad_(False)
    assert _call(steps, module) is None  # a new signature: its first call
    slot = _call(steps, module)
    assert slot.frozen == {"input", "layer_norm.weight"} and FakeSlot.made == 2  # x wants no gradient either


def test_an_input_that_wants_no_gradient_is_frozen_for_the_backward(fake_slots):
    """The backward skips the gradients nobody asked for: an input's too (its key, e.g. the
    readout's pair features given as data), decided by its requires_grad, part of the signature."""
    module, steps = ContactHead(8, 4), captured.CapturedSteps()
    _call(steps, module, input_grad=True)
    assert _call(steps, module, input_grad=True).frozen == frozenset()
    _call(steps, module)
    assert _call(steps, module).frozen == {"input"} and FakeSlot.made == 2


def test_a_capture_that_fails_warns_once_and_runs_uncaptured(monkeypatch):
    def failing(*args):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(captured, "Slot", failing)
    module, steps = ContactHead(8, 4), captured.CapturedSteps()
    _call(steps, module)
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        assert _call(steps, module) is None
    assert _call(steps, module) is None and steps.captures == 1  # not tried again


def test_which_calls_may_capture():
    module = ContactHead(8, 4)
    x = torch.zeros(1, 5, 5, 8)
    assert module.routing.captured_training_steps and module.capture_training_steps is None
    assert not dispatch.captures_training_step(module, (x,))  # CPU tensors
    module.capture_training_steps = False
    assert not dispatch.captures_training_step(module, (x,))
    assert not TriangleMultiplication(8, 4).routing.captured_training_steps  # many a model: off by default


def test_release_captured_steps_drops_them(fake_slots):
    module = ContactHead(8, 4)
    steps = captured.steps_of(module)
    _call(steps, module), _call(steps, module)
    assert captured.steps_of(module) is steps and steps.slots
    module.release_captured_steps()
    assert captured.steps_of(module) is not steps and not captured.steps_of(module).slots


def test_the_fused_kernels_setting_is_part_of_the_signature(fake_slots, monkeypatch):
    module, steps = ContactHead(8, 4), captured.CapturedSteps()
    _call(steps, module), _call(steps, module)
    monkeypatch.setenv("PAIRGEN_FUSED_BACKWARD", "0")  # the closed form's PyTorch passes: other graphs
    assert _call(steps, module) is None and FakeSlot.made == 1


def test_the_uncaptured_count_stays_bounded(fake_slots, monkeypatch):
    monkeypatch.setattr(captured, "MAX_SEEN", 4)
    module, steps = ContactHead(8, 4), captured.CapturedSteps()
    for n in range(3, 13):  # ten lengths, each seen once
        _call(steps, module, n)
    assert len(steps.seen) <= 4 and FakeSlot.made == 0
