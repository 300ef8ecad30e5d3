"""The weight packs each call makes (pairgen/ops/packing.py, pairgen/ops/<op>/packs.py): every Layout
is the independent PyTorch oracle's pack byte for byte (tests/pack_oracles.py), for the module's own
parameters and for the AlphaFold 3 layout's fused weights (CPU); the gather kernel renders and
compiles for every layout and storage type (CPU, NVRTC), and on the GPU writes what the host pack
writes, byte for byte, from fp32, bf16 and fp16 parameters, NaN-prefilled."""
from __future__ import annotations

import itertools

import pytest
import torch

from helpers import generator
from pack_oracles import (contact_fp32_pack, contact_mma_pack, pack_mma_weights, pack_weights, readout_fp32_pack,
                          readout_mma_pack, split_w2t)
from pairgen import compiler
from pairgen.functional import af3_parameters
from pairgen.ops import get_op
from pairgen.ops.contact import packs as contact_packs
from pairgen.ops.contact.strategies import mma as contact_mma
from pairgen.ops.packing import Piece, Sources, layout, pack, pack_on_host, render
from pairgen.ops.readout import packs as readout_packs
from pairgen.ops.readout.strategies import gemm as readout_gemm, mma as readout_mma
from pairgen.ops.trimul import packs as trimul_packs
from pairgen.ops.trimul.strategies import mma as trimul_mma

TRIMUL_FORMS = [dict(bias=b, gate_at=g) for b, g in itertools.product((True, False), ("output", "hidden"))]
OPERANDS = {"bfloat16": torch.bfloat16, "float16": torch.float16, "tf32x3": torch.float32}


def _randomised(module):
    gen = generator(11)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return module


def _trimul(P, H, bias, gate_at):
    from pairgen.ops.trimul import TriangleMultiplication

    return _randomised(TriangleMultiplication(P, H, bias=bias, gate_at=gate_at))


def _own(module) -> tuple[list, Sources]:
    weights = module._slots.weights()
    return [t.detach() for t in weights.tensors], weights.sources


def _layouts(P: int = 40, H: int = 24, D: int = 20):
    """(name, layout, sources list, oracle bytes) for every pack at small odd-ish widths."""
    for form in TRIMUL_FORMS:
        m = _trimul(P, H, **form)
        params, sources = _own(m)
        gate = m.out_gate.weight.shape[0]
        named = dict(m.named_parameters())
        yield (f"trimul fp32 {form}", trimul_packs.fp32_layout(P, H, form["bias"], gate, sources), params,
               pack_weights(named, P, H, form["bias"]).view(torch.uint8))
        for precision, dtype in OPERANDS.items():
            yield (f"trimul mma {precision} {form}", trimul_mma.mma_layout(P, H, form["bias"], gate, precision, sources),
                   params, pack_mma_weights(named, P, H, form["bias"], dtype))
    contact = _randomised(get_op("contact").make_module({"P": P, "H": H}, generator(1)))
    params, sources = _own(contact)
    ordered = [contact.get_parameter(n).detach() for n in ("mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias",
                                                           "mlp.4.weight", "mlp.4.bias", "layer_norm.weight",
                                                           "layer_norm.bias")]
    yield "contact fp32", contact_packs.fp32_layout(P, H, sources), params, contact_fp32_pack(ordered, P, H).view(torch.uint8)
    for precision, dtype in OPERANDS.items():
        yield (f"contact mma {precision}", contact_mma.mma_layout(P, H, precision, sources), params,
               contact_mma_pack(ordered, P, H, dtype))
    readout = _randomised(get_op("readout").make_module({"D": D, "P": P, "H": H}, generator(2)))
    params, sources = _own(readout)
    fp32 = readout_fp32_pack(params, D, P, H)
    yield "readout fp32", readout_packs.fp32_layout(D, P, H, sources), params, fp32.view(torch.uint8)
    yield ("readout tf32x3 W2^T", readout_gemm.split_w2t_layout(D, H, sources), params,
           split_w2t(params).reshape(-1).view(torch.uint8))
    for precision, dtype in OPERANDS.items():
        yield (f"readout mma {precision}", readout_mma.mma_layout(D, P, H, precision, sources), params,
               readout_mma_pack(fp32, params, D, P, H, dtype))


def test_every_layout_is_the_oracle_pack_byte_for_byte():
    cases = list(_layouts())
    assert len(cases) == 4 * 4 + 4 + 5
    for name, lay, params, oracle in cases:
        assert torch.equal(pack_on_host(lay, params), oracle), name


def test_the_alphafold3_layout_packs_as_the_module_it_stands_for():
    """Fused a/b projections read at a row offset, biases left out read as zeros, LayerNorm weights
    left out as ones: the pack of the module those weights make (af3_parameters)."""
    P, H = 40, 24
    gen = generator(3)
    w = {"norm_in_weight": None, "norm_in_bias": torch.randn(P, generator=gen),
         "p_in_weight": torch.randn(2 * H, P, generator=gen), "p_in_bias": torch.randn(2 * H, generator=gen),
         "g_in_weight": torch.randn(2 * H, P, generator=gen), "g_in_bias": None,
         "norm_out_weight": torch.randn(H, generator=gen), "norm_out_bias": None,
         "p_out_weight": torch.randn(P, H, generator=gen), "p_out_bias": None,
         "g_out_weight": torch.randn(P, P, generator=gen), "g_out_bias": torch.randn(P, generator=gen)}
    given = tuple(t is not None for t in w.values())
    sources = trimul_packs.af3_sources(given, P, H)
    tensors = [t for t in w.values() if t is not None]
    complete = dict(w, norm_in_weight=torch.ones(P), norm_out_bias=torch.zeros(H))
    named = af3_parameters(complete, True, lambda t: t)
    assert torch.equal(pack_on_host(trimul_packs.fp32_layout(P, H, True, P, sources), tensors),
                       pack_weights(named, P, H, True).view(torch.uint8))
    assert torch.equal(pack_on_host(trimul_mma.mma_layout(P, H, True, P, "bfloat16", sources), tensors),
                       pack_mma_weights(named, P, H, True, torch.bfloat16))


def test_pieces_that_overlap_or_leave_holes_are_refused():
    a = Piece(0, 0, "f32", 0, 1, 4, (4, 1), (4, 1))
    assert layout(32, [a], 1).pieces[-1].cols == 16  # the gap after it: zero bytes
    with pytest.raises(ValueError, match="overlap or leave holes"):
        layout(32, [a, Piece(0, 0, "f32", 8, 1, 4, (4, 1), (4, 1))], 1)
    with pytest.raises(ValueError, match="overlap or leave holes"):
        layout(64, [Piece(0, 0, "f32", 0, 2, 2, (2, 1), (4, 1))], 1)  # rows 4 floats apart, 2 written


def test_the_gather_kernel_compiles_for_every_layout():
    """Every layout read from fp32 sources; the 16-bit storage types (which change only how a
    source value is loaded) on one layout each."""
    sources = {}
    for k, (name, lay, _, _) in enumerate(_layouts()):
        for kind in ("float32", *(("bfloat16", "float16") if k == 0 else ())):
            rendered = render(kind, lay)
            sources[rendered.source] = (rendered.kernel_name, f"{name} from {kind}")
    results = compiler.compile_many([(s, k, "sm_90") for s, (k, _) in sources.items()])
    for (_, name), result in zip(sources.values(), results):
        assert not isinstance(result, Exception), f"{name}: {result}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_gather_kernel_writes_the_host_pack_on_the_gpu(dtype):
    for name, lay, params, _ in _layouts(P=72, H=40, D=36):
        on_gpu = [p.to("cuda", dtype) for p in params]
        poisoned = torch.full((lay.total,), 0xFF, dtype=torch.uint8, device="cuda")  # NaN bytes in every kind
        ours = pack(lay, on_gpu, out=poisoned)
        assert ours.data_ptr() == poisoned.data_ptr(), f"{name}: the kernel did not run"
        assert torch.equal(ours.cpu(), pack_on_host(lay, [p.cpu() for p in on_gpu])), f"{name} from {dtype}"
