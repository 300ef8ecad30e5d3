"""The CPU kernel emulator (tests/emulator) itself: that it computes what GPU-verified kernels
compute (the tensor-core instructions' operand layouts, the shared-memory pipelines), and that it
stops on what would go wrong on a GPU: a barrier not every thread reaches, shared memory a wgmma
still reads being overwritten, a write over a cp.async copy in flight, a missing barrier between
warpgroups (under a priority order)."""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from emulator import (EARLY_LANDING, EmulatedKernel, EmulatedVariant, EmulationError, build_library, emulated,
                      emulated_variant)
from emulator.translate import UnknownInstruction, translate
from helpers import generator, sampled_plans
from pairgen import codegen
from pairgen.ops import get_op
from pairgen.ops.trimul import TRIMUL
from pairgen.tuning.check import compare, reference64
from pairgen.tuning.evaluate import inputs_in_precision, module_in_precision

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles kernels with g++")

MODELS = {"P": 128, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 0}


def _launch_raw(source: str, name: str, threads: int, *args: int, order: int = 0, smem: int = 0) -> None:
    library, _ = build_library(source)
    with emulated(order):
        EmulatedKernel(library, name, threads).bind(1, threads, smem, len(args))(*args)


def emulated_error(module, inputs: tuple, variant, order: int = 0):
    """compare() of the variant's output, emulated, against the float64 reference."""
    ref = reference64(module, inputs)
    out = torch.full(tuple(ref.shape), float("nan"), dtype=inputs[0].dtype)
    with emulated(order), torch.no_grad():
        module._launch(*inputs, out=out, variant=variant)
    return compare(out, ref, TRIMUL.tolerance[variant.plan.precision])


def _case(precision: str, widths: dict, batch: int, n: int, seed: int = 0):
    gen = generator(seed)
    module = module_in_precision(TRIMUL, widths, gen, precision, "cpu")
    inputs = inputs_in_precision(TRIMUL.make_inputs({"B": batch, "N": n, **widths}, gen, "normal"), precision, "cpu")
    return module, inputs


def test_shuffles_and_barriers_meet_every_lane():
    source = """
extern "C" __global__ void lanes(int* out) {
    int v = threadIdx.x;
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    out[threadIdx.x] = v + __shfl_sync(0xffffffffu, (int)threadIdx.x, 3);
}"""
    out = torch.full((64,), -1, dtype=torch.int32)
    _launch_raw(source, "lanes", 64, out.data_ptr())
    warp_sums = torch.tensor([sum(range(32)), sum(range(32, 64))]).repeat_interleave(32)
    lane3 = torch.tensor([3, 35]).repeat_interleave(32)
    assert torch.equal(out, (warp_sums + lane3).int())


def test_a_barrier_that_some_threads_skip_is_a_deadlock():
    source = """
extern "C" __global__ void divergent(float* out) {
    if (threadIdx.x < 16) __syncthreads();
    out[threadIdx.x] = 1.0f;
}"""
    out = torch.zeros(32)
    with pytest.raises(EmulationError, match="deadlock.*__syncthreads"):
        _launch_raw(source, "divergent", 32, out.data_ptr())


def test_unknown_ptx_is_an_error_naming_it():
    with pytest.raises(UnknownInstruction, match="mbarrier"):
        translate('extern "C" __global__ void k() { asm volatile("mbarrier.init.shared.b64 [%0], 1;" :: "r"(0)); }')


@pytest.mark.parametrize("op, strategy, precision, widths, shape", [
    ("trimul", "wgmma", "bfloat16", MODELS, (1, 37)),  # swizzled, x and the sums in registers, stmatrix staging
    ("trimul", "wgmma", "float16", {**MODELS, "outgoing": 0}, (2, 23)),
    ("trimul", "mma", "bfloat16", {"P": 64, "H": 32, "outgoing": 1, "gate_normalized": 0, "bias": 1}, (3, 7)),
    ("contact", "wgmma", "bfloat16", {"P": 128, "H": 64}, (1, 29)),  # layer 1's output as layer 2's A fragments
    ("readout", "wgmma", "float16", {"D": 64, "P": 32, "H": 96}, (2, 13)),  # streamed weight chunks
])
def test_gpu_verified_default_points_match_float64_emulated(op, strategy, precision, widths, shape):
    """Each op's first feasible default point of a tensor-core strategy, which passes on the H200,
    passes emulated: the emulator's operand layouts and pipelines are the hardware's where these
    kernels use them. (All of the GPU tests' cases of the three ops passed emulated once: 990.)"""
    spec = get_op(op)
    plan = sampled_plans(spec.at(precision), strategy, spec.widths_of({**widths, "B": 1, "N": 1}), 1)[0]
    gen = generator(shape[1])
    module = module_in_precision(spec, plan.widths, gen, precision, "cpu")
    inputs = inputs_in_precision(spec.make_inputs({"B": shape[0], "N": shape[1], **plan.widths}, gen, "cauchy"),
                                 precision, "cpu")
    ref = reference64(module, inputs)
    out = torch.full(tuple(ref.shape), float("nan"), dtype=inputs[0].dtype)
    with emulated(), torch.no_grad():
        module._launch(*inputs, out=out, variant=emulated_variant(plan))
    result = compare(out, ref, spec.tolerance[precision])
    assert result.ok, result


def _with_cp_async(source: str) -> str:
    """A raw test kernel's source after the templates' cp.async helpers (cp_async16, commit, wait)."""
    return (codegen.TEMPLATES_DIR / "common" / "cp_async.cuh").read_text() + source


STAGED = """
extern "C" __global__ void staged(const float* src, float* out, int write_in_flight) {
    extern __shared__ __align__(16) unsigned char smem[];
    float* buf = reinterpret_cast<float*>(smem);
    if (threadIdx.x < 4) buf[threadIdx.x] = -1.0f;
    __syncthreads();
    if (threadIdx.x == 0) {
        cp_async16(buf, src, true);
        cp_async_commit();
        if (write_in_flight) buf[1] = 5.0f;
        out[0] = buf[0];  // read before the wait: the old bytes or the copy's, as the copy lands
        cp_async_wait<0>();
        out[1] = buf[0];
    }
}"""


def _staged(order: int, write_in_flight: int) -> torch.Tensor:
    src, out = torch.tensor([7.0, 8.0, 9.0, 10.0]), torch.full((2,), float("nan"))
    _launch_raw(_with_cp_async(STAGED), "staged", 32, src.data_ptr(), out.data_ptr(), write_in_flight, order=order, smem=16)
    return out


def test_cp_async_copies_land_at_either_end_and_writes_over_them_in_flight_are_races():
    """A GPU may land a copy at any moment between its issue and its wait: the default order lands
    it at the wait, EARLY_LANDING at the issue, so a read that depends on which differs between
    them; a store into its destination while it is in flight is reported."""
    assert _staged(0, 0).tolist() == [-1.0, 7.0]
    assert _staged(EARLY_LANDING, 0).tolist() == [7.0, 7.0]
    with pytest.raises(EmulationError, match="written while a cp.async into it was in flight"):
        _staged(0, 1)


MBARRIER_RING = """
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(unsigned long long* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    unsigned done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void cp_async_arrive(unsigned long long* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// The consumer's side of a two-stage ring of 512-byte tiles: each lane's sum of its 4 floats of
// every tile, each stage read once its `full` barrier's phase completes and freed on `empty`.
__device__ float consume_ring(const float* buf, unsigned long long* full, unsigned long long* empty, int tiles,
                              int lane) {
    float acc = 0.0f;
    for (int t = 0; t < tiles; ++t) {
        const int s = t & 1;
        mbar_wait(full + s, (t >> 1) & 1);
        for (int k = 0; k < 4; ++k) acc += buf[s * 128 + 4 * lane + k];
        mbar_arrive(empty + s);
    }
    return acc;
}

// A two-stage ring: warp 0 copies 512-byte tiles in with cp.async, each stage's `full` barrier
// completing when its copies land; warp 1 sums them and frees the stage on its `empty` barrier.
extern "C" __global__ void ring(const float* src, float* out, int tiles) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned long long* full = reinterpret_cast<unsigned long long*>(smem);
    unsigned long long* empty = full + 2;
    float* buf = reinterpret_cast<float*>(smem + 128);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0)
        for (int s = 0; s < 2; ++s) mbar_init(full + s, 32), mbar_init(empty + s, 32);
    __syncthreads();
    if (warp == 0) {
        for (int t = 0; t < tiles; ++t) {
            const int s = t & 1;
            if (t >= 2) mbar_wait(empty + s, ((t >> 1) - 1) & 1);
            cp_async16(buf + s * 128 + 4 * lane, src + t * 128 + 4 * lane, true);
            cp_async_arrive(full + s);
        }
    } else {
        out[lane] = consume_ring(buf, full, empty, tiles, lane);
    }
}"""


def _ring(source: str, order: int) -> tuple[torch.Tensor, torch.Tensor]:
    tiles = 7
    src, out = torch.randn(tiles * 128, generator=generator(3)), torch.full((32,), float("nan"))
    _launch_raw(_with_cp_async(source), "ring", 64, src.data_ptr(), out.data_ptr(), tiles, order=order, smem=128 + 2 * 512)
    return out, src.view(tiles, 32, 4).sum((0, 2))


@pytest.mark.parametrize("order", [0, 1, 3, 4, EARLY_LANDING])
def test_an_mbarrier_ring_of_cp_async_stages_runs_and_a_consumer_that_skips_its_wait_is_wrong(order):
    out, expected = _ring(MBARRIER_RING, order)
    torch.testing.assert_close(out, expected)
    skipping = MBARRIER_RING.replace("        mbar_wait(full + s, (t >> 1) & 1);\n", "")
    assert skipping != MBARRIER_RING
    if order in (0, 3):  # (where the producer runs first: it is blocked two tiles ahead)
        try:  # the consumer reads stages not yet refilled, or runs the empty barriers' phases past the producer
            assert not torch.allclose(_ring(skipping, order)[0], expected, equal_nan=False)
        except EmulationError as error:
            assert "deadlock" in str(error)


def test_the_mbarrier_ring_s_ptx_compiles_for_hopper():
    """The instructions the emulator takes for mbarriers are the GPU's own: NVRTC accepts them."""
    from pairgen.compiler import compile_many

    (result,) = compile_many([(_with_cp_async(MBARRIER_RING), "ring", "sm_90")])
    assert not isinstance(result, Exception), result


BULK_RING = """
__device__ __forceinline__ void mbar_expect_bytes(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_in(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void bulk_out(void* dst, const void* src, unsigned bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_u32(src)), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
__device__ __forceinline__ void bulk_out_wait() { asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(0) : "memory"); }

// The ring above with bulk copies: one producer thread arms each stage's `full` barrier with the
// tile's bytes and copies the 512-byte tile in one instruction; the consumer warp's sums leave
// through shared memory in one bulk copy out.
extern "C" __global__ void bulk_ring(const float* src, float* out, int tiles, int write_in_flight) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned long long* full = reinterpret_cast<unsigned long long*>(smem);
    unsigned long long* empty = full + 2;
    float* buf = reinterpret_cast<float*>(smem + 128);
    float* sums = buf + 2 * 128;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0)
        for (int s = 0; s < 2; ++s) mbar_init(full + s, 1), mbar_init(empty + s, 32);
    __syncthreads();
    if (warp == 0) {
        if (lane == 0)
            for (int t = 0; t < tiles; ++t) {
                const int s = t & 1;
                if (t >= 2) mbar_wait(empty + s, ((t >> 1) - 1) & 1);
                mbar_expect_bytes(full + s, 512);
                bulk_in(buf + s * 128, src + t * 128, 512, full + s);
            }
    } else {
        sums[lane] = consume_ring(buf, full, empty, tiles, lane);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncwarp();
        if (lane == 0) {
            bulk_out(out, sums, 128);
            if (write_in_flight) sums[0] = 0.0f;
            bulk_out_wait();
        }
    }
}"""


def _bulk_ring(order: int, write_in_flight: int = 0, source: str = MBARRIER_RING + BULK_RING):
    tiles = 7
    src, out = torch.randn(tiles * 128, generator=generator(4)), torch.full((32,), float("nan"))
    _launch_raw(_with_cp_async(source), "bulk_ring", 64, src.data_ptr(), out.data_ptr(), tiles, write_in_flight,
                order=order, smem=128 + 3 * 512)
    return out, src.view(tiles, 32, 4).sum((0, 2))


@pytest.mark.parametrize("order", [0, 1, 3, 4, EARLY_LANDING])
def test_a_ring_of_bulk_copies_runs_and_its_races_are_caught(order):
    """cp.async.bulk in (its bytes completing on an mbarrier armed by arrive.expect_tx) and out (a
    bulk group): the ring's sums are right in every order; a consumer that skips its wait reads
    stages not yet landed, and a store over a copy's source before its wait is reported."""
    out, expected = _bulk_ring(order)
    torch.testing.assert_close(out, expected)
    if order == 0:  # copies land when their phase completes: a consumer that does not wait sees the old bytes
        skipping = (MBARRIER_RING + BULK_RING).replace("        mbar_wait(full + s, (t >> 1) & 1);\n", "")
        assert skipping != MBARRIER_RING + BULK_RING
        try:
            assert not torch.allclose(_bulk_ring(order, source=skipping)[0], expected)
        except EmulationError as error:
            assert "deadlock" in str(error) or "in flight" in str(error)
        with pytest.raises(EmulationError, match="written while a bulk copy out of it was in flight"):
            _bulk_ring(order, write_in_flight=1)


def test_the_bulk_copies_ptx_compiles_for_hopper():
    """The bulk-copy instructions the emulator takes are the GPU's own: NVRTC accepts them."""
    from pairgen.compiler import compile_many

    (result,) = compile_many([(_with_cp_async(MBARRIER_RING + BULK_RING), "bulk_ring", "sm_90")])
    assert not isinstance(result, Exception), result


W_REGISTERS = {"p_groups": 2, "p_stages": 2, "p_wn": 32, "o_groups": 3, "o_wn": 64, "o_stages": 1, "swizzle": True,
               "consts_smem": True, "paired_columns": True, "z_registers": True, "w_registers": True}

#: Broken variants of the w_registers projection and what must stop them.
MUTATIONS = {
    "the tile's pair order": ("lane_pair((n >> 1) & 3, 2 * (n >> 3) + (n & 1))",
                              "lane_pair((n >> 1) & 3, 2 * (n >> 3) + ((n + 1) & 1))", 0, "result"),
    "the x tile not waited for": ("cp_async_wait<0>();\n        fence_async_shared();\n        __syncthreads();  // this tile",
                                  "cp_async_wait<1>();\n        fence_async_shared();\n        __syncthreads();  // this tile",
                                  0, "overwritten before its wait"),
    "the last product not waited for": ("} else {\n                    wgmma_wait<0>();\n                }\n"
                                        "                w_registers_epilogue(acc1",
                                        "} else {\n                    wgmma_wait<1>();\n                }\n"
                                        "                w_registers_epilogue(acc1", 0, "cp.async into shared memory"),
    "no barrier after the statistics": ("        __syncthreads();  // the statistics are in", "", 3, "result"),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_broken_kernels_fail_emulated(mutation):
    old, new, order, caught_by = MUTATIONS[mutation]
    plan = TRIMUL.at("bfloat16").plan("wgmma", W_REGISTERS, MODELS)
    rendered = codegen.render_plan(plan)
    assert rendered.source.count(old) == 1, "the mutation no longer matches the template"
    variant = EmulatedVariant(plan, dataclasses.replace(rendered, source=rendered.source.replace(old, new)))
    case = _case("bfloat16", MODELS, 1, 37)
    if caught_by == "result":
        assert not emulated_error(*case, variant, order).ok
    else:
        with pytest.raises(EmulationError, match=caught_by):
            emulated_error(*case, variant, order)
