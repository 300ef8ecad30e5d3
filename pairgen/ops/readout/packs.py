"""The pair readout's fp32 pack, made for each call from its parameters as they are
(pairgen/ops/packing.py): the fp32 kernels' whole pack, and the fp32 part of the tensor-core
kernels' (strategies/mma.py adds their operands; strategies/gemm.py makes its W2ᵀ split for tf32x3)."""
from __future__ import annotations

import functools

from ..packing import Sources, layout
from .common import weight_offsets


def fp32_pieces(D: int, P: int, H: int, s: Sources) -> tuple[list, int]:
    """[W_i^T | W_j^T] | W_p^T | b1 | W2^T | b2 | gamma | beta at weight_offsets (floats): the first
    Linear's weight (H, 2D + P) holds the node i, node j and pair columns in turn."""
    off = {name: 4 * at for name, at in weight_offsets(D, P, H).items()}
    k = 2 * D + P
    pieces = [s.piece("fuse.0.weight", "f32", off["wuvt"], D, H, (1, k), (2 * H, 1)),  # W_i^T: rows d, columns h
              s.piece("fuse.0.weight", "f32", off["wuvt"] + 4 * H, D, H, (1, k), (2 * H, 1), offset=D),  # W_j^T
              s.piece("fuse.0.weight", "f32", off["wpt"], P, H, (1, k), (H, 1), offset=2 * D),  # W_p^T
              s.copy("fuse.0.bias", "f32", off["b1"], H), s.transposed("fuse.2.weight", "f32", off["w2t"], D, H),
              s.copy("fuse.2.bias", "f32", off["b2"], D), s.copy("norm.weight", "f32", off["gamma"], D),
              s.copy("norm.bias", "f32", off["beta"], D)]
    return pieces, off["total"]


@functools.lru_cache(maxsize=64)
def fp32_layout(D: int, P: int, H: int, sources: Sources):
    pieces, total = fp32_pieces(D, P, H, sources)
    return layout(total, pieces, sources.count)
