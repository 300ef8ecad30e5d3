"""The training path's tuned launch shapes (pairgen/ops/backward_tuning.py, pairgen-tune --backward)
on the CPU: every point of each space renders to its declared signatures and compiles for sm_90;
entries are found by key and nearest bucket, and a stale or invalid one runs the defaults with a
warning; the sweep keeps the fastest point whose gradients agree with the default's; --status
lists the entries; --backward needs a GPU."""
from __future__ import annotations

import pytest
import torch

from pairgen import compiler, runtime
from pairgen.ops import backward_tuning
from pairgen.ops.trimul import fused_backward as trimul_fused
from pairgen.spec import DeviceLimits
from pairgen.tuned import TunedDB, make_key
from pairgen.tuning import backward_tune

INFO = runtime.DeviceInfo(0, "Test GPU", "test-gpu", "sm_90", DeviceLimits())
WIDTHS = {"trimul": {"P": 64, "H": 32, "outgoing": 0, "gate_normalized": 0, "bias": 1}, "contact": {"P": 64, "H": 32}}


@pytest.mark.parametrize("op", sorted(backward_tuning.OPS))
def test_points_cover_the_space_default_first(op):
    space = backward_tuning.declared(op).TUNING_SPACE
    points = backward_tuning.points(op)
    count = 1
    for values in space.values():
        count *= len(values)
    assert points[0] == backward_tuning.declared(op).TUNING_DEFAULT and len(points) == count
    assert len({tuple(sorted(p.items())) for p in points}) == count


@pytest.mark.parametrize("items, ln_tile", [
    pytest.param(items, ln_tile, id=f"{ln_tile}-{items}", marks=[] if i == t else [pytest.mark.slow])
    for t, ln_tile in enumerate(trimul_fused.TUNING_SPACE["ln_tile"])
    for i, items in enumerate(trimul_fused.TUNING_SPACE["items"])])  # fast share: each value once, the default among them
def test_every_trimul_kernel_shape_renders_to_its_signatures_and_compiles(items, ln_tile):
    """The launch parameters that change the source (items, ln_tile): each compiles without spills
    (the others only change grids)."""
    rendered = trimul_fused.render("float32", tuning={**trimul_fused.TUNING_DEFAULT, "items": items, "ln_tile": ln_tile})
    compiled = compiler.compile_source(rendered.source, rendered.kernel_name, "sm_90")
    assert set(compiled.kernels) >= {f"{rendered.kernel_name}_{suffix}" for suffix in trimul_fused.SIGNATURES}
    assert not compiled.spill_bytes
    # the LayerNorm backward keeps four 256-thread blocks per SM at every tile (it once took 157
    # registers at 64 pairs: one block per SM, a quarter of its bandwidth)
    assert compiled.kernels[f"{rendered.kernel_name}_ln_grad"]["registers"] <= 64


def _entry(op: str, params: dict, n_bucket: int, kind: str = "float32") -> dict:
    widths = WIDTHS[op]
    return {"key": make_key(kind, widths, n_bucket), "shape": {"B": 1, "N": n_bucket, **widths},
            "strategy": backward_tuning.STRATEGY, "params": params,
            "template_sha256": backward_tuning.template_sha256(op, kind, widths),
            "source_sha256": backward_tuning.sources_sha256(op, kind, params, widths), "us": 1.0}


@pytest.fixture
def tuned_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(tmp_path))
    backward_tuning._warned.clear()
    return tmp_path


def test_entries_are_found_by_the_forward_kernels_lookup_chain(tuned_dir):
    """Exact N bucket, then the nearest, then a GPU of the same architecture, else the defaults."""
    db = TunedDB(backward_tuning.db_name("trimul"), "test-gpu")
    chosen = {**trimul_fused.TUNING_DEFAULT, "items": 8, "row_blocks": 2}
    db.upsert(_entry("trimul", chosen, 256), arch="sm_90")
    params, entry, source = backward_tuning.lookup("trimul", "float32", WIDTHS["trimul"], 250, INFO)
    assert (params, source) == (chosen, "tuned") and entry["key"]["n_bucket"] == 256
    params, _, source = backward_tuning.lookup("trimul", "float32", WIDTHS["trimul"], 700, INFO)
    assert (params, source) == (chosen, "tuned (nearest N bucket 256)")
    other = backward_tuning.lookup("trimul", "bfloat16", WIDTHS["trimul"], 256, INFO)
    assert other == (trimul_fused.TUNING_DEFAULT, None, "default"), "another dtype: no entry"
    h100 = runtime.DeviceInfo(0, "NVIDIA H100", "nvidia-h100", "sm_90", DeviceLimits())
    params, _, source = backward_tuning.lookup("trimul", "float32", WIDTHS["trimul"], 256, h100)
    assert params == chosen and source == "tuned on test-gpu (same architecture, sm_90)"
    a100 = runtime.DeviceInfo(0, "NVIDIA A100", "nvidia-a100", "sm_80", DeviceLimits())
    assert backward_tuning.lookup("trimul", "float32", WIDTHS["trimul"], 256, a100)[2] == "default"


def test_a_stale_or_invalid_entry_is_skipped_with_a_warning(tuned_dir):
    db = TunedDB(backward_tuning.db_name("contact"), "test-gpu")
    good = _entry("contact", {"row_blocks": 8}, 128)
    stale = _entry("contact", {"row_blocks": 16}, 512)
    stale["source_sha256"] = "0" * 64
    db.upsert(good)
    db.upsert(stale)
    with pytest.warns(UserWarning, match="stale"):
        params, entry, source = backward_tuning.lookup("contact", "float32", WIDTHS["contact"], 512, INFO)
    assert params == {"row_blocks": 8} and source == "tuned (nearest N bucket 128)", "the fresh entry, not the stale one"
    db.upsert({**good, "source_sha256": "0" * 64})
    params, entry, source = backward_tuning.lookup("contact", "float32", WIDTHS["contact"], 512, INFO)
    assert (params, entry, source) == (backward_tuning.declared("contact").TUNING_DEFAULT, None, "default")
    invalid = _entry("contact", {"row_blocks": 8}, 512)
    invalid["params"] = {"row_blocks": 3}
    assert backward_tuning.entry_state("contact", invalid) == "invalid"


def test_an_entry_stays_current_across_template_edits_that_leave_its_sources(monkeypatch):
    """Staleness compares the rendered sources without the header's hash of the template files: an
    edit elsewhere in the tree (code for other calls, behind a condition) leaves the entry current;
    other sources (here another point's) make it stale."""
    from pairgen import codegen

    entry = _entry("trimul", trimul_fused.TUNING_DEFAULT, 256, "bfloat16")
    before = trimul_fused.render("bfloat16").source
    monkeypatch.setattr(codegen, "template_hash", lambda op, strategy: "f" * 64)  # the tree edited
    after = trimul_fused.render("bfloat16").source
    assert before != after and before.partition("\n")[2] == after.partition("\n")[2], "only the header differs"
    assert backward_tuning.entry_state("trimul", entry) == "ok"
    other = {**trimul_fused.TUNING_DEFAULT, "items": next(v for v in trimul_fused.TUNING_SPACE["items"]
                                                          if v != trimul_fused.TUNING_DEFAULT["items"])}
    assert backward_tuning.entry_state("trimul", {**entry, "params": other}) == "stale"
    whole = backward_tuning.sources_sha256("trimul", "bfloat16", trimul_fused.TUNING_DEFAULT, WIDTHS["trimul"],
                                           with_template_hash=True)  # an entry recorded before: still current
    assert whole != entry["source_sha256"] and backward_tuning.entry_state("trimul", {**entry, "source_sha256": whole}) == "ok"


def test_the_module_s_forced_tuning_wins_and_cpu_calls_run_the_defaults():
    from pairgen.ops.contact import CONTACT

    module = CONTACT.make_module(WIDTHS["contact"], torch.Generator().manual_seed(0))
    x = torch.zeros(1, 3, 3, 64)
    assert backward_tuning.for_call(module, x) == backward_tuning.declared("contact").TUNING_DEFAULT
    module._backward_tuning = {"row_blocks": 16}
    assert backward_tuning.for_call(module, x) == {"row_blocks": 16}


def test_the_sweep_keeps_the_fastest_point_that_agrees():
    points = [{"a": 1}, {"a": 2}, {"a": 3}, {"a": 4}]
    times = {1: 10.0, 2: 7.0, 3: 5.0, 4: 6.0}
    grads = {1: [torch.ones(3)], 2: [torch.ones(3)], 3: [torch.ones(3) * 2], 4: [torch.ones(3) + 1e-9]}
    result = backward_tune.sweep(points, lambda p: times[p["a"]], lambda p: grads[p["a"]], bound=1e-6)
    assert result["best"] == ({"a": 4}, 6.0), "3 is fastest but disagrees"
    assert result["disagreed"] == ["a=3"] and result["default_us"] == 10.0 and len(result["timed"]) == 3


def test_status_lists_backward_entries_with_their_state(tuned_dir, capsys):
    from pairgen.tuning.tune_cli import main

    TunedDB(backward_tuning.db_name("contact"), "test-gpu").upsert(_entry("contact", {"row_blocks": 8}, 512))
    assert main(["--status", "--gpu", "test-gpu", "--arch", "sm_90"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "contact_backward" in line]
    assert len(rows) == 1 and backward_tuning.STRATEGY in rows[0] and "ok" in rows[0]


def test_tuning_the_backward_needs_a_gpu(capsys, monkeypatch):
    from pairgen.tuning.tune_cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--backward", "--op", "contact"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_a_sweep_stopped_part_way_resumes_from_its_study(tmp_path):
    """The sweep is an Optuna study in the forward tuner's journal storage: a second run of the same
    study times only the points the first did not reach."""
    from pairgen.tuning.tuner import open_study

    points = [{"a": a, "b": b} for a in (1, 2, 3) for b in (1, 2)]
    timed = []

    def step_us(params, stop_after=None):
        if stop_after is not None and len(timed) == stop_after:
            raise KeyboardInterrupt
        timed.append(dict(params))
        return 10.0 - params["a"] - params["b"]

    def gradients(params):
        return [torch.ones(2)]

    with pytest.raises(KeyboardInterrupt):
        backward_tune.sweep(points, lambda p: step_us(p, stop_after=4), gradients, 1e-6,
                            open_study("resume", 0, tmp_path))
    assert len(timed) == 4
    result = backward_tune.sweep(points, step_us, gradients, 1e-6, open_study("resume", 0, tmp_path))
    assert len(timed) == 6 and len({tuple(sorted(p.items())) for p in timed}) == 6, "each point timed once"
    assert result["best"] == ({"a": 3, "b": 2}, 5.0) and len(result["timed"]) == 6
