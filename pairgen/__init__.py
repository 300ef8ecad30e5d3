"""pairgen: auto-tuned fused CUDA kernels for pair-representation operations."""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["ContactHead", "ContactHeadReference", "PairReadout", "PairReadoutReference", "TriangleMultiplication",
           "TriangleMultiplicationReference", "__version__"]


def __getattr__(name):
    # Lazy, so that compile workers (which import pairgen.compiler) do not import torch.
    if name in ("ContactHead", "ContactHeadReference"):
        from .ops import contact

        return getattr(contact, name)
    if name in ("TriangleMultiplication", "TriangleMultiplicationReference"):
        from .ops import trimul

        return getattr(trimul, name)
    if name in ("PairReadout", "PairReadoutReference"):
        from .ops import readout

        return getattr(readout, name)
    raise AttributeError(f"module 'pairgen' has no attribute {name!r}")
