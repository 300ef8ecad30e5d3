"""pairgen: auto-tuned fused CUDA kernels for pair-representation operations."""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["ContactHead", "ContactHeadReference", "PairReadout", "PairReadoutReference", "TriangleMultiplication",
           "TriangleMultiplicationReference", "__version__", "adapt", "patch", "triangle_multiplicative_update", "unpatch"]

#: public name -> the op package that defines it
_EXPORTS = {"ContactHead": "contact", "ContactHeadReference": "contact",
            "TriangleMultiplication": "trimul", "TriangleMultiplicationReference": "trimul",
            "PairReadout": "readout", "PairReadoutReference": "readout"}


def __getattr__(name):
    # Lazy, so that compile workers (which import pairgen.compiler) do not import torch.
    if name == "triangle_multiplicative_update":
        from .functional import triangle_multiplicative_update

        return triangle_multiplicative_update
    if name in ("adapt", "patch", "unpatch"):
        from . import adapters

        return getattr(adapters, name)
    if name in _EXPORTS:
        from .ops import get_op

        spec = get_op(_EXPORTS[name])
        return spec.reference_class if name.endswith("Reference") else spec.module_class
    raise AttributeError(f"module 'pairgen' has no attribute {name!r}")
