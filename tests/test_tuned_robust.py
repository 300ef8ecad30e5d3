"""The tuned database never loses an entry: malformed entries are skipped and kept, files it cannot
use are never overwritten, any JSON is a warning at worst; every field is type-checked; writes keep
the file's mode (or follow the umask); the header's arch finds same-architecture databases."""
from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from pairgen import tuned
from pairgen.tuned import SCHEMA_VERSION, TunedDB, TunedDBError, databases_for_arch, entry_problem, make_key

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "tuned" / "nvidia-h200"
WIDTHS = {"P": 64, "H": 32}
SHA = "ab" * 32


def entry(bucket=64, **fields):
    base = {"key": make_key("float32", WIDTHS, bucket), "shape": {"B": 1, "N": bucket, **WIDTHS},
            "strategy": "thread_per_pair", "params": {"threads": 128, "weights_smem": True, "mode": "x"},
            "template_sha256": SHA, "us": 10.0}
    return {**base, **fields}


def write(db: TunedDB, data) -> str:
    """Write `data` (JSON-encoded unless a str or bytes) as the database file; return its bytes as text."""
    db.path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        db.path.write_bytes(data)
    else:
        db.path.write_text(data if isinstance(data, str) else json.dumps(data))
    return db.path.read_bytes().decode("latin-1")


def stored(db: TunedDB) -> dict:
    return json.loads(db.path.read_text())


@pytest.fixture
def db(tmp_path):
    return TunedDB("contact", "test-gpu", tmp_path)


# ---- 1. a malformed entry is skipped with a warning and kept -------------------------------------

def test_a_malformed_entry_in_a_real_file_is_skipped_and_kept_when_another_is_written(db):
    """The reported loss: one bad entry among five made the whole file ignored, and the next upsert
    wrote a file holding only the new entry (5 entries became 1)."""
    data = json.loads((COMMITTED / "contact.json").read_text())
    bad = {**data["entries"][1], "params": {**data["entries"][1]["params"], "threads": 64.0}}
    data["entries"].insert(2, bad)
    write(db, data)
    with pytest.warns(UserWarning, match=r"skipping malformed entry 2 of tuned database .*contact\.json: params: 'threads'"):
        assert len(db.entries()) == len(data["entries"]) - 1  # all but the bad one
    assert db.problem is None
    assert [index for index, _ in db.skipped()] == [2] and "64.0" in db.skipped()[0][1]

    new = {**data["entries"][0], "key": make_key("float32", {"P": 32, "H": 32}, 32)}
    with pytest.warns(UserWarning, match="skipping malformed entry 2"):
        db.upsert(new)
    after = stored(db)["entries"]
    assert len(after) == len(data["entries"]) + 1 and bad in after and new in after
    for old in data["entries"]:
        assert old in after
    assert not list(db.path.parent.glob("*.tmp")) and not list(db.path.parent.glob("*corrupt*"))


def test_an_entry_with_the_same_key_as_a_malformed_one_is_added_beside_it(db):
    bad = {**entry(64), "us": "fast"}
    write(db, {"schema": 1, "op": "contact", "entries": [bad]})
    with pytest.warns(UserWarning, match="skipping malformed entry 0"):
        db.upsert(entry(64))
    assert stored(db)["entries"] == [entry(64), bad]  # the valid ones sorted, then the malformed, unchanged


def _unusable_files():
    deep = "[" * 100_000 + "]" * 100_000
    return {
        "not json": ("{not json", "not valid JSON"),
        "truncated": (json.dumps({"schema": 1, "op": "contact", "entries": [entry()]})[:-20], "not valid JSON"),
        "empty": ("", "not valid JSON"),
        "bad utf-8": (b'{"schema": 1, "op": "contact", "entries": ["\xff\xfe"]}', "not valid JSON"),
        "nested 100,000 deep": (deep, "nested too deeply"),
        "deep inside an entry": ('{"schema": 1, "op": "contact", "entries": [' + deep + "]}", "nested too deeply"),
        "an int of 5000 digits": ('{"schema": 1, "op": "contact", "entries": [' + "1" * 5000 + "]}", "not valid JSON"),
        "a list": (json.dumps([1, 2]), "not a JSON object"),
        "no schema": (json.dumps({"op": "contact", "entries": []}), "no schema"),
        "schema as a string": (json.dumps({"schema": "1", "op": "contact", "entries": []}), "no schema"),
        "newer schema": (json.dumps({"schema": SCHEMA_VERSION + 1, "op": "contact", "entries": [entry()]}),
                         "newer than this pairgen"),
        "older schema": (json.dumps({"schema": 0, "op": "contact", "entries": []}), "schema 0"),
        "another op": (json.dumps({"schema": 1, "op": "trimul", "entries": [entry()]}), "for op 'trimul'"),
        "entries not a list": (json.dumps({"schema": 1, "op": "contact", "entries": {"a": 1}}), "no entries list"),
        "arch not a string": (json.dumps({"schema": 1, "op": "contact", "arch": 90, "entries": []}), "header arch"),
    }


@pytest.mark.parametrize("name", list(_unusable_files()))
def test_a_file_that_cannot_be_used_is_a_warning_and_never_overwritten(db, name):
    text, why = _unusable_files()[name]
    before = write(db, text)
    with pytest.warns(UserWarning, match="ignoring tuned database"):
        assert db.entries() == []
    assert why in db.problem and str(db.path) in db.problem
    with pytest.warns(UserWarning):
        assert db.entries() == []
        assert db.previous("float32", WIDTHS, 64) is None
        assert db.arch() is None
    with pytest.raises(TunedDBError, match=why) as raised:
        db.upsert(entry())
    assert isinstance(raised.value, RuntimeError) and str(db.path) in str(raised.value)
    assert db.path.read_bytes().decode("latin-1") == before
    assert sorted(p.name for p in db.path.parent.iterdir()) == ["contact.json", "contact.json.lock"]


def test_a_file_the_process_cannot_read_is_never_overwritten(db, monkeypatch):
    before = write(db, {"schema": 1, "op": "contact", "entries": [entry(64), entry(128)]})
    real_read = Path.read_bytes

    def denied(path):  # tests run as root here, where chmod 000 would not stop the read
        if path == db.path:
            raise PermissionError(13, "Permission denied", str(path))
        return real_read(path)

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.warns(UserWarning, match="cannot be read .Permission denied"):
        assert db.entries() == []
    with pytest.raises(TunedDBError, match=r"contact\.json: cannot be read"):
        db.upsert(entry(256))
    monkeypatch.undo()
    assert db.path.read_text() == before and len(db.entries()) == 2


def test_a_failed_write_leaves_the_file_and_no_temp_file(db, monkeypatch):
    db.upsert(entry(64))
    before = db.path.read_text()

    def broken_dump(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tuned.json, "dump", broken_dump)
    with pytest.raises(OSError, match="No space"):
        db.upsert(entry(128))
    assert db.path.read_text() == before
    assert not list(db.path.parent.glob("*.tmp"))


# ---- 2. file modes --------------------------------------------------------------------------------

@pytest.fixture
def umask():
    """Set the process umask for one test, and put it back."""
    saved = os.umask(0o022)
    os.umask(saved)
    yield lambda mask: os.umask(mask)
    os.umask(saved)


@pytest.mark.parametrize("mask, mode", [(0o002, 0o664), (0o022, 0o644), (0o077, 0o600)])
def test_a_new_file_follows_the_umask(db, umask, mask, mode):
    umask(mask)
    db.upsert(entry(64))
    assert stat.S_IMODE(db.path.stat().st_mode) == mode


def test_an_existing_file_keeps_its_mode(db, umask):
    umask(0o002)
    db.upsert(entry(64))
    db.path.chmod(0o640)
    umask(0o077)  # another user's tuner with a strict umask must not lock the group out
    db.upsert(entry(128))
    assert stat.S_IMODE(db.path.stat().st_mode) == 0o640
    assert len(db.entries()) == 2


def test_a_read_only_lock_file_still_locks(db):
    db.upsert(entry(64))
    db.path.with_suffix(".json.lock").chmod(0o444)  # created by another user
    db.upsert(entry(128))
    assert len(db.entries()) == 2


# ---- 3. every field is type-checked ---------------------------------------------------------------

def _with(path: str, value):
    """entry() with the field at a dotted path set to value (the sentinel _DROP removes it)."""
    result = json.loads(json.dumps(entry()))
    *parents, last = path.split(".")
    target = result
    for name in parents:
        target = target[name]
    if value is _DROP:
        del target[last]
    else:
        target[last] = value
    return result


class _Drop:
    """The field left out (a stable repr: test ids must not depend on addresses)."""

    def __repr__(self):
        return "<dropped>"


_DROP = _Drop()

MALFORMED = [
    ("key.n_bucket", "64"), ("key.n_bucket", 64.0), ("key.n_bucket", True), ("key.n_bucket", 0),
    ("key.n_bucket", -4), ("key.n_bucket", 48), ("key.n_bucket", None), ("key.n_bucket", _DROP),
    ("key.widths.P", "64"), ("key.widths.P", 64.0), ("key.widths.P", True), ("key.widths", [64, 32]),
    ("key.dtype", 32), ("key.dtype", ""), ("key.extra", 1), ("key", "float32/64"),
    ("params.threads", 64.0), ("params.threads", [64]), ("params.threads", {"a": 1}), ("params.threads", None),
    ("params", [128]), ("params", _DROP),
    ("strategy", None), ("strategy", 3), ("strategy", _DROP),
    ("template_sha256", "abc"), ("template_sha256", SHA.upper()), ("template_sha256", 123),
    ("template_sha256", _DROP),
    ("source_sha256", "z" * 64), ("source_sha256", None), ("precision", 3), ("precision", ""),
    ("shape.N", "64"), ("shape.N", 64.5), ("us", "10"), ("us", True), ("us", float("nan")),
    ("baselines_us", {"eager": "151"}), ("trials", {"evaluated": 6.5}), ("date", 20261129),
    ("versions", {"torch": 2.11}), ("compile_s_mean", "1"), ("tune_seconds", None),
]


@pytest.mark.parametrize("path, value", MALFORMED, ids=[f"{p}={v!r}" for p, v in MALFORMED])
def test_a_wrongly_typed_field_makes_the_entry_malformed_skipped_and_kept(db, path, value):
    bad = _with(path, value)
    assert entry_problem(bad) is not None
    with pytest.raises(ValueError, match="not a valid tuned entry"):
        db.upsert(bad)
    write(db, {"schema": 1, "op": "contact", "entries": [bad]})
    with pytest.warns(UserWarning, match=r"skipping malformed entry 0 of tuned database .*contact\.json"):
        assert db.entries() == []
    with pytest.warns(UserWarning, match="skipping malformed entry 0"):
        db.upsert(entry(128))
    kept = json.loads(db.path.read_text(), parse_constant=lambda name: name)["entries"]
    assert len(kept) == 2 and kept[0] == entry(128)


def test_a_non_object_entry_is_malformed(db):
    write(db, {"schema": 1, "op": "contact", "entries": [3, None, "x", entry(64)]})
    with pytest.warns(UserWarning, match="skipping malformed entry"):
        assert len(db.entries()) == 1
    assert [index for index, _ in db.skipped()] == [0, 1, 2]


def test_valid_optional_fields_and_unknown_fields_are_accepted(db):
    good = entry(64, source_sha256="cd" * 32, precision="tf32", compile_s_mean=None, added_later={"x": [1.5]})
    assert entry_problem(good) is None
    db.upsert(good)
    assert db.entries() == [good] and db.skipped() == []


def test_make_key_wants_ints():
    assert make_key("float32", {"P": 64, "H": 32}, 64) == {"dtype": "float32", "widths": {"H": 32, "P": 64},
                                                           "n_bucket": 64}
    for widths, bucket in (({"P": 64.0}, 64), ({"P": True}, 64), ({"P": "64"}, 64), ({"P": 64}, 64.0),
                           ({"P": 64}, "64"), ({"P": 64}, 0)):
        with pytest.raises(TypeError):
            make_key("float32", widths, bucket)


def test_the_committed_databases_are_valid():
    for path in sorted(COMMITTED.glob("*.json")):
        db = TunedDB(path.stem, "nvidia-h200", COMMITTED.parent)
        assert db.entries() and db.skipped() == [] and db.problem is None, path


# ---- 5. the header's arch -------------------------------------------------------------------------

def test_upsert_writes_the_arch_once_and_keeps_it(db):
    db.upsert(entry(64), arch="sm_90")
    assert stored(db)["arch"] == "sm_90" and db.arch() == "sm_90"
    db.upsert(entry(128))  # no arch given: the header keeps its own
    assert stored(db)["arch"] == "sm_90"
    with pytest.warns(UserWarning, match="keeps arch 'sm_90'"):
        db.upsert(entry(256), arch="sm_80")
    assert stored(db)["arch"] == "sm_90" and len(db.entries()) == 3
    with pytest.raises(ValueError):
        db.upsert(entry(512), arch=90)


def test_a_file_without_arch_gets_it_on_the_next_write(db):
    write(db, {"schema": 1, "op": "contact", "gpu": "test-gpu", "entries": [entry(64)]})
    assert db.arch() is None
    db.upsert(entry(128), arch="sm_90")
    assert db.arch() == "sm_90" and len(db.entries()) == 2


def test_databases_for_arch_finds_other_folders_of_the_same_arch(tmp_path):
    def make(slug, arch, op="contact"):
        TunedDB(op, slug, tmp_path).upsert(entry(64), **({"arch": arch} if arch else {}))

    make("nvidia-h200", "sm_90")
    make("nvidia-gh200", "sm_90")
    make("nvidia-a100", "sm_80")
    make("no-arch", None)
    make("other-op", "sm_90", op="trimul")
    make("mine", "sm_90")
    write(TunedDB("contact", "broken", tmp_path), "{not json")
    with pytest.warns(UserWarning, match="broken"):
        found = databases_for_arch("contact", "sm_90", "mine", tmp_path)
    assert [(d.gpu_slug, d.op) for d in found] == [("nvidia-gh200", "contact"), ("nvidia-h200", "contact")]
    assert [d.gpu_slug for d in databases_for_arch("contact", "sm_80", None, tmp_path)] == ["nvidia-a100"]
    assert databases_for_arch("contact", "sm_90", "mine", tmp_path / "missing") == []


def test_the_committed_databases_say_sm_90_and_keep_their_formatting(tmp_path):
    for path in sorted(COMMITTED.glob("*.json")):
        text = path.read_text()
        data = json.loads(text)
        assert data["arch"] == "sm_90", path
        assert text == json.dumps(data, indent=1, sort_keys=True) + "\n", path
    shutil.copytree(COMMITTED, tmp_path / "nvidia-h200")
    found = databases_for_arch("contact", "sm_90", "nvidia-h100", tmp_path)
    committed = len(json.loads((COMMITTED / "contact.json").read_text())["entries"])
    assert [d.gpu_slug for d in found] == ["nvidia-h200"] and len(found[0].entries()) == committed > 0
