"""The triangle update's closed-form gradients (pairgen/ops/trimul/backward.py) against float64
autograd of the reference, on the CPU: both directions, both gate inputs, bias on and off, odd
sizes, heavy-tailed inputs, masks with empty rows and columns, bool and float masks; the gradient
standard for fp32 (relative L2 <= 2e-5 per tensor). The GPU tests check the same through a
module's backward."""
from __future__ import annotations

import shutil

import pytest
import torch

from helpers import (assert_16_bit_gradients_meet_the_standard, assert_emulated_16_bit_step_meets_the_standard,
                     closed_form_errors, generator, gradient_errors64)
from pairgen import codegen, compiler, config
from pairgen.module.autograd import ReferenceBackward, SavedClosedForm
from pairgen.ops import layer_norm_rows, row_products
from pairgen.ops.trimul import TRIMUL, fused_backward

STANDARD = 2e-5


def _errors(widths: dict, B: int, N: int, seed: int, distribution: str = "normal", float_mask: bool = False):
    gen = generator(seed)
    module = TRIMUL.make_module(widths, gen)
    x, mask = TRIMUL.make_inputs({"B": B, "N": N, **widths}, gen, distribution)
    return closed_form_errors(module, (x, mask.float() if float_mask else mask), torch.randn(x.shape, generator=gen))


@pytest.mark.parametrize("outgoing", [0, 1])
@pytest.mark.parametrize("gate_normalized", [0, 1])
@pytest.mark.parametrize("bias", [0, 1])
def test_closed_form_gradients_meet_the_fp32_standard(outgoing, gate_normalized, bias):
    widths = {"P": 24, "H": 16, "outgoing": outgoing, "gate_normalized": gate_normalized, "bias": bias}
    errors = _errors(widths, B=2, N=13, seed=10 + 4 * outgoing + 2 * gate_normalized + bias)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= STANDARD, f"gradient of {worst}: {errors}"


def test_heavy_tails_and_a_float_mask():
    widths = {"P": 32, "H": 8, "outgoing": 1, "gate_normalized": 0, "bias": 1}
    errors = _errors(widths, B=1, N=19, seed=30, distribution="cauchy", float_mask=True)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= STANDARD, f"gradient of {worst}: {errors}"


def test_a_mask_that_wants_its_own_gradient_recomputes_the_reference():
    widths = {"P": 16, "H": 8, "outgoing": 0, "gate_normalized": 0, "bias": 0}
    gen = generator(31)
    module = TRIMUL.make_module(widths, gen)
    x, mask = TRIMUL.make_inputs({"B": 1, "N": 5, **widths}, gen)
    params = [p.detach() for p in module.parameters()]
    assert module.analytic_gradients([x, mask.float().requires_grad_()], params, torch.ones_like(x)) is None
    assert module.analytic_gradients([x.double(), mask], params, torch.ones_like(x)) is None  # a float64 call


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_modules_meet_the_16_bit_standard(dtype):
    """A 16-bit module's gradients come back in its dtype, within max(2e-2, 1.5x the error of the
    reference's own autograd in that dtype) of float64 autograd (the gradient standard)."""
    widths = {"P": 32, "H": 16, "outgoing": 0, "gate_normalized": 1, "bias": 1}
    gen = generator(40)
    module = TRIMUL.make_module(widths, gen).to(dtype)
    x, mask = TRIMUL.make_inputs({"B": 2, "N": 21, **widths}, gen)
    x = x.to(dtype)
    grad_out = torch.randn(x.shape, generator=gen).to(dtype)
    names = [name for name, _ in module.named_parameters()]
    ours = module.analytic_gradients([x, mask], [p.detach() for p in module.parameters()], grad_out)
    assert ours[0].dtype is dtype and all(g.dtype is dtype for g in ours[2:])

    def autograd(reference, x_in, g):
        x_in = x_in.clone().requires_grad_()
        (reference(x_in, mask) * g).sum().backward()
        return [x_in.grad] + [p.grad for p in reference.parameters()]

    exact = autograd(TRIMUL.make_reference(module).double(), x.double(), grad_out.double())
    same_dtype = autograd(TRIMUL.make_reference(module).to(dtype), x, grad_out)
    for name, g, g16, e in zip(["input", *names], [ours[0], *ours[2:]], same_dtype, exact):
        ours_err = ((g.double() - e).norm() / e.norm()).item()
        reference_err = ((g16.double() - e).norm() / e.norm()).item()
        assert ours_err <= max(2e-2, 1.5 * reference_err), f"{name}: {ours_err} (the {dtype} reference: {reference_err})"


def test_frozen_parameters_get_no_gradient_and_the_rest_are_unchanged():
    """A frozen parameter's products are skipped (None); the input's and the other parameters'
    gradients are the same as with nothing frozen."""
    widths = {"P": 16, "H": 8, "outgoing": 1, "gate_normalized": 0, "bias": 1}
    gen = generator(90)
    module = TRIMUL.make_module(widths, gen)
    x, mask = TRIMUL.make_inputs({"B": 1, "N": 9, **widths}, gen)
    g = torch.randn(x.shape, generator=gen)
    names = [name for name, _ in module.named_parameters()]
    params = [p.detach() for p in module.parameters()]
    everything = module.analytic_gradients([x, mask], params, g)
    wanted = [not name.startswith(("proj_", "gate_", "out_proj.weight")) for name in names]
    some = module.analytic_gradients([x, mask], params, g, wanted=wanted)
    assert torch.equal(some[0], everything[0])
    skippable = {"out_proj.weight", "out_gate.weight", *(f"{n}.weight" for n in ("proj_a", "gate_a", "proj_b", "gate_b"))}
    for name, w, a, b in zip(names, wanted, some[2:], everything[2:]):
        if name in skippable and not w:
            assert a is None, f"{name}: frozen, its product skipped"
        else:  # wanted, or cheap enough to come anyway (biases, LayerNorm affines: sums)
            assert torch.equal(a, b), name


def test_a_tf32x3_module_meets_the_fp32_standard():
    """tf32x3 modules' backward runs exact fp32 products (faster than splitting them in PyTorch
    on an H200, and more exact), held to 2e-5."""
    widths = {"P": 24, "H": 16, "outgoing": 0, "gate_normalized": 1, "bias": 1}
    gen = generator(95)
    module = TRIMUL.make_module(widths, gen)
    module.precision = "tf32x3"
    assert module.backward_precision(torch.zeros(1), autocast=None) == "ieee"
    module.precision = "tf32"  # a TF32-accurate module keeps TF32 products in its backward
    assert module.backward_precision(torch.zeros(1), autocast=None) == "tf32"
    # under a 16-bit autocast the closed form runs in its dtype, whatever the module's precision
    assert module.backward_precision(torch.zeros(1), autocast=torch.bfloat16) == "bfloat16"
    assert module.backward_precision(torch.zeros(1), autocast=torch.float16) == "float16"
    module.precision = "tf32x3"
    x, mask = TRIMUL.make_inputs({"B": 2, "N": 11, **widths}, gen)
    errors = closed_form_errors(module, (x, mask), torch.randn(x.shape, generator=gen))
    worst = max(errors, key=errors.get)
    assert errors[worst] <= STANDARD, f"gradient of {worst}: {errors}"


def test_backward_mode_is_checked_and_auto_trains_large_16_bit_calls_through_the_fused_closed_form(monkeypatch):
    """"auto": fp32 calls always through the closed form; 16-bit calls from
    Routing.closed_form_16_bit_training_min_pairs pairs (below, a step is bound by the host and PyTorch's
    reference is as fast) and only with the fused kernels; the explicit modes as they say."""
    monkeypatch.delenv("PAIRGEN_FUSED_BACKWARD", raising=False)
    module = TRIMUL.make_module({"P": 16, "H": 8, "outgoing": 0, "gate_normalized": 0, "bias": 1}, generator(96))
    assert module.backward_mode == "auto"
    with pytest.raises(ValueError, match="backward_mode must be one of 'auto', 'closed_form', 'reference'"):
        module.backward_mode = "fast"
    assert module.backward_mode == "auto", "a refused value leaves the mode as it was"
    large = (torch.empty(2, 256, 256, 16, device="meta"),)  # 2^17 pairs
    small = (torch.empty(1, 256, 256, 16, device="meta"),)
    precisions = ("float32", "tf32x3", "bfloat16", "float16")
    assert [module.trains_through_reference(p, large) for p in precisions] == [False] * 4
    assert [module.trains_through_reference(p, small) for p in precisions] == [False, False, True, True]
    monkeypatch.setenv("PAIRGEN_FUSED_BACKWARD", "0")  # without the fused kernels 16 bits is not faster
    assert [module.trains_through_reference(p, large) for p in precisions] == [False, False, True, True]
    module.backward_mode = "reference"
    assert module.trains_through_reference("float32", large)
    module.backward_mode = "closed_form"
    assert not module.trains_through_reference("bfloat16", small)


@pytest.mark.parametrize("kind,out_fp32", [("float32", False), ("bfloat16", False), ("float16", False),
                                          ("bfloat16", True), ("float16", True)])
def test_the_fused_backward_kernels_render_to_their_signatures_and_compile(kind, out_fp32):
    """The fused passes (fused_backward.py): each storage type's source declares the signatures
    the launches pass, and NVRTC compiles it for sm_90 without spills; out_fp32 (the output gate
    writing fp32 from 16-bit storage) changes only that kernel."""
    rendered = fused_backward.render(kind, out_fp32=out_fp32)
    compiled = compiler.compile_source(rendered.source, rendered.kernel_name, "sm_90")
    assert set(compiled.kernels) >= {f"{rendered.kernel_name}_{suffix}" for suffix in fused_backward.SIGNATURES}
    assert not compiled.spill_bytes
    if out_fp32:  # the same source before the output gate and after it
        plain, wide = fused_backward.render(kind).source, rendered.source
        gate = f'extern "C" __global__ void __launch_bounds__(THREADS) {rendered.kernel_name}_gated('
        after = "// The LayerNorm kernels' tile"
        assert wide[:wide.index("// out_fp32:")] == plain[:plain.index(gate)]
        assert wide[wide.index(after):] == plain[plain.index(after):]
        assert "float* out" in wide[wide.index(gate):].splitlines()[1]


def test_the_output_gate_refuses_an_output_it_cannot_write():
    """fp32 out from 16-bit o and u, or o's own dtype: nothing else (an fp32 o into a 16-bit out)."""
    o = torch.zeros(8)
    with pytest.raises(ValueError, match="o's dtype or fp32 from 16 bits"):
        fused_backward.gated(o, o, torch.zeros(8, dtype=torch.bfloat16))


@pytest.mark.parametrize("kind,cols,x_kind", [("float32", 128, None), ("bfloat16", 128, None), ("float16", 100, None),
                                              ("float32", layer_norm_rows.MAX_COLS, None), ("bfloat16", 384, "float32"),
                                              ("float16", 100, "float32")])
def test_the_row_layer_norm_kernels_render_to_their_signatures_and_compile(kind, cols, x_kind):
    """The row LayerNorm (pairgen/ops/layer_norm_rows.py) for each storage type, at a width no
    multiple of the warp and the widest it takes, and reading fp32 rows into 16 bits (x_kind): its
    signatures are the launches', and NVRTC compiles it for sm_90 without spills (the row lives in
    registers)."""
    rendered = layer_norm_rows.render(kind, cols, x_kind=x_kind)
    assert ("const float* __restrict__ x" in rendered.source) == (x_kind == "float32")
    compiled = compiler.compile_source(rendered.source, rendered.kernel_name, "sm_90")
    assert set(compiled.kernels) >= {rendered.kernel_name, f"{rendered.kernel_name}_grad"}
    assert not compiled.spill_bytes


@pytest.mark.parametrize("declared", [("ptr o", "ptr u", "i64 count"), ("ptr u", "ptr o", "ptr g", "i64 count")],
                         ids=["an argument left out", "two pointers swapped"])
def test_a_kernel_whose_signature_disagrees_with_its_launch_is_refused(monkeypatch, declared):
    """The fused kernels are plans like the forward ones: their arguments are checked by name and
    kind, so two pointers of one kind in each other's place are caught too."""
    monkeypatch.setitem(fused_backward.SIGNATURES, "out_gate", declared)
    with pytest.raises(codegen.ContractError, match="out_gate"):
        fused_backward.render("float32")


def test_the_fused_kernels_are_on_by_default_can_be_turned_off_and_are_gpu_only(monkeypatch):
    monkeypatch.delenv("PAIRGEN_FUSED_BACKWARD", raising=False)
    assert config.fused_backward()
    monkeypatch.setenv("PAIRGEN_FUSED_BACKWARD", "0")
    assert not config.fused_backward()
    monkeypatch.setenv("PAIRGEN_FUSED_BACKWARD", "1")
    assert not fused_backward.enabled(torch.zeros(1)), "CPU tensors keep the PyTorch passes"


def _small_case(seed: int, N: int, **options) -> tuple:
    """(module, x wanting a gradient, mask): P16 H8, one batch, the options over the defaults."""
    widths = {"P": 16, "H": 8, "outgoing": 0, "gate_normalized": 0, "bias": 1, **options}
    gen = generator(seed)
    module = TRIMUL.make_module(widths, gen)
    x, mask = TRIMUL.make_inputs({"B": 1, "N": N, **widths}, gen)
    return module, x.requires_grad_(), mask


def _saving_call(module):
    """A training call through the saving path (what a CUDA call takes unless
    recompute_for_backward is set), run here on the CPU tensors given."""
    return lambda x, mask: SavedClosedForm.run(module, (x, mask))


@pytest.mark.parametrize("outgoing,gate_normalized,bias", [(0, 0, 1), (1, 1, 0), (1, 0, 1), (0, 1, 0)])
def test_the_saving_forward_is_exact_and_its_gradients_meet_the_standard(outgoing, gate_normalized, bias):
    """The forward computed the closed form's way (its intermediates kept for the backward) gives
    the reference's output within the fp32 forward standard, and the backward from what it kept
    gives every gradient within 2e-5 of float64 autograd; odd N, a mask with empty rows."""
    widths = {"P": 24, "H": 16, "outgoing": outgoing, "gate_normalized": gate_normalized, "bias": bias}
    gen = generator(97 + outgoing + 2 * gate_normalized)
    module = TRIMUL.make_module(widths, gen)
    x, mask = TRIMUL.make_inputs({"B": 2, "N": 13, **widths}, gen)
    mask[0, 3] = False  # an empty row
    with torch.no_grad():
        out = _saving_call(module)(x, mask)
        exact = TRIMUL.make_reference(module).double()(x.double(), mask)
    assert out.dtype is torch.float32 and out.shape == x.shape
    assert ((out.double() - exact).norm() / exact.norm()).item() <= 1e-5
    assert (out.double() - exact).abs().max().item() <= 1e-4
    errors = gradient_errors64(_saving_call(module), module, (x, mask), torch.randn(x.shape, generator=gen))
    worst = max(errors, key=errors.get)
    assert errors[worst] <= STANDARD, f"gradient of {worst}: {errors}"


def test_the_four_projection_gradients_are_one_product_copied_only_for_an_operator():
    """The saving path hands autograd the four input projections' weight gradients as views of
    the one product that makes them (no copies); analytic_gradients, which a custom operator
    returns, makes every gradient its own storage. Accumulated over two steps they add up."""
    module, x, mask = _small_case(98, 7, outgoing=1, gate_normalized=1)
    _saving_call(module)(x, mask).sum().backward()
    weights = [getattr(module, name).weight for name in ("proj_a", "gate_a", "proj_b", "gate_b")]
    assert len({w.grad.untyped_storage().data_ptr() for w in weights}) == 1, "views of one product"
    first = [w.grad.clone() for w in weights]
    _saving_call(module)(x, mask).sum().backward()
    assert all(torch.allclose(w.grad, 2 * g, rtol=1e-5, atol=1e-6) for w, g in zip(weights, first))
    names = [name for name, _ in module.named_parameters()]
    grads = module.analytic_gradients([x.detach(), mask], [p.detach() for p in module.parameters()],
                                      torch.ones_like(x))
    storages = [g.untyped_storage().data_ptr() for g in grads if g is not None]
    assert len(storages) == len(set(storages)) == 1 + len(names)
    for name, g in zip(names, grads[2:]):
        if name.endswith(".weight") and name.split(".")[0] in ("proj_a", "gate_a", "proj_b", "gate_b"):
            assert torch.allclose(g, first[("proj_a", "gate_a", "proj_b", "gate_b").index(name.split(".")[0])],
                                  rtol=1e-5, atol=1e-6)


def test_the_saved_intermediates_serve_one_backward_and_a_second_is_refused_clearly():
    """The backward turns the saved intermediates into gradients in place, so a second backward
    through the same call (retain_graph=True) is refused with what to do, not answered wrongly."""
    module, x, mask = _small_case(99, 6)
    out = _saving_call(module)(x, mask)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="recompute_for_backward = True"):
        out.sum().backward()


def test_frozen_parameters_in_the_saving_path_get_no_gradient():
    module, x, mask = _small_case(100, 7, outgoing=1, gate_normalized=1)
    module.proj_a.weight.requires_grad_(False)
    _saving_call(module)(x, mask).sum().backward()
    assert module.proj_a.weight.grad is None
    assert x.grad is not None and module.gate_a.weight.grad is not None


def test_a_second_derivative_through_the_kept_intermediates_is_refused_not_zero():
    """The closed form's gradients carry no autograd graph: a double backward (create_graph=True,
    as a gradient penalty uses) through a kept-intermediates call raises instead of silently
    treating the second derivative as zero."""
    module, x, mask = _small_case(101, 5)
    out = _saving_call(module)(x, mask)
    (grad_x,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="second derivative"):  # asked for by tensor: the graph reaches x
        torch.autograd.grad(grad_x.square().sum(), x, retain_graph=True)
    with pytest.raises(RuntimeError, match="second derivative"):
        grad_x.sum().backward()
    linear = _saving_call(module)(x, mask)  # d(sum)/d(out) has no graph: the refusal still stands
    (grad_lin,) = torch.autograd.grad(linear.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="second derivative"):
        grad_lin.sum().backward()
    plain = _saving_call(module)(x, mask)
    (first,) = torch.autograd.grad(plain.square().sum(), x)
    assert first.grad_fn is None and torch.equal(first, grad_x.detach()), "a plain backward is untouched"


def test_create_graph_through_the_recomputing_path_gives_the_references_second_derivative(monkeypatch):
    """ReferenceBackward (the kernel forward, here stood in for by the reference on the CPU) under
    create_graph=True answers with the reference's autograd on the saved tensors, so a second
    derivative (a gradient penalty) is the reference's: within 2e-5 of float64, not zero."""
    widths = {"P": 16, "H": 8, "outgoing": 1, "gate_normalized": 1, "bias": 1}
    gen = generator(102)
    module = TRIMUL.make_module(widths, gen)
    x, mask = TRIMUL.make_inputs({"B": 1, "N": 6, **widths}, gen)
    monkeypatch.setattr(module, "_launch", lambda *inputs, variant: module.reference_forward(*inputs))

    def second_derivative(call, x_in):
        leaf = x_in.clone().requires_grad_()
        (grad,) = torch.autograd.grad(call(leaf).square().sum(), leaf, create_graph=True)
        (second,) = torch.autograd.grad(grad.square().sum(), leaf)
        return second

    ours = second_derivative(lambda t: ReferenceBackward.apply(module, 2, None, t, mask, *module.parameters()), x)
    reference64 = TRIMUL.make_reference(module).double()
    exact = second_derivative(lambda t: reference64(t, mask), x.double())
    assert ((ours.double() - exact).norm() / exact.norm()).item() <= 2e-5


@pytest.mark.parametrize("outgoing,gate_normalized,bias", [(0, 0, 1), (1, 1, 0)])
def test_the_hidden_gate_placement_in_closed_form(outgoing, gate_normalized, bias):
    """The closed form of gate_at="hidden" (the gate on LN_out(z), in hidden width, before the
    output projection), recomputing and kept: every gradient within the fp32 standard of float64
    autograd, the kept forward's output within the forward standard. The module does not take it
    yet (closed_form_applies: not measured on a GPU); here it is called directly."""
    widths = {"P": 24, "H": 16, "outgoing": outgoing, "gate_normalized": gate_normalized, "bias": bias,
              "gate_hidden": 1}
    gen = generator(120 + outgoing)
    module = TRIMUL.make_module(widths, gen)
    assert module.gate_at == "hidden" and not module.closed_form_applies([None, torch.zeros(1)])
    x, mask = TRIMUL.make_inputs({"B": 2, "N": 11, **widths}, gen, "cauchy")
    g = torch.randn(x.shape, generator=gen)
    module.closed_form_applies = lambda inputs: True  # the math, which the module does not take yet
    errors = closed_form_errors(module, (x, mask), g)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= STANDARD, f"recomputed: gradient of {worst}: {errors}"
    out = _saving_call(module)(x.clone().requires_grad_(), mask)
    exact = TRIMUL.make_reference(module).double()(x.double(), mask)
    assert ((out.double() - exact).norm() / exact.norm()).item() <= 1e-5
    kept = gradient_errors64(_saving_call(module), module, (x, mask), g)
    worst = max(kept, key=kept.get)
    assert kept[worst] <= STANDARD, f"kept: gradient of {worst}: {kept}"


@pytest.mark.parametrize("outgoing,gate_normalized,bias,gate_hidden", [(0, 0, 1, 0), (1, 1, 0, 0), (1, 0, 1, 1)])
def test_the_inference_forward_keeps_nothing_and_matches_the_reference(outgoing, gate_normalized, bias, gate_hidden):
    """The closed form's forward without a backward (what a CLOSED_FORM call runs: the gates not
    stored, each intermediate freed once used, the output gate in the projection's storage) gives
    the reference's output within the fp32 forward standard: odd N, heavy tails, an empty mask row."""
    widths = {"P": 24, "H": 16, "outgoing": outgoing, "gate_normalized": gate_normalized, "bias": bias,
              "gate_hidden": gate_hidden}
    gen = generator(140 + outgoing + 2 * gate_hidden)
    module = TRIMUL.make_module(widths, gen)
    x, mask = TRIMUL.make_inputs({"B": 2, "N": 13, **widths}, gen, "cauchy")
    mask[1, 6] = False
    params = {name: p.detach() for name, p in module.named_parameters()}
    with torch.no_grad():
        out = module.inference_forward(module, x, mask, params, "ieee")
        exact = TRIMUL.make_reference(module).double()(x.double(), mask)
    assert out.dtype is torch.float32 and out.shape == x.shape
    assert ((out.double() - exact).norm() / exact.norm()).item() <= 1e-5
    assert (out.double() - exact).abs().max().item() <= 1e-4 * exact.abs().max().item()


def test_the_output_layer_norm_tile_halves_until_it_fits_and_wider_widths_keep_pytorchs():
    """The LayerNorm kernels' pairs per block: the tuning's ln_tile where its tiles (one forward,
    two backward, in the storage type) fit 48 KB of shared memory, halved down to 8 where not,
    None past that (the closed form then uses PyTorch's LayerNorm on a transposed copy; a training
    call, whose backward needs both tiles, where the backward's do not fit)."""
    tuning = fused_backward.TUNING_DEFAULT
    assert tuning["ln_tile"] == 64
    assert fused_backward.ln_tile(128, 2, tuning, backward=False) == 64
    assert fused_backward.ln_tile(128, 2, tuning) == 64
    assert fused_backward.ln_tile(384, 2, tuning, backward=False) == 32
    assert fused_backward.ln_tile(384, 2, tuning) == 16
    assert fused_backward.ln_tile(512, 4, tuning, backward=False) == 16
    assert fused_backward.ln_tile(768, 4, tuning) is None and not fused_backward.layer_norm_fits(768, 4, tuning)
    for hidden in (48, 128, 384, 512, 768):
        for element_bytes in (2, 4):
            for backward in (False, True):
                tile = fused_backward.ln_tile(hidden, element_bytes, tuning, backward)
                if tile is not None:
                    smem = fused_backward._ln_smem(hidden, 2 if backward else 1, tile, element_bytes)
                    assert smem + 2 * tile * 4 <= fused_backward.SMEM_LIMIT
                    assert ((tile + 4 // element_bytes) * element_bytes // 4) % 2 == 1, "rows of odd words"


def test_the_fused_passes_move_16_bytes_a_load_only_where_every_tensor_and_length_allows():
    wide = torch.empty(4, 64, dtype=torch.bfloat16)
    assert fused_backward._vectors(wide, wide, multiples_of=(36 * 36, 128))
    assert not fused_backward._vectors(wide, wide, multiples_of=(37 * 37,))  # odd N: one value a load
    assert not fused_backward._vectors(wide, wide.view(-1)[1:], multiples_of=(64,))  # 2 bytes off alignment
    assert not fused_backward._vectors(torch.empty(4, 64), multiples_of=(6,))  # fp32: multiples of 4



# fp32 and fp16 with --slow (fp16: the same template on the other 16-bit type)
@pytest.mark.parametrize("kind", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16",
                                  pytest.param("float16", marks=pytest.mark.slow)])
def test_the_output_layer_norm_compiles_at_every_tile(kind):
    """The output LayerNorm's forward (a thread per column of the tile, in its 16-byte and its
    scalar form) compiles without spills at every tile it can get, down to the 8 pairs narrow
    tiles halve to."""
    for tile in (8, 16, 64):
        rendered = fused_backward.render(kind, tuning={**fused_backward.TUNING_DEFAULT, "ln_tile": tile})
        compiled = compiler.compile_source(rendered.source, rendered.kernel_name, "sm_90")
        assert "ln_pass_columns<VEC>" in rendered.source and "ln_pass_columns<1>" in rendered.source
        assert not compiled.spill_bytes


def test_the_output_layer_norm_leaves_room_for_its_partial_sums():
    """The forward's partial sums take shared memory beside its tile: the tile it gets is the
    largest (from the tuning's, halving) whose tile, statistics and partial sums stay in the limit."""
    tuning = {**fused_backward.TUNING_DEFAULT, "ln_tile": 64}
    for element_bytes in (2, 4):
        partial_sums = fused_backward.THREADS * (4 // element_bytes) * 4

        def used(hidden, tile):
            return fused_backward._ln_smem(hidden, 1, tile, element_bytes) + 2 * tile * 4 + partial_sums

        tiles = set()
        for hidden in range(8, 3000, 8):
            tile = fused_backward.ln_tile(hidden, element_bytes, tuning, backward=False)
            tiles.add(tile)
            if tile is not None:
                assert used(hidden, tile) <= fused_backward.SMEM_LIMIT, (hidden, element_bytes, tile)
            if tile != 64:
                assert used(hidden, 64 if tile is None else 2 * tile) > fused_backward.SMEM_LIMIT, (hidden, tile)
        assert {64, 8, None} <= tiles


MODELS_FORM = {"P": 128, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 0}
#: Widths of the projection's backward: the models' form both ways, the seed's options at small
#: widths, k padded with the gate in hidden width, and a wide P (Wp's row blocks sliced).
PROJECTION_BACKWARD_WIDTHS = [MODELS_FORM, {**MODELS_FORM, "outgoing": 0},
                              {"P": 64, "H": 32, "outgoing": 1, "gate_normalized": 0, "bias": 1},
                              {"P": 48, "H": 32, "outgoing": 0, "gate_normalized": 1, "bias": 1, "gate_hidden": 1},
                              {"P": 384, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 0}]


#: The kernels a training step's backward can recompute the projections on (wgmma.BACKWARD_PROJECTION).
BACKWARD_LAYOUTS = ("w_registers", "resident")


@pytest.mark.parametrize("layout", BACKWARD_LAYOUTS)
@pytest.mark.parametrize("widths", [w if w["P"] in (128, 384) and w.get("outgoing", 1) else pytest.param(w, marks=pytest.mark.slow)
                                    for w in PROJECTION_BACKWARD_WIDTHS],  # (the others: emulated below)
                         ids=lambda w: "P{P}H{H}".format(**w))
def test_the_projection_backward_kernel_renders_to_its_signature_and_compiles_without_spills(widths, layout,
                                                                                             monkeypatch):
    from pairgen.ops.trimul.strategies import wgmma

    monkeypatch.setattr(wgmma, "BACKWARD_PROJECTION", layout)
    plan = wgmma.backward_plan(TRIMUL, "bfloat16", widths)
    assert plan is not None
    if layout == "resident" and widths["P"] == widths["H"] == 128:
        assert not plan.params["w_registers"], "the resident backward's point is feasible at P = H = 128"
    rendered = codegen.render_plan(plan)
    compiled = compiler.compile_source(rendered.source, plan.main.name, "sm_90")
    for name in (k.name for k in plan.kernels):
        assert compiled.kernels[name]["spill_bytes"] == 0, compiled.summary()


def _d_proj64(module, x, mask, d_a, d_b) -> torch.Tensor:
    """The closed form's d_proj (B, 4, H, N*N) in float64: the gates' chain rule on the float64
    pre-activations of x."""
    B, N, _, P = x.shape
    H = module.widths["H"]
    p = {k: v.double() for k, v in module.named_parameters()}
    xn = torch.nn.functional.layer_norm(x.double(), (P,), p["layer_norm_in.weight"], p["layer_norm_in.bias"],
                                        module.layer_norm_in.eps)

    def pre(name):
        v = xn @ p[f"{name}.weight"].T + (p[f"{name}.bias"] if f"{name}.bias" in p else 0.0)
        return v.permute(0, 3, 1, 2).reshape(B, H, N * N)

    keep = mask.double().reshape(B, 1, N * N)
    slots = []
    for d, (value, gate) in ((d_a, ("proj_a", "gate_a")), (d_b, ("proj_b", "gate_b"))):
        d, s = d.double().view(B, H, N * N) * keep, torch.sigmoid(pre(gate))
        slots += [d * s, d * pre(value) * s * (1 - s)]
    return torch.stack(slots, 1)


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")
@pytest.mark.parametrize("widths,B,N,dtype,float_mask", [(MODELS_FORM, 1, 37, torch.bfloat16, False),
                                                         (MODELS_FORM, 2, 36, torch.bfloat16, False),
                                                         (PROJECTION_BACKWARD_WIDTHS[1], 2, 8, torch.float16, True),
                                                         (PROJECTION_BACKWARD_WIDTHS[3], 3, 1, torch.bfloat16, False)],
                         ids=["models-N37", "models-whole-rows-B2-N36", "incoming-N8-float-mask", "k-padded-N1"])
@pytest.mark.parametrize("layout", BACKWARD_LAYOUTS)
def test_the_projection_backward_kernel_matches_float64_emulated(widths, B, N, dtype, float_mask, layout,
                                                                 monkeypatch):
    """d_proj from the kernel (run on the CPU emulator) against float64 of the same rounded inputs
    and weights: the bf16/fp16 forward standard (relative L2 1e-2), NaN-prefilled by the emulator's
    0xFF shared memory and every pair written (N*N % 8 == 0, odd, and 1: the kernel's three ways
    to its pairs), on each kernel the backward can take (the resident one where its point is
    feasible: P = H = 128 here). B2 N36 gives each warpgroup of the emulator's few blocks several
    tiles of whole rows and a last tile half past the end: the resident kernel's gradient loads
    run passes ahead and into the next tile."""
    from emulator import emulated
    from pairgen.ops.trimul.strategies import wgmma

    monkeypatch.setattr(wgmma, "BACKWARD_PROJECTION", layout)
    gen = generator(80 + N)
    module = TRIMUL.make_module(widths, gen).to(dtype)
    H = widths["H"]
    x = torch.randn(B, N, N, widths["P"], generator=gen).to(dtype)
    mask = torch.rand(B, N, N, generator=gen) > 0.25
    mask = mask.float() if float_mask else mask
    d_a, d_b = (torch.randn(B * H, N, N, generator=gen).to(dtype) for _ in range(2))
    with emulated():
        precision = str(dtype).split(".")[1]
        packed = wgmma.pack_given(dict(module.named_parameters()), module.widths, precision)
        d_proj = wgmma.run_projection_backward(module, x, mask, d_a, d_b, precision, packed)
    expected = _d_proj64(module, x, mask, d_a, d_b)
    assert torch.isfinite(d_proj).all()
    for slot in range(4):
        error = ((d_proj[:, slot].double() - expected[:, slot]).norm() / expected[:, slot].norm()).item()
        assert error <= 1e-2, f"slot {slot}: {error}"


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")
@pytest.mark.parametrize("widths,B,N,dtype,float_mask",  # (the second: the switch's other side only, --slow)
                         [(MODELS_FORM, 2, 36, torch.bfloat16, False),
                          pytest.param(PROJECTION_BACKWARD_WIDTHS[1], 2, 8, torch.float16, True, marks=pytest.mark.slow)],
                         ids=["models-whole-rows-B2-N36", "incoming-N8-float-mask"])
def test_the_resident_backward_with_x_normalised_in_registers_or_not_matches_float64_emulated(widths, B, N, dtype,
                                                                                             float_mask, monkeypatch):
    """wgmma.BACKWARD_NORMALIZED_X: on (the default, which the test above runs), the resident
    backward normalises x in registers (p_normalized_x, every row of Wp halved so that the products
    give p / 2 and g / 2) and compiles without spills; off, its point has no trace of it and its
    d_proj meets float64 as above."""
    from pairgen.ops.trimul.strategies import wgmma

    plan = wgmma.backward_plan(TRIMUL, "bfloat16", widths)
    assert plan.params["p_normalized_x"] and "stage_projection_bias" in codegen.render_plan(plan).source
    if dtype is torch.bfloat16:
        rendered = codegen.render_plan(plan)
        compiled = compiler.compile_source(rendered.source, plan.main.name, "sm_90")
        assert all(compiled.kernels[k.name]["spill_bytes"] == 0 for k in plan.kernels), compiled.summary()
    monkeypatch.setattr(wgmma, "BACKWARD_NORMALIZED_X", False)
    plan = wgmma.backward_plan(TRIMUL, "bfloat16", widths)
    assert not plan.params["p_normalized_x"] and "stage_projection_bias" not in codegen.render_plan(plan).source
    test_the_projection_backward_kernel_matches_float64_emulated(widths, B, N, dtype, float_mask, "resident",
                                                                 monkeypatch)


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")
@pytest.mark.parametrize("layout", BACKWARD_LAYOUTS)
def test_16_bit_gradients_through_the_projection_backward_kernel_meet_the_standard_emulated(layout):
    """The 16-bit closed form with its fused kernels and the projection's backward kernel, all on
    the CPU emulator: every gradient within the 16-bit standard, and the kernel ran."""
    from pairgen.ops.trimul.strategies import wgmma

    runs = assert_emulated_16_bit_step_meets_the_standard(91, 23, (wgmma, "run_projection_backward"),
                                                          ((wgmma, "BACKWARD_PROJECTION", layout),))
    assert runs, "the projection's backward kernel did not run"


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")
@pytest.mark.parametrize("dtype,ln_tile,hidden,L", [(torch.float32, 64, 48, 37 * 37), (torch.bfloat16, 64, 128, 23 * 23),
                                                     (torch.float16, 16, 40, 9 * 9), (torch.bfloat16, 32, 24, 7),
                                                     (torch.bfloat16, 64, 128, 12 * 12), (torch.float16, 32, 96, 80)],
                         ids=["fp32", "bf16", "fp16-tile16", "bf16-short-plane", "bf16-vectors", "fp16-vectors-tile32"])
def test_the_output_layer_norm_backward_kernel_matches_float64_emulated(dtype, ln_tile, hidden, L):
    """The channels-first LayerNorm's backward kernel (run on the CPU emulator, 0xFF-filled shared
    memory) against float64 autograd of the same rounded inputs: d z within the dtype's rounding
    (relative L2 1e-5 in fp32, 1e-2 in 16 bits), d gamma and d beta to fp32 sums, at planes that
    end mid-tile and hidden widths that are and are not multiples of 16 bytes' values (the last two
    cases: 16-byte accesses)."""
    from emulator import emulated

    gen = generator(70 + hidden)
    B = 2
    z = (torch.randn(B, hidden, L, generator=gen) * 3 + 1).to(dtype)
    gamma = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    d_zn = torch.randn(B * L, hidden, generator=gen).to(dtype)
    rows = z.double().transpose(1, 2).reshape(B * L, hidden)
    mean = rows.mean(1)
    rstd = (rows.var(1, unbiased=False) + 1e-5).rsqrt()
    tuning = {**fused_backward.TUNING_DEFAULT, "ln_tile": ln_tile}
    with emulated():
        d_z, d_gamma, d_beta = fused_backward.layer_norm_channels_first_backward(
            d_zn, z, mean.float(), rstd.float(), gamma, 1e-5, tuning)
    rows64 = rows.clone().requires_grad_()
    gamma64, beta64 = gamma.double().requires_grad_(), torch.zeros(hidden, dtype=torch.float64, requires_grad=True)
    torch.nn.functional.layer_norm(rows64, [hidden], gamma64, beta64, 1e-5).backward(d_zn.double())
    expected = rows64.grad.view(B, L, hidden).transpose(1, 2)
    bound = 1e-5 if dtype is torch.float32 else 1e-2
    for name, ours, exact in (("d z", d_z, expected), ("d gamma", d_gamma, gamma64.grad), ("d beta", d_beta, beta64.grad)):
        assert torch.isfinite(ours).all(), name
        error = ((ours.double() - exact).norm() / exact.norm()).item()
        assert error <= (bound if name == "d z" else 1e-5), f"{name}: {error}"


def test_a_training_forward_runs_the_modules_own_wgmma_projection_else_the_first_feasible_default(monkeypatch):
    """wgmma.forward_projection_variant: the variant the module's inference runs for the length
    where it is a wgmma one without Wp in registers (a first-use Pending's default too); for a
    w_registers, mma or reference choice, the first default point feasible at the widths (built
    through runtime.variant_of)."""
    from types import SimpleNamespace

    from pairgen import runtime
    from pairgen.ops.trimul.strategies import wgmma

    module = TRIMUL.make_module(MODELS_FORM, generator(3)).bfloat16()
    x = torch.zeros(1, 8, 8, MODELS_FORM["P"], dtype=torch.bfloat16)
    built = []
    monkeypatch.setattr(runtime, "variant_of", lambda plan, device_index: built.append(plan) or ("built", plan))
    first = next(p for s, p in TRIMUL.at("bfloat16").default_points if s == "wgmma")

    def chosen(plan_params, strategy="wgmma"):
        return SimpleNamespace(plan=SimpleNamespace(strategy=strategy, params=plan_params))

    own = chosen({**first, "p_groups": 2})
    for choice in (own, SimpleNamespace(variant=own)):  # a variant, and a first_use.Pending holding it
        monkeypatch.setattr(type(module), "variant_for", lambda self, n, device, precision="float32", c=choice: c)
        assert wgmma.forward_projection_variant(module, x, "bfloat16") is own
    assert not built
    for choice in (chosen({**first, "w_registers": True}), chosen({}, strategy="mma"), None):
        monkeypatch.setattr(type(module), "variant_for", lambda self, n, device, precision="float32", c=choice: c)
        tag, plan = wgmma.forward_projection_variant(module, x, "bfloat16")
        assert tag == "built" and plan.strategy == "wgmma" and plan.params == {**plan.params, **first}
        assert not plan.params["w_registers"]


#: Widths of the output gate's backward kernel: the models' form, biases with the gate on x and P
#: apart from H, and the narrowest H.
OUTPUT_BACKWARD_WIDTHS = [MODELS_FORM, {"P": 48, "H": 32, "outgoing": 0, "gate_normalized": 0, "bias": 1},
                          {"P": 64, "H": 16, "outgoing": 1, "gate_normalized": 1, "bias": 0}]


# fp16 with --slow: the same template on the other 16-bit type
@pytest.mark.parametrize("kind", ["bfloat16", pytest.param("float16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("widths", OUTPUT_BACKWARD_WIDTHS, ids=lambda w: "P{P}H{H}".format(**w))
def test_the_output_backward_kernel_renders_and_compiles_without_spills(kind, widths):
    from pairgen.ops.trimul import output_backward

    rendered = output_backward.render(kind, widths["P"], widths["H"], bool(widths["bias"]))
    compiled = compiler.compile_source(rendered.source, rendered.kernel_name, "sm_90")
    assert compiled.spill_bytes == 0 and compiled.stack_bytes == 0, compiled.summary()


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")
@pytest.mark.parametrize("dtype,P,H,B,L,bias", [(torch.bfloat16, 128, 128, 1, 37 * 37, False),
                                                (torch.float16, 48, 32, 2, 75, True),
                                                (torch.bfloat16, 64, 16, 2, 40, False),
                                                (torch.bfloat16, 32, 16, 1, 1, False)],
                         ids=["models", "bias-fp16-two-batches", "chunked-planes", "one-pair"])
def test_the_output_side_backward_kernel_matches_float64_emulated(dtype, P, H, B, L, bias):
    """zn, d_o, d_u, d_gate_in, d_z and the LayerNorm's d gamma and d beta from the kernel (CPU
    emulator, 0xFF-filled shared memory) against float64 autograd of the same rounded inputs and
    weights: the 16-bit forward standard (relative L2 1e-2) for the 16-bit values, fp32 sums for
    d gamma and d beta within 1e-2 as well (they add 16-bit products), at pair counts that end
    mid-tile, tiles across two batches' planes, planes of whole 16-byte chunks (40) and of single
    values, and one pair. d z is written over z."""
    from emulator import emulated
    from pairgen.ops.trimul import output_backward

    gen = generator(100 + P + L)
    M = B * L
    z = (torch.randn(B, H, L, generator=gen) * 2 + 0.5).to(dtype)
    gate_in, g = (torch.randn(M, P, generator=gen).to(dtype) for _ in range(2))
    gamma, beta = (torch.rand(H, generator=gen) + 0.5).to(dtype), torch.randn(H, generator=gen).to(dtype)
    wo, wg = (torch.randn(P, k, generator=gen) / k ** 0.5 for k in (H, P))
    wo, wg = wo.to(dtype), wg.to(dtype)
    bo, bg = (torch.randn(P, generator=gen).to(dtype) for _ in range(2)) if bias else (None, None)
    consumed = z.clone()
    with emulated():
        ours = output_backward.output_side_backward(consumed, gate_in, g, (gamma, beta, 1e-5), wo, wg, bo, bg)
    assert ours["d_z"].data_ptr() == consumed.data_ptr(), "d z in z's storage"
    rows = z.double().transpose(1, 2).reshape(M, H).requires_grad_()
    gamma64, beta64 = gamma.double().requires_grad_(), beta.double().requires_grad_()
    zn = torch.nn.functional.layer_norm(rows, [H], gamma64, beta64, 1e-5)
    o = zn @ wo.double().t() + (bo.double() if bias else 0)
    u = (gate_in.double() @ wg.double().t() + (bg.double() if bias else 0)).requires_grad_()
    o.retain_grad()
    ((o * torch.sigmoid(u)) * g.double()).sum().backward()
    d_gate_in = u.grad @ wg.double()
    exact = {"zn": zn.detach(), "d_o": o.grad, "d_u": u.grad, "d_gate_in": d_gate_in,
             "d_z": rows.grad.view(B, L, H).transpose(1, 2), "d_gamma": gamma64.grad, "d_beta": beta64.grad}
    for name, expected in exact.items():
        mine = ours[name]
        assert mine.shape == expected.shape and torch.isfinite(mine).all(), name
        error = ((mine.double() - expected).norm() / expected.norm()).item()
        assert error <= 1e-2, f"{name}: {error}"


@pytest.mark.slow  # a kernel switch's own cases, both sides (its default runs in the fast tests above)
@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")
@pytest.mark.parametrize("dtype,P,H,B,L,bias", [(torch.bfloat16, 128, 128, 1, 37 * 37, False),
                                                (torch.float16, 48, 32, 2, 75, True)],
                         ids=["models", "bias-fp16-two-batches"])
def test_the_output_side_backward_with_descriptors_made_once_matches_float64_emulated(dtype, P, H, B, L, bias,
                                                                                     monkeypatch):
    """output_backward.DESCRIPTORS_ONCE (on since session 50): the kernel's weights' and tiles'
    descriptors made once, each product adding its offset, meet float64 as the test above does and
    compile without spills at P = H = 128; off (the earlier kernel), the source has no trace of them."""
    from pairgen.ops.trimul import output_backward

    monkeypatch.setattr(output_backward, "DESCRIPTORS_ONCE", False)
    assert "desc_wo" not in output_backward.render("bfloat16", 128, 128).source
    monkeypatch.setattr(output_backward, "DESCRIPTORS_ONCE", True)
    rendered = output_backward.render("bfloat16", 128, 128)
    assert "desc_wo + (core_offset(c0, 2 * ks, ZC) >> 4)" in rendered.source
    if P == 128:
        compiled = compiler.compile_source(rendered.source, rendered.kernel_name, "sm_90")
        assert compiled.spill_bytes == 0 and compiled.stack_bytes == 0, compiled.summary()
    test_the_output_side_backward_kernel_matches_float64_emulated(dtype, P, H, B, L, bias)


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")
@pytest.mark.parametrize("widths,B,N,dtype", [(MODELS_FORM, 1, 23, torch.bfloat16), (OUTPUT_BACKWARD_WIDTHS[1], 2, 9, torch.float16)],
                         ids=["models-N23", "bias-gate-on-x-fp16"])
@pytest.mark.parametrize("path", ["recomputed", "saved"])
@pytest.mark.parametrize("projections", ["kernels", "cuBLAS"])
def test_16_bit_gradients_through_the_output_side_kernel_meet_the_standard_emulated(widths, B, N, dtype, path,
                                                                                    projections):
    """The 16-bit closed form with its fused kernels and the output side's backward kernel, on the
    CPU emulator: every gradient within the 16-bit standard, the kernel ran, and a saving forward
    (the training call's) keeps none of zn, o and u for it and gives the reference's output. The
    projection kernels' forward takes its output from the projection's own output kernel; with
    cuBLAS's projections (wgmma.TRAINING_PROJECTION_KERNELS off) it makes zn, o and u, gates into
    o's storage and drops them. The output side's two weight gradients come from one row_products
    kernel."""
    from unittest import mock

    from emulator import emulated
    from pairgen.ops.trimul import backward, output_backward
    from pairgen.ops.trimul.strategies import wgmma

    gen = generator(110 + N)
    module = TRIMUL.make_module(widths, gen).to(dtype)
    x, mask = TRIMUL.make_inputs({"B": B, "N": N, **widths}, gen, "cauchy")
    x, g = x.to(dtype), torch.randn(x.shape, generator=gen).to(dtype)
    params = {name: p.detach() for name, p in module.named_parameters()}
    precision = str(dtype).split(".")[1]
    runs, real = [], output_backward.output_side_backward
    forwards, real_forward = [], wgmma.run_output_forward
    weight_runs, real_weights = [], row_products.row_products
    with emulated(), mock.patch.object(fused_backward, "enabled", lambda t: True), \
            mock.patch.object(output_backward, "OUTPUT_BACKWARD_KERNEL", True), \
            mock.patch.object(output_backward, "output_side_backward", lambda *a: runs.append(a) or real(*a)), \
            mock.patch.object(wgmma, "run_output_forward", lambda *a: forwards.append(a) or real_forward(*a)), \
            mock.patch.object(wgmma, "TRAINING_PROJECTION_KERNELS", projections == "kernels"), \
            mock.patch.object(layer_norm_rows, "applies", lambda t, cols: True), \
            mock.patch.object(row_products, "applies", lambda pairs: True), \
            mock.patch.object(row_products, "row_products", lambda pairs: weight_runs.append(pairs) or real_weights(pairs)):
        if path == "recomputed":
            ours = module.analytic_gradients([x, mask], list(params.values()), g)
            ours = [ours[0], *ours[2:]]
        else:
            out, saved = backward.forward_saving(module, x, mask, params, precision)
            assert saved.state.o is None and saved.state.u is None
            assert saved.state.zn is None and bool(forwards) == (projections == "kernels"), len(forwards)
            with torch.no_grad():
                expected = TRIMUL.make_reference(module).double()(x.double(), mask)
            assert ((out.double() - expected).norm() / expected.norm()).item() <= 1e-2
            grads = backward.gradients_from(module, saved, g)
            ours = [grads["input"], *(grads[name] for name in params)]
    assert len(runs) == 1, "the output side's backward kernel did not run once"
    assert [len(pairs) for pairs in weight_runs] == [2], "the output side's two weight products in one kernel"
    assert_16_bit_gradients_meet_the_standard(module, (x, mask), g, ours)


@pytest.mark.slow  # a kernel switch's own cases, both sides (its default runs in the fast tests above)
@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")
@pytest.mark.parametrize("widths,B,N,dtype,float_mask", [(MODELS_FORM, 1, 37, torch.bfloat16, False),
                                                         (MODELS_FORM, 2, 36, torch.bfloat16, False),
                                                         (PROJECTION_BACKWARD_WIDTHS[1], 2, 8, torch.float16, True)],
                         ids=["models-N37", "models-whole-rows-B2-N36", "incoming-N8-float-mask"])
def test_the_resident_backward_through_addresses_made_once_a_tile_matches_float64_emulated(widths, B, N, dtype,
                                                                                         float_mask, monkeypatch):
    """wgmma.BACKWARD_POINTERS (on since session 50): the resident backward's gradient loads and d_proj
    stores through the lane's addresses made once a tile (the next tile's for the passes loaded
    across the boundary) meet float64 as the test above does, with odd rows (one element at a
    time), several tiles a warpgroup and a float mask; it compiles without spills or a stack frame
    (its ring of loads stays in registers); off (the earlier kernel), it has no trace of it."""
    from pairgen.ops.trimul.strategies import wgmma

    monkeypatch.setattr(wgmma, "BACKWARD_POINTERS", False)
    assert "BackwardPointers" not in codegen.render_plan(wgmma.backward_plan(TRIMUL, "bfloat16", widths)).source
    monkeypatch.setattr(wgmma, "BACKWARD_POINTERS", True)
    plan = wgmma.backward_plan(TRIMUL, "bfloat16", widths)
    rendered = codegen.render_plan(plan)
    assert "ptrs.load = ptrs.load_next;" in rendered.source
    if widths is MODELS_FORM and N == 37:
        compiled = compiler.compile_source(rendered.source, plan.main.name, "sm_90")
        kernel = compiled.kernels[plan.main.name]
        assert kernel["spill_bytes"] == 0 and kernel["stack_bytes"] == 0, compiled.summary()
    test_the_projection_backward_kernel_matches_float64_emulated(widths, B, N, dtype, float_mask, "resident",
                                                                 monkeypatch)


@pytest.mark.slow  # a kernel switch's own cases, both sides (its default runs in the fast tests above)
@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")
def test_a_saving_forward_hands_x_statistics_to_its_output_kernel_emulated(monkeypatch):
    """wgmma.OUTPUT_STATS_FROM_PROJECTION (on since session 50): a training call's forward on the projection kernels
    passes the statistics its projection wrote to its output kernel, and the output and every
    gradient still meet the standard (the test above, models' form, saved), on the first default
    point (the forward's variant where the module has none of its own)."""
    from pairgen.module.kernel_module import KernelModule
    from pairgen.ops.trimul.strategies import wgmma

    monkeypatch.setattr(wgmma, "OUTPUT_STATS_FROM_PROJECTION", True)
    monkeypatch.setattr(KernelModule, "variant_for", lambda self, *args: None)
    handed, real = [], wgmma.run_output_forward
    monkeypatch.setattr(wgmma, "run_output_forward",
                        lambda projected, *rest: handed.append("stats" in projected.stats) or real(projected, *rest))
    test_16_bit_gradients_through_the_output_side_kernel_meet_the_standard_emulated(MODELS_FORM, 1, 23, torch.bfloat16,
                                                                                    "saved", "kernels")
    assert handed == [True], handed


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")
def test_the_projection_backward_reads_the_forward_row_statistics_emulated():
    """With the input LayerNorm's row kernel (the GPU's path), the projection's sliced backward
    kernel (w_registers at P = H = 128) reads that kernel's mean and 1/std of x instead of running its own statistics kernel,
    and the gradients meet the 16-bit standard (CPU emulator)."""
    from unittest import mock

    from emulator import emulated
    from pairgen.ops.trimul.strategies import wgmma

    gen = generator(93)
    module = TRIMUL.make_module(MODELS_FORM, gen).bfloat16()
    x, mask = TRIMUL.make_inputs({"B": 1, "N": 21, **MODELS_FORM}, gen, "cauchy")
    x, g = x.bfloat16(), torch.randn(x.shape, generator=gen).bfloat16()
    own_statistics, given = [], []
    real_statistics, real_backward = wgmma._row_statistics, wgmma.run_projection_backward
    with emulated(), mock.patch.object(fused_backward, "enabled", lambda t: True), \
            mock.patch.object(layer_norm_rows, "applies", lambda t, cols: True), \
            mock.patch.object(wgmma, "TRAINING_PROJECTION_KERNELS", True), \
            mock.patch.object(wgmma, "BACKWARD_PROJECTION", "w_registers"), \
            mock.patch.object(wgmma, "_row_statistics", lambda *a: own_statistics.append(a) or real_statistics(*a)), \
            mock.patch.object(wgmma, "run_projection_backward", lambda *a: given.append(a[-1]) or real_backward(*a)):
        assert wgmma.backward_plan(TRIMUL, "bfloat16", module.widths).kernels[0].name.endswith("_stats")
        ours = module.analytic_gradients([x, mask], [p.detach() for p in module.parameters()], g)
    assert len(given) == 1 and given[0] is not None and given[0].shape == (2, 21 * 21)
    assert not own_statistics, "the backward ran its own statistics kernel"
    assert_16_bit_gradients_meet_the_standard(module, (x, mask), g, [ours[0], *ours[2:]])
