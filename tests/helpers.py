"""Shared test data: sampled search-space points, shapes, inputs (OPS.md's standard)."""
from __future__ import annotations

import random

import torch

from pairgen.ops.base import DeviceLimits

SEED_WIDTHS = {"P": 64, "H": 32}
REAL_WIDTHS = ({"P": 128, "H": 128}, {"P": 128, "H": 64})
ODD_SHAPES = [(b, n) for n in (1, 7, 37, 64, 123) for b in (1, 3)]


def sampled_plans(spec, strategy: str, widths: dict, k: int, seed: int = 0, limits=DeviceLimits()):
    """k feasible points of a strategy (a fixed random sample, defaults first)."""
    return spec.sample_plans(strategy, widths, k, random.Random(f"{seed}-{strategy}-{sorted(widths.items())}"), limits)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_gradients_match_the_reference(module, inputs: tuple) -> None:
    """The backward recomputes the reference (ReferenceBackward), so for the same upstream
    gradient the module's gradients must be the fp32 reference's own. The loss is linear in the
    output, (out * g).sum() with a fixed random g: the upstream gradient is then g for both, and
    the comparison checks the backward's wiring (which inputs and parameters get which gradient)
    without the forward's rounding differences, which the forward tests cover against float64."""
    out = module(*inputs)
    g = torch.randn(out.shape, generator=generator(99)).to(out.device)
    leaves = [t.clone().requires_grad_() if t.dtype.is_floating_point else t for t in inputs]
    (module(*leaves) * g).sum().backward()
    reference = module.op.make_reference(module)
    ref_leaves = [t.clone().requires_grad_() if t.dtype.is_floating_point else t for t in inputs]
    (reference(*ref_leaves) * g).sum().backward()
    named = [(f"input {k}", a.grad, b.grad) for k, (a, b) in enumerate(zip(leaves, ref_leaves)) if a.dtype.is_floating_point]
    named += [(name, p.grad, q.grad) for (name, p), q in zip(module.named_parameters(), reference.parameters())]
    for name, grad, ref_grad in named:
        assert grad is not None, f"no gradient for {name}"
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6, msg=f"gradient of {name}")
