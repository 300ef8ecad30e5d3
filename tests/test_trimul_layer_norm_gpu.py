"""GPU: the output LayerNorm's forward kernel (channels first in, one row per pair out; a thread per
column of the tile) against float64, in its 16-byte and its scalar form, at widths whose chunks and
planes do and do not fill the tile, with the statistics PyTorch keeps."""
from __future__ import annotations

import pytest
import torch

from pairgen.ops.trimul import fused_backward

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B, H, L, ln_tile", [(1, 128, 100 * 100, 64), (2, 40, 64 * 64, 32), (1, 384, 48 * 48, 16),
                                              (1, 24, 37 * 37, 64)])
def test_the_output_layer_norm_meets_float64(aligned, dtype, B, H, L, ln_tile):
    gen = torch.Generator(device="cuda").manual_seed(H + L)
    # not aligned: z starts one element into its storage, so the kernel takes its scalar form
    storage = (torch.randn(B * H * L + 1, device="cuda", generator=gen) * 3 + 1).to(dtype)
    z = (storage[:-1] if aligned else storage[1:]).view(B, H, L)
    gamma = torch.randn(H, device="cuda", generator=gen).to(dtype)
    beta = torch.randn(H, device="cuda", generator=gen).to(dtype)
    assert fused_backward._vectors(z, multiples_of=(L,)) == (aligned and L % (16 // z.element_size()) == 0)
    tuning = {**fused_backward.TUNING_DEFAULT, "ln_tile": ln_tile}
    zn, mean, rstd = fused_backward.layer_norm_channels_first(z, gamma, beta, 1e-5, tuning)
    rows = z.double().transpose(1, 2).reshape(B * L, H)
    expected = torch.nn.functional.layer_norm(rows, (H,), gamma.double(), beta.double(), 1e-5)
    tolerance = 1e-5 if dtype is torch.float32 else 1e-2
    assert ((zn.double() - expected).norm() / expected.norm()).item() < tolerance
    assert torch.allclose(mean.double(), rows.mean(1), rtol=1e-5, atol=1e-5)
    assert torch.allclose(rstd.double(), (rows.var(1, unbiased=False) + 1e-5).rsqrt(), rtol=1e-4)
