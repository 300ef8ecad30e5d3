"""The weight-gradient kernel (pairgen/ops/row_products.py): sum over rows of A^T B for one or two
pairs of row-major 16-bit tensors. On the CPU: every width it takes compiles without spills, and
the kernel run on the CPU emulator (0xFF-filled shared memory) matches float64 of the same rounded
inputs, at row counts that end mid-tile and at fewer rows than blocks. The GPU tests check it on
the card and through a training step."""
from __future__ import annotations

import shutil

import pytest
import torch

from helpers import generator
from pairgen import compiler
from pairgen.ops import row_products

CASES = {"models": ((128, 128), (128, 128)), "one-product": ((48, 32),), "narrow-and-wide": ((64, 16), (32, 128))}


@pytest.mark.parametrize("kind", ["bfloat16", "float16"])
@pytest.mark.parametrize("products", CASES.values(), ids=CASES.keys())
def test_the_row_products_kernel_compiles_without_spills(kind, products):
    rendered = row_products.render(kind, products)
    compiled = compiler.compile_source(rendered.source, rendered.kernel_name, "sm_90")
    assert compiled.spill_bytes == 0 and compiled.stack_bytes == 0, compiled.summary()


def _pairs(products, rows, dtype, gen):
    return [tuple((torch.randn(rows, k, generator=gen) * scale).to(dtype) for k, scale in ((ka, 1.0), (kb, 3.0)))
            for ka, kb in products]


def _check(pairs, ours):
    assert len(ours) == len(pairs)
    for (a, b), mine in zip(pairs, ours):
        expected = a.double().t() @ b.double()
        assert mine.shape == expected.shape and mine.dtype is a.dtype and torch.isfinite(mine).all()
        error = ((mine.double() - expected).norm() / expected.norm()).item()
        assert error <= 1e-2, error  # the 16-bit standard; the sums are fp32, rounded once


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")
@pytest.mark.parametrize("case,rows,dtype", [("models", 37 * 37, torch.bfloat16), ("one-product", 75, torch.float16),
                                             ("narrow-and-wide", 200, torch.bfloat16), ("models", 1, torch.float16)],
                         ids=["models-odd-rows", "one-product-fp16", "narrow-and-wide", "one-row"])
def test_the_row_products_kernel_matches_float64_emulated(case, rows, dtype):
    from emulator import emulated

    pairs = _pairs(CASES[case], rows, dtype, generator(7 + rows))
    with emulated():
        ours = row_products.row_products(pairs)
    _check(pairs, ours)


def test_the_kernel_refuses_what_it_cannot_take():
    """Off a GPU, and with no pairs or three, the kernel is not taken (the widths it refuses are
    checked on the GPU)."""
    a = torch.zeros(64, 128, dtype=torch.bfloat16)
    assert not row_products.applies([(a, a)])  # not on a GPU
    assert not row_products.applies([])
    assert not row_products.applies([(a, a)] * 3)


def test_the_kernel_runs_only_where_its_shared_memory_fits():
    """Two 128 x 128 products stage 204 KB: an H100's blocks take it, an A100's (163 KB) do not,
    a narrower product fits both; no mma.sync before sm_80."""
    from pairgen.runtime import DeviceInfo
    from pairgen.spec import DeviceLimits

    def gpu(smem_kb, capability):
        return DeviceInfo(0, "gpu", "gpu", "sm_%d%d" % capability, DeviceLimits(max_smem_per_block=smem_kb * 1024),
                          capability)

    models, narrow = CASES["models"], CASES["one-product"]
    assert row_products.smem_bytes(models) == 3 * 64 * (2 * (128 + 128 + 16)) * 2
    assert row_products.device_takes(gpu(227, (9, 0)), models)
    assert not row_products.device_takes(gpu(163, (8, 0)), models)
    assert row_products.device_takes(gpu(163, (8, 0)), narrow)
    assert not row_products.device_takes(gpu(227, (7, 5)), narrow)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case,rows", [("models", 123 * 123), ("one-product", 300), ("narrow-and-wide", 37)])
def test_the_row_products_kernel_matches_float64_on_the_gpu(case, rows, dtype):
    pairs = [tuple(t.cuda() for t in pair) for pair in _pairs(CASES[case], rows, dtype, generator(11 + rows))]
    assert row_products.applies(pairs)
    wide = [(torch.zeros(64, 144, dtype=dtype, device="cuda"),) * 2, (torch.zeros(64, 40, dtype=dtype, device="cuda"),) * 2]
    assert not any(row_products.applies([pair]) for pair in wide)
    _check(pairs, row_products.row_products(pairs))
