"""dispatch.route on the CPU: every path a call can take, decided from stand-ins of CUDA inputs
(what the route reads of a tensor: shape, dtype, device, requires_grad) and the module's variant
cache given by hand; the precision table's spellings; explain() printing the routes."""
from __future__ import annotations

import types
from dataclasses import replace

import pytest
import torch

from helpers import generator
from pairgen import first_use, precision, runtime
from pairgen.module import dispatch, training_replay
from pairgen.module.dispatch import (CLOSED_FORM, FIRST_USE, FP32_KERNEL, KERNEL, KERNEL_TRAINING, REFERENCE,
                                     SAVED_CLOSED_FORM, route)
from pairgen.ops import get_op


@pytest.fixture(autouse=True)
def no_training_replays(monkeypatch):
    """The routes as where no training call is replayed (the compiled module may or may not have
    finished building in a test process); tests that want replays say so."""
    monkeypatch.setattr(training_replay, "replays", lambda module, first: False)


class CudaStandIn:
    """What the route reads of a CUDA tensor."""
    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, shape, dtype, requires_grad=False):
        self.shape, self.dtype, self.requires_grad = torch.Size(shape), dtype, requires_grad

    def get_device(self) -> int:
        return 0

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def to(self, dtype):
        return CudaStandIn(self.shape, dtype, self.requires_grad)


def variant(strategy: str = "s", precision_name: str = "bfloat16"):
    return types.SimpleNamespace(plan=types.SimpleNamespace(strategy=strategy, precision=precision_name,
                                                            label=f"{strategy}()"))


def module_and_inputs(op: str, B: int, N: int, dtype, variants: dict, training: bool = False):
    """A module of the op's seed widths in `dtype` whose variant per precision is `variants`
    (missing: None), and stand-ins of a call at (B, N)."""
    spec = get_op(op)
    module = spec.make_module(spec.widths_of(spec.presets["seed"][0]), generator(0)).to(dtype)
    module._choice_for = lambda n, device, p: variants.get(p)
    inputs = dispatch.stand_in_inputs(module, B, N, dtype, "cpu", training)
    return module, tuple(CudaStandIn(t.shape, t.dtype, t.requires_grad) for t in inputs)


@pytest.mark.parametrize("op", ["trimul", "contact", "readout"])
def test_kernel_calls_route_to_the_kernel_and_repeat_their_route(op):
    v = variant()
    module, inputs = module_and_inputs(op, 1, 32, torch.bfloat16, {"bfloat16": v})
    with torch.no_grad():
        first = route(module, inputs)
        assert first.path == KERNEL and first.variant is v and first.precision == "bfloat16"
        assert route(module, inputs) is first, "a repeated call's route is kept, not rebuilt"
        module.force_variant(None)
        w = variant("t")
        module._choice_for = lambda n, device, p: w
        assert route(module, inputs).variant is w


def test_training_routes_follow_the_backward_mode_and_the_routing_thresholds(monkeypatch):
    monkeypatch.delenv("PAIRGEN_FUSED_BACKWARD", raising=False)
    v = variant()
    small, inputs = module_and_inputs("trimul", 1, 64, torch.bfloat16, {"bfloat16": v}, training=True)
    r = route(small, inputs)
    assert r.path == REFERENCE and "16-bit" in r.reason, "auto: a small 16-bit call trains in PyTorch"
    small.routing = replace(small.routing, closed_form_16_bit_training_min_pairs=0)
    assert route(small, inputs).path == SAVED_CLOSED_FORM
    small.recompute_for_backward = True
    assert route(small, inputs).path == KERNEL_TRAINING
    monkeypatch.setenv("PAIRGEN_FUSED_BACKWARD", "0")
    assert route(small, inputs).path == REFERENCE, "the 16-bit closed form needs the fused kernels"
    small.backward_mode = "closed_form"
    assert route(small, inputs).path == KERNEL_TRAINING
    small.backward_mode = "reference"
    assert route(small, inputs) == dispatch._MODE_REFERENCE


def test_a_pending_default_is_reported_or_settled():
    pending = first_use.Pending(variant(), "trimul", "gpu", "bfloat16", {}, 32, "sha")
    module, inputs = module_and_inputs("trimul", 1, 32, torch.bfloat16, {"bfloat16": pending})
    settled = []
    module._first_use = lambda p, call, prec: settled.append(p) or None
    with torch.no_grad():
        assert route(module, inputs, settle=False).path == FIRST_USE and not settled
        r = route(module, inputs)  # settled: the reference won, and no 16-bit kernel: without a kernel
    assert settled == [pending] and r.path == REFERENCE


def test_a_16_bit_triangle_update_no_kernel_runs_takes_the_closed_form_from_its_size():
    """The widths fit no 16-bit kernel, or the default kernel of an untuned shape lost its first-use
    check, which times it against the closed form where that is what would run instead."""
    pending = first_use.Pending(variant(), "trimul", "gpu", "bfloat16", {}, 512, "sha")
    module, small = module_and_inputs("trimul", 1, 362, torch.bfloat16, {"bfloat16": pending})
    _, large = module_and_inputs("trimul", 1, 363, torch.bfloat16, {})  # 363^2 >= 2^17 pairs
    rivals = []

    def loses(p, call, prec, reference=None, rival="the PyTorch reference"):
        rivals.append(rival)
        return None

    module._first_use = loses
    with torch.no_grad():
        assert route(module, large).path == CLOSED_FORM and rivals == ["the closed form"]
        assert route(module, small).path == REFERENCE and rivals[-1] == "the PyTorch reference"
        module._choice_for = lambda n, device, p: None  # no kernel fits these widths
        assert route(module, large) == dispatch._CLOSED_FORM
        module.backward_mode = "reference"
        assert route(module, large).path == REFERENCE
    assert module.routing.closed_form_min_pairs == 2**17


def test_calls_without_a_kernel_take_the_fp32_kernel_the_closed_form_or_the_reference():
    v32 = variant("fp32", "float32")
    module, _ = module_and_inputs("contact", 1, 8, torch.bfloat16, {"float32": v32})
    module.kernel_precision = lambda *call: None  # as a call no kernel serves
    below = (CudaStandIn((1, 256, 256, module.widths["P"]), torch.bfloat16),)
    at = (CudaStandIn((1, 363, 363, module.widths["P"]), torch.bfloat16),)
    with torch.no_grad():
        r = route(module, below)
        assert r.path == FP32_KERNEL and r.variant is v32 and r.inputs[0].dtype is torch.float32
        assert route(module, at).path == CLOSED_FORM
        module.backward_mode = "reference"
        assert route(module, below).path == REFERENCE and route(module, at).path == REFERENCE
    readout, inputs = module_and_inputs("readout", 16, 128, torch.bfloat16, {"float32": v32})
    readout.kernel_precision = lambda *call: None
    with torch.no_grad():
        assert route(readout, inputs).path == REFERENCE, "past 2^15 pairs, and the closed form never runs"


def test_cpu_inputs_and_pairgen_disable_run_the_reference(monkeypatch):
    spec = get_op("trimul")
    module = spec.make_module(spec.widths_of(spec.presets["seed"][0]), generator(0))
    cpu = dispatch.stand_in_inputs(module, 1, 16, torch.float32, "cpu", False)
    with torch.no_grad():
        assert route(module, cpu) == dispatch._NOT_SERVED
    module, inputs = module_and_inputs("contact", 1, 8, torch.bfloat16, {})
    module.kernel_precision = lambda *call: None
    monkeypatch.setenv("PAIRGEN_DISABLE", "1")
    with torch.no_grad():
        assert route(module, inputs) == dispatch._DISABLED


def test_explain_prints_the_routes(monkeypatch):
    v = variant("wgmma")
    module, _ = module_and_inputs("trimul", 1, 128, torch.bfloat16, {"bfloat16": v})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime, "explain", lambda spec, p, widths, n, index: runtime.explain_on_cpu(spec, n, "tuned"))
    monkeypatch.setattr(dispatch, "stand_in", lambda shape, dtype, device, grad=False: CudaStandIn(shape, dtype, grad))
    text = str(module.explain(128))
    print(text)
    assert "inference call B=1 N=128 bfloat16: kernel forward [bfloat16, wgmma()]" in text and "fast replay" in text
    assert "training call B=1 N=128 bfloat16: reference" in text
    # Where training calls are replayed, the closed form at this size too, and the explanation says so.
    monkeypatch.setattr(training_replay, "replays", lambda module, first: True)
    monkeypatch.setattr(dispatch, "_backward_kernels", lambda module, inputs, n: None)
    text = str(module.explain(128))
    assert f"training call B=1 N=128 bfloat16: {dispatch.SAVED_CLOSED_FORM}" in text and dispatch.TRAINING_REPLAY in text


def test_explain_on_the_cpu_says_the_route_is_the_reference(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = get_op("readout")
    module = spec.make_module(spec.widths_of(spec.presets["seed"][0]), generator(0))
    explained = module.explain(32)
    assert [r.path for _, r in explained.routes] == [REFERENCE, REFERENCE]
    assert "inference call B=1 N=32 float32: reference: CPU tensors" in str(explained)


def test_one_precision_table_knows_every_spelling():
    assert precision.lookup("ieee") is precision.lookup("float32") is precision.FLOAT32
    assert precision.lookup("bf16") is precision.BFLOAT16 and precision.lookup("fp16") is precision.FLOAT16
    assert precision.of_dtype(torch.bfloat16) is precision.BFLOAT16 and precision.of_dtype(torch.float32) is None
    with pytest.raises(ValueError, match="unknown precision"):
        precision.lookup("fp8")
    assert precision.MMA_KINDS == {"bfloat16": 0, "float16": 1, "tf32": 2, "tf32x3": 3}
    assert precision.COMPUTE_DTYPES == {"ieee": torch.float32, "tf32": torch.float32, "bfloat16": torch.bfloat16,
                                        "float16": torch.float16}
    module = get_op("contact").make_module({"P": 16, "H": 16}, generator(0))
    module.precision = "float32"  # an alias of exact fp32: kept as the module's own spelling
    assert module.precision == "ieee"
