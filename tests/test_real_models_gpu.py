"""pairgen.patch on the real models' own pairformer blocks (tests/real_models.py) on the GPU, at
the models' width (P = H = 128) and odd N: forward and backward in fp32, bf16 and fp32 under
autocast to bf16, every triangle update counted on pairgen. fp32: output within relative L2 1e-5
and every gradient within 2e-5 of the block in float64. 16 bits: within max(2e-2, 1.5 x the
unpatched block's own error in the same dtype) of float64, for the block's output and the
gradients of its input and of the triangle updates' parameters (the gradient standard's form: the
block's other layers compute in 16 bits too; their parameters' gradients follow the triangle
updates' 16-bit outputs and are not pairgen's to meet)."""
from __future__ import annotations

import copy
import contextlib

import pytest
import torch

import pairgen
from real_models import BLOCKS, inputs, randomize, stand_ins

pytestmark = pytest.mark.gpu
C_Z = 128


def relative(ours, exact) -> float:
    return ((ours.double() - exact.double()).norm() / exact.double().norm()).item()


def run(block, module, z, tokens, pair, grad, autocast: bool):
    z = z.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        out = block.call(module, z, tokens, pair)
    params = [p for p in module.parameters() if p.requires_grad]
    grads = torch.autograd.grad((out.float() * grad.float()).sum(), [z, *params], allow_unused=True)
    return [out.detach(), *grads]


@pytest.mark.parametrize("mode", ["fp32", "bf16", "autocast"])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_patched_block_on_the_gpu(name, mode):
    block = BLOCKS[name](c_z=C_Z)
    if mode == "bf16" and not block.runs_in_every_dtype:
        pytest.skip(f"{name}'s own triangle update casts to fp32: it runs in fp32 and under autocast, not in bf16")
    randomize(block.module, 11).train()
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    module = block.in_dtype(block.module.cuda(), dtype)
    z, tokens, pair, grad = inputs(1, 37, 12, device="cuda", dtype=dtype, c_z=C_Z)
    exact_module = block.in_float64(copy.deepcopy(module))
    if not block.runs_in_every_dtype:
        pairgen.patch(exact_module)
    exact = run(block, exact_module, z.double(), tokens, pair, grad.double(), autocast=False)
    theirs = run(block, copy.deepcopy(module), z, tokens, pair, grad, autocast=mode == "autocast") \
        if mode != "fp32" else None
    patched = copy.deepcopy(module)
    assert sum("swapped for pairgen" in line for line in pairgen.patch(patched)) == block.swapped
    ours = run(block, patched, z, tokens, pair, grad, autocast=mode == "autocast")
    assert [(m.pairgen_calls, m.source_calls) for m in stand_ins(patched)] == [(1, 0)] * block.swapped
    updates = {id(p) for m in stand_ins(patched) for p in m.parameters()}
    checked = [True, True] + [mode == "fp32" or id(p) in updates for p in patched.parameters() if p.requires_grad]
    for i, (o, e) in enumerate(zip(ours, exact)):
        assert (o is None) == (e is None), i
        if e is None or not checked[i]:
            continue
        error = relative(o, e)
        if mode == "fp32":
            bound = 1e-5 if i == 0 else 2e-5
        else:
            bound = max(2e-2, 1.5 * relative(theirs[i], e))
        assert error <= bound, f"{name} {mode}: {'output' if i == 0 else f'gradient {i}'} {error:.3g} > {bound:.3g}"
