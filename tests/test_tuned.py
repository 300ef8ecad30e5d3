"""The tuned database: keys and N buckets, the lookup chain, staleness, atomic concurrent writes,
corrupt and foreign files; and the runtime's choice built on it."""
from __future__ import annotations

import json
import multiprocessing
import random
from pathlib import Path

import pytest

import tuned_writer
from pairgen import codegen, runtime
from pairgen.spec import DeviceLimits, n_bucket
from pairgen.ops import render
from pairgen.ops.contact import CONTACT
from pairgen.tuned import TunedDB, TunedDBError, make_key

ROOT = Path(__file__).resolve().parent.parent

WIDTHS = {"P": 64, "H": 32}
TPP = {"threads": 128, "chunk": 8, "weights_smem": True, "symmetric": True}


INFO = runtime.DeviceInfo(0, "Test GPU", "test-gpu", "sm_90", DeviceLimits())


def entry(bucket, strategy="thread_per_pair", params=TPP, sha=None, widths=WIDTHS, us=10.0, source=None):
    """An entry as the tuner writes it: hashes of today's template and rendered source, unless given."""
    if strategy not in CONTACT.strategies:  # a strategy gone from today's code
        sha, source = sha or "e" * 64, source or "f" * 64
    if source is None:
        try:
            source = render("contact", strategy, params, widths).source_sha256
        except ValueError:  # a point outside today's space
            source = "f" * 64
    return {"key": make_key("float32", widths, bucket), "shape": {"B": 1, "N": bucket, **widths},
            "strategy": strategy, "params": dict(params), "us": us,
            "template_sha256": sha or codegen.template_hash("contact", strategy), "source_sha256": source}


def choose(n, widths=WIDTHS, dtype="float32", info=INFO):
    return runtime.choose(CONTACT, dtype, widths, n, info)


@pytest.fixture
def db(tmp_path):
    return TunedDB("contact", "test-gpu", tmp_path)


def test_n_bucket_is_the_nearest_power_of_two():
    assert [n_bucket(n) for n in (1, 2, 3, 37, 48, 64, 100, 123, 768, 1024)] == [1, 2, 4, 32, 64, 64, 128, 128, 1024, 1024]


def test_lookup_exact_then_nearest_then_default(db, monkeypatch):
    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(db.path.parent.parent))
    assert choose(64).source == "default"
    db.upsert(entry(64))
    db.upsert(entry(512, params=dict(TPP, threads=256)))
    found = choose(64)
    assert found.source == "tuned" and found.entry["key"]["n_bucket"] == 64 and found.database == str(db.path)
    found = choose(256)  # log-distance 2 to 64, 1 to 512
    assert found.source == "tuned (nearest N bucket 512)" and found.plan.params["threads"] == 256
    assert choose(64, widths={"P": 128, "H": 128}).source == "default"
    # another precision's key, at widths its tensor-core kernel cannot take (H = 36: no 16-byte rows)
    assert choose(64, widths={"P": 64, "H": 36}, dtype="float16").source == \
        "no contact kernel in float16 fits widths {'P': 64, 'H': 36}"


def test_upsert_replaces_the_same_key(db):
    db.upsert(entry(64, us=10.0))
    db.upsert(entry(64, us=7.0))
    assert [e["us"] for e in db.entries()] == [7.0]


def test_stale_entries_are_not_used(db, monkeypatch):
    """Stale: today's code renders another source at the entry's parameters than the one it was tuned with."""
    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(db.path.parent.parent))
    db.upsert(entry(64, source="0" * 64))
    assert runtime.entry_state(CONTACT, db.entries()[0]) == "stale"
    with pytest.warns(UserWarning, match="skipping the stale tuned entry for N bucket 64 in .*contact.json"):
        assert choose(64).source == "default"


def test_a_changed_plan_constant_makes_an_entry_stale(db, monkeypatch):
    """Not only template edits: a value the plan derives (here the packed weights' offsets) that
    changes the rendered kernel makes the entry stale, though its template is unchanged."""
    from pairgen.ops.contact import common as contact_common

    tuned = entry(64)
    assert runtime.entry_state(CONTACT, tuned) == "ok"
    real = contact_common.weight_offsets
    monkeypatch.setattr(contact_common, "weight_offsets", lambda P, H: {**real(P, H), "b3": real(P, H)["b3"] + 4})
    assert tuned["template_sha256"] == codegen.template_hash("contact", "thread_per_pair")
    assert runtime.entry_state(CONTACT, tuned) == "stale"


@pytest.mark.parametrize("strategy, params, why", [
    ("gone_strategy", TPP, "unknown strategy"),
    ("thread_per_pair", dict(TPP, threads=96), "threads=96 not in"),
    ("thread_per_pair", dict(TPP, chunk=16, bogus=1), "params"),
    ("thread_per_pair", dict(TPP, threads=256, chunk=16, weights_smem=True), None),
])
def test_invalid_entries_are_skipped_with_a_warning_naming_the_file(db, monkeypatch, strategy, params, why):
    """Outside today's space, or breaking today's restrictions (a GPU with 1 KB of shared memory
    per block): listed as invalid, skipped with a warning naming the file, never raised."""
    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(db.path.parent.parent))
    db.upsert(entry(64, strategy=strategy, params=params))
    tiny = runtime.DeviceInfo(0, "Tiny GPU", "test-gpu", "sm_90", DeviceLimits(max_smem_per_block=1024))
    info = INFO if why else tiny
    state = runtime.entry_state(CONTACT, db.entries()[0], info.limits)
    assert state.startswith("invalid: ") and (why or "shared memory") in state
    with pytest.warns(UserWarning, match=r"skipping the invalid tuned entry .* in .*contact\.json"):
        choice = choose(64, info=info)
    assert not choice.source.startswith("tuned")


@pytest.mark.parametrize("text", ["{not json", json.dumps([1, 2]),
                                  json.dumps({"schema": 99, "op": "contact", "entries": []}),
                                  json.dumps({"schema": 1, "op": "trimul", "entries": []})])
def test_corrupt_or_foreign_files_are_reported_and_ignored(db, text):
    db.path.parent.mkdir(parents=True, exist_ok=True)
    db.path.write_text(text)
    with pytest.warns(UserWarning, match="ignoring tuned database"):
        assert db.entries() == []
    assert db.problem
    with pytest.raises(TunedDBError, match="contact.json"):
        db.upsert(entry(64))  # a write never replaces a file it cannot read: that lost every entry in it
    assert db.path.read_text() == text


def test_a_malformed_entry_is_skipped_and_kept(db):
    db.path.parent.mkdir(parents=True, exist_ok=True)
    db.path.write_text(json.dumps({"schema": 1, "op": "contact", "entries": [{"key": 3}]}))
    with pytest.warns(UserWarning, match="skipping malformed entry 0"):
        assert db.entries() == []
    assert db.problem is None and [i for i, _ in db.skipped()] == [0]
    with pytest.warns(UserWarning, match="skipping malformed entry 0"):
        db.upsert(entry(64))
    assert json.loads(db.path.read_text())["entries"][1] == {"key": 3}


def test_concurrent_writers_lose_nothing(tmp_path):
    buckets = [2 ** k for k in range(12)]
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        pool.map(tuned_writer.upsert, [(str(tmp_path), entry(b)) for b in buckets])
    db = TunedDB("contact", "test-gpu", tmp_path)
    assert sorted(e["key"]["n_bucket"] for e in db.entries()) == buckets
    assert not list(db.path.parent.glob("*.tmp"))


def test_runtime_choice_follows_the_chain(tmp_path, monkeypatch):
    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(tmp_path))
    choice = choose(64)
    assert choice.source == "default" and choice.plan.strategy == CONTACT.default_points[0][0]
    TunedDB("contact", "test-gpu", tmp_path).upsert(entry(64))
    choice = choose(70)
    assert choice.source == "tuned" and choice.plan.params == TPP
    assert choose(300).source.startswith("tuned (nearest")


def test_same_architecture_entries_come_before_the_defaults(tmp_path, monkeypatch):
    """A GPU without a folder of its own (an H100, an H200 NVL) uses entries tuned on a GPU of the
    same compute capability, and says so; a GPU of another capability does not."""
    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(tmp_path))
    TunedDB("contact", "test-gpu", tmp_path).upsert(entry(64), arch="sm_90")
    h100 = runtime.DeviceInfo(0, "NVIDIA H100", "nvidia-h100", "sm_90", DeviceLimits())
    choice = choose(64, info=h100)
    assert choice.plan.params == TPP and choice.source == "tuned on test-gpu (same architecture, sm_90)"
    a100 = runtime.DeviceInfo(0, "NVIDIA A100", "nvidia-a100", "sm_80", DeviceLimits())
    assert choose(64, info=a100).source == "default"
    explained = runtime.explain(CONTACT, "float32", WIDTHS, 70, info=h100)
    assert explained.strategy == "thread_per_pair" and explained.measured_us == 10.0
    assert "same architecture" in str(explained) and "contact.json" in str(explained)


def test_explain_says_default_where_nothing_is_tuned(tmp_path, monkeypatch):
    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(tmp_path))
    explained = runtime.explain(CONTACT, "float32", WIDTHS, 37, info=INFO)
    assert explained.source == "default" and explained.n_bucket == 32 and explained.measured_us is None
    assert explained.params == CONTACT.default_points[0][1]


def test_a_stale_entry_is_completed_to_the_current_space_and_tried_first(db, monkeypatch):
    """A template edit that adds a parameter makes the old winner stale; the re-tune starts from
    it, the new parameter at its default (without it, a re-tune of contact N1024 came out 9% worse)."""
    import importlib.util

    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(db.path.parent.parent))  # no same-architecture entries from tuned/
    old = {"tile_side": 16, "threads": 512, "tn": 4, "unroll": 4, "ln_rows": 4, "weights_smem": True,
           "blocks_per_sm": 1}  # before stage_rows existed
    db.upsert(entry(1024, "symmetric_tiled", old, sha="0" * 64, widths={"P": 128, "H": 64}, source="0" * 64))
    assert runtime.entry_state(CONTACT, db.entries()[0]) == "stale"
    assert db.previous("float32", {"P": 128, "H": 64}, 1024)["params"] == old
    completed = CONTACT.complete_point("symmetric_tiled", old)
    assert completed == {**old, "stage_rows": 0, "ln_lanes": 0}
    CONTACT.check_point("symmetric_tiled", completed)
    assert CONTACT.complete_point("symmetric_tiled", {**old, "threads": 96}) is None  # a value gone from the space
    assert CONTACT.complete_point("no_such_strategy", old) is None

    spec = importlib.util.spec_from_file_location("tune_script", ROOT / "scripts" / "tune.py")
    tune_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune_script)
    shape = {"B": 1, "N": 1024, "P": 128, "H": 64}
    assert tune_script.starting_points(CONTACT, db, shape, INFO) == [("symmetric_tiled", completed)] + [
        ("symmetric_tiled", {**completed, name: value}) for name, values in (("stage_rows", (1, 2)), ("ln_lanes", (4, 8)))
        for value in values]


def test_a_16_bit_tune_starts_from_the_other_16_bit_dtypes_winner(tmp_path, monkeypatch):
    """bf16 and fp16 run the same code: each one's search starts from the other's winner at the
    shape (as tf32x3's starts from exact fp32's); exact fp32 starts from nothing but its own."""
    from pairgen.ops.readout import READOUT
    from pairgen.tuning.tune_cli import starting_points

    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(tmp_path))
    widths = {"D": 256, "P": 64, "H": 512}
    shape = {"B": 16, "N": 128, **widths}
    plan = READOUT.sample_plans("mma", widths, 0, random.Random(0), precision="bfloat16")[0]  # a default point that fits
    point = plan.params
    db = TunedDB("readout", "test-gpu", tmp_path)
    db.upsert({"key": make_key("bfloat16", widths, 128), "shape": shape, "strategy": "mma", "params": dict(point),
               "us": 500.0, "template_sha256": codegen.template_hash("readout", "mma"),
               "source_sha256": codegen.render_plan(plan).source_sha256})
    assert runtime.entry_state(READOUT, db.entries()[0]) == "ok"
    assert ("mma", point) in starting_points(READOUT.at("float16"), db, shape, INFO)
    assert starting_points(READOUT.at("float32"), db, shape, INFO) == []


def test_an_entry_whose_closed_form_was_faster_runs_without_its_kernel(db, monkeypatch):
    """A 16-bit entry's tuner also timed the closed form where a module runs it without a kernel:
    the kernel must beat that, not only the reference (which the closed form beats at these sizes)."""
    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(db.path.parent.parent))
    db.upsert(dict(entry(1024, us=350.0), baselines_us={"eager": 900.0, "closed_form": 300.0}))
    choice = choose(1024)
    assert choice.plan is None and choice.expected_reference
    assert "the closed form measured faster when it was tuned (300.0 µs against the best kernel's 350.0 µs)" \
        in choice.source
    # slower than the reference but faster than the closed form, which is what runs without it: the kernel
    db.upsert(dict(entry(1024, us=350.0), baselines_us={"eager": 200.0, "closed_form": 400.0}))
    assert choose(1024).plan is not None


def test_an_entry_whose_reference_was_faster_runs_the_reference(db, monkeypatch):
    """The tuner times the eager reference in the same run as the kernels: where it was faster than
    the best kernel, the module runs the reference (exact bucket and nearest bucket alike), and
    explain says why; an entry without that baseline, or slower than its kernel, runs the kernel."""
    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(db.path.parent.parent))
    slower = dict(entry(1024, us=350.0), baselines_us={"eager": 70.0, "compile": 500.0})
    db.upsert(slower)
    db.upsert(dict(entry(64, us=10.0), baselines_us={"eager": 69.0}))
    for n in (1024, 700):
        choice = choose(n)
        assert choice.plan is None and choice.expected_reference and choice.entry["key"]["n_bucket"] == 1024
        assert "the PyTorch reference measured faster when it was tuned (70.0 µs against the best kernel's 350.0 µs)" \
            in choice.source
    assert choose(64).plan is not None and choose(64).source == "tuned"
    explained = runtime.explain(CONTACT, "float32", WIDTHS, 1024, info=INFO)
    assert explained.strategy is None and "reference measured faster" in explained.source
    assert "the PyTorch reference" in str(explained)
    db.upsert(dict(slower, baselines_us={"compile": 500.0}))  # no eager baseline: nothing says the reference is faster
    assert choose(1024).plan is not None


def test_an_entry_whose_code_renders_unchanged_under_another_template_hash_stays_ok():
    """The header's first line names the template tree's hash, a comment: an entry tuned before an
    edit that left its variant's code alone (code for other variants behind a jinja condition) is
    still the kernel it was measured with; any other change to the source makes it stale."""
    from pairgen.codegen import source_hash

    tuned = entry(64)
    rendered = codegen.render_plan(CONTACT.plan(tuned["strategy"], tuned["params"], WIDTHS))
    older_tree = "a" * 64
    first, rest = rendered.source.split("\n", 1)
    then = first.replace(rendered.template_sha256[:16], older_tree[:16]) + "\n" + rest
    assert then != rendered.source
    assert runtime.entry_state(CONTACT, dict(tuned, template_sha256=older_tree, source_sha256=source_hash(then))) == "ok"
    changed = then.replace("__global__", "__global__ ", 1)  # one byte of code
    assert runtime.entry_state(CONTACT, dict(tuned, template_sha256=older_tree, source_sha256=source_hash(changed))) == "stale"
    # the header must name the tree the entry records: the same source under a third hash is not it
    assert runtime.entry_state(CONTACT, dict(tuned, template_sha256="b" * 64, source_sha256=source_hash(then))) == "stale"


def test_an_entry_written_before_a_parameter_was_added_stays_ok():
    """A parameter added since an entry was written takes the value that reproduces the old kernel
    (added_params); today's header lists it, the entry's recorded source did not: still the same
    kernel. The added parameter at its other value renders other code: stale."""
    from pairgen.codegen import source_hash
    from pairgen.spec import DeviceLimits

    widths = {"P": 128, "H": 64}
    old_point = {"groups": 1, "prefetch": False, "swizzle": True}  # before ln_quads existed
    plan = CONTACT.plan("wgmma", old_point, widths, "bfloat16")
    assert plan.params["ln_quads"] is False and not CONTACT.infeasible(plan, DeviceLimits(arch="sm_90"))
    first, rest = codegen.render_plan(plan).source.split("\n", 1)
    params_line, after = rest.split("\n", 1)
    assert '"ln_quads": false' in params_line
    as_written = first + "\n// params " + json.dumps(old_point, sort_keys=True) + "\n" + after
    tuned = {"strategy": "wgmma", "params": old_point, "key": {"dtype": "bfloat16", "n_bucket": 1024, "widths": widths},
             "template_sha256": codegen.template_hash("contact", "wgmma"), "source_sha256": source_hash(as_written)}
    assert runtime.entry_state(CONTACT, tuned) == "ok"
    quads = codegen.render_plan(CONTACT.plan("wgmma", {**old_point, "ln_quads": True}, widths, "bfloat16")).source
    assert runtime.entry_state(CONTACT, dict(tuned, source_sha256=source_hash(quads))) == "stale"


def test_an_entry_whose_kernels_were_named_before_a_parameter_was_added_stays_ok():
    """Kernel names carry every parameter of a point, so the kernels of an entry written before a
    parameter was added were named without it: the same code under other symbols, still ok (the
    tuned store's wgmma entries of the triangle update, written before paired_columns). Another
    name is not accepted for it."""
    from pairgen.codegen import source_hash
    from pairgen.ops.trimul import TRIMUL
    from pairgen.spec import kernel_name

    widths = {"P": 128, "H": 128, "outgoing": 1, "gate_normalized": 1, "bias": 0}
    old_point = {"p_groups": 4, "p_stages": 1, "p_wn": 64, "o_groups": 3, "o_wn": 64, "o_stages": 1, "swizzle": True,
                 "consts_smem": True}  # before paired_columns existed
    rendered = codegen.render_plan(TRIMUL.plan("wgmma", old_point, widths, "bfloat16"))
    old_name = kernel_name("trimul", "wgmma", "bfloat16", old_point)
    assert "paired_columns0" in rendered.kernel_name and old_name != rendered.kernel_name
    first, rest = rendered.source.replace(rendered.kernel_name, old_name).split("\n", 1)
    as_written = first + "\n// params " + json.dumps(old_point, sort_keys=True) + "\n" + rest.split("\n", 1)[1]
    tuned = {"strategy": "wgmma", "params": old_point, "key": {"dtype": "bfloat16", "n_bucket": 512, "widths": widths},
             "template_sha256": codegen.template_hash("trimul", "wgmma"), "source_sha256": source_hash(as_written)}
    assert runtime.entry_state(TRIMUL, tuned) == "ok"
    renamed = as_written.replace(old_name, old_name + "x")
    assert runtime.entry_state(TRIMUL, dict(tuned, source_sha256=source_hash(renamed))) == "stale"


def test_kernels_are_named_after_their_variant_and_entries_from_before_stay_ok():
    """Two points of one strategy name their kernels apart (a profile says which variant ran); an
    entry recorded when every variant's kernels had the strategy's name is the same code under
    other symbols: still ok. Other code under the old name is stale."""
    from pairgen.codegen import source_hash
    from pairgen.spec import kernel_base_name

    tuned = entry(64)
    plan = CONTACT.plan(tuned["strategy"], tuned["params"], WIDTHS)
    other = CONTACT.plan(tuned["strategy"], {**tuned["params"], "threads": 256 if tuned["params"]["threads"] != 256 else 128},
                         WIDTHS)
    assert plan.main.name != other.main.name
    rendered = codegen.render_plan(plan)
    assert rendered.kernel_name == plan.main.name and f"{plan.main.name}(" in rendered.source
    assert all(f"{name}{int(value)}" in plan.main.name for name, value in plan.params.items())
    before = rendered.source.replace(plan.main.name, kernel_base_name("contact", plan.strategy))
    assert runtime.entry_state(CONTACT, dict(tuned, source_sha256=source_hash(before))) == "ok"
    assert runtime.entry_state(CONTACT, dict(tuned, source_sha256=rendered.source_sha256)) == "ok"
    changed = before.replace("__global__", "__global__ ", 1)
    assert runtime.entry_state(CONTACT, dict(tuned, source_sha256=source_hash(changed))) == "stale"


def test_every_shipped_entry_is_current():
    """The committed tuned/ entries plan, fit the sm_90 limits and render the source they were tuned
    with (a template edit that changes a tuned variant's code must come with its re-tune)."""
    from pairgen.ops import get_op

    states = {}
    for path in sorted((ROOT / "tuned").glob("*/*.json")):
        data = json.loads(path.read_text())
        op = data["op"]
        if op.endswith("_backward"):
            continue  # the training path's entries (their own state: pairgen/backward_tuning.py)
        for e in data["entries"]:
            states[(path.parent.name, op, json.dumps(e["key"], sort_keys=True))] = runtime.entry_state(get_op(op), e)
    assert states and all(state == "ok" for state in states.values()), \
        {k: v for k, v in states.items() if v != "ok"}
