"""The tuned database: tuned/<gpu-slug>/<op>.json.

Schema (version 1):
  {"schema": 1, "op": "contact", "gpu": "<slug>", "arch": "sm_90", "entries": [entry, ...]}
  "arch" (optional) is the compute capability of the GPU the entries were tuned on; a GPU without a
  folder of its own can use another folder's entries of the same arch (databases_for_arch).
  entry = {"key": {"dtype", "widths", "n_bucket"}, "shape", "strategy", "params", "template_sha256",
           "source_sha256" (optional), "precision" (optional), "us", "baselines_us", "trials", "date",
           "versions", "timed" (optional: the other points the tune timed, fastest first, each as
           {"us", "changes": the params that differ from the entry's, "strategy" where it differs}), ...}
This module stores and validates entries; which entry a call runs (the lookup chain, and whether an
entry is stale or invalid against today's code) is runtime's: runtime.choose and runtime.entry_state.

The database never loses an entry:
  * A malformed entry (entry_problem says why) is skipped with a warning when reading, and written
    back unchanged by upsert: a person fixes or removes it, the code never does.
  * A file that cannot be used as a whole (unreadable, not JSON, a newer schema, another op) reads as
    no entries with a warning, and upsert refuses to touch it (TunedDBError).
Writes hold a lock file and replace the file atomically, so two tuners can share it; the new file
keeps the old one's mode (or follows the umask), so a shared tuned/ folder stays writable by the group.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
import warnings
from pathlib import Path
from typing import NamedTuple

from . import config, files

SCHEMA_VERSION = 1

_HEX64 = re.compile(r"[0-9a-f]{64}")  # a sha256 hexdigest, as hashlib writes it
_KEY_FIELDS = {"dtype", "widths", "n_bucket"}


class TunedDBError(RuntimeError):
    """A tuned database file that upsert must not overwrite: the message names the file and why."""


class TunedDBWarning(UserWarning):
    """A tuned database file, or an entry in it, that is being ignored (the message says why)."""


def make_key(dtype: str, widths: dict, n_bucket: int) -> dict:
    """The lookup key of a (dtype, widths, N bucket). Ints must be ints: a float or a bool here would
    end up in the file and in the rendered kernel (`constexpr int P = 64.0;`)."""
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a str, not {_show(dtype)}")
    for name, value in widths.items():
        if not _is_int(value):
            raise TypeError(f"width {name!r} must be an int, not {_show(value)}")
    if not _is_int(n_bucket) or n_bucket < 1:
        raise TypeError(f"n_bucket must be an int >= 1, not {_show(n_bucket)}")
    return {"dtype": dtype, "widths": {k: int(v) for k, v in sorted(widths.items())}, "n_bucket": int(n_bucket)}


# ---- what a valid entry is ---------------------------------------------------------------------
# Each check takes a value and returns why it is wrong, or None. Fields not listed are kept and not
# checked, so a newer pairgen can add informational fields without older ones skipping its entries.

def _is_int(value) -> bool:
    # bool is a subclass of int in Python, but True is not a thread count.
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value, limit: int = 60) -> str:
    """A value for a message, short even when the value is huge."""
    text = repr(value)
    return f"{text[:limit]}... ({type(value).__name__})" if len(text) > limit else f"{text} ({type(value).__name__})"


def _check_str(value) -> str | None:
    return None if isinstance(value, str) and value else f"{_show(value)} is not a non-empty string"


def _check_sha256(value) -> str | None:
    return None if isinstance(value, str) and _HEX64.fullmatch(value) else \
        f"{_show(value)} is not a sha256 (64 lowercase hex digits)"


def _check_n_bucket(value) -> str | None:
    if _is_int(value) and value >= 1 and value & (value - 1) == 0:
        return None
    return f"{_show(value)} is not a power of two >= 1 (an int)"


def _check_number(value) -> str | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return None
    return f"{_show(value)} is not a finite number"


def _check_optional_number(value) -> str | None:
    return None if value is None else _check_number(value)


def _mapping_check(describe: str, value_ok):
    """A check for an object whose keys are strings and whose values pass value_ok."""
    def check(value) -> str | None:
        if not isinstance(value, dict):
            return f"{_show(value)} is not an object"
        for name, item in value.items():
            if not isinstance(name, str):
                return f"key {_show(name)} is not a string"
            if not value_ok(item):
                return f"{name!r} is {_show(item)}, not {describe}"
        return None
    return check


_check_ints = _mapping_check("an int", _is_int)
_check_numbers = _mapping_check("a finite number", lambda v: _check_number(v) is None)
# Params are rendered into the CUDA source: only values a template can print as a literal.
_check_params = _mapping_check("an int, bool or str", lambda v: isinstance(v, (int, str)))  # bool is an int
_check_versions = _mapping_check("a str or null", lambda v: v is None or isinstance(v, str))


def _check_timed(value) -> str | None:
    """The other points a tune timed (tuner.timed_points): a list of {"us", "changes", "strategy"
    (optional)}."""
    if not isinstance(value, list):
        return f"{_show(value)} is not a list"
    for index, record in enumerate(value):
        if not isinstance(record, dict) or set(record) - {"us", "changes", "strategy"} or "us" not in record:
            return f"[{index}] is {_show(record)}, not an object of us, changes and (optionally) strategy"
        why = _check_number(record["us"]) or _check_params(record.get("changes", {})) or (
            _check_str(record["strategy"]) if "strategy" in record else None)
        if why is not None:
            return f"[{index}]: {why}"
    return None


_KEY_CHECKS = {"dtype": _check_str, "widths": _check_ints, "n_bucket": _check_n_bucket}
_REQUIRED_CHECKS = {"strategy": _check_str, "params": _check_params, "template_sha256": _check_sha256}
_OPTIONAL_CHECKS = {
    "source_sha256": _check_sha256,  # sha256 of the variant's rendered CUDA source
    "precision": _check_str,
    "shape": _check_ints,
    "us": _check_number,
    "baselines_us": _check_numbers,
    "trials": _check_ints,
    "compile_s_mean": _check_optional_number,
    "tune_seconds": _check_number,
    "date": _check_str,
    "versions": _check_versions,
    "timed": _check_timed,
}


def entry_problem(entry) -> str | None:
    """Why `entry` is not a usable tuned entry, or None when it is."""
    if not isinstance(entry, dict):
        return f"the entry {_show(entry)} is not an object"
    key = entry.get("key")
    if not isinstance(key, dict):
        return f"key: {_show(key)} is not an object"
    if set(key) != _KEY_FIELDS:
        return f"key: has fields {sorted(map(str, key))}, not {sorted(_KEY_FIELDS)}"
    for name, check in _KEY_CHECKS.items():
        if (why := check(key[name])) is not None:
            return f"key.{name}: {why}"
    for name, check in _REQUIRED_CHECKS.items():
        if name not in entry:
            return f"{name}: missing"
        if (why := check(entry[name])) is not None:
            return f"{name}: {why}"
    for name, check in _OPTIONAL_CHECKS.items():
        if name in entry and (why := check(entry[name])) is not None:
            return f"{name}: {why}"
    return None


def _sort_key(entry: dict):
    key = entry["key"]
    return key["dtype"], sorted(key["widths"].items()), key["n_bucket"]


# ---- the database --------------------------------------------------------------------------------

class _Snapshot(NamedTuple):
    """One read of the file."""
    data: dict  # the file as stored: the header and every entry, malformed ones included
    valid: list[dict]  # the entries that passed entry_problem
    skipped: list[tuple[int, str]]  # (index in data["entries"], why) of the others


class TunedDB:
    def __init__(self, op: str, gpu_slug: str, root: Path | None = None):
        self.op = op
        self.gpu_slug = gpu_slug
        self.path = Path(root or config.tuned_write_dir()) / gpu_slug / f"{op}.json"
        self.problem: str | None = None  # why the whole file was ignored by the last read, if it was
        self._skipped: list[tuple[int, str]] | None = None  # the last read's malformed entries

    # ---- reading ---------------------------------------------------------------------------

    def _empty(self) -> dict:
        return {"schema": SCHEMA_VERSION, "op": self.op, "gpu": self.gpu_slug, "entries": []}

    def _parse(self) -> dict | None:
        """The file's header-checked contents; None when there is no file.
        Raises TunedDBError when the file exists but cannot be used as a whole."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TunedDBError(f"{self.path}: cannot be read ({exc.strerror or exc})") from exc
        try:
            data = json.loads(raw)
        except RecursionError as exc:  # json recurses once per nesting level: `[[[[...` 100,000 deep
            raise TunedDBError(f"{self.path}: is not valid JSON (nested too deeply)") from exc
        except ValueError as exc:  # bad JSON, bad UTF-8, an integer too long to convert
            raise TunedDBError(f"{self.path}: is not valid JSON ({exc})") from exc
        if (why := self._header_problem(data)) is not None:
            raise TunedDBError(f"{self.path}: {why}")
        return data

    def _header_problem(self, data) -> str | None:
        if not isinstance(data, dict):
            return f"is not a JSON object but {type(data).__name__}"
        schema = data.get("schema")
        if not _is_int(schema):
            return f"has no schema version (schema is {_show(schema)})"
        if schema > SCHEMA_VERSION:  # written by a newer pairgen: rewriting it would drop what we don't know
            return f"has schema {schema}, newer than this pairgen's {SCHEMA_VERSION}; upgrade pairgen"
        if schema != SCHEMA_VERSION:
            return f"has schema {schema}; this pairgen reads schema {SCHEMA_VERSION}"
        if data.get("op") != self.op:
            return f"is for op {_show(data.get('op'))}, not {self.op!r}"
        if not isinstance(data.get("entries"), list):
            return f"has no entries list (entries is {_show(data.get('entries'))})"
        for name in ("gpu", "arch"):
            if name in data and _check_str(data[name]) is not None:
                return f"header {name}: {_check_str(data[name])}"
        return None

    def _load(self) -> _Snapshot:
        """Read and sort the entries into valid and malformed. Raises TunedDBError (see _parse)."""
        data = self._parse() or self._empty()
        valid, skipped = [], []
        for index, entry in enumerate(data["entries"]):
            why = entry_problem(entry)
            if why is None:
                valid.append(entry)
            else:
                skipped.append((index, why))
        return _Snapshot(data, valid, skipped)

    def _read(self) -> _Snapshot:
        """_load for readers: a file that cannot be used is a warning and no entries, never a crash."""
        try:
            snapshot = self._load()
        except TunedDBError as exc:
            self.problem, self._skipped = str(exc), []
            warnings.warn(f"pairgen: ignoring tuned database {exc}", TunedDBWarning, stacklevel=3)
            return _Snapshot(self._empty(), [], [])
        self._note_skipped(snapshot)
        return snapshot

    def _note_skipped(self, snapshot: _Snapshot) -> None:
        self.problem, self._skipped = None, list(snapshot.skipped)
        for index, why in snapshot.skipped:
            warnings.warn(f"pairgen: skipping malformed entry {index} of tuned database {self.path}: {why}",
                          TunedDBWarning, stacklevel=4)

    def entries(self) -> list[dict]:
        """The valid entries (malformed ones are skipped: see skipped())."""
        return self._read().valid

    def skipped(self) -> list[tuple[int, str]]:
        """(index in the file's entries, why) of each malformed entry the last read skipped."""
        if self._skipped is None:
            self._read()
        return list(self._skipped)

    def arch(self) -> str | None:
        """The header's arch (e.g. "sm_90": what the entries were tuned on); None if absent or unusable."""
        return self._read().data.get("arch")

    def previous(self, dtype: str, widths: dict, n_bucket: int) -> dict | None:
        """The entry recorded for exactly this key, stale or not (a re-tune starts from it)."""
        want = make_key(dtype, widths, n_bucket)
        return next((e for e in self.entries() if e["key"] == want), None)

    # ---- writing ---------------------------------------------------------------------------

    def _locked(self):
        return files.locked(self.path.with_suffix(".json.lock"))

    def upsert(self, entry: dict, *, arch: str | None = None) -> None:
        """Insert or replace the entry with the same key, atomically and under the lock. `arch` (the
        compute capability it was tuned on) goes into the header unless the header already has one.
        Raises ValueError for a malformed entry, TunedDBError when the file cannot be used: it is
        then left as it is, for a person to look at."""
        if (why := entry_problem(entry)) is not None:
            raise ValueError(f"not a valid tuned entry ({why}): {_show(entry, 200)}")
        if arch is not None and _check_str(arch) is not None:
            raise ValueError(f"arch: {_check_str(arch)}")
        with self._locked():
            try:
                snapshot = self._load()
            except TunedDBError as exc:
                self.problem, self._skipped = str(exc), []
                raise
            self._note_skipped(snapshot)
            data = dict(snapshot.data)
            data["entries"] = _merged(snapshot, entry)
            data["gpu"] = self.gpu_slug
            self._set_arch(data, arch)
            self._replace(data)

    def _set_arch(self, data: dict, arch: str | None) -> None:
        if arch is None:
            return
        if "arch" not in data:
            data["arch"] = arch
        elif data["arch"] != arch:  # the folder's other entries were tuned on data["arch"]
            warnings.warn(f"pairgen: {self.path} keeps arch {data['arch']!r}; this entry was tuned on {arch!r}",
                          TunedDBWarning, stacklevel=3)

    def _replace(self, data: dict) -> None:
        """Write data to a temp file and rename it over the database (readers see old or new, whole)."""
        fd, tmp = self._create_temp()
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(data, handle, indent=1, sort_keys=True)
                handle.write("\n")
                handle.flush()
                os.fsync(handle.fileno())  # the data is on disk before the rename makes it the database
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def _create_temp(self) -> tuple[int, str]:
        """A new temp file beside the database with the mode the database should have: the existing
        file's, else 0o666 less the umask. (mkstemp makes 0600 whatever the umask, and in a shared
        folder that locked the other users out of the database.)"""
        try:
            keep_mode = stat.S_IMODE(os.stat(self.path).st_mode)
        except FileNotFoundError:
            keep_mode = None
        fd, tmp = files.create_temp_beside(self.path)
        if keep_mode is not None:
            os.fchmod(fd, keep_mode)
        return fd, tmp


def _merged(snapshot: _Snapshot, entry: dict) -> list:
    """The file's entries with `entry` in place of the valid one with its key, sorted by key; the
    malformed entries follow, unchanged (they are not ours to drop)."""
    valid = [e for e in snapshot.valid if e["key"] != entry["key"]] + [entry]
    valid.sort(key=_sort_key)
    malformed = [snapshot.data["entries"][index] for index, _ in snapshot.skipped]
    return valid + malformed


def all_databases(root: Path | None = None) -> list[TunedDB]:
    """Every <gpu>/<op>.json under the root; without one, under each folder lookups read
    (config.tuned_read_dirs), in their order."""
    roots = [Path(root)] if root else config.tuned_read_dirs()
    return [TunedDB(p.stem, p.parent.name, r) for r in roots for p in sorted(r.glob("*/*.json"))]


def databases_for_arch(op: str, arch: str, exclude_slug: str | None, root: Path | None = None) -> list[TunedDB]:
    """The op's databases in other GPUs' folders whose header arch is `arch`, by folder name: a GPU
    without a folder of its own (an H100, an "H200 NVL") can use entries tuned on a GPU of the same
    compute capability. A file whose header cannot be read is left out (with its warning)."""
    root = Path(root or config.tuned_write_dir())
    if not root.is_dir():
        return []
    found = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name != exclude_slug):
        if (folder / f"{op}.json").is_file():
            db = TunedDB(op, folder.name, root)
            if db.arch() == arch:
                found.append(db)
    return found
