"""GPU: every contact strategy over sampled params and odd shapes against the float64 reference."""
from __future__ import annotations

import pytest
import torch

from helpers import ODD_SHAPES, REAL_WIDTHS, SEED_WIDTHS, assert_gradients_match_the_reference, generator, sampled_plans
from pairgen import compiler, runtime
from pairgen.check import compare, reference64
from pairgen.ops.contact import CONTACT
from pairgen.tuned import TunedDB

pytestmark = pytest.mark.gpu
TOL = CONTACT.tolerance["float32"]
WIDTHS = (SEED_WIDTHS, *REAL_WIDTHS)
POINTS_PER_STRATEGY = 6


def _cases():
    cases = []
    for widths in WIDTHS:
        for strategy in CONTACT.strategies:
            for plan in sampled_plans(CONTACT, strategy, widths, POINTS_PER_STRATEGY):
                cases.append(pytest.param(plan, id=f"P{widths['P']}H{widths['H']}-{plan.label}"))
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def variants():
    """Every sampled variant, compiled in parallel once."""
    plans = [c.values[0] for c in CASES]
    rendered = [runtime.render_plan(p) for p in plans]
    arch = runtime.default_arch()
    results = compiler.compile_many([(r.source, r.kernel_name, arch) for r in rendered])
    out = {}
    for plan, rend, res in zip(plans, rendered, results):
        out[id(plan)] = res if isinstance(res, Exception) else runtime.Variant(plan, rend, res)
    return out


_references: dict = {}


def _data(widths, batch, n, seed):
    """Module with random weights, input, and its float64 reference (cached per shape)."""
    key = (tuple(widths.values()), batch, n, seed)
    if key not in _references:
        gen = generator(seed)
        module = CONTACT.make_module(widths, gen).cuda()
        dist = "cauchy" if seed % 2 else "normal"
        (x,) = CONTACT.make_inputs({"B": batch, "N": n, **widths}, gen, dist)
        x = x.cuda()
        _references[key] = (module, x, reference64(module, (x,)))
    return _references[key]


@pytest.mark.parametrize("plan", CASES)
def test_variant_matches_float64_reference(plan, variants):
    variant = variants[id(plan)]
    if isinstance(variant, Exception):
        raise variant
    failures = []
    for k, (batch, n) in enumerate(ODD_SHAPES):
        module, x, ref = _data(plan.widths, batch, n, seed=k)
        out = torch.full((batch, n, n), float("nan"), device="cuda")
        with torch.no_grad():
            module._launch(x, out=out, variant=variant)
        torch.cuda.synchronize()
        result = compare(out, ref, TOL)
        if not result.ok:
            failures.append(f"B={batch} N={n}: {result}")
    assert not failures, f"{plan.label}:\n" + "\n".join(failures)


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
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        module(x)  # warm: compile and pack outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # a launch on the legacy default stream would break capture
            out = module(x)
    torch.cuda.current_stream().wait_stream(side)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
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
    info = runtime.device_info(0)
    entries = TunedDB("contact", info.slug).entries()
    if not entries:
        pytest.skip(f"no tuned contact entries for {info.slug} in {TunedDB('contact', info.slug).path}")
    for entry in entries:
        shape = entry["shape"]
        widths = CONTACT.widths_of(shape)
        plan = CONTACT.plan(entry["strategy"], entry["params"], widths)
        variant = runtime.build_variant(plan)
        module, x, ref = _data(widths, 1, 37, seed=21)
        out = torch.full((1, 37, 37), float("nan"), device="cuda")
        with torch.no_grad():
            module._launch(x, out=out, variant=variant)
        result = compare(out, ref, TOL)
        assert result.ok, f"tuned {entry['strategy']} {entry['params']}: {result}"
