"""The wgmma kernels' packed weights made on the GPU, in one launch, from weights in the AlphaFold 3
layout (templates/trimul/pack_wgmma.cu.j2): what pairgen.triangle_multiplicative_update runs when
a caller passes weight tensors it made anew for the call (OpenFold 3 and Protenix torch.cat their
a and b projections on every call), so that no packed copy has to be kept, or built, per tensor."""
from __future__ import annotations

import functools

try:
    import torch
except ImportError:  # rendering the source (pairgen-tune --status) needs no torch
    torch = None

from ..fused_kernels import THREADS, FusedTemplate, storage_kind
from .spec import k_padded, wgmma_weight_offsets

#: The weights the kernel reads, in its argument order (None: a bias left out, read as zero).
WEIGHT_NAMES = ("norm_in_weight", "norm_in_bias", "p_in_weight", "p_in_bias", "g_in_weight", "g_in_bias",
                "norm_out_weight", "norm_out_bias", "p_out_weight", "p_out_bias", "g_out_weight", "g_out_bias")
OPERAND_ELEMENT_BYTES = 2
TEMPLATE = FusedTemplate("trimul", "pack_wgmma", lambda context: {"": ("ptr",) * (len(WEIGHT_NAMES) + 1)})


@functools.lru_cache(maxsize=64)
def context(P: int, H: int, operand: str) -> dict:
    """The template's context for widths P, H and an operand type ("bfloat16" or "float16"): the
    padded k extents and each section's byte offset (off_<section>). Cached: not to be modified."""
    offsets = wgmma_weight_offsets(P, H, OPERAND_ELEMENT_BYTES)
    return {"P": P, "H": H, "p_pad": k_padded(P), "h_pad": k_padded(H), "operand": operand,
            **{f"off_{name}": offset for name, offset in offsets.items()}}


def render(kind: str, P: int, H: int, operand: str):
    """The kernel's source for weights stored in `kind`, its signature checked."""
    return TEMPLATE.render(kind, **context(P, H, operand))


def applies(weights: dict) -> bool:
    """Whether the kernel reads these weights as given: one storage type it knows, contiguous."""
    first = weights["p_in_weight"]
    return storage_kind(first.dtype) is not None and all(
        w is None or (w.dtype is first.dtype and w.is_contiguous()) for w in weights.values())


def pack(weights: dict, operand: str) -> torch.Tensor:
    """The packed bytes for the wgmma kernels in `operand` ("bfloat16"/"float16") from `weights`
    (WEIGHT_NAMES; the LayerNorms' weights given, applies() true), on their device's current stream."""
    P, H = weights["p_out_weight"].shape
    found = context(P, H, operand)
    like = weights["p_in_weight"]
    packed = torch.empty(found["off_total"], dtype=torch.uint8, device=like.device)
    from ... import fastcall  # imports torch: rendering the source needs none

    fastcall.note_scratch(packed)  # a recorded call packs again on every replay
    rows = 4 * H + 2 * P
    pointers = [0 if weights[name] is None else weights[name].data_ptr() for name in WEIGHT_NAMES]
    TEMPLATE.launch(like, "", -(-rows // (THREADS // 32)), *pointers, packed.data_ptr(), **found)
    return packed
