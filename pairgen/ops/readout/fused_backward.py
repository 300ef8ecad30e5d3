"""The readout's 16-bit closed form on the GPU: the first layer's rows and the max over partners,
forward and backward (templates/readout/closed_form.cu.j2).

PyTorch's way (backward.py's fallback) builds the first layer's rows with torch.cat of the
broadcast node rows, which copies them element by element; masks the messages in place and takes
the max; then finds the winners by comparing every message with its node's max, counts them (a
cast of the pair-sized boolean to int64 first) and scatters the shares: pair-sized passes, most
through broadcasting kernels that run at a fraction of the memory's rate. Here the rows are copied
16 bytes at a time, and for the max a thread takes a node and 16 bytes of channels and walks the
node's partners: the forward reads the messages once; the backward reads them once more and
writes the dense gradient the tensor-core products take, revisiting a node's partners only where
a channel's max is tied. On by default with the other closed forms' fused kernels
(PAIRGEN_FUSED_BACKWARD); the GPU tests check both ways against the same standard."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ... import config
from ..fused_kernels import THREADS, FusedTemplate, sm_count

if TYPE_CHECKING:  # annotations only: these sources render without torch (pairgen-tune --status)
    import torch

SIGNATURES = {"rows": ("ptr nodes", "ptr pair", "ptr rows", "i64 n", "i64 total_rows"),
              "max": ("ptr m", "ptr edge", "ptr pooled", "i64 nodes", "i64 n", "i64 channels"),
              "max_grad": ("ptr m", "ptr edge", "ptr pooled", "ptr d_pooled", "ptr d_m", "ptr taken", "i64 nodes",
                           "i64 n", "i64 channels"),
              "silu_grad": ("ptr d", "ptr pre", "ptr d_u_parts", "ptr d_v_parts", "i64 nodes", "i64 n", "i64 channels",
                            "i64 row_blocks", "i64 col_blocks")}
TEMPLATE = FusedTemplate("readout", "closed_form", lambda context: {
    suffix: args for suffix, args in SIGNATURES.items() if suffix != "silu_grad" or _whole_vectors(context)})
#: Bytes a thread copies or reads of a row at a time.
ACCESS_BYTES = 16
#: Resident blocks per SM the grid-stride loops are sized for.
BLOCKS_PER_SM = 8
#: The rows kernel works out a row's (b, i, j) in 32-bit arithmetic.
MAX_ROWS = 2**31 - 1
#: The pairs (i, j) of one silu_grad block: SG_ROWS rows i by SG_COLS partners j. SG_COLS bounds
#: its registers: each thread keeps running sums of SG_COLS / 4 partners' VEC channels.
SG_ROWS, SG_COLS = 32, 16


def applies(nodes: torch.Tensor) -> bool:
    """Whether these kernels take a closed form computing in nodes' dtype (CUDA, 16 bits: fp32
    keeps its split first layer and sparse max gradient; PAIRGEN_FUSED_BACKWARD not 0)."""
    import torch

    return nodes.is_cuda and nodes.dtype in (torch.bfloat16, torch.float16) and config.fused_backward()


def vector_width(itemsize: int, D: int, P: int) -> int:
    """Elements a thread takes at a time: 16 bytes' worth where D and P divide into them, else fewer."""
    vec = ACCESS_BYTES // itemsize
    while math.gcd(D, P) % vec:
        vec //= 2
    return vec


def _whole_vectors(context: dict) -> bool:
    """Whether a rendering's vector is 16 bytes: the SiLU's backward kernel is rendered only there
    (at narrower vectors its sums' registers spill, and a 2-byte walk would not beat PyTorch's)."""
    return context["vec"] * (4 if context["kind"] == "float32" else 2) == ACCESS_BYTES


def _context(vec: int, D: int, P: int) -> dict:
    return {"vec": vec, "d": D, "p": P, "sg_rows": SG_ROWS, "sg_cols": SG_COLS}


def render(kind: str, D: int, P: int):
    return TEMPLATE.render(kind, **_context(vector_width(2 if kind != "float32" else 4, D, P), D, P))


def _launch(like: torch.Tensor, suffix: str, vec: int, work: int, D: int, P: int, *args: int) -> None:
    """Launch `suffix` of the rendering for (vec, D, P) for `work` thread-items (grid-stride,
    BLOCKS_PER_SM blocks per SM at most)."""
    blocks = max(1, min(-(-work // THREADS), sm_count(like.device.index) * BLOCKS_PER_SM))
    TEMPLATE.launch(like, suffix, blocks, *args, **_context(vec, D, P))


def starts_aligned(t: torch.Tensor, vec: int) -> bool:
    """Whether t's first element starts a vec-element access (a contiguous view into a larger
    tensor may start mid-vector)."""
    return t.data_ptr() % (vec * t.element_size()) == 0


def first_layer_rows(nodes: torch.Tensor, pair: torch.Tensor) -> torch.Tensor | None:
    """(B*N*N, 2D+P): each pair's row [nodes[b, i] | nodes[b, j] | pair[b, i, j]] (nodes (B, N, D)
    and pair (B, N, N, P) of one dtype); None past MAX_ROWS rows, or for inputs that start
    mid-vector (the caller concatenates)."""
    B, N, D = nodes.shape
    P = pair.shape[-1]
    if B * N * N > MAX_ROWS:
        return None
    nodes, pair = nodes.contiguous(), pair.contiguous()
    vec = vector_width(nodes.element_size(), D, P)
    if not (starts_aligned(nodes, vec) and starts_aligned(pair, vec)):
        return None
    rows = nodes.new_empty(B * N * N, 2 * D + P)
    _launch(nodes, "rows", vec, B * N * N * ((2 * D + P) // vec), D, P, nodes.data_ptr(), pair.data_ptr(),
            rows.data_ptr(), N, B * N * N)
    return rows


def max_pool(m: torch.Tensor, edge: torch.Tensor, P: int) -> torch.Tensor:
    """m (B, N, N, D) contiguous, edge (B, N, N) bool: pooled (B, N, D) in m's dtype, the max of
    m[b, i, j] over the j with edge[b, i, j] (0 for a node with none). P: the pair width (the
    kernels' rendering is per D and P)."""
    B, N, _, D = m.shape
    pooled = m.new_empty(B, N, D)
    vec = vector_width(m.element_size(), D, P)
    _launch(m, "max", vec, B * N * (D // vec), D, P, m.data_ptr(), edge.contiguous().data_ptr(), pooled.data_ptr(),
            B * N, N, D)
    return pooled


def max_pool_backward(m: torch.Tensor, edge: torch.Tensor, pooled: torch.Tensor, d_pooled: torch.Tensor,
                      P: int) -> tuple:
    """The gradient through max_pool: (d m (B*N*N, D) in m's dtype, the sum over nodes of what the
    winners took (D,) in fp32). d_pooled (B, N, D)."""
    import torch

    B, N, _, D = m.shape
    d_pooled = d_pooled.to(torch.float32).contiguous()
    d_m = torch.empty_like(m)
    taken = torch.empty_like(d_pooled)
    vec = vector_width(m.element_size(), D, P)
    _launch(m, "max_grad", vec, B * N * (D // vec), D, P, m.data_ptr(), edge.contiguous().data_ptr(), pooled.data_ptr(),
            d_pooled.data_ptr(), d_m.data_ptr(), taken.data_ptr(), B * N, N, D)
    return d_m.view(-1, D), taken.sum((0, 1))


def silu_backward_sums(d_act: torch.Tensor, pre: torch.Tensor, B: int, N: int, D: int, P: int) -> tuple | None:
    """d_act (B*N*N, H) contiguous becomes d(loss)/d(pre) = d_act * silu'(pre) in place (pre of its
    shape and dtype); returns (it, d_u, d_v): its sums over each node's partners, d_u (B, N, H) over
    j for each (b, i) and d_v over i for each (b, j), in fp32 (each block's partial sums, added
    here: deterministic). None where the kernel does not take these tensors (a rendering whose
    vector is not 16 bytes, H not a multiple of it, or a tensor that starts mid-vector): the caller
    runs PyTorch's passes.
    D and P: the rendering's widths (its vector is theirs)."""
    import torch

    H = d_act.shape[-1]
    vec = vector_width(d_act.element_size(), D, P)
    if vec * d_act.element_size() != ACCESS_BYTES or H % vec or not (d_act.is_contiguous() and pre.is_contiguous() and starts_aligned(d_act, vec)
                       and starts_aligned(pre, vec)):
        return None
    row_blocks, col_blocks = -(-N // SG_ROWS), -(-N // SG_COLS)
    d_u_parts = torch.empty(col_blocks, B * N, H, device=d_act.device, dtype=torch.float32)
    d_v_parts = torch.empty(row_blocks, B * N, H, device=d_act.device, dtype=torch.float32)
    TEMPLATE.launch(d_act, "silu_grad", B * row_blocks * col_blocks, d_act.data_ptr(), pre.data_ptr(),
                    d_u_parts.data_ptr(), d_v_parts.data_ptr(), B * N, N, H, row_blocks, col_blocks,
                    **_context(vec, D, P))
    return d_act, d_u_parts.sum(0).view(B, N, H), d_v_parts.sum(0).view(B, N, H)
