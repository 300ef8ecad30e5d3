import os

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped, with the reason, where there is none)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: none is visible to torch on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Tests never write the user's cache; compiled cubins are shared across one test session."""
    if not os.environ.get("PAIRGEN_CACHE_DIR"):
        monkeypatch.setenv("PAIRGEN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "pairgen-cache"))
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
