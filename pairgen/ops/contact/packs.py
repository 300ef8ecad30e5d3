"""The contact head's fp32 kernels' weight pack, made for each call from its parameters as they are
(pairgen/ops/packing.py); the tensor-core kernels' is strategies/mma.py's."""
from __future__ import annotations

import functools

from ..packing import Sources, layout
from .common import weight_offsets


@functools.lru_cache(maxsize=64)
def fp32_layout(P: int, H: int, sources: Sources):
    """W1ᵀ | b1 | W2ᵀ | b2 | w3 | b3 | gamma | beta at weight_offsets (floats), fp32."""
    off = {name: 4 * at for name, at in weight_offsets(P, H).items()}
    s = sources
    pieces = [s.transposed("mlp.0.weight", "f32", off["w1t"], H, P), s.copy("mlp.0.bias", "f32", off["b1"], H),
              s.transposed("mlp.2.weight", "f32", off["w2t"], H, H), s.copy("mlp.2.bias", "f32", off["b2"], H),
              s.copy("mlp.4.weight", "f32", off["w3"], H), s.copy("mlp.4.bias", "f32", off["b3"], 1),
              s.copy("layer_norm.weight", "f32", off["gamma"], P), s.copy("layer_norm.bias", "f32", off["beta"], P)]
    return layout(off["total"], pieces, sources.count)
