"""The disk cache of cubins serves only entries it can verify, and a cache that cannot be written
never costs a compile: NVRTC on the CPU, each test with its own cache directory."""
from __future__ import annotations

import hashlib
import json
import os
import uuid
import warnings

import pytest

from pairgen import compiler

ARCH = "sm_90"


def fresh_source() -> str:
    """A source no other test (or earlier run) has cached."""
    return f'// {uuid.uuid4()}\nextern "C" __global__ void cache_k(float* x) {{ x[threadIdx.x] += 3.0f; }}\n'


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAIRGEN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def warn_again(monkeypatch):
    """Forget that this process already warned about an unwritable cache, for one test."""
    monkeypatch.setattr(compiler, "_warned_unwritable_cache", False)


def compile_recording_warnings(*sources: str) -> tuple[list[compiler.Compiled], list[str]]:
    """Compile each source; also return the warnings about the cache that this raised."""
    # "always": a once-per-process rule must be pairgen's own, not Python's warning registry.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [compiler.compile_source(source, "cache_k", ARCH) for source in sources]
    return results, [str(w.message) for w in caught if "cache" in str(w.message)]


def entry_paths(source: str):
    return compiler._cache_paths(compiler.cache_key(source, ARCH))


def test_the_metadata_records_the_cubins_size_and_sha256(cache_dir):
    source = fresh_source()
    compiled = compiler.compile_source(source, "cache_k", ARCH)
    cubin_path, meta_path = entry_paths(source)
    assert cubin_path.is_relative_to(cache_dir)
    meta = json.loads(meta_path.read_text())
    assert meta["cubin_size"] == len(compiled.cubin) == cubin_path.stat().st_size
    assert meta["cubin_sha256"] == hashlib.sha256(compiled.cubin).hexdigest()
    again = compiler.compile_source(source, "cache_k", ARCH)
    assert again.from_cache and again.cubin == compiled.cubin


DAMAGE = {
    "empty": lambda cubin: b"",
    "truncated": lambda cubin: cubin[: len(cubin) // 2],
    "random": lambda cubin: os.urandom(len(cubin)),
    "elf magic, random body": lambda cubin: b"\x7fELF" + os.urandom(len(cubin) - 4),
    "one byte flipped": lambda cubin: cubin[:-1] + bytes([cubin[-1] ^ 0xFF]),
    "one byte appended": lambda cubin: cubin + b"\0",
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_damaged_cubin_is_recompiled_and_rewritten(cache_dir, damage):
    """A damaged cubin used to be served as "(cached)", and loading it failed on the GPU later."""
    source = fresh_source()
    good = compiler.compile_source(source, "cache_k", ARCH)
    cubin_path, _ = entry_paths(source)
    cubin_path.write_bytes(DAMAGE[damage](good.cubin))

    (recompiled,), caught = compile_recording_warnings(source)
    assert not recompiled.from_cache and recompiled.cubin == good.cubin
    assert len(caught) == 1 and "damaged" in caught[0]
    assert cubin_path.read_bytes() == good.cubin, "the entry is rewritten"
    assert compiler.compile_source(source, "cache_k", ARCH).from_cache


def test_a_missing_cubin_or_unreadable_metadata_is_recompiled(cache_dir):
    source = fresh_source()
    good = compiler.compile_source(source, "cache_k", ARCH)
    cubin_path, meta_path = entry_paths(source)
    for damage in (cubin_path.unlink, lambda: meta_path.write_text("{not json")):
        damage()
        (recompiled,), caught = compile_recording_warnings(source)
        assert not recompiled.from_cache and recompiled.cubin == good.cubin
        assert len(caught) == 1 and "damaged" in caught[0]


def test_compile_source_refuses_an_empty_cubin(cache_dir):
    """compute_90 is a virtual architecture: NVRTC makes PTX and a 0-byte cubin for it, which
    used to be reported as a successful compile (and cached)."""
    source = fresh_source()
    with pytest.raises(RuntimeError, match="compute_90"):
        compiler.compile_source(source, "cache_k", "compute_90")
    cubin_path, _ = compiler._cache_paths(compiler.cache_key(source, "compute_90"))
    assert not cubin_path.exists()


def test_a_cache_dir_that_cannot_be_created_compiles_in_memory_and_warns_once(tmp_path, monkeypatch, warn_again):
    """Writing the cache used to raise after a successful compile. A path under a regular file
    cannot be created even by root, unlike a chmod'ed directory."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("PAIRGEN_CACHE_DIR", str(blocker / "cache"))
    results, caught = compile_recording_warnings(fresh_source(), fresh_source())
    assert all(r.cubin.startswith(b"\x7fELF") and not r.from_cache for r in results)
    assert len(caught) == 1 and str(blocker / "cache") in caught[0]


def test_a_read_only_cache_dir_compiles_in_memory_and_warns_once(tmp_path, monkeypatch, warn_again):
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o500)
    read_only.chmod(0o500)
    try:
        if os.access(read_only, os.W_OK):
            pytest.skip("chmod does not stop this user (root) writing; the test above covers it")
        monkeypatch.setenv("PAIRGEN_CACHE_DIR", str(read_only))
        results, caught = compile_recording_warnings(fresh_source(), fresh_source())
        assert all(r.cubin.startswith(b"\x7fELF") and not r.from_cache for r in results)
        assert len(caught) == 1 and str(read_only) in caught[0]
    finally:
        read_only.chmod(0o700)  # so pytest can clean tmp_path up


def _compile_after(barrier, source: str, results) -> None:
    barrier.wait()  # every process misses the cache: none has compiled yet
    results.put(compiler.compile_source(source, "cache_k", ARCH).from_cache)


def test_processes_compiling_one_source_at_once_compile_it_once(cache_dir):
    """The others wait for the first one's cubin (compile workers of several test or training
    processes on one host start on the same kernels together)."""
    import multiprocessing

    pytest.importorskip("fcntl", reason="the compile lock needs fcntl's file locks (none on Windows: each process compiles)")
    context = multiprocessing.get_context("spawn")
    source = fresh_source().replace("+= 3.0f", "= sinf(x[threadIdx.x]) * cosf(x[threadIdx.x] + 1.0f)")
    processes = 3
    barrier, results = context.Barrier(processes), context.Queue()
    workers = [context.Process(target=_compile_after, args=(barrier, source, results)) for _ in range(processes)]
    for worker in workers:
        worker.start()
    answers = [results.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
    assert sorted(answers) == [False] + [True] * (processes - 1)
    cubin_path, _ = entry_paths(source)
    assert cubin_path.exists() and not compiler._lock_path(compiler.cache_key(source, ARCH)).exists()
