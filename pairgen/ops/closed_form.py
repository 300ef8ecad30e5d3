"""Pieces the ops' closed-form backwards share (pairgen/ops/<op>/backward.py): each backward
recomputes its forward's intermediates from the input and weights (closed_form_gradients) or takes
them from a forward that kept them (forward_saving, gradients_from), then applies the chain rule."""
from __future__ import annotations

import contextlib

import torch

from ..module.modes import as_dtype, autocast_off, cublas_fp32_mode  # as_dtype: a training step makes about forty such casts
from ..precision import COMPUTE_DTYPES


def channel_sums(t: torch.Tensor) -> torch.Tensor:
    """t (B, C, L) channels first -> (C,): a bias's gradient (each channel's row summed)."""
    return t.sum((0, 2))


def column_sums(t: torch.Tensor) -> torch.Tensor:
    """t (M, C) -> (C,), summed over the rows as one matrix-vector product: it reads t once at
    about the memory's rate, where a reduction over the slow dim of a tall matrix does not."""
    return t.t().mv(t.new_ones(t.shape[0]))


class Products:
    """The matrix products of a closed-form backward, in their operands' dtype; fp32 ones in the
    cuBLAS mode closed_form_gradients sets: exact for "ieee", TF32 tensor cores for "tf32"."""

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a @ b (2-D, or a batch of rows by a matrix)."""
        return torch.matmul(a, b)

    def bmm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.bmm(a, b)

    def linear(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """rows @ weight^T (+ bias), as nn.Linear."""
        return rows @ weight.t() if bias is None else torch.addmm(bias, rows, weight.t())

    # Products between the two layouts of pair-sized tensors: channels first (B, C, L), one row
    # per channel (what batched products over the pair's N x N planes want), and channels last
    # (B, L, C), one row per pair. cuBLAS reads either operand transposed, so none of these copies.

    def channels_first(self, weight: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """weight (C, K) applied to rows (B, L, K) (any strides, unit in one of the last two):
        (B, C, L), contiguous, plus bias (C,) per channel."""
        B = rows.shape[0]
        weight = weight.expand(B, *weight.shape)
        if bias is None:
            return self.bmm(weight, rows.transpose(1, 2))
        return torch.baddbmm(bias.view(1, -1, 1).expand(B, -1, rows.shape[1]), weight, rows.transpose(1, 2))

    def channels_last(self, t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """t (B, C, L) channels first, times weight (C, K): (B, L, K), contiguous."""
        return self.bmm(t.transpose(1, 2), weight.expand(t.shape[0], *weight.shape))

    def summed_over_batch(self, t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """sum over b of t[b] (C, L) @ rows[b] (L, K): a weight's gradient, (C, K)."""
        if t.shape[0] == 1:
            return self(t[0], rows[0])
        return self.bmm(t, rows).sum(0)


#: What a closed form computes in, by the precision its module's backward_precision names:
#: COMPUTE_DTYPES (pairgen/precision.py) = {"ieee": float32, "tf32": float32, "bfloat16", "float16"}.


def closed_form_gradients(compute, x: torch.Tensor, params: dict[str, torch.Tensor], grad_out: torch.Tensor,
                          precision: str, *extra) -> dict[str, torch.Tensor]:
    """compute(x, params, grad_out, products, *extra) -> {"input": d x, name: d param}, run without
    autograd on x, params and grad_out cast to the precision's dtype (COMPUTE_DTYPES), each gradient
    returned in the dtype of what it is the gradient of. "ieee": exact fp32, whatever TF32 setting
    the caller has; "tf32": fp32 with TF32 products; "bfloat16"/"float16": 16-bit tensors, products
    on 16-bit tensor cores with fp32 accumulation, as PyTorch's own 16-bit backward computes."""
    with computing_in(precision) as (dtype, products):
        weights, param_dtypes = weights_in(params, dtype)
        grads = compute(as_dtype(x, dtype), weights, as_dtype(grad_out, dtype), products, *extra)
    return in_dtypes(grads, x.dtype, param_dtypes)


@contextlib.contextmanager
def computing_in(precision: str):
    """(the dtype tensors are cast to, the Products) for a closed form in `precision`, inside no
    autograd and the cuBLAS fp32 mode it asks for."""
    if precision not in COMPUTE_DTYPES:
        raise ValueError(f"precision must be one of {', '.join(map(repr, COMPUTE_DTYPES))}, got {precision!r}")
    # autocast off: the closed form chooses its dtypes itself (a forward computed under the
    # caller's autocast would otherwise have its LayerNorms lifted to fp32)
    with torch.no_grad(), autocast_off(), cublas_fp32_mode(precision == "tf32"):
        yield COMPUTE_DTYPES[precision], Products()


def in_dtypes(grads: dict[str, torch.Tensor], input_dtype: torch.dtype,
              param_dtypes: "dict[str, torch.dtype] | torch.dtype") -> dict[str, torch.Tensor]:
    """Each gradient in the dtype of what it is the gradient of (a frozen parameter has none);
    param_dtypes: each parameter's dtype by name, or one dtype, every parameter's (weights_in)."""
    grads["input"] = as_dtype(grads["input"], input_dtype)
    if isinstance(param_dtypes, torch.dtype):
        for name, grad in grads.items():
            if name != "input":
                grads[name] = as_dtype(grad, param_dtypes)
        return grads
    for name, dtype in param_dtypes.items():
        if name in grads:
            grads[name] = as_dtype(grads[name], dtype)
    return grads


def weights_in(params: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[dict, "dict | torch.dtype"]:
    """(params cast to dtype, by name; their dtypes by name, or dtype itself where every one is in
    it already): one pass, since a training call makes both, and the common case (a 16-bit module,
    or fp32 in "ieee") has no weight to cast."""
    if all(p.dtype is dtype for p in params.values()):
        return params, dtype
    return {name: as_dtype(p, dtype) for name, p in params.items()}, {name: p.dtype for name, p in params.items()}


class Saved:
    """What a saving forward keeps for its backward: the op's intermediates (`state`, consumed by
    the one backward), the weights in the compute dtype, and the dtypes the gradients go back to
    (param_dtypes: by name, or one dtype for all: weights_in)."""
    __slots__ = ("state", "weights", "precision", "input_dtype", "param_dtypes")

    def __init__(self, state, weights, precision, input_dtype, param_dtypes):
        self.state, self.weights, self.precision = state, weights, precision
        self.input_dtype, self.param_dtypes = input_dtype, param_dtypes


def forward_saving(forward, x: torch.Tensor, params: dict[str, torch.Tensor], precision: str) -> tuple:
    """forward(x, params, products) -> (out, state), run as closed_form_gradients runs a backward
    (the precision's dtype, no autograd): (out, a Saved for gradients_from)."""
    with computing_in(precision) as (dtype, products):
        weights, param_dtypes = weights_in(params, dtype)
        out, state = forward(as_dtype(x, dtype), weights, products)
    return out, Saved(state, weights, precision, x.dtype, param_dtypes)


def forward_only(forward, x: torch.Tensor, params: dict[str, torch.Tensor], precision: str,
                 cast_input: bool = True) -> torch.Tensor:
    """forward(x, params, products) -> out, run as forward_saving runs its forward, for a call no
    backward follows. cast_input=False: x goes to forward as it is (a forward whose first kernel
    reads it in its own dtype)."""
    with computing_in(precision) as (dtype, products):
        return forward(as_dtype(x, dtype) if cast_input else x, weights_in(params, dtype)[0], products)


def gradients_from(backward, saved: Saved, grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    """backward(state, params, grad_out, products) -> gradients as closed_form_gradients returns
    them, from a forward_saving() state, which it consumes (its tensors may become gradients in
    place): one backward per forward."""
    if saved.state is None:
        raise RuntimeError("this call's saved intermediates were consumed by an earlier backward (a second "
                           "backward through the same call, retain_graph=True, needs "
                           "module.recompute_for_backward = True)")
    state, saved.state = saved.state, None
    with computing_in(saved.precision) as (dtype, products):
        grads = backward(state, saved.weights, as_dtype(grad_out, dtype), products)
    return in_dtypes(grads, saved.input_dtype, saved.param_dtypes)
