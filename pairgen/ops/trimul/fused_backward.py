"""The closed-form backward's fused elementwise passes on the GPU (templates/trimul/backward.cu.j2).

Each kernel replaces a chain of PyTorch passes over a pair-sized tensor: the gates' bias, sigmoid
and products with the mask (one pass instead of about eight), the gates' chain rule (one instead
of five), the output gate's (one instead of four), and the output LayerNorm and its backward read
and written in the layouts around them (instead of a transposing copy each way and PyTorch's
LayerNorm kernels). They are on by default; PAIRGEN_FUSED_BACKWARD=0 runs the PyTorch passes
instead (the GPU tests check both against the same standard).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ... import config
from ..fused_kernels import THREADS, FusedTemplate, sm_count, storage_kind

if TYPE_CHECKING:  # annotations only: torch is imported where it is used, so that these sources
    import torch  # render without it (pairgen-tune --status)

#: The launch shapes a tuned backward entry chooses (pairgen/ops/backward_tuning.py), and the
#: defaults where there is none: elements per thread of the elementwise kernels where they read
#: one value at a time ("items"), pairs per block of the output LayerNorm kernels ("ln_tile"),
#: blocks per SM of the grid-stride output-gate kernels ("out_gate_blocks": the backward's and the
#: forward's) and of the warp-per-row input LayerNorm's backward ("row_blocks"; its forward takes
#: layer_norm_rows.FORWARD_BLOCKS_PER_SM).
TUNING_SPACE = {"items": (2, 4, 8), "ln_tile": (16, 32, 64), "out_gate_blocks": (4, 8, 16), "row_blocks": (2, 4, 8)}
TUNING_DEFAULT = {"items": 4, "ln_tile": 64, "out_gate_blocks": 8, "row_blocks": 4}
#: The output LayerNorm kernels stay within a block's default shared memory (no opt-in).
SMEM_LIMIT = 48 * 1024
#: Each kernel's arguments ("kind name"), in order, as the launches below pass them; render() checks
#: them by name and kind against the source's `extern "C"` signatures.
SIGNATURES = {"gates": ("ptr proj", "ptr bias4", "ptr keep", "ptr a", "ptr b", "i32 hidden", "i64 plane",
                        "i32 blocks_per_plane", "i32 apply", "i32 vectors"),
              "gates_grad": ("ptr da", "ptr proj", "ptr keep", "i32 hidden", "i64 plane", "i32 blocks_per_plane",
                             "i32 slot_index", "i32 vectors"),
              "out_gate": ("ptr o", "ptr u", "ptr g", "i64 count", "i32 vectors"),
              "gated": ("ptr o", "ptr u", "ptr out", "i64 count", "i32 vectors"),
              "ln": ("ptr z", "ptr gamma", "ptr beta", "ptr zn", "ptr mean", "ptr rstd", "i32 hidden", "i64 plane",
                     "i32 tiles_per_batch", "i32 vectors"),
              "ln_grad": ("ptr d_zn", "ptr z", "ptr mean", "ptr rstd", "ptr gamma", "ptr d_z", "ptr gamma_parts",
                          "ptr beta_parts", "i32 hidden", "i64 plane", "i32 tiles_per_batch", "i32 vectors")}
TEMPLATE = FusedTemplate("trimul", "backward", lambda context: SIGNATURES)


def enabled(t: torch.Tensor) -> bool:
    """Whether the closed form uses these kernels for a tensor like t (CUDA, a known dtype, and
    PAIRGEN_FUSED_BACKWARD not 0)."""
    return t.is_cuda and storage_kind(t.dtype) is not None and config.fused_backward()


def render(kind: str, eps: float = 1e-5, tuning: dict = TUNING_DEFAULT, out_fp32: bool = False):
    """The kernels' source for one storage type, LayerNorm epsilon and tuning (out_fp32: the output
    gate writing fp32), its signatures checked against SIGNATURES."""
    return TEMPLATE.render(kind, **_context(eps, tuning, out_fp32))


def tuning_sources(kind: str, tuning: dict, widths: dict) -> list:
    """The rendered sources a tuning's kernels run at these widths (the default LayerNorm
    epsilon): what a tuned backward entry records the hash of, so that it goes stale when they
    change."""
    from .. import layer_norm_rows

    return [render(kind, tuning=tuning), layer_norm_rows.render(kind, widths["P"])]


def _context(eps: float, tuning: dict, out_fp32: bool = False) -> dict:
    """out_fp32: the output gate (`gated`) writes fp32 from 16-bit storage (another rendering)."""
    return {"items": tuning["items"], "ln_tile": tuning["ln_tile"], "eps": repr(float(eps)), "out_fp32": out_fp32}


def _launch(t: torch.Tensor, tuning: dict, suffix: str, blocks: int, *args: int, smem: int = 0,
            eps: float = 1e-5, out_fp32: bool = False) -> None:
    TEMPLATE.launch(t, suffix, blocks, *args, smem=smem, **_context(eps, tuning, out_fp32))


def _vectors(*tensors: torch.Tensor, multiples_of: tuple = ()) -> bool:
    """Whether the kernels move 16 bytes a load for these tensors (one storage type): every one
    16-byte aligned, and each length of `multiples_of` (a plane, a hidden width: what the accesses
    step along) a multiple of the values in 16 bytes."""
    per_access = 16 // tensors[0].element_size()
    return (all(t.data_ptr() % 16 == 0 for t in tensors)
            and all(length % per_access == 0 for length in multiples_of))


def _plane_blocks(plane: int, tuning: dict, vectors: bool, element_bytes: int) -> int:
    """Blocks per (batch, channel) plane: a thread takes `items` positions, or one 16-byte access."""
    return -(-plane // (THREADS * (16 // element_bytes if vectors else tuning["items"])))


def gates(proj: torch.Tensor, bias4: torch.Tensor | None, keep: torch.Tensor, apply: bool,
          tuning: dict = TUNING_DEFAULT, store: bool = True) -> tuple:
    """proj (B, 4, H, L) contiguous: with `apply`, bias added and the gates' sigmoid taken, in
    place unless `store` is False (a forward that keeps nothing: proj is left as it was); returns
    a, b = value * sigmoid(gate) * keep as (B*H, L) each (keep: (B, L))."""
    B, _, H, L = proj.shape
    a = proj.new_empty(B * H, L)
    b = proj.new_empty(B * H, L)
    vectors = _vectors(proj, keep, a, b, multiples_of=(L,))
    per_plane = _plane_blocks(L, tuning, vectors, proj.element_size())
    mode = (1 if store else 2) if apply else 0
    _launch(proj, tuning, "gates", B * H * per_plane, proj.data_ptr(), 0 if bias4 is None else bias4.data_ptr(),
            keep.data_ptr(), a.data_ptr(), b.data_ptr(), H, L, per_plane, mode, int(vectors))
    return a, b


def gates_grad(da: torch.Tensor, proj: torch.Tensor, keep: torch.Tensor, slot: int,
               tuning: dict = TUNING_DEFAULT) -> None:
    """da (B*H, L) the gradient of a (slot 0) or b (slot 2): proj's slot becomes the value's
    gradient and slot + 1 the gate's, in place."""
    B, _, H, L = proj.shape
    vectors = _vectors(da, proj, keep, multiples_of=(L,))
    per_plane = _plane_blocks(L, tuning, vectors, proj.element_size())
    _launch(proj, tuning, "gates_grad", B * H * per_plane, da.data_ptr(), proj.data_ptr(), keep.data_ptr(), H, L,
            per_plane, slot, int(vectors))


def out_gate(o: torch.Tensor, u: torch.Tensor, g: torch.Tensor, tuning: dict = TUNING_DEFAULT) -> None:
    """o, u (the out gate's pre-activation), g contiguous, same shape: o becomes the gradient of
    u, u the gradient of o, in place."""
    vectors = _vectors(o, u, g)
    _launch(o, tuning, "out_gate", _grid_stride_blocks(o, tuning, vectors), o.data_ptr(), u.data_ptr(), g.data_ptr(),
            o.numel(), int(vectors))


def _grid_stride_blocks(o: torch.Tensor, tuning: dict, vectors: bool) -> int:
    """The output-gate kernels' grid over o's elements: a block per THREADS accesses (of one
    value, or of 16 bytes), at most out_gate_blocks per SM (past that the threads loop)."""
    accesses = -(-o.numel() // (16 // o.element_size() if vectors else 1))
    return max(1, min(-(-accesses // THREADS), sm_count(o.device.index) * tuning["out_gate_blocks"]))


def gated(o: torch.Tensor, u: torch.Tensor, out: torch.Tensor, tuning: dict = TUNING_DEFAULT) -> torch.Tensor:
    """out = o * sigmoid(u) (o, u, out contiguous, one shape; out may be o), in one pass: the
    forward's output gate. out in o's dtype, or fp32 for 16-bit o and u (a caller that wants an
    fp32 output: the values as computed, no rounding to 16 bits). Returns out."""
    out_fp32 = out.dtype != o.dtype
    if out_fp32 and not (out.element_size() == 4 and o.element_size() == 2):
        raise ValueError(f"the output gate writes o's dtype or fp32 from 16 bits, not {o.dtype} -> {out.dtype}")
    vectors = _vectors(o, u, out)
    _launch(o, tuning, "gated", _grid_stride_blocks(o, tuning, vectors), o.data_ptr(), u.data_ptr(), out.data_ptr(),
            o.numel(), int(vectors), out_fp32=out_fp32)
    return out


def _ln_smem(hidden: int, tiles: int, ln_tile: int, element_bytes: int) -> int:
    """The dynamic shared memory of the LayerNorm kernels: `tiles` tiles of hidden rows of ln_tile
    values in the storage type, each row padded to an odd number of 4-byte words."""
    return tiles * hidden * (ln_tile + 4 // element_bytes) * element_bytes


def ln_tile(hidden: int, element_bytes: int, tuning: dict = TUNING_DEFAULT, backward: bool = True) -> int | None:
    """The pairs per block of the output LayerNorm kernel at this hidden width and storage type:
    the tuning's ln_tile, halved until its tiles (one for the forward, two for the backward) and
    their statistics fit a block's default shared memory, down to 8; None where even 8 does not
    (wider hidden widths keep PyTorch's LayerNorm and transposing copies). The forward also holds
    its statistics' partial sums (THREADS * pairs per 4-byte word floats)."""
    tile = tuning["ln_tile"]
    partial_sums = 0 if backward else THREADS * (4 // element_bytes) * 4
    while tile >= 8:
        if _ln_smem(hidden, 2 if backward else 1, tile, element_bytes) <= SMEM_LIMIT - 2 * tile * 4 - partial_sums:
            return tile
        tile //= 2
    return None


def layer_norm_fits(hidden: int, element_bytes: int, tuning: dict = TUNING_DEFAULT, backward: bool = True) -> bool:
    """Whether the LayerNorm kernel (the forward's, or the backward's) runs at this hidden width."""
    return ln_tile(hidden, element_bytes, tuning, backward) is not None


def layer_norm_channels_first(z: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float,
                              tuning: dict = TUNING_DEFAULT) -> tuple:
    """LayerNorm over dim 1 of z (B, H, L) contiguous: (zn (B*L, H) one row per pair, mean and
    1/std (B*L,) in fp32)."""
    import torch

    B, H, L = z.shape
    zn = z.new_empty(B * L, H)
    mean = torch.empty(B * L, device=z.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    tile = ln_tile(H, z.element_size(), tuning, backward=False)
    tiles = -(-L // tile)
    vectors = _vectors(z, zn, multiples_of=(L, H))
    _launch(z, {**tuning, "ln_tile": tile}, "ln", B * tiles, z.data_ptr(), gamma.data_ptr(), beta.data_ptr(),
            zn.data_ptr(), mean.data_ptr(), rstd.data_ptr(), H, L, tiles, int(vectors),
            smem=_ln_smem(H, 1, tile, z.element_size()), eps=eps)
    return zn, mean, rstd


def layer_norm_channels_first_backward(d_zn: torch.Tensor, z: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                                       gamma: torch.Tensor, eps: float, tuning: dict = TUNING_DEFAULT) -> tuple:
    """The backward of layer_norm_channels_first: (d z (B, H, L), d gamma (H,), d beta (H,)), the
    affine gradients in fp32 (each block's partial sums, added here)."""
    import torch

    B, H, L = z.shape
    d_z = torch.empty_like(z)
    tile = ln_tile(H, z.element_size(), tuning)
    tiles = -(-L // tile)
    parts = torch.empty(2, B * tiles, H, device=z.device, dtype=torch.float32)
    vectors = _vectors(d_zn, z, d_z, multiples_of=(L, H))
    _launch(z, {**tuning, "ln_tile": tile}, "ln_grad", B * tiles, d_zn.data_ptr(), z.data_ptr(), mean.data_ptr(),
            rstd.data_ptr(), gamma.data_ptr(), d_z.data_ptr(), parts[0].data_ptr(), parts[1].data_ptr(), H, L, tiles,
            int(vectors), smem=_ln_smem(H, 2, tile, z.element_size()), eps=eps)
    return (d_z, *parts.sum(1))  # d gamma and d beta: views of one reduction

