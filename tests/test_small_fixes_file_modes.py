"""Files pairgen writes get the mode an ordinary open() gives (0o666 less the umask), so a shared
cache, study folder or tuned folder stays usable by the other users the umask lets in: a 0600 file
written by one user locked the others out."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pairgen import compiler, first_use
from pairgen.tuned import TunedDB, make_key
from pairgen.tuning import tuner

SOURCE = 'extern "C" __global__ void mode_k(float* x) { x[threadIdx.x] = 1.0f; }'


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_compile_cache_files_follow_the_umask(tmp_path, monkeypatch, umask_022):
    monkeypatch.setenv("PAIRGEN_CACHE_DIR", str(tmp_path))
    compiler.compile_source(SOURCE, "mode_k", "sm_90")
    cubin, meta = compiler._cache_paths(compiler.cache_key(SOURCE, "sm_90"))
    assert (mode(cubin), mode(meta)) == (0o644, 0o644)
    assert mode(cubin.parent) == 0o755


def test_first_use_verdicts_follow_the_umask(tmp_path, monkeypatch, umask_022):
    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(tmp_path))
    path = first_use.record_verdict("contact", "test-gpu", "float32", {"P": 64, "H": 32}, 64, "0" * 64,
                                    "default", 1.0, 2.0)
    assert mode(path) == 0o644


def test_a_repaired_tuner_journal_follows_the_umask(tmp_path, umask_022):
    journal = tmp_path / "study.journal"
    journal.write_bytes(b'{"op_code": 0}\n{"torn')
    assert tuner.repair_journal(journal)
    assert mode(journal) == 0o644


def test_a_new_tuned_database_follows_the_umask(tmp_path, umask_022):
    entry = {"key": make_key("float32", {"P": 64, "H": 32}, 64), "strategy": "tiled", "params": {"threads": 128},
             "template_sha256": "0" * 64}
    db = TunedDB("contact", "test-gpu", tmp_path)
    db.upsert(entry)
    assert mode(db.path) == 0o644
