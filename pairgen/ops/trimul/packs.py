"""The triangle update's weights as its packs name them, and the fp32 kernels' pack (bmm, fused),
made for each call from the weights as the caller holds them (pairgen/ops/packing.py); the
tensor-core strategies' packs are theirs (strategies/mma.py, strategies/wgmma.py). A weight is named
as the module's state_dict names it; `Sources` says where it lies among the call's tensors: the
module's own parameters, or the AlphaFold 3 layout of pairgen.triangle_multiplicative_update (a and
b projections fused)."""
from __future__ import annotations

import functools

from ..packing import Sources, layout
from .common import weight_offsets

#: The four gated projections, in the order the packs interleave them per channel.
FOUR = ("proj_a", "gate_a", "proj_b", "gate_b")
_SUBMODULES = ("layer_norm_in", "proj_a", "gate_a", "proj_b", "gate_b", "layer_norm_out", "out_proj", "out_gate")
#: The weights of the AlphaFold 3 layout, in pairgen.triangle_multiplicative_update's argument order.
AF3_NAMES = ("norm_in_weight", "norm_in_bias", "p_in_weight", "p_in_bias", "g_in_weight", "g_in_bias",
             "norm_out_weight", "norm_out_bias", "p_out_weight", "p_out_bias", "g_out_weight", "g_out_bias")


def parameter_names(bias: bool) -> tuple[str, ...]:
    """The module's parameters in state_dict order."""
    return tuple(f"{sub}.{name}" for sub in _SUBMODULES for name in ("weight", "bias")
                 if name == "weight" or bias or sub.startswith("layer_norm"))


@functools.lru_cache(maxsize=64)
def af3_sources(given: tuple[bool, ...], P: int, H: int) -> Sources:
    """Where the module's weights lie among the AF3 weights given (`given`: per AF3_NAMES, whether it
    was passed; the sources are the given ones, in order): proj_b is p_in's last H rows, and so on."""
    index = {}
    for name, present in zip(AF3_NAMES, given):
        if present:
            index[name] = len(index)
    places = {}

    def place(module_name: str, af3_name: str, offset: int = 0) -> None:
        if af3_name in index:
            places[module_name] = (index[af3_name], offset)

    for kind in ("weight", "bias"):
        place(f"layer_norm_in.{kind}", f"norm_in_{kind}")
        place(f"layer_norm_out.{kind}", f"norm_out_{kind}")
        place(f"out_proj.{kind}", f"p_out_{kind}")
        place(f"out_gate.{kind}", f"g_out_{kind}")
        per_row = P if kind == "weight" else 1
        for half, rows in (("a", 0), ("b", H)):
            place(f"proj_{half}.{kind}", f"p_in_{kind}", rows * per_row)
            place(f"gate_{half}.{kind}", f"g_in_{kind}", rows * per_row)
    return Sources(places)


@functools.lru_cache(maxsize=64)
def fp32_layout(P: int, H: int, bias: bool, gate: int, sources: Sources):
    """pack_weights's layout (the fp32 kernels, weight_offsets in floats): linear weights k-major
    (transposed), the four projections interleaved per channel: column 4h + {0,1,2,3} of Wp is
    proj_a, gate_a, proj_b, gate_b of channel h, so one thread's float4 holds all four."""
    off = {name: 4 * at for name, at in weight_offsets(P, H, bias, gate).items()}
    s = sources
    pieces = [s.copy("layer_norm_in.weight", "f32", off["ln_in_g"], P), s.copy("layer_norm_in.bias", "f32", off["ln_in_b"], P),
              s.copy("layer_norm_out.weight", "f32", off["ln_out_g"], H),
              s.copy("layer_norm_out.bias", "f32", off["ln_out_b"], H),
              s.transposed("out_proj.weight", "f32", off["wo"], P, H), s.transposed("out_gate.weight", "f32", off["wg"], gate, P)]
    for k, name in enumerate(FOUR):  # Wp[p][h][k] = W_k[h][p]
        pieces.append(s.piece(f"{name}.weight", "f32", off["wp"] + 4 * k, P, H, (1, P), (4 * H, 4)))
        if bias:
            pieces.append(s.piece(f"{name}.bias", "f32", off["bp"] + 4 * k, H, 1, (1, 0), (4, 0)))
    if bias:
        pieces += [s.copy("out_proj.bias", "f32", off["bo"], P), s.copy("out_gate.bias", "f32", off["bg"], gate)]
    return layout(off["total"], pieces, sources.count)
