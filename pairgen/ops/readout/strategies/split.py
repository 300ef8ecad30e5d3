"""split: the direct strategy's pair-max kernel after a node prologue (U = nodes W_i^T + b1,
V = nodes W_j^T, once per node), so a pair needs only U_i + V_j + W_p p_ij
(templates/readout/split.cu.j2; the prologue: _nodes.cuh.j2)."""
from __future__ import annotations

from ....spec import Kernel, Strategy
from ..common import (EXACT_SERVES, PAIR_MAX_ARGS, PAIR_MAX_RESTRICTIONS, PAIR_MAX_SPACE, nodes_kernel,
                      pair_max_context, pair_max_grid, run_pair_max)


def derive(params: dict, w: dict, name: str):
    """The pair-max kernel (declared first: the restrictions read its block) runs after the node
    prologue, as its programmatic dependent: it stages its weights while the prologue runs."""
    context, smem = pair_max_context(params, w, split=True)
    grid = pair_max_grid(params["tile_i"], params["j_split"])
    return context, (Kernel(name, params["threads"], smem, PAIR_MAX_ARGS, grid, mode="programmatic"),
                     nodes_kernel(name, w["H"], params["prologue_rows"]))


def run(module, variant, weights, nodes, pair_feats, edge_mask, out) -> None:
    run_pair_max(module, variant, weights, nodes, pair_feats, edge_mask, out, with_uv=True)


SPLIT = Strategy(
    name="split",
    summary="U = nodes W_i^T + b1, V = nodes W_j^T once per node (a prologue kernel); per pair only "
            "U_i + V_j + W_p p_ij",
    # prologue_rows: node rows per prologue block (of 128 columns, the k loop split across its 4
    # warps: _nodes.cuh.j2). 2 gives the seed (B*N = 96 rows, 2H = 384) 144 blocks, 8 gives it 36,
    # reading the weights from L2 a quarter as often (what matters at B*N = 2048).
    space={**PAIR_MAX_SPACE, "prologue_rows": (2, 8)},
    derive=derive,
    restrictions=PAIR_MAX_RESTRICTIONS,
    precisions=EXACT_SERVES,
    records=EXACT_SERVES,
    run=run,
)
