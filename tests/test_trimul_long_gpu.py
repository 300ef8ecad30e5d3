"""GPU: the bf16 triangle update at long N (N = 4096 and 8192, P = H = 128, the models' form): the
kernels run (2^24 pairs, 2^31 elements of x: past 32-bit element offsets; at N = 8192 2^33, and
2^34 of a and b together), every output is finite, the output meets the 16-bit standard against
float64 on sampled rows and columns, and the module's peak memory stays below the bf16
reference's (at N = 8192 the reference does not fit an H200's memory at all).

A float64 reference of the whole output would take ~100 GB; the sampled one is exact: in the
outgoing direction out[i, j] needs only rows i and j of x (the projections are per pair, the
triangle sum runs over their k), so float64 copies of the reference's own layers evaluate rows I
and columns J of the output from x[:, I], x[:, J] and x[:, I][:, :, J]."""
from __future__ import annotations

import pytest
import torch

from helpers import generator
from pairgen.ops import get_op
from pairgen.spec import Tolerance
from pairgen.tuning.check import compare

SIXTEEN_BIT = Tolerance(max_abs=float("inf"), rel_l2=1e-2)
#: GPU memory an N = 8192 call needs (x alone is 16 GiB; a, b, the sums and the output as much
#: each): an H200's, not an H100's.
N8192_MEMORY = 100 * 2**30


def _sampled_reference64(reference, x: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor,
                         cols: torch.Tensor) -> torch.Tensor:
    """out[:, rows][:, :, cols] of the outgoing triangle update, in float64 (the gate on the
    normalised input, as the models run it)."""
    ref = reference.double()

    def gated(which: str, index: torch.Tensor) -> torch.Tensor:
        xs = ref.layer_norm_in(x[:, index].double())
        proj, gate = getattr(ref, f"proj_{which}"), getattr(ref, f"gate_{which}")
        return proj(xs) * torch.sigmoid(gate(xs)) * mask[:, index].unsqueeze(-1).double()

    z = torch.einsum("bikh,bjkh->bijh", gated("a", rows), gated("b", cols))
    gate = torch.sigmoid(ref.out_gate(ref.layer_norm_in(x[:, rows][:, :, cols].double())))
    return ref.out_proj(ref.layer_norm_out(z)) * gate


def test_the_sampled_reference_is_the_whole_reference_s_rows_and_columns():
    """CPU: at N = 23 the sampled float64 evaluation equals the float64 reference's output there."""
    from pairgen.tuning.check import reference64

    spec = get_op("trimul")
    shape = {"B": 1, "N": 23, "P": 16, "H": 8, "outgoing": 1, "gate_normalized": 1, "bias": 0}
    gen = generator(23)
    module = spec.make_module(spec.widths_of(shape), gen)
    x, mask = spec.make_inputs(shape, gen)
    rows, cols = torch.tensor([0, 5, 22]), torch.tensor([3, 4, 17, 21])
    whole = reference64(module, (x, mask))[:, rows][:, :, cols]
    sampled = _sampled_reference64(spec.make_reference(module), x, mask.float(), rows, cols)
    torch.testing.assert_close(sampled, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [4096, 8192])
def test_long_n_runs_finite_within_the_16_bit_standard_and_below_the_reference_s_memory(N):
    if N == 8192 and torch.cuda.get_device_properties(0).total_memory < N8192_MEMORY:
        pytest.skip(f"N = 8192 needs about {N8192_MEMORY / 2**30:.0f} GiB of GPU memory (an H200)")
    spec = get_op("trimul")
    shape = {"B": 1, "N": N, "P": 128, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 0}
    gen = generator(N)
    module = spec.make_module(spec.widths_of(shape), gen).cuda().to(torch.bfloat16)
    cuda_gen = torch.Generator(device="cuda").manual_seed(N)  # x made on the GPU: 2^33 values at N = 8192
    x = torch.randn(1, N, N, 128, device="cuda", generator=cuda_gen, dtype=torch.bfloat16)
    mask = torch.rand(1, N, N, device="cuda", generator=cuda_gen) < 0.9
    mask[0, 7] = False  # an empty row
    torch.cuda.synchronize()
    with torch.no_grad():
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = module(x, mask)
        torch.cuda.synchronize()
        ours = torch.cuda.max_memory_allocated() - base
        assert bool(torch.isfinite(out).all()), "every output finite"
        rows = torch.tensor([0, 7, 1234, N - 1], device="cuda")
        cols = torch.randperm(N, generator=gen)[:96].cuda()
        result = compare(out[:, rows][:, :, cols], _sampled_reference64(spec.make_reference(module), x, mask.float(),
                                                                         rows, cols), SIXTEEN_BIT)
        assert result.ok, result
        del out
        reference = spec.make_reference(module).cuda().to(torch.bfloat16)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        # what the reference may use: the device's free memory and the allocator's cached blocks
        free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - base
        torch.cuda.reset_peak_memory_stats()
        try:
            reference(x, mask)
            torch.cuda.synchronize()
            theirs = torch.cuda.max_memory_allocated() - base
        except torch.cuda.OutOfMemoryError:  # the reference needs more than was free: more than ours
            theirs = free
    assert ours <= theirs, f"peak memory {ours / 2**30:.1f} GiB against the reference's {theirs / 2**30:.1f} GiB"
