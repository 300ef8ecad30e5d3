"""Every environment variable pairgen reads, in one place (the README's table mirrors this)."""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

#: name -> (default, meaning). tests/test_docs.py checks the README lists exactly these.
ENVIRONMENT = {
    "PAIRGEN_CACHE_DIR": ("~/.cache/pairgen", "Compiled cubins and the tuner's Optuna journals."),
    "PAIRGEN_TUNED_DIR": ("<repo>/tuned", "The tuned database read by the modules and written by scripts/tune.py."),
    "PAIRGEN_DISABLE": ("0", "1 makes every module run its PyTorch reference (for debugging). Read when a module first meets a length; after changing it in a running process call `pairgen.runtime.clear_caches()`."),
    "PAIRGEN_ARCH": ("the current GPU's, else sm_90", "NVRTC target, e.g. sm_90; lets a machine without a GPU compile."),
    "PAIRGEN_COMPILE_WORKERS": ("number of CPUs", "Processes compiling variants in parallel (tuner, dry runs)."),
    "PAIRGEN_COMPILE_BUDGET_S": ("60", "Compile-time budget per variant; a slower variant fails its trial."),
}


def _get(name: str) -> str | None:
    assert name in ENVIRONMENT, name
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def cache_dir() -> Path:
    return Path(_get("PAIRGEN_CACHE_DIR") or "~/.cache/pairgen").expanduser()


def tuned_dir() -> Path:
    return Path(_get("PAIRGEN_TUNED_DIR") or REPO_ROOT / "tuned").expanduser()


def disabled() -> bool:
    return (_get("PAIRGEN_DISABLE") or "0") not in ("0", "false", "False")


def arch_override() -> str | None:
    return _get("PAIRGEN_ARCH")


def compile_workers() -> int:
    value = _get("PAIRGEN_COMPILE_WORKERS")
    return max(1, int(value)) if value else max(1, os.cpu_count() or 1)


def compile_budget_s() -> float:
    return float(_get("PAIRGEN_COMPILE_BUDGET_S") or 60.0)
