"""GPU: every contact strategy over sampled params and odd shapes against the float64 reference."""
from __future__ import annotations

import pytest
import torch

from helpers import (ODD_SHAPES, REAL_WIDTHS, SEED_WIDTHS, assert_gradients_match_the_reference,
                     assert_variant_matches_float64, check_tuned_entries, compile_plans, compiled_variant, generator,
                     run_under_graph_capture, sampled_cases)
from pairgen.check import compare, reference64
from pairgen.ops.contact import CONTACT

pytestmark = pytest.mark.gpu
TOL = CONTACT.tolerance["float32"]
WIDTHS = (SEED_WIDTHS, *REAL_WIDTHS)
POINTS_PER_STRATEGY = 6


CASES = sampled_cases(CONTACT, WIDTHS, POINTS_PER_STRATEGY)


@pytest.fixture(scope="module")
def variants():
    """Every sampled variant, compiled in parallel once."""
    return compile_plans([c.values[0] for c in CASES])


@pytest.mark.parametrize("plan", CASES)
def test_variant_matches_float64_reference(plan, variants):
    assert_variant_matches_float64(CONTACT, plan, compiled_variant(variants, plan), ODD_SHAPES)


def test_module_forward_noncontiguous_and_tuned_choice():
    gen = generator(11)
    module = CONTACT.make_module(SEED_WIDTHS, gen).cuda()
    base = torch.randn(2, 37, 37, SEED_WIDTHS["P"], generator=gen).cuda()
    x = base.transpose(1, 2)  # non-contiguous, still (B, N, N, P)
    assert not x.is_contiguous()
    with torch.no_grad():
        out = module(x)
    assert compare(out, reference64(module, (x,)), TOL).ok


def test_runs_on_the_current_stream_and_under_graph_capture():
    gen = generator(12)
    module = CONTACT.make_module(SEED_WIDTHS, gen).cuda()
    x = torch.randn(3, 37, 37, SEED_WIDTHS["P"], generator=gen).cuda()
    ref = reference64(module, (x,))
    out = run_under_graph_capture(module, (x,))  # a launch on the legacy default stream would break capture
    assert compare(out, ref, TOL).ok


def test_gradients_are_the_references():
    gen = generator(13)
    module = CONTACT.make_module(SEED_WIDTHS, gen).cuda()
    assert_gradients_match_the_reference(module, (torch.randn(2, 7, 7, SEED_WIDTHS["P"], generator=gen).cuda(),))


def test_weights_updated_in_place_are_repacked():
    gen = generator(14)
    module = CONTACT.make_module(SEED_WIDTHS, gen).cuda()
    x = torch.randn(1, 7, 7, SEED_WIDTHS["P"], generator=gen).cuda()
    with torch.no_grad():
        module(x)
        module.mlp[0].weight.mul_(-0.5)  # an optimizer step, in effect
        out = module(x)
    assert compare(out, reference64(module, (x,)), TOL).ok


def test_tuned_entries_load_and_run():
    check_tuned_entries(CONTACT)
