"""Test data: fresh random inputs and weights of the kinds the correctness standard asks for
(normal and heavy-tailed values, never zeros: zeros hide output a kernel forgot to write)."""
from __future__ import annotations

import torch
from torch import nn


def random_tensor(shape, generator: torch.Generator, distribution: str = "normal") -> torch.Tensor:
    """Normal, or heavy-tailed (a Cauchy clipped to +-50)."""
    if distribution == "normal":
        return torch.randn(shape, generator=generator)
    if distribution == "cauchy":
        u = torch.rand(shape, generator=generator)
        return torch.tan(torch.pi * (u - 0.5)).clamp(-50.0, 50.0)
    raise ValueError(f"unknown distribution {distribution!r}")


def randomize_parameters(module: nn.Module, generator: torch.Generator) -> None:
    """Random weights of the default init's scale; every LayerNorm's affine away from (1, 0)
    (its weight around 1), so a kernel that ignores the affine fails the check."""
    layer_norm_weights = {f"{name}.weight" if name else "weight"
                          for name, sub in module.named_modules() if isinstance(sub, nn.LayerNorm)}
    with torch.no_grad():
        for name, p in module.named_parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            scale = (1.0 / fan_in) ** 0.5 if p.dim() > 1 else 0.5
            p.copy_(torch.randn(p.shape, generator=generator) * scale + (1.0 if name in layer_norm_weights else 0.0))
