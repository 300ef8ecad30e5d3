"""Weights packed for each call: a kernel's weight buffer made from the caller's tensors as they
are, in one launch (templates/common/gather_pack.cu.j2), so no packed copy is kept between calls
and none can go stale, whatever the caller did to its tensors (an optimizer step, an EMA update
through `.data`, a replaced parameter, weights made anew by a torch.cat).

A pack is a Layout: byte-addressed pieces, each a 2-D strided copy of one source tensor (or of a
constant: a LayerNorm weight the caller left out is ones), converted to the piece's kind on the
way. Sources are the tensors of the call, in order; `Sources` says where each weight the layout
names lies among them (a tensor of its own, or rows of a tensor holding two weights, as the
AlphaFold 3 layout's fused a/b projections). The same Layout runs on the host with PyTorch
(`pack_on_host`: the CPU, the tests, sources the kernel does not read as given) and on the GPU
(`pack`)."""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

from .fused_kernels import THREADS, FusedTemplate, storage_kind

if TYPE_CHECKING:  # annotations only: rendering needs no torch
    import torch

#: Piece kinds: what a source value is converted to, and its bytes. "tf32_hi" is the value rounded
#: to TF32 (to nearest, ties away from zero, as cvt.rna), "tf32_lo" the rest rounded too; "byte"
#: fills alignment gaps with zeros.
KIND_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "tf32_hi": 4, "tf32_lo": 4, "byte": 1}
#: The kind of a 16-bit operand dtype's matrices, by precision name.
OPERAND_KINDS = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "tf32": "f32", "tf32x3": "f32"}
#: The most source tensors one pack reads (the triangle update with biases has 16 parameters).
MAX_SOURCES = 16


@dataclasses.dataclass(frozen=True)
class Piece:
    """dst[r * dst_strides[0] + c * dst_strides[1]] = kind(source[offset + r * src_strides[0] +
    c * src_strides[1]]) for r < rows, c < cols; dst counts elements of the kind from byte `at`.
    source -1: the constant `fill`."""
    source: int
    offset: int
    kind: str
    at: int
    rows: int
    cols: int
    src_strides: tuple[int, int]
    dst_strides: tuple[int, int]
    fill: float = 0.0

    @property
    def count(self) -> int:
        return self.rows * self.cols

    def byte_range(self) -> tuple[int, int]:
        size = KIND_BYTES[self.kind]
        last = (self.rows - 1) * self.dst_strides[0] + (self.cols - 1) * self.dst_strides[1] if self.count else -1
        return self.at, self.at + (last + 1) * size


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """A pack of `total` bytes made of `pieces` (and zero bytes wherever no piece writes: alignment
    gaps between sections). Compared and hashed by identity: layouts are made once per shape
    (cached by the functions that build them), and a call's launch looks its kernel up by it."""
    total: int
    pieces: tuple[Piece, ...]
    sources: int  # how many source tensors the pack reads

    @property
    def elements(self) -> int:
        return sum(p.count for p in self.pieces)


def layout(total: int, pieces: list[Piece], sources: int) -> Layout:
    """A Layout whose gaps (bytes no piece writes) are zero pieces. The pieces must tile the byte
    ranges they span (an interleaved section's pieces together fill it): checked here, since a
    byte left unwritten would hold whatever the allocator left there."""
    spans = sorted(p.byte_range() for p in pieces if p.count)
    written = sum(p.count * KIND_BYTES[p.kind] for p in pieces)
    covered, gaps, at = 0, [], 0
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    for start, end in merged:
        covered += end - start
        if start > at:
            gaps.append((at, start))
        at = end
    if at < total:
        gaps.append((at, total))
    if written != covered or at > total:
        raise ValueError(f"pack pieces overlap or leave holes inside their sections ({written} bytes written, "
                         f"{covered} spanned, {total} in all)")
    zeros = [Piece(-1, 0, "byte", start, 1, end - start, (0, 0), (0, 1)) for start, end in gaps]
    return Layout(total, tuple(pieces) + tuple(zeros), sources)


class Sources:
    """Where each weight a layout names lies among a call's source tensors: name -> (source
    index, element offset), or absent (a weight the caller left out: a LayerNorm weight reads as
    ones, anything else as zeros). Hashable: layouts are cached per Sources."""

    def __init__(self, places: dict[str, tuple[int, int]]):
        self.places = dict(places)
        self.count = 1 + max((index for index, _ in self.places.values()), default=-1)
        self._key = tuple(sorted(self.places.items()))

    @classmethod
    def each_its_own(cls, names) -> "Sources":
        """Every weight a tensor of its own, in the order of `names` (a module's parameters)."""
        return cls({name: (index, 0) for index, name in enumerate(names)})

    def __eq__(self, other):
        return isinstance(other, Sources) and self._key == other._key

    def __hash__(self):
        return hash(self._key)

    def piece(self, name: str, kind: str, at: int, rows: int, cols: int, src_strides: tuple[int, int],
              dst_strides: tuple[int, int], offset: int = 0) -> Piece:
        """A piece reading weight `name` from element `offset` of it (constant where it is absent:
        ones for a LayerNorm weight, zeros otherwise)."""
        place = self.places.get(name)
        if place is None:
            fill = 1.0 if "norm" in name and name.endswith(".weight") else 0.0  # LayerNorm weights only
            return Piece(-1, 0, kind, at, rows, cols, (0, 0), dst_strides, fill)
        index, start = place
        return Piece(index, start + offset, kind, at, rows, cols, src_strides, dst_strides)

    def copy(self, name: str, kind: str, at: int, rows: int, cols: int = 1) -> Piece:
        """Weight `name` (rows x cols, row-major) copied as it is."""
        return self.piece(name, kind, at, rows, cols, (cols, 1), (cols, 1))

    def transposed(self, name: str, kind: str, at: int, rows: int, cols: int, row_stride: int | None = None,
                   offset: int = 0) -> Piece:
        """Weight `name` (rows x cols; row_stride elements apart, cols by default) transposed, from
        column `offset`: the pack holds cols x rows."""
        stride = cols if row_stride is None else row_stride
        return self.piece(name, kind, at, cols, rows, (1, stride), (rows, 1), offset)


# ---- the kernel ------------------------------------------------------------------------------------

def source_arguments() -> tuple[str, ...]:
    """The pack kernels' first arguments: a pointer per source slot (s0, s1, ...), then the pack."""
    return tuple(f"ptr s{k}" for k in range(MAX_SOURCES)) + ("ptr packed",)


TEMPLATE = FusedTemplate("common", "gather_pack", lambda context: {"": source_arguments() + ("i32 count",)})


def render(kind: str, layout_: Layout):
    """The gather kernel's source for sources stored in `kind` (float32, bfloat16, float16)."""
    return TEMPLATE.render(kind, layout=layout_, max_sources=MAX_SOURCES)


def readable(sources: list) -> bool:
    """Whether the kernel reads these sources as given: at most MAX_SOURCES, one storage type it
    knows, each contiguous."""
    if not sources or len(sources) > MAX_SOURCES:
        return False
    dtype = sources[0].dtype
    return storage_kind(dtype) is not None and all(s.dtype is dtype and s.is_contiguous() for s in sources)


def pack(layout_: Layout, sources: list, out: "torch.Tensor | None" = None) -> "torch.Tensor":
    """The packed bytes, on the sources' device (the current stream): one launch where the kernel
    reads the sources as given (readable), else PyTorch on the host's terms (pack_on_host)."""
    if not sources[0].is_cuda or not readable(sources):
        return pack_on_host(layout_, sources)
    count = layout_.elements
    return launch_pack(TEMPLATE, sources, layout_.total, max(1, min(-(-count // THREADS), 1024)), count, out=out,
                       layout=layout_, max_sources=MAX_SOURCES)


def launch_pack(template: FusedTemplate, sources: list, total: int, blocks: int, *tail: int,
                out: "torch.Tensor | None" = None, **context) -> "torch.Tensor":
    """A pack kernel of `template` (arguments: MAX_SOURCES source pointers, the unused ones null,
    the pack, then `tail`) launched on the sources into `out` (`total` bytes a module holds), or
    into a per-call buffer, noted so a recorded call (pairgen/fastcall.py) makes one on every
    replay. A replay runs the pack launch too: the weights are packed on every call."""
    torch, fastcall = _torch_side()
    packed = out
    if packed is None:
        packed = torch.empty(total, dtype=torch.uint8, device=sources[0].device)
        fastcall.note_scratch(packed)
    pointers = [s.data_ptr() for s in sources] + [0] * (MAX_SOURCES - len(sources))
    template.launch(sources[0], "", blocks, *pointers, packed.data_ptr(), *tail, **context)
    return packed


@functools.cache
def _torch_side():
    """torch and pairgen.fastcall, imported on first use (rendering a pack needs neither)."""
    import torch

    from .. import fastcall

    return torch, fastcall


@functools.lru_cache(maxsize=None)
def _torch_kinds():
    import torch

    return {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "tf32_hi": torch.float32,
            "tf32_lo": torch.float32}


def tf32_rounded(x: "torch.Tensor") -> "torch.Tensor":
    """fp32 values rounded to TF32 (10 mantissa bits), to nearest with ties away from zero; NaN and
    infinity stay as they are."""
    import torch

    bits = x.view(torch.int32)
    rounded = ((bits + 0x1000) & -0x2000).view(torch.float32)  # -0x2000: the int32 of 0xffffe000
    return torch.where(torch.isfinite(x), rounded, x)


def converted(values: "torch.Tensor", kind: str) -> "torch.Tensor":
    """Source values as a piece of `kind` holds them."""
    if kind == "tf32_hi":
        return tf32_rounded(values.float())
    if kind == "tf32_lo":
        v = values.float()
        return tf32_rounded(v - tf32_rounded(v))
    return values.to(_torch_kinds()[kind])


def pack_on_host(layout_: Layout, sources: list) -> "torch.Tensor":
    """The pack made with PyTorch operations on the sources' device: what the kernel computes."""
    import torch

    first = sources[0]
    packed = torch.zeros(layout_.total, dtype=torch.uint8, device=first.device)
    flat = [s.detach().contiguous().reshape(-1) for s in sources]
    for p in layout_.pieces:
        if p.kind == "byte" or not p.count:
            continue  # zeros already
        if p.source < 0:
            values = torch.full((p.rows, p.cols), p.fill, dtype=torch.float32, device=first.device)
        else:
            base = flat[p.source]
            values = base.as_strided((p.rows, p.cols), p.src_strides, base.storage_offset() + p.offset)
        start, end = p.byte_range()
        typed = packed[start:end].view(_torch_kinds()[p.kind])
        typed.as_strided((p.rows, p.cols), p.dst_strides).copy_(converted(values, p.kind))
    return packed
