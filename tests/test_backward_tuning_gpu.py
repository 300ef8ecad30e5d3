"""GPU: the training path's launch shapes. Every kernel shape of the triangle update's fused passes
(items x ln_tile) and blocks per SM of the contact head's keeps every gradient within 2e-5 of
float64 autograd; a sweep writes an entry that a training call then runs, and explain() names."""
from __future__ import annotations

import pytest
import torch

from helpers import generator, gradient_errors64
from pairgen.ops import backward_tuning
from pairgen.ops.contact import CONTACT
from pairgen.ops.trimul import TRIMUL
from pairgen.ops.trimul import fused_backward as trimul_fused

pytestmark = pytest.mark.gpu


def _kernel_shapes(op: str) -> list[dict]:
    if op == "contact":
        return backward_tuning.points("contact")
    default = trimul_fused.TUNING_DEFAULT
    return [{**default, "items": i, "ln_tile": t, "out_gate_blocks": 16, "row_blocks": 2}
            for i in trimul_fused.TUNING_SPACE["items"] for t in trimul_fused.TUNING_SPACE["ln_tile"]]


@pytest.mark.parametrize("op", ["trimul", "contact"])
def test_every_launch_shape_meets_the_gradient_standard(op):
    spec = {"trimul": TRIMUL, "contact": CONTACT}[op]
    widths = {"trimul": {"P": 64, "H": 32, "outgoing": 1, "gate_normalized": 1, "bias": 1},
              "contact": {"P": 64, "H": 32}}[op]
    gen = generator(50)
    module = spec.make_module(widths, gen).cuda()
    inputs = tuple(t.cuda() for t in spec.make_inputs({"B": 2, "N": 37, **widths}, gen, "cauchy"))
    with torch.no_grad():
        g = torch.randn(module(*inputs).shape, generator=gen).cuda()
    for tuning in _kernel_shapes(op):
        module._backward_tuning = tuning
        errors = gradient_errors64(module, module, inputs, g)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 2e-5, f"{tuning}: gradient of {worst}: {errors}"


def test_a_swept_entry_is_what_a_training_call_runs(tmp_path, monkeypatch):
    from pairgen import runtime
    from pairgen.tuning import backward_tune

    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(tmp_path))
    runtime.clear_caches()
    monkeypatch.setattr(backward_tuning.declared("contact"), "TUNING_SPACE", {"row_blocks": (4, 8)})
    shape = {"B": 1, "N": 96, "P": 64, "H": 32}
    assert backward_tune.main([(CONTACT, shape)], reps=5) == 0
    params, entry, source = backward_tuning.lookup("contact", "float32", {"P": 64, "H": 32}, 96,
                                                   runtime.device_info())
    assert source == "tuned" and entry["params"] == params and params["row_blocks"] in (4, 8)
    module = CONTACT.make_module({"P": 64, "H": 32}, generator(51)).cuda()
    x = torch.randn(1, 96, 96, 64, device="cuda")
    assert backward_tuning.for_call(module, x) == params
    training = dict(module.explain(96).routes)
    route = next(str(r) for label, r in training.items() if label.startswith("training"))
    assert f"row_blocks={params['row_blocks']}; tuned" in route and "pairgen_contact_symmetric_ln_grad" in route, route
    runtime.clear_caches()
