"""The contact head's closed-form gradients (pairgen/ops/contact/backward.py) against float64
autograd of the reference, on the CPU: odd sizes, heavy tails, the fp32 gradient standard
(relative L2 <= 2e-5 per tensor); a 16-bit module within the 16-bit standard."""
from __future__ import annotations

import shutil

import pytest
import torch

from helpers import assert_16_bit_gradients_meet_the_standard, closed_form_errors, generator, gradient_errors64
from pairgen import compiler
from pairgen.module.autograd import SavedClosedForm
from pairgen.module.dispatch import pairs
from pairgen.ops import layer_norm_rows
from pairgen.ops.contact import CONTACT, backward, fused_backward


@pytest.mark.parametrize("widths,B,N,distribution", [({"P": 24, "H": 16}, 2, 13, "normal"),
                                                     ({"P": 64, "H": 32}, 1, 21, "cauchy")])
def test_closed_form_gradients_meet_the_fp32_standard(widths, B, N, distribution):
    gen = generator(50 + N)
    module = CONTACT.make_module(widths, gen)
    (x,) = CONTACT.make_inputs({"B": B, "N": N, **widths}, gen, distribution)
    errors = closed_form_errors(module, (x,), torch.randn((B, N, N), generator=gen))
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 2e-5, f"gradient of {worst}: {errors}"


def test_a_16_bit_module_meets_the_16_bit_standard():
    gen = generator(60)
    widths = {"P": 32, "H": 16}
    module = CONTACT.make_module(widths, gen).bfloat16()
    (x,) = CONTACT.make_inputs({"B": 2, "N": 17, **widths}, gen)
    x, g = x.bfloat16(), torch.randn((2, 17, 17), generator=gen).bfloat16()
    ours = module.analytic_gradients([x], [p.detach() for p in module.parameters()], g)
    assert_16_bit_gradients_meet_the_standard(module, (x,), g, ours)


def test_the_saving_forward_is_exact_and_its_gradients_meet_the_standard():
    """The training path that keeps its intermediates (SavedClosedForm): the output within the
    fp32 forward standard of float64, every gradient within 2e-5; a second backward through the
    same call is refused with what to do."""
    widths = {"P": 24, "H": 16}
    gen = generator(61)
    module = CONTACT.make_module(widths, gen)
    (x,) = CONTACT.make_inputs({"B": 2, "N": 13, **widths}, gen, "cauchy")

    def call(x_in):
        return SavedClosedForm.run(module, (x_in,))

    with torch.no_grad():
        out = call(x)
        exact = CONTACT.make_reference(module).double()(x.double())
    assert out.shape == exact.shape and ((out.double() - exact).norm() / exact.norm()).item() <= 1e-5
    errors = gradient_errors64(call, module, (x,), torch.randn(exact.shape, generator=gen))
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 2e-5, f"gradient of {worst}: {errors}"
    twice = call(x.clone().requires_grad_())
    twice.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="recompute_for_backward = True"):
        twice.sum().backward()


@pytest.mark.parametrize("kind,cols", [("float32", 128), ("bfloat16", 128), ("float16", 100),
                                       ("float32", layer_norm_rows.MAX_COLS)])
def test_the_symmetrised_layer_norm_kernels_render_to_their_signatures_and_compile(kind, cols):
    """The input LayerNorm fused with the symmetrisation over pairs i <= j (fused_backward.py),
    for each storage type, at a width no multiple of the warp and the widest it takes: its
    signatures are the launches', and NVRTC compiles it for sm_90 without spills."""
    rendered = fused_backward.render(kind, cols)
    compiled = compiler.compile_source(rendered.source, rendered.kernel_name, "sm_90")
    assert set(compiled.kernels) >= {rendered.kernel_name, f"{rendered.kernel_name}_grad"}
    assert not compiled.spill_bytes


def test_unique_pairs_cover_each_unordered_pair_once():
    """Every (i, j) of every plane is the ij or the ji row of exactly one pair i <= j; `off`
    marks the pairs off the diagonal and `share` is each row's part of a pair's gradient."""
    B, N = 2, 7
    pairs = backward.unique_pairs(B, N, torch.device("cpu"))
    assert pairs.ij.numel() == B * N * (N + 1) // 2
    covered = torch.zeros(B * N * N, dtype=torch.int64)
    covered.index_add_(0, pairs.ij, torch.ones_like(pairs.ij))
    covered.index_add_(0, pairs.ji, (pairs.off > 0).long())
    assert torch.equal(covered, torch.ones_like(covered))
    assert torch.equal(pairs.off == 0, pairs.ij == pairs.ji)
    assert torch.equal(pairs.share, torch.where(pairs.off > 0, 0.5, 1.0))


def test_the_16_bit_output_layer_gradient_rounds_once_from_fp32():
    """d(loss)/d(y) of a pair i <= j is (g_ij + g_ji) * sigmoid'(y) computed in fp32 and rounded to
    16 bits once, and the bias's gradient is its fp32 sum rounded once: a 16-bit sum of the two
    rows' gradients, then a 16-bit product, rounded twice (the error grew past the reference's at
    small shapes, where the bias's gradient is a sum with cancellations)."""
    from types import SimpleNamespace

    gen = generator(61)
    B, N = 2, 9
    pairs = backward.unique_pairs(B, N, torch.device("cpu"))
    g = (torch.randn(B, N, N, generator=gen) * 3).bfloat16()
    out = torch.rand(pairs.ij.numel(), 1, generator=gen).bfloat16()
    d_y, grads = backward._output_layer_gradients(g, SimpleNamespace(pairs=pairs, out_unique=out))
    flat = g.reshape(-1).double()
    exact = (flat[pairs.ij] + pairs.off.double() * flat[pairs.ji]).view(-1, 1) * out.double() * (1 - out.double())
    assert d_y.dtype is torch.bfloat16 and torch.equal(d_y, exact.float().bfloat16())
    assert grads["mlp.4.bias"].dtype is torch.bfloat16
    assert torch.equal(grads["mlp.4.bias"], exact.sum(0).float().bfloat16())
    twice = torch.ops.aten.sigmoid_backward((g.reshape(-1)[pairs.ij] + pairs.off.bfloat16() * g.reshape(-1)[pairs.ji]).view(-1, 1), out)
    assert not torch.equal(twice, d_y)  # the old way differs here: the test can tell them apart


def test_16_bit_forwards_and_training_take_the_closed_form_from_the_measured_sizes(monkeypatch):
    """Without 16-bit kernels, a forward from Routing.closed_form_min_pairs pairs runs the closed
    form (below it, where the host's time per PyTorch operation makes the closed form slower than
    the reference, the fp32 kernel on the input made fp32); "auto" trains 16-bit calls through the
    reference up to 2^18 pairs and the closed form above, "closed_form" through the closed form
    (tests/test_dispatch.py follows the routes)."""
    module = CONTACT.make_module({"P": 8, "H": 8}, generator(62)).bfloat16()
    routing = module.routing
    assert routing.closed_form_min_pairs == 2**17 and routing.fp32_kernel_max_pairs == 2**17 - 1
    below, at = (torch.empty(1, n, n, 8, dtype=torch.bfloat16) for n in (256, 363))
    assert pairs(below) < routing.closed_form_min_pairs <= pairs(at)
    assert pairs(below) <= routing.fp32_kernel_max_pairs < pairs(at), "below it: the fp32 kernel"
    assert module.trains_through_reference("bfloat16", (at,))
    # "auto" trains through the closed form above 2^18 pairs (B1 N512 measured even, B2 N384 and
    # N768 faster), with the fused backward kernels only
    N512, B2_N384 = torch.empty(1, 512, 512, 1), torch.empty(2, 384, 384, 1)
    assert module.trains_through_reference("bfloat16", (N512,))
    assert not module.trains_through_reference("bfloat16", (B2_N384,))
    monkeypatch.setenv("PAIRGEN_FUSED_BACKWARD", "0")
    assert module.trains_through_reference("bfloat16", (B2_N384,))
    monkeypatch.delenv("PAIRGEN_FUSED_BACKWARD")
    module.backward_mode = "closed_form"
    assert not module.trains_through_reference("bfloat16", (at,))


# fp16 with --slow: the same template on the other 16-bit type
# (MLP_KERNEL is off: without --slow one width compiles, and one case below is emulated)
@pytest.mark.parametrize("kind", ["bfloat16", pytest.param("float16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("P,H", [pytest.param(16, 16, marks=pytest.mark.slow), pytest.param(48, 32, marks=pytest.mark.slow),
                                 pytest.param(64, 32, marks=pytest.mark.slow), (128, 64), pytest.param(128, 128, marks=pytest.mark.slow)])
def test_the_mlp_kernel_renders_and_compiles_without_spills(kind, P, H):
    rendered = fused_backward.render_mlp(kind, P, H)
    compiled = compiler.compile_source(rendered.source, rendered.kernel_name, "sm_90")
    assert compiled.spill_bytes == 0 and compiled.stack_bytes == 0, compiled.summary()


def _gradients_through_the_mlp_kernel(module, x, g) -> list:
    """module.analytic_gradients (the recomputing closed form) with the closed form's kernels on
    the CPU emulator (tests/emulator), asserting that the MLP kernel ran."""
    from unittest import mock

    from emulator import emulated

    runs = []
    real = fused_backward.mlp_forward_backward
    with emulated(), mock.patch.object(fused_backward, "applies", lambda t, cols: True), \
            mock.patch.object(fused_backward, "MLP_KERNEL", True), \
            mock.patch.object(fused_backward, "mlp_forward_backward", lambda *a: runs.append(a) or real(*a)):
        ours = module.analytic_gradients([x], [p.detach() for p in module.parameters()], g)
    assert runs, "the MLP kernel did not run"
    return ours


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")
@pytest.mark.parametrize("dtype,widths,B,N", [pytest.param(torch.bfloat16, {"P": 128, "H": 128}, 1, 37, marks=pytest.mark.slow),
                                              (torch.float16, {"P": 48, "H": 32}, 2, 13),
                                              pytest.param(torch.bfloat16, {"P": 64, "H": 16}, 3, 1, marks=pytest.mark.slow)])
def test_the_mlp_kernel_gradients_meet_the_16_bit_standard_emulated(dtype, widths, B, N):
    """The 16-bit closed form with the MLP's forward and backward in one wgmma kernel
    (templates/contact/mlp_backward.cu.j2), run on the CPU emulator, heavy-tailed inputs: every
    gradient within the 16-bit standard, none aliasing another."""
    gen = generator(70 + N)
    module = CONTACT.make_module(widths, gen).to(dtype)
    (x,) = CONTACT.make_inputs({"B": B, "N": N, **widths}, gen, "cauchy")
    x, g = x.to(dtype), torch.randn((B, N, N), generator=gen).to(dtype)
    ours = _gradients_through_the_mlp_kernel(module, x, g)
    storages = [t.untyped_storage().data_ptr() for t in ours]
    assert len(set(storages)) == len(storages), "gradients that alias"
    assert_16_bit_gradients_meet_the_standard(module, (x,), g, ours)
