"""The wgmma weights packed on the GPU for each call (pairgen/ops/trimul/packs.py,
templates/trimul/pack_wgmma.cu.j2), from the module's parameters or the AlphaFold 3 layout: the
source renders and compiles for every storage type, operand type and gate form (CPU); on the GPU
the pack is the PyTorch oracle's (tests/pack_oracles.py) byte for byte in its matrices and to fp32
rounding in its sums, and pairgen's function called with weights made anew on every call (as
OpenFold 3 and Protenix torch.cat them) runs on it: no module built per call, the call recorded and
replayed with the pack launch, the output the module's."""
from __future__ import annotations

import pytest
import torch

import pairgen
from pairgen import compiler, functional, native
from pairgen.functional import af3_parameters
from pack_oracles import pack_wgmma_weights
from pairgen.ops.trimul import packs as trimul_packs
from pairgen.ops.trimul.strategies import wgmma as trimul_wgmma
from pairgen.ops.trimul.strategies.wgmma import k_padded, wgmma_weight_offsets


@pytest.mark.parametrize("kind, operand, gate", [("float32", "bfloat16", "normalized"), ("bfloat16", "float16", "input"),
                                                 ("float16", "bfloat16", "hidden"), ("bfloat16", "bfloat16", "normalized")])
def test_the_pack_kernel_renders_and_compiles(kind, operand, gate):
    rendered = trimul_wgmma.render_fold(kind, 40, 24, operand, gate != "input", gate == "hidden")
    assert compiler.compile_source(rendered.source, rendered.kernel_name, "sm_90")


def _af3_weights(P: int, H: int, bias: bool, dtype, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    w = {"norm_in_weight": 1 + 0.3 * torch.randn(P, generator=gen), "norm_in_bias": 0.3 * torch.randn(P, generator=gen),
         "p_in_weight": torch.randn(2 * H, P, generator=gen), "g_in_weight": torch.randn(2 * H, P, generator=gen),
         "norm_out_weight": 1 + 0.3 * torch.randn(H, generator=gen), "norm_out_bias": 0.3 * torch.randn(H, generator=gen),
         "p_out_weight": torch.randn(P, H, generator=gen), "g_out_weight": torch.randn(P, P, generator=gen)}
    for name, rows in (("p_in_bias", 2 * H), ("g_in_bias", 2 * H), ("p_out_bias", P), ("g_out_bias", P)):
        w[name] = torch.randn(rows, generator=gen) if bias else None
    return {k: (w[k].cuda().to(dtype) if w[k] is not None else None) for k in trimul_packs.AF3_NAMES}  # the function's order


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype,operand", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16"),
                                           (torch.float32, "bfloat16")])
@pytest.mark.parametrize("P,H", [(128, 128), (40, 24)])
def test_the_gpu_pack_is_the_pytorch_pack(P, H, dtype, operand, bias):
    w = _af3_weights(P, H, bias, dtype, seed=P + H)
    given = [t for t in w.values() if t is not None]
    sources = trimul_packs.af3_sources(tuple(t is not None for t in w.values()), P, H)
    ours = trimul_wgmma.pack_wgmma(given, sources, P, H, True, False, operand)
    params = af3_parameters(w, bias, lambda t: t)
    theirs = pack_wgmma_weights(params, P, H, bias, True, getattr(torch, operand))
    offsets = wgmma_weight_offsets(P, H, 2)
    matrices = {"wp": 4 * H * k_padded(P), "wo": P * k_padded(H), "wg": P * k_padded(P)}  # elements, 16-bit
    sums = {"c1p": 4 * H, "c2p": 4 * H, "c1o": P, "c2o": P, "c1g": P, "c2g": P}  # fp32
    for name, count in matrices.items():
        start = offsets[name]
        assert torch.equal(ours[start:start + 2 * count], theirs[start:start + 2 * count]), f"{name}: other bytes"
    for name, count in sums.items():
        got, want = (t[offsets[name]:offsets[name] + 4 * count].view(torch.float32) for t in (ours, theirs))
        torch.testing.assert_close(got, want, rtol=2e-7, atol=1e-30, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "autocast"])
def test_weights_made_anew_every_call_run_on_a_pack_not_a_new_module(monkeypatch, dtype, direction):
    """bf16 and fp16 weights and input, and fp32 ones under autocast to bf16."""
    if native.fastcall(wait=True) is None:  # built in the background on first use: a call before records nothing
        pytest.skip(f"the compiled fast path: {native.status()}")
    P = H = 128
    autocast = dtype == "autocast"
    dtype, precision = (torch.float32, "bfloat16") if autocast else (dtype, str(dtype).split(".")[1])
    w = _af3_weights(P, H, False, dtype, seed=3)
    halves = {n: w[n].chunk(2) for n in ("p_in_weight", "g_in_weight")}
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 123, 123, P, generator=gen).cuda().to(dtype)
    mask = torch.rand(1, 123, 123, generator=gen).cuda() > 0.2
    mask[0, 7] = False  # an empty row
    packs = []
    real_pack = trimul_wgmma.pack_wgmma
    monkeypatch.setattr(trimul_wgmma, "pack_wgmma", lambda *a: packs.append(1) or real_pack(*a))
    functional._modules.clear()
    functional._structures.clear()
    functional._replayers.clear()
    outs = []
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        for _ in range(3):
            fresh = dict(w, **{n: torch.cat(halves[n]) for n in halves})  # as OpenFold 3 and Protenix call it
            outs.append(pairgen.triangle_multiplicative_update(x, direction, mask, **fresh))
    # One module (the first call) for the structure, none per weights; a pack on the Python path
    # (the first call, recorded), then replays of it (the pack launch included), under autocast too
    # (the recording notes the cast of x and replays only under the autocast it ran under).
    assert len(functional._structures) == 1 and not functional._modules
    assert len(packs) == 1, packs
    assert functional._replayers, "a recorded call is replayed before any Python check"
    module = next(iter(functional._structures.values()))
    assert module.variant_for(123, x.device, precision).plan.strategy == "wgmma"
    assert outs[0].dtype == (torch.bfloat16 if autocast else dtype)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    torch.testing.assert_close(outs[2], outs[0], rtol=0, atol=0)
