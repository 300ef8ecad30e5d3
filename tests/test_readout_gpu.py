"""GPU: every readout strategy over sampled params and odd shapes against the float64 reference;
the mask and NaN semantics; the j split (partials, flags and counters across blocks, calls and
graph replays); the gemm strategy (poisoned scratch, warps per node, graphs, TF32 callers);
streams, graphs, gradients, repacking, tuned entries."""
from __future__ import annotations

import pytest
import torch

from helpers import (ODD_SHAPES, assert_graph_survives_larger_calls, assert_closed_form_meets_the_standard,
                     assert_max_act_grad_is_max_grad_then_act_grad, assert_pair_gradient_matches_float64,
                     assert_readout_max_kernels_match_pytorch, assert_the_first_layer_kernel_rounds_once,
                     assert_variant_matches_float64,
                     check_tuned_entries, compile_plans, compiled_variant, generator, reference_case,
                     run_under_graph_capture, run_variant, sampled_cases, sampled_plans, gpu_params)
from pairgen import runtime
from pairgen.tuning.check import compare, reference64
from pairgen.ops.readout import READOUT, gemm_scratch_offsets, pair_max_scratch

pytestmark = pytest.mark.gpu
TOL = READOUT.tolerance["float32"]
WIDTHS = tuple(READOUT.widths_of(s) for p in READOUT.presets.values() for s in p)
SEED_WIDTHS = WIDTHS[0]
POINTS_PER_STRATEGY = 5


CASES = gpu_params(lambda: sampled_cases(READOUT.at("float32"), WIDTHS, POINTS_PER_STRATEGY,
                                         label="D{D}P{P}H{H}".format_map))


@pytest.fixture(scope="module")
def variants():
    """Every sampled variant, compiled in parallel once."""
    return compile_plans([c.values[0] for c in CASES])


def _run(module, inputs, variant):
    B, N = inputs[0].shape[:2]
    return run_variant(module, inputs, variant, (B, N, module.widths["D"]))


@pytest.mark.parametrize("plan", CASES)
def test_variant_matches_float64_reference(plan, variants):
    big = plan.widths["H"] >= 512

    def skip(batch, n):
        return big and batch * n > 200  # the float64 reference of D256/H512 at B3 N123 dominates the test time

    assert_variant_matches_float64(READOUT, plan, compiled_variant(variants, plan), ODD_SHAPES, skip=skip)


def _default_variants(widths):
    out = []
    for strategy in READOUT.at("float32").strategies:  # the exact kernels (mma: test_readout_mma_gpu.py)
        plans = sampled_plans(READOUT, strategy, widths, 1, seed=3)
        out += [runtime.build_variant(p) for p in plans[:2]]
    return out


def test_masks_isolated_nodes_single_edges_and_nan():
    """The definition's semantics (docs/ops.md) on the kernels: fully masked rows give nodes + norm.bias; a single edge
    pools its own message; NaN at a valid edge makes the row NaN, at a masked edge it is ignored;
    bool and float masks agree."""
    gen = generator(31)
    module = READOUT.make_module(SEED_WIDTHS, gen).cuda()
    nodes, pair, mask = (t.cuda() for t in READOUT.make_inputs({"B": 3, "N": 37, **SEED_WIDTHS}, gen))
    mask[2] = False  # a graph without edges
    pair[0, 5, 9, 3] = float("nan")
    mask[0, 5, 9] = True
    pair[1, 6, 9, 3] = float("nan")
    mask[1, 6, 9] = False
    ref = reference64(module, (nodes, pair, mask))
    assert torch.isnan(ref[0, 5]).all() and torch.isfinite(ref[1, 6]).all()
    for variant in _default_variants(SEED_WIDTHS):
        out = _run(module, (nodes, pair, mask), variant)
        assert compare(out, ref, TOL).ok, variant
        assert torch.isnan(out[0, 5]).all() and torch.isfinite(out[1, 6]).all()
        torch.testing.assert_close(out[:, 0], nodes[:, 0] + module.norm.bias, rtol=0, atol=1e-5)
        torch.testing.assert_close(out[2], nodes[2] + module.norm.bias, rtol=0, atol=1e-5)
        module.force_variant(variant)
        try:
            with torch.no_grad():
                from_float = module(nodes, pair, mask.float())
        finally:
            module.force_variant(None)
        torch.testing.assert_close(from_float, out, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("batch", [1, 3])
def test_n_equal_one(batch):
    gen = generator(32)
    module = READOUT.make_module(SEED_WIDTHS, gen).cuda()
    nodes, pair, mask = (t.cuda() for t in READOUT.make_inputs({"B": batch, "N": 1, **SEED_WIDTHS}, gen))
    mask[0, 0, 0] = True  # a self edge in the first graph; the others are isolated
    ref = reference64(module, (nodes, pair, mask))
    for variant in _default_variants(SEED_WIDTHS):
        assert compare(_run(module, (nodes, pair, mask), variant), ref, TOL).ok, variant


def test_module_forward_noncontiguous_inputs():
    gen = generator(11)
    module = READOUT.make_module(SEED_WIDTHS, gen).cuda()
    nodes, pair, mask = (t.cuda() for t in READOUT.make_inputs({"B": 2, "N": 37, **SEED_WIDTHS}, gen))
    pair_t, mask_t = pair.transpose(1, 2), mask.transpose(1, 2)
    assert not pair_t.is_contiguous() and not mask_t.is_contiguous()
    with torch.no_grad():
        out = module(nodes, pair_t, mask_t)
    assert compare(out, reference64(module, (nodes, pair_t, mask_t)), TOL).ok


@pytest.mark.parametrize("batch,n,mode", [(4, 24, "cooperative"), (48, 61, "plain")])
def test_fused_is_one_cooperative_launch_where_its_grid_fits_else_two(batch, n, mode):
    """The seed's grid (36 prologue + 96 pair blocks) is resident at once: one cooperative launch,
    the pair blocks waiting for the prologue's; B48 N61's (1,098 + 2,928) is not: the same kernel
    twice, prologue blocks then pair blocks. Each launch leaves the producers' counter zeroed."""
    widths = SEED_WIDTHS
    plan = READOUT.plan("fused", next(p for s, p in READOUT.default_points if s == "fused"), widths)
    variant = runtime.build_variant(plan)
    module, inputs, ref = reference_case(READOUT, widths, batch, n, seed=batch)
    assert variant.launches(0, batch, n)[0].mode == mode
    for _ in range(3):
        result = compare(_run(module, inputs, variant), ref, TOL)
        assert result.ok, f"B={batch} N={n} ({mode}): {result}"
    assert module._barrier[1].tolist() == [0, 0]


def test_runs_on_the_current_stream_and_under_graph_capture():
    gen = generator(12)
    module = READOUT.make_module(SEED_WIDTHS, gen).cuda()
    inputs = tuple(t.cuda() for t in READOUT.make_inputs({"B": 3, "N": 37, **SEED_WIDTHS}, gen))
    ref = reference64(module, inputs)
    out = run_under_graph_capture(module, inputs)  # both launches of the split strategy must be captured
    assert compare(out, ref, TOL).ok


def test_programmatic_main_launch_gives_the_plain_launchs_result_eager_and_captured():
    """The split strategy's main kernel launched as a programmatic dependent of the prologue
    (it stages weights before waiting for U and V) gives bit for bit what a plain launch after
    the prologue gives, in eager calls on a fresh module per mode and under graph capture: a
    main kernel that read U/V too early would read another call's or uninitialised scratch."""
    gen = generator(16)
    plan = READOUT.default_plan(SEED_WIDTHS, runtime.device_info(0).limits)
    assert plan.strategy == "split"
    variant = runtime.build_variant(plan)  # forced: the tuned choice at the seed may be another strategy
    inputs = tuple(t.cuda() for t in READOUT.make_inputs({"B": 4, "N": 24, **SEED_WIDTHS}, gen))
    outputs = {}
    for programmatic in (False, True):
        module = READOUT.make_module(SEED_WIDTHS, generator(17)).cuda()
        module.programmatic_main = programmatic
        module.force_variant(variant)
        with torch.no_grad():
            eager = [module(*inputs) for _ in range(3)]
        captured = run_under_graph_capture(module, inputs)
        main = module.variant_for(24, inputs[0].device).launches(0, 4, 24, programmatic=programmatic)[0]
        assert (main.mode == "programmatic") is programmatic
        outputs[programmatic] = (eager, captured)
    ref = reference64(module, inputs)
    for programmatic, (eager, captured) in outputs.items():
        assert all(compare(out, ref, TOL).ok for out in eager + [captured]), programmatic
    assert all(torch.equal(a, b) for a, b in zip(outputs[False][0], outputs[True][0]))
    assert torch.equal(outputs[False][1], outputs[True][1])


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recomputed"])
def test_gradients_meet_the_standard(recompute):
    """The closed-form backward (pairgen/ops/readout/backward.py), from the intermediates its
    forward kept, or recomputed after the kernel's forward: the nodes', pair features' and every
    parameter's gradient within relative L2 2e-5 of float64 autograd, with isolated nodes, at an
    odd length with heavy tails (the max's sparse gradient through cuSPARSE)."""
    gen = generator(13)
    module = READOUT.make_module(SEED_WIDTHS, gen).cuda()
    module.recompute_for_backward = recompute
    inputs = tuple(t.cuda() for t in READOUT.make_inputs({"B": 2, "N": 29, **SEED_WIDTHS}, gen, "cauchy"))
    g = torch.randn(inputs[0].shape, generator=gen).cuda()
    assert_closed_form_meets_the_standard(module, inputs, g)


def test_weights_updated_in_place_are_repacked():
    gen = generator(14)
    module = READOUT.make_module(SEED_WIDTHS, gen).cuda()
    inputs = tuple(t.cuda() for t in READOUT.make_inputs({"B": 1, "N": 7, **SEED_WIDTHS}, gen))
    with torch.no_grad():
        module(*inputs)
        module.fuse[0].weight.mul_(-0.5)  # an optimizer step, in effect
        out = module(*inputs)
    assert compare(out, reference64(module, inputs), TOL).ok


def test_tuned_entries_load_and_run():
    check_tuned_entries(READOUT)


# ---- the j split: J_SPLIT blocks per tile of rows i, combined by the last to arrive ---------------

_SEED_POINT = {"tile_i": 2, "tile_j": 8, "threads": 128, "threads_n": 8, "tn": 4, "unroll": 4, "weights_smem": False}
J_SPLIT_POINTS = [
    ("split", dict(_SEED_POINT, j_split=3, prologue_rows=2), SEED_WIDTHS),  # N = 24: one j tile per split
    ("split", dict(_SEED_POINT, weights_smem=True, j_split=3), SEED_WIDTHS),  # splits without j work stage nothing
    ("split", dict(_SEED_POINT, tile_j=16, j_split=2), SEED_WIDTHS),
    ("split", dict(_SEED_POINT, tile_i=8, unroll=2, j_split=8), SEED_WIDTHS),  # 8 nodes, 4 warps; N = 37: 3 idle splits
    ("split", dict(_SEED_POINT, tile_i=1, tile_j=16, j_split=6), SEED_WIDTHS),  # 1 node: 3 warps idle in the combine
    ("direct", dict(_SEED_POINT, j_split=4), SEED_WIDTHS),
    # 4-partner tiles (split: weights staged by cp.async), several j tiles per split at N = 37 and 123
    ("split", dict(_SEED_POINT, tile_i=4, tile_j=4, weights_smem=True, j_split=6), SEED_WIDTHS),
    ("direct", dict(_SEED_POINT, tile_i=4, tile_j=4, j_split=2), SEED_WIDTHS),
    ("split", {"tile_i": 4, "tile_j": 16, "threads": 256, "threads_n": 8, "tn": 8, "unroll": 4, "weights_smem": False,
               "j_split": 4}, WIDTHS[1]),
]
J_SPLIT_CASES = [pytest.param(READOUT.plan(s, p, w), id="D{D}P{P}H{H}-".format_map(w) + READOUT.plan(s, p, w).label)
                 for s, p, w in J_SPLIT_POINTS]


@pytest.fixture(scope="module")
def j_split_variants():
    return compile_plans([c.values[0] for c in J_SPLIT_CASES])


def _split_of(plan, j: int) -> int:
    """The split whose blocks fold partner j: j tiles are dealt round-robin (_pair_max.cuh.j2)."""
    return (j // plan.params["tile_j"]) % plan.params["j_split"]


def _scratch_words(plan, B: int, N: int) -> int:
    """The 4-byte words of scratch a call at (B, N) takes."""
    D, H = plan.widths["D"], plan.widths["H"]
    if plan.strategy == "gemm":
        return gemm_scratch_offsets(B, N, D, H)["total"]
    return pair_max_scratch(B, N, D, H, plan.params["j_split"], with_uv=plan.strategy == "split")["total"]


def _run_on_poisoned_scratch(module, inputs, variant):
    """_run on NaN-filled scratch: a partial row or flag that the combine read without its block
    having written it shows up as NaN or as a wrong row (gemm: a hidden row or message the kernels
    left unwritten reaches the output as NaN). split and direct: the module's held scratch is
    filled with NaN in place; gemm: a NaN-filled block of exactly the scratch's size is freed
    right before the call, and the caching allocator most likely hands it to the call's scratch."""
    B, N = inputs[0].shape[:2]
    words = _scratch_words(variant.plan, B, N)
    out = torch.full((B, N, module.widths["D"]), float("nan"), device="cuda")
    module.packed_weights()  # packed before the poisoned block is freed, so it is not what takes it
    if variant.plan.strategy != "gemm" and words:
        module._split_scratch(0, words)
        module._scratch.live.fill_(float("nan"))
    torch.full((words,), float("nan"), device="cuda")  # freed at once, cached
    with torch.no_grad():
        module._launch(*inputs, out=out, variant=variant)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("plan", J_SPLIT_CASES)
def test_j_split_matches_float64_reference(plan, j_split_variants):
    """Odd shapes: N = 1 (more splits than j tiles), 7, 37, 64, 123 (not multiples of
    TILE_J * J_SPLIT), B = 1 and 3; heavy-tailed inputs on every other shape."""
    assert_variant_matches_float64(READOUT, plan, compiled_variant(j_split_variants, plan), ODD_SHAPES)


def _check_single_edges_nan_and_masked_rows(plan, variant, seed: int, N: int, single_edges: dict, what: str):
    """B = 3. Batch 1: node 2 + s has one valid edge, to partner single_edges[s]. Batch 0: NaN at
    a valid edge to the last of those partners makes node 5's row NaN; at a masked edge (node 6)
    it is ignored. Batch 2 has no edge at all, and node 0 of every batch is isolated: both give
    nodes + norm.bias. Returns (module, inputs, out) for further checks."""
    gen = generator(seed)
    module = READOUT.make_module(plan.widths, gen).cuda()
    nodes, pair, mask = (t.cuda() for t in READOUT.make_inputs({"B": 3, "N": N, **plan.widths}, gen))
    mask[2] = False
    for s, j in single_edges.items():
        mask[1, 2 + s] = False
        mask[1, 2 + s, j] = True
    nan_j = single_edges[max(single_edges)]
    pair[0, 5, nan_j, 3] = pair[0, 6, nan_j, 3] = float("nan")
    mask[0, 5, nan_j], mask[0, 6, nan_j] = True, False
    ref = reference64(module, (nodes, pair, mask))
    assert torch.isnan(ref[0, 5]).all() and torch.isfinite(ref[0, 6]).all()

    out = _run_on_poisoned_scratch(module, (nodes, pair, mask), variant)
    assert compare(out, ref, TOL).ok, compare(out, ref, TOL)
    assert torch.isnan(out[0, 5]).all() and torch.isfinite(out[0, 6]).all()
    bias = module.norm.bias
    torch.testing.assert_close(out[2], nodes[2] + bias, rtol=0, atol=1e-5)
    torch.testing.assert_close(out[:, 0], nodes[:, 0] + bias, rtol=0, atol=1e-5)
    for s in single_edges:  # a single edge pools its own message, not 0
        assert (out[1, 2 + s] - nodes[1, 2 + s] - bias).abs().max() > 1e-3, f"node {2 + s} ({what} {s}) pooled to 0"
    return module, (nodes, pair, mask), out


@pytest.mark.parametrize("plan", J_SPLIT_CASES)
def test_j_split_single_edges_nan_and_masked_rows_in_every_split(plan, j_split_variants):
    """_check_single_edges_nan_and_masked_rows with N = 37 and node 2 + s's only edge to the last
    partner of split s (the other splits see none of its edges, so the combine must skip their
    unwritten rows); the NaN edge is folded by a non-first split."""
    N = 37
    last_j = {_split_of(plan, j): j for j in range(N)}  # split -> its last partner
    assert _split_of(plan, last_j[max(last_j)]) > 0, "the NaN edge must be folded by a non-first split"
    _check_single_edges_nan_and_masked_rows(plan, compiled_variant(j_split_variants, plan), 41, N, last_j, "split")


def _check_n_equal_one(plan, variant, batch: int, seed: int) -> None:
    """N = 1 against float64: a self edge in the first graph, the others' single node isolated."""
    gen = generator(seed)
    module = READOUT.make_module(plan.widths, gen).cuda()
    nodes, pair, mask = (t.cuda() for t in READOUT.make_inputs({"B": batch, "N": 1, **plan.widths}, gen))
    mask[0, 0, 0] = True
    ref = reference64(module, (nodes, pair, mask))
    assert compare(_run_on_poisoned_scratch(module, (nodes, pair, mask), variant), ref, TOL).ok


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("plan", J_SPLIT_CASES)
def test_j_split_n_equal_one(plan, batch, j_split_variants):
    """N = 1: only split 0 has a j tile; the others only write "no edge" and count."""
    _check_n_equal_one(plan, compiled_variant(j_split_variants, plan), batch, seed=42)


def _capture_without_warm_up(module, inputs):
    """The module's forward captured into a CUDA graph with no earlier call at this shape (its
    variant is loaded and its weights packed by calls at another shape)."""
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = module(*inputs)
    return graph, out


def _replay(graph, out) -> torch.Tensor:
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return out


def test_j_split_counters_reset_between_calls_growth_and_graph_replays(j_split_variants):
    """A counter the last block failed to reset would make the next launch's blocks of that tile
    miss the combine (outputs left NaN). Consecutive calls; a graph whose counters were made
    under capture (zeroed by its replays); eager calls growing the module's counters after the
    capture, with the graph still replaying correctly; a captured graph on the module's counters.
    The module's held scratch (U/V, partial maxima) goes through the same growth and capture."""
    plan = J_SPLIT_CASES[0].values[0]
    variant = compiled_variant(j_split_variants, plan)
    gen = generator(43)
    module = READOUT.make_module(plan.widths, gen).cuda()
    module.MIN_COUNTERS = 1  # every larger grid grows the counters
    small, large = (tuple(t.cuda() for t in READOUT.make_inputs({"B": b, "N": n, **plan.widths}, gen))
                    for b, n in ((1, 7), (3, 37)))
    ref_small, ref_large = reference64(module, small), reference64(module, large)
    module.force_variant(variant)
    try:
        for _ in range(2):
            assert compare(_run(module, small, variant), ref_small, TOL).ok
        graph, captured = _capture_without_warm_up(module, large)
        for _ in range(3):
            assert compare(_replay(graph, captured), ref_large, TOL).ok
        for _ in range(2):
            with torch.no_grad():
                assert compare(module(*large), ref_large, TOL).ok
        assert compare(_replay(graph, captured), ref_large, TOL).ok, "the graph survives the counters' growth"
        live, retired = module._counters.live, module._counters.retired
        assert live.numel() >= 3 * 19 and len(retired) >= 2
        assert all(int(t.abs().sum()) == 0 for t in (live, *retired)), "every launch leaves its counters zeroed"
        assert len(module._scratch.retired) >= 2, "the scratch grew under capture and again after it"
        assert compare(run_under_graph_capture(module, large, replays=3), ref_large, TOL).ok
        assert compare(run_under_graph_capture(module, small, replays=2), ref_small, TOL).ok
    finally:
        module.force_variant(None)


# ---- the gemm strategy: prologue, hidden kernel, cuBLAS mm (fp32), pool kernel --------------------

_GEMM_DEFAULT, _GEMM_SPLIT, _GEMM_GENERAL = (params for strategy, params in READOUT.default_points if strategy == "gemm")
GEMM_POINTS = [
    (_GEMM_DEFAULT, SEED_WIDTHS),
    (dict(_GEMM_DEFAULT, pool_nodes=1, pool_warps=4), SEED_WIDTHS),  # N = 37: warps 2, 3 see no partner
    (dict(_GEMM_DEFAULT, pool_nodes=8, pool_warps=1, tile=64, tn=4), SEED_WIDTHS),  # 8 nodes a block, no combine
    (dict(_GEMM_DEFAULT, tile=256, threads=256, weights_smem=True, unroll=4, tn=4), SEED_WIDTHS),  # W_p staged
    (_GEMM_GENERAL, SEED_WIDTHS),  # 1x4 micro-tiles, 8 columns per chunk
    (dict(_GEMM_DEFAULT, pool_warps=4), WIDTHS[1]),
    (_GEMM_DEFAULT, WIDTHS[2]),
    (dict(_GEMM_DEFAULT, weights_smem=True), WIDTHS[2]),
]
# tf32x3's split product (hidden rows [hi | lo], two TF32 GEMMs): the fp32 standard still holds.
GEMM_SPLIT_PLANS = [READOUT.plan("gemm", _GEMM_SPLIT, w, "tf32x3") for w in (SEED_WIDTHS, WIDTHS[2])]
GEMM_CASES = [pytest.param(plan, id="D{D}P{P}H{H}-".format_map(plan.widths) + plan.label)
              for plan in [*(READOUT.plan("gemm", p, w) for p, w in GEMM_POINTS), *GEMM_SPLIT_PLANS]]


@pytest.fixture(scope="module")
def gemm_variants():
    return compile_plans([c.values[0] for c in GEMM_CASES])


def test_sampled_cases_include_the_gemm_strategy():
    """The generic tests above sample gemm points at every preset width (its defaults first)."""
    for widths in WIDTHS:
        gemm = [c.values[0] for c in CASES if c.values[0].strategy == "gemm" and c.values[0].widths == widths]
        assert len(gemm) >= POINTS_PER_STRATEGY and gemm[0].params == _GEMM_DEFAULT


@pytest.mark.parametrize("plan", GEMM_CASES)
def test_gemm_matches_float64_reference_on_poisoned_scratch(plan, gemm_variants):
    """Odd shapes (N = 1, 7, 37, 64, 123; B = 1, 3), heavy-tailed inputs on every other one, the
    scratch handed a NaN-filled block: a hidden row, message or uv row left unwritten shows."""
    variant = compiled_variant(gemm_variants, plan)
    big = plan.widths["H"] >= 512
    failures = []
    for k, (batch, n) in enumerate(ODD_SHAPES):
        if big and batch * n > 200:  # the float64 reference at D256/H512, B3 N123 dominates the time
            continue
        module, inputs, ref = reference_case(READOUT, plan.widths, batch, n, seed=k)
        result = compare(_run_on_poisoned_scratch(module, inputs, variant), ref, TOL)
        if not result.ok:
            failures.append(f"B={batch} N={n}: {result}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("plan", GEMM_CASES[:3] + GEMM_CASES[5:6] + GEMM_CASES[-2:-1])
def test_gemm_single_edges_nan_masked_rows_and_float_masks(plan, gemm_variants):
    """_check_single_edges_nan_and_masked_rows with N = 123 (four chunks of 32 partners) and node
    2 + s's only edge to the last partner of chunk s (with several warps per node, each warp holds
    one node's only edge in turn); the NaN edge is in the last chunk. A float mask (read as
    mask != 0) gives the bool mask's output bit for bit."""
    variant = compiled_variant(gemm_variants, plan)
    N = 123
    last_of_chunk = {s: min(32 * s + 31, N - 1) for s in range(4)}
    module, (nodes, pair, mask), out = _check_single_edges_nan_and_masked_rows(plan, variant, 51, N, last_of_chunk,
                                                                              "chunk")
    from_float = _run(module, (nodes, pair, mask.float() * 0.5), variant)  # nonzero entries: edges
    torch.testing.assert_close(from_float, out, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("batch", [1, 3])
def test_gemm_n_equal_one(batch, gemm_variants):
    plan = GEMM_CASES[1].values[0]  # four warps per node: three of them see no partner
    _check_n_equal_one(plan, compiled_variant(gemm_variants, plan), batch, seed=52)


def test_gemm_graph_capture_replays_and_survives_later_larger_calls(gemm_variants):
    """All four launches (the mm included) are captured on the current stream; the graph keeps
    its scratch: eager calls at a larger shape afterwards (a new, larger scratch each) leave its
    replays correct."""
    plan = GEMM_CASES[0].values[0]
    module, small, ref_small = reference_case(READOUT, plan.widths, 1, 7, seed=53)
    _, large, ref_large = reference_case(READOUT, plan.widths, 3, 64, seed=53)
    module.force_variant(compiled_variant(gemm_variants, plan))
    try:
        assert compare(run_under_graph_capture(module, small, replays=3), ref_small, TOL).ok
        assert_graph_survives_larger_calls(module, small, ref_small, large, ref_large, TOL)
    finally:
        module.force_variant(None)


@pytest.mark.parametrize("api", ["legacy", "fp32_precision"])
def test_gemm_gives_fp32_results_to_a_caller_that_allowed_tf32(api, gemm_variants):
    """The caller allowed TF32 for cuBLAS (either API); the gemm strategy's mm still runs in fp32
    (TF32 would miss the tolerance at K = 512: the reference itself does, checked first), and the
    caller's setting is what it was afterwards. Both APIs: with torch >= 2.9, reading the legacy
    flag raises for a caller on the fp32_precision API, so fp32_matmul must not read it."""
    matmul = torch.backends.cuda.matmul
    new_api = hasattr(matmul, "fp32_precision")
    if api == "fp32_precision" and not new_api:
        pytest.skip(f"torch {torch.__version__} has no torch.backends.cuda.matmul.fp32_precision")
    plan = GEMM_CASES[6].values[0]  # D256 P64 H512
    module, inputs, ref = reference_case(READOUT, plan.widths, 1, 37, seed=54)
    saved = matmul.fp32_precision if new_api else matmul.allow_tf32
    if api == "legacy":
        matmul.allow_tf32 = True
    else:
        matmul.fp32_precision = "tf32"
    try:
        with torch.no_grad():
            assert not compare(module.reference_forward(*inputs), ref, TOL).ok, "TF32 must be visible at this shape"
        module.force_variant(compiled_variant(gemm_variants, plan))
        try:
            with torch.no_grad():
                out = module(*inputs)
        finally:
            module.force_variant(None)
        restored = matmul.fp32_precision == "tf32" if new_api else matmul.allow_tf32
        assert restored and (api != "legacy" or matmul.allow_tf32), "the caller's setting is restored"
    finally:
        matmul.allow_tf32 = False  # both APIs consistent again, then the saved value
        if new_api:
            matmul.fp32_precision = saved
        else:
            matmul.allow_tf32 = saved
    assert compare(out, ref, TOL).ok


def test_gemm_inputs_that_start_mid_vector_or_are_not_contiguous(gemm_variants):
    """The hidden kernel stages pair rows with cp.async and the prologue reads nodes as float4: a
    view 4 bytes past an aligned start, and transposed pair features and mask, are copied first."""
    plan = GEMM_CASES[0].values[0]
    module, (nodes, pair, mask), ref = reference_case(READOUT, plan.widths, 2, 37, seed=56)
    shifted_nodes = torch.empty(nodes.numel() + 1, device="cuda")[1:].view(nodes.shape).copy_(nodes)
    shifted_pair = torch.empty(pair.numel() + 1, device="cuda")[1:].view(pair.shape).copy_(pair)
    assert shifted_nodes.data_ptr() % 16 == 4 and shifted_pair.data_ptr() % 16 == 4
    pair_t = pair.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, other strides
    mask_t = mask.transpose(1, 2).contiguous().transpose(1, 2)
    assert not pair_t.is_contiguous() and not mask_t.is_contiguous()
    variant = compiled_variant(gemm_variants, plan)
    assert compare(_run(module, (shifted_nodes, shifted_pair, mask), variant), ref, TOL).ok
    assert compare(_run(module, (nodes, pair_t, mask_t), variant), ref, TOL).ok


def test_widths_no_split_tile_fits_run_the_gemm_default():
    """D=504 P=8 H=496: no split or direct tile fits shared memory; the module runs gemm's general
    default (not the reference) and matches float64."""
    widths = {"D": 504, "P": 8, "H": 496}
    gen = generator(55)
    module = READOUT.make_module(widths, gen).cuda()
    inputs = tuple(t.cuda() for t in READOUT.make_inputs({"B": 2, "N": 7, **widths}, gen))
    variant = module.variant_for(7, inputs[0].device)
    assert variant is not None and variant.plan.strategy == "gemm"
    with torch.no_grad():
        out = module(*inputs)
    assert compare(out, reference64(module, inputs), TOL).ok


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("B,N,D,P", [(2, 13, 24, 8), (3, 37, 7, 3), (2, 64, 256, 64)])
def test_the_16_bit_closed_form_kernels_match_pytorch_with_ties_isolated_nodes_and_nan(dtype, B, N, D, P):
    """The rows, the max with its winner counts and the max's gradient on the GPU against PyTorch's
    way (helpers.assert_readout_max_kernels_match_pytorch)."""
    assert_readout_max_kernels_match_pytorch("cuda", dtype, B, N, D, P, B * 1000 + N)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("B,N,D,H", [(2, 13, 24, 64), (1, 37, 70, 192), (2, 128, 256, 512)])
def test_the_act_grad_kernel_matches_float64(dtype, B, N, D, H):
    """fused_backward.act_gradient on the GPU: d_pre = (d_m W2) silu'(pre) against float64 of the same
    16-bit d_m (from the max's gradient kernel: a winner or a tie a node and channel, isolated nodes),
    W2 and pre, and d_u (each node's rows of d_pre summed) within the 16-bit standard (relative L2
    1e-2), pre NaN-free and heavy-tailed; pre is consumed (d_pre in its storage)."""
    from pairgen.ops.readout import fused_backward

    gen = torch.Generator(device="cuda").manual_seed(B * 100 + N + D)
    m = (torch.randint(-3, 4, (B, N, N, D), device="cuda", generator=gen) * 0.5).to(dtype)
    edge = torch.rand(B, N, N, device="cuda", generator=gen) < 0.7
    edge[0, 3] = False
    pooled, winners = fused_backward.max_pool(m, edge, 8)
    d_m, _ = fused_backward.max_pool_backward(m, edge, pooled, winners, torch.randn(B, N, D, device="cuda", generator=gen),
                                              8)
    w2 = (torch.randn(D, H, device="cuda", generator=gen) / D ** 0.5).to(dtype)
    pre = (torch.randn(B, N, N, H, device="cuda", generator=gen) * 3).clamp(-12, 12).to(dtype)
    pre64 = pre.double()
    sig = torch.sigmoid(pre64)
    exact = (d_m.double() @ w2.double()).view(B, N, N, H) * sig * (1 + pre64 * (1 - sig))
    storage = pre.data_ptr()
    d_pre, d_u = fused_backward.act_gradient(d_m, w2, pre, 8)
    assert d_pre.data_ptr() == storage and d_pre.dtype is dtype and d_u.dtype is dtype
    for name, ours, ref in (("d_pre", d_pre.view(B, N, N, H), exact), ("d_u", d_u, exact.sum(2))):
        assert torch.isfinite(ours).all(), name
        error = ((ours.double() - ref).norm() / ref.norm()).item()
        assert error <= 1e-2, f"{name}: {error}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("B,N,D,H", [(2, 13, 24, 64), (1, 37, 70, 192), (2, 128, 256, 512)])
def test_the_max_act_grad_kernel_is_the_max_gradient_then_act_grad(dtype, B, N, D, H):
    """fused_backward.max_act_gradient on the GPU equals max_pool_backward then act_gradient bit for
    bit (helpers.assert_max_act_grad_is_max_grad_then_act_grad), whose results the tests above hold
    to PyTorch's and float64's."""
    assert_max_act_grad_is_max_grad_then_act_grad("cuda", dtype, B, N, D, H, 3000 + N)


@pytest.mark.parametrize("wp", [False, True], ids=["pair_gradient", "weight_gradient"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("B,N,P,H", [(2, 13, 16, 128), (1, 37, 48, 384), (2, 128, 64, 512), (16, 128, 64, 512)])
def test_the_pair_gradient_kernels_match_float64(dtype, B, N, P, H, wp):
    """pair_grad's two kernels on the GPU (helpers.assert_pair_gradient_matches_float64): a last
    tile of partners past N, i split into ranges (B N / 16 tiles fill no GPU at B <= 2) and the
    readout's training widths, at its training shape too (one range)."""
    from pairgen.ops.readout import pair_grad

    splits = pair_grad.splits_for(B, N, torch.cuda.get_device_properties(0).multi_processor_count)
    assert (splits > 1) == (B <= 2)
    assert_pair_gradient_matches_float64("cuda", dtype, B, N, P, H, 4000 + N, wp)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("B,N,D,P,H", [(2, 23, 20, 24, 128), (1, 128, 256, 64, 512)])
def test_the_first_layer_kernel_rounds_once(dtype, B, N, D, P, H):
    """first_layer.py on the GPU (helpers.assert_the_first_layer_kernel_rounds_once): rows ending
    mid-tile with padded k-steps, and the readout's training shape's widths."""
    assert_the_first_layer_kernel_rounds_once("cuda", dtype, B, N, D, P, H, 2000 + N)
