"""The closed-form backwards' shared pieces (pairgen/ops/closed_form.py) on the CPU: the products
and the channel layouts agree with float64, and an unknown precision is refused (the GPU tests
check the TF32 tensor cores' accuracy through the modules' gradients)."""
from __future__ import annotations

import pytest
import torch

from pairgen.ops.closed_form import Products, column_sums, closed_form_gradients


def _rel(got, expected):
    return ((got.double() - expected).norm() / expected.norm()).item()


def test_products_and_layouts_agree_with_float64():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(33, 40, generator=gen), torch.randn(40, 17, generator=gen)
    weight, bias = torch.randn(17, 40, generator=gen), torch.randn(17, generator=gen)
    rows = torch.randn(3, 11, 40, generator=gen)  # (B, L, K) channels last
    first = torch.randn(3, 17, 11, generator=gen)  # (B, C, L) channels first
    mm = Products()
    w64, r64, f64 = weight.double(), rows.double(), first.double()
    checks = [(mm(a, b), a.double() @ b.double()),
              (mm.linear(a, weight, bias), a.double() @ w64.t() + bias.double()),
              (mm.channels_first(weight, rows, bias), w64 @ r64.transpose(1, 2) + bias.double().view(1, -1, 1)),
              (mm.channels_first(weight, rows.transpose(1, 2).contiguous().transpose(1, 2)), w64 @ r64.transpose(1, 2)),
              (mm.channels_last(first, b.t()), f64.transpose(1, 2) @ b.t().double()),
              (mm.summed_over_batch(first, rows), (f64 @ r64).sum(0)),
              (mm.summed_over_batch(first[:1], rows[:1]), f64[0] @ r64[0]),
              (column_sums(a), a.double().sum(0))]
    for k, (got, expected) in enumerate(checks):
        assert got.shape == expected.shape and _rel(got, expected) < 1e-6, f"check {k}"
    assert mm.channels_first(weight, rows).is_contiguous() and mm.channels_last(first, b.t()).is_contiguous()


def test_an_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision must be one of"):
        closed_form_gradients(lambda *args: {}, torch.zeros(1), {}, torch.zeros(1), "tf32x3")


def test_gradients_an_operator_returns_have_distinct_storages():
    """distinct_storages: views of one tensor and a gradient in an input's storage are copied
    (the values kept); distinct tensors and None pass as they are."""
    from pairgen.module.autograd import distinct_storages

    stacked = torch.arange(8.0).view(2, 4)
    grad_out = torch.ones(3)
    alone = torch.zeros(5)
    out = distinct_storages([stacked[0], stacked[1], None, alone, grad_out[:2]], (grad_out,))
    assert out[0] is not None and out[0].data_ptr() == stacked[0].data_ptr(), "the first view is kept as it is"
    assert out[1].untyped_storage().data_ptr() != stacked.untyped_storage().data_ptr()
    assert torch.equal(out[1], stacked[1]) and out[2] is None and out[3] is alone
    assert out[4].untyped_storage().data_ptr() != grad_out.untyped_storage().data_ptr() and torch.equal(out[4], grad_out[:2])
