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
