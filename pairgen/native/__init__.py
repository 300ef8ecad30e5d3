"""pairgen's compiled helper (fastcall.cpp), built on first use with the machine's C++ compiler
against the installed torch, as Triton and torch's inductor build their launchers, and cached
under PAIRGEN_CACHE_DIR. The build runs in a background thread, so no call waits for it; until it
is there (or where it cannot be built: no compiler, no Python headers, PAIRGEN_FASTCALL=0) every
call takes the Python path, which computes the same thing."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

from .. import config, files

SOURCE = Path(__file__).resolve().parent / "fastcall.cpp"
MODULE_NAME = "pairgen_fastcall"  # its PyInit_ function's name

_lock = threading.Lock()
_state = {"module": None, "thread": None, "error": None}


def compile_command(output: Path) -> list[str]:
    """The compiler command that builds fastcall.cpp against this process's torch and Python."""
    import torch
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    libraries = cpp_extension.library_paths()
    return [os.environ.get("CXX", "c++"), "-O2", "-std=c++17", "-shared", "-fPIC", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{path}" for path in includes), str(SOURCE),
            *(f"-L{path}" for path in libraries), "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
            *(f"-Wl,-rpath,{path}" for path in libraries), "-o", str(output)]


def built_path() -> Path:
    """Where the build for this source, torch and Python is cached."""
    import torch

    key = hashlib.sha256(SOURCE.read_bytes() + f"{torch.__version__} {sys.version}".encode()).hexdigest()[:16]
    return config.cache_dir() / "native" / f"{MODULE_NAME}-{key}.so"


def _build() -> None:
    try:
        path = built_path()
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            # Processes sharing the cache (a test run's workers, a server's) build it once: the
            # others wait for the lock and find it built.
            with files.locked(path.with_suffix(".lock")):
                if not path.exists():
                    _compile_to(path)
        spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _state["module"] = module
    except Exception as exc:  # no compiler, no headers, a read-only cache: the Python path stays
        _state["error"] = f"{type(exc).__name__}: {exc}"


def _compile_to(path: Path) -> None:
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        partial = Path(scratch) / path.name
        result = subprocess.run(compile_command(partial), capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"the compiler failed ({result.returncode}): {result.stderr[-2000:]}")
        os.replace(partial, path)  # whole or absent: another process may be reading the cache


def fastcall(wait: bool = False):
    """The compiled module, or None while it builds (started by the first request) and where it
    cannot be built. wait=True builds it in this thread first (tests, and the tuner's reports)."""
    module = _state["module"]
    if module is not None or _state["error"] is not None or not config.fastcall_enabled():
        return module
    with _lock:
        thread = _state["thread"]
        if thread is None:
            thread = _state["thread"] = threading.Thread(target=_build, name="pairgen-fastcall-build", daemon=True)
            thread.start()
    if wait:
        thread.join()
    return _state["module"]


def status() -> str:
    """What the compiled fast path is doing: ready, building, disabled, or why it failed."""
    if not config.fastcall_enabled():
        return "disabled (PAIRGEN_FASTCALL=0)"
    if _state["module"] is not None:
        return "ready"
    if _state["error"] is not None:
        return f"unavailable: {_state['error']}"
    return "building" if _state["thread"] is not None else "not built yet"
