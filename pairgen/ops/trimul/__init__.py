"""The triangle multiplicative update (AlphaFold-style trunks), both directions, both gate inputs,
with or without biases.

reference.py  the reference module and its test inputs
spec.py       strategies, search space, restrictions, defaults, plans (no torch)
module.py     the drop-in module and the strategies' runners
packs.py      the weight packs each call makes for the kernels
peers.py      cuEquivariance, timed beside it by scripts/bench.py

Importing the package imports only the spec; the torch half loads on first use.
"""
from ...spec import lazy_exports
from .spec import TRI_BUDGET, TRI_KC, TRIMUL, options_of, triangle_staging, weight_offsets


def _torch_half():
    from .module import TriangleMultiplication
    from .peers import cuequivariance_peer
    from .reference import TriangleMultiplicationReference, make_inputs

    return TriangleMultiplicationReference, TriangleMultiplication, make_inputs, cuequivariance_peer


TRIMUL.bind(_torch_half)
__getattr__ = lazy_exports(__name__, {
    "TriangleMultiplication": "module", "triangle_bmm": "module",
    "cuequivariance_peer": "peers",
    "TriangleMultiplicationReference": "reference", "make_inputs": "reference", "random_mask": "reference"})

__all__ = ["TRIMUL", "TRI_BUDGET", "TRI_KC", "TriangleMultiplication", "TriangleMultiplicationReference",
           "make_inputs", "options_of", "random_mask", "triangle_bmm", "triangle_staging",
           "weight_offsets"]
