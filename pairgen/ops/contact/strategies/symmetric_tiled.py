"""symmetric_tiled: tiled over blocks (bi <= bj) of the pair grid, each pair computed once and
written twice, so the output is exactly symmetric (templates/contact/symmetric_tiled.cu.j2)."""
from __future__ import annotations

from ....spec import Kernel, Strategy, ceil_div, persistent_blocks
from ..common import run_single_kernel
from .tiled import TILED_ARGS, TILED_RESTRICTIONS, TILED_SPACE, tiled_context


def derive(params: dict, widths: dict, name: str):
    side = params["tile_side"]
    context, smem = tiled_context(params, widths, side * side)
    context["tile_side"] = side

    def grid(B, N, sms, resident, _side=side, _per_sm=params["blocks_per_sm"]):
        nb = ceil_div(N, _side)
        tiles = B * nb * (nb + 1) // 2
        return persistent_blocks(tiles, _per_sm, sms, resident), (B, N, tiles)

    return context, (Kernel(name, params["threads"], smem, TILED_ARGS, grid),)


SYMMETRIC_TILED = Strategy(
    name="symmetric_tiled",
    summary="tiled over blocks (bi <= bj) of the pair grid; each pair computed once, written twice",
    space={"tile_side": (4, 8, 16), **TILED_SPACE},
    derive=derive,
    restrictions=TILED_RESTRICTIONS,
    # Exact fp32 keeps tf32x3's and tf32's promises too: where it is faster (the smallest shapes),
    # they run it. Only this strategy (the fp32 winner at every tuned shape), to keep their searches small.
    precisions=("float32", "tf32x3", "tf32"),
    run=run_single_kernel,
    records=("float32", "tf32x3", "tf32"),
)
