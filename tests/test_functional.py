"""pairgen.triangle_multiplicative_update (cuEquivariance's arguments) on the CPU, against a copy of
the computation written from Boltz's public TriangleMultiplicationOutgoing/Incoming forward (its
PyTorch path): both directions, with and without biases, masks of every kind and none, unbatched
input, other eps; gradients reach the caller's weights; in-place weight updates are seen; bad
arguments say what is wrong."""
from __future__ import annotations

import enum

import pytest
import torch

import pairgen
from pairgen import TriangleMultiplication, functional

P, H = 24, 16


def boltz_form(x, direction, mask, w, eps=1e-5):
    """Boltz's forward, written out: norm_in, p_in * sigmoid(g_in), mask, chunk(2) into a and b, the
    einsum of the direction, p_out(norm_out(.)) * sigmoid(g_out(normalised input))."""
    x = torch.nn.functional.layer_norm(x, (x.shape[-1],), w["norm_in_weight"], w["norm_in_bias"], eps)
    x_in = x
    x = torch.nn.functional.linear(x, w["p_in_weight"], w.get("p_in_bias")) * torch.nn.functional.linear(
        x, w["g_in_weight"], w.get("g_in_bias")).sigmoid()
    x = x * mask.unsqueeze(-1)
    a, b = torch.chunk(x.float(), 2, dim=-1)
    eq = "bikd,bjkd->bijd" if direction == "outgoing" else "bkid,bkjd->bijd"
    x = torch.einsum(eq, a, b)
    x = torch.nn.functional.layer_norm(x, (x.shape[-1],), w["norm_out_weight"], w["norm_out_bias"], eps)
    return torch.nn.functional.linear(x, w["p_out_weight"], w.get("p_out_bias")) * torch.nn.functional.linear(
        x_in, w["g_out_weight"], w.get("g_out_bias")).sigmoid()


def weights(gen, bias: bool, dtype=torch.float32, P=P, H=H):
    w = {"norm_in_weight": 1 + 0.1 * torch.randn(P, generator=gen), "norm_in_bias": 0.1 * torch.randn(P, generator=gen),
         "p_in_weight": torch.randn(2 * H, P, generator=gen) / P ** 0.5,
         "g_in_weight": torch.randn(2 * H, P, generator=gen) / P ** 0.5,
         "norm_out_weight": 1 + 0.1 * torch.randn(H, generator=gen), "norm_out_bias": 0.1 * torch.randn(H, generator=gen),
         "p_out_weight": torch.randn(P, H, generator=gen) / H ** 0.5, "g_out_weight": torch.randn(P, P, generator=gen) / P ** 0.5}
    if bias:
        w.update(p_in_bias=torch.randn(2 * H, generator=gen), g_in_bias=torch.randn(2 * H, generator=gen),
                 p_out_bias=torch.randn(P, generator=gen), g_out_bias=torch.randn(P, generator=gen))
    return {k: v.to(dtype) for k, v in w.items()}


@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
def test_matches_the_boltz_form(direction, bias, mask_kind):
    gen = torch.Generator().manual_seed(1)
    w = weights(gen, bias)
    x = torch.randn(2, 7, 7, P, generator=gen)
    keep = torch.rand(2, 7, 7, generator=gen) > 0.3
    keep[:, 2] = False  # an empty row
    mask = {"bool": keep, "float": keep.float(), "none": None}[mask_kind]
    with torch.no_grad():
        out = pairgen.triangle_multiplicative_update(x, direction, mask, **w)
        expected = boltz_form(x, direction, keep.float() if mask is not None else torch.ones(2, 7, 7), w)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_unbatched_input_other_eps_and_defaults_for_the_layer_norms():
    gen = torch.Generator().manual_seed(2)
    w = weights(gen, bias=False)
    x, mask = torch.randn(5, 5, P, generator=gen), torch.ones(5, 5)
    out = pairgen.triangle_multiplicative_update(x, "incoming", mask, **w, eps=1e-3)
    torch.testing.assert_close(out, boltz_form(x[None], "incoming", mask[None], w, eps=1e-3)[0], rtol=1e-5, atol=1e-5)
    plain = {k: v for k, v in w.items() if not k.startswith("norm")}
    ones = {"norm_in_weight": torch.ones(P), "norm_in_bias": torch.zeros(P), "norm_out_weight": torch.ones(H),
            "norm_out_bias": torch.zeros(H)}
    with torch.no_grad():
        torch.testing.assert_close(pairgen.triangle_multiplicative_update(x, "outgoing", None, **plain),
                                   boltz_form(x[None], "outgoing", torch.ones(1, 5, 5), {**plain, **ones})[0])


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recomputed"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
def test_gradients_reach_the_callers_weights_and_input(monkeypatch, bias, direction, recompute):
    """With gradients wanted the module's closed form runs (its forward keeping the intermediates,
    or with recompute_for_backward its forward and then a backward that recomputes them), its
    gradients mapped onto the caller's fused weights (not the PyTorch path): every gradient within
    the fp32 gradient standard (relative L2 2e-5) of float64 autograd of the definition."""
    monkeypatch.setattr(TriangleMultiplication, "recompute_for_backward", recompute)
    used = closed_form_paths(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    w = {k: v.requires_grad_() for k, v in weights(gen, bias=bias).items()}
    x = torch.randn(1, 9, 9, P, generator=gen, requires_grad=True)
    mask = torch.rand(1, 9, 9, generator=gen) > 0.2
    mask[0, 4] = False
    g = torch.randn(1, 9, 9, P, generator=gen)
    with monkeypatch.context() as patched:
        patched.setattr(functional, "reference", lambda *a, **k: pytest.fail("the PyTorch path ran"))
        (pairgen.triangle_multiplicative_update(x, direction, mask, **w) * g).sum().backward()
    assert used == ["recomputed" if recompute else "saved"]
    assert_gradients_meet_the_fp32_standard(x, direction, mask, w, g)


def closed_form_paths(monkeypatch) -> list:
    """The closed-form backwards the triangle updates take from here on, in order: "saved"
    (intermediates kept by the forward) or "recomputed" (recomputed from the inputs)."""
    used = []
    saved, recomputed = TriangleMultiplication.saved_gradients, TriangleMultiplication.analytic_gradients
    monkeypatch.setattr(TriangleMultiplication, "saved_gradients",
                        staticmethod(lambda *args: used.append("saved") or saved(*args)))
    monkeypatch.setattr(TriangleMultiplication, "analytic_gradients",
                        lambda self, *args, **kw: used.append("recomputed") or recomputed(self, *args, **kw))
    return used


def assert_gradients_meet_the_fp32_standard(x, direction, mask, w: dict, g) -> None:
    """x.grad and every w[k].grad (left by the call under test, loss (out * g).sum()) within
    relative L2 2e-5 of float64 autograd of the definition on the same tensors."""
    x64 = x.detach().double().requires_grad_()
    w64 = {k: v.detach().double().requires_grad_() for k, v in w.items()}
    full = {name: w64.get(name) for name in functional._WEIGHT_NAMES}
    (functional.reference(x64, direction, mask.double(), full) * g.double()).sum().backward()
    for name, ours, exact in [("x", x.grad, x64.grad)] + [(k, w[k].grad, w64[k].grad) for k in sorted(w)]:
        error = ((ours.double() - exact).norm() / exact.norm()).item()
        assert error <= 2e-5, f"gradient of {name}: {error}"


def test_inference_keeps_no_module_per_weights_and_follows_in_place_updates():
    gen = torch.Generator().manual_seed(4)
    w = weights(gen, bias=False)
    x, mask = torch.randn(1, 5, 5, P, generator=gen), torch.ones(1, 5, 5, dtype=torch.bool)
    functional._modules.clear()
    with torch.no_grad():
        first = pairgen.triangle_multiplicative_update(x, "outgoing", mask, **w)
        again = pairgen.triangle_multiplicative_update(x, "outgoing", mask, **w)
        assert not functional._modules and torch.equal(first, again)
        w["p_out_weight"].mul_(2.0)  # an optimizer-style update between calls
        updated = pairgen.triangle_multiplicative_update(x, "outgoing", mask, **w)
    torch.testing.assert_close(updated, boltz_form(x, "outgoing", mask.float(), w), rtol=1e-5, atol=1e-5)
    assert not torch.equal(updated, first)


def test_bad_arguments_say_what_is_wrong():
    gen = torch.Generator().manual_seed(5)
    w = weights(gen, bias=False)
    x = torch.randn(1, 4, 4, P, generator=gen)
    with pytest.raises(ValueError, match="direction must be"):
        pairgen.triangle_multiplicative_update(x, "sideways", None, **w)
    with pytest.raises(ValueError, match="precision must be None, a TriMulPrecision member or one of"):
        pairgen.triangle_multiplicative_update(x, "outgoing", None, **w, precision="mxfp8")
    with pytest.raises(ValueError, match="missing: \\['g_out_weight'\\]"):
        pairgen.triangle_multiplicative_update(x, "outgoing", None, **{**w, "g_out_weight": None})
    with pytest.raises(ValueError, match="p_out_weight must have shape"):
        pairgen.triangle_multiplicative_update(x, "outgoing", None, **{**w, "p_out_weight": torch.zeros(P, H + 1)})
    with pytest.raises(ValueError, match="mask must have shape"):
        pairgen.triangle_multiplicative_update(x, "outgoing", torch.ones(1, 4, 5), **w)


def test_weights_made_under_inference_mode_are_accepted():
    with torch.inference_mode():
        gen = torch.Generator().manual_seed(6)
        w = weights(gen, bias=False)
        x = torch.randn(1, 5, 5, P, generator=gen)
        out = pairgen.triangle_multiplicative_update(x, "outgoing", None, **w)
        torch.testing.assert_close(out, boltz_form(x, "outgoing", torch.ones(1, 5, 5), w), rtol=1e-5, atol=1e-5)


def test_under_non_reentrant_checkpointing_the_intermediates_are_recomputed(monkeypatch):
    """Activation checkpointing (torch.utils.checkpoint, use_reentrant=False) manages what autograd
    saves through saved-tensor hooks; intermediates kept outside them would stay alive, so such a
    call takes the recomputing path (and its gradients are right)."""
    from torch.utils.checkpoint import checkpoint

    used = closed_form_paths(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    w = {k: v.requires_grad_() for k, v in weights(gen, bias=True).items()}
    x = torch.randn(1, 7, 7, P, generator=gen, requires_grad=True)
    mask = torch.rand(1, 7, 7, generator=gen) > 0.2
    g = torch.randn(1, 7, 7, P, generator=gen)
    out = checkpoint(lambda t: pairgen.triangle_multiplicative_update(t, "incoming", mask, **w), x, use_reentrant=False)
    (out * g).sum().backward()
    assert used == ["recomputed"]
    assert_gradients_meet_the_fp32_standard(x, "incoming", mask, w, g)
    used.clear()
    for v in (x, *w.values()):
        v.grad = None
    (pairgen.triangle_multiplicative_update(x, "incoming", mask, **w) * g).sum().backward()
    assert used == ["saved"], "without checkpointing the intermediates are kept"


def test_a_second_derivative_is_refused_not_zero():
    """The function's gradients carry no autograd graph: differentiating them (create_graph=True)
    raises instead of silently treating the second derivative as zero."""
    gen = torch.Generator().manual_seed(6)
    w = weights(gen, bias=False)
    x = torch.randn(1, 5, 5, P, generator=gen, requires_grad=True)
    out = pairgen.triangle_multiplicative_update(x, "outgoing", None, **w)
    (grad_x,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="second derivative"):
        grad_x.sum().backward()


def test_leading_dimensions_and_masks_as_cuequivariance_takes_them():
    """x of any leading dimensions is flattened into one batch and the result shaped like x; a mask's
    leading dimensions broadcast to x's: Protenix calls with z[None] and an unbatched mask, or with
    5-D z and a (B, N, N) mask."""
    gen = torch.Generator().manual_seed(7)
    w = weights(gen, bias=False)
    x = torch.randn(2, 3, 6, 6, P, generator=gen)
    keep = torch.rand(3, 6, 6, generator=gen) > 0.3
    keep[1, 2] = False
    full = keep.expand(2, 3, 6, 6)
    with torch.no_grad():
        expected = boltz_form(x.reshape(6, 6, 6, P), "incoming", full.reshape(6, 6, 6).float(), w).reshape(x.shape)
        for mask in (keep, keep[None], full, full.float()):
            out = pairgen.triangle_multiplicative_update(x, "incoming", mask, **w)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        z = x[0, 0]  # Protenix: kernel_triangular_mult(z[None], mask=pair_mask (N, N), ...)[0]
        out = pairgen.triangle_multiplicative_update(z[None], "incoming", keep[0], **w)[0]
        torch.testing.assert_close(out, expected[0, 0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="mask must have shape"):
        pairgen.triangle_multiplicative_update(x, "incoming", torch.ones(2, 6, 6, dtype=torch.bool), **w)


class TriMulPrecision(enum.IntEnum):
    """cuEquivariance's precision enum, as it defines it where its ops are not installed."""
    NONE = -1
    DEFAULT = 0
    TF32 = 1
    TF32x3 = 2
    IEEE = 3


@pytest.mark.parametrize("precision", [TriMulPrecision.IEEE, TriMulPrecision.DEFAULT, TriMulPrecision.NONE, "IEEE",
                                       "Default", "none", "bfloat16", "BF16", None])
def test_precision_as_cuequivariance_spells_it(precision):
    """The enum's members and the names in any case are taken; on the CPU every one computes the
    fp32 definition (the 16-bit and TF32 kernels are the GPU's)."""
    gen = torch.Generator().manual_seed(8)
    w = weights(gen, bias=True)
    x = torch.randn(1, 5, 5, P, generator=gen)
    with torch.no_grad():
        out = pairgen.triangle_multiplicative_update(x, "outgoing", None, **w, precision=precision)
    torch.testing.assert_close(out, boltz_form(x, "outgoing", torch.ones(1, 5, 5), w), rtol=1e-5, atol=1e-5)
    assert functional.precision_name(TriMulPrecision.TF32x3) == "tf32x3"


def test_wrong_weights_are_named():
    gen = torch.Generator().manual_seed(9)
    w = weights(gen, bias=False)
    x = torch.randn(1, 4, 4, P, generator=gen)
    with pytest.raises(ValueError, match=r"p_in_weight must have shape \(32, 24\)"):  # only a's H rows
        pairgen.triangle_multiplicative_update(x, "outgoing", None, **{**w, "p_in_weight": w["p_in_weight"][:H]})
    with pytest.raises(ValueError, match="g_out_weight must be a torch.Tensor, got ndarray"):
        pairgen.triangle_multiplicative_update(x, "outgoing", None, **{**w, "g_out_weight": w["g_out_weight"].numpy()})
    with pytest.raises(ValueError, match="p_out_weight must have shape"):
        pairgen.triangle_multiplicative_update(x, "outgoing", None, **{**w, "p_out_weight": w["p_out_weight"].t()})


@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
def test_float64_gradcheck(direction):
    """float64 has no kernel and no closed form: the definition runs, and torch.autograd.gradcheck
    passes through the function (input and every weight)."""
    gen = torch.Generator().manual_seed(10)
    w = {k: v.double().requires_grad_() for k, v in weights(gen, bias=True, P=6, H=4).items()}
    x = torch.randn(1, 4, 4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(1, 4, 4, generator=gen) > 0.3
    names = sorted(w)

    def update(x, *ws):
        return pairgen.triangle_multiplicative_update(x, direction, mask, **dict(zip(names, ws)))

    assert torch.autograd.gradcheck(update, (x, *(w[n] for n in names)))


def test_training_under_a_cpu_autocast():
    """Under torch.autocast("cpu") the gradients are the definition's under the same autocast
    (the closed form chooses its own dtypes, so it stands aside)."""
    gen = torch.Generator().manual_seed(11)
    w = {k: v.requires_grad_() for k, v in weights(gen, bias=False).items()}
    x = torch.randn(1, 6, 6, P, generator=gen, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pairgen.triangle_multiplicative_update(x, "outgoing", None, **w)
        expected = functional.reference(x, "outgoing", None, {n: w.get(n) for n in functional._WEIGHT_NAMES})
    assert out.dtype == expected.dtype
    grads = torch.autograd.grad(out.float().square().sum(), [x, *w.values()])
    exact = torch.autograd.grad(expected.float().square().sum(), [x, *w.values()])
    for ours, theirs in zip(grads, exact):
        torch.testing.assert_close(ours, theirs)


def test_slices_of_a_parameter_taken_on_every_call_find_their_module_again():
    """alphafold3-pytorch's stand-in passes slices of one fused weight, new tensors on every call:
    they lie where the last call's did, so the module kept for training serves them."""
    gen = torch.Generator().manual_seed(12)
    w = weights(gen, bias=False)
    fused = torch.cat([w["p_in_weight"], w["g_in_weight"]])
    x = torch.randn(1, 5, 5, P, generator=gen)
    functional._modules.clear()
    x.requires_grad_()
    for _ in range(3):
        out = pairgen.triangle_multiplicative_update(x, "outgoing", None, **{**w, "p_in_weight": fused[: 2 * H],
                                                                              "g_in_weight": fused[2 * H:]})
    assert len(functional._modules) == 1
    torch.testing.assert_close(out, boltz_form(x, "outgoing", torch.ones(1, 5, 5), w), rtol=1e-5, atol=1e-5)
