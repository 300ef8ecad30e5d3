"""The scene-graph pair readout's reference module (docs/ops.md) and its test inputs."""
from __future__ import annotations

import torch
from torch import nn

from ...testdata import random_tensor


class PairReadoutReference(nn.Module):
    """The definition, verbatim: a per-pair MLP over [h_i | h_j | p_ij], the max over partners j
    with a valid edge (a node with none pools to 0), LayerNorm, residual."""

    def __init__(self, node_dim, pair_dim, hidden_dim):
        super().__init__()
        self.fuse = nn.Sequential(
            nn.Linear(2 * node_dim + pair_dim, hidden_dim), nn.SiLU(),
            nn.Linear(hidden_dim, node_dim),
        )
        self.norm = nn.LayerNorm(node_dim)

    def forward(self, nodes, pair_feats, edge_mask):  # (B,N,D), (B,N,N,P), (B,N,N) bool
        B, N, D = nodes.shape
        hi = nodes.unsqueeze(2).expand(B, N, N, D)  # node i
        hj = nodes.unsqueeze(1).expand(B, N, N, D)  # node j
        m = self.fuse(torch.cat([hi, hj, pair_feats], dim=-1))
        m = m.masked_fill(~edge_mask.unsqueeze(-1), float("-inf"))
        pooled = m.amax(dim=2)  # max over j
        isolated = ~edge_mask.any(dim=2)  # a node with no valid edge pools to 0
        pooled = pooled.masked_fill(isolated.unsqueeze(-1), 0.0)
        return nodes + self.norm(pooled)  # (B,N,D)


def random_edge_mask(B: int, N: int, generator: torch.Generator, density: float = 0.5) -> torch.Tensor:
    """A bool (B, N, N) mask with, in every batch, a fully masked row (an isolated node) and,
    for N > 1, a row with exactly one valid edge; a fully masked column too when N > 2."""
    mask = torch.rand((B, N, N), generator=generator) < density
    mask[:, 0, :] = False  # node 0 is isolated
    if N > 1:
        mask[:, 1, :] = False
        mask[:, 1, N - 1] = True  # node 1 has a single valid edge, to the last node
    if N > 2:
        mask[:, :, N // 2] = False  # no node receives from node N//2
    return mask


def make_inputs(shape: dict, generator: torch.Generator, distribution: str = "normal") -> tuple:
    """(nodes, pair_feats, edge_mask) for a shape {B, N, D, P, ...}."""
    B, N, D, P = (shape[k] for k in ("B", "N", "D", "P"))
    nodes = random_tensor((B, N, D), generator, distribution)
    pair_feats = random_tensor((B, N, N, P), generator, distribution)
    return nodes, pair_feats, random_edge_mask(B, N, generator)
