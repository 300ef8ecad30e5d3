"""The readout's first layer for 16-bit training on the GPU (templates/readout/first_layer.cu.j2):
pre = [nodes_i | nodes_j | pair_ij] W1^T + b1 and act = silu(pre), both (B, N, N, H) in the
nodes' dtype, computed split by columns and rounded once.

The single product over the concatenated rows takes K = 2 D + P and reads each node's row N
times; here each node's two terms (U = nodes W_i^T + b1, V = nodes W_j^T) are products
accumulated in fp32 once per node, and the kernel multiplies only the pair rows (K = P) on tensor
cores, adds U and V in fp32, rounds pre once (as the single product's fp32 accumulator is
rounded: the same partners win the max), and writes act = silu(pre) beside it, which PyTorch's
SiLU would read and write again.
Used where the closed forms' fused kernels are (PAIRGEN_FUSED_BACKWARD)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ... import config, runtime
from ...module.modes import fp32_matmul
from ...precision import MMA_KINDS
from ..fused_kernels import FusedTemplate, sm_count, storage_kind

if TYPE_CHECKING:  # annotations only: the source renders without torch (pairgen-tune --status)
    import torch

SIGNATURES = {"": ("ptr pair", "ptr wp", "ptr u", "ptr v", "ptr pre", "ptr act", "i64 batches", "i64 length")}
TEMPLATE = FusedTemplate("readout", "first_layer", lambda context: SIGNATURES)
#: Threads a block: four warps along a tile's 128 rows by two along H (32 x 32 each).
THREADS = 256
#: A tile: TILE_I rows i by TILE_J partners j of one batch (TILE_ROWS pair rows, 32 a warp, four
#: warps along them), so that it reads 8 + 16 rows of U and V for its 128 pair rows; COLUMNS of H
#: a pass of the block's warps.
TILE_I, TILE_J, COLUMNS = 8, 16, 64
TILE_ROWS = TILE_I * TILE_J
#: Persistent blocks an SM (W_p and two row tiles in shared memory: 108 KB at P 64, H 512).
BLOCKS_PER_SM = 2
#: The kernel's pair and row indices are 32-bit in its staging.
MAX_ROWS = 2**31 - TILE_ROWS
_KSTEP = 16  # elements of a 16-bit k-step (mma.cuh.j2)


def smem_bytes(P: int, H: int) -> int:
    """All of W_p's H rows and two tiles of pair rows, each row P padded to a k-step, plus 16 bytes
    past a multiple of 128 (mma.cuh.j2's MmaRow)."""
    row = (-(-P // _KSTEP) * _KSTEP * 2 + 127) // 128 * 128 + 16
    return (H + 2 * TILE_ROWS) * row


def context(P: int, H: int, kind: str) -> dict:
    return {"p": P, "h": H, "threads": THREADS, "smem_bytes": smem_bytes(P, H), "blocks_per_sm": BLOCKS_PER_SM,
            "mma_kind": MMA_KINDS[kind]}


def render(kind: str, P: int, H: int):
    """The kernel's source for one 16-bit storage type and widths P, H."""
    return TEMPLATE.render(kind, **context(P, H, kind))


def applies(nodes: torch.Tensor, pair: torch.Tensor, H: int) -> bool:
    """Whether first_layer takes these: CUDA tensors that it fits."""
    return nodes.is_cuda and fits(nodes, pair, H)


def fits(nodes: torch.Tensor, pair: torch.Tensor, H: int) -> bool:
    """Whether the kernel takes these tensors on their device's GPU (the emulator's in the tests): the
    fused kernels on, one 16-bit dtype, pair rows of whole 16-byte pieces (P % 8 == 0) in a
    contiguous 16-byte aligned tensor, H a multiple of COLUMNS, fewer than MAX_ROWS pair rows and
    B N H < 2^31 (the kernel's row offsets), and a GPU that runs it (device_takes)."""
    import torch

    if not config.fused_backward() or nodes.dtype not in (torch.bfloat16, torch.float16):
        return False
    P = pair.shape[-1]
    if pair.dtype is not nodes.dtype or not pair.is_contiguous() or pair.data_ptr() % 16 or P % 8 or H % COLUMNS:
        return False
    return (pair.numel() // P < MAX_ROWS and nodes.numel() // nodes.shape[-1] * H < 2**31
            and device_takes(runtime.device_info(nodes.device.index or 0), P, H))


def device_takes(info: runtime.DeviceInfo, P: int, H: int) -> bool:
    """mma.sync (sm_80 on) and a block that may take W_p and two tiles of shared memory."""
    return info.capability >= (8, 0) and smem_bytes(P, H) <= info.limits.max_smem_per_block


def node_terms(node_rows: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor) -> tuple:
    """(U, V), each (B*N, H) fp32: U = node_rows W_i^T + b1, V = node_rows W_j^T, from the 16-bit
    node rows (B*N, D) and the first layer's 16-bit weight (H, 2 D + P) and bias, accumulated in
    fp32 as the single 16-bit product accumulates. On the GPU a 16-bit tensor-core product that
    writes fp32 (no fp32 copies of the rows and weights, no fp32 products); elsewhere (the CPU
    emulator's tests) fp32 products of the same values: the products of 16-bit values are exact in
    fp32 either way."""
    import torch

    D = node_rows.shape[-1]
    if node_rows.is_cuda:
        u = torch.mm(node_rows, w1[:, :D].t(), out_dtype=torch.float32).add_(b1)
        return u, torch.mm(node_rows, w1[:, D:2 * D].t(), out_dtype=torch.float32)
    rows32, w32 = node_rows.float(), w1.float()
    with fp32_matmul():
        return torch.addmm(b1.float(), rows32, w32[:, :D].t()), rows32 @ w32[:, D:2 * D].t()


def first_layer(nodes: torch.Tensor, pair: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor) -> tuple:
    """(pre, act), each (B, N, N, H) in the nodes' dtype, for nodes (B, N, D), pair (B, N, N, P) and
    the first layer's weight (H, 2 D + P) and bias (H) (applies must hold)."""
    import torch

    B, N, D = nodes.shape
    P, H = pair.shape[-1], w1.shape[0]
    w16 = w1.to(nodes.dtype)  # the weights as the single 16-bit product takes them
    u, v = node_terms(nodes.reshape(-1, D), w16, b1.to(nodes.dtype))
    wp = w16[:, 2 * D:].contiguous()
    pre = nodes.new_empty(B, N, N, H)
    act = torch.empty_like(pre)
    tiles = B * -(-N // TILE_I) * -(-N // TILE_J)
    blocks = max(1, min(tiles, sm_count(nodes.device.index) * BLOCKS_PER_SM))
    TEMPLATE.launch(nodes, "", blocks, pair.data_ptr(), wp.data_ptr(), u.data_ptr(), v.data_ptr(), pre.data_ptr(),
                    act.data_ptr(), B, N, smem=smem_bytes(P, H), **context(P, H, storage_kind(nodes.dtype)))
    return pre, act
