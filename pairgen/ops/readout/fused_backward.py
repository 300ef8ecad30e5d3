"""The readout's 16-bit closed form on the GPU: the first layer's rows and the max over partners,
forward and backward (templates/readout/closed_form.cu.j2).

PyTorch's way (backward.py's fallback) builds the first layer's rows with torch.cat of the
broadcast node rows, which copies them element by element; masks the messages in place and takes
the max; then finds the winners by comparing every message with its node's max, counts them (a
cast of the pair-sized boolean to int64 first) and scatters the shares: pair-sized passes, most
through broadcasting kernels that run at a fraction of the memory's rate. Here the rows are copied
16 bytes at a time, and for the max a thread takes a node and 16 bytes of channels and walks the
node's partners (the forward's max: two lanes, half of them each): the forward reads the messages
once, counting each channel's winners as the max runs; the backward reads them once more and
writes the dense gradient the tensor-core products take, each winner's share from those counts
(ties share equally), in one walk. From that gradient, act_grad gives the first layer's output
gradient (d_m W2 through the SiLU's derivative) and each node's sum of it in one pass, adding
W2's rows of each row's winners (about D / N of them) where cuBLAS would multiply the dense
matrix. On by default with the other closed forms' fused kernels (PAIRGEN_FUSED_BACKWARD); the
GPU tests check both ways against the same standard."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ... import config
from ..fused_kernels import THREADS, FusedTemplate, sm_count

if TYPE_CHECKING:  # annotations only: these sources render without torch (pairgen-tune --status)
    import torch

SIGNATURES = {"rows": ("ptr nodes", "ptr pair", "ptr rows", "i64 n", "i64 total_rows"),
              "max": ("ptr m", "ptr edge", "ptr pooled", "ptr winners", "i64 nodes", "i64 n", "i64 channels"),
              "max_grad": ("ptr m", "ptr edge", "ptr pooled", "ptr winners", "ptr d_pooled", "ptr d_m", "ptr taken",
                           "i64 nodes", "i64 n", "i64 channels")}
#: The kernel a rendering with the hidden width (context "h") adds.
ACT_GRAD_SIGNATURE = {"act_grad": ("ptr d_m", "ptr w2", "ptr pre", "ptr d_u", "i64 nodes", "i64 n"),
                      "max_act_grad": ("ptr m", "ptr edge", "ptr pooled", "ptr winners", "ptr d_pooled", "ptr w2",
                                       "ptr pre", "ptr d_m", "ptr d_u", "ptr taken", "i64 nodes", "i64 n")}
TEMPLATE = FusedTemplate("readout", "closed_form",
                         lambda context: {**SIGNATURES, **(ACT_GRAD_SIGNATURE if context.get("h") else {})})
#: Bytes a thread copies or reads of a row at a time.
ACCESS_BYTES = 16
#: Resident blocks per SM the grid-stride loops are sized for.
BLOCKS_PER_SM = 8
#: The rows kernel works out a row's (b, i, j) in 32-bit arithmetic.
MAX_ROWS = 2**31 - 1
#: Partners the max's walks (forward and backward) load at once: a thread walks its node's
#: partners in turn, so these loads in flight hide the memory's latency. Of 1, 2, 4 and 8, two
#: measured fastest for both walks (docs/performance.md).
WALK_UNROLL = 2


def walk_threads(items: int) -> int:
    """Threads the max's walk takes for `items` (node, channel group) items: a warp per 16, its two
    16-lane halves walking the two halves of the items' partners (the template's WalkItem; the
    gradient's walk, which writes every partner's row, measured slower split and keeps a thread an
    item)."""
    return 32 * -(-items // 16)


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


def render(kind: str, D: int, P: int, H: int = 0):
    """The template for (D, P); with H, the act_grad kernel too (act_grad_applies must hold)."""
    hidden = {"h": H} if H else {}
    return TEMPLATE.render(kind, vec=vector_width(2 if kind != "float32" else 4, D, P), d=D, p=P,
                           walk_unroll=WALK_UNROLL, **hidden)


def _launch(like: torch.Tensor, suffix: str, vec: int, work: int, D: int, P: int, *args: int) -> None:
    """Launch `suffix` of the rendering for (vec, D, P) for `work` thread-items (grid-stride,
    BLOCKS_PER_SM blocks per SM at most)."""
    blocks = max(1, min(-(-work // THREADS), sm_count(like.device.index) * BLOCKS_PER_SM))
    TEMPLATE.launch(like, suffix, blocks, *args, vec=vec, d=D, p=P, walk_unroll=WALK_UNROLL)


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


def max_pool(m: torch.Tensor, edge: torch.Tensor, P: int) -> tuple:
    """m (B, N, N, D) contiguous, edge (B, N, N) bool: (pooled (B, N, D) in m's dtype, the max of
    m[b, i, j] over the j with edge[b, i, j] (0 for a node with none); winners (B, N, D) int32, how
    many of those j reach it (0 where pooled is NaN or the node has no edge), which
    max_pool_backward shares the gradient among). P: the pair width (the kernels' rendering is per
    D and P)."""
    import torch

    B, N, _, D = m.shape
    pooled = m.new_empty(B, N, D)
    winners = torch.empty(B, N, D, dtype=torch.int32, device=m.device)
    vec = vector_width(m.element_size(), D, P)
    _launch(m, "max", vec, walk_threads(B * N * (D // vec)), D, P, m.data_ptr(), edge.contiguous().data_ptr(),
            pooled.data_ptr(), winners.data_ptr(), B * N, N, D)
    return pooled, winners


def max_pool_backward(m: torch.Tensor, edge: torch.Tensor, pooled: torch.Tensor, winners: torch.Tensor,
                      d_pooled: torch.Tensor, P: int) -> tuple:
    """The gradient through max_pool, given its (pooled, winners): (d m (B*N*N, D) in m's dtype, the
    sum over nodes of what the winners took (D,) in fp32). d_pooled (B, N, D)."""
    import torch

    B, N, _, D = m.shape
    d_pooled = d_pooled.to(torch.float32).contiguous()
    d_m = torch.empty_like(m)
    taken = torch.empty_like(d_pooled)
    vec = vector_width(m.element_size(), D, P)
    _launch(m, "max_grad", vec, B * N * (D // vec), D, P, m.data_ptr(), edge.contiguous().data_ptr(), pooled.data_ptr(),
            winners.contiguous().data_ptr(), d_pooled.data_ptr(), d_m.data_ptr(), taken.data_ptr(), B * N, N, D)
    return d_m.view(-1, D), taken.sum((0, 1))


#: Whether 16-bit closed forms take act_grad (where act_grad_applies); the tests run both ways.
ACT_GRAD_KERNEL = True
#: Blocks per SM of act_grad's grid (a block takes a node at a time; 16 KB of shared memory at
#: H = 512). Many more than fit at once (3 at H = 512, by registers), so that up to B N = 2112
#: on 132 SMs a block takes one node and the scheduler balances them: a grid that is a wave and a
#: part of one leaves the part's SMs a tail of whole blocks (docs/performance.md).
ACT_GRAD_BLOCKS_PER_SM = 16
#: The widest H act_grad takes: its warps' sums of a node's rows are static shared memory (8 warps
#: x H fp32: 32 KB of the 48 a block may declare).
ACT_GRAD_MAX_H = 1024
#: The widest D act_grad takes: a warp holds its next row of d_m in registers (D / 64 words a lane)
#: beside this one's; at 2048 and H = ACT_GRAD_MAX_H that is 220 registers a thread, no spill.
ACT_GRAD_MAX_D = 2048


def act_grad_applies(D: int, H: int) -> bool:
    """Whether act_gradient takes these widths: on (ACT_GRAD_KERNEL), rows of whole 4-byte words,
    H / 64 of them a lane, H up to ACT_GRAD_MAX_H and D up to ACT_GRAD_MAX_D."""
    return (ACT_GRAD_KERNEL and D % 2 == 0 and H % 64 == 0 and 0 < H <= ACT_GRAD_MAX_H
            and 0 < D <= ACT_GRAD_MAX_D)


#: Whether act_grad makes d_m from m itself (max_act_gradient: max_grad's pass folded in, m read
#: once where max_grad reads it and act_grad then reads d_m); the tests run both ways.
MAX_ACT_GRAD_KERNEL = True


def act_gradient(d_m: torch.Tensor, w2: torch.Tensor, pre: torch.Tensor, P: int) -> tuple:
    """From max_pool_backward's dense d_m (B*N*N, D), the second layer's weight w2 (D, H) and the
    first layer's output pre (B, N, N, H) before the SiLU, all of one 16-bit dtype and contiguous:
    (d_pre = (d_m w2) * silu'(pre) in pre's storage (pre is consumed), d_u (B, N, H) = d_pre summed
    over each node's partners j). act_grad_applies(D, H) must hold; P: the pair width (the
    rendering is per D and P)."""
    B, N, _, H = pre.shape
    D = d_m.shape[-1]
    d_u = pre.new_empty(B, N, H)
    nodes = B * N
    TEMPLATE.launch(pre, "act_grad", _act_grad_blocks(nodes, pre), d_m.data_ptr(), w2.data_ptr(), pre.data_ptr(),
                    d_u.data_ptr(), nodes, N, vec=vector_width(pre.element_size(), D, P), d=D, p=P,
                    walk_unroll=WALK_UNROLL, h=H)
    return pre, d_u


def _act_grad_blocks(nodes: int, like: torch.Tensor) -> int:
    """act_grad's grid: a block a node, up to ACT_GRAD_BLOCKS_PER_SM an SM (then a block takes several)."""
    return max(1, min(nodes, sm_count(like.device.index) * ACT_GRAD_BLOCKS_PER_SM))


def max_act_gradient(m: torch.Tensor, edge: torch.Tensor, pooled: torch.Tensor, winners: torch.Tensor,
                     d_pooled: torch.Tensor, w2: torch.Tensor, pre: torch.Tensor, P: int) -> tuple:
    """max_pool_backward and act_gradient in one pass over m: (d_pre in pre's storage (pre is
    consumed), d_u, d_m (B*N*N, D), the sum over nodes of what the winners took (D,) in fp32), each
    as those two give it. m (B, N, N, D), edge (B, N, N) bool, max_pool's (pooled, winners), d_pooled
    (B, N, D); w2 (D, H) and pre (B, N, N, H) in m's 16-bit dtype, contiguous. act_grad_applies(D, H)
    must hold."""
    import torch

    B, N, _, H = pre.shape
    D = m.shape[-1]
    d_pooled = d_pooled.to(torch.float32).contiguous()
    d_m = torch.empty_like(m)
    taken = torch.empty_like(d_pooled)
    d_u = pre.new_empty(B, N, H)
    nodes = B * N
    TEMPLATE.launch(pre, "max_act_grad", _act_grad_blocks(nodes, pre), m.data_ptr(), edge.contiguous().data_ptr(),
                    pooled.data_ptr(), winners.contiguous().data_ptr(), d_pooled.data_ptr(), w2.data_ptr(),
                    pre.data_ptr(), d_m.data_ptr(), d_u.data_ptr(), taken.data_ptr(), nodes, N,
                    vec=vector_width(pre.element_size(), D, P), d=D, p=P, walk_unroll=WALK_UNROLL, h=H)
    return pre, d_u, d_m.view(-1, D), taken.sum((0, 1))
