"""A writer process of tests/test_tuned.py's concurrent writes: this module imports the tuned
database alone (no torch, no op package), so the spawned writers start in a fraction of a second
and their upserts overlap."""
from __future__ import annotations

from pairgen.tuned import TunedDB


def upsert(args) -> None:
    root, entry = args
    TunedDB("contact", "test-gpu", root).upsert(entry)
