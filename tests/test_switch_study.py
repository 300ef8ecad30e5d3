"""scripts/switch_study.py on the CPU: its variants name only real switches, flip them for the plan
they make and leave the strategy as it was, and its rounds alternate (the timing itself needs a GPU:
a session's probes, docs/performance.md)."""
from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

from pairgen import codegen
from pairgen.ops.trimul import TRIMUL
from pairgen.ops.trimul.strategies import wgmma

PATH = Path(__file__).resolve().parent.parent / "scripts" / "switch_study.py"


@pytest.fixture(scope="module")
def study():
    loaded = importlib.util.spec_from_file_location("switch_study", PATH)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


def test_a_variant_names_switches_and_param_overrides(study):
    assert "PROJECTION_MASK_FOLD" in study.switches() and "P" not in study.switches()
    assert study.parse_variant("none=") == ("none", {}, {})
    name, flips, params = study.parse_variant("both=PROJECTION_MASK_FOLD,PROJECTION_STORE_POINTER:p_groups=3")
    assert name == "both" and params == {"p_groups": 3}
    assert flips == {"PROJECTION_MASK_FOLD": not wgmma.PROJECTION_MASK_FOLD,
                     "PROJECTION_STORE_POINTER": not wgmma.PROJECTION_STORE_POINTER}
    for bad in ("nosign", "=X", "a=NO_SUCH_SWITCH", "a=:p_groups=three", "a=:p_groups"):
        with pytest.raises(argparse.ArgumentTypeError):
            study.parse_variant(bad)


def test_a_param_override_takes_the_spaces_type_and_values(study):
    """A switch-like param's 0/1 becomes the bool the space holds (a plain 0 would fail the plan's
    point check on the GPU); a name or value the space lacks fails at parsing."""
    _, _, params = study.parse_variant("og3=:o_groups=3,o_staged_stores=0,swizzle=true")
    assert params == {"o_groups": 3, "o_staged_stores": False, "swizzle": True}
    assert type(params["o_staged_stores"]) is bool and type(params["o_groups"]) is int
    spec = TRIMUL.at("bfloat16")
    point = next(p for s, p in TRIMUL.default_points if s == "wgmma")
    study.plan_for(spec, point, {}, params, study.MODELS_FORM)  # the point check passes
    for bad in ("a=:o_groups=9", "a=:no_such_param=1", "a=:o_staged_stores=2", "a=:swizzle=yes"):
        with pytest.raises(argparse.ArgumentTypeError):
            study.parse_variant(bad)


def test_resources_need_no_gpu_and_say_what_cannot_run(study, monkeypatch):
    """--resources compiles a variant's kernels with NVRTC and prints their registers and shared
    memory; a variant that does not fit says why instead of compiling."""
    monkeypatch.setenv("PAIRGEN_ARCH", "sm_90")
    variants = [study.parse_variant("before="), study.parse_variant("four=:o_groups=4")]
    lines = study.resources_report(variants, [512], study.MODELS_FORM)
    assert len(lines) == 2
    assert lines[0].startswith("N512 before (the tuned point, ") and ": projection " in lines[0]
    assert " B shared in " in lines[0]
    assert re.search(r"output \d+ regs", lines[0]) and re.search(r"projection \d+ regs", lines[0])
    assert lines[1].startswith("N512 four (") and ": cannot run (" in lines[1] and "warpgroups" in lines[1]


def test_a_variants_plan_renders_its_switch_and_the_strategy_is_left_as_it_was(study):
    widths = study.MODELS_FORM
    params = next(p for s, p in TRIMUL.default_points if s == "wgmma")
    spec = TRIMUL.at("bfloat16")
    before = wgmma.PROJECTION_MASK_FOLD
    _, flips, _ = study.parse_variant("fold=PROJECTION_MASK_FOLD")
    flipped = codegen.render_plan(study.plan_for(spec, params, flips, {}, widths)).source
    plain = codegen.render_plan(study.plan_for(spec, params, {}, {}, widths)).source
    assert wgmma.PROJECTION_MASK_FOLD == before
    assert ("fold_mask(" in flipped) != ("fold_mask(" in plain)
    wider = study.plan_for(spec, params, {}, {"p_groups": 3, "p_wn": 64}, widths)
    assert wider.params["p_groups"] == 3 and wider.params["p_wn"] == 64


def test_widths_parse_to_the_pair_and_hidden_widths(study):
    assert study.parse_widths("P=256,H=256") == {"P": 256, "H": 256}
    assert study.parse_widths("P=384") == {"P": 384}
    for bad in ("Q=256", "P=250", "P=", "P=2x6", "P=0"):
        with pytest.raises(argparse.ArgumentTypeError):
            study.parse_widths(bad)


def test_rounds_alternate_and_the_summary_compares_with_the_first_variant(study):
    assert study.alternating_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert study.alternating_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    lines = study.summary({"base": [100.0, 104.0, 90.0], "new": [95.0, 99.0, 97.0]})
    assert lines[0].startswith("base: median 100.0 us") and "(+0.0 %)" in lines[0]
    assert lines[1].startswith("new: median 97.0 us") and "(-3.0 %)" in lines[1]


def test_a_training_variants_switches_hold_while_it_runs_and_are_restored(study):
    """--training sets a variant's switches for its calls (a training call reads the backward's when
    it first runs) and restores them after, an exception too."""
    before = wgmma.BACKWARD_POINTERS
    _, flips, _ = study.parse_variant("pointers=BACKWARD_POINTERS")
    with study.switched(flips):
        assert wgmma.BACKWARD_POINTERS is (not before)
    assert wgmma.BACKWARD_POINTERS is before
    with pytest.raises(RuntimeError), study.switched(flips):
        raise RuntimeError
    assert wgmma.BACKWARD_POINTERS is before


def test_the_output_side_backwards_switch_is_named_by_its_module(study):
    from pairgen.ops.trimul import output_backward

    assert "output_backward.DESCRIPTORS_ONCE" in study.switches() and "DESCRIPTORS_ONCE" not in study.switches()
    before = output_backward.DESCRIPTORS_ONCE
    _, flips, _ = study.parse_variant("described=output_backward.DESCRIPTORS_ONCE,BACKWARD_POINTERS")
    assert flips == {"output_backward.DESCRIPTORS_ONCE": not before, "BACKWARD_POINTERS": not wgmma.BACKWARD_POINTERS}
    with study.switched(flips):
        assert output_backward.DESCRIPTORS_ONCE is (not before)
    assert output_backward.DESCRIPTORS_ONCE is before


def test_a_variant_is_looked_up_in_what_the_tuned_entrys_tune_timed(study):
    """--resources says what the tune measured of each variant: the tuned point's time, a point it
    timed (the entry's "timed", as changes from the entry's params), or that it kept none such."""
    entry = {"params": {"o_groups": 1, "o_stages": 1, "o_wn": 64}, "us": 1300.0,
             "timed": [{"us": 1313.0, "changes": {"o_stages": 2}}, {"us": 1400.0, "strategy": "bmm", "changes": {}}]}
    assert study.record_of(entry, {}, {}) == "the tuned point, 1300.0 us"
    assert study.record_of(entry, {}, {"o_stages": 1}) == "the tuned point, 1300.0 us"
    assert study.record_of(entry, {}, {"o_stages": 2}) == "timed by its tune: 1313.0 us, +1.0 %"
    assert study.record_of(entry, {}, {"o_groups": 2}) == "not among the 2 other points its tune kept"
    assert study.record_of(entry, {"PROJECTION_MASK_FOLD": False}, {}) == "a switch: not in the tune's records"
    del entry["timed"]
    assert study.record_of(entry, {}, {"o_groups": 2}) == "its tune kept no record of other points"


def test_a_variant_gives_an_integer_setting_a_value_and_it_is_restored(study):
    """output_backward.GROUPS=3 (the output side's backward's warpgroups) holds while the variant
    runs; a setting outside SETTINGS, or a value that is not an integer, fails at parsing."""
    from pairgen.ops.trimul import output_backward

    before = output_backward.GROUPS
    name, flips, params = study.parse_variant("g3=output_backward.GROUPS=3,BACKWARD_POINTERS")
    assert name == "g3" and params == {}
    assert flips == {"output_backward.GROUPS": 3, "BACKWARD_POINTERS": not wgmma.BACKWARD_POINTERS}
    with study.switched(flips):
        assert output_backward.GROUPS == 3
    assert output_backward.GROUPS == before
    for bad in ("a=output_backward.GROUPS=three", "a=WGMMA_ROWS=32", "a=output_backward.GROUPS="):
        with pytest.raises(argparse.ArgumentTypeError):
            study.parse_variant(bad)


def test_the_resident_backwards_warpgroups_are_a_setting_its_plan_follows(study):
    """RESIDENT_BACKWARD_GROUPS=4 with the gradients two passes ahead: the backward plan a training
    call looks up follows the setting (its caches key it), and that kernel compiles without a spill
    (four passes ahead it spills)."""
    from pairgen import compiler

    _, flips, _ = study.parse_variant("g4=RESIDENT_BACKWARD_GROUPS=4,GRADIENT_PASSES_AHEAD=2")
    assert wgmma.backward_plan(TRIMUL, "bfloat16", study.MODELS_FORM).params["p_groups"] == wgmma.RESIDENT_BACKWARD_GROUPS
    with study.switched(flips):
        plan = wgmma.backward_plan(TRIMUL, "bfloat16", study.MODELS_FORM)
        assert plan.params["p_groups"] == 4 and plan.context["gradient_passes_ahead"] == 2
        rendered = codegen.render_plan(plan)
        compiled = compiler.compile_source(rendered.source, plan.main.name, "sm_90")
        assert compiled.kernels[plan.main.name]["spill_bytes"] == 0, compiled.summary()
    assert wgmma.backward_plan(TRIMUL, "bfloat16", study.MODELS_FORM).params["p_groups"] == 3
