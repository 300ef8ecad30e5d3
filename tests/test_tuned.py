"""The tuned database: keys and N buckets, the lookup chain, staleness, atomic concurrent writes,
corrupt and foreign files; and the runtime's choice built on it."""
from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from pairgen import codegen, runtime
from pairgen.ops.base import DeviceLimits, n_bucket
from pairgen.ops.contact import CONTACT
from pairgen.tuned import TunedDB, TunedDBError, make_key

ROOT = Path(__file__).resolve().parent.parent

WIDTHS = {"P": 64, "H": 32}
TPP = {"threads": 128, "chunk": 8, "weights_smem": True, "symmetric": True}


def entry(bucket, strategy="thread_per_pair", params=TPP, sha=None, widths=WIDTHS, us=10.0):
    return {"key": make_key("float32", widths, bucket), "shape": {"B": 1, "N": bucket, **widths},
            "strategy": strategy, "params": dict(params), "us": us,
            "template_sha256": sha or codegen.template_hash("contact", strategy)}


@pytest.fixture
def db(tmp_path):
    return TunedDB("contact", "test-gpu", tmp_path)


def test_n_bucket_is_the_nearest_power_of_two():
    assert [n_bucket(n) for n in (1, 2, 3, 37, 48, 64, 100, 123, 768, 1024)] == [1, 2, 4, 32, 64, 64, 128, 128, 1024, 1024]


def test_lookup_exact_then_nearest_then_default(db):
    assert db.lookup("float32", WIDTHS, 64) == (None, "default")
    db.upsert(entry(64))
    db.upsert(entry(512, params=dict(TPP, threads=256)))
    found, how = db.lookup("float32", WIDTHS, 64)
    assert how == "tuned" and found["params"]["threads"] == 128
    found, how = db.lookup("float32", WIDTHS, 256)  # log-distance 2 to 64, 1 to 512
    assert found["params"]["threads"] == 256 and "nearest" in how
    assert db.lookup("float32", {"P": 128, "H": 128}, 64) == (None, "default")
    assert db.lookup("float16", WIDTHS, 64) == (None, "default")


def test_upsert_replaces_the_same_key(db):
    db.upsert(entry(64, us=10.0))
    db.upsert(entry(64, us=7.0))
    assert [e["us"] for e in db.entries()] == [7.0]


def test_stale_entries_are_not_used(db):
    db.upsert(entry(64, sha="0" * 64))
    assert db.is_stale(db.entries()[0])
    assert db.lookup("float32", WIDTHS, 64) == (None, "default")
    db.upsert(entry(128, strategy="gone_strategy", sha="1" * 64))
    assert db.is_stale([e for e in db.entries() if e["strategy"] == "gone_strategy"][0])


@pytest.mark.parametrize("text", ["{not json", json.dumps([1, 2]),
                                  json.dumps({"schema": 99, "op": "contact", "entries": []}),
                                  json.dumps({"schema": 1, "op": "trimul", "entries": []})])
def test_corrupt_or_foreign_files_are_reported_and_ignored(db, text):
    db.path.parent.mkdir(parents=True, exist_ok=True)
    db.path.write_text(text)
    with pytest.warns(UserWarning, match="ignoring tuned database"):
        assert db.lookup("float32", WIDTHS, 64) == (None, "default")
    assert db.problem
    with pytest.raises(TunedDBError, match="contact.json"):
        db.upsert(entry(64))  # a write never replaces a file it cannot read: that lost every entry in it
    assert db.path.read_text() == text


def test_a_malformed_entry_is_skipped_and_kept(db):
    db.path.parent.mkdir(parents=True, exist_ok=True)
    db.path.write_text(json.dumps({"schema": 1, "op": "contact", "entries": [{"key": 3}]}))
    with pytest.warns(UserWarning, match="skipping malformed entry 0"):
        assert db.lookup("float32", WIDTHS, 64) == (None, "default")
    assert db.problem is None and [i for i, _ in db.skipped()] == [0]
    with pytest.warns(UserWarning, match="skipping malformed entry 0"):
        db.upsert(entry(64))
    assert json.loads(db.path.read_text())["entries"][1] == {"key": 3}


def _writer(args):
    root, bucket = args
    TunedDB("contact", "test-gpu", root).upsert(entry(bucket))


def test_concurrent_writers_lose_nothing(tmp_path):
    buckets = [2 ** k for k in range(12)]
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        pool.map(_writer, [(str(tmp_path), b) for b in buckets])
    db = TunedDB("contact", "test-gpu", tmp_path)
    assert sorted(e["key"]["n_bucket"] for e in db.entries()) == buckets
    assert not list(db.path.parent.glob("*.tmp"))


def test_runtime_choice_follows_the_chain(tmp_path, monkeypatch):
    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(tmp_path))
    info = runtime.DeviceInfo(0, "Test GPU", "test-gpu", "sm_90", DeviceLimits())
    choice = runtime.choose(CONTACT, "float32", WIDTHS, 64, info)
    assert choice.source == "default" and choice.plan.strategy == CONTACT.default_points[0][0]
    TunedDB("contact", "test-gpu", tmp_path).upsert(entry(64))
    choice = runtime.choose(CONTACT, "float32", WIDTHS, 70, info)
    assert choice.source == "tuned" and choice.plan.params == TPP
    choice = runtime.choose(CONTACT, "float32", WIDTHS, 300, info)
    assert choice.source.startswith("tuned (nearest")


def test_an_entry_that_does_not_fit_the_gpu_falls_back_to_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(tmp_path))
    TunedDB("contact", "test-gpu", tmp_path).upsert(entry(64))
    tiny = runtime.DeviceInfo(0, "Tiny GPU", "test-gpu", "sm_90", DeviceLimits(max_smem_per_block=1024))
    with pytest.warns(UserWarning, match="does not fit"):
        choice = runtime.choose(CONTACT, "float32", WIDTHS, 64, tiny)
    assert choice.source != "tuned"


def test_a_stale_entry_is_completed_to_the_current_space_and_tried_first(db):
    """A template edit that adds a parameter makes the old winner stale; the re-tune starts from
    it, the new parameter at its default (run 17: without this, contact N1024 came out 9% worse)."""
    import importlib.util

    old = {"tile_side": 16, "threads": 512, "tn": 4, "unroll": 4, "ln_rows": 4, "weights_smem": True,
           "blocks_per_sm": 1}  # before stage_rows existed
    db.upsert(entry(1024, "symmetric_tiled", old, sha="0" * 64, widths={"P": 128, "H": 64}))
    assert db.lookup("float32", {"P": 128, "H": 64}, 1024) == (None, "default")
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
    assert tune_script.starting_points(CONTACT, db, shape) == [("symmetric_tiled", completed)] + [
        ("symmetric_tiled", {**completed, name: value}) for name, values in (("stage_rows", (1, 2)), ("ln_lanes", (4, 8)))
        for value in values]
