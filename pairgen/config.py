"""Every environment variable pairgen reads, in one place (the README's table mirrors this), and
where the kernel templates and the tuned results are (a checkout's folders, or the wheel's copies;
the user's tuned folder follows XDG_DATA_HOME)."""
from __future__ import annotations

import math
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Callable, TypeVar

PACKAGE_DIR = Path(__file__).resolve().parent
#: The checkout's root when pairgen runs from one (the folder holding pyproject.toml, templates/ and
#: tuned/); for an installed wheel, the site-packages folder (see in_checkout()).
REPO_ROOT = PACKAGE_DIR.parent

#: name -> (default, meaning). tests/test_docs.py checks the README lists exactly these.
ENVIRONMENT = {
    "PAIRGEN_CACHE_DIR": ("~/.cache/pairgen", "Compiled cubins and the tuner's Optuna journals."),
    "PAIRGEN_TUNED_DIR": ("unset: the user folder (`$XDG_DATA_HOME/pairgen/tuned`, else `~/.local/share/pairgen/tuned`) over the shipped results; `<repo>/tuned` in a checkout",
                          "The tuned database folder. Set, it is the only one: read by the modules and written by `pairgen-tune`. Unset, tuning writes the user folder and lookups read it before the results shipped with pairgen; a checkout whose `tuned/` is writable reads and writes `<repo>/tuned` instead (results to commit)."),
    "PAIRGEN_DISABLE": ("0", "1 makes every module run its PyTorch reference (for debugging). Read when a module first meets a length; after changing it in a running process call `pairgen.runtime.clear_caches()`."),
    "PAIRGEN_FIRST_USE_CHECK": ("1", "On a shape with no tuned entry, time the default kernel against the PyTorch reference at its first call and run the faster; the verdict is kept under the user's tuned folder (`<gpu>/first-use/<op>.json`). 0 turns the check off."),
    "PAIRGEN_FUSED_BACKWARD": ("1", "0 runs the closed forms' elementwise steps as PyTorch passes instead of pairgen's fused kernels (the triangle update's gates, their chain rule, the output gate, the output LayerNorm and its backward, and in 16 bits on Hopper its projections, forward and backward, and the output side's weight gradients; the input LayerNorm of the triangle update and the contact head, forward and backward; the readout's 16-bit first-layer rows and its max over partners, forward and backward); both meet the same gradient standard, the fused kernels are faster, and \"auto\" trains 16-bit triangle updates and contact heads in PyTorch without them."),
    "PAIRGEN_FASTCALL": ("1", "A module call like one of its recent kernel calls (shapes, dtypes, device, autocast; no autograd, the parameters unchanged) replays its kernels from compiled code, built on first use with the machine's C++ compiler in a background thread and cached under `PAIRGEN_CACHE_DIR`; so does a 16-bit training call like one of its recent closed-form training calls, forward and backward. 0 keeps every call on the Python path (the same kernels, more host time per call)."),
    "PAIRGEN_ARCH": ("the current GPU's, else sm_90", "NVRTC target, e.g. sm_90; lets a machine without a GPU compile."),
    "PAIRGEN_COMPILE_WORKERS": ("number of CPUs", "Processes compiling variants in parallel (tuner, dry runs)."),
    "PAIRGEN_COMPILE_BUDGET_S": ("60", "Compile-time budget per variant; a slower variant fails its trial."),
}


#: A real GPU target, which NVRTC compiles to a cubin: sm_90, sm_90a, sm_100f, sm_120, ...
#: (compute_XY is a virtual target: NVRTC gives PTX and an empty cubin for it.)
ARCH_PATTERN = re.compile(r"sm_\d{2,3}[af]?")

#: The real targets of the CUDA 12 and 13 NVRTCs, for where NVRTC cannot say which it compiles for
#: (not loadable, or a cuda-bindings without nvrtcGetSupportedArchs): 90 is sm_90.
KNOWN_ARCHS = (50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 88, 89, 90, 100, 101, 103, 110, 120, 121)
#: The first architectures with arch-specific ("a": sm_90a) and family-specific ("f": sm_100f) targets.
SUFFIX_SINCE = {"a": 90, "f": 100}

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


def fastcall_enabled() -> bool:
    return _parse("PAIRGEN_FASTCALL", int, lambda v: v in (0, 1), "0 or 1") != 0


def cache_dir() -> Path:
    return Path(_get("PAIRGEN_CACHE_DIR") or "~/.cache/pairgen").expanduser()


# ---- where the templates and the tuned results are ---------------------------------------------
# A checkout keeps templates/ and tuned/ at the top of the repository; the wheel ships them inside
# the package as pairgen/_templates and pairgen/_tuned (pyproject.toml maps the folders).

def in_checkout() -> bool:
    """True when pairgen runs from a source tree (an editable install, or the repository on
    sys.path), False for an installed wheel."""
    if {"site-packages", "dist-packages"} & set(PACKAGE_DIR.parts):
        return False
    return (REPO_ROOT / "pyproject.toml").is_file() and (REPO_ROOT / "templates").is_dir()


def templates_dir() -> Path:
    """The kernel templates: <repo>/templates in a checkout, the packaged copy in a wheel."""
    return REPO_ROOT / "templates" if in_checkout() else PACKAGE_DIR / "_templates"


def shipped_tuned_dir() -> Path:
    """The tuned results that come with pairgen: <repo>/tuned in a checkout, the packaged copy in a wheel."""
    return REPO_ROOT / "tuned" if in_checkout() else PACKAGE_DIR / "_tuned"


def user_tuned_dir() -> Path:
    """$XDG_DATA_HOME/pairgen/tuned, else ~/.local/share/pairgen/tuned (a relative XDG_DATA_HOME
    is ignored, as the XDG base directory specification says)."""
    base = os.environ.get("XDG_DATA_HOME", "")
    root = Path(base) if base and Path(base).is_absolute() else Path("~/.local/share").expanduser()
    return root / "pairgen" / "tuned"


def _checkout_tuned_writable() -> bool:
    tuned = REPO_ROOT / "tuned"
    return in_checkout() and os.access(tuned if tuned.exists() else REPO_ROOT, os.W_OK)


def tuned_dir_override() -> Path | None:
    """PAIRGEN_TUNED_DIR, when set: then the only tuned folder, read and written."""
    override = _get("PAIRGEN_TUNED_DIR")
    return Path(override).expanduser() if override is not None else None


def tuned_write_dir() -> Path:
    """Where tuning writes: PAIRGEN_TUNED_DIR; else, in a checkout whose tuned/ is writable, that
    folder (results to commit); else the user folder."""
    override = tuned_dir_override()
    if override is not None:
        return override
    return REPO_ROOT / "tuned" if _checkout_tuned_writable() else user_tuned_dir()


def tuned_read_dirs() -> list[Path]:
    """Where lookups read, first folder first (an entry there hides the same key's in later ones):
    PAIRGEN_TUNED_DIR alone when set; else the folder tuning writes, then the shipped results."""
    override = tuned_dir_override()
    if override is not None:
        return [override]
    dirs = [tuned_write_dir()]
    if shipped_tuned_dir() not in dirs:
        dirs.append(shipped_tuned_dir())
    return dirs


def disabled() -> bool:
    return (_get("PAIRGEN_DISABLE") or "0") not in ("0", "false", "False")


def first_use_check() -> bool:
    return (_get("PAIRGEN_FIRST_USE_CHECK") or "1") not in ("0", "false", "False")


def fused_backward() -> bool:
    return (_get("PAIRGEN_FUSED_BACKWARD") or "1") not in ("0", "false", "False")


@lru_cache(maxsize=1)
def supported_archs() -> tuple[int, ...]:
    """The architectures the installed NVRTC compiles for (90 for sm_90), else KNOWN_ARCHS."""
    try:
        from cuda.bindings import nvrtc

        err, archs = nvrtc.nvrtcGetSupportedArchs()
    except Exception:  # no cuda-bindings, NVRTC not loadable, a binding without the call
        return KNOWN_ARCHS
    return tuple(sorted(archs)) if err == nvrtc.nvrtcResult.NVRTC_SUCCESS and archs else KNOWN_ARCHS


def _arch_supported(arch: str, archs: tuple[int, ...]) -> bool:
    if not ARCH_PATTERN.fullmatch(arch):
        return False
    number, suffix = int(arch[3:].rstrip("af")), arch[3:].lstrip("0123456789")
    return number in archs and (not suffix or number >= SUFFIX_SINCE[suffix])


def arch_override() -> str | None:
    """PAIRGEN_ARCH, checked against the targets NVRTC compiles for here: a target it does not know
    would pass a pattern and then fail every compile."""
    if _get("PAIRGEN_ARCH") is None:
        return None
    archs = supported_archs()
    return _parse("PAIRGEN_ARCH", str, lambda arch: _arch_supported(arch, archs),
                  f"a real GPU target the installed NVRTC compiles for: {', '.join(f'sm_{a}' for a in archs)} "
                  f"(sm_{SUFFIX_SINCE['a']} and later also with an a suffix, sm_{SUFFIX_SINCE['f']} and later with "
                  "an f, e.g. sm_90a, sm_100f; not compute_XY: NVRTC makes no cubin for a virtual target)")


def compile_workers() -> int:
    workers = _parse("PAIRGEN_COMPILE_WORKERS", int, lambda n: n >= 1, "a whole number of processes, 1 or more")
    return workers if workers is not None else max(1, os.cpu_count() or 1)


def compile_budget_s() -> float:
    # A budget of 0 or less would fail every trial as "over the budget" without saying why.
    budget = _parse("PAIRGEN_COMPILE_BUDGET_S", float, lambda s: math.isfinite(s) and s > 0,
                    "a number of seconds greater than 0")
    return budget if budget is not None else 60.0
