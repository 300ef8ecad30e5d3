"""The triangle update's weight packs, made for each call from the weights as the caller holds them
(pairgen/ops/packing.py): the fp32 kernels' (bmm, fused), the mma kernels' (a gather each), and the
wgmma kernels' (templates/trimul/pack_wgmma.cu.j2: each linear layer folded with the LayerNorm
before it, which takes arithmetic, not a gather). A weight is named as the module's state_dict
names it; `Sources` says where it lies among the call's tensors: the module's own parameters, or
the AlphaFold 3 layout of pairgen.triangle_multiplicative_update (a and b projections fused)."""
from __future__ import annotations

import functools

from ..fused_kernels import THREADS, FusedTemplate
from ..packing import MAX_SOURCES, OPERAND_KINDS, Sources, launch_pack, layout
from .spec import k_padded, mma_weight_offsets, weight_offsets, wgmma_weight_offsets

_FOUR = ("proj_a", "gate_a", "proj_b", "gate_b")
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
    for k, name in enumerate(_FOUR):  # Wp[p][h][k] = W_k[h][p]
        pieces.append(s.piece(f"{name}.weight", "f32", off["wp"] + 4 * k, P, H, (1, P), (4 * H, 4)))
        if bias:
            pieces.append(s.piece(f"{name}.bias", "f32", off["bp"] + 4 * k, H, 1, (1, 0), (4, 0)))
    if bias:
        pieces += [s.copy("out_proj.bias", "f32", off["bo"], P), s.copy("out_gate.bias", "f32", off["bg"], gate)]
    return layout(off["total"], pieces, sources.count)


@functools.lru_cache(maxsize=64)
def mma_layout(P: int, H: int, bias: bool, gate: int, precision: str, sources: Sources):
    """pack_mma_weights's layout (mma_weight_offsets, bytes): the matrices n-major as nn.Linear holds
    them, in the operand type (Wp's rows interleaved per channel: 4h + {0,1,2,3} = proj_a, gate_a,
    proj_b, gate_b of channel h), the LayerNorm affines and biases in fp32."""
    kind = OPERAND_KINDS[precision]
    size = 2 if kind in ("bf16", "f16") else 4
    off = mma_weight_offsets(P, H, bias, size, gate)
    s = sources
    pieces = [s.copy("out_proj.weight", kind, off["wo"], P, H), s.copy("out_gate.weight", kind, off["wg"], gate, P),
              s.copy("layer_norm_in.weight", "f32", off["ln_in_g"], P), s.copy("layer_norm_in.bias", "f32", off["ln_in_b"], P),
              s.copy("layer_norm_out.weight", "f32", off["ln_out_g"], H),
              s.copy("layer_norm_out.bias", "f32", off["ln_out_b"], H)]
    for k, name in enumerate(_FOUR):  # row 4h + k of Wp is row h of W_k
        pieces.append(s.piece(f"{name}.weight", kind, off["wp"] + size * k * P, H, P, (P, 1), (4 * P, 1)))
        if bias:
            pieces.append(s.piece(f"{name}.bias", "f32", off["bp"] + 4 * k, H, 1, (1, 0), (4, 0)))
    if bias:
        pieces += [s.copy("out_proj.bias", "f32", off["bo"], P), s.copy("out_gate.bias", "f32", off["bg"], gate)]
    return layout(off["total"], pieces, sources.count)


# ---- the wgmma kernels' folded pack (templates/trimul/pack_wgmma.cu.j2) --------------------------

#: The weights the fold kernel reads, each a pointer variable of the template.
FOLD_WEIGHTS = parameter_names(True)
FOLD_TEMPLATE = FusedTemplate("trimul", "pack_wgmma", lambda context: {"": ("ptr",) * (MAX_SOURCES + 1)})
OPERAND_ELEMENT_BYTES = 2


@functools.lru_cache(maxsize=64)
def fold_context(P: int, H: int, gate_normalized: bool, gate_hidden: bool, operand: str, sources: Sources) -> dict:
    """The fold kernel's context: widths, the padded k extents, each section's byte offset
    (off_<section>) and where each weight lies (weights: variable name -> (source, offset) or None)."""
    offsets = wgmma_weight_offsets(P, H, OPERAND_ELEMENT_BYTES, gate_hidden)
    weights = {name.replace(".", "_"): sources.places.get(name) for name in FOLD_WEIGHTS}
    return {"P": P, "H": H, "G": H if gate_hidden else P, "p_pad": k_padded(P), "h_pad": k_padded(H),
            "operand": operand, "gate_normalized": gate_normalized, "gate_hidden": gate_hidden,
            "weights": tuple(sorted(weights.items())), "max_sources": MAX_SOURCES,
            **{f"off_{name}": offset for name, offset in offsets.items()}}


def render_fold(kind: str, P: int, H: int, operand: str, gate_normalized: bool = True, gate_hidden: bool = False,
                sources: Sources | None = None):
    """The fold kernel's source for weights stored in `kind`, its signature checked (by default
    for the module's own parameters, with biases)."""
    sources = sources or Sources.each_its_own(FOLD_WEIGHTS)
    return FOLD_TEMPLATE.render(kind, **fold_context(P, H, gate_normalized, gate_hidden, operand, sources))


@functools.lru_cache(maxsize=64)
def fold_bytes(P: int, H: int, gate_hidden: bool) -> int:
    """The size of the wgmma kernels' pack."""
    return wgmma_weight_offsets(P, H, OPERAND_ELEMENT_BYTES, gate_hidden)["total"]


def pack_wgmma(tensors: list, sources: Sources, P: int, H: int, gate_normalized: bool, gate_hidden: bool,
               operand: str, out=None):
    """The wgmma kernels' packed bytes in `operand` ("bfloat16"/"float16") from the call's weight
    tensors (all of one storage type, contiguous: packing.readable), on the current stream, into
    `out` (fold_bytes bytes) or a per-call buffer (packing.launch_pack). One warp per output row."""
    found = fold_context(P, H, gate_normalized, gate_hidden, operand, sources)
    rows = 4 * H + P + found["G"]
    return launch_pack(FOLD_TEMPLATE, tensors, found["off_total"], -(-rows // (THREADS // 32)), out=out, **found)
