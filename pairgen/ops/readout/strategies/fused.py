"""fused: split in one cooperative launch (templates/readout/fused.cu.j2): the first blocks are the
node prologue's, the others split's pair blocks, which wait for them (common/block_roles.cuh); the
kernel runs twice (phase 1 the prologue's blocks, phase 2 the pair blocks) where its grid cannot be
resident at once. A second launch costs the host time per call, and the small shapes' repeated
calls are bound by host time."""
from __future__ import annotations

from ....spec import Kernel, Restriction, Strategy
from ..common import (EXACT_SERVES, PAIR_MAX_ARGS, PAIR_MAX_RESTRICTIONS, PROLOGUE_THREADS, fp32_pack,
                      launch_with_prologue_inside, pair_max_buffers, pair_max_context, pair_max_grid, prologue_blocks,
                      prologue_fits_beside)
from .split import SPLIT

#: The fused strategy's kernel: the pair-max pointers, the producers' counter (common/block_roles.cuh),
#: then B, N, row tiles and the phase (0: prologue and pair blocks; 1: prologue only; 2: pairs only).
FUSED_ARGS = (*PAIR_MAX_ARGS[:8], "ptr done", "i32 B", "i32 N", "i32 num_tiles", "i32 phase")


def _fused_grid(H: int, prologue_rows: int, tile_i: int, j_split: int):
    """The node prologue's blocks (as split's prologue kernel), then split's pair blocks."""
    pair_blocks = pair_max_grid(tile_i, j_split)

    def grid(B, N, sms, resident, _H=H, _rows=prologue_rows):
        blocks, tail = pair_blocks(B, N, sms, resident)
        return prologue_blocks(B * N, _H, _rows) + blocks, tail

    return grid


def derive(params: dict, w: dict, name: str):
    """split's node prologue and pair-max kernel in one launch."""
    context, smem = pair_max_context(params, w, split=True)
    context = {**context, "fused": True, "nodes_inline": True}
    grid = _fused_grid(w["H"], params["prologue_rows"], params["tile_i"], params["j_split"])
    return context, (Kernel(name, params["threads"], smem, FUSED_ARGS, grid, mode="cooperative_or_plain"),)


def run(module, variant, weights, nodes, pair_feats, edge_mask, out) -> None:
    """split's buffers and arguments, the prologue's blocks in the same launch (launch_with_prologue_inside)."""
    B, N, D = nodes.shape
    (main,) = variant.launches(nodes.get_device(), B, N)
    uv, partials, counters = pair_max_buffers(module, variant, main, B, N, D, with_uv=True)
    packed = fp32_pack(module, weights)  # alive until the launches are enqueued
    pointers = dict(nodes=nodes.data_ptr(), pair=pair_feats.data_ptr(), mask=edge_mask.data_ptr(),
                    wpack=packed.data_ptr(), uv=uv, scratch=partials, counters=counters,
                    out=out.data_ptr())
    launch_with_prologue_inside(module, main, pointers, "done", nodes.device)


FUSED = Strategy(
    name="fused",
    summary="split in one launch: the first blocks compute U and V as the prologue's blocks would, "
            "the others run split's per-pair work once they are done",
    # split's space, prologue_rows included.
    space=dict(SPLIT.space),
    derive=derive,
    restrictions=PAIR_MAX_RESTRICTIONS + (
        Restriction("the prologue's 128 threads must fit in the block", lambda p, _: p.threads >= PROLOGUE_THREADS),
        Restriction("the prologue's static shared arrays must fit beside the block's", prologue_fits_beside),),
    precisions=EXACT_SERVES,
    records=EXACT_SERVES,
    run=run,
)
