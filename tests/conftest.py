import os
import shutil
import tempfile

import pytest

# An xdist worker shares the CPUs with the other workers (`-n auto`: one per CPU). torch's thread
# pool in each, a thread per CPU, would oversubscribe them: its threads then spin waiting for one
# another, and a small CPU op takes milliseconds instead of microseconds. Each worker gets its
# share, set before torch is imported; the commands a test starts inherit it. NVRTC likewise: its
# share of compile processes (a share of one compiles in the worker itself; the tests of the
# compile pool make their own pool).
if os.environ.get("PYTEST_XDIST_WORKER"):
    _share = str(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)))
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PAIRGEN_COMPILE_WORKERS"):
        os.environ.setdefault(_name, _share)

import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


SLOW_REASON = "a broad sweep whose coverage a fast test shares in part: run with --slow (or PAIRGEN_SLOW_TESTS=1)"


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the tests marked slow: broad compile sweeps (every preset width, a second "
                          "architecture, further option sets), minutes of NVRTC on a small machine")


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pytest-xdist): a worker per CPU where no GPU is visible, where the suite is mostly
    NVRTC and Python; none where one is (the GPU tests time kernels and share the device: one
    process runs them all)."""
    return 0 if torch.cuda.is_available() else max(2, os.cpu_count() or 1)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped, with the reason, where there is none)")
    config.addinivalue_line("markers", f"slow: {SLOW_REASON}")
    # Tests never write the user's cache. Set for the whole session, before any test module is
    # imported: work at import or collection time, in module fixtures, or in a thread that outlives
    # its test (the native helper's build) would miss a per-test setting. Compiled cubins are shared
    # across the session.
    if not os.environ.get("PAIRGEN_CACHE_DIR"):
        config._pairgen_cache = os.environ["PAIRGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="pairgen-test-cache-")
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        # xdist's main process, idle while its workers test: the compiled fast path builds here in
        # the background, once for every worker (they wait for its lock instead of building it too).
        from pairgen import native

        native.fastcall()


def pytest_unconfigure(config):
    cache = getattr(config, "_pairgen_cache", None)
    if cache is not None:
        from pairgen import native

        build = native._state["thread"]
        if build is not None:
            build.join()  # not to leave a compiler writing into the folder removed below
        del os.environ["PAIRGEN_CACHE_DIR"]
        shutil.rmtree(cache, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--slow") or os.environ.get("PAIRGEN_SLOW_TESTS") == "1"
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU: none is visible to torch on this machine")
    not_slow = pytest.mark.skip(reason=SLOW_REASON)
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        elif "slow" in item.keywords and not run_slow:
            item.add_marker(not_slow)


@pytest.fixture(scope="session")
def compiled_fast_path():
    """The compiled fast path (pairgen/native), built before the first test that asks for it rather
    than at collection (the build takes seconds of the C++ compiler), or that test skipped with
    the reason it cannot be built."""
    from pairgen import native

    module = native.fastcall(wait=True)
    if module is None:
        pytest.skip(f"the compiled fast path: {native.status()}")
    return module


@pytest.fixture(autouse=True)
def _first_use_check_off(monkeypatch):
    # Tests choose their variants: a first-use check would swap in the reference at small shapes
    # and write verdicts to the user's folder. tests/test_first_use*.py turn it on themselves.
    if not os.environ.get("PAIRGEN_FIRST_USE_CHECK"):
        monkeypatch.setenv("PAIRGEN_FIRST_USE_CHECK", "0")


@pytest.fixture
def first_use_folder(tmp_path, monkeypatch):
    """The first-use check on, its verdicts (and every tuned lookup) in a fresh folder."""
    from pairgen import runtime

    monkeypatch.setenv("PAIRGEN_TUNED_DIR", str(tmp_path))
    monkeypatch.setenv("PAIRGEN_FIRST_USE_CHECK", "1")
    runtime.clear_caches()
    yield tmp_path
    runtime.clear_caches()
