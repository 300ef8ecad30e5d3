"""direct: one kernel: per pair, the first Linear over [h_i | h_j | p_ij], the second Linear, and a
running max over j, per tile of rows i (templates/readout/direct.cu.j2: the pair-max kernel of
_pair_max.cuh.j2 with the node rows i and j staged beside the tile's pair features). One launch, no
node scratch: for small shapes, where a second launch costs more than the repeated node products."""
from __future__ import annotations

from ....spec import Kernel, Strategy
from ..common import (EXACT_SERVES, PAIR_MAX_ARGS, PAIR_MAX_RESTRICTIONS, PAIR_MAX_SPACE, pair_max_context,
                      pair_max_grid, run_pair_max)


def derive(params: dict, w: dict, name: str):
    context, smem = pair_max_context(params, w, split=False)
    grid = pair_max_grid(params["tile_i"], params["j_split"])
    return context, (Kernel(name, params["threads"], smem, PAIR_MAX_ARGS, grid),)


def run(module, variant, weights, nodes, pair_feats, edge_mask, out) -> None:
    run_pair_max(module, variant, weights, nodes, pair_feats, edge_mask, out, with_uv=False)


DIRECT = Strategy(
    name="direct",
    summary="per pair, the first Linear over [h_i | h_j | p_ij] as three register-tiled products; one launch",
    space=dict(PAIR_MAX_SPACE),
    derive=derive,
    restrictions=PAIR_MAX_RESTRICTIONS,
    precisions=EXACT_SERVES,
    records=EXACT_SERVES,
    run=run,
)
