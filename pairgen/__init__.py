"""pairgen: auto-tuned fused CUDA kernels for pair-representation operations."""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["ContactHead", "ContactHeadReference", "__version__"]


def __getattr__(name):
    # Lazy, so that compile workers (which import pairgen.compiler) do not import torch.
    if name in ("ContactHead", "ContactHeadReference"):
        from .ops import contact

        return getattr(contact, name)
    raise AttributeError(f"module 'pairgen' has no attribute {name!r}")
