"""The row LayerNorm kernels (pairgen/ops/layer_norm_rows.py), forward and backward, on the CPU
emulator against float64 of the same rounded inputs: at widths whose rows take a whole warp, half
of one and an eighth (two and four rows a warp), a width no chunk divides, rows that stop partway
through a warp's rows, tensors whose addresses allow only narrower loads, fp32 rows normalised into
16 bits, and both places a second gradient joins."""
from __future__ import annotations

import shutil

import pytest
import torch

from helpers import generator
from pairgen.ops import layer_norm_rows

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")
EPS = 1e-5
#: (kind, cols, x_kind): chunks of 8 (a row in 16 lanes: two a warp), a width of 25 chunks of 4 (a
#: row in 32 lanes, 7 idle), 6 chunks (8 lanes: four rows a warp), fp32 rows into bf16, fp32 rows
CASES = [("bfloat16", 128, None), ("float16", 100, None), ("bfloat16", 48, None), ("bfloat16", 96, "float32"),
         ("float32", 72, None)]
#: (the case, elements its rows start past an aligned address): aligned, and one element off (the
#: narrowest chunk) where a 16-bit and an fp32 row take it.
PLACED = [(*case, 0) for case in CASES] + [("bfloat16", 128, None, 1), ("float32", 72, None, 1)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def test_the_chunk_is_the_widest_the_row_and_every_address_allow():
    assert layer_norm_rows.chunk_values(128, [("bfloat16", 0)]) == 8
    assert layer_norm_rows.chunk_values(128, [("bfloat16", 0), ("float32", 256)]) == 4
    assert layer_norm_rows.chunk_values(100, [("float16", 0)]) == 4
    assert layer_norm_rows.chunk_values(128, [("bfloat16", 0), ("bfloat16", 2)]) == 1  # an odd element's address
    assert layer_norm_rows.chunk_values(128, [("bfloat16", 8)]) == 4
    assert layer_norm_rows.chunk_values(33, [("bfloat16", 0)]) == 1


def _rows(M: int, cols: int, dtype, gen, offset: int = 0) -> torch.Tensor:
    """(M, cols) rows with heavy tails, starting `offset` elements into their storage."""
    flat = torch.distributions.Cauchy(0.0, 1.0).sample((M * cols + offset,)).clamp(-1e3, 1e3)
    return flat.to(dtype)[offset:].view(M, cols)


@needs_gxx
@pytest.mark.parametrize("kind,cols,x_kind,offset", PLACED)
def test_the_forward_matches_float64_emulated(kind, cols, x_kind, offset):
    from emulator import emulated

    torch.manual_seed(7 + cols + offset)
    dtype, x_dtype = DTYPES[kind], DTYPES[x_kind or kind]
    gen = generator(cols)
    M = 37  # not a multiple of any rows-a-warp
    rows = _rows(M, cols, x_dtype, gen, offset)
    gamma, beta = torch.randn(cols).to(dtype), torch.randn(cols).to(dtype)
    gamma[3] = 0.0
    with emulated():
        xn, mean, rstd = layer_norm_rows.layer_norm(rows, gamma, beta, EPS)
    x64 = rows.double()
    expected = torch.nn.functional.layer_norm(x64, (cols,), gamma.double(), beta.double(), EPS)
    tolerance = 1e-5 if kind == "float32" else 1e-2
    assert ((xn.double() - expected).norm() / expected.norm()).item() <= tolerance
    assert torch.allclose(mean.double(), x64.mean(1), rtol=1e-5, atol=1e-4)
    assert torch.allclose(rstd.double(), 1 / (x64.var(1, unbiased=False) + EPS).sqrt(), rtol=1e-4)


@needs_gxx
@pytest.mark.parametrize("join", ["before", "after", None])
@pytest.mark.parametrize("kind,cols,offset", [(k, c, o) for k, c, x_kind, o in PLACED if x_kind is None])
def test_the_backward_matches_float64_emulated(kind, cols, offset, join):
    from emulator import emulated

    dtype = DTYPES[kind]
    gen = generator(100 + cols + offset)
    M = 37
    rows = _rows(M, cols, dtype, gen, offset)
    gamma = torch.randn(cols, generator=gen).to(dtype)
    gamma[5] = 0.0
    d_xn, more = (torch.randn(M, cols, generator=gen).to(dtype) for _ in range(2))
    x64 = rows.double().requires_grad_()
    g64, b64 = gamma.double().requires_grad_(), torch.zeros(cols, dtype=torch.float64, requires_grad=True)
    out = torch.nn.functional.layer_norm(x64, (cols,), g64, b64, EPS)
    out.backward(d_xn.double() + (more.double() if join == "before" else 0))
    expected = [x64.grad + (more.double() if join == "after" else 0), g64.grad, b64.grad]
    mean, rstd = x64.detach().mean(1).float(), (1 / (x64.detach().var(1, unbiased=False) + EPS).sqrt()).float()
    with emulated():
        ours = layer_norm_rows.layer_norm_backward(d_xn, rows, mean, rstd, gamma, EPS,
                                                   add_before=more if join == "before" else None,
                                                   add_after=more if join == "after" else None)
    tolerance = 2e-5 if kind == "float32" else 1e-2
    for name, got, want in zip(("d x", "d gamma", "d beta"), ours, expected):
        assert got.shape == want.shape and torch.isfinite(got).all(), name
        error = ((got.double() - want).norm() / want.norm()).item()
        assert error <= tolerance, f"{name}: {error}"
