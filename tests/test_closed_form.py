"""The closed-form backwards' shared pieces (pairgen/ops/closed_form.py) on the CPU: the products
and the channel layouts agree with float64, an unknown precision is refused, and each gradient
comes back in its tensor's dtype (the GPU tests check the TF32 tensor cores' accuracy through the
modules' gradients)."""
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


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_each_gradient_comes_back_in_the_dtype_of_what_it_is_the_gradient_of(param_dtype):
    """forward_saving and gradients_from in bf16: the weights reach the op in bf16 (cast, or as
    they are where they are bf16 already), and every gradient returns in its parameter's dtype and
    the input's, whether the op made it in bf16 or (as the LayerNorms' affine sums) in fp32."""
    from pairgen.ops import closed_form

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, generator=gen)
    params = {"w": torch.randn(4, 4, generator=gen).to(param_dtype), "gamma": torch.randn(4, generator=gen).to(param_dtype)}
    seen = {}

    def forward(x_in, w, mm):
        seen.update(w)
        return x_in @ w["w"], {"x": x_in}

    def backward(state, w, g, mm):
        return {"input": g @ w["w"].t(), "w": state["x"].t() @ g,
                "gamma": g.float().sum(0)}  # fp32, as the row LayerNorm's affine sums are

    out, saved = closed_form.forward_saving(forward, x, params, "bfloat16")
    assert all(t.dtype is torch.bfloat16 for t in seen.values()) and out.dtype is torch.bfloat16
    if param_dtype is torch.bfloat16:
        assert all(seen[name] is params[name] for name in params), "nothing to cast: the weights as given"
    grads = closed_form.gradients_from(backward, saved, torch.ones(3, 4))
    assert grads["input"].dtype is torch.float32
    assert grads["w"].dtype is param_dtype and grads["gamma"].dtype is param_dtype
    expected = torch.ones(3, 4, dtype=torch.float64).sum(0)
    assert torch.allclose(grads["gamma"].double(), expected)
