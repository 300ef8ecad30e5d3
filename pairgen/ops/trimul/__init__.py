"""The triangle multiplicative update (AlphaFold-style trunks), both directions, both gate inputs,
with or without biases.

reference.py  the reference module and its test inputs
spec.py       strategies, search space, restrictions, defaults, plans (no torch)
module.py     the drop-in module and the strategies' runners
peers.py      cuEquivariance, timed beside it by scripts/bench.py
"""
from .module import TriangleMultiplication, pack_weights, triangle_bmm
from .peers import cuequivariance_peer
from .reference import TriangleMultiplicationReference, make_inputs, random_mask
from .spec import TRI_BUDGET, TRI_KC, TRIMUL, options_of, triangle_staging, weight_offsets

TRIMUL.bind(TriangleMultiplicationReference, TriangleMultiplication, make_inputs, cuequivariance_peer)

__all__ = ["TRIMUL", "TRI_BUDGET", "TRI_KC", "TriangleMultiplication", "TriangleMultiplicationReference",
           "make_inputs", "options_of", "pack_weights", "random_mask", "triangle_bmm", "triangle_staging",
           "weight_offsets"]
