"""The pair contact head's reference module (docs/ops.md) and its test inputs."""
from __future__ import annotations

import torch
from torch import nn

from ...testdata import random_tensor


class ContactHeadReference(nn.Module):
    """The definition, verbatim: LayerNorm per pair, symmetrised, a 3-layer MLP, sigmoid."""

    def __init__(self, pair_dim, hidden_dim):
        super().__init__()
        self.layer_norm = nn.LayerNorm(pair_dim)
        self.mlp = nn.Sequential(
            nn.Linear(pair_dim, hidden_dim), nn.ReLU(),
            nn.Linear(hidden_dim, hidden_dim), nn.ReLU(),
            nn.Linear(hidden_dim, 1),
        )

    def forward(self, pair_repr):  # (B,N,N,P)
        x = self.layer_norm(pair_repr)  # each (i,j) normalised on its own ...
        x = (x + x.permute(0, 2, 1, 3)) / 2.0  # ... then symmetrised
        return torch.sigmoid(self.mlp(x).squeeze(-1))  # (B,N,N) probabilities


def make_inputs(shape: dict, generator: torch.Generator, distribution: str = "normal") -> tuple:
    """(pair_repr,) for a shape {B, N, P, ...}."""
    return (random_tensor((shape["B"], shape["N"], shape["N"], shape["P"]), generator, distribution),)
