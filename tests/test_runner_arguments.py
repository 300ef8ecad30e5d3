"""Every strategy's runner binds its kernels' arguments by the names the plan declares (checked
against the template's signature when the plan renders): run on the CPU with stand-in launches
that record what each kernel would be given, nothing launched. The inputs, the output and the
shape tail must land where the declaration names them."""
from __future__ import annotations

import random

import pytest
import torch

from helpers import generator
from pairgen import launch
from pairgen.ops import get_op, op_names
from pairgen.precision import HALF_DTYPES
from pairgen.spec import DeviceLimits

SHAPES = {"contact": {"B": 2, "N": 8, "P": 64, "H": 32},
          "trimul": {"B": 2, "N": 8, "P": 64, "H": 32, "outgoing": 0, "gate_normalized": 0, "bias": 1},
          "readout": {"B": 2, "N": 8, "D": 96, "P": 16, "H": 192}}
#: The pointer each input is passed as, per op (the templates' names).
INPUT_NAMES = {"contact": ("x",), "trimul": ("x", "mask"), "readout": ("nodes", "pair", "mask")}


class _RecordedLaunch(launch.BoundLaunch):
    """A launch.BoundLaunch of one declared kernel that records the positional arguments a call
    would write instead of launching (its named() is the real one)."""

    def __init__(self, declaration, tail: tuple):  # no loaded kernel: nothing is launched
        self.names, self.tail, self.mode, self._orders = declaration.names, tuple(tail), "plain", {}
        self.kernel = type("Kernel", (), {"name": declaration.name, "device_index": -1})()
        self.calls: list[tuple] = []

    def __call__(self, *args) -> None:
        self.calls.append(args)


class _RecordingVariant:
    def __init__(self, plan, shape: dict):
        self.plan = plan
        self.launched = [_RecordedLaunch(k, k.grid(shape["B"], shape["N"], 132, 1)[1]) for k in plan.kernels]

    def launches(self, device, batch, n, programmatic: bool = True) -> tuple:
        return tuple(self.launched)


@pytest.fixture(autouse=True)
def wgmma_fold_stand_in(monkeypatch):
    """The wgmma fold kernel (ops/trimul/packs.py) needs a GPU: a zeroed buffer of its size stands
    in (only where pointers land is checked here)."""
    from pairgen.ops.trimul.strategies import wgmma as packs

    def zeros(tensors, sources, P, H, gate_normalized, gate_hidden, operand, out=None):
        size = packs.fold_context(P, H, gate_normalized, gate_hidden, operand, sources)["off_total"]
        assert size == packs.fold_bytes(P, H, gate_hidden)
        return torch.zeros(size, dtype=torch.uint8) if out is None else out

    monkeypatch.setattr(packs, "pack_wgmma", zeros)


def _cases():
    for op in op_names():
        spec = get_op(op)
        for precision in spec.precisions:
            view = spec.at(precision)
            for strategy in view.strategies:
                yield pytest.param(op, precision, strategy, id=f"{op}-{strategy}-{precision}")


@pytest.mark.parametrize("op, precision, strategy", list(_cases()))
def test_each_runner_passes_the_inputs_and_output_by_their_declared_names(op, precision, strategy):
    spec = get_op(op)
    shape = SHAPES[op]
    widths = spec.widths_of(shape)
    plans = spec.at(precision).sample_plans(strategy, widths, 3, random.Random(f"{op}{strategy}"),
                                            DeviceLimits(arch="sm_90"))
    assert plans, f"no feasible {strategy} point at {widths}"
    gen = generator(0)
    module = spec.make_module(widths, gen)
    dtype = HALF_DTYPES.get(precision, torch.float32)
    module = module.to(dtype)
    if dtype is torch.float32 and precision != "float32":
        module.precision = precision
    inputs = tuple(t.to(dtype) if t.dtype.is_floating_point and t.dtype is not torch.bool else t
                   for t in spec.make_inputs(shape, gen, "normal"))
    with torch.no_grad():
        for plan in plans:
            out = torch.empty_like(module.reference_forward(*inputs))
            variant = _RecordingVariant(plan, shape)
            module._launch(*inputs, out=out, variant=variant)
            for recorded in variant.launched:
                assert recorded.calls, f"{recorded.kernel.name} was not launched"
                assert recorded._orders, f"{recorded.kernel.name} was called positionally: runners bind by name"
                for args in recorded.calls:
                    bound = dict(zip(recorded.names, args))
                    for name, tensor in zip(INPUT_NAMES[op], inputs):
                        if name in bound:
                            assert bound[name] == tensor.data_ptr(), f"{recorded.kernel.name}: {name}"
                    if "out" in bound:
                        assert bound["out"] == out.data_ptr(), f"{recorded.kernel.name}: out"
                    for batch, length in (("B", "N"), ("B64", "N64"), ("batches", "length")):
                        if batch in bound:
                            assert (bound[batch], bound[length]) == (shape["B"], shape["N"]), recorded.kernel.name


def test_arrange_refuses_unknown_names_missing_values_and_a_tail_left_over():
    names = ("x", "out", "B", "N")
    assert launch.arrange(names, (2, 8), {"out": 20, "x": 10}, "k") == [10, 20, 2, 8]
    with pytest.raises(TypeError, match="k: no argument named y"):
        launch.arrange(names, (2, 8), {"x": 10, "out": 20, "y": 1}, "k")
    with pytest.raises(TypeError, match="no value for its argument 'N'"):
        launch.arrange(names, (2,), {"x": 10, "out": 20}, "k")
    with pytest.raises(TypeError, match="longer than its arguments"):
        launch.arrange(names, (2, 8, 5), {"x": 10, "out": 20}, "k")


def test_named_gives_what_a_positional_call_gives_whatever_the_order_of_the_names():
    declaration = type("Declared", (), {"name": "k", "names": ("x", "mask", "out", "B", "N", "flag")})()
    bound = _RecordedLaunch(declaration, (2, 8))
    bound.named(x=10, mask=11, out=12, flag=1)
    bound.named(out=22, flag=0, x=20, mask=21)   # another call site's order
    bound.named(x=30, mask=31, out=32, flag=1)   # the first site's arrangement, kept
    assert bound.calls == [(10, 11, 12, 2, 8, 1), (20, 21, 22, 2, 8, 0), (30, 31, 32, 2, 8, 1)]
    assert len(bound._orders) == 2
    with pytest.raises(TypeError, match="k: no argument named outt"):
        bound.named(x=1, mask=2, outt=3, flag=0)


def test_a_sliced_wgmma_runner_hands_one_statistics_buffer_to_both_kernels():
    """With column slices the wgmma variant has a third kernel, run first: the rows' statistics of x,
    into a per-call buffer that the projection and the output kernel then read (`stats`)."""
    spec = get_op("trimul")
    shape = SHAPES["trimul"]
    params = {"p_groups": 2, "p_stages": 1, "p_wn": 32, "p_slices": 4, "o_groups": 2, "o_wn": 16, "o_stages": 1,
              "o_slices": 4, "swizzle": False, "consts_smem": True, "paired_columns": True}
    plan = spec.at("bfloat16").plan("wgmma", params, spec.widths_of(shape))
    assert not spec.infeasible(plan, DeviceLimits(arch="sm_90"))
    gen = generator(0)
    module = spec.make_module(spec.widths_of(shape), gen).to(torch.bfloat16)
    x, mask = (t.to(torch.bfloat16) if t.dtype.is_floating_point else t for t in spec.make_inputs(shape, gen, "normal"))
    variant = _RecordingVariant(plan, shape)
    with torch.no_grad():
        module._launch(x, mask, out=torch.empty_like(module.reference_forward(x, mask)), variant=variant)
    stats, project, output = (dict(zip(k.names, k.calls[0])) for k in variant.launched)
    assert [k.kernel.name.rsplit("_", 1)[-1] for k in variant.launched][0] == "stats"
    assert stats["x"] == project["x"] == output["x"] == x.data_ptr()
    assert stats["stats"] == project["stats"] == output["stats"] not in (0, x.data_ptr())
