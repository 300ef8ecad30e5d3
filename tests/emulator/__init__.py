"""pairgen's kernels run on the CPU: the rendered CUDA source translated to C++ (translate.py),
compiled by g++ against prelude.h, and launched on CPU tensors in place of the GPU.

`with emulated():` makes runtime.build_variant (every kernel pairgen launches: the strategies'
plans and the fused templates, weight packs included) build emulated variants, so a module's
`_launch` with a variant runs its real launch path (grids, arguments, scratch buffers, cuBLAS's
place taken by torch's CPU bmm) on CPU tensors. A launch that fails (a deadlock, a shared-memory
race the emulator sees, __trap) raises EmulationError with what the emulator found.

Not a performance model and not a full memory checker: an out-of-bounds global access may crash
the process. Threads of a block interleave only where CUDA threads meet, so a race between two
threads without a barrier between them shows only when the order of the threads decides the
result (`order` runs them reversed, or alternating, to try).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from pathlib import Path

from pairgen import codegen, runtime
from pairgen.launch import FASTCALL_MODES, BoundLaunch, note_launch
from pairgen.spec import DeviceLimits

from .translate import TOGETHER, kernel_names, translate

HERE = Path(__file__).parent
PRELUDE = HERE / "prelude.h"
#: g++ flags: optimised enough that a kernel's products run in seconds, -O1 compiles in half the time of -O2
CXXFLAGS = ("-std=c++17", "-O1", "-fPIC", "-shared", "-fvisibility=hidden", "-w", "-pthread")
#: SMs of the emulated GPU: few, so that the persistent kernels' blocks each take several tiles
EMULATED_SMS = 3


class EmulationError(RuntimeError):
    """The emulator stopped a launch: a deadlock, a race it saw, a __trap, an unknown instruction."""


def cache_dir() -> Path:
    base = os.environ.get("PAIRGEN_EMULATOR_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pairgen-emulator")
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


_build_lock = threading.Lock()


def precompiled_prelude(prelude: str) -> Path:
    """prelude.h in the cache beside its precompiled form (built once per content and flags): g++
    then reads the precompiled header instead of parsing the standard headers for every kernel
    (about half a second of each build). Where the precompiled form is missing or does not fit, g++
    reads the header itself, so a build never depends on it."""
    key = hashlib.sha256("\0".join([prelude, *CXXFLAGS]).encode()).hexdigest()[:24]
    folder = cache_dir() / f"prelude-{key}"
    header = folder / "prelude.h"
    if not (folder / "prelude.h.gch").exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            staged = Path(tmp) / "prelude.h"
            staged.write_text(prelude)
            flags = [f for f in CXXFLAGS if f != "-shared"]
            result = subprocess.run(["g++", *flags, "-x", "c++-header", str(staged), "-o", str(staged) + ".gch"],
                                    capture_output=True, text=True)
            if result.returncode == 0:
                os.replace(staged, header)  # the header first: a .gch is only read beside its header
                os.replace(str(staged) + ".gch", str(header) + ".gch")
    return header if header.exists() else PRELUDE


def build_library(source: str) -> tuple[ctypes.CDLL, list[str]]:
    """The rendered source compiled for the CPU (cached by content), and its kernel names."""
    text = translate(source)
    prelude = PRELUDE.read_text()
    key = hashlib.sha256("\0".join([prelude, text, *CXXFLAGS]).encode()).hexdigest()[:24]
    library = cache_dir() / f"{key}.so"
    with _build_lock:
        if not library.exists():
            header = precompiled_prelude(prelude)
            with tempfile.TemporaryDirectory() as tmp:
                cpp = Path(tmp) / "kernel.cpp"
                cpp.write_text(text)
                built = Path(tmp) / "kernel.so"
                result = subprocess.run(["g++", *CXXFLAGS, "-include", str(header), str(cpp), "-o", str(built)],
                                        capture_output=True, text=True)
                if result.returncode:
                    raise EmulationError(f"g++ failed on the translated source:\n{result.stderr[-6000:]}")
                os.replace(built, library)
    return ctypes.CDLL(str(library)), kernel_names(source)


class EmulatedKernel:
    """One __global__ function of an emulated variant (LoadedKernel's part that launches use)."""

    resident_per_sm = 1

    def __init__(self, library: ctypes.CDLL, name: str, threads: int, device_index: int = -1):
        self.name, self.device_index = name, device_index
        self.threads = threads
        self.function = getattr(library, f"pgx_launch_{name}")
        self.function.restype = ctypes.c_int
        self.function.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        self.order = 0
        # What a compiled replay launches: the library's cuLaunchKernel stand-in, on this kernel.
        self._handle = ctypes.c_void_p(ctypes.cast(self.function, ctypes.c_void_p).value)
        self.driver_launch = ctypes.cast(library.pgx_driver_launch, ctypes.c_void_p).value

    def bind(self, grid: int, block: int, smem: int, arg_count: int, mode: str = "plain", tail: tuple = (),
             names: tuple = ()) -> "EmulatedLaunch":
        return EmulatedLaunch(self, grid, block, smem, arg_count, mode, tail, names)


class EmulatedLaunch(BoundLaunch):
    """A BoundLaunch that runs the kernel on the CPU, synchronously."""

    def __init__(self, kernel: EmulatedKernel, grid: int, block: int, smem: int, arg_count: int,
                 mode: str = "plain", tail: tuple = (), names: tuple = ()):
        self.kernel, self.grid, self.block, self.smem = kernel, grid, block, smem
        self.mode, self.tail, self.names = mode, tail, names
        self._orders = {}

    def __call__(self, *args: int) -> None:
        note_launch(self, args)
        values = (ctypes.c_longlong * max(1, len(args)))(*args)
        error = ctypes.create_string_buffer(4096)
        if self.kernel.function(self.grid, self.block, self.smem, values, ORDER[0], TOGETHER, error, len(error)):
            raise EmulationError(f"{self.kernel.name} (grid {self.grid}, block {self.block}, {self.smem} B shared): "
                                 f"{error.value.decode()}")

    def driver_entry(self) -> tuple[int, int]:
        """A plain launch through the library's cuLaunchKernel stand-in (translate.DRIVER_LAUNCH)."""
        return FASTCALL_MODES["plain"], self.kernel.driver_launch


#: The order threads run between meetings (prelude.h's run_block: 0 in order, 1 reversed, 2 alternating,
#: 3 and 4 by priority), plus EARLY_LANDING for cp.async copies that land at their issue, not at their wait.
ORDER = [0]
EARLY_LANDING = 8


class EmulatedVariant(runtime.Variant):
    """A plan rendered and compiled for the CPU; kernel() gives EmulatedKernels."""

    def __init__(self, plan, rendered: codegen.Rendered):
        self.plan, self.rendered, self.compiled = plan, rendered, None
        self._loaded, self._bound = {}, {}
        self.library, self.names = build_library(rendered.source)

    def kernel(self, device_index: int, name: str | None = None):
        decl = self.plan.main if name is None else next(k for k in self.plan.kernels if k.name == name)
        kernel = self._loaded.get(decl.name)
        if kernel is None:
            kernel = self._loaded[decl.name] = EmulatedKernel(self.library, decl.name, decl.threads, device_index)
        return kernel


def emulated_variant(plan) -> EmulatedVariant:
    return EmulatedVariant(plan, codegen.render_plan(plan))


EMULATED_DEVICE = runtime.DeviceInfo(-1, "pairgen CPU emulator", "cpu-emulator", "sm_90",
                                     DeviceLimits(sm_count=EMULATED_SMS), (9, 0))


@contextlib.contextmanager
def emulated(order: int = 0):
    """Every variant pairgen builds inside is emulated on the CPU (see the module's docstring)."""
    saved = (runtime.build_variant, runtime.device_info, runtime.variant_of, ORDER[0])
    runtime.clear_caches()
    runtime.build_variant = lambda plan, arch=None: emulated_variant(plan)
    runtime.device_info = lambda index=0: EMULATED_DEVICE
    runtime.variant_of = lambda plan, device_index: emulated_variant(plan)
    ORDER[0] = order
    try:
        yield
    finally:
        runtime.build_variant, runtime.device_info, runtime.variant_of, ORDER[0] = saved
        runtime.clear_caches()
