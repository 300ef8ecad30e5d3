"""GPU: every readout strategy over sampled params and odd shapes against the float64 reference;
the mask and NaN semantics; streams, graphs, gradients, repacking, tuned entries."""
from __future__ import annotations

import pytest
import torch

from helpers import (ODD_SHAPES, assert_gradients_match_the_reference, assert_variant_matches_float64,
                     check_tuned_entries, compile_plans, compiled_variant, generator, run_under_graph_capture,
                     run_variant, sampled_cases, sampled_plans)
from pairgen import runtime
from pairgen.check import compare, reference64
from pairgen.ops.readout import READOUT

pytestmark = pytest.mark.gpu
TOL = READOUT.tolerance["float32"]
WIDTHS = tuple(READOUT.widths_of(s) for p in READOUT.presets.values() for s in p)
SEED_WIDTHS = WIDTHS[0]
POINTS_PER_STRATEGY = 5


CASES = sampled_cases(READOUT, WIDTHS, POINTS_PER_STRATEGY, label="D{D}P{P}H{H}".format_map)


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
    for strategy in READOUT.strategies:
        plans = sampled_plans(READOUT, strategy, widths, 1, seed=3)
        out += [runtime.build_variant(p) for p in plans[:2]]
    return out


def test_masks_isolated_nodes_single_edges_and_nan():
    """OPS.md's semantics on the kernels: fully masked rows give nodes + norm.bias; a single edge
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


def test_runs_on_the_current_stream_and_under_graph_capture():
    gen = generator(12)
    module = READOUT.make_module(SEED_WIDTHS, gen).cuda()
    inputs = tuple(t.cuda() for t in READOUT.make_inputs({"B": 3, "N": 37, **SEED_WIDTHS}, gen))
    ref = reference64(module, inputs)
    out = run_under_graph_capture(module, inputs)  # both launches of the split strategy must be captured
    assert compare(out, ref, TOL).ok


def test_gradients_are_the_references():
    gen = generator(13)
    module = READOUT.make_module(SEED_WIDTHS, gen).cuda()
    inputs = tuple(t.cuda() for t in READOUT.make_inputs({"B": 2, "N": 7, **SEED_WIDTHS}, gen))
    assert_gradients_match_the_reference(module, inputs)


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
