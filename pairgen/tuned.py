"""The tuned database: tuned/<gpu-slug>/<op>.json.

Schema (version 1):
  {"schema": 1, "op": "contact", "gpu": "<slug>", "entries": [entry, ...]}
  entry = {"key": {"dtype", "widths", "n_bucket"}, "shape", "strategy", "params", "template_sha256",
           "us", "baselines_us", "trials", "date", "versions", ...}
Lookup: exact key -> nearest N bucket (same dtype and widths) -> none (the op's defaults).
An entry whose template hash differs from the template's current hash is stale and not used.
Writes hold a lock file and replace the file atomically, so two tuners can share it.
A corrupt or foreign file is reported (a warning) and ignored, never a crash.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import tempfile
import time
import warnings
from pathlib import Path

from . import codegen, config

SCHEMA_VERSION = 1


def make_key(dtype: str, widths: dict, n_bucket: int) -> dict:
    return {"dtype": dtype, "widths": {k: int(v) for k, v in sorted(widths.items())}, "n_bucket": int(n_bucket)}


class TunedDB:
    def __init__(self, op: str, gpu_slug: str, root: Path | None = None):
        self.op = op
        self.gpu_slug = gpu_slug
        self.path = Path(root or config.tuned_dir()) / gpu_slug / f"{op}.json"
        self.problem: str | None = None  # why the file was ignored, if it was

    # ---- reading ---------------------------------------------------------------------------

    def _read(self) -> dict:
        self.problem = None
        if not self.path.exists():
            return {"schema": SCHEMA_VERSION, "op": self.op, "gpu": self.gpu_slug, "entries": []}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or data.get("schema") != SCHEMA_VERSION or data.get("op") != self.op:
                raise ValueError(f"not a pairgen schema-{SCHEMA_VERSION} file for op {self.op!r}")
            if not isinstance(data.get("entries"), list) or not all(_valid_entry(e) for e in data["entries"]):
                raise ValueError("malformed entries")
            return data
        except (OSError, ValueError) as exc:
            self.problem = f"{self.path}: {exc}"
            warnings.warn(f"pairgen: ignoring tuned database {self.problem}")
            return {"schema": SCHEMA_VERSION, "op": self.op, "gpu": self.gpu_slug, "entries": []}

    def entries(self) -> list[dict]:
        return self._read()["entries"]

    def is_stale(self, entry: dict) -> bool:
        try:
            return entry["template_sha256"] != codegen.template_hash(self.op, entry["strategy"])
        except Exception:  # the strategy's template is gone
            return True

    def lookup(self, dtype: str, widths: dict, n_bucket: int) -> tuple[dict | None, str]:
        """The entry to use, and how it was found."""
        want = make_key(dtype, widths, n_bucket)
        usable = [e for e in self.entries()
                  if e["key"]["dtype"] == dtype and e["key"]["widths"] == want["widths"] and not self.is_stale(e)]
        for entry in usable:
            if entry["key"]["n_bucket"] == want["n_bucket"]:
                return entry, "tuned"
        if usable:
            nearest = min(usable, key=lambda e: (abs(math.log2(e["key"]["n_bucket"]) - math.log2(want["n_bucket"])),
                                                 e["key"]["n_bucket"]))
            return nearest, f"tuned (nearest N bucket {nearest['key']['n_bucket']})"
        return None, "default"

    def previous(self, dtype: str, widths: dict, n_bucket: int) -> dict | None:
        """The entry recorded for exactly this key, stale or not (a re-tune starts from it)."""
        want = make_key(dtype, widths, n_bucket)
        return next((e for e in self.entries() if e["key"] == want), None)

    # ---- writing ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".json.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def upsert(self, entry: dict) -> None:
        """Insert or replace the entry with the same key, atomically and under the lock."""
        if not _valid_entry(entry):
            raise ValueError(f"not a valid tuned entry: {entry}")
        with self._locked():
            data = self._read()
            if self.problem is not None and self.path.exists():  # keep the bad file for inspection
                os.replace(self.path, self.path.with_suffix(f".json.corrupt-{int(time.time())}"))
            data["entries"] = [e for e in data["entries"] if e["key"] != entry["key"]] + [entry]
            data["entries"].sort(key=lambda e: (e["key"]["dtype"], sorted(e["key"]["widths"].items()),
                                                e["key"]["n_bucket"]))
            data["gpu"] = self.gpu_slug
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            with os.fdopen(fd, "w") as handle:
                json.dump(data, handle, indent=1, sort_keys=True)
                handle.write("\n")
            os.replace(tmp, self.path)


def _valid_entry(entry) -> bool:
    try:
        key = entry["key"]
        return (isinstance(key["dtype"], str) and isinstance(key["widths"], dict) and int(key["n_bucket"]) >= 1
                and isinstance(entry["strategy"], str) and isinstance(entry["params"], dict)
                and isinstance(entry["template_sha256"], str))
    except (KeyError, TypeError, ValueError):
        return False


def all_databases(root: Path | None = None) -> list[TunedDB]:
    """Every tuned/<gpu>/<op>.json under the root."""
    root = Path(root or config.tuned_dir())
    return [TunedDB(p.stem, p.parent.name, root) for p in sorted(root.glob("*/*.json"))]
