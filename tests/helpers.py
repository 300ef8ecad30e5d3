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


def assert_gradients_match_float64(module, inputs: tuple) -> None:
    """Gradients of sum(out²) through the module (kernel forward, reference recompute backward)
    against the same gradients of the reference evaluated in float64, to the op's fp32
    standard (OPS.md). The loss reads the forward's output, so this covers both passes."""
    from pairgen.check import compare

    tol = module.op.tolerance["float32"]
    leaves = [t.clone().requires_grad_() if t.dtype.is_floating_point else t for t in inputs]
    module(*leaves).square().sum().backward()
    reference = module.op.make_reference(module).double()
    leaves64 = [t.detach().double().requires_grad_() if t.dtype.is_floating_point else t for t in inputs]
    reference(*leaves64).square().sum().backward()
    named = [(f"input {k}", a.grad, b.grad) for k, (a, b) in enumerate(zip(leaves, leaves64)) if a.dtype.is_floating_point]
    named += [(name, p.grad, q.grad) for (name, p), q in zip(module.named_parameters(), reference.parameters())]
    for name, grad, grad64 in named:
        result = compare(grad, grad64, tol)
        assert result.ok, f"gradient of {name}: {result}"
