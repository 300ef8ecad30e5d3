"""contiguous_aligned: the kernels' float4 and cp.async reads need 16-byte aligned rows."""
import torch

from pairgen.module.validation import contiguous_aligned


def test_a_view_that_starts_mid_vector_is_copied_to_an_aligned_buffer():
    flat = torch.randn(1 + 2 * 3 * 3 * 8)
    view = flat[1:].view(2, 3, 3, 8)  # contiguous, but 4 bytes past an aligned start
    assert view.is_contiguous() and view.data_ptr() % 16 == 4
    fixed = contiguous_aligned(view)
    assert fixed.data_ptr() % 16 == 0
    assert torch.equal(fixed, view)


def test_an_aligned_contiguous_tensor_is_not_copied():
    x = torch.randn(2, 3, 3, 8)
    assert contiguous_aligned(x).data_ptr() == x.data_ptr()


def test_a_non_contiguous_tensor_comes_back_contiguous_and_aligned():
    x = torch.randn(2, 3, 3, 8).transpose(1, 2)
    fixed = contiguous_aligned(x)
    assert fixed.is_contiguous() and fixed.data_ptr() % 16 == 0 and torch.equal(fixed, x)
