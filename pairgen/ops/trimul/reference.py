"""The triangle multiplicative update's reference module with its options (docs/ops.md), and its
test inputs."""
from __future__ import annotations

import torch
from torch import nn

from ...testdata import random_tensor

DIRECTIONS = ("incoming", "outgoing")
GATE_INPUTS = ("input", "normalized")
#: Where the output gate acts: on the output, in pair width (the original listing), or on the
#: normalised triangle sums, in hidden width, before the output projection (the form of lucidrains'
#: triangle-multiplicative-module).
GATE_PLACEMENTS = ("output", "hidden")


class TriangleMultiplicationReference(nn.Module):
    """The definition with its options; the defaults are the original listing verbatim."""

    def __init__(self, pair_dim, hidden_dim, direction="incoming", gate_on="input", bias=True, *, gate_at="output"):
        super().__init__()
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if gate_on not in GATE_INPUTS:
            raise ValueError(f"gate_on must be one of {GATE_INPUTS}, got {gate_on!r}")
        if not isinstance(bias, bool):
            raise ValueError(f"bias must be True or False, got {bias!r}")
        if gate_at not in GATE_PLACEMENTS:
            raise ValueError(f"gate_at must be one of {GATE_PLACEMENTS}, got {gate_at!r}")
        self.direction, self.gate_on, self.gate_at = direction, gate_on, gate_at
        self.layer_norm_in = nn.LayerNorm(pair_dim)
        self.proj_a = nn.Linear(pair_dim, hidden_dim, bias=bias)
        self.gate_a = nn.Linear(pair_dim, hidden_dim, bias=bias)
        self.proj_b = nn.Linear(pair_dim, hidden_dim, bias=bias)
        self.gate_b = nn.Linear(pair_dim, hidden_dim, bias=bias)
        self.layer_norm_out = nn.LayerNorm(hidden_dim)
        self.out_proj = nn.Linear(hidden_dim, pair_dim, bias=bias)
        self.out_gate = nn.Linear(pair_dim, hidden_dim if gate_at == "hidden" else pair_dim, bias=bias)

    def forward(self, pair_repr, pair_mask):  # (B,N,N,P), (B,N,N) float 0/1 or bool
        x = self.layer_norm_in(pair_repr)
        mask = pair_mask.unsqueeze(-1).to(x.dtype)
        a = self.proj_a(x) * torch.sigmoid(self.gate_a(x)) * mask
        b = self.proj_b(x) * torch.sigmoid(self.gate_b(x)) * mask
        if self.direction == "incoming":
            out = torch.einsum("bkih,bkjh->bijh", a, b)  # sum over the FIRST index
        else:
            out = torch.einsum("bikh,bjkh->bijh", a, b)
        gate_input = x if self.gate_on == "normalized" else pair_repr  # default: the RAW input
        gate = torch.sigmoid(self.out_gate(gate_input))
        if self.gate_at == "hidden":
            return self.out_proj(self.layer_norm_out(out) * gate)
        return self.out_proj(self.layer_norm_out(out)) * gate


def random_mask(B: int, N: int, generator: torch.Generator, keep: float = 0.8) -> torch.Tensor:
    """A random, non-symmetric bool mask with one fully masked row and one fully masked (other)
    column per batch when N > 1: masked rows and columns zero whole triangle sums."""
    mask = torch.rand((B, N, N), generator=generator) < keep
    if N > 1:
        row = int(torch.randint(N, (1,), generator=generator))
        col = (row + 1 + int(torch.randint(N - 1, (1,), generator=generator))) % N
        mask[:, row, :] = False
        mask[:, :, col] = False
    return mask


def make_inputs(shape: dict, generator: torch.Generator, distribution: str = "normal") -> tuple:
    """(pair_repr, pair_mask) for a shape {B, N, P, ...}."""
    B, N, P = shape["B"], shape["N"], shape["P"]
    return random_tensor((B, N, N, P), generator, distribution), random_mask(B, N, generator)
