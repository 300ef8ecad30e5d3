"""Every environment variable pairgen reads, in one place (the README's table mirrors this)."""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Callable, TypeVar

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


#: A real GPU target, which NVRTC compiles to a cubin: sm_90, sm_90a, sm_100f, sm_120, ...
#: (compute_XY is a virtual target: NVRTC gives PTX and an empty cubin for it.)
ARCH_PATTERN = re.compile(r"sm_\d{2,3}[af]?")

T = TypeVar("T")


def _get(name: str) -> str | None:
    assert name in ENVIRONMENT, name
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def _parse(name: str, convert: Callable[[str], T], is_valid: Callable[[T], object], expected: str) -> T | None:
    """The variable's value converted, None when it is unset; a bad value raises a ValueError
    naming the variable, its value and what is expected, since the error may surface far from
    where the variable was set (in a compile worker, in the middle of a tuning run)."""
    value = _get(name)
    if value is None:
        return None
    try:
        parsed = convert(value)
    except ValueError:
        parsed = None
    if parsed is None or not is_valid(parsed):
        raise ValueError(f"{name}={value!r} is not valid: expected {expected}")
    return parsed


def cache_dir() -> Path:
    return Path(_get("PAIRGEN_CACHE_DIR") or "~/.cache/pairgen").expanduser()


def tuned_dir() -> Path:
    return Path(_get("PAIRGEN_TUNED_DIR") or REPO_ROOT / "tuned").expanduser()


def disabled() -> bool:
    return (_get("PAIRGEN_DISABLE") or "0") not in ("0", "false", "False")


def arch_override() -> str | None:
    return _parse("PAIRGEN_ARCH", str, ARCH_PATTERN.fullmatch,
                  "a real GPU target sm_XY such as sm_80, sm_90, sm_90a, sm_100 or sm_120 "
                  "(not compute_XY: NVRTC makes no cubin for a virtual target)")


def compile_workers() -> int:
    workers = _parse("PAIRGEN_COMPILE_WORKERS", int, lambda n: n >= 1, "a whole number of processes, 1 or more")
    return workers if workers is not None else max(1, os.cpu_count() or 1)


def compile_budget_s() -> float:
    # A budget of 0 or less would fail every trial as "over the budget" without saying why.
    budget = _parse("PAIRGEN_COMPILE_BUDGET_S", float, lambda s: math.isfinite(s) and s > 0,
                    "a number of seconds greater than 0")
    return budget if budget is not None else 60.0
