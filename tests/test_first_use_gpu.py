"""GPU: the first call of a module at widths nobody tuned times the default kernel against the
reference, runs the faster, and records the verdict, which a later process reads instead of
timing again; where the reference is faster, the module runs the reference."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import generator
from pairgen import first_use, runtime
from pairgen.ops.contact import CONTACT
from pairgen.tuning.check import compare, reference64

pytestmark = pytest.mark.gpu
WIDTHS = {"P": 48, "H": 16}  # nobody tuned these


@pytest.fixture
def checked(first_use_folder):
    """The verdict file the checks write."""
    return first_use_folder / runtime.device_info(0).slug / "first-use" / "contact.json"


def _case(seed: int):
    gen = generator(seed)
    module = CONTACT.make_module(WIDTHS, gen).cuda()
    (x,) = (t.cuda() for t in CONTACT.make_inputs({"B": 2, "N": 45, **WIDTHS}, gen))
    return module, x


def _count_launches(module) -> list:
    launches, run = [], module._run
    module._run = lambda *args: launches.append(1) or run(*args)
    return launches


def test_the_first_call_times_the_default_and_a_later_process_reads_the_verdict(checked, monkeypatch):
    module, x = _case(3)
    with torch.no_grad():
        out = module(x)
    assert compare(out, reference64(module, (x,)), CONTACT.tolerance["float32"]).ok
    (verdict,) = json.loads(checked.read_text())["verdicts"]
    assert verdict["kernel_us"] > 0 and verdict["reference_us"] > 0
    assert verdict["winner"] == ("kernel" if verdict["kernel_us"] <= verdict["reference_us"] else "reference")
    runtime.clear_caches()  # as a new process would start
    monkeypatch.setattr(first_use, "measure", lambda *a: pytest.fail("timed again despite the verdict"))
    other, _ = _case(4)
    launches = _count_launches(other)
    with torch.no_grad():
        out = other(x)
    assert (len(launches) == 1) == (verdict["winner"] == "kernel")
    assert compare(out, reference64(other, (x,)), CONTACT.tolerance["float32"]).ok


def test_a_default_slower_than_the_reference_gives_way_to_it(checked, monkeypatch):
    monkeypatch.setattr(first_use, "measure", lambda kernel, reference, device: (100.0, 1.0))
    module, x = _case(5)
    launches = _count_launches(module)
    with torch.no_grad(), pytest.warns(UserWarning, match="slower than the PyTorch reference"):
        module(x)
    launches.clear()
    with torch.no_grad():
        out = module(x)
    assert launches == [], "the kernel ran after losing its check"
    assert torch.equal(out, module.reference_forward(x))


def test_the_tuner_times_the_closed_form_a_16_bit_module_runs_without_a_kernel():
    """A 16-bit forward from the closed form's size runs the closed form where no kernel serves it:
    the tuner's baselines time it beside the reference (a tuned kernel must beat it), and not where
    the module would run the reference (fp32)."""
    from pairgen.ops.trimul import TRIMUL
    from pairgen.tuning.evaluate import GpuEvaluator

    shape = {"B": 1, "N": 384, "P": 64, "H": 32, "outgoing": 1, "gate_normalized": 1, "bias": 0}  # 2^17 pairs and more
    baselines = GpuEvaluator(TRIMUL.at("bfloat16"), shape, peers=("eager",)).baselines()
    assert set(baselines) == {"eager", "closed_form"} and all(v > 0 for v in baselines.values())
    assert set(GpuEvaluator(TRIMUL.at("float32"), shape, peers=("eager",)).baselines()) == {"eager"}
