"""The pair readout's weight packs, made for each call from its parameters as they are
(pairgen/ops/packing.py): the fp32 kernels', the gemm strategy's W2ᵀ split for tf32x3, and the
tensor-core kernels'."""
from __future__ import annotations

import functools

from ..packing import OPERAND_KINDS, Sources, layout
from .spec import mma_weight_offsets, weight_offsets


def _fp32_pieces(D: int, P: int, H: int, s: Sources) -> tuple[list, int]:
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
    pieces, total = _fp32_pieces(D, P, H, sources)
    return layout(total, pieces, sources.count)


@functools.lru_cache(maxsize=64)
def split_w2t_layout(D: int, H: int, sources: Sources):
    """W2^T split for the tf32x3 product (gemm's split_product), (3H, D) fp32: [W2hi^T; W2hi^T; W2lo^T]
    with hi = W2 rounded to TF32 and lo = W2 - hi rounded too, both exact TF32 values. [hi | lo]
    rows of hidden times the first 2H rows give hi W2hi + lo W2hi; hidden's hi half times the last
    H rows adds hi W2lo."""
    block = 4 * H * D
    pieces = [sources.transposed("fuse.2.weight", kind, at, D, H)
              for kind, at in (("tf32_hi", 0), ("tf32_hi", block), ("tf32_lo", 2 * block))]
    return layout(3 * block, pieces, sources.count)


@functools.lru_cache(maxsize=64)
def mma_layout(D: int, P: int, H: int, precision: str, sources: Sources):
    """The fp32 pack (the node prologue's [W_i^T | W_j^T], b1, b2, gamma, beta), then W_p [H][P] and
    W2 [D][H], nn.Linear's own layout, in the operand type, at mma_weight_offsets (bytes)."""
    kind = OPERAND_KINDS[precision]
    off = mma_weight_offsets(D, P, H, 2 if kind in ("bf16", "f16") else 4)
    pieces, _ = _fp32_pieces(D, P, H, sources)
    pieces += [sources.piece("fuse.0.weight", kind, off["wp"], H, P, (2 * D + P, 1), (P, 1), offset=2 * D),
               sources.copy("fuse.2.weight", kind, off["w2"], D, H)]
    return layout(off["total"], pieces, sources.count)
