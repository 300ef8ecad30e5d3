"""LayerNorm over rows (M, C) on the GPU for the closed forms (templates/common/layer_norm_rows.cu.j2):
a warp per row, the row in registers. PyTorch's LayerNorm kernels read the short rows of a pair
representation (one per pair, tens to hundreds of channels) at a fraction of the memory's rate;
these kernels are several times faster there. Used where the closed forms' fused kernels are on
(PAIRGEN_FUSED_BACKWARD)."""
from __future__ import annotations

import functools

from typing import TYPE_CHECKING

from .. import config
from .fused_kernels import THREADS, WARP_KERNEL_BLOCKS_PER_SM, FusedTemplate, storage_kind, warp_per_item_blocks

if TYPE_CHECKING:  # annotations only: torch is imported where it is used, so that these sources
    import torch  # render without it (pairgen-tune --status)

SIGNATURES = {"": ("ptr x", "ptr gamma", "ptr beta", "ptr xn", "ptr mean", "ptr rstd", "i64 rows"),
              "grad": ("ptr d_xn", "ptr add_before", "ptr x", "ptr mean", "ptr rstd", "ptr gamma", "ptr add_after",
                       "ptr d_x", "ptr gamma_parts", "ptr beta_parts", "i64 rows")}
#: Widest row taken (a lane holds C / 32 values of each of a few arrays in registers).
MAX_COLS = 1024
TEMPLATE = FusedTemplate("common", "layer_norm_rows", lambda context: SIGNATURES)


def applies(t: torch.Tensor, cols: int) -> bool:
    """Whether these kernels take rows like t of width cols (else PyTorch's LayerNorm)."""
    return t.is_cuda and storage_kind(t.dtype) is not None and cols <= MAX_COLS and config.fused_backward()


#: Bytes of each storage kind's element.
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: The widest load a lane makes of a row.
CHUNK_BYTES = 16


def chunk_values(cols: int, kinds_and_addresses) -> int:
    """Values a lane loads and stores at once (the template's VEC): the most, up to CHUNK_BYTES of
    the widest element, that divide the row and keep each (kind, address) of the call (every row's
    start and each weight's) aligned to its chunk; 1 where nothing wider does."""
    pairs = list(kinds_and_addresses)
    vec = CHUNK_BYTES // max(ELEMENT_BYTES[kind] for kind, _ in pairs)
    while vec > 1 and (cols % vec or any(address % (vec * ELEMENT_BYTES[kind]) for kind, address in pairs)):
        vec //= 2
    return vec


@functools.lru_cache(maxsize=64)
def _context(kind: str, cols: int, eps: float, x_kind: str | None, vec: int | None) -> dict:
    """The template's context (cached: every training step launches these kernels; not to be
    changed)."""
    x_kind = x_kind or kind
    if vec is None:  # the chunk of aligned tensors
        vec = chunk_values(cols, [(kind, 0), (x_kind, 0)])
    group = min(32, 1 << max(0, cols // vec - 1).bit_length())  # lanes a row: CHUNKS up to a power of two
    return {"cols": cols, "eps": repr(float(eps)), "x_kind": x_kind, "vec": vec, "group": group}


def render(kind: str, cols: int, eps: float = 1e-5, x_kind: str | None = None, vec: int | None = None):
    """The kernels' source for one storage type and width; x_kind "float32" with a 16-bit kind: the
    forward reading fp32 rows (layer_norm's fp32 input); vec: the values a lane loads at once
    (chunk_values; by default the most that aligned tensors allow)."""
    return TEMPLATE.render(kind, **_context(kind, cols, eps, x_kind, vec))


def _addresses(*tensors) -> list:
    """(kind, address) of each tensor given (None: left out): with the row width a multiple of the
    chunk, every row's start is then aligned where the first is."""
    return [(storage_kind(t.dtype), t.data_ptr()) for t in tensors if t is not None]


def _blocks(rows: torch.Tensor, M: int, context: dict, blocks_per_sm: int) -> int:
    """A warp per 32 / GROUP rows, up to blocks_per_sm blocks an SM (the kernels loop past that)."""
    return warp_per_item_blocks(rows, -(-M // (32 // context["group"])), blocks_per_sm)


#: Blocks an SM of the forward's grid: more than the backward's (row_blocks), whose rows carry three
#: inputs to the forward's one and measured slower with more blocks (docs/performance.md).
FORWARD_BLOCKS_PER_SM = 8


def layer_norm(rows: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float,
               blocks_per_sm: int = FORWARD_BLOCKS_PER_SM) -> tuple:
    """LayerNorm over the last dim of rows (M, C) contiguous: (xn (M, C), mean and 1/std (M,) in
    fp32), as torch.native_layer_norm returns them. xn in gamma's dtype: rows in that dtype, or
    fp32 rows with 16-bit weights (an fp32 input under autocast, normalised as it is read instead
    of cast first: reads_fp32). mean and 1/std are the two rows of one (2, M) tensor (`statistics`
    gives it back), the layout the triangle update's projection kernels read them in."""
    import torch

    M, C = rows.shape
    xn = torch.empty(rows.shape, device=rows.device, dtype=gamma.dtype)
    mean, rstd = torch.empty(2, M, device=rows.device, dtype=torch.float32)
    context = _context(storage_kind(gamma.dtype), C, eps, storage_kind(rows.dtype),
                       chunk_values(C, _addresses(rows, gamma, beta, xn)))
    TEMPLATE.launch(xn, "", _blocks(rows, M, context, blocks_per_sm), rows.data_ptr(), gamma.data_ptr(),
                    beta.data_ptr(), xn.data_ptr(), mean.data_ptr(), rstd.data_ptr(), M, **context)
    return xn, mean, rstd


def statistics(mean: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor | None:
    """The (2, M) tensor whose rows are layer_norm's mean and 1/std, where they are its rows
    (None otherwise)."""
    base = mean._base
    if base is None or base.shape != (2, mean.numel()) or rstd._base is not base:
        return None
    return base if mean.data_ptr() == base.data_ptr() and rstd.data_ptr() == base[1].data_ptr() else None


def reads_fp32(rows: torch.Tensor, dtype) -> bool:
    """Whether layer_norm takes fp32 rows with weights of `dtype` as they are (16-bit weights)."""
    import torch

    return rows.dtype is torch.float32 and dtype in (torch.bfloat16, torch.float16) and applies(rows, rows.shape[-1])


def layer_norm_backward(d_xn: torch.Tensor, rows: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                        gamma: torch.Tensor, eps: float, add_before: torch.Tensor | None = None,
                        add_after: torch.Tensor | None = None,
                        blocks_per_sm: int = WARP_KERNEL_BLOCKS_PER_SM) -> tuple:
    """The backward of layer_norm: (d rows, d gamma, d beta; the affine gradients in fp32 from each
    warp's partial sums), d xn taken as d_xn + add_before, and add_after added to d rows (both
    (M, C) contiguous, optional): the two places a second path's gradient joins."""
    import torch

    M, C = rows.shape
    d_rows = torch.empty_like(rows)
    kind = storage_kind(rows.dtype)
    context = _context(kind, C, eps, kind, chunk_values(C, _addresses(d_xn, add_before, rows, gamma, add_after, d_rows)))
    blocks = _blocks(rows, M, context, blocks_per_sm)
    parts = torch.empty(2, blocks * (THREADS // 32), C, device=rows.device, dtype=torch.float32)
    TEMPLATE.launch(rows, "grad", blocks, d_xn.data_ptr(), 0 if add_before is None else add_before.data_ptr(),
                    rows.data_ptr(), mean.data_ptr(), rstd.data_ptr(), gamma.data_ptr(),
                    0 if add_after is None else add_after.data_ptr(), d_rows.data_ptr(), parts[0].data_ptr(),
                    parts[1].data_ptr(), M, **context)
    return (d_rows, *parts.sum(1))  # d gamma and d beta: views of one reduction

