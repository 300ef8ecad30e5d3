"""Shared test data: sampled search-space points, shapes, inputs (OPS.md's standard)."""
from __future__ import annotations

import itertools
import random

import torch

from pairgen.ops.base import DeviceLimits

SEED_WIDTHS = {"P": 64, "H": 32}
REAL_WIDTHS = ({"P": 128, "H": 128}, {"P": 128, "H": 64})
ODD_SHAPES = [(b, n) for n in (1, 7, 37, 64, 123) for b in (1, 3)]


def all_points(spec, strategy: str):
    space = spec.strategies[strategy].space
    names = sorted(space)
    for values in itertools.product(*(space[n] for n in names)):
        yield dict(zip(names, values))


def sampled_plans(spec, strategy: str, widths: dict, k: int, seed: int = 0, limits=DeviceLimits()):
    """k feasible points of a strategy (a fixed random sample, defaults first)."""
    feasible = []
    for params in all_points(spec, strategy):
        plan = spec.plan(strategy, params, widths)
        if not spec.infeasible(plan, limits):
            feasible.append(plan)
    rng = random.Random(f"{seed}-{strategy}-{sorted(widths.items())}")
    defaults = [spec.plan(s, p, widths) for s, p in spec.default_points if s == strategy]
    picked = [p for p in defaults if not spec.infeasible(p, limits)]
    picked += rng.sample(feasible, min(k, len(feasible)))
    return picked


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
