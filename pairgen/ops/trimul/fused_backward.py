"""The closed-form backward's fused elementwise passes on the GPU (templates/trimul/backward.cu.j2).

Each kernel replaces a chain of PyTorch passes over a pair-sized tensor: the gates' bias, sigmoid
and products with the mask (one pass instead of about eight), the gates' chain rule (one instead
of five), the output gate's (one instead of four), and the output LayerNorm and its backward read
and written in the layouts around them (instead of a transposing copy each way and PyTorch's
LayerNorm kernels). They are on by default; PAIRGEN_FUSED_BACKWARD=0 runs the PyTorch passes
instead (the GPU tests check both against the same standard).
"""
from __future__ import annotations

import functools

import torch

from ... import codegen, compiler, config, runtime

#: Storage types the kernels are rendered for.
KINDS = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
THREADS, ITEMS = 256, 4
#: Pairs per block of the LayerNorm kernels, and the shared memory they stay within (no opt-in).
LN_TILE = 16
LN_SMEM_LIMIT = 48 * 1024 - 2 * LN_TILE * 4
#: Blocks of the grid-stride output-gate kernel per SM.
OUT_GATE_BLOCKS_PER_SM = 8
#: Each kernel's argument kinds, in order, as the launches below pass them; render() checks them
#: against the source's `extern "C"` signatures.
SIGNATURES = {"gates": ("ptr",) * 5 + ("i32", "i64", "i32", "i32"),
              "gates_grad": ("ptr",) * 3 + ("i32", "i64", "i32", "i32"),
              "out_gate": ("ptr",) * 3 + ("i64",),
              "ln": ("ptr",) * 6 + ("i32", "i64", "i32"),
              "ln_grad": ("ptr",) * 8 + ("i32", "i64", "i32")}
#: The row LayerNorm kernels, rendered only for a width (`cols`, compiled in: the row is held in
#: registers): render(kind, eps, cols).
ROW_SIGNATURES = {"ln_rows": ("ptr",) * 6 + ("i64",),
                  "ln_rows_grad": ("ptr",) * 10 + ("i64",)}
#: Widest row the row kernels take (its values per lane are registers); wider rows keep PyTorch's.
MAX_ROW_COLS = 1024
#: Blocks per SM of the grid-stride row kernels.
ROW_BLOCKS_PER_SM = 4


def enabled(t: torch.Tensor) -> bool:
    """Whether the closed form uses these kernels for a tensor like t (CUDA, a known dtype, and
    PAIRGEN_FUSED_BACKWARD not 0)."""
    return t.is_cuda and t.dtype in KINDS and config.fused_backward()


def render(kind: str, eps: float = 1e-5, cols: int = 0) -> codegen.Rendered:
    """The kernels' source for one storage type and LayerNorm epsilon (and with `cols`, the row
    LayerNorm kernels for that width), its signatures checked against SIGNATURES (ROW_SIGNATURES)."""
    context = {"kind": kind, "threads": THREADS, "items": ITEMS, "ln_tile": LN_TILE, "eps": repr(float(eps)),
               "cols": cols}
    rendered = codegen.render_template("trimul", "backward", {}, {}, context, precision=kind)
    found = codegen.signatures(rendered.source)
    for suffix, kinds in _signatures(cols).items():
        name = f"{rendered.kernel_name}_{suffix}"
        if found.get(name) != kinds:
            raise codegen.ContractError(f"{rendered.template}: kernel {name} takes {found.get(name)} in the source "
                                        f"but the launch passes {kinds}")
    return rendered


def _signatures(cols: int) -> dict:
    return {**SIGNATURES, **ROW_SIGNATURES} if cols else SIGNATURES


@functools.lru_cache(maxsize=None)
def _kernels(kind: str, device_index: int, eps: float, cols: int) -> dict:
    from ...launch import LoadedKernel

    rendered = render(kind, eps, cols)
    compiled = compiler.compile_source(rendered.source, rendered.kernel_name, runtime.device_info(device_index).arch)
    return {suffix: LoadedKernel(compiled, device_index, 0, THREADS, f"{rendered.kernel_name}_{suffix}")
            for suffix in _signatures(cols)}


@functools.lru_cache(maxsize=256)  # bounded: a bound launch per grid, and every N has its own grid
def _bound(kind: str, device_index: int, eps: float, cols: int, suffix: str, blocks: int, smem: int, arg_count: int):
    return _kernels(kind, device_index, eps, cols)[suffix].bind(blocks, THREADS, smem, arg_count)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _launch(t: torch.Tensor, suffix: str, blocks: int, *args: int, smem: int = 0, eps: float = 1e-5,
            cols: int = 0) -> None:
    _bound(KINDS[t.dtype], t.device.index, eps, cols, suffix, blocks, smem, len(args))(*args)


def _plane_blocks(plane: int) -> int:
    return -(-plane // (THREADS * ITEMS))


def gates(proj: torch.Tensor, bias4: torch.Tensor | None, keep: torch.Tensor, apply: bool) -> tuple:
    """proj (B, 4, H, L) contiguous: with `apply`, bias added and the gates' sigmoid taken in
    place; returns a, b = value * sigmoid(gate) * keep as (B*H, L) each (keep: (B, L))."""
    B, _, H, L = proj.shape
    a = proj.new_empty(B * H, L)
    b = proj.new_empty(B * H, L)
    per_plane = _plane_blocks(L)
    _launch(proj, "gates", B * H * per_plane, proj.data_ptr(), 0 if bias4 is None else bias4.data_ptr(),
            keep.data_ptr(), a.data_ptr(), b.data_ptr(), H, L, per_plane, int(apply))
    return a, b


def gates_grad(da: torch.Tensor, proj: torch.Tensor, keep: torch.Tensor, slot: int) -> None:
    """da (B*H, L) the gradient of a (slot 0) or b (slot 2): proj's slot becomes the value's
    gradient and slot + 1 the gate's, in place."""
    B, _, H, L = proj.shape
    per_plane = _plane_blocks(L)
    _launch(proj, "gates_grad", B * H * per_plane, da.data_ptr(), proj.data_ptr(), keep.data_ptr(), H, L,
            per_plane, slot)


def out_gate(o: torch.Tensor, u: torch.Tensor, g: torch.Tensor) -> None:
    """o, u (the out gate's pre-activation), g contiguous, same shape: o becomes the gradient of
    u, u the gradient of o, in place."""
    blocks = min(_plane_blocks(o.numel()), _sm_count(o.device.index) * OUT_GATE_BLOCKS_PER_SM)
    _launch(o, "out_gate", blocks, o.data_ptr(), u.data_ptr(), g.data_ptr(), o.numel())


def _ln_smem(hidden: int, tiles: int) -> int:
    return tiles * hidden * (LN_TILE + 1) * 4


def layer_norm_fits(hidden: int) -> bool:
    """Whether the LayerNorm kernels' tiles (two of hidden x LN_TILE, fp32) fit in a block's
    default shared memory; wider hidden widths keep PyTorch's LayerNorm and transposing copies."""
    return _ln_smem(hidden, 2) <= LN_SMEM_LIMIT


def layer_norm_channels_first(z: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float) -> tuple:
    """LayerNorm over dim 1 of z (B, H, L) contiguous: (zn (B*L, H) one row per pair, mean and
    1/std (B*L,) in fp32)."""
    B, H, L = z.shape
    zn = z.new_empty(B * L, H)
    mean = torch.empty(B * L, device=z.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    tiles = -(-L // LN_TILE)
    _launch(z, "ln", B * tiles, z.data_ptr(), gamma.data_ptr(), beta.data_ptr(), zn.data_ptr(), mean.data_ptr(),
            rstd.data_ptr(), H, L, tiles, smem=_ln_smem(H, 1), eps=eps)
    return zn, mean, rstd


def layer_norm_channels_first_backward(d_zn: torch.Tensor, z: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                                       gamma: torch.Tensor, eps: float) -> tuple:
    """The backward of layer_norm_channels_first: (d z (B, H, L), d gamma (H,), d beta (H,)), the
    affine gradients in fp32 (each block's partial sums, added here)."""
    B, H, L = z.shape
    d_z = torch.empty_like(z)
    tiles = -(-L // LN_TILE)
    parts = torch.empty(2, B * tiles, H, device=z.device, dtype=torch.float32)
    _launch(z, "ln_grad", B * tiles, d_zn.data_ptr(), z.data_ptr(), mean.data_ptr(), rstd.data_ptr(),
            gamma.data_ptr(), d_z.data_ptr(), parts[0].data_ptr(), parts[1].data_ptr(), H, L, tiles,
            smem=_ln_smem(H, 2), eps=eps)
    return d_z, parts[0].sum(0), parts[1].sum(0)  # two tensors: gradients may not alias each other


def layer_norm_rows(rows: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float) -> tuple:
    """LayerNorm over the last dim of rows (M, C) contiguous, C <= MAX_ROW_COLS: (xn (M, C), mean
    and 1/std (M,) in fp32), as torch.native_layer_norm returns them."""
    M, C = rows.shape
    xn = torch.empty_like(rows)
    mean = torch.empty(M, device=rows.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    _launch(rows, "ln_rows", _row_blocks(rows, M), rows.data_ptr(), gamma.data_ptr(), beta.data_ptr(), xn.data_ptr(),
            mean.data_ptr(), rstd.data_ptr(), M, eps=eps, cols=C)
    return xn, mean, rstd


def layer_norm_rows_backward(d_xn: torch.Tensor, rows: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                             gamma: torch.Tensor, eps: float, add_before: torch.Tensor | None = None,
                             add_after: torch.Tensor | None = None) -> tuple:
    """The backward of layer_norm_rows: (d rows, d gamma, d beta, the affine gradients in fp32 from
    each warp's partial sums), d xn taken as d_xn + add_before and add_after added to d rows (both
    (M, C) contiguous, optional): the two places a second path's gradient joins."""
    M, C = rows.shape
    d_rows = torch.empty_like(rows)
    blocks = _row_blocks(rows, M)
    parts = torch.empty(2, blocks * (THREADS // 32), C, device=rows.device, dtype=torch.float32)
    _launch(rows, "ln_rows_grad", blocks, d_xn.data_ptr(), 0 if add_before is None else add_before.data_ptr(),
            rows.data_ptr(), mean.data_ptr(), rstd.data_ptr(), gamma.data_ptr(),
            0 if add_after is None else add_after.data_ptr(), d_rows.data_ptr(), parts[0].data_ptr(),
            parts[1].data_ptr(), M, eps=eps, cols=C)
    return d_rows, parts[0].sum(0), parts[1].sum(0)


def _row_blocks(t: torch.Tensor, rows: int) -> int:
    """A warp per row up to ROW_BLOCKS_PER_SM blocks per SM, then grid-stride."""
    return max(1, min(-(-rows // (THREADS // 32)), _sm_count(t.device.index) * ROW_BLOCKS_PER_SM))
