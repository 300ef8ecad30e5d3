"""The input side's backward kernel (pairgen/ops/trimul/input_backward.py): d xn = d_proj^T W4 and the
input LayerNorm's backward in one kernel (off by default: not faster yet), on the CPU emulator
against float64 of the same rounded inputs, at planes that end mid-tile, more tiles than the
emulator's blocks, both places the gate's gradient joins, zero gammas, and both 16-bit dtypes; its
renderings compile without spills; and a 16-bit training step through it meets the gradient
standard."""
from __future__ import annotations

import shutil
from unittest import mock

import pytest
import torch

from helpers import assert_16_bit_gradients_meet_the_standard, assert_emulated_16_bit_step_meets_the_standard, generator
from pairgen import compiler
from pairgen.ops import layer_norm_rows
from pairgen.ops.trimul import TRIMUL, input_backward

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")
MODELS_FORM = {"P": 128, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 0}


@pytest.mark.parametrize("kind,P,H,join_before", [("bfloat16", 128, 128, True), ("float16", 128, 64, False),
                                                  ("bfloat16", 64, 32, True)])
def test_the_kernel_renders_to_its_signature_and_compiles_without_spills(kind, P, H, join_before):
    rendered = input_backward.render(kind, P, H, join_before)
    name = input_backward.TEMPLATE.kernel_name("")
    compiled = compiler.compile_source(rendered.source, name, "sm_90")
    assert compiled.kernels[name]["spill_bytes"] == 0, compiled.summary()


def test_it_is_off_by_default_and_applies_only_where_its_tiles_and_registers_fit(monkeypatch):
    rows = torch.zeros(16, 128, dtype=torch.bfloat16)
    tensors = [rows] * 5  # d_proj, W4, the rows, the joined gradient, gamma (one dtype; 16 rows)
    stats = [torch.zeros(16)] * 2

    def applies(P=128, H=128, plane=576, tensors=tensors, stats=stats):
        return input_backward.applies(P, H, plane, tensors, stats)

    with mock.patch.object(input_backward.runtime, "device_info", lambda i: mock.Mock(capability=(9, 0))):
        assert not applies(), "off by default (not faster yet)"
    monkeypatch.setattr(input_backward, "INPUT_BACKWARD_KERNEL", True)
    with mock.patch.object(input_backward.runtime, "device_info", lambda i: mock.Mock(capability=(9, 0))):
        assert applies()
        assert not applies(P=96)      # P not whole warpgroups
        assert not applies(H=16)      # a ring of one chunk
        assert not applies(H=256)     # W4^T past the registers
        assert not applies(plane=37 * 37)  # rows of d_proj not in 16 bytes
        assert not applies(tensors=[rows.float()] * 5)
        assert not applies(tensors=[rows, rows, rows, rows.half(), rows])  # dtypes mixed
        assert not applies(stats=[torch.zeros(16, dtype=torch.bfloat16)] * 2)  # statistics not fp32
        assert not applies(stats=[torch.zeros(15)] * 2)  # not a value a row
        assert not applies(tensors=[rows, rows, rows, rows.view(-1)[4:].view(-1, 4), rows])  # a start mid-piece
    with mock.patch.object(input_backward.runtime, "device_info", lambda i: mock.Mock(capability=(8, 0))):
        assert not applies()


def _expected(d_proj, w4, rows, gamma, joined, join_before, eps=1e-5):
    """d rows, d gamma, d beta in float64 autograd of LayerNorm and the projections."""
    B, K, L = d_proj.shape
    P = rows.shape[1]
    rows64 = rows.double().clone().requires_grad_()
    gamma64 = gamma.double().clone().requires_grad_()
    beta64 = torch.zeros(P, dtype=torch.float64, requires_grad=True)
    xn = torch.nn.functional.layer_norm(rows64, [P], gamma64, beta64, eps)
    proj = (xn @ w4.double().T).view(B, L, K).transpose(1, 2)
    loss = (proj * d_proj.double()).sum() + ((xn if join_before else rows64) * joined.double()).sum()
    loss.backward()
    return rows64.grad, gamma64.grad, beta64.grad


# (INPUT_BACKWARD_KERNEL is off: without --slow one case is emulated)
@needs_gxx
@pytest.mark.parametrize("P,H,B,L,dtype,join_before", [(128, 128, 1, 24 * 24, torch.bfloat16, True),
                                                       pytest.param(64, 32, 2, 40, torch.float16, False, marks=pytest.mark.slow),
                                                       pytest.param(128, 64, 3, 8, torch.bfloat16, False, marks=pytest.mark.slow),
                                                       pytest.param(64, 48, 1, 136, torch.bfloat16, True, marks=pytest.mark.slow)],
                         ids=["models-N24", "fp16-P64-gate-on-x-mid-tile", "B3-N8", "H48-three-chunks"])
def test_the_kernel_matches_float64_emulated(P, H, B, L, dtype, join_before):
    """d x within the 16-bit standard's 1e-2 relative L2 of float64 (its only rounding: the stored
    result), d gamma and d beta to fp32 sums (1e-4); a zero gamma among the channels; shared
    memory 0xFF-filled by the emulator (NaN in 16 bits), every pair written."""
    from emulator import emulated

    gen = generator(300 + P + H + L)
    K = 4 * H
    rows = (torch.randn(B * L, P, generator=gen) * 2 + 0.5).to(dtype)
    gamma = (torch.rand(P, generator=gen) + 0.5)
    gamma[3] = 0.0
    gamma = gamma.to(dtype)
    w4 = (torch.randn(K, P, generator=gen) / P**0.5).to(dtype)
    d_proj = torch.randn(B, K, L, generator=gen).to(dtype)
    joined = torch.randn(B * L, P, generator=gen).to(dtype)
    r64 = rows.double()
    mean = r64.mean(1)
    rstd = (r64.var(1, unbiased=False) + 1e-5).rsqrt()
    stats = torch.stack([mean, rstd]).float()
    with emulated():
        d_rows, d_gamma, d_beta = input_backward.input_side_backward(d_proj, w4, rows, stats[0], stats[1], gamma,
                                                                     joined, join_before)
    exact = _expected(d_proj, w4, rows, gamma, joined, join_before)
    for name, ours, ref, bound in (("d x", d_rows, exact[0], 1e-2), ("d gamma", d_gamma, exact[1], 1e-4),
                                   ("d beta", d_beta, exact[2], 1e-4)):
        assert torch.isfinite(ours).all(), name
        error = ((ours.double() - ref).norm() / ref.norm()).item()
        assert error <= bound, f"{name}: {error}"


@needs_gxx
def test_a_16_bit_training_step_through_it_meets_the_gradient_standard_emulated():
    """The 16-bit closed form with its fused kernels (the input LayerNorm's row kernels among them, as
    on a GPU: their statistics are fp32), the projection kernels and this one, all on the CPU
    emulator (N24: 576 pairs, whole 16-byte rows of d_proj): every gradient within the 16-bit
    standard, and the kernel ran."""
    runs = assert_emulated_16_bit_step_meets_the_standard(
        95, 24, (input_backward, "input_side_backward"),
        ((layer_norm_rows, "applies", lambda t, cols: True), (input_backward, "INPUT_BACKWARD_KERNEL", True)))
    assert runs, "the input side's backward kernel did not run"


@pytest.mark.gpu
@pytest.mark.parametrize("P,H,B,N,dtype,join_before", [(128, 128, 2, 52, torch.bfloat16, True),
                                                       (128, 128, 1, 100, torch.float16, False),
                                                       (64, 32, 3, 12, torch.bfloat16, True)])
def test_the_kernel_matches_float64_on_the_gpu(P, H, B, N, dtype, join_before):
    """As the emulated test, on the GPU at planes of thousands of pairs (more tiles than SMs, a
    last tile mid-way), outputs NaN-prefilled by the caching allocator's reuse of a NaN buffer."""
    gen = generator(400 + N)
    L, K = N * N, 4 * H
    rows = (torch.randn(B * L, P, generator=gen) * 2 + 0.5).to(dtype)
    gamma = (torch.rand(P, generator=gen) + 0.5)
    gamma[5] = 0.0
    w4 = (torch.randn(K, P, generator=gen) / P**0.5).to(dtype)
    d_proj = torch.randn(B, K, L, generator=gen).to(dtype)
    joined = torch.randn(B * L, P, generator=gen).to(dtype)
    r64 = rows.double()
    stats = torch.stack([r64.mean(1), (r64.var(1, unbiased=False) + 1e-5).rsqrt()]).float()
    exact = _expected(d_proj, w4, rows, gamma.to(dtype), joined, join_before)
    torch.full((B * L * P,), float("nan"), device="cuda", dtype=dtype)  # freed: the outputs may take its bytes
    cuda = [t.cuda() for t in (d_proj, w4, rows, stats[0], stats[1], gamma.to(dtype), joined)]
    d_rows, d_gamma, d_beta = input_backward.input_side_backward(*cuda, join_before)
    for name, ours, ref, bound in (("d x", d_rows, exact[0], 1e-2), ("d gamma", d_gamma, exact[1], 1e-4),
                                   ("d beta", d_beta, exact[2], 1e-4)):
        ours = ours.cpu()
        assert torch.isfinite(ours).all(), name
        error = ((ours.double() - ref).norm() / ref.norm()).item()
        assert error <= bound, f"{name}: {error}"


@pytest.mark.gpu
def test_a_bf16_training_step_on_the_gpu_runs_it_and_meets_the_gradient_standard():
    """A module's bf16 training step (the models' form, N64: 4096 pairs) with the kernel on runs it,
    and its gradients meet the 16-bit standard against float64 of the reference."""
    gen = generator(97)
    module = TRIMUL.make_module(MODELS_FORM, gen).cuda().bfloat16()
    x, mask = TRIMUL.make_inputs({"B": 1, "N": 64, **MODELS_FORM}, gen)
    x, mask = x.cuda().bfloat16(), mask.cuda()
    g = torch.randn(x.shape, generator=gen).cuda().bfloat16()
    runs, real = [], input_backward.input_side_backward
    with mock.patch.object(input_backward, "INPUT_BACKWARD_KERNEL", True), \
            mock.patch.object(input_backward, "input_side_backward", lambda *a: runs.append(a) or real(*a)):
        ours = module.analytic_gradients([x, mask], [p.detach() for p in module.parameters()], g)
    assert runs, "the input side's backward kernel did not run"
    assert_16_bit_gradients_meet_the_standard(module, (x, mask), g, [ours[0], *ours[2:]])
