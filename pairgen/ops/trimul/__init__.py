"""The triangle multiplicative update (AlphaFold-style trunks), both directions, both gate inputs,
with or without biases.

reference.py  the reference module and its test inputs
spec.py       the op's widths, presets, tolerances, defaults and cost (no torch)
strategies/   one file per strategy: space, restrictions, kernels, its pack, what runs a call
common.py     what the strategies share: argument lists, fp32 offsets, the FMA kernels' layouts
module.py     the drop-in module (validation; the call's strategy runs it)
packs.py      the weights' names and places, the fp32 kernels' pack
triangle.py   the triangle sums as one batched product
backward.py   the closed-form gradients (fused_backward.py: their fused passes)
peers.py      cuEquivariance, timed beside it by scripts/bench.py

Importing the package imports only the spec; the torch half loads on first use.
"""
from ...spec import lazy_exports
from .common import TRI_BUDGET, TRI_KC, triangle_staging, weight_offsets
from .spec import TRIMUL, options_of


def _torch_half():
    from .module import TriangleMultiplication
    from .peers import cuequivariance_peer
    from .reference import TriangleMultiplicationReference, make_inputs

    return TriangleMultiplicationReference, TriangleMultiplication, make_inputs, cuequivariance_peer


TRIMUL.bind(_torch_half)
__getattr__ = lazy_exports(__name__, {
    "TriangleMultiplication": "module", "triangle_bmm": "triangle",
    "cuequivariance_peer": "peers",
    "TriangleMultiplicationReference": "reference", "make_inputs": "reference", "random_mask": "reference"})

__all__ = ["TRIMUL", "TRI_BUDGET", "TRI_KC", "TriangleMultiplication", "TriangleMultiplicationReference",
           "make_inputs", "options_of", "random_mask", "triangle_bmm", "triangle_staging",
           "weight_offsets"]
