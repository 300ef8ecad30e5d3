"""GPU: pairgen's operators under torch.compile run pairgen's kernels: opcheck on CUDA, a compiled
model (fullgraph, dynamic lengths, and mode="reduce-overhead") against the float64 reference, a
bf16 module compiled."""
from __future__ import annotations

import pytest
import torch

from pairgen import library
from pairgen.ops import get_op
from pairgen.tuning.check import compare, reference64
from helpers import gradient_errors64

pytestmark = pytest.mark.gpu
WIDTHS = {"trimul": {"P": 64, "H": 32, "outgoing": 0, "gate_normalized": 0, "bias": 1},
          "contact": {"P": 64, "H": 32}, "readout": {"D": 96, "P": 16, "H": 192}}


def _case(op: str, n: int, seed: int = 0, dtype=torch.float32):
    spec = get_op(op)
    gen = torch.Generator().manual_seed(seed)
    module = spec.make_module(WIDTHS[op], gen).cuda().to(dtype)
    inputs = tuple(t.cuda().to(dtype) if t.is_floating_point() else t.cuda()
                   for t in spec.make_inputs({"B": 2, "N": n, **WIDTHS[op]}, gen))
    return spec, module, inputs


class _Launches:
    """Counts a module's kernel runs (its runner calls)."""

    def __init__(self, module):
        self.count, original = 0, module._run

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        module._run = counted


@pytest.mark.parametrize("op", sorted(WIDTHS))
def test_opcheck_on_cuda(op):
    _, module, inputs = _case(op, 9)
    torch.library.opcheck(getattr(torch.ops.pairgen, op).default,
                          (list(inputs), list(module.parameters()), library.register(module)))


@pytest.mark.parametrize("op", sorted(WIDTHS))
def test_compiled_module_runs_the_kernels_for_every_length(op):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    spec, module, _ = _case(op, 5)
    launches = _Launches(module)
    compiled = torch.compile(module, fullgraph=True, dynamic=True)
    for n in (17, 23, 37):
        _, _, inputs = _case(op, n, seed=n)
        with torch.no_grad():
            out = compiled(*inputs)
        assert compare(out, reference64(module, inputs), spec.tolerance["float32"]).ok
    assert launches.count == 3, "each call ran pairgen's kernels"
    assert counters["stats"]["unique_graphs"] == 1


def test_reduce_overhead_mode_and_a_bf16_module():
    spec, module, inputs = _case("trimul", 33, dtype=torch.bfloat16)
    compiled = torch.compile(module, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(3):  # warm-up, record, replay
            out = compiled(*inputs)
    assert out.dtype == torch.bfloat16
    assert compare(out.clone(), reference64(module, inputs), spec.tolerance["bfloat16"]).ok


def test_compiled_training_step_gradients_meet_the_standard():
    """A training step through torch.compile: every gradient (input and parameters) within the fp32
    gradient standard (relative L2 2e-5 against float64 autograd), as the eager module's are."""
    spec, module, (x, mask) = _case("trimul", 21)
    compiled = torch.compile(module, fullgraph=True)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).cuda()
    for call in (compiled, module):
        errors = gradient_errors64(call, module, (x, mask), g)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 2e-5, f"{'compiled' if call is compiled else 'eager'}: gradient of {worst}: {errors}"