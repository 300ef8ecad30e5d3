"""The real models' pairformer blocks, built small, for tests/test_real_models*.py: each package's
own block (Boltz PairformerLayer, OpenFold 3 PairBlock unfused and fused, Protenix PairformerBlock,
alphafold3-pytorch PairwiseBlock), a call as the package's trunk makes it, and what pairgen.patch
swaps in it. A package that is not installed skips its tests with the install line."""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

# Protenix builds a CUDA LayerNorm extension at import unless told to use torch's.
os.environ.setdefault("LAYERNORM_TYPE", "torch")

INSTALL = "pip install --no-deps -r tests/real-models.txt"
C_Z = 16


def need(module: str):
    """The module, or the test skipped with the install line."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.skip(f"{module} is not installed ({exc}); {INSTALL}")


@dataclass
class Block:
    """A block, a call of it on (pair z, token mask, pair mask) returning the pair output, how many triangle
    updates patch swaps in it, and whether its own triangle update runs in float64 and bf16 (Boltz's
    casts a and b to float32, so it runs in fp32 and under autocast only)."""
    module: torch.nn.Module
    call: Callable
    swapped: int = 2
    runs_in_every_dtype: bool = True
    #: The block in a dtype (its pair track; parts the pair output does not depend on may stay fp32).
    in_dtype: Callable = lambda module, dtype: module.to(dtype)

    def in_float64(self, module: torch.nn.Module) -> torch.nn.Module:
        return self.in_dtype(module, torch.float64)


def boltz_block(c_z: int = C_Z) -> Block:
    pairformer = need("boltz.model.layers.pairformer")
    block = pairformer.PairformerLayer(token_s=8, token_z=c_z, num_heads=2, dropout=0.0, pairwise_head_width=4, v2=True,
                                       pairwise_num_heads=2)

    def call(module, z, tokens, pair):
        s = torch.ones(*z.shape[:2], 8, device=z.device)  # the single track computes in fp32 (it casts)
        return module(s, z, tokens.to(z.dtype), pair.to(z.dtype))[1]

    def in_dtype(module, dtype):
        """The pair track in dtype; the single track (it casts to fp32, and the pair output does
        not depend on it) stays fp32."""
        module.to(dtype)
        for name in ("pre_norm_s", "attention", "transition_s", "s_post_norm"):
            getattr(module, name).float()
        return module
    return Block(block, call, runs_in_every_dtype=False, in_dtype=in_dtype)


def openfold3_block(fused: bool, c_z: int = C_Z) -> Block:
    blocks = need("openfold3.core.model.latent.base_blocks")
    block = blocks.PairBlock(c_z=c_z, c_hidden_mul=c_z, c_hidden_pair_att=4, no_heads_pair=2, transition_type="relu",
                             transition_n=2, pair_dropout=0.0, fuse_projection_weights=fused, inf=1e9)

    def call(module, z, tokens, pair):
        return module(z, pair.to(z.dtype))
    return Block(block, call)


def protenix_block(c_z: int = C_Z) -> Block:
    pairformer = need("protenix.model.modules.pairformer")
    block = pairformer.PairformerBlock(n_heads=2, c_z=c_z, c_s=0, c_hidden_mul=c_z, c_hidden_pair_att=4,
                                       no_heads_pair=2, dropout=0.0)

    def call(module, z, tokens, pair):
        # Protenix's config default is "cuequivariance"; unpatched without cuEquivariance, "torch"
        kernel = "cuequivariance" if stand_ins(module) else "torch"
        return module(None, z, pair.to(z.dtype), triangle_multiplicative=kernel)[1]
    return Block(block, call)


def af3_pytorch_block(c_z: int = C_Z) -> Block:
    af3 = need("alphafold3_pytorch.alphafold3")
    block = af3.PairwiseBlock(dim_pairwise=c_z, tri_attn_dim_head=4, tri_attn_heads=2, dropout_row_prob=0.0,
                              dropout_col_prob=0.0)
    return Block(block, lambda module, z, tokens, pair: module(z, mask=tokens))


#: name -> builder(c_z=C_Z)
BLOCKS = {"boltz": boltz_block, "openfold3": lambda c_z=C_Z: openfold3_block(False, c_z),
          "openfold3-fused": lambda c_z=C_Z: openfold3_block(True, c_z), "protenix": protenix_block,
          "alphafold3-pytorch": af3_pytorch_block}


def randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter random (the packages zero-initialise their output layers, which would hide
    an update that is wrong)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            scale = 0.3 if p.dim() == 1 else p.shape[-1] ** -0.5  # Linear outputs of unit size at any width
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if p.dim() == 1 else 0.0))
    return module


def inputs(B: int, N: int, seed: int, device="cpu", dtype=torch.float32, c_z: int = C_Z):
    """Pair features, a token mask (every token valid: the blocks' attention over a fully masked row
    depends on rounding, fp32 against float64), a pair mask with random holes (the diagonal kept),
    an upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(B, N, N, c_z, generator=gen)
    tokens = torch.ones(B, N, dtype=torch.bool)
    pair = (torch.rand(B, N, N, generator=gen) > 0.2) | torch.eye(N, dtype=torch.bool)
    grad = torch.randn(B, N, N, c_z, generator=gen)
    return z.to(device, dtype), tokens.to(device), pair.to(device), grad.to(device, dtype)


def stand_ins(model: torch.nn.Module) -> list:
    from pairgen.adapters import _Patched

    return [m for m in model.modules() if isinstance(m, _Patched)]
