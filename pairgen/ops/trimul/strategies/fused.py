"""fused: one cooperative kernel, projection, grid-wide barrier, triangle sums + output
(templates/trimul/fused.cu.j2). For small N, where three launches and a cuBLAS call cost more than
the work. Its triangle sums read a and b from global memory per (pair, channel) (tri_smem=False),
or stage them in shared memory per row tile (tri_smem=True; templates/trimul/_triangle.cuh.j2)."""
from __future__ import annotations

from ....spec import DeviceLimits, Kernel, Plan, Restriction, Strategy, ceil_div, cuda_bool, padded_stride
from ..common import FMA_RESTRICTIONS, fma_context, triangle_staging

#: torch and what needs it, bound by _import_torch_half() on the first call a strategy runs, so that
#: the spec half (space, restrictions, plans) loads without torch and a call pays no import.
torch = fastcall = None


def _import_torch_half() -> None:
    global torch, fastcall
    import torch
    from .... import fastcall


#: The fused kernel: x, mask, weights, a, b, the barrier's ints, out, then B, N, work, mask is float.
FUSED_ARGS = ("ptr x", "ptr mask", "ptr w", "ptr ar", "ptr br", "ptr barrier", "ptr out", "i32 B", "i32 N", "i32 work",
              "i32 mask_is_float")


def _fused_grid(p_tile: int, o_tile: int, blocks_per_sm: int, row_tiles: bool = False):
    """Persistent and co-resident (the grid barrier needs every block running): at most
    min(blocks_per_sm, resident) per SM, and no more than the larger phase has tiles.
    work = the output phase's tile count: o_tile consecutive pairs of the flattened B*N*N, or with
    row_tiles (staged triangle sums) up to o_tile pairs of one row (b, i), ceil(N / o_tile) per row."""

    def grid(B, N, sms, resident, _p=p_tile, _o=o_tile, _per_sm=blocks_per_sm, _rows=row_tiles):
        pairs = B * N * N
        out_tiles = B * N * ceil_div(N, _o) if _rows else ceil_div(pairs, _o)
        tiles = max(ceil_div(pairs, _p), out_tiles)
        return max(1, min(tiles, min(_per_sm, max(1, resident)) * sms)), (B, N, out_tiles)

    return grid


def derive(params: dict, w: dict, name: str):
    context, project_smem, output_smem = fma_context(params, w)
    threads, staged = params["threads"], params["tri_smem"]
    tri = triangle_staging(params["o_tile"], w["H"], bool(w["outgoing"]))
    context.update(threads=threads, output_threads=threads, output_smem=0, tri_smem=cuda_bool(staged),
                   **{f"tri_{k}": v for k, v in tri.items()})
    # One buffer, reused by every phase; staged sums hold the tile's z rows and two stages in it.
    triangle_smem = 4 * (params["o_tile"] * padded_stride(w["H"]) + 2 * tri["stage_floats"]) if staged else 0
    smem = max(project_smem, output_smem, triangle_smem)
    grid = _fused_grid(params["p_tile"], params["o_tile"], params["blocks_per_sm"], row_tiles=staged)
    return context, (Kernel(name, threads, smem, FUSED_ARGS, grid, mode="cooperative"),)


def _persistent_blocks_fit(plan: Plan, limits: DeviceLimits) -> bool:
    blocks = plan.params["blocks_per_sm"]
    return blocks * plan.smem_bytes <= limits.smem_per_sm and blocks * plan.threads <= limits.max_threads_per_sm


def run(module, variant, weights, x, mask, out) -> None:
    """One cooperative kernel; its grid barrier's two ints are held by the module."""
    if torch is None:
        _import_torch_half()
    B, N = x.shape[0], x.shape[1]
    (fused,) = variant.launches(x.get_device(), B, N)
    ab = torch.empty((2, B * module.widths["H"] * N * N), device=x.device, dtype=torch.float32)
    fastcall.note_scratch(ab)
    packed = module._packed(module.fp32_layout(weights.sources), weights)  # alive until the launch is enqueued
    fused.named(x=x.data_ptr(), mask=mask.data_ptr(), w=packed.data_ptr(), ar=ab[0].data_ptr(),
                br=ab[1].data_ptr(), barrier=module._barrier_ints(x.device), out=out.data_ptr(),
                mask_is_float=int(mask.dtype is torch.float32))


FUSED = Strategy(
    name="fused",
    summary="one cooperative kernel: projection, grid barrier, triangle sums + output (small N)",
    # tri_smem: the output phase's triangle sums from global memory per (pair, channel) (False), or
    # staged in shared memory per row tile (True; stages sized by triangle_staging).
    space={"p_tile": (32, 64), "p_tm": (2, 4), "p_tn": (4, 8), "o_tile": (16, 32, 64), "o_tm": (1, 2, 4),
           "threads": (128, 256), "unroll": (2, 4), "blocks_per_sm": (1, 2), "tri_smem": (False, True)},
    derive=derive,
    restrictions=FMA_RESTRICTIONS + (Restriction("persistent blocks must be co-resident on an SM", _persistent_blocks_fit),),
    precisions=("float32", "tf32x3", "tf32"),
    records=("float32", "tf32x3", "tf32"),
    run=run,
)
