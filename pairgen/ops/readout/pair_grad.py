"""The readout's 16-bit backward on the GPU after act_grad (templates/readout/pair_grad.cu.j2): d_v,
each node's sum of d_pre over the nodes i that read it, with one of d_pre's products, from one read
of d_pre, where cuBLAS's product and PyTorch's sum over i read it once each (268 MB apiece at B16
N128 H512): the pair features' gradient d_pre W_p (pair_gradient), or the weight gradient of the
first layer's pair columns, the sum over rows of d_pre^T pair (weight_gradient: the pair features'
gradient not wanted). Used where the closed forms' fused kernels are (PAIRGEN_FUSED_BACKWARD)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ... import config, runtime
from ...precision import MMA_KINDS
from ..fused_kernels import FusedTemplate, sm_count, storage_kind

if TYPE_CHECKING:  # annotations only: the source renders without torch (pairgen-tune --status)
    import torch

SIGNATURES = {"": ("ptr d_pre", "ptr wpt", "ptr d_pair", "ptr d_v", "ptr d_v_parts", "i64 batches", "i64 length",
                   "i64 splits")}
#: The rendering with context wp: the weight gradient's kernel instead.
WP_SIGNATURES = {"wp": ("ptr d_pre", "ptr pair", "ptr wp_parts", "ptr d_v", "ptr d_v_parts", "i64 batches",
                        "i64 length", "i64 splits")}
TEMPLATE = FusedTemplate("readout", "pair_grad", lambda context: WP_SIGNATURES if context.get("wp") else SIGNATURES)
THREADS = 256
WARPS = THREADS // 32
#: Partners a block takes (one mma row block) and tiles of rows in its copy ring.
TILE_J, STAGES = 16, 4
#: The widest H and the most W_p a block takes: each warp keeps its slice of W_p (H / WARPS x P)
#: as mma fragments in registers (64 words a thread at the limit; weight_gradient: its slice of
#: d W_p in fp32, 128) beside its sums of d_pre's slice (H / 16 floats).
MAX_H, MAX_WP = 512, 32768
#: Whether 16-bit closed forms take this kernel (where applies); the tests run both ways.
PAIR_GRAD_KERNEL = True
_KSTEP = 16


def _mma_row(elements: int) -> int:
    """A staged 16-bit row's bytes, padded as mma.cuh.j2's MmaRow (16 past a multiple of 128)."""
    return (elements * 2 + 127) // 128 * 128 + 16


def smem_bytes(P: int, H: int, wp: bool = False) -> int:
    """The ring of row tiles of d_pre (with the pair rows beside them for the weight gradient), and
    for pair_gradient two buffers of the warps' partial products (fp32, rows of P + 8)."""
    if wp:
        return STAGES * TILE_J * (_mma_row(H) + _mma_row(P))
    return STAGES * TILE_J * _mma_row(H) + 2 * WARPS * TILE_J * (P + 8) * 4


def takes_widths(P: int, H: int, wp: bool = False) -> bool:
    """Widths the kernel takes: H in whole k-steps a warp up to MAX_H, P in whole n-tiles (two an
    ldmatrix for the weight gradient), and W_p within the fragments' registers."""
    return (0 < H <= MAX_H and H % (WARPS * _KSTEP) == 0 and P > 0 and P % (16 if wp else 8) == 0
            and H * P <= MAX_WP)


def context(P: int, H: int, kind: str, wp: bool = False) -> dict:
    return {"p": P, "h": H, "threads": THREADS, "stages": STAGES, "smem_bytes": smem_bytes(P, H, wp),
            "mma_kind": MMA_KINDS[kind], "wp": wp}


def render(kind: str, P: int, H: int, wp: bool = False):
    """The kernel's source for one 16-bit storage type and widths P, H (wp: the weight gradient's)."""
    return TEMPLATE.render(kind, **context(P, H, kind, wp))


def applies(d_pre: torch.Tensor, P: int, wp: bool = False) -> bool:
    """Whether pair_gradient (wp: weight_gradient) takes d_pre (B, N, N, H): a CUDA tensor that it
    fits."""
    return d_pre.is_cuda and fits(d_pre, P, wp)


def fits(d_pre: torch.Tensor, P: int, wp: bool = False) -> bool:
    """Whether the kernel takes d_pre on its device's GPU (the emulator's in the tests): on
    (PAIR_GRAD_KERNEL, the fused kernels), a contiguous 16-bit tensor with 16-byte aligned rows,
    widths it takes, and a GPU that runs it (device_takes)."""
    import torch

    H = d_pre.shape[-1]
    if not (PAIR_GRAD_KERNEL and config.fused_backward() and d_pre.dtype in (torch.bfloat16, torch.float16)):
        return False
    if not (d_pre.is_contiguous() and d_pre.data_ptr() % 16 == 0 and takes_widths(P, H, wp)):
        return False
    return device_takes(runtime.device_info(d_pre.device.index or 0), P, H, wp)


def device_takes(info: runtime.DeviceInfo, P: int, H: int, wp: bool = False) -> bool:
    """mma.sync (sm_80 on) and a block that may take the ring (and the partial products)."""
    return info.capability >= (8, 0) and smem_bytes(P, H, wp) <= info.limits.max_smem_per_block


def splits_for(batches: int, N: int, sms: int) -> int:
    """How many ranges of i the grid splits each tile of partners into: one where the tiles fill
    the GPU, else enough that the blocks do (at most N)."""
    return max(1, min(N, sms // (batches * -(-N // TILE_J))))


def pair_gradient(d_pre: torch.Tensor, wp: torch.Tensor) -> tuple:
    """(d_pair (B, N, N, P) = d_pre W_p, d_v (B, N, H) = d_pre summed over i), both in d_pre's
    dtype, rounded once from fp32 sums, for d_pre (B, N, N, H) and W_p (H, P) (the first layer's
    pair columns, its weight's [:, 2 D:]). applies(d_pre, P) must hold."""
    B, N, _, H = d_pre.shape
    P = wp.shape[-1]
    wpt = wp.to(d_pre.dtype).t().contiguous()
    d_pair = d_pre.new_empty(B, N, N, P)
    d_v = _launch(d_pre, P, False, _grid(d_pre), wpt.data_ptr(), d_pair.data_ptr())
    return d_pair, d_v


def weight_gradient(d_pre: torch.Tensor, pair: torch.Tensor) -> tuple:
    """(d W_p (H, P) = the sum over pair rows of d_pre^T pair, d_v (B, N, H) = d_pre summed over
    i), both in d_pre's dtype, rounded once from fp32 sums, for d_pre (B, N, N, H) and the pair
    features (B, N, N, P). applies(d_pre, P, wp=True) must hold."""
    import torch

    H = d_pre.shape[-1]
    P = pair.shape[-1]
    pair = pair.to(d_pre.dtype).contiguous()
    if pair.data_ptr() % 16:  # a view starting mid-row: its rows are copied 16 bytes at a time
        pair = pair.clone()
    grid = _grid(d_pre)
    parts = torch.empty(grid[1], H, P, dtype=torch.float32, device=d_pre.device)  # a block's sums each
    d_v = _launch(d_pre, P, True, grid, pair.data_ptr(), parts.data_ptr())
    return parts.sum(0).to(d_pre.dtype), d_v


def _grid(d_pre: torch.Tensor) -> tuple:
    """(splits, blocks) of a launch over d_pre (B, N, N, H): a block a tile of partners and range of i."""
    B, N = d_pre.shape[:2]
    splits = splits_for(B, N, sm_count(d_pre.device.index))
    return splits, B * -(-N // TILE_J) * splits


def _launch(d_pre: torch.Tensor, P: int, wp: bool, grid: tuple, operand: int, product: int) -> torch.Tensor:
    """One launch of either kernel over d_pre with its other operand and product (pointers); d_v,
    rounded in the kernel where a block has all of i, else from the ranges' fp32 sums added here."""
    import torch

    B, N, _, H = d_pre.shape
    splits, blocks = grid
    sums = d_pre.new_empty(B, N, H) if splits == 1 else torch.empty(splits, B, N, H, dtype=torch.float32,
                                                                       device=d_pre.device)
    TEMPLATE.launch(d_pre, "wp" if wp else "", blocks, d_pre.data_ptr(), operand, product, sums.data_ptr(),
                    sums.data_ptr(), B, N, splits, smem=smem_bytes(P, H, wp),
                    **context(P, H, storage_kind(d_pre.dtype), wp))
    return sums if splits == 1 else sums.sum(0).to(d_pre.dtype)
