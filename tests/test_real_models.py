"""pairgen.patch on the real models' own pairformer blocks (tests/real_models.py), on the CPU: each
block's two triangle updates run on pairgen in forward and backward (counted on the stand-ins),
with the block's output and every gradient within the fp32 standards of the same block unpatched
in float64; float64 itself (no kernel, no closed form) trains and passes gradcheck; unpatch gives
back the modules as the model left them. And the packages' own calls of cuEquivariance's function
(OpenFold 3's and Protenix's cuEquivariance paths, Boltz's use_kernels) answered by pairgen's."""
from __future__ import annotations

import copy
import importlib.machinery
import sys
import types

import pytest
import torch

import pairgen
from real_models import BLOCKS, C_Z, inputs, need, randomize, stand_ins


def relative(ours: torch.Tensor, exact: torch.Tensor) -> float:
    return ((ours.double() - exact.double()).norm() / exact.double().norm()).item()


def run(block, module, z, tokens, pair, grad):
    """The block's pair output and the gradients of its input and every parameter."""
    z = z.clone().requires_grad_()
    out = block.call(module, z, tokens, pair)
    params = [p for p in module.parameters() if p.requires_grad]
    grads = torch.autograd.grad((out * grad).sum(), [z, *params], allow_unused=True)  # unused: a track the output skips
    return out.detach(), grads


@pytest.mark.parametrize("name", list(BLOCKS))
def test_patched_block_trains_on_pairgen_within_the_fp32_standard(name):
    block = BLOCKS[name]()
    randomize(block.module, 1).train()
    z, tokens, pair, grad = inputs(2, 9, 2)
    exact = block.in_float64(copy.deepcopy(block.module))
    if not block.runs_in_every_dtype:  # its update is then pairgen's definition in float64 (tested in test_functional.py)
        pairgen.patch(exact)
    exact_out, exact_grads = run(block, exact, z.double(), tokens, pair, grad.double())
    patched = copy.deepcopy(block.module)
    report = pairgen.patch(patched)
    swapped = [line for line in report if "swapped for pairgen" in line]
    assert len(swapped) == block.swapped, report
    out, grads = run(block, patched, z, tokens, pair, grad)
    calls = [(m.pairgen_calls, m.source_calls) for m in stand_ins(patched)]
    assert calls == [(1, 0)] * block.swapped, "every triangle update ran on pairgen, none on the source"
    assert relative(out, exact_out) <= 1e-5
    names = ["input"] + [n for n, p in patched.named_parameters() if p.requires_grad]
    for label, ours, exact in zip(names, grads, exact_grads):
        assert (ours is None) == (exact is None), label
        if exact is not None:
            assert relative(ours, exact) <= 2e-5, f"{name}: gradient of {label}"


@pytest.mark.parametrize("name", list(BLOCKS))
def test_patched_block_in_float64_trains_as_the_block_does(name):
    """float64 has no kernel and no closed form: the definition runs (pairgen's reference, or for
    alphafold3-pytorch its own forward), never a crash; gradients equal the unpatched block's."""
    block = BLOCKS[name]()
    if not block.runs_in_every_dtype:
        pytest.skip(f"{name}'s own triangle update computes in float32, so the unpatched block has no float64 run")
    randomize(block.module, 3).double().train()
    z, tokens, pair, grad = inputs(1, 6, 4, dtype=torch.float64)
    exact_out, exact_grads = run(block, block.module, z, tokens, pair, grad)
    patched = copy.deepcopy(block.module)
    pairgen.patch(patched)
    out, grads = run(block, patched, z, tokens, pair, grad)
    torch.testing.assert_close(out, exact_out, rtol=1e-10, atol=1e-10)
    for ours, exact in zip(grads, exact_grads):
        torch.testing.assert_close(ours, exact, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", list(BLOCKS))
def test_each_stand_in_passes_gradcheck_in_float64(name):
    block = BLOCKS[name]()
    randomize(block.module, 5).double()
    pairgen.patch(block.module)
    z, tokens, pair, _ = inputs(1, 4, 6, dtype=torch.float64)
    for stand_in in stand_ins(block.module):
        mask = tokens if name == "alphafold3-pytorch" else pair.double()
        x = z.clone().requires_grad_()
        assert torch.autograd.gradcheck(lambda t: stand_in(t, mask=mask), (x,))


@pytest.mark.parametrize("name", list(BLOCKS))
def test_unpatch_gives_back_the_modules_as_the_model_left_them(name):
    block = BLOCKS[name]()
    model = block.module.train()
    before = {n: type(m) for n, m in model.named_modules()}
    keys = list(model.state_dict())
    pairgen.patch(model)
    assert list(model.state_dict()) == keys
    model.eval()  # while patched
    assert pairgen.unpatch(model) == block.swapped
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert not any(m.training for m in model.modules()), "eval() while patched holds after unpatch"


def test_alphafold3_pytorch_dim_hidden_other_than_dim_is_not_swapped():
    af3 = need("alphafold3_pytorch.alphafold3")
    block = af3.PairwiseBlock(dim_pairwise=C_Z, tri_mult_dim_hidden=8)
    report = pairgen.patch(block)
    assert [line for line in report if "TriangleMultiplication" in line or "PreLayerNorm" in line]
    assert not any("swapped for pairgen" in line for line in report)
    assert all("dim_hidden == dim" in line for line in report if "tri_mult" in line)


# ---- the packages' calls of cuEquivariance's function, answered by pairgen's -------------------

@pytest.fixture
def cuequivariance_is_pairgen(monkeypatch):
    """`from cuequivariance_torch.primitives.triangle import triangle_multiplicative_update` gives
    pairgen's function (as a user who swaps the import has it)."""
    package = types.ModuleType("cuequivariance_torch")
    primitives = types.ModuleType("cuequivariance_torch.primitives")
    triangle = types.ModuleType("cuequivariance_torch.primitives.triangle")
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return pairgen.triangle_multiplicative_update(*args, **kwargs)
    package.triangle_multiplicative_update = triangle.triangle_multiplicative_update = counted
    for module in (package, primitives, triangle):
        # a spec, as an imported module has: OpenFold 3's first import asks importlib.util.find_spec for it
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return calls


def _triangle_pair(module_name: str, outgoing: str, incoming: str, **kwargs):
    layers = need(module_name)
    return [randomize(getattr(layers, cls)(**kwargs), 7 + i) for i, cls in enumerate((outgoing, incoming))]


@pytest.mark.parametrize("batched", [False, True], ids=["unbatched", "batched"])
def test_protenix_cuequivariance_path(cuequivariance_is_pairgen, batched):
    """Protenix calls kernel_triangular_mult(z[None], mask=pair_mask, torch.cat'ed weights)[0]: an
    unbatched mask for z[None], a (B, N, N) mask for 5-D z."""
    modules = _triangle_pair("protenix.model.triangular.triangular", "TriangleMultiplicationOutgoing",
                             "TriangleMultiplicationIncoming", c_z=C_Z, c_hidden=C_Z)
    z, _, pair, _ = inputs(2, 7, 8)
    pair = pair.float()
    if not batched:
        z, pair = z[0], pair[0]
    with torch.no_grad():
        for module in modules:
            ours = module(z, mask=pair, triangle_multiplicative="cuequivariance")
            theirs = module(z, mask=pair, triangle_multiplicative="torch")
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert len(cuequivariance_is_pairgen) == 2


def test_openfold3_cuequivariance_path(monkeypatch, cuequivariance_is_pairgen):
    """OpenFold 3 torch.cat's the a/b weights and flattens templates (5-D z) into the batch."""
    layers = need("openfold3.core.model.layers.triangular_multiplicative_update")
    monkeypatch.setattr(layers, "triangle_multiplicative_update",
                        sys.modules["cuequivariance_torch"].triangle_multiplicative_update, raising=False)
    modules = _triangle_pair("openfold3.core.model.layers.triangular_multiplicative_update",
                             "TriangleMultiplicationOutgoing", "TriangleMultiplicationIncoming", c_z=32, c_hidden=16)
    gen = torch.Generator().manual_seed(9)
    z = torch.randn(2, 3, 6, 6, 32, generator=gen)
    mask = (torch.rand(2, 3, 6, 6, generator=gen) > 0.2).float()
    with torch.no_grad():
        for module in modules:
            ours = module(z, mask=mask, use_cueq_triangle_kernels=True)
            theirs = module(z, mask=mask)
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert len(cuequivariance_is_pairgen) == 2


def test_boltz_use_kernels_path(cuequivariance_is_pairgen):
    modules = _triangle_pair("boltz.model.layers.triangular_mult", "TriangleMultiplicationOutgoing",
                             "TriangleMultiplicationIncoming", dim=C_Z)
    z, _, pair, _ = inputs(2, 7, 10)
    pair = pair.float()
    with torch.no_grad():
        for module in modules:
            torch.testing.assert_close(module(z, pair, use_kernels=True), module(z, pair), rtol=1e-5, atol=1e-5)
    assert len(cuequivariance_is_pairgen) == 2
