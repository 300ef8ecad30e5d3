"""pairgen.adapt on the CPU against copies of the public modules written from their source (the
projects are not installed here): OpenFold's TriangleMultiplicationOutgoing/Incoming (AlphaFold 2
form, biases, parameters shared) and Boltz's (AlphaFold 3 form, fused p_in/g_in, no biases, weights
copied), OpenFold 3's fused form (linear_ab_*, copied; patched on the live weights), both
directions, masks with empty rows; what adapt refuses."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pairgen


class OpenFoldForm(nn.Module):
    """OpenFold's TriangleMultiplicativeUpdate, re-written: LayerNorm in; a, b = p(z)·sigmoid(g(z))·mask;
    outgoing sums a[i,k]·b[j,k] over k, incoming a[k,i]·b[k,j]; LayerNorm out, linear_z; times
    sigmoid(linear_g(z)) of the normalised input."""

    def __init__(self, c_z, c_hidden, _outgoing=True):
        super().__init__()
        self._outgoing = _outgoing
        for name in ("linear_a_p", "linear_a_g", "linear_b_p", "linear_b_g"):
            setattr(self, name, nn.Linear(c_z, c_hidden))
        self.linear_g, self.linear_z = nn.Linear(c_z, c_z), nn.Linear(c_hidden, c_z)
        self.layer_norm_in, self.layer_norm_out = nn.LayerNorm(c_z), nn.LayerNorm(c_hidden)

    def forward(self, z, mask=None):
        mask = (z.new_ones(z.shape[:-1]) if mask is None else mask).unsqueeze(-1)
        z = self.layer_norm_in(z)
        a = self.linear_a_p(z) * torch.sigmoid(self.linear_a_g(z)) * mask
        b = self.linear_b_p(z) * torch.sigmoid(self.linear_b_g(z)) * mask
        if self._outgoing:
            x = torch.einsum("...ikc,...jkc->...ijc", a, b)
        else:
            x = torch.einsum("...kic,...kjc->...ijc", a, b)
        return self.linear_z(self.layer_norm_out(x)) * torch.sigmoid(self.linear_g(z))


class BoltzTriangleMultiplicationIncoming(nn.Module):
    """Boltz's module (AlphaFold 3 form), re-written: fused p_in/g_in of 2·dim rows without bias, the
    first half a, the second b; output gated by g_out of the normalised input. Boltz's two classes
    differ only in the einsum."""

    equation = "bkid,bkjd->bijd"

    def __init__(self, dim):
        super().__init__()
        self.norm_in, self.norm_out = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.p_in, self.g_in = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.p_out, self.g_out = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)

    def forward(self, x, mask):
        x = self.norm_in(x)
        x_in = x
        x = self.p_in(x) * self.g_in(x).sigmoid() * mask.unsqueeze(-1)
        a, b = torch.chunk(x, 2, dim=-1)
        x = torch.einsum(self.equation, a, b)
        return self.p_out(self.norm_out(x)) * self.g_out(x_in).sigmoid()


class BoltzTriangleMultiplicationOutgoing(BoltzTriangleMultiplicationIncoming):
    equation = "bikd,bjkd->bijd"


class OpenFold3FusedForm(nn.Module):
    """OpenFold 3's FusedTriangleMultiplicativeUpdate, re-written: LayerNorm in; ab = mask ·
    sigmoid(linear_ab_g(z)) · linear_ab_p(z), both of 2·c_hidden rows with biases, a the first half
    and b the second; the direction's sum; LayerNorm out, linear_z; times sigmoid(linear_g(z)) of
    the normalised input. With inplace_safe and _add_with_inplace it returns z + update in z."""

    def __init__(self, c_z, c_hidden, _outgoing=True):
        super().__init__()
        self._outgoing, self.c_hidden = _outgoing, c_hidden
        self.linear_ab_p, self.linear_ab_g = nn.Linear(c_z, 2 * c_hidden), nn.Linear(c_z, 2 * c_hidden)
        self.linear_g, self.linear_z = nn.Linear(c_z, c_z), nn.Linear(c_hidden, c_z)
        self.layer_norm_in, self.layer_norm_out = nn.LayerNorm(c_z), nn.LayerNorm(c_hidden)

    def forward(self, z, mask=None, inplace_safe=False, _add_with_inplace=False, **kernel_flags):
        m = (z.new_ones(z.shape[:-1]) if mask is None else mask).unsqueeze(-1)
        zn = self.layer_norm_in(z)
        ab = m * torch.sigmoid(self.linear_ab_g(zn)) * self.linear_ab_p(zn)
        a, b = ab[..., :self.c_hidden], ab[..., self.c_hidden:]
        equation = "...ikc,...jkc->...ijc" if self._outgoing else "...kic,...kjc->...ijc"
        x = self.linear_z(self.layer_norm_out(torch.einsum(equation, a, b))) * torch.sigmoid(self.linear_g(zn))
        return z.add_(x) if inplace_safe and _add_with_inplace else x


def _randomize(module: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return module


def _inputs(P: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 9, 9, P, generator=gen)
    mask = (torch.rand(2, 9, 9, generator=gen) > 0.25).float()
    mask[:, 3] = 0.0
    return x, mask


def _patched(model: nn.Module, P: int, seed: int):
    """Inputs, the model's output, state_dict keys and parameter ids before pairgen.patch, and its report."""
    x, mask = _inputs(P, seed)
    with torch.no_grad():
        before = model(x, mask)
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    return (x, mask), before, keys, params, pairgen.patch(model)


@pytest.mark.parametrize("outgoing", [True, False])
def test_openfold_form_is_adapted_with_shared_parameters(outgoing):
    source = _randomize(OpenFoldForm(24, 16, _outgoing=outgoing), 1)
    adapted = pairgen.adapt(source)
    assert isinstance(adapted, pairgen.TriangleMultiplication)
    assert adapted.direction == ("outgoing" if outgoing else "incoming") and adapted.gate_on == "normalized"
    assert adapted.proj_b.weight is source.linear_b_p.weight and adapted.out_gate.bias is source.linear_g.bias
    x, mask = _inputs(24, 2)
    with torch.no_grad():
        torch.testing.assert_close(adapted(x, mask), source(x, mask), rtol=1e-5, atol=1e-5)
        source.linear_z.weight.mul_(0.5)  # shared: the adapted module sees the update
        torch.testing.assert_close(adapted(x, mask), source(x, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", [BoltzTriangleMultiplicationOutgoing, BoltzTriangleMultiplicationIncoming])
def test_boltz_form_is_adapted_with_copied_weights(cls):
    source = _randomize(cls(16), 3)
    adapted = pairgen.adapt(source)
    assert adapted.direction == ("outgoing" if "Outgoing" in cls.__name__ else "incoming")
    assert not adapted.widths["bias"] and adapted.widths["H"] == 16
    assert adapted.proj_b.weight.data_ptr() != source.p_in.weight.data_ptr(), "copied"
    x, mask = _inputs(16, 4)
    with torch.no_grad():
        torch.testing.assert_close(adapted(x, mask), source(x, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("outgoing", [True, False])
def test_openfold3_fused_form_is_adapted_and_patched(outgoing):
    source = _randomize(OpenFold3FusedForm(24, 8, _outgoing=outgoing), 5)
    adapted = pairgen.adapt(source)
    assert adapted.direction == ("outgoing" if outgoing else "incoming") and adapted.widths["bias"]
    assert torch.equal(adapted.gate_b.weight, source.linear_ab_g.weight[8:]), "b: the second half of the rows"
    x, mask = _inputs(24, 6)
    with torch.no_grad():
        expected = source(x, mask)
        torch.testing.assert_close(adapted(x, mask), expected, rtol=1e-5, atol=1e-5)
        model = nn.ModuleDict({"tri": source})
        keys = list(model.state_dict())
        (line,) = pairgen.patch(model)
        assert "OpenFold 3 fused form" in line and list(model.state_dict()) == keys
        stacked = torch.stack([x, x], dim=1)  # a template stack: a leading dimension more
        got = model["tri"](stacked, mask=torch.stack([mask, mask], dim=1), use_cueq_triangle_kernels=True)
        torch.testing.assert_close(got[:, 1], expected, rtol=1e-5, atol=1e-5)
        z = x.clone()
        added = model["tri"](z, mask=mask, inplace_safe=True, _add_with_inplace=True)
        assert added.data_ptr() == z.data_ptr()
        torch.testing.assert_close(added, x + expected, rtol=1e-5, atol=1e-5)
        source.linear_z.weight.mul_(0.5)  # the stand-in reads the live weights
        torch.testing.assert_close(model["tri"](x, mask), model["tri"].source(x, mask), rtol=1e-5, atol=1e-5)
    assert pairgen.unpatch(model) == 1 and model["tri"] is source


def test_what_adapt_refuses():
    with pytest.raises(ValueError, match="does not recognise Linear"):
        pairgen.adapt(nn.Linear(4, 4))
    odd = OpenFoldForm(8, 8)
    odd.layer_norm_in.eps = 1e-3
    with pytest.raises(ValueError, match="eps"):
        pairgen.adapt(odd)
    nameless = BoltzTriangleMultiplicationOutgoing(8)
    nameless.__class__ = type("Trimul", (BoltzTriangleMultiplicationOutgoing,), {})
    with pytest.raises(ValueError, match="pass direction="):
        pairgen.adapt(nameless)
    assert pairgen.adapt(nameless, direction="incoming").direction == "incoming"


class Trunk(nn.Module):
    """A model holding both forms, nested, as a user's trunk would."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.ModuleDict({"tri_out": BoltzTriangleMultiplicationOutgoing(16),
                                                    "tri_in": BoltzTriangleMultiplicationIncoming(16)})])
        self.openfold_out = OpenFoldForm(16, 8, _outgoing=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x, mask):
        for block in self.blocks:
            x = x + block["tri_out"](x, mask)
            x = x + block["tri_in"](x, mask)
        x = x + self.openfold_out(x, mask)
        return self.head(x).squeeze(-1)


def test_patch_swaps_in_place_and_keeps_parameters_keys_and_results(tmp_path):
    model = _randomize(Trunk(), 7)
    (x, mask), before, keys, params, report = _patched(model, 16, 8)
    assert report == ["blocks.0.tri_out (BoltzTriangleMultiplicationOutgoing): swapped for pairgen (AlphaFold 3 / Boltz form, outgoing)",
                      "blocks.0.tri_in (BoltzTriangleMultiplicationIncoming): swapped for pairgen (AlphaFold 3 / Boltz form, incoming)",
                      "openfold_out (OpenFoldForm): swapped for pairgen (OpenFold form, outgoing)"]
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    assert pairgen.patch(model) == [], "patching twice changes nothing"
    with torch.no_grad():
        torch.testing.assert_close(model(x, mask), before, rtol=1e-5, atol=1e-5)
    # Gradients reach the model's own parameters; a checkpoint round trip works.
    model(x, mask).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, mask), before, rtol=1e-5, atol=1e-5)
    assert pairgen.unpatch(model) == 3 and isinstance(model.openfold_out, OpenFoldForm)


def test_patch_reports_what_it_cannot_swap_and_refuses_a_lone_module():
    model = Trunk()
    model.openfold_out.layer_norm_out.eps = 1e-6
    report = pairgen.patch(model)
    assert report[-1].startswith("openfold_out (OpenFoldForm): not swapped: pairgen's kernels use LayerNorm eps")
    with pytest.raises(ValueError, match="pairgen.adapt"):
        pairgen.patch(OpenFoldForm(8, 8))


class AF3PytorchTrimul(nn.Module):
    """alphafold3-pytorch's TriangleMultiplication, re-written from its public source (the package
    needs ~40 other packages to import): one Linear(P, 4H) into a GLU gives left and right, masked;
    outgoing sums left[i,k]·right[j,k], incoming left[k,j]·right[k,i]; LayerNorm, to_out, times
    sigmoid(out_gate(x)) of its input (normalised by the wrapper below)."""

    def __init__(self, dim, mix):
        super().__init__()
        self.left_right_proj = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.GLU(dim=-1))
        self.out_gate = nn.Linear(dim, dim, bias=False)
        self.mix_einsum_eq = "... i k d, ... j k d -> ... i j d" if mix == "outgoing" else "... k j d, ... k i d -> ... i j d"
        self.to_out_norm = nn.LayerNorm(dim)
        self.to_out = nn.Sequential(nn.Linear(dim, dim, bias=False), nn.Dropout(0.0))

    def forward(self, x, mask):
        left, right = self.left_right_proj(x).chunk(2, dim=-1)
        pair = (mask[..., :, None] & mask[..., None, :])[..., None]
        left, right = left * pair, right * pair
        out = torch.einsum(self.mix_einsum_eq.replace(" ", ""), left, right)
        return self.to_out(self.to_out_norm(out)) * self.out_gate(x).sigmoid()


class PreLayerNorm(nn.Module):
    def __init__(self, fn, dim):
        super().__init__()
        self.fn, self.norm = fn, nn.LayerNorm(dim)

    def forward(self, x, **kwargs):
        return self.fn(self.norm(x), **kwargs)


@pytest.mark.parametrize("mix", ["outgoing", "incoming"])
def test_alphafold3_pytorch_form(mix):
    source = _randomize(PreLayerNorm(AF3PytorchTrimul(16, mix), 16), 11)
    adapted = pairgen.adapt(source)
    assert adapted.direction == mix and not adapted.widths["bias"]
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(2, 9, 9, 16, generator=gen)
    tokens = torch.rand(2, 9, generator=gen) > 0.2
    pair_mask = tokens[:, :, None] & tokens[:, None, :]
    with torch.no_grad():
        torch.testing.assert_close(adapted(x, pair_mask), source(x, mask=tokens), rtol=1e-5, atol=1e-5)


def test_patch_takes_the_alphafold3_pytorch_form_with_its_token_mask():
    model = nn.ModuleDict({"tri_out": PreLayerNorm(AF3PytorchTrimul(16, "outgoing"), 16),
                           "tri_in": PreLayerNorm(AF3PytorchTrimul(16, "incoming"), 16)})
    _randomize(model, 13)
    gen = torch.Generator().manual_seed(14)
    x, tokens = torch.randn(2, 7, 7, 16, generator=gen), torch.rand(2, 7, generator=gen) > 0.2
    with torch.no_grad():
        before = [model[k](x, mask=tokens) for k in ("tri_out", "tri_in")]
        report = pairgen.patch(model)
        assert [line.split(": ")[1] for line in report] == ["swapped for pairgen (alphafold3-pytorch form, outgoing)",
                                                            "swapped for pairgen (alphafold3-pytorch form, incoming)"]
        for k, expected in zip(("tri_out", "tri_in"), before):
            torch.testing.assert_close(model[k](x, mask=tokens), expected, rtol=1e-5, atol=1e-5)
        model["tri_out"].source.fn.to_out[0].weight.mul_(3.0)  # an update reaches the stand-in's copies
        torch.testing.assert_close(model["tri_out"](x, mask=tokens), model["tri_out"].source(x, mask=tokens),
                                   rtol=1e-5, atol=1e-5)


class LucidrainsTriangleMultiplicativeModule(nn.Module):
    """lucidrains' triangle-multiplicative-module (TriangleMultiplicativeModule), re-written from its
    public source (IgFold and others carry copies): LayerNorm; left/right projections times the mask,
    then times their sigmoid gates; outgoing sums left[i,k]·right[j,k], ingoing left[k,j]·right[k,i];
    to_out_norm, times sigmoid(out_gate(x)) in hidden width, then to_out. Every Linear has a bias."""

    def __init__(self, *, dim, hidden_dim=None, mix="ingoing"):
        super().__init__()
        hidden_dim = hidden_dim or dim
        self.norm = nn.LayerNorm(dim)
        self.left_proj, self.right_proj = nn.Linear(dim, hidden_dim), nn.Linear(dim, hidden_dim)
        self.left_gate, self.right_gate = nn.Linear(dim, hidden_dim), nn.Linear(dim, hidden_dim)
        self.out_gate = nn.Linear(dim, hidden_dim)
        self.mix_einsum_eq = "... i k d, ... j k d -> ... i j d" if mix == "outgoing" else "... k j d, ... k i d -> ... i j d"
        self.to_out_norm = nn.LayerNorm(hidden_dim)
        self.to_out = nn.Linear(hidden_dim, dim)

    def forward(self, x, mask=None):
        if mask is not None:
            mask = mask[..., None]
        x = self.norm(x)
        left, right = self.left_proj(x), self.right_proj(x)
        if mask is not None:
            left, right = left * mask, right * mask
        left = left * self.left_gate(x).sigmoid()
        right = right * self.right_gate(x).sigmoid()
        out = torch.einsum(self.mix_einsum_eq.replace(" ", ""), left, right)
        return self.to_out(self.to_out_norm(out) * self.out_gate(x).sigmoid())


@pytest.mark.parametrize("mix", ["outgoing", "ingoing"])
def test_lucidrains_form_is_adapted_with_the_gate_in_hidden_width(mix):
    """P != H, so the gate's width tells the placements apart; the module computes what the source
    does (the reference on the CPU) and its state_dict loads into a reference of the same options."""
    source = _randomize(LucidrainsTriangleMultiplicativeModule(dim=24, hidden_dim=16, mix=mix), 13)
    adapted = pairgen.adapt(source)
    assert adapted.direction == ("outgoing" if mix == "outgoing" else "incoming")
    assert adapted.gate_on == "normalized" and adapted.gate_at == "hidden" and adapted.widths["bias"]
    assert adapted.out_gate.weight.shape == (16, 24)
    x, mask = _inputs(24, 14)
    with torch.no_grad():
        torch.testing.assert_close(adapted(x, mask), source(x, mask), rtol=1e-5, atol=1e-5)
        reference = pairgen.TriangleMultiplicationReference(24, 16, adapted.direction, "normalized", gate_at="hidden")
        reference.load_state_dict(adapted.state_dict())
        torch.testing.assert_close(reference(x, mask), source(x, mask), rtol=1e-5, atol=1e-5)


class LucidrainsTrunk(nn.Module):
    def __init__(self):
        super().__init__()
        self.tri_out = LucidrainsTriangleMultiplicativeModule(dim=16, hidden_dim=8, mix="outgoing")
        self.tri_in = LucidrainsTriangleMultiplicativeModule(dim=16, hidden_dim=8, mix="ingoing")
        self.head = nn.Linear(16, 1)

    def forward(self, x, mask):
        x = x + self.tri_out(x, mask)
        x = x + self.tri_in(x, mask)
        return self.head(x).squeeze(-1)


def test_patch_swaps_lucidrains_modules_on_their_own_parameters():
    """The stand-in runs pairgen on the model's own Parameter objects: keys, ids and results kept, an
    optimizer step on the model reaches the next call, gradients reach the parameters; a module
    without a bias is reported, not swapped."""
    model = _randomize(LucidrainsTrunk(), 17)
    (x, mask), before, keys, params, report = _patched(model, 16, 18)
    assert report == ["tri_out (LucidrainsTriangleMultiplicativeModule): swapped for pairgen (lucidrains form, outgoing)",
                      "tri_in (LucidrainsTriangleMultiplicativeModule): swapped for pairgen (lucidrains form, incoming)"]
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    with torch.no_grad():
        torch.testing.assert_close(model(x, mask), before, rtol=1e-5, atol=1e-5)
    model(x, mask).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    with torch.no_grad():
        after = model(x, mask)
        assert not torch.allclose(after, before)
        assert pairgen.unpatch(model) == 2
        torch.testing.assert_close(model(x, mask), after, rtol=1e-5, atol=1e-5)
    biasless = LucidrainsTrunk()
    biasless.tri_in.out_gate = nn.Linear(16, 8, bias=False)
    report = pairgen.patch(biasless)
    assert report[1].startswith("tri_in (LucidrainsTriangleMultiplicativeModule): not swapped: lucidrains' form has a bias")
