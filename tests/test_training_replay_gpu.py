"""GPU: 16-bit triangle-update training calls replayed from compiled code (pairgen/replay.py): the
first call of a signature runs the Python path and is recorded, later ones run its traces, whose
output and gradients meet the 16-bit standards against float64 and match the Python path's, on
memory the caching allocator hands out full of NaN (a replay reading a buffer it never wrote
shows)."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_16_bit_gradients_meet_the_standard, generator
from pairgen.ops.trimul import TRIMUL

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("compiled_fast_path")]  # replays need it built

CASES = [({"B": 1, "N": 37, "outgoing": 1}, torch.bfloat16), ({"B": 2, "N": 64, "outgoing": 0}, torch.bfloat16),
         ({"B": 1, "N": 45, "outgoing": 1}, torch.float16)]


def _nan_filled_cache() -> None:
    """The caching allocator's free blocks full of NaN: what a replay's buffers are carved from."""
    blocks = [torch.full((2**22,), float("nan"), device="cuda") for _ in range(16)]
    del blocks


def _step(module, x, mask, g, autocast: bool = False) -> list:
    module.zero_grad(set_to_none=True)
    leaf = x.detach().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = module(leaf, mask)
    out.backward(g)
    return [out.detach(), leaf.grad, *(p.grad for p in module.parameters())]


@pytest.mark.parametrize("case,dtype", CASES, ids=lambda v: str(v))
def test_replayed_training_calls_meet_the_16_bit_standard_and_match_the_python_path(case, dtype):
    widths = {"P": 128, "H": 128, "gate_normalized": 1, "bias": 0, "outgoing": case["outgoing"]}
    gen = generator(11)
    module = TRIMUL.make_module(widths, gen).cuda().to(dtype)
    x, mask = TRIMUL.make_inputs({"B": case["B"], "N": case["N"], **widths}, gen, "cauchy")
    mask[0, 5] = False  # a row with no pair
    x, mask = x.cuda().to(dtype), mask.cuda()
    g = torch.randn(x.shape, generator=gen).cuda().to(dtype)
    python = _step(module, x, mask, g)
    assert len(module._training_replays) == 1, "the first training call was not recorded"
    forwards = []
    module.saving_forward = lambda *a: forwards.append(1) or type(module).saving_forward(*a)
    _nan_filled_cache()
    replayed = _step(module, x, mask, g)
    assert forwards == [], "the second call ran the Python path"
    assert all(torch.isfinite(t).all() for t in replayed)
    for mine, theirs in zip(replayed, python):
        assert ((mine.double() - theirs.double()).norm() / theirs.double().norm()).item() <= 1e-3
    assert_16_bit_gradients_meet_the_standard(module, (x, mask), g, replayed[1:])


def test_replayed_training_calls_under_autocast_match_the_python_path():
    """An fp32 module trained under a bf16 autocast (as the models train): recorded with the
    autocast's dtype and replayed under it."""
    widths = {"P": 128, "H": 128, "gate_normalized": 1, "bias": 0, "outgoing": 1}
    gen = generator(12)
    module = TRIMUL.make_module(widths, gen).cuda()
    x, mask = TRIMUL.make_inputs({"B": 1, "N": 41, **widths}, gen, "cauchy")
    x, mask = x.cuda(), mask.cuda()
    g = torch.randn(x.shape, generator=gen).cuda().bfloat16()
    python = _step(module, x, mask, g, autocast=True)
    assert len(module._training_replays) == 1, "the first autocast training call was not recorded"
    forwards = []
    module.saving_forward = lambda *a: forwards.append(1) or type(module).saving_forward(*a)
    _nan_filled_cache()
    replayed = _step(module, x, mask, g, autocast=True)
    assert forwards == [], "the second call ran the Python path"
    for mine, theirs in zip(replayed, python):
        assert mine.dtype is theirs.dtype
        assert ((mine.double() - theirs.double()).norm() / theirs.double().norm()).item() <= 1e-3


def test_pairgens_function_trains_replayed_on_the_callers_weights():
    """pairgen.triangle_multiplicative_update as Boltz, OpenFold 3 and Protenix call it in training
    (bf16, their weights wanting gradients, fused 2H-row input weights): the third call replayed
    (the second recorded), its output and gradients those of the first, on memory full of NaN."""
    import pairgen
    from pairgen import functional

    gen = generator(13)
    P = H = 128
    w = {"norm_in_weight": 1 + 0.1 * torch.randn(P, generator=gen), "norm_in_bias": 0.1 * torch.randn(P, generator=gen),
         "p_in_weight": torch.randn(2 * H, P, generator=gen) / P ** 0.5,
         "g_in_weight": torch.randn(2 * H, P, generator=gen) / P ** 0.5,
         "norm_out_weight": 1 + 0.1 * torch.randn(H, generator=gen), "norm_out_bias": 0.1 * torch.randn(H, generator=gen),
         "p_out_weight": torch.randn(P, H, generator=gen) / H ** 0.5, "g_out_weight": torch.randn(P, P, generator=gen) / P ** 0.5}
    w = {k: v.cuda().bfloat16().requires_grad_() for k, v in w.items()}
    x = torch.randn(1, 77, 77, P, generator=gen).cuda().bfloat16()
    mask = (torch.rand(1, 77, 77, generator=gen) > 0.2).cuda()
    g = torch.randn(x.shape, generator=gen).cuda().bfloat16()

    def step() -> list:
        leaf = x.detach().requires_grad_()
        for t in w.values():
            t.grad = None
        out = pairgen.triangle_multiplicative_update(leaf, "outgoing", mask, **w)
        out.backward(g)
        return [out.detach(), leaf.grad, *(t.grad for t in w.values())]

    python = step()
    module = list(functional._modules.values())[-1]
    assert module._training_replays == ()  # recorded at the module's second call
    step()
    assert len(module._training_replays) == 1, module.__dict__.get("_training_replay_refused")
    forwards = []
    module.saving_forward = lambda *a: forwards.append(1) or type(module).saving_forward(*a)
    _nan_filled_cache()
    replayed = step()
    assert forwards == [], "the second call ran the Python path"
    for mine, theirs in zip(replayed, python):
        assert torch.isfinite(mine).all()
        assert ((mine.double() - theirs.double()).norm() / theirs.double().norm()).item() <= 1e-3
