"""Weight gradients of layers applied row by row, sum over r of A[r]^T B[r] for row-major 16-bit
A (M, KA) and B (M, KB), one or two at a time, on the GPU (templates/common/row_products.cu.j2).

With M the pairs of a pair representation (N*N rows) and KA, KB its channels, cuBLAS splits the
product's tall K into output tiles that each read their own stripes of the operands, so it reads
an operand once per output tile across it; this kernel reads each once, the two products of a
layer's output side in one launch (a little faster than cuBLAS's two: docs/performance.md,
session 26). Used where the closed forms' fused kernels are (PAIRGEN_FUSED_BACKWARD); the sums are
fp32, rounded once to the operands' dtype."""
from __future__ import annotations

import functools

from .. import config, runtime
from ..precision import MMA_KINDS
from .fused_kernels import THREADS, FusedTemplate, sm_count, storage_kind

SIGNATURES = {"": ("ptr a0", "ptr b0", "ptr a1", "ptr b1", "ptr parts", "i64 rows")}
TEMPLATE = FusedTemplate("common", "row_products", lambda context: SIGNATURES)
#: The widest KA and KB (a warp's accumulators: 16-row blocks of KA by all of KB, in registers).
MAX_WIDTH = 128
#: Tiles of 64 rows in flight through shared memory.
STAGES = 3
_TILE_ROWS = 64


@functools.lru_cache(maxsize=64)
def smem_bytes(products: tuple) -> int:
    """STAGES tiles of 64 rows of every operand, each row padded by 16 bytes (the template's)."""
    return STAGES * sum(_TILE_ROWS * (ka + kb + 16) * 2 for ka, kb in products)


@functools.lru_cache(maxsize=64)
def context(kind: str, products: tuple) -> dict:
    """The template's context (cached: every training step launches the kernel; not to be changed)."""
    return {"products": products, "stages": STAGES, "smem_bytes": smem_bytes(products), "mma_kind": MMA_KINDS[kind]}


def render(kind: str, products: tuple):
    """The kernel's source for one storage type and one or two (KA, KB) widths."""
    return TEMPLATE.render(kind, **context(kind, tuple(products)))


def applies(pairs: list) -> bool:
    """Whether the kernel takes these (A, B) pairs: one or two, every tensor a contiguous 2-D CUDA
    tensor of the first's 16-bit dtype with 16-byte aligned start and the same rows, widths
    multiples of 16 up to MAX_WIDTH, the fused kernels on, and a GPU that runs it
    (device_takes)."""
    import torch

    if not 1 <= len(pairs) <= THREADS // 128 or not config.fused_backward():
        return False
    first = pairs[0][0]
    if not first.is_cuda or first.dtype not in (torch.bfloat16, torch.float16):
        return False
    for t in (t for pair in pairs for t in pair):
        if t.dim() != 2 or t.dtype is not first.dtype or not t.is_contiguous() or t.data_ptr() % 16:
            return False
        if t.shape[0] != first.shape[0] or t.shape[1] % 16 or t.shape[1] > MAX_WIDTH or t.device != first.device:
            return False
    products = tuple((a.shape[1], b.shape[1]) for a, b in pairs)
    return device_takes(runtime.device_info(first.device.index or 0), products)


def device_takes(info: runtime.DeviceInfo, products: tuple) -> bool:
    """Whether a GPU runs the kernel for these (KA, KB) widths: mma.sync (sm_80 on), and blocks that
    may take the stages' shared memory (204 KB for two 128 x 128 products: Hopper's, not an
    A100's 163 KB)."""
    return info.capability >= (8, 0) and smem_bytes(products) <= info.limits.max_smem_per_block


def row_products(pairs: list) -> list:
    """[A^T B for each (A, B) in pairs] (KA, KB) in A's dtype, summed in fp32 (applies must hold)."""
    import torch

    a0 = pairs[0][0]
    rows = a0.shape[0]
    products = tuple((a.shape[1], b.shape[1]) for a, b in pairs)
    blocks = max(1, min(-(-rows // _TILE_ROWS), sm_count(a0.device.index)))
    parts = torch.empty(blocks, sum(ka * kb for ka, kb in products), device=a0.device, dtype=torch.float32)
    second = pairs[1] if len(pairs) > 1 else (a0, a0)
    TEMPLATE.launch(a0, "", blocks, a0.data_ptr(), pairs[0][1].data_ptr(), second[0].data_ptr(), second[1].data_ptr(),
                    parts.data_ptr(), rows, smem=smem_bytes(products), **context(storage_kind(a0.dtype), products))
    sums = parts.sum(0).to(a0.dtype).split([ka * kb for ka, kb in products])
    return [s.view(ka, kb) for s, (ka, kb) in zip(sums, products)]
