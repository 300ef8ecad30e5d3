"""The closed-form backwards' shared pieces (pairgen/ops/closed_form.py) on the CPU: the TF32 split
is exact and its head is TF32-representable; the products agree with float64 in every precision
(on a CPU no product rounds to TF32, so this checks the split's algebra; the GPU tests check the
TF32 tensor cores' accuracy through the modules' gradients)."""
from __future__ import annotations

import pytest
import torch

from pairgen.ops.closed_form import Products, split_tf32


def test_the_tf32_split_is_exact_and_its_head_fits_tf32():
    t = torch.randn(257, generator=torch.Generator().manual_seed(0)) * torch.logspace(-20, 20, 257)
    head, tail = split_tf32(t)
    assert torch.equal(head + tail, t), "exact: the tail is what the head leaves out"
    assert not (head.view(torch.int32) & 8191).any(), "the head's low 13 mantissa bits are clear"
    assert (tail.abs() <= t.abs() * 2.0 ** -10).all()
    transposed = torch.randn(5, 7).t()  # a strided view splits too
    assert torch.equal(sum(split_tf32(transposed)), transposed)


@pytest.mark.parametrize("precision", ["ieee", "tf32", "tf32x3"])
def test_products_agree_with_float64(precision):
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(33, 40, generator=gen), torch.randn(40, 17, generator=gen)
    batch_a, batch_b = torch.randn(3, 9, 11, generator=gen), torch.randn(3, 11, 5, generator=gen)
    weight, bias = torch.randn(17, 40, generator=gen), torch.randn(17, generator=gen)
    mm = Products(precision)
    checks = [(mm(a, b), a.double() @ b.double()),
              (mm.bmm(batch_a, batch_b), batch_a.double() @ batch_b.double()),
              (mm.linear(a, weight, bias), a.double() @ weight.double().t() + bias.double()),
              (mm.linear(a, weight, None), a.double() @ weight.double().t())]
    for got, expected in checks:
        assert ((got.double() - expected).norm() / expected.norm()).item() < 1e-6


def test_an_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="'ieee', 'tf32' or 'tf32x3'"):
        Products("bf16")
